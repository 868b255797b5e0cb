"""What the ingress keeps of its routing decisions: the strong share served, and recorded traffic.

The strong share is the fraction of a route's requests sent to its strongest tier since this
ingress started, shown next to the route's target (its ``strong_fraction``) so an SRE sees
calibration drift. Recorded traffic goes to ``model_routing.recording`` for tenants that opted in.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleetserve.deployments.ingress.metrics import IngressMetrics
from fleetserve.deployments.ingress.protocol import APIError
from fleetserve.deployments.ingress.security import FrontDoor
from fleetserve.router.model.routes import RouteChoice, RouteTable
from fleetserve.router.model.traffic import TrafficRecorder

# The tenant name recorded when auth is off.
ANONYMOUS = "anonymous"
THUMBS = {"up": 1.0, "down": 0.0}


class FeedbackBody(BaseModel):
    """``POST /v1/feedback``: a score of one response, by the x-request-id the ingress returned."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=200)
    # 0 (bad) to 1 (good); or thumbs.
    score: float | None = Field(default=None, ge=0.0, le=1.0)
    thumbs: str | None = Field(default=None, pattern="^(up|down)$")

    @model_validator(mode="after")
    def _one_score(self) -> FeedbackBody:
        if (self.score is None) == (self.thumbs is None):
            raise ValueError("give exactly one of score (0-1) or thumbs (up|down)")
        return self


class RouteLedger:
    """Counts each route's strong share and records opted-in tenants' routed prompts and feedback.

    Args:
        routes: the routed names this ingress serves.
        metrics: where the strong share and its target are shown.
        front_door: the tenants, whose ``record_routed_prompts`` opts them in; None (auth off) records
            everything as ANONYMOUS when the recording config asks for it.
        executor: the thread that writes records, so file I/O never runs on the event loop.
    """

    def __init__(self, routes: RouteTable, metrics: IngressMetrics, front_door: FrontDoor | None,
                 executor: Executor) -> None:
        self.metrics = metrics
        self._executor = executor
        recording = routes.config.recording
        self.recorder = (TrafficRecorder(recording.directory, recording.max_bytes, recording.num_backups)
                         if recording is not None else None)
        if self.recorder is None:
            self.recording_tenants: set[str] = set()
        elif front_door is not None:
            self.recording_tenants = {name for name, spec in front_door.limiter.tenants.items()
                                      if spec.record_routed_prompts}
        else:
            self.recording_tenants = {ANONYMOUS} if recording.anonymous else set()
        self._counts: dict[str, list[int]] = {}
        for spec in routes.config.routes:
            if spec.strong_fraction is not None:
                metrics.route_strong_share_target.labels(spec.name).set(spec.strong_fraction)

    def records(self, tenant: str | None) -> bool:
        """Whether this caller's routed prompts are recorded."""
        return (tenant or ANONYMOUS) in self.recording_tenants

    async def _write(self, write, *args) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, write, *args)

    async def on_decision(self, choice: RouteChoice, request_id: str, tenant: str | None, text: str) -> None:
        """Counts one routing decision, and records it when the tenant opted in."""
        strongest = choice.model == choice.strongest_model
        counts = self._counts.setdefault(choice.route, [0, 0])
        counts[0] += int(strongest)
        counts[1] += 1
        self.metrics.route_strong_share.labels(choice.route).set(counts[0] / counts[1])
        if self.records(tenant):
            await self._write(self.recorder.record_route, request_id, tenant or ANONYMOUS, choice.route, text,
                              choice.model, choice.tier_index, strongest, choice.win_rate, choice.reason.value)

    async def feedback(self, tenant: str | None, payload: Any) -> dict[str, Any]:
        """Records a feedback body; returns the API's answer.

        Raises:
            APIError: 400 for a malformed body, 403 when the caller's prompts are not recorded.
        """
        try:
            body = FeedbackBody.model_validate(payload)
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join(str(part) for part in first["loc"]) or None
            raise APIError(f"invalid feedback: {first['msg']}", 400, param=param) from None
        if not self.records(tenant):
            where = (f"auth.tenants.{tenant}.record_routed_prompts" if tenant is not None
                     else "model_routing.recording.anonymous")
            raise APIError(f"feedback is recorded only for tenants whose routed prompts are recorded; set {where}",
                           403, "permission_error", code="feedback_not_recorded")
        score = body.score if body.score is not None else THUMBS[body.thumbs]
        await self._write(self.recorder.record_feedback, body.request_id, tenant or ANONYMOUS, score)
        return {"object": "feedback", "request_id": body.request_id, "score": score}
