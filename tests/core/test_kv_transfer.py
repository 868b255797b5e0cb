"""Side-channel port leases: distinct per replica on one node, reclaimed from dead owners."""

import socket
import subprocess
import sys

import pytest

from fleetserve.platform.kv_transfer import (
    PORT_RANGE,
    KVTransferSpec,
    lease_side_channel_ports,
    release_side_channel_ports,
)


@pytest.fixture
def registry(tmp_path):
    return tmp_path / "ports.json"


def test_leases_never_collide_and_skip_ports_in_use(registry):
    first = lease_side_channel_ports(registry=registry)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first + 1))
        second = lease_side_channel_ports(registry=registry)
    # first + 1 was bound by someone else, so the next lease skips it.
    assert second == first + 2
    # A run of 2 for a data-parallel engine: two consecutive free ports after the highest lease.
    assert lease_side_channel_ports(2, registry=registry) == second + 1
    assert PORT_RANGE[0] <= first < PORT_RANGE[1]


def test_concurrent_processes_get_distinct_ports(registry):
    code = ("import sys; from pathlib import Path; from fleetserve.platform.kv_transfer import "
            "lease_side_channel_ports as lease; print(lease(owner_pid=1, registry=Path(sys.argv[1])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(registry)], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    ports = [int(proc.communicate(timeout=60)[0]) for proc in procs]
    assert len(set(ports)) == 6


def test_dead_owner_and_release_free_the_port(registry):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    first = lease_side_channel_ports(owner_pid=dead.pid, registry=registry)
    mine = lease_side_channel_ports(registry=registry)
    release_side_channel_ports(mine, registry=registry)
    # The dead owner's lease is dropped, and the released one too: the next lease starts over.
    assert lease_side_channel_ports(registry=registry) == first


def test_spec_env_and_vllm_config():
    spec = KVTransferSpec(side_channel_host="10.0.0.5", side_channel_port=21000, lease_s=7, progress_delay_us=250)
    assert spec.env() == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5", "VLLM_NIXL_SIDE_CHANNEL_PORT": "21000",
                          "FLEETSERVE_NIXL_PROGRESS_DELAY_US": "250"}
    config = spec.vllm_config()
    assert (config.kv_connector, config.kv_role) == ("NixlConnector", "kv_both")
    assert config.kv_connector_extra_config == {"kv_lease_duration": 7}
