"""A Ray cluster of several nodes on this machine, started the way a user starts one: ``ray start --head``, then
``ray start --address`` for each worker node with its own ``--resources``. Each node is its own raylet with
its own node id; losing one is killing its process group (raylet, workers and engines at once, as when a
machine dies).

The test process stays out of it (it may be a driver of the suite's own cluster): everything is done through
subprocesses and HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fleetserve.loadtest.local_server import free_port

RAY = str(Path(sys.executable).parent / "ray")
# Ray's smallest object store (bytes): the tests move no objects worth storing.
OBJECT_STORE_BYTES = 80 * 1024 * 1024
# Worker ports of this cluster, apart from the range a default cluster on this machine uses (10002-19999).
MIN_WORKER_PORT, MAX_WORKER_PORT = 21000, 21999

_NODES_SCRIPT = """
import json, ray
ray.init(address={address!r}, log_to_driver=False, configure_logging=False)
print(json.dumps([{{"node_id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]}} for n in ray.nodes()]))
"""
_REPLICAS_SCRIPT = """
import json, ray
ray.init(address={address!r}, log_to_driver=False, configure_logging=False)
print(json.dumps(sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                        if actor["name"].startswith("SERVE_REPLICA::"))))
"""


def clean_env() -> dict[str, str]:
    """This process's environment without Ray's variables (a driver's RAY_ADDRESS would redirect children),
    with Ray's token authentication on for nodes and clients alike: a head started with `ray start` turns it
    on once a token file exists (~/.ray/auth_token), and a client that does not send the token is refused."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    return {**env, "RAY_AUTH_MODE": "token"}


@dataclass
class LocalNode:
    """One node: its name in the test, its resources, the ``ray start --block`` process that owns it."""

    name: str
    resources: dict[str, float]
    process: subprocess.Popen
    node_id: str = ""


@dataclass
class LocalCluster:
    """Nodes started with ``ray start`` under one temp dir; ``address`` is the head's GCS."""

    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fsray", dir="/tmp")))
    port: int = field(default_factory=free_port)
    nodes: dict[str, LocalNode] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def port_registry(self) -> Path:
        """The side-channel port leases of this cluster's engines (apart from other clusters on the host)."""
        return self.temp_dir / "side-channel-ports.json"

    def start_node(self, name: str, resources: dict[str, float] | None = None, num_cpus: int = 1,
                   head: bool = False, timeout_s: float = 90) -> LocalNode:
        """Starts a node (the head first) and waits until the cluster lists it alive."""
        known = {node["node_id"] for node in self.list_nodes()} if not head else set()
        where = (["--head", f"--port={self.port}", "--include-dashboard=false", "--disable-usage-stats",
                  f"--temp-dir={self.temp_dir}"] if head else [f"--address={self.address}"])
        command = [RAY, "start", "--block", *where, f"--num-cpus={num_cpus}", "--node-ip-address=127.0.0.1",
                   f"--object-store-memory={OBJECT_STORE_BYTES}", f"--min-worker-port={MIN_WORKER_PORT}",
                   f"--max-worker-port={MAX_WORKER_PORT}", f"--resources={json.dumps(resources or {})}"]
        log = (self.temp_dir / f"ray-start-{name}.log").open("w")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**clean_env(), "FLEETSERVE_PORT_REGISTRY": str(self.port_registry)})
        node = LocalNode(name, resources or {}, process)
        self.nodes[name] = node
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"ray start for node {name} exited: "
                                   f"{(self.temp_dir / f'ray-start-{name}.log').read_text()[-2000:]}")
            alive = [n["node_id"] for n in self.list_nodes(quiet=True) if n["alive"] and n["node_id"] not in known]
            if len(alive) == 1:
                node.node_id = alive[0]
                return node
            time.sleep(1)
        raise RuntimeError(f"node {name} did not join in {timeout_s} s")

    def list_nodes(self, quiet: bool = False) -> list[dict]:
        """Every node the head knows, alive or dead: node_id, alive, resources."""
        return self._driver(_NODES_SCRIPT, [] if quiet else None)

    def serve_replicas(self) -> list[str]:
        """The live Serve replica actors, by name: ``SERVE_REPLICA::<app>#<deployment>#<replica id>``, the id new
        for each replica Serve starts."""
        return self._driver(_REPLICAS_SCRIPT)

    def _driver(self, script: str, on_failure: list | None = None) -> list:
        """What ``script``, run as a driver of this cluster, prints as JSON on its last line; ``on_failure``, if
        given, when it fails."""
        done = subprocess.run([sys.executable, "-c", script.format(address=self.address)],
                              capture_output=True, text=True, env=clean_env(), timeout=60)
        if done.returncode != 0:
            if on_failure is not None:
                return on_failure
            raise RuntimeError(done.stderr[-2000:])
        return json.loads(done.stdout.strip().splitlines()[-1])

    def name_of(self, node_id: str) -> str:
        return next(name for name, node in self.nodes.items() if node.node_id == node_id)

    def kill_node(self, name: str, timeout_s: float = 30) -> None:
        """Loses a node at once: SIGKILL to its raylet, workers and engines (its whole process group); returns
        once none of them is left."""
        os.killpg(self.nodes[name].process.pid, signal.SIGKILL)
        self.nodes[name].process.wait(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.node_processes_left(name) and time.monotonic() < deadline:
            time.sleep(0.2)

    def node_processes_left(self, name: str) -> bool:
        """Whether any process of the node's process group still runs."""
        try:
            os.killpg(self.nodes[name].process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self) -> None:
        """Stops every node, workers first, then the head (killing what does not stop in time), and removes
        the cluster's temp dir."""
        for node in reversed(list(self.nodes.values())):
            if node.process.poll() is None:
                os.killpg(node.process.pid, signal.SIGTERM)
        for node in self.nodes.values():
            try:
                node.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if self.node_processes_left(node.name):
                os.killpg(node.process.pid, signal.SIGKILL)
        if not os.environ.get("FLEETSERVE_KEEP_TEST_CLUSTER"):  # set it to read the nodes' logs after a run
            shutil.rmtree(self.temp_dir, ignore_errors=True)
