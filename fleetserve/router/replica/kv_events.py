"""The engines' own account of their prefix caches: vLLM's KV cache events, indexed for routing.

With ``kv_events_config`` an engine publishes, over ZMQ, each full KV block it stores in its prefix cache
(``BlockStored``: the blocks' hashes, their parent's hash and their token ids) and each block it evicts
(``BlockRemoved``). vLLM's block hashes are seeded per process, so the router cannot compute them; it
chains its own hashes over the token ids the events carry instead, and maps each engine hash to its own.
A prompt's blocks then match exactly what the engine holds, evictions included, where the approximate
index (``prefix_index``) can only guess from what it routed.

Pure Python apart from pyzmq and msgspec (both vLLM dependencies); no Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

from fleetserve.router.replica.prefix_index import PrefixMatch, chained_hashes, num_leading

logger = logging.getLogger(__name__)
# The chain's seed: the hash "before" a prompt's first block.
ROOT_HASH = b""
# Seconds the blocks of a prompt just routed to a replica count as held there before its engine's events
# confirm them: enough for the prefill to run and BlockStored to arrive, so a burst sharing a prefix
# stays together instead of scattering while the first request is still prefilling.
PENDING_TTL_S = 5.0


class AdapterTokens(NamedTuple):
    """A prompt's token ids under a LoRA adapter: its blocks chain from the adapter's own root, as vLLM's block
    hashes include the adapter (the same tokens under another adapter, or none, hold other KV)."""

    # The adapter's served name (vLLM's ``lora_name``, which its events carry).
    adapter: str
    token_ids: Sequence[int]


def adapter_root(adapter: str | None) -> bytes:
    """The chain's seed for prompts under ``adapter``; ROOT_HASH for the base model."""
    return ROOT_HASH if adapter is None else chained_hashes([b"lora:" + adapter.encode()], ROOT_HASH)[0]


def token_block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids`` (a partial last block is
    not cached by vLLM, so it is left out); block i's hash covers blocks 0..i."""
    return chained_hashes((b"".join(int(token).to_bytes(4, "little") for token in token_ids[start:start + block_size])
                           for start in range(0, len(token_ids) - block_size + 1, block_size)), parent)


class KVEventIndex:
    """Which token-block prefixes each replica's engine holds, kept from its KV cache events.

    Args:
        block_size: the engines' KV block size in tokens (vLLM's ``block_size``; 128 on CPU); None until
            a replica reports it, and until then no prompt matches.
        clock: monotonic seconds (tests pass a fake clock).
    """

    def __init__(self, block_size: int | None = None, clock=time.monotonic) -> None:
        if block_size is not None and block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.clock = clock
        self._lock = threading.Lock()
        # replica id -> chain hash -> expiry of a routed, not yet confirmed block
        self._pending: dict[str, dict[bytes, float]] = {}
        # replica id -> engine block hash -> our chain hash
        self._chains: dict[str, dict[Any, bytes]] = {}
        # replica id -> our chain hash -> engine blocks holding it (a prefix can be stored twice)
        self._held: dict[str, Counter[bytes]] = {}
        # Blocks whose parent was never seen (an event missed), which cannot be placed in a chain.
        self.num_orphan_blocks = 0

    def apply(self, replica_id: str, event: Any) -> None:
        """Applies one vLLM KV cache event (``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``)."""
        kind = type(event).__name__
        with self._lock:
            chains = self._chains.setdefault(replica_id, {})
            held = self._held.setdefault(replica_id, Counter())
            if kind == "BlockStored":
                self._store(event, chains, held)
            elif kind == "BlockRemoved":
                for block_hash in event.block_hashes:
                    chain = chains.pop(block_hash, None)
                    if chain is not None:
                        held[chain] -= 1
                        if held[chain] <= 0:
                            del held[chain]
            elif kind == "AllBlocksCleared":
                chains.clear()
                held.clear()

    def _store(self, event: Any, chains: dict[Any, bytes], held: Counter[bytes]) -> None:
        adapter = getattr(event, "lora_name", None)
        if adapter is None and getattr(event, "lora_id", None) is not None:
            return  # an adapter's blocks from an engine that does not name it: no prompt could match them
        if event.parent_block_hash is None:
            parent = adapter_root(adapter)
        elif event.parent_block_hash in chains:
            parent = chains[event.parent_block_hash]
        else:
            self.num_orphan_blocks += len(event.block_hashes)
            return
        ours = token_block_hashes(event.token_ids, event.block_size, parent)
        for block_hash, chain in zip(event.block_hashes, ours, strict=False):
            if block_hash not in chains:
                chains[block_hash] = chain
                held[chain] += 1

    def clear(self, replica_id: str) -> None:
        """Forgets what one replica holds (its event stream had a gap; it refills as the engine stores)."""
        with self._lock:
            self._chains.pop(replica_id, None)
            self._held.pop(replica_id, None)
            self._pending.pop(replica_id, None)

    def hashes(self, key: Sequence[int] | AdapterTokens) -> list[bytes]:
        """A prompt's chained block hashes, to match against replicas (none before the block size is known)."""
        if not self.block_size:
            return []
        if isinstance(key, AdapterTokens):
            return token_block_hashes(key.token_ids, self.block_size, adapter_root(key.adapter))
        return token_block_hashes(key, self.block_size)

    def insert(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        """Counts a prompt just routed to the replica as held there for PENDING_TTL_S, until events confirm."""
        now = self.clock()
        with self._lock:
            pending = self._pending.setdefault(replica_id, {})
            for block_hash in [key for key, expiry in pending.items() if expiry <= now]:
                del pending[block_hash]
            for block_hash in hashes:
                pending[block_hash] = now + PENDING_TTL_S

    def match(self, hashes: Sequence[bytes], replica_ids: Sequence[str]) -> list[PrefixMatch]:
        """For each replica, how many leading blocks of the prompt its engine holds."""
        now = self.clock()
        with self._lock:
            matches = []
            for replica_id in replica_ids:
                held = self._held.get(replica_id, Counter())
                pending = self._pending.get(replica_id, {})
                num_matched = num_leading(hashes, lambda h: h in held or pending.get(h, 0.0) > now)
                matches.append(PrefixMatch(replica_id, num_matched, len(hashes)))
            return matches

    def num_blocks(self, replica_id: str) -> int:
        """Distinct prefix blocks the replica's engine holds."""
        with self._lock:
            return len(self._held.get(replica_id, ()))

    def retain(self, live_replica_ids: Sequence[str]) -> None:
        """Drops replicas that are gone."""
        live = set(live_replica_ids)
        with self._lock:
            for replica_id in [key for key in {*self._chains, *self._pending} if key not in live]:
                self._chains.pop(replica_id, None)
                self._held.pop(replica_id, None)
                self._pending.pop(replica_id, None)


class KVEventSubscriber:
    """Follows replicas' KV event streams (vLLM's ZMQ publisher) in one thread, feeding an index.

    Args:
        index: where events go.
        topic: the publishers' topic (``kv_events_config.topic``).
        poll_ms: how long the thread waits for events before looking at follow/unfollow requests.
    """

    def __init__(self, index: KVEventIndex, topic: str = "", poll_ms: int = 100) -> None:
        import zmq

        self.index = index
        self.topic = topic.encode()
        self.poll_ms = poll_ms
        self._context = zmq.Context.instance()
        self._wanted: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Events applied, and gaps in a replica's sequence numbers (each gap clears that replica).
        self.num_events = 0
        self.num_gaps = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)
        self._thread.start()

    def follow(self, replica_id: str, endpoint: str) -> None:
        """Subscribes to a replica's publisher, e.g. ``tcp://10.0.0.5:21000`` (again on a new endpoint)."""
        with self._lock:
            self._wanted[replica_id] = endpoint

    def followed(self) -> list[str]:
        with self._lock:
            return list(self._wanted)

    def unfollow(self, replica_id: str) -> None:
        with self._lock:
            self._wanted.pop(replica_id, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        poller = zmq.Poller()
        # replica id -> (endpoint, socket, next expected sequence number or None)
        sockets: dict[str, list[Any]] = {}
        while not self._stop.is_set():
            with self._lock:
                wanted = dict(self._wanted)
            for replica_id in [key for key, entry in sockets.items() if wanted.get(key) != entry[0]]:
                poller.unregister(sockets[replica_id][1])
                sockets.pop(replica_id)[1].close(linger=0)
                self.index.clear(replica_id)
            for replica_id, endpoint in wanted.items():
                if replica_id not in sockets:
                    socket = self._context.socket(zmq.SUB)
                    socket.connect(endpoint)
                    socket.setsockopt(zmq.SUBSCRIBE, self.topic)
                    poller.register(socket, zmq.POLLIN)
                    sockets[replica_id] = [endpoint, socket, None]
            by_socket = {entry[1]: replica_id for replica_id, entry in sockets.items()}
            for socket, _ in poller.poll(self.poll_ms):
                replica_id = by_socket[socket]
                _, seq_bytes, payload = socket.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                expected = sockets[replica_id][2]
                if expected is not None and seq != expected:
                    # Missed batches: what the replica holds is unknown until it stores blocks again.
                    self.num_gaps += 1
                    logger.warning("KV events from %s skipped %d batches; forgetting its cache", replica_id,
                                   seq - expected)
                    self.index.clear(replica_id)
                sockets[replica_id][2] = seq + 1
                for event in decoder.decode(payload).events:
                    self.index.apply(replica_id, event)
                    self.num_events += 1
        for _, socket, _ in sockets.values():
            socket.close(linger=0)
