"""An approximate index of which prompt prefixes each replica holds in its KV cache.

The router sees prompt text, not tokens, so prefixes are tracked as a chain of hashes over
fixed-size character blocks: block i's hash covers blocks 0..i, so a match on block i implies the
whole prefix before it matches (the same idea as vLLM's block hashes, on text). Each replica keeps
an LRU set of block hashes bounded by its KV capacity, so old prefixes are forgotten roughly when
the engine would have evicted them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


def chained_hashes(blocks: Iterable[bytes], parent: bytes = b"") -> list[bytes]:
    """Each block's hash chained over every block before it (and ``parent``): a match on block i
    implies the whole prefix before it matches."""
    hashes = []
    for block in blocks:
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(parent)
    return hashes


def num_leading(hashes: Iterable[bytes], holds: Callable[[bytes], bool]) -> int:
    """How many of a prompt's chained hashes are held before the first miss (which ends the prefix)."""
    count = 0
    for block in hashes:
        if not holds(block):
            break
        count += 1
    return count


def block_hashes(text: str, block_chars: int) -> list[bytes]:
    """Chained hashes of the text's full blocks (a trailing partial block is not cacheable)."""
    return chained_hashes(text[start:start + block_chars].encode()
                          for start in range(0, len(text) - block_chars + 1, block_chars))


@dataclass(frozen=True)
class PrefixMatch:
    """How much of a prompt a replica is believed to hold."""

    replica_id: str
    # Leading full blocks of the prompt found in the replica's index.
    num_matched_blocks: int
    # Full blocks in the prompt.
    num_blocks: int

    @property
    def ratio(self) -> float:
        """Matched share of the prompt's blocks, 0-1; 0 for prompts shorter than one block."""
        return self.num_matched_blocks / self.num_blocks if self.num_blocks else 0.0


class PrefixIndex:
    """Per-replica LRU sets of prefix block hashes for one model.

    Args:
        block_chars: characters per block (~4 characters per token: 64 chars ~ a 16-token KV block).
        capacity_blocks: blocks remembered per replica before the least recently used are evicted.
    """

    def __init__(self, block_chars: int = 64, capacity_blocks: int = 4096) -> None:
        if block_chars < 1 or capacity_blocks < 1:
            raise ValueError("block_chars and capacity_blocks must be positive")
        self.block_chars = block_chars
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def hashes(self, text: str) -> list[bytes]:
        return block_hashes(text, self.block_chars)

    def match(self, hashes: list[bytes], replica_ids: Iterable[str]) -> list[PrefixMatch]:
        """The longest cached prefix of ``hashes`` on each replica."""
        matches = []
        for replica_id in replica_ids:
            blocks = self._blocks.get(replica_id, {})
            matches.append(PrefixMatch(replica_id, num_leading(hashes, blocks.__contains__), len(hashes)))
        return matches

    def insert(self, replica_id: str, hashes: list[bytes]) -> None:
        """Records that ``replica_id`` now holds this prefix; evicts its least recently used blocks."""
        blocks = self._blocks.setdefault(replica_id, OrderedDict())
        for block in hashes:
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forgets replicas that no longer exist."""
        keep = set(replica_ids)
        for replica_id in list(self._blocks):
            if replica_id not in keep:
                del self._blocks[replica_id]

    def num_blocks(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))
