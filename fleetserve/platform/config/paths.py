"""The filesystem paths a platform config names: what a pod elsewhere must find at the same place."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from fleetserve.platform.config.platform import PlatformConfig
from fleetserve.platform.lora_store import RANDOM_LORA_PREFIX
from fleetserve.platform.model_store import SourceKind, source_kind
from fleetserve.platform.object_store import is_object_store_uri

# What marks a chat template as inline Jinja rather than a file name.
_JINJA_MARKERS = ("{{", "{%")


@dataclass(frozen=True)
class ConfigPath:
    """One path a platform config names."""

    # Where the config names it, e.g. ``model_routing.checkpoints.mlp``.
    key: str
    # The path as the config holds it (``load_config`` made relative ones absolute, here).
    path: str


def config_paths(config: PlatformConfig) -> list[ConfigPath]:
    """Every file or folder the config names: model, draft, tokenizer and adapter folders, adapter roots, router
    checkpoints, the recording folder, the API keys file and chat template files; packaged ids, Hub ids and inline
    templates are not paths.
    """
    paths = []
    for model in config.models:
        if source_kind(model.source) is SourceKind.PATH:
            paths.append(ConfigPath(f"models[{model.name}].source", model.source))
        draft = model.draft_source
        if draft is not None and source_kind(draft) is SourceKind.PATH:
            paths.append(ConfigPath(f"models[{model.name}].engine_args.speculative_config.model", draft))
        tokenizer = model.engine_args.extra.get("tokenizer")
        if isinstance(tokenizer, str) and source_kind(tokenizer) is SourceKind.PATH:
            paths.append(ConfigPath(f"models[{model.name}].engine_args.extra.tokenizer", tokenizer))
        template = model.api.chat_template
        if template is not None and not any(marker in template for marker in _JINJA_MARKERS):
            paths.append(ConfigPath(f"models[{model.name}].api.chat_template", template))
        for adapter in model.lora.adapters if model.lora is not None else []:
            if not adapter.source.startswith(RANDOM_LORA_PREFIX) and not is_object_store_uri(adapter.source):
                paths.append(ConfigPath(f"models[{model.name}].lora.adapters[{adapter.name}].source", adapter.source))
        root = model.lora.adapter_root if model.lora is not None else None
        if root is not None and not is_object_store_uri(root):
            paths.append(ConfigPath(f"models[{model.name}].lora.adapter_root", root))
    routing = config.model_routing
    if routing is not None:
        paths += [ConfigPath(f"model_routing.checkpoints.{kind}", folder)
                  for kind, folder in routing.checkpoints.items() if not is_object_store_uri(folder)]
        if routing.recording is not None:
            paths.append(ConfigPath("model_routing.recording.directory", routing.recording.directory))
    if config.auth is not None and config.auth.api_keys_file is not None:
        paths.append(ConfigPath("auth.api_keys_file", config.auth.api_keys_file))
    return paths


def outside(paths: list[ConfigPath], mount_paths: list[str]) -> list[ConfigPath]:
    """The paths under none of ``mount_paths`` (relative paths included: a pod's working directory is not the
    config's folder)."""

    def mounted(path: str) -> bool:
        normal = posixpath.normpath(path)
        return any(posixpath.commonpath([normal, posixpath.normpath(mount)]) == posixpath.normpath(mount)
                   for mount in mount_paths if posixpath.isabs(normal))

    return [item for item in paths if not mounted(item.path)]
