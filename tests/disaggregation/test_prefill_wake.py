"""A prefill pool that scales to zero is woken by the decode replica that finds it empty: while it is empty its
decode replicas prefill locally (or refuse), so no prefill would ever reach it and nothing else would start it.
On a fake engine, and through the Serve handle client with a stand-in handle."""

from __future__ import annotations

import asyncio
import json

import pytest

from factories import RecordingHandle
from fleetserve.deployments.disaggregated import decode_server
from fleetserve.deployments.disaggregated.decode_server import DecodeServer, HandlePrefillClient
from fleetserve.platform.api_types import ApiRequest, Endpoint
from fleetserve.platform.config import ModelConfig
from fleetserve.platform.engine import EngineRequestError
from fleetserve.platform.kv_transfer import KVTransferSpec


class EmptyPool:
    """A prefill pool with no running replica, counting the wake calls it gets."""

    def __init__(self) -> None:
        self.num_wakes = 0

    async def prefill(self, request):
        raise AssertionError("an empty pool gets no prefill")

    async def num_running_replicas(self) -> int:
        return 0

    def wake(self) -> None:
        self.num_wakes += 1


def decode(engine_cls, min_replicas: int | None, prefill_pool_empty: str = "prefill_locally") -> DecodeServer:
    scaling = ({"autoscaling": {"policy": "kv_cache", "min_replicas": min_replicas, "max_replicas": 2}}
               if min_replicas is not None else {})
    model = ModelConfig.model_validate({"name": "fake", "source": "unused", "disaggregation": {
        "min_prompt_tokens": 0, "prefill_pool_empty": prefill_pool_empty,
        "prefill": {"replicas": 1, **scaling}, "decode": {"replicas": 1}}})
    return DecodeServer(model.pool_model("decode"), engine_cls=engine_cls, model_path="/unused",
                        kv_transfer=KVTransferSpec(), prefill_client=EmptyPool())


async def status_of(server: DecodeServer, request_id: str) -> int:
    body = json.dumps({"model": "fake", "prompt": "hello there", "max_tokens": 2}).encode()
    chunks = [chunk async for chunk in server.forward(ApiRequest(request_id, Endpoint.COMPLETIONS, body))]
    return chunks[0].head.status_code


@pytest.mark.parametrize(("min_replicas", "num_wakes"), [(0, 2), (1, 0), (None, 0)],
                         ids=["scales-to-zero", "min-one", "fixed"])
async def test_a_prompt_that_finds_the_pool_empty_wakes_it_only_if_it_scales_to_zero(fake_engine_cls, min_replicas,
                                                                                    num_wakes):
    server = decode(fake_engine_cls, min_replicas)
    # Both prompts are prefilled here, and each asks a pool that scales to zero for a replica (the client
    # keeps one wake call outstanding at a time).
    assert [await status_of(server, f"r{i}") for i in range(2)] == [200, 200]
    assert server.prefill_client.num_wakes == num_wakes


async def test_a_pool_that_refuses_while_empty_is_woken_before_the_refusal(fake_engine_cls):
    server = decode(fake_engine_cls, 0, prefill_pool_empty="refuse")
    with pytest.raises(EngineRequestError, match="no running replica"):
        await status_of(server, "refused")
    assert server.prefill_client.num_wakes == 1  # so the client's retry finds a replica on its way


class QueuedCall:
    """A handle call Serve keeps queued: it never answers until cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    def __await__(self):
        return asyncio.Event().wait().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class WakeHandle(RecordingHandle):
    """A prefill deployment's handle whose ``wake`` calls queue."""

    def __init__(self) -> None:
        super().__init__(deployment_name="prefill-fake")
        self.calls: list[QueuedCall] = []
        self.wake = self

    def remote(self) -> QueuedCall:
        self.calls.append(QueuedCall())
        return self.calls[-1]


async def test_the_handle_client_keeps_one_wake_call_queued_and_gives_up_after_its_timeout(monkeypatch):
    monkeypatch.setattr(decode_server, "WAKE_TIMEOUT_S", 0.2)
    handle = WakeHandle()
    client = HandlePrefillClient(handle)
    client.wake()
    client.wake()  # the first call still waits in Serve's queue: no second one
    await asyncio.sleep(0.05)
    assert len(handle.calls) == 1
    await asyncio.sleep(0.3)  # past the timeout: cancelled, and the next prompt may send another
    assert handle.calls[0].cancelled
    client.wake()
    await asyncio.sleep(0.05)
    assert len(handle.calls) == 2
