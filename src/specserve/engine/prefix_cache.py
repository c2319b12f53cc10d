"""Automatic prefix caching: a request starts from the KV of the longest prefix some earlier request computed.

Multi-turn chats resend their whole history and many requests share a system prompt; prefilling those tokens
again costs about 10 ms each on a CPU. So KV outlives its request:

* **Blocks.** A token sequence is cut into blocks of ``block_size`` tokens. Block i's hash chains block i-1's
  hash with block i's tokens (vLLM's scheme), and block 0 starts from the request's cache salt. One hash thus
  names a whole prefix, finding the longest cached prefix is a walk down the prompt's hashes until one is
  unknown, and tenants with different salts never match (nor can they time each other's prompts).
* **Holders.** A slot (one sequence's KV stream) holds what its sequence computed: a finished request's KV
  stays in its slot until the slot is needed, and a running request's prompt can be copied from. A slot about
  to be overwritten is saved, as a ``llama_state_seq_get_data`` blob, to a host-RAM tier (an LRU bounded in
  bytes) when its content would otherwise be lost.
* **Admission** gives a request a free slot already holding its prefix (nothing to move), or copies the
  prefix from the slot or host blob that holds it into an empty or least recently used free slot.

Exactness: a reused token must carry the KV a cold run would compute, or greedy output could change. With a
batch-invariant runtime (and in fast mode, which promises nothing) every computed token qualifies. In capped
exact mode a call's row count changes its rounding, so only prompt chunks computed on the fixed prefill grid
are reusable: the reusable length is rounded down to whole chunks. KV is never moved to other positions.
"""

from __future__ import annotations

import hashlib
import logging
import time
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from specserve.backends.base import ModelRuntime
from specserve.engine.host_memory import map_large_blocks
from specserve.sequence import Sequence

log = logging.getLogger("specserve.prefix_cache")

BLOCK_SIZE = 16


def block_hashes(tokens: Seq[int], salt: str = "", block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The chained hash of each full block of ``tokens``: ``h[i]`` names ``tokens[: (i + 1) * block_size]``"""
    parent = hashlib.blake2b(salt.encode("utf-8"), digest_size=16, person=b"specserve-salt").digest()
    hashes = []
    for lo in range(0, len(tokens) - block_size + 1, block_size):
        block = array("i", tokens[lo : lo + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


def routing_key(block_hash: bytes) -> int:
    """A block hash as a 64-bit int: compact enough for replicas to report thousands to a router."""
    return int.from_bytes(block_hash[:8], "little")


@dataclass
class Holder:
    """KV of a prefix: in a slot (``slot >= 0``) or in a host blob."""

    hashes: list[bytes]
    tokens: list[int]
    """The reusable tokens: the blocks ``hashes`` name, and a partial block after them."""
    slot: int = -1
    blob: bytes = b""
    checksum: int = 0
    positions: int = 0
    """Positions the blob holds (at least ``len(tokens)``)."""
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class CacheHit:
    """Where an admitted request's prefix came from."""

    tokens: int = 0
    source: str = "none"  # "slot" (in place) | "copy" (another slot) | "host" | "none"


@dataclass
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up (vLLM's prefix_cache_queries)."""
    hits: int = 0
    """Prompt tokens found cached (vLLM's prefix_cache_hits)."""
    host_saves: int = 0
    host_drops: int = 0
    """Host blobs dropped because they failed their checksum or did not load."""


class PrefixCache:
    """The index of reusable KV over one runtime's slots and a host-RAM tier."""

    def __init__(
        self,
        runtime: ModelRuntime[Any],
        *,
        host_bytes: int,
        grid: int | None = None,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        """``grid``: in capped exact mode the prefill chunk size, the granularity of reusable KV (None: any
        computed token is reusable). ``host_bytes``: budget of the host tier (0 turns it off)."""
        self.runtime = runtime
        self.block_size = block_size
        self.grid = grid
        self.host_bytes = host_bytes
        if host_bytes > 0:
            map_large_blocks()  # evicted blobs must go back to the OS, not fragment the heap
        self.stats = PrefixCacheStats()
        self._index: dict[bytes, set[int]] = {}
        """Block hash -> ids of the holders that hold that prefix."""
        self._holders: dict[int, Holder] = {}
        self._slot_holder: dict[int, int] = {}
        self._host: OrderedDict[int, None] = OrderedDict()  # host holder ids, least recently used first
        self._next_id = 0
        # Totals kept up to date here, so that gauges read plain ints from another thread.
        self._tokens = {"slot": 0, "host": 0}
        self._host_total_bytes = 0

    # -- admission --------------------------------------------------------------------------------

    def admit(self, seq: Sequence, free_slots: Seq[int]) -> int:
        """Choose ``seq``'s slot among ``free_slots`` (the free slots the scheduler offers: those beside the
        running sequences) and fill it with its longest cached prefix, in place or copied from another slot.

        Sets ``seq.num_computed`` and ``seq.cached_tokens``; returns the slot. The cache never fails a
        request: if admission breaks (a bug), the request runs cold in an emptied slot."""
        try:
            return self._admit(seq, free_slots)
        except Exception:
            log.exception("prefix cache: admission of %s failed; it runs without the cache", seq.request_id)
            slot = free_slots[-1]
            self._forget_slot(slot)
            self.runtime.free(slot)
            seq.num_computed = seq.cached_tokens = 0
            return slot

    def _admit(self, seq: Sequence, free_slots: Seq[int]) -> int:
        prompt = seq.prompt_ids[:-1]  # the last prompt token is evaluated: its logits give the first token
        if seq.params.prompt_logprobs is not None:
            prompt = []  # every prompt position is evaluated for its logprobs: nothing is reused (as in vLLM)
        hashes = block_hashes(prompt, seq.cache_salt, self.block_size)
        depth, found = self._longest(hashes)
        # Past the last whole block, a holder's own tokens extend the match token by token (as a radix tree
        # would): a new turn's prompt rarely ends on a block boundary of the previous one.
        reach = {h: self._extend(self._holders[h].tokens, prompt, depth * self.block_size) for h in found}
        length = max(reach.values(), default=0)
        holders = {h for h, n in reach.items() if n == length}
        free = set(free_slots)
        in_place = [h for h in holders if self._holders[h].slot in free]
        slot = self._holders[in_place[0]].slot if in_place else self._victim(free_slots)
        hit = CacheHit()
        if in_place:
            self._spill(slot, keep=length)
            self.runtime.truncate(slot, length)
            hit = CacheHit(length, "slot")
        else:
            self._spill(slot, keep=0)  # may evict host blobs, candidates among them
            self.runtime.free(slot)
            holders = {h for h in holders if h in self._holders}
            # Copying from a slot is a memcpy; loading a host blob also checks it first.
            for holder_id in sorted(holders, key=lambda h: self._holders[h].slot < 0):
                source = "copy" if self._holders[holder_id].slot >= 0 else "host"
                if self._fill(slot, holder_id, length):
                    hit = CacheHit(length, source)
                    break
        self._forget_slot(slot)
        if hit.tokens:
            self._register_slot(slot, hashes[: hit.tokens // self.block_size], prompt[: hit.tokens])
        seq.num_computed = seq.cached_tokens = hit.tokens
        self.stats.queries += len(seq.prompt_ids)
        self.stats.hits += hit.tokens
        if hit.tokens:
            log.debug("%s reuses %d tokens (%s)", seq.request_id, hit.tokens, hit.source)
        return slot

    def _longest(self, hashes: list[bytes]) -> tuple[int, set[int]]:
        """Depth (blocks) of the longest cached prefix and its holders."""
        depth, holders = 0, set[int]()
        for i, h in enumerate(hashes):
            found = self._index.get(h)
            if not found:
                break
            depth, holders = i + 1, set(found)
        return depth, holders

    @staticmethod
    def _extend(held: list[int], prompt: list[int], start: int) -> int:
        """Length of the common prefix of ``held`` and ``prompt``, known to be at least ``start``."""
        n, limit = start, min(len(held), len(prompt))
        while n < limit and held[n] == prompt[n]:
            n += 1
        return n

    def _victim(self, free_slots: Seq[int]) -> int:
        """An empty free slot, else the one whose cached prefix was used least recently."""
        empty = [s for s in free_slots if s not in self._slot_holder]
        if empty:
            return empty[-1]
        return min(free_slots, key=lambda s: self._holders[self._slot_holder[s]].last_used)

    def _fill(self, slot: int, holder_id: int, length: int) -> bool:
        """Put the first ``length`` positions of a holder's KV into the (empty) ``slot``."""
        holder = self._holders[holder_id]
        holder.last_used = time.monotonic()
        if holder.slot >= 0:
            return self.runtime.copy_sequence(holder.slot, slot, length)
        self._host.move_to_end(holder_id)
        if zlib.crc32(holder.blob) != holder.checksum:
            return self._drop_blob(holder_id, "its checksum does not match (corrupted in memory)")
        loaded = self.runtime.load_sequence(slot, holder.blob)
        if loaded < length:
            self.runtime.free(slot)
            return self._drop_blob(holder_id, f"it loaded {loaded} positions, {holder.positions} expected")
        self.runtime.truncate(slot, length)
        return True

    def _drop_blob(self, holder_id: int, why: str) -> bool:
        log.warning("prefix cache: dropped a host KV blob because %s", why)
        self.stats.host_drops += 1
        self._remove(holder_id)
        return False

    # -- what slots hold --------------------------------------------------------------------------

    def prefilled(self, seq: Sequence) -> None:
        """``seq`` finished its prompt: later requests may copy the reusable part while it runs."""
        self._hold(seq)

    def release(self, seq: Sequence, reusable: bool = True) -> None:
        """``seq`` ended: its KV stays in its slot for later requests (or is freed if none is reusable)."""
        if not (reusable and self._hold(seq)):
            self._forget_slot(seq.slot)
            self.runtime.free(seq.slot)

    def _hold(self, seq: Sequence) -> bool:
        """Register what ``seq``'s slot holds that a later request may reuse (see the module docstring);
        False if that is less than a block."""
        self._forget_slot(seq.slot)
        reusable = seq.num_computed
        if self.grid is not None:
            reusable = min(reusable, len(seq.prompt_ids)) // self.grid * self.grid
        tokens = seq.tokens[:reusable]
        if len(tokens) < self.block_size:
            return False
        self._register_slot(seq.slot, block_hashes(tokens, seq.cache_salt, self.block_size), tokens)
        return True

    def _register_slot(self, slot: int, hashes: list[bytes], tokens: list[int]) -> None:
        self._slot_holder[slot] = self._add(Holder(hashes, tokens, slot=slot))

    def _forget_slot(self, slot: int) -> None:
        holder_id = self._slot_holder.pop(slot, None)
        if holder_id is not None:
            self._remove(holder_id)

    def _spill(self, slot: int, keep: int) -> None:
        """Save the slot's content to the host tier if a block or more past its first ``keep`` tokens would be
        lost and no host blob holds that prefix already."""
        holder_id = self._slot_holder.get(slot)
        if holder_id is None or self.host_bytes <= 0:
            return
        hashes, tokens = self._holders[holder_id].hashes, self._holders[holder_id].tokens
        if len(tokens) - keep < self.block_size:
            return
        if any(
            self._holders[h].slot < 0 and self._holders[h].tokens == tokens for h in self._index[hashes[-1]]
        ):
            return
        blob = self.runtime.save_sequence(slot)
        if blob is None or len(blob) > self.host_bytes:
            return
        while self._host and self.host_tier_bytes() + len(blob) > self.host_bytes:
            self._remove(next(iter(self._host)))
        holder = Holder(
            list(hashes), list(tokens), blob=blob, checksum=zlib.crc32(blob), positions=len(tokens)
        )
        self._host[self._add(holder)] = None
        self.stats.host_saves += 1

    def _add(self, holder: Holder) -> int:
        holder_id, self._next_id = self._next_id, self._next_id + 1
        self._holders[holder_id] = holder
        self._tokens["slot" if holder.slot >= 0 else "host"] += len(holder.tokens)
        self._host_total_bytes += len(holder.blob)
        for h in holder.hashes:
            self._index.setdefault(h, set()).add(holder_id)
        return holder_id

    def _remove(self, holder_id: int) -> None:
        holder = self._holders.pop(holder_id)
        self._host.pop(holder_id, None)
        self._tokens["slot" if holder.slot >= 0 else "host"] -= len(holder.tokens)
        self._host_total_bytes -= len(holder.blob)
        for h in holder.hashes:
            ids = self._index.get(h)
            if ids is not None:
                ids.discard(holder_id)
                if not ids:
                    del self._index[h]

    # -- gauges -----------------------------------------------------------------------------------

    def slot_tier_tokens(self) -> int:
        return self._tokens["slot"]

    def host_tier_tokens(self) -> int:
        return self._tokens["host"]

    def host_tier_bytes(self) -> int:
        return self._host_total_bytes

    def slot_tier_bytes(self) -> int:
        return self.slot_tier_tokens() * self.runtime.info.kv_bytes_per_token

    def host_entries(self) -> list[Holder]:
        """The prefixes kept in host RAM (their blobs), least recently used first."""
        return [self._holders[h] for h in self._host]

    # -- routing ----------------------------------------------------------------------------------

    def held_hashes(self) -> list[bytes]:
        """Every block hash some holder can serve (engine thread only: the index changes under it)."""
        return list(self._index)
