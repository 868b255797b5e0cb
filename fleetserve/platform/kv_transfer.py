"""KV transfer between prefill and decode engines through vLLM's NixlConnector.

Every engine with a connector listens on a side-channel port where peers run the NIXL handshake.
Ports are leased from a node-wide registry (a locked JSON file), so replicas that start together on
one node never pick the same port; a lease whose owner process is gone is reclaimed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetserve.platform.ports import bindable

# vLLM's connector class for each platform connector name.
CONNECTORS = {"nixl": "NixlConnector"}
# Handshake ports are drawn from here, below Linux's default ephemeral range (32768-60999) so the
# OS does not hand them to outgoing connections meanwhile.
PORT_RANGE = (20000, 32000)


@dataclass(frozen=True)
class KVTransferSpec:
    """How one engine joins KV transfer."""

    # Platform connector name (a key of CONNECTORS).
    connector: str = "nixl"
    # Address peers use for the NIXL handshake with this engine.
    side_channel_host: str = "127.0.0.1"
    # The engine's handshake port; vLLM adds the data-parallel index, so one port per DP rank is leased.
    side_channel_port: int = 5600
    # Seconds a prefill engine keeps a finished request's KV for a decode engine that never reads it.
    lease_s: int = 30
    # Pause between polls of NIXL's progress thread; 0 is NIXL's own busy-poll (a core per engine).
    progress_delay_us: int = 500

    def env(self) -> dict[str, str]:
        """Environment the engine's processes read when they start (see fleetserve.platform.nixl_tuning)."""
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": self.side_channel_host,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                "FLEETSERVE_NIXL_PROGRESS_DELAY_US": str(self.progress_delay_us)}

    def vllm_config(self) -> Any:
        """vLLM's ``KVTransferConfig`` for this engine; every engine both sends and receives (kv_both)."""
        from vllm.config import KVTransferConfig

        return KVTransferConfig(kv_connector=CONNECTORS[self.connector], kv_role="kv_both",
                                kv_connector_extra_config={"kv_lease_duration": self.lease_s})


def _registry_path() -> Path:
    return Path(os.environ.get("FLEETSERVE_PORT_REGISTRY",
                               Path(tempfile.gettempdir()) / "fleetserve-side-channel-ports.json"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


@contextlib.contextmanager
def _locked_registry(path: Path) -> Iterator[dict[str, int]]:
    """The registry {port: owner pid} under an exclusive lock, written back on exit; dead owners dropped."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            leases = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):  # a torn or foreign file: start over, live engines re-lease on restart
            leases = {}
        leases = {port: pid for port, pid in leases.items() if _alive(int(pid))}
        yield leases
        path.write_text(json.dumps(leases))


def lease_side_channel_ports(num_ports: int = 1, host: str = "127.0.0.1", owner_pid: int | None = None,
                             registry: Path | None = None) -> int:
    """Leases ``num_ports`` consecutive free ports on this node; returns the first.

    The lease lasts while ``owner_pid`` (default: this process) lives, or until released.

    Raises:
        RuntimeError: no free run of ports is left in PORT_RANGE.
    """
    owner_pid = owner_pid or os.getpid()
    with _locked_registry(registry or _registry_path()) as leases:
        # Start after the highest lease so restarts do not reuse a port a dying engine still holds.
        taken = {int(port) for port in leases}
        start = max(taken, default=PORT_RANGE[0] - 1) + 1
        span = PORT_RANGE[1] - PORT_RANGE[0]
        for offset in range(span):
            first = PORT_RANGE[0] + (start - PORT_RANGE[0] + offset) % span
            ports = range(first, first + num_ports)
            if ports[-1] >= PORT_RANGE[1] or any(port in taken for port in ports):
                continue
            if all(bindable(host, port) for port in ports):
                leases.update({str(port): owner_pid for port in ports})
                return first
    raise RuntimeError(f"no {num_ports} consecutive free side-channel ports in {PORT_RANGE}")


def release_side_channel_ports(first: int, num_ports: int = 1, registry: Path | None = None) -> None:
    """Returns leased ports to the registry."""
    with _locked_registry(registry or _registry_path()) as leases:
        for port in range(first, first + num_ports):
            leases.pop(str(port), None)
