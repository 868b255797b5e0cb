"""OpenAI's Batch API on the platform: where its files live and how fast a batch runs."""

from __future__ import annotations

from pydantic import Field

from fleetserve.platform.config.base import MiB, Strict


class BatchesConfig(Strict):
    """``/v1/files`` and ``/v1/batches``, served by one batch service that runs each batch's requests through the
    platform's own front door, with its submitter's key."""

    # Where uploaded files, batch records and results are kept, relative to the config file; empty: the model
    # cache's `batches` folder (FLEETSERVE_CACHE) on the node the service runs on. In Kubernetes, a volume that
    # outlives the pod.
    folder: str = ""
    # Requests of one batch in flight at once.
    max_concurrency: int = Field(default=16, gt=0)
    # Largest upload to /v1/files, in bytes (other requests keep limits.max_body_bytes).
    max_file_bytes: int = Field(default=200 * MiB, gt=0)
