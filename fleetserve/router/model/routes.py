"""Routed model names: which served model answers a request sent to ``auto`` or ``router-mf-0.3``.

A route has a router, a threshold and tiers (served models, cheapest first). It picks the cheapest
tier that the strongest tier is not predicted to beat: tier i is chosen when
``win_rate(strongest, tier_i) < threshold``. With two tiers this is exactly RouteLLM's rule (strong
when the strong win rate is at or above the threshold); threshold 0 always picks the strongest
tier, threshold 1 always the cheapest.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from fleetserve.platform.config import ModelRoutingConfig
from fleetserve.router.model.quality_router import ROUTER_KINDS, CostQualityRouter, load_router, random_router

_ROUTELLM_NAME = re.compile(r"^router-([^-]+)-(.*)$")


class WinRateRouter(Protocol):
    """What a route needs of a router: the models it knows, and a win rate between two of them."""

    # Which router (random, mf, classifier), for calibration lookups and messages.
    kind: str
    # The models the router scores, weakest first.
    models: list[str]

    def win_rate(self, prompt: str, model_a: str, model_b: str) -> float:
        """P(model_a's answer beats model_b's) on this prompt, 0-1."""
        ...

    @property
    def max_domain_distance(self) -> float | None:
        """Distance from the training prompts beyond which a prompt is out of domain (None: unknown)."""
        ...

    def domain_distance(self, prompt: str) -> float:
        """How far this prompt lies from the router's training prompts."""
        ...


class RouteReason(str, Enum):
    """Why a route picked its tier (the ``x-fleetserve-model-route-reason`` header)."""

    # Threshold 0: the strongest tier, with no win rate computed.
    THRESHOLD_ZERO = "threshold_zero"
    # The strongest tier is not predicted to beat the chosen one.
    BELOW_THRESHOLD = "below_threshold"
    # The strongest tier is predicted to beat every cheaper one.
    STRONGEST_NEEDED = "strongest_needed"
    # The prompt lies beyond the router's domain bound: the route's out_of_domain_tier.
    OUT_OF_DOMAIN = "out_of_domain"


class RouteError(ValueError):
    """A routed model name that does not resolve; the message lists the valid routes."""


@dataclass(frozen=True)
class Route:
    """A resolved routed name."""

    name: str
    router: WinRateRouter
    threshold: float
    # Served model names, cheapest first.
    tiers: tuple[str, ...]
    # The router's model for each tier, same order.
    checkpoint_models: tuple[str, ...]
    # Index of the tier for out-of-domain prompts; None trusts the win rate everywhere.
    out_of_domain_tier: int | None = None


@dataclass(frozen=True)
class RouteChoice:
    """The served model a route picked for one request, and why."""

    route: str
    model: str
    # Index into the route's tiers; the last is the strongest.
    tier_index: int
    # Predicted P(strongest tier beats the chosen one); None when the strongest was chosen at threshold 0.
    win_rate: float | None
    # The strongest tier, for "cost saved against always-strong".
    strongest_model: str
    reason: RouteReason = RouteReason.BELOW_THRESHOLD
    # The prompt's distance from the router's training prompts, when the route measures it.
    domain_distance: float | None = None


def calibrated_threshold(router: CostQualityRouter, strong_fraction: float) -> float:
    """The checkpoint's calibrated threshold for a strong-call share (uniform arithmetic for random).

    Raises:
        RouteError: when that share was never calibrated for this checkpoint.
    """
    if router.kind == "random":
        return 1.0 - strong_fraction  # win rates are uniform on [0, 1)
    for entry in router.metadata.get("calibrations", []):
        if math.isclose(entry["strong_fraction"], strong_fraction, abs_tol=1e-9):
            return float(entry["threshold"])
    known = sorted(entry["strong_fraction"] for entry in router.metadata.get("calibrations", []))
    raise RouteError(f"the {router.kind} checkpoint has no calibration for strong_fraction {strong_fraction} "
                     f"(it has {known}); run `fleetserve router calibrate CHECKPOINT --strong-fraction "
                     f"{strong_fraction}`")


def _map_tiers(router: CostQualityRouter, tiers: list[str], checkpoint_models: list[str] | None,
               where: str) -> tuple[str, ...]:
    if checkpoint_models is not None:
        unknown = [name for name in checkpoint_models if name not in router.models]
        if unknown:
            raise RouteError(f"{where}: checkpoint_models {unknown} are not in the checkpoint ({router.models})")
        return tuple(checkpoint_models)
    if len(tiers) == len(router.models):
        return tuple(router.models)
    if len(tiers) == 2:
        return (router.weak, router.strong)
    raise RouteError(f"{where}: {len(tiers)} tiers but the {router.kind} checkpoint knows {len(router.models)} "
                     f"models {router.models}; set checkpoint_models")


class RouteTable:
    """Every routed name a platform serves: named routes and RouteLLM-style ``router-<router>-<threshold>``.

    Args:
        config: the platform's model_routing section (already validated against the served models).
        routers: router kind -> loaded router; by default loaded from ``config.checkpoints``.
    """

    def __init__(self, config: ModelRoutingConfig, routers: dict[str, CostQualityRouter] | None = None) -> None:
        self.config = config
        if routers is None:
            routers = {kind: load_router(path) for kind, path in config.checkpoints.items()}
        self.routers = dict(routers)
        if "random" not in self.routers:
            self.routers["random"] = random_router(["weak", "strong"])
        self.named: dict[str, Route] = {}
        for spec in config.routes:
            router = self.routers[spec.router]
            tiers = spec.tiers or config.tiers
            threshold = spec.threshold if spec.threshold is not None else calibrated_threshold(
                router, spec.strong_fraction)
            where = f"model_routing.routes[{spec.name}]"
            fallback = None
            if spec.out_of_domain_tier is not None:
                if router.max_domain_distance is None:
                    raise RouteError(f"{where}: out_of_domain_tier needs a checkpoint that keeps its training "
                                     f"inputs; the {router.kind} checkpoint has none (retrain it)")
                fallback = list(tiers).index(spec.out_of_domain_tier)
            self.named[spec.name] = Route(spec.name, router, threshold, tuple(tiers),
                                          _map_tiers(router, tiers, spec.checkpoint_models, where), fallback)

    def names(self) -> list[str]:
        """The named routes, as listed in /v1/models."""
        return list(self.named)

    def valid_routes(self) -> str:
        """A one-line description of every valid routed name, for error messages."""
        named = ", ".join(self.named) or "none"
        if not self.config.tiers:
            return f"named routes: {named}"
        kinds = "|".join(kind for kind in ROUTER_KINDS if kind in self.routers)
        return f"named routes: {named}; or router-<{kinds}>-<threshold in [0, 1]>"

    def is_routed(self, name: str) -> bool:
        """Whether a model name is meant for this table (a named route or any ``router-`` name)."""
        return name in self.named or name.startswith("router-")

    def resolve(self, name: str) -> Route:
        """The route for a routed name.

        Raises:
            RouteError: unknown router, malformed or out-of-range threshold, or no tiers configured.
        """
        if name in self.named:
            return self.named[name]
        match = _ROUTELLM_NAME.match(name)
        if match is None:
            raise RouteError(f"`{name}` is not a route; expected router-<router>-<threshold>. "
                             f"Valid routes: {self.valid_routes()}")
        kind, text = match.groups()
        if kind not in self.routers:
            raise RouteError(f"unknown router `{kind}` in `{name}`. Valid routes: {self.valid_routes()}")
        try:
            threshold = float(text)
        except ValueError:
            threshold = math.nan
        if not 0.0 <= threshold <= 1.0:  # also rejects nan and inf
            raise RouteError(f"malformed threshold `{text}` in `{name}`: expected a number in [0, 1]. "
                             f"Valid routes: {self.valid_routes()}")
        if not self.config.tiers:
            raise RouteError(f"`{name}` needs model_routing.tiers in the platform config. "
                             f"Valid routes: {self.valid_routes()}")
        router = self.routers[kind]
        return Route(name, router, threshold, tuple(self.config.tiers),
                     _map_tiers(router, self.config.tiers, None, "model_routing.tiers"))

    @staticmethod
    def choose(route: Route, text: str) -> RouteChoice:
        """Picks the cheapest tier the strongest is not predicted to beat (may embed: run off the event loop)."""
        top = len(route.tiers) - 1
        strongest = route.checkpoint_models[top]
        distance = None
        if route.out_of_domain_tier is not None:
            distance = route.router.domain_distance(text)
            if distance > route.router.max_domain_distance:
                index = route.out_of_domain_tier
                return RouteChoice(route.name, route.tiers[index], index, None, route.tiers[top],
                                   RouteReason.OUT_OF_DOMAIN, distance)
        if route.threshold <= 0.0:
            return RouteChoice(route.name, route.tiers[top], top, None, route.tiers[top],
                               RouteReason.THRESHOLD_ZERO, distance)
        for index in range(top):
            rate = route.router.win_rate(text, strongest, route.checkpoint_models[index])
            if rate < route.threshold:
                return RouteChoice(route.name, route.tiers[index], index, rate, route.tiers[top],
                                   RouteReason.BELOW_THRESHOLD, distance)
        return RouteChoice(route.name, route.tiers[top], top, rate, route.tiers[top],
                           RouteReason.STRONGEST_NEEDED, distance)


def routing_text(messages: list[dict[str, str]] | None, prompt: str | None, route_on: str) -> str:
    """The text a router reads from a chat or a completion prompt.

    Args:
        route_on: "last_user" (RouteLLM's choice), "all_user", or "all".
    """
    if messages is None:
        return prompt or ""
    if route_on == "all":
        return "\n".join(message["content"] for message in messages)
    user = [message["content"] for message in messages if message["role"] == "user"]
    if route_on == "all_user":
        return "\n".join(user)
    return user[-1] if user else (messages[-1]["content"] if messages else "")
