"""Telling a hung engine from an idle one.

An engine whose kernel or collective hangs neither dies nor errs: vLLM's own health check passes, and every
request on it waits until its progress timeout. What gives it away is time: requests unfinished, and no engine
step for longer than any step takes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class EngineStalledError(RuntimeError):
    """An engine held unfinished requests without finishing a step for longer than its stall timeout."""


@dataclass
class StallWatch:
    """Follows one engine between health checks.

    Args:
        stall_timeout_s: the longest an engine may hold unfinished requests without finishing a step.
    """

    stall_timeout_s: float
    # The last time the engine was seen with nothing unfinished: a step before it says nothing of the
    # requests since, so a stall is counted from the later of the two.
    idle_at: float = field(default_factory=time.time)

    def stalled_for(self, num_unfinished: int, last_step_at: float, now: float) -> float:
        """Seconds the engine has held unfinished requests without a step; 0 while it is idle."""
        if num_unfinished == 0:
            self.idle_at = now
            return 0.0
        return max(0.0, now - max(last_step_at, self.idle_at))

    def check(self, num_unfinished: int, last_step_at: float, now: float) -> None:
        """Checks the engine at a health check.

        Raises:
            EngineStalledError: stalled for longer than ``stall_timeout_s``.
        """
        stalled_s = self.stalled_for(num_unfinished, last_step_at, now)
        if stalled_s > self.stall_timeout_s:
            raise EngineStalledError(f"the engine holds {num_unfinished} unfinished request(s) and has finished no "
                                     f"step for {stalled_s:.0f} s (stall_timeout_s={self.stall_timeout_s:g})")
