"""Prefix-affinity routing on the prefix cache's own block hashes (a Serve ``RequestRouter``).

Each replica reports the hashes of the blocks its prefix cache can serve (``record_routing_stats``); the
front puts the chained block hashes of a request's prompt tokens (same tokenizer, same cache salt) on the
call. Because block i's hash names the whole prefix up to block i, the deepest of the request's hashes that
a replica holds is exactly how many prompt blocks it would not have to prefill — no character-level
approximation. Between two stats reports, hashes routed to a replica count as held by it (by every replica
they went to), so the second request of a conversation follows the first before the cache has reported
anything.

A match steers a request as far as it distinguishes it. Chat traffic shares its first blocks (the
template's system turn, a few-shot header, a long document) and then goes separate ways: a match that ends
exactly where earlier requests went another way is a prefix many requests share. Following it within the
usual imbalance bound would send every chat to whichever replica saw the system prompt first (issue 20:
20 of 20). So such a match never outweighs load: a short one (under ``STEER_BLOCKS`` blocks, a system turn:
prefilling it again elsewhere costs little) is ignored, and a long one (a document many questions are
asked about) only breaks ties, its holder chosen while it is among the least busy replicas; under load the
others get requests, compute the shared part once, hold it too, and share the traffic. A match that runs on
into the request's own history (the next turn of a conversation) steers within the imbalance bound, as
SGLang's router follows its cache above a ``cache_threshold`` and balances otherwise.

Load stays balanced: the best-matching replica is chosen only while its queue is at most
``imbalanced_threshold`` requests longer than the shortest; otherwise (and without a match) the least loaded
replica is offered first, then two random ones (Serve takes the one with the shorter queue). A replica's
load is the longer of Serve's cached queue length and the requests this router has sent it that have not
completed, counted from the moment of choice: requests that arrive together are routed before any of them
reaches Serve's cache, and a coin toss between "equally idle" replicas sent a quarter or more of a burst to
the wrong one. Equal loads go to the replica this router has sent fewer requests, so they alternate. A call
pinned to a replica (admin broadcast, metrics collection) goes there and nowhere else.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Collection, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from specserve import rayserve
from specserve.rayserve.asgi_bridge import HTTPCall

RECENT_HASHES = 65536
"""Hashes remembered from routing decisions not yet confirmed by a stats report (and their followers)."""
STEER_BLOCKS = 16
"""A prefix many requests share steers (breaks ties) only from this many blocks (256 tokens) on."""
IN_FLIGHT_EXPIRY_S = 600.0
"""A request counted in flight this long is forgotten (one chosen but never sent would otherwise count on)."""


def _call_of(request: PendingRequest | None) -> HTTPCall | None:
    if request is None or not request.args or not isinstance(request.args[0], HTTPCall):
        return None
    return request.args[0]


@dataclass
class Candidate:
    """A replica as the routing decision sees it."""

    replica: str
    held: Container[int]
    """Block hashes its prefix cache reported, plus those routed to it since."""
    queue: int
    """Requests it is serving or queueing (Serve's cached count or, when longer, this router's own)."""
    routed: int = 0
    """Requests this router has sent it so far (ties in load go to the fewest)."""


def affinity_choice(
    hashes: Sequence[int],
    candidates: Sequence[Candidate],
    threshold: int,
    followers: Mapping[int, Collection[int]] | None = None,
) -> list[str]:
    """The replicas holding the deepest prefix of ``hashes`` (ties all listed: Serve then takes the one with
    the shortest queue), or ``[]``: no replica holds any of it, or the best is busier than the least busy
    replica by more than ``threshold`` requests. A shared prefix (the match ends where an earlier request
    went on with another block, per ``followers``) steers only from ``STEER_BLOCKS`` blocks on, and then
    only while its holder is among the least busy.

    Example: ``hashes = [s, u]`` (a system block, then this user's), a replica holding ``s``, an idle one,
    and ``followers[s] = {v}`` (another user went on from ``s``): ``[]``, load decides. Without ``v`` (``u``
    is where this conversation went before): the holder, unless it is busier by more than ``threshold``.
    """
    best: list[Candidate] = []
    best_depth = 0
    for candidate in candidates:
        for depth in range(len(hashes), best_depth - 1, -1):
            if depth == 0:
                break
            if hashes[depth - 1] in candidate.held:
                if depth > best_depth:
                    best, best_depth = [], depth
                best.append(candidate)
                break
    if _shared_prefix(hashes, best_depth, followers):
        if best_depth < STEER_BLOCKS:
            return []  # a system turn: load decides
        threshold = 0  # a long shared document: it breaks ties
    least_busy = min((c.queue for c in candidates), default=0)
    return [c.replica for c in best if c.queue - least_busy <= threshold]


def least_loaded(candidates: Sequence[Candidate]) -> str | None:
    """The replica for a request that load decides: the shortest queue, then the fewest requests sent.

    Example: queues (0, 0), sent (3, 2): the second; queues (1, 0), sent (0, 9): the second."""
    best = min(candidates, key=lambda c: (c.queue, c.routed), default=None)
    return None if best is None else best.replica


def _shared_prefix(
    hashes: Sequence[int], depth: int, followers: Mapping[int, Collection[int]] | None
) -> bool:
    """Whether the first ``depth`` blocks of ``hashes`` end where an earlier request went on with another
    block than this one does (a prefix requests share, not this request's own history)."""
    if followers is None or not 0 < depth < len(hashes):
        return False
    return any(h != hashes[depth] for h in followers.get(hashes[depth - 1], ()))


class _Held:
    """A replica's reported hashes as a set, plus the hashes routed to it since (a Container)."""

    def __init__(
        self, reported: frozenset[int], recent: Mapping[int, Collection[ReplicaID]], replica: ReplicaID
    ) -> None:
        self.reported, self.recent, self.replica = reported, recent, replica

    def __contains__(self, h: object) -> bool:
        return h in self.reported or self.replica in self.recent.get(h, ())  # type: ignore[call-overload]


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes to the replica holding the longest prompt prefix, within a load-imbalance bound."""

    def initialize_state(self, imbalanced_threshold: int = 4, **_: Any) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self._recent: OrderedDict[int, set[ReplicaID]] = OrderedDict()  # every replica a block went to
        self._followers: OrderedDict[int, set[int]] = OrderedDict()  # up to 2 next blocks seen per block
        self._reported: dict[ReplicaID, tuple[list[int], frozenset[int]]] = {}  # last report, as a set
        self._in_flight: dict[str, tuple[ReplicaID, float]] = {}  # request -> (replica, since), to completion
        self._sent: Counter[ReplicaID] = Counter()
        # Through the package: Serve ships this class by value, with copies of this module's globals.
        rayserve.ROUTERS.add(self)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        call = _call_of(pending_request)
        if call is not None and call.pin is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == call.pin]
            return [pinned] if pinned else []
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        if call is None or len(candidate_replicas) < 2:
            return [two]
        lengths = self.replica_queue_len_cache
        in_flight = self._in_flight_counts()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = [
            Candidate(
                r.replica_id.unique_id,
                _Held(self._reported_by(r), self._recent, r.replica_id),
                max(lengths.get(r.replica_id) or 0, in_flight[r.replica_id]),
                self._sent[r.replica_id],
            )
            for r in candidate_replicas
        ]
        # Which block follows which does not depend on where this request goes: known at once, so that
        # requests arriving together already see each other diverge after their shared prefix.
        self._note_followers(call.block_hashes)
        chosen = affinity_choice(call.block_hashes, candidates, self.imbalanced_threshold, self._followers)
        load = {c.replica: (c.queue, c.routed) for c in candidates}
        chosen = sorted(chosen, key=load.__getitem__) or [least_loaded(candidates) or candidates[0].replica]
        if pending_request is not None:  # counted from now: the next request may be chosen before it is sent
            self._count(pending_request.metadata.internal_request_id, by_id[chosen[0]].replica_id)
        return [[by_id[c] for c in chosen], two]

    def _count(self, request: str, replica: ReplicaID) -> None:
        """``request`` is in flight on ``replica`` (moved there if it was counted elsewhere)."""
        before = self._in_flight.get(request)
        if before is not None and before[0] == replica:
            return
        if before is not None:
            self._sent[before[0]] -= 1
        self._in_flight[request] = (replica, time.monotonic())
        self._sent[replica] += 1

    def _in_flight_counts(self) -> Counter[ReplicaID]:
        expired = time.monotonic() - IN_FLIGHT_EXPIRY_S
        for request in [q for q, (_, since) in self._in_flight.items() if since < expired]:
            del self._in_flight[request]
        return Counter(replica for replica, _ in self._in_flight.values())

    def _reported_by(self, replica: RunningReplica) -> frozenset[int]:
        reported = replica.routing_stats.get("block_hashes") or []
        cached = self._reported.get(replica.replica_id)
        if cached is None or cached[0] is not reported:
            cached = (reported, frozenset(reported))
            self._reported[replica.replica_id] = cached
        return cached[1]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        call = _call_of(pending_request)
        if call is None or call.pin is not None:
            return
        self._count(pending_request.metadata.internal_request_id, replica_id)  # where it really went
        for h in call.block_hashes:
            self._recent.setdefault(h, set()).add(replica_id)
            self._recent.move_to_end(h)
        while len(self._recent) > RECENT_HASHES:
            self._recent.popitem(last=False)

    def _note_followers(self, hashes: Sequence[int]) -> None:
        for h, following in itertools.pairwise(hashes):
            seen = self._followers.setdefault(h, set())
            if len(seen) < 2:  # two tell "others went elsewhere" from "only this way"
                seen.add(following)
            self._followers.move_to_end(h)
        while len(self._followers) > RECENT_HASHES:
            self._followers.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._reported.pop(replica_id, None)
        for h, replicas in list(self._recent.items()):
            replicas.discard(replica_id)
            if not replicas:
                del self._recent[h]
        for request in [q for q, (r, _) in self._in_flight.items() if r == replica_id]:
            del self._in_flight[request]
        self._sent.pop(replica_id, None)
