"""The Batch API's objects, as OpenAI returns them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class BatchStatus(str, Enum):
    """A batch's lifecycle (OpenAI's names)."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# The statuses of a batch whose requests may still be sent, as records hold them (values: an Enum hashes by name).
ACTIVE = frozenset(status.value for status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING,
                                               BatchStatus.CANCELLING))


@dataclass
class Reply:
    """What the batch service answers the ingress."""

    status_code: int
    # A JSON object, or a file's bytes.
    body: dict[str, Any] | bytes


def file_object(file_id: str, filename: str, purpose: str, num_bytes: int, created_at: int) -> dict[str, Any]:
    """OpenAI's File object."""
    return {"id": file_id, "object": "file", "bytes": num_bytes, "created_at": created_at, "filename": filename,
            "purpose": purpose, "status": "processed", "status_details": None}


def batch_object(batch_id: str, endpoint: str, input_file_id: str, completion_window: str, created_at: int,
                 expires_at: int, num_requests: int, metadata: dict[str, str] | None) -> dict[str, Any]:
    """OpenAI's Batch object for a batch that starts running now (its requests were checked at upload)."""
    return {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
            "completion_window": completion_window, "status": BatchStatus.IN_PROGRESS.value, "output_file_id": None,
            "error_file_id": None, "created_at": created_at, "in_progress_at": created_at, "expires_at": expires_at,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": num_requests, "completed": 0, "failed": 0}, "metadata": metadata}


def list_page(objects: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's list of ``objects``, newest first: ``limit`` of those after the one with id ``after``."""
    ordered = sorted(objects, key=lambda item: (item["created_at"], item["id"]), reverse=True)
    if after is not None:
        ids = [item["id"] for item in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}
