"""Platform config: one YAML file that lists the models to serve, split by concern.

Validated with pydantic. Unknown keys are errors (a typo must not silently fall back to a default), and
every error names the offending key path, e.g. ``models.0.engine_args.dtype``.

* ``base``: strict sections and ``ConfigError``.
* ``engine``: ``EngineArgs`` (vLLM's), ``ApiConfig`` (vLLM's OpenAI server flags), ``Resources``.
* ``autoscaling``: ``AutoscalingConfig`` and ``ReplicaProfile``, shared by the platform and the simulator.
* ``routing``: ``RoutingConfig`` (replicas) and ``ModelRoutingConfig`` (routed model names).
* ``disaggregation``: prefill and decode pools.
* ``lora``: a base model's LoRA adapters and vLLM's LoRA limits.
* ``model``: ``ModelConfig``, one served model.
* ``front_door``: listening address, limits, API keys and tenants.
* ``batches``: OpenAI's Batch API (``BatchesConfig``).
* ``platform``: ``PlatformConfig`` and ``parse_config`` / ``load_config`` / ``default_config``.
* ``paths``: the files and folders a config names, which pods elsewhere must find at the same place.

How Serve runs a config (deployment options) is the serving layer's: ``fleetserve.deployments.serve_options``.
"""

from fleetserve.platform.config.autoscaling import AutoscalingConfig, ReplicaProfile
from fleetserve.platform.config.base import ConfigError, MiB, parse_section, serve_safe
from fleetserve.platform.config.batches import BatchesConfig
from fleetserve.platform.config.disaggregation import POOLS, DisaggregationConfig, PDRatio, PoolConfig
from fleetserve.platform.config.engine import KV_LAYOUT_ARGS, RAY_MIG_RESOURCE_PREFIX, ApiConfig, EngineArgs, Resources
from fleetserve.platform.config.front_door import (APIKeyConfig, AuthConfig, CorsConfig, LimitsConfig, ServerConfig,
                                                   TenantConfig)
from fleetserve.platform.config.lora import LoraAdapter, LoraConfig
from fleetserve.platform.config.model import ModelConfig
from fleetserve.platform.config.platform import PlatformConfig, default_config, load_config, parse_config
from fleetserve.platform.config.routing import ModelRoute, ModelRoutingConfig, RecordingConfig, RoutingConfig

__all__ = ["APIKeyConfig", "ApiConfig", "AuthConfig", "AutoscalingConfig", "BatchesConfig", "ConfigError",
           "DisaggregationConfig", "EngineArgs", "KV_LAYOUT_ARGS", "LimitsConfig", "LoraAdapter", "LoraConfig", "MiB",
           "ModelConfig", "ModelRoute", "ModelRoutingConfig", "RecordingConfig", "CorsConfig", "PDRatio", "POOLS",
           "PlatformConfig", "RAY_MIG_RESOURCE_PREFIX", "PoolConfig", "ReplicaProfile", "Resources", "RoutingConfig",
           "ServerConfig", "TenantConfig", "default_config", "load_config", "parse_config", "parse_section",
           "serve_safe"]
