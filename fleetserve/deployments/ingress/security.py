"""The front door: API keys to tenants, model permissions, and per-tenant rate limits.

Plain classes (no Ray); the ingress calls them before any engine work. Keys are compared by their
sha256 only, so neither the config nor the logs ever hold a key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from fleetserve.deployments.ingress.protocol import RATE_LIMIT_KINDS, APIError
from fleetserve.platform.config import APIKeyConfig, AuthConfig, ConfigError, TenantConfig

logger = logging.getLogger(__name__)

SECONDS_PER_MINUTE = 60.0
# Seconds between checks of the keys file for changes (a Kubernetes Secret update reaches the mount within
# about a minute; this adds at most this much).
KEYS_FILE_CHECK_S = 5.0


def hash_key(key: str) -> str:
    """The sha256 hex digest a key is stored as."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling, once their key checked out."""

    tenant: str
    # May read platform state beyond health (/metrics).
    admin: bool
    # Names the tenant may call; None: every served and routed name.
    models: frozenset[str] | None

    def may_use(self, name: str) -> bool:
        return self.models is None or name in self.models


def _unauthorized(message: str) -> APIError:
    return APIError(message, 401, "invalid_request_error", code="invalid_api_key")


def load_keys_file(path: str | Path) -> list[APIKeyConfig]:
    """Keys from a mounted secret file: a YAML list of {sha256, tenant, admin}.

    Raises:
        ConfigError: the file is unreadable or an entry is invalid.
    """
    try:
        entries = yaml.safe_load(Path(path).read_text()) or []
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"auth.api_keys_file {path}: {error}") from None
    if not isinstance(entries, list):
        raise ConfigError(f"auth.api_keys_file {path}: expected a list of {{sha256, tenant, admin}}")
    try:
        return [APIKeyConfig.model_validate(entry) for entry in entries]
    except ValueError as error:
        raise ConfigError(f"auth.api_keys_file {path}: {error}") from None


def _file_stamp(path: str) -> tuple[int, int, int] | None:
    """What changes when a file is rewritten or swapped (a Kubernetes Secret's mount swaps a symlink)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


class KeyStore:
    """Maps bearer tokens to principals. The keys file, when there is one, is read again within
    KEYS_FILE_CHECK_S of changing, so a key added to or revoked from the mounted secret takes effect
    without a restart.

    Args:
        auth: the auth config.
        clock: monotonic seconds.

    Raises:
        ConfigError: a key in the secret file names an undefined tenant.
    """

    def __init__(self, auth: AuthConfig, clock=time.monotonic) -> None:
        self.auth = auth
        self.clock = clock
        self.tenants: dict[str, TenantConfig] = dict(auth.tenants)
        self._stamp = _file_stamp(auth.api_keys_file) if auth.api_keys_file else None
        self._checked = clock()
        self._keys = self._load()

    def _load(self) -> dict[str, APIKeyConfig]:
        auth = self.auth
        keys = list(auth.api_keys) + (load_keys_file(auth.api_keys_file) if auth.api_keys_file else [])
        unknown = sorted({key.tenant for key in keys} - set(auth.tenants))
        if unknown:
            raise ConfigError(f"auth.api_keys_file names tenants {unknown} that auth.tenants does not define")
        return {key.sha256: key for key in keys}

    def _reload_if_changed(self) -> None:
        path = self.auth.api_keys_file
        now = self.clock()
        if path is None or now - self._checked < KEYS_FILE_CHECK_S:
            return
        self._checked = now
        stamp = _file_stamp(path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._keys = self._load()
        except ConfigError as error:
            # The keys in force stay: an unreadable or half-written secret must not lock every caller out.
            logger.error("API keys file changed but cannot be used; keeping the previous keys: %s", error)
            return
        logger.info("API keys file %s changed: %d keys in force", path, len(self._keys))

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal behind an ``Authorization: Bearer <key>`` header.

        Raises:
            APIError: 401 for a missing, malformed or unknown key.
        """
        self._reload_if_changed()
        if not authorization:
            raise _unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                                "(or 'x-api-key: <key>').")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("Malformed Authorization header; expected 'Bearer <key>'.")
        digest = hash_key(token.strip())
        # Constant-time comparison against each stored hash, so timing tells nothing about near misses.
        match = next((key for stored, key in self._keys.items() if hmac.compare_digest(stored, digest)), None)
        if match is None:
            raise _unauthorized("Incorrect API key provided.")
        models = self.tenants[match.tenant].models
        return Principal(match.tenant, match.admin, None if "*" in models else frozenset(models))


class TokenBucket:
    """A bucket of ``capacity`` that refills at ``rate_per_s``; a take that does not fit takes nothing."""

    def __init__(self, capacity: float, rate_per_s: float, now: float) -> None:
        self.capacity = capacity
        self.rate_per_s = rate_per_s
        self.level = capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
        self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` fits (0 when it fits now); inf when it never can."""
        self._refill(now)
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate_per_s)

    def level_at(self, now: float) -> float:
        """What the bucket holds at ``now``."""
        self._refill(now)
        return self.level

    def take(self, amount: float) -> None:
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


class RateLimiter:
    """Per-tenant request and token budgets per minute (token buckets holding a minute's worth).

    Args:
        tenants: the tenants and their limits.
        clock: monotonic seconds.
        num_parts: ingress replicas sharing each budget: this one enforces an equal part of it.
    """

    def __init__(self, tenants: dict[str, TenantConfig], clock=time.monotonic, num_parts: int = 1) -> None:
        self.tenants = tenants
        self.clock = clock
        self.num_parts = num_parts
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def _bucket(self, tenant: str, kind: str, per_minute: float) -> TokenBucket:
        key = (tenant, kind)
        if key not in self._buckets:
            part = per_minute / self.num_parts
            self._buckets[key] = TokenBucket(part, part / SECONDS_PER_MINUTE, self.clock())
        return self._buckets[key]

    def _limit_text(self, bucket: TokenBucket) -> str:
        if self.num_parts == 1:
            return number_text(bucket.capacity)
        return (f"{number_text(bucket.capacity * self.num_parts)}, {number_text(bucket.capacity)} at each of "
                f"{self.num_parts} ingress replicas")

    def refund(self, tenant: str, num_tokens: int) -> None:
        """Gives back what ``admit`` charged, for a request the platform then refused or failed."""
        spec = self.tenants.get(tenant)
        if spec is None:
            return
        for kind, limit, amount in (("requests", spec.requests_per_minute, 1),
                                    ("tokens", spec.tokens_per_minute, num_tokens)):
            if limit is not None:
                self._bucket(tenant, kind, limit).give_back(amount, self.clock())

    def admit(self, tenant: str, num_tokens: int) -> None:
        """Charges one request and ``num_tokens`` to the tenant, or charges nothing and raises.

        Raises:
            APIError: 429 with a ``Retry-After`` header when either budget is short (and OpenAI's
                ``x-ratelimit-*`` headers).
        """
        spec = self.tenants.get(tenant)
        if spec is None:
            return
        now = self.clock()
        charges = [(self._bucket(tenant, kind, limit), amount, kind) for kind, limit, amount in (
            ("requests", spec.requests_per_minute, 1), ("tokens", spec.tokens_per_minute, num_tokens))
            if limit is not None]
        for bucket, amount, kind in charges:
            wait = bucket.wait_for(amount, now)
            if math.isinf(wait):
                error = APIError(f"This request needs {amount} tokens, more than tenant {tenant!r}'s "
                                 f"{self._limit_text(bucket)} tokens per minute; lower max_tokens or the prompt.",
                                 429, "rate_limit_error", code="rate_limit_exceeded")
                error.headers = self.headers(tenant)
                raise error
            if wait > 0:
                error = APIError(f"Rate limit reached for tenant {tenant!r} on {kind} per minute "
                                 f"(limit {self._limit_text(bucket)}). Retry after {math.ceil(wait)} s.",
                                 429, "rate_limit_error", code="rate_limit_exceeded")
                error.headers = {"Retry-After": str(max(1, math.ceil(wait))), **self.headers(tenant)}
                raise error
        for bucket, amount, _ in charges:
            bucket.take(amount)

    def headers(self, tenant: str) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the tenant's budgets now: the per-minute limit, what is left
        and how long until the bucket is full again. With several ingress replicas each holds an equal part,
        and what is left is this replica's part scaled to the whole (exact when requests spread evenly)."""
        spec = self.tenants.get(tenant)
        if spec is None:
            return {}
        now = self.clock()
        headers = {}
        for kind in RATE_LIMIT_KINDS:
            limit = getattr(spec, f"{kind}_per_minute")
            if limit is None:
                continue
            bucket = self._bucket(tenant, kind, limit)
            level = bucket.level_at(now)
            headers[f"x-ratelimit-limit-{kind}"] = number_text(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level * self.num_parts)))
            headers[f"x-ratelimit-reset-{kind}"] = duration_text((bucket.capacity - level) / bucket.rate_per_s)
        return headers


def number_text(value: float) -> str:
    """A limit as people write it: 1000000, not 1e+06; 12.5 stays 12.5."""
    return f"{value:.12g}" if value < 1e12 else f"{value:.0f}"


def duration_text(seconds: float) -> str:
    """Seconds as OpenAI writes a rate limit's reset: ``20ms``, ``1.5s``, ``6m0s``."""
    millis = max(0, math.ceil(seconds * 1000 - 1e-6))
    if millis < 1000:
        return f"{millis}ms"
    minutes, rest = divmod(millis, 60_000)
    return f"{minutes}m{rest / 1000:g}s" if minutes else f"{rest / 1000:g}s"


def estimated_prompt_tokens(prompt_text: str) -> int:
    """A prompt's tokens before tokenizing: ~4 characters each."""
    return math.ceil(len(prompt_text) / 4)


def estimated_tokens(prompt_text: str, max_tokens: int | None, num_sequences: int = 1,
                     default_max_tokens: int = 256) -> int:
    """What a request is charged at admission: its estimated prompt tokens plus its output budget for each of
    the ``num_sequences`` outputs it asks for (``n``, times a completion's prompts)."""
    budget = max_tokens if max_tokens is not None else default_max_tokens
    return estimated_prompt_tokens(prompt_text) + budget * num_sequences


class FrontDoor:
    """Authentication, permissions and rate limits for one ingress.

    Args:
        auth: the platform's auth config.
        clock: monotonic seconds (tests pass a fake clock).
        num_parts: ingress replicas sharing the tenants' rate limits (``server.num_ingress_replicas``).
    """

    def __init__(self, auth: AuthConfig, clock=time.monotonic, num_parts: int = 1) -> None:
        self.keys = KeyStore(auth, clock)
        self.limiter = RateLimiter(self.keys.tenants, clock, num_parts)
        total_weight = sum(spec.weight for spec in self.keys.tenants.values())
        self._shares = {name: spec.weight / total_weight for name, spec in self.keys.tenants.items()}

    def is_batch(self, tenant: str) -> bool:
        """Whether the tenant's requests are batch work (queued and scheduled after interactive work)."""
        spec = self.limiter.tenants.get(tenant)
        return spec is not None and spec.priority == "batch"

    def share(self, tenant: str) -> float:
        """The tenant's weighted share of a model's admission queue: its weight over all tenants' weights."""
        return self._shares.get(tenant, 1.0)

    def authenticate(self, authorization: str | None) -> Principal:
        return self.keys.authenticate(authorization)

    @staticmethod
    def require_admin(principal: Principal) -> None:
        """Raises a 403 unless the key is an admin key."""
        if not principal.admin:
            raise APIError("This endpoint needs an admin key.", 403, "permission_error", code="admin_required")

    @staticmethod
    def check_model(principal: Principal, name: str) -> None:
        """Raises a 403 when the tenant may not call ``name``."""
        if not principal.may_use(name):
            raise APIError(f"Tenant {principal.tenant!r} may not use the model `{name}`.", 403,
                           "permission_error", param="model", code="model_not_allowed")
