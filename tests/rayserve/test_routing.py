"""The Ray Serve pieces that need no cluster: the affinity decision, the metrics merge, the ASGI bridge."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from specserve.engine.prefix_cache import block_hashes, routing_key
from specserve.models import DEFAULT_TARGET, ModelStore
from specserve.rayserve.asgi_bridge import HTTPCall, Part, run_asgi
from specserve.rayserve.front import local_model
from specserve.rayserve.metrics_merge import FrontMetrics, merge_expositions
from specserve.rayserve.router import STEER_BLOCKS, Candidate, affinity_choice, least_loaded

A = [routing_key(h) for h in block_hashes(list(range(64)), "")]  # 4 blocks
B = [routing_key(h) for h in block_hashes(list(range(1000, 1064)), "")]


def test_the_replica_holding_the_deepest_prefix_wins() -> None:
    shallow = Candidate("shallow", set(A[:1]), queue=0)
    deep = Candidate("deep", set(A[:3]), queue=1)
    other = Candidate("other", set(B), queue=0)
    assert affinity_choice(A, [shallow, deep, other], threshold=4) == ["deep"]


def test_ties_are_all_offered_so_the_shorter_queue_takes_it() -> None:
    one, two = Candidate("one", set(A), queue=3), Candidate("two", set(A), queue=0)
    assert affinity_choice(A, [one, two], threshold=4) == ["one", "two"]


def test_no_match_means_no_affinity() -> None:
    assert affinity_choice(A, [Candidate("x", set(B), 0), Candidate("y", set(), 0)], threshold=4) == []
    assert affinity_choice([], [Candidate("x", set(A), 0)], threshold=4) == []


def test_a_hot_prefix_spills_over_when_its_replica_is_too_busy() -> None:
    hot, idle = Candidate("hot", set(A), queue=5), Candidate("idle", set(), queue=0)
    assert affinity_choice(A, [hot, idle], threshold=4) == []
    hot.queue = 4
    assert affinity_choice(A, [hot, idle], threshold=4) == ["hot"]


def test_load_decides_by_queue_then_by_requests_sent_so_equal_replicas_alternate() -> None:
    a, b = Candidate("a", set(), queue=0, routed=3), Candidate("b", set(), queue=0, routed=2)
    assert least_loaded([a, b]) == "b"
    b.queue, b.routed = 1, 0
    assert least_loaded([a, b]) == "a"
    assert least_loaded([]) is None
    sent = {"a": 0, "b": 0}  # requests arriving together: each is counted as sent when it is chosen
    for _ in range(6):
        choice = least_loaded([Candidate(r, set(), queue=0, routed=n) for r, n in sent.items()])
        assert choice is not None
        sent[choice] += 1
    assert sent == {"a": 3, "b": 3}


def test_a_salt_changes_every_hash_so_tenants_never_route_on_each_others_prefixes() -> None:
    salted = [routing_key(h) for h in block_hashes(list(range(64)), "tenant")]
    assert not set(salted) & set(A)
    assert affinity_choice(salted, [Candidate("x", set(A), 0), Candidate("y", set(), 0)], 4) == []


def _exposition(value: float) -> bytes:
    registry = CollectorRegistry()
    Counter("specserve:requests", "Requests.", ("outcome",), registry=registry).labels("success").inc(value)
    return generate_latest(registry)


def test_metrics_of_replicas_are_merged_with_a_replica_label() -> None:
    front = FrontMetrics()
    front.set_replicas(2, 3)
    front.routed([(b"x-specserve-replica", b"r1")])
    text, _ = merge_expositions(front.render(), {"r1": _exposition(2), "r2": _exposition(5)})
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    requests = {
        s.labels["replica"]: s.value
        for s in families["specserve:requests"].samples
        if s.name == "specserve:requests_total"
    }
    assert requests == {"r1": 2.0, "r2": 5.0}
    assert families["specserve:replicas_ready"].samples[0].value == 2.0
    assert families["specserve:replicas_desired"].samples[0].value == 3.0
    relayed = [s for s in families["specserve:front_requests"].samples if s.name.endswith("_total")]
    assert [(s.labels, s.value) for s in relayed] == [({"replica": "r1"}, 1.0)]
    assert text.count(b"# TYPE specserve:requests_total counter") == 1  # one family, not one per replica


def _app(disconnected: asyncio.Event) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"body": (await request.body()).decode(), "id": request.headers["x-request-id"]})

    async def endless(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"data: tick\n\n"
                    await asyncio.sleep(0.01)
            finally:
                disconnected.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/endless", endless)])


def test_a_request_runs_through_the_app_and_comes_back_in_parts() -> None:
    async def go() -> list[Part]:
        call = HTTPCall("POST", "/echo", headers=[(b"x-request-id", b"abc")], body=b"hello")
        return [part async for part in run_asgi(_app(asyncio.Event()), call, [(b"x-replica", b"r9")])]

    parts = asyncio.run(go())
    assert parts[0].start and parts[0].status == 200 and (b"x-replica", b"r9") in parts[0].headers
    assert b"".join(p.body for p in parts[1:]) == b'{"body":"hello","id":"abc"}'
    assert not parts[-1].more


def test_a_caller_that_goes_away_shows_the_app_a_disconnect() -> None:
    async def go() -> bool:
        disconnected = asyncio.Event()
        parts = run_asgi(_app(disconnected), HTTPCall("GET", "/endless"), [])
        assert (await anext(parts)).start
        assert (await anext(parts)).body == b"data: tick\n\n"
        await parts.aclose()  # what cancelling the handle call does on the replica
        await asyncio.wait_for(disconnected.wait(), 5)
        return disconnected.is_set()

    assert asyncio.run(go())


def test_body_messages_waiting_together_travel_as_one_part() -> None:
    async def burst(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            for i in range(50):
                yield f"data: {i}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def go() -> list[Part]:
        parts = []
        async for part in run_asgi(Starlette(routes=[Route("/burst", burst)]), HTTPCall("GET", "/burst"), []):
            parts.append(part)
            await asyncio.sleep(0.05)  # a slow reader: the app's events queue up meanwhile
        return parts

    parts = asyncio.run(go())
    assert b"".join(p.body for p in parts[1:]) == b"".join(f"data: {i}\n\n".encode() for i in range(50))
    assert len(parts) < 20 and not parts[-1].more


def test_the_front_never_pulls_a_model_for_its_vocabulary(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "store")
    assert local_model(store, DEFAULT_TARGET) is None  # absent: no download, routing without affinity
    assert local_model(store, "no-such-model") is None
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert local_model(store, str(gguf)) == gguf
    assert not any((tmp_path / "store").glob("**/*.whl"))


SYSTEM = A[:1]  # a system turn's block, shared by every chat


def test_a_shared_system_prompt_does_not_steer_once_chats_diverge_after_it() -> None:
    """Chat traffic: [system, user] blocks. The replica that saw the system turn first holds it; another
    user went on from it with another block, so the match does not distinguish this request."""
    this_user, other_user = A[1], B[0]
    hashes = [SYSTEM[0], this_user]
    holder, idle = Candidate("holder", set(SYSTEM), queue=1), Candidate("idle", set(), queue=0)
    assert affinity_choice(hashes, [holder, idle], threshold=4) == ["holder"]  # without history: steers
    followers = {SYSTEM[0]: {other_user}}
    assert affinity_choice(hashes, [holder, idle], threshold=4, followers=followers) == []
    # Not even a tie: idle replicas take turns (least_loaded), or one replica would get every chat that
    # arrives after the last one ended (a tie each time).
    resting = Candidate("holder", set(SYSTEM), queue=0)
    assert affinity_choice(hashes, [resting, idle], threshold=4, followers=followers) == []


DOC = [routing_key(h) for h in block_hashes(list(range(5000, 5000 + 16 * (STEER_BLOCKS + 1))), "")]
"""A long document (STEER_BLOCKS blocks) and a question after it."""


def test_a_conversation_follows_its_own_history_and_a_long_document_keeps_its_replica() -> None:
    holder, idle = Candidate("holder", set(A[:3]), queue=0), Candidate("idle", set(), queue=0)
    # The next turn: the match ends where only this conversation went on (A[3] follows A[2]).
    assert affinity_choice(A, [holder, idle], threshold=4, followers={A[2]: {A[3]}}) == ["holder"]
    # ... within the imbalance bound: busy, it still gets the next turn.
    busy = Candidate("holder", set(A[:3]), queue=3)
    assert affinity_choice(A, [busy, idle], threshold=4, followers={A[2]: {A[3]}}) == ["holder"]
    # A long shared document others asked other questions about: its holder while idle, load when busy.
    document = DOC[:STEER_BLOCKS]
    asked = {document[-1]: {B[0]}}
    reader, resting = Candidate("reader", set(document), queue=0), Candidate("resting", set(), queue=0)
    assert affinity_choice(DOC, [reader, resting], threshold=4, followers=asked) == ["reader"]
    reading = Candidate("reader", set(document), queue=1)
    assert affinity_choice(DOC, [reading, resting], threshold=4, followers=asked) == []
    # A shorter shared part (a system turn) never steers.
    assert affinity_choice(A, [holder, idle], threshold=4, followers={A[2]: {B[0]}}) == []
    # The same prompt again: a whole match always steers.
    full = Candidate("full", set(A), queue=0)
    assert affinity_choice(A, [full, idle], threshold=4, followers={A[3]: {B[0]}}) == ["full"]
