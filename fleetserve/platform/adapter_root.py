"""Adapters under a base model's ``lora.adapter_root``: each subfolder serves as ``<base>:<folder>`` (Ray Serve
LLM's naming), loaded by each replica the first time it serves one, as Serve's model multiplexing loads models."""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath

from fleetserve.platform.object_store import ObjectStoreError, filesystem

# Between the base model's name and the folder's; model and adapter names in a config never hold it.
SEPARATOR = ":"
# The file that makes a subfolder an adapter (PEFT's).
MARKER = "adapter_config.json"
# A subfolder name: one path part, not hidden ("..", ".cache"), in the characters model names take.
_FOLDER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


class AdapterNameError(ValueError):
    """A ``<base>:<folder>`` name whose folder part is no folder name; the message says what is expected."""


def root_folder(name: str, base: str) -> str | None:
    """The folder ``name`` names under ``base``'s adapter root; None when ``name`` is not ``<base>:...``.

    Raises:
        AdapterNameError: the part after ``:`` is a path or hidden.
    """
    prefix = f"{base}{SEPARATOR}"
    if not name.startswith(prefix):
        return None
    folder = name[len(prefix):]
    if not _FOLDER_NAME.fullmatch(folder):
        raise AdapterNameError(f"`{name}`: `{folder}` is no adapter folder name under the adapter root of `{base}` "
                               f"(letters, digits, `.`, `_` and `-`, not starting with `.`)")
    return folder


def list_folders(root: str) -> list[str]:
    """The adapter folders under ``root``, sorted: its subfolders that hold an ``adapter_config.json`` and whose
    names ``root_folder`` accepts. A local root that does not exist here holds none.

    Raises:
        ObjectStoreError: the store cannot be listed (its package missing, credentials, network).
    """
    fs, path = filesystem(root)
    fs.invalidate_cache(path)  # a listing cached by this process would hide adapters added since
    try:
        found = fs.glob(f"{path}/*/{MARKER}")
    except Exception as error:  # noqa: BLE001 - credentials, permissions and network errors differ per store
        raise ObjectStoreError(f"could not list {root}: {type(error).__name__}: {error}") from None
    folders = {PurePosixPath(match).parent.name for match in found}
    return sorted(folder for folder in folders if _FOLDER_NAME.fullmatch(folder))


def holds_adapter(root: str, folder: str) -> bool:
    """Whether ``folder`` of ``root`` holds an ``adapter_config.json`` (one check of the store, not a listing).

    Raises:
        ObjectStoreError: the store cannot be read (its package missing, credentials, network).
    """
    fs, path = filesystem(root)
    marker = f"{path}/{folder}/{MARKER}"
    fs.invalidate_cache(marker)
    try:
        return bool(fs.exists(marker))
    except Exception as error:  # noqa: BLE001 - as list_folders
        raise ObjectStoreError(f"could not read {root}/{folder}: {type(error).__name__}: {error}") from None


def root_source(root: str, folder: str) -> str:
    """Where the adapter in ``folder`` of ``root`` is loaded from."""
    return f"{root.rstrip('/')}/{folder}"


def load_error(name: str, status: int, body: bytes) -> bytes:
    """OpenAI error JSON for a request whose adapter could not be loaded: a missing folder is a model that does not
    exist (404); anything else keeps the load's status, naming the model."""
    try:
        reason = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        reason = body.decode(errors="replace")
    if status == 404:
        error = {"message": f"The model `{name}` does not exist: {reason}", "type": "not_found_error",
                 "param": "model", "code": "model_not_found"}
    else:
        error = {"message": f"The adapter `{name}` cannot be served: {reason}", "type": "invalid_request_error",
                 "param": "model", "code": "invalid_adapter"}
    return json.dumps({"error": error}).encode()
