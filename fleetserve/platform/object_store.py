"""Model and adapter folders in object storage (``s3://``, ``gs://``, ``az://``), copied to a local snapshot that
vLLM then loads, as Ray Serve LLM's cloud mirror does for its model sources.

Files are listed and fetched through fsspec (s3fs for S3, gcsfs for Google Cloud Storage, adlfs for Azure) with
each store's usual credentials: the ``AWS_*`` environment or an instance role, ``GOOGLE_APPLICATION_CREDENTIALS``,
``AZURE_STORAGE_*``. An S3-compatible store (MinIO, Ceph) is named by ``AWS_ENDPOINT_URL``. A snapshot is keyed
by its listing (each file's name, size and ETag or generation), so a folder replaced in place is fetched afresh
and an unchanged one never twice.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
# The fsspec package each URI scheme needs.
SCHEME_PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
# What a listing's entry says about a file's version, per store (S3's ETag, GCS's generation, Azure's etag).
_VERSION_KEYS = ("ETag", "etag", "generation", "LastModified", "last_modified", "mtime")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class ObjectStoreError(ValueError):
    """A folder in object storage that cannot be fetched; the message says why.

    Args:
        missing: the folder, or the file that marks it, does not exist (rather than an unreadable store).
    """

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing

    def __reduce__(self):  # survives pickling with its kind
        return (ObjectStoreError, (str(self), self.missing))


def is_object_store_uri(source: str) -> bool:
    """Whether ``source`` names a folder in object storage (``s3://bucket/prefix`` and the like)."""
    scheme, separator, rest = source.partition("://")
    return bool(separator) and scheme in SCHEME_PACKAGES and bool(rest.strip("/"))


def snapshot(uri: str, patterns: tuple[str, ...], marker: str, cache: Path) -> Path:
    """A local copy of the files under ``uri`` whose paths match ``patterns``, fetched once per version.

    Args:
        uri: the folder, e.g. ``s3://models/llama-3-8b-ft``.
        patterns: fnmatch patterns on paths relative to ``uri``; other files are not fetched.
        marker: the file the folder must hold (``config.json``, ``adapter_config.json``).
        cache: the folder snapshots are kept under.

    Raises:
        ObjectStoreError: the store's package is missing, the store cannot be read, or the folder lacks ``marker``
            (``missing``).
    """
    from fleetserve.platform.model_store import atomic_folder

    fs, root = filesystem(uri)
    files = _listing(fs, root, uri, patterns)
    if marker not in files:
        raise ObjectStoreError(f"{uri} holds no {marker}" + ("" if files else " (nothing at that prefix)"),
                               missing=True)
    digest = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:16]
    final = cache / "object-store" / _UNSAFE.sub("_", uri.rstrip("/")) / digest
    if (final / marker).exists():
        return final
    num_mib = sum(size or 0 for size, _ in files.values()) / 2**20
    logger.info("fetching %s: %d files, %.1f MiB, into %s", uri, len(files), num_mib, final)
    started = time.monotonic()
    with atomic_folder(final, marker=marker) as scratch:
        _fetch(fs, root, uri, sorted(files), scratch)
    seconds = time.monotonic() - started
    logger.info("fetched %s in %.1f s (%.1f MiB/s)", uri, seconds, num_mib / max(seconds, 1e-3))
    return final


def filesystem(uri: str) -> tuple[Any, str]:
    """The fsspec filesystem that reads ``uri`` (a local path too), and the path within it.

    Raises:
        ObjectStoreError: the store's package is not installed.
    """
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(uri)
    except ImportError:
        package = SCHEME_PACKAGES[uri.partition("://")[0]]
        raise ObjectStoreError(f"{uri}: reading this store needs the {package} package (pip install {package})"
                               ) from None
    return fs, root.rstrip("/")


def _listing(fs: Any, root: str, uri: str, patterns: tuple[str, ...]) -> dict[str, list[Any]]:
    """Relative path -> [size, version] of the files under ``root`` that match ``patterns``."""
    fs.invalidate_cache(root)  # a listing cached by this process would hide a folder replaced since
    try:
        entries = fs.find(root, detail=True)
    except Exception as error:  # noqa: BLE001 - credentials, permissions and network errors differ per store
        raise ObjectStoreError(f"could not list {uri}: {type(error).__name__}: {error}") from None
    files = {}
    for path, info in entries.items():
        relative = path[len(root):].lstrip("/")
        if info.get("type") == "file" and any(fnmatch.fnmatch(relative, pattern) for pattern in patterns):
            version = next((str(info[key]) for key in _VERSION_KEYS if info.get(key) is not None), "")
            files[relative] = [info.get("size"), version]
    return files


def _fetch(fs: Any, root: str, uri: str, relatives: list[str], out: Path) -> None:
    """Fetches the files in one call: fsspec's async stores (s3fs, gcsfs, adlfs) then fetch them concurrently,
    which is what makes a sharded checkpoint quick to copy."""
    for relative in relatives:
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
    try:
        fs.get([f"{root}/{relative}" for relative in relatives], [str(out / relative) for relative in relatives])
    except Exception as error:  # noqa: BLE001 - as in _listing
        raise ObjectStoreError(f"could not fetch {uri}: {type(error).__name__}: {error}") from None
