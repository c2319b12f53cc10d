"""Operating a live server: API keys, request ids and JSON request logs, metrics after real requests, the
runtime speculation switch during a stream, and the rate limit.

One server for the module: keys k1 (the tests) and k2 (the rate-limit test only), an admin key, 30 requests
per minute per key, JSON logs captured in its log file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.server.metrics import PREFIX
from support.tiny_models import TinyModels

from .process import ServerProcess, start_server, stop_server

K1 = {"Authorization": "Bearer k1"}
ADMIN = {"Authorization": "Bearer adm"}
MARKER = "def zebra_marker_prompt(self, other):"  # must never appear in the logs
GREEDY = {"prompt": MARKER, "temperature": 0, "max_tokens": 24, "ignore_eos": True}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
T = TypeVar("T")


@pytest.fixture(scope="module")
def ops(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"SPECSERVE_API_KEYS": "k1,k2", "SPECSERVE_ADMIN_KEY": "adm"}
    proc = start_server(
        tiny_models, tmp_path_factory.mktemp("ops"), "--max-running", "2", "--rate-limit-per-minute", "30",
        "--log-format", "json", "--log-level", "info", env=env,
    )  # fmt: skip
    yield proc
    code = stop_server(proc)
    assert code == 0, proc.log()
    assert "Traceback" not in proc.log()


def metrics(server: ServerProcess) -> Samples:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((PREFIX + name, tuple(sorted(labels.items()))), 0.0)


def eventually(read: Callable[[], T], ready: Callable[[T], bool], deadline_s: float = 10.0) -> T:
    """A request's record is written just after its last byte is sent: poll until it shows."""
    deadline = time.monotonic() + deadline_s
    while not ready(result := read()):
        assert time.monotonic() < deadline, "not recorded in time"
        time.sleep(0.05)
    return result


def complete(server: ServerProcess, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, headers={**K1, **headers}, timeout=30)


def log_lines(server: ServerProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in server.log().splitlines() if line.strip()]


def test_api_keys_guard_v1_but_not_health_ready_metrics(ops: ServerProcess) -> None:
    url = ops.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}):
        for response in (
            httpx.post(f"{url}/v1/completions", json=GREEDY, headers=headers),
            httpx.get(f"{url}/v1/models", headers=headers),
        ):
            assert response.status_code == 401, response.text
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/v1/models", headers=K1).status_code == 200
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code == 200
    assert httpx.get(f"{url}/admin/speculation").status_code == 401
    assert httpx.get(f"{url}/admin/speculation", headers=K1).status_code == 403
    assert httpx.get(f"{url}/admin/speculation", headers=ADMIN).json()["enabled"] is True


def test_metrics_after_requests_are_consistent(ops: ServerProcess) -> None:
    before = metrics(ops)
    stats = []
    for stream in (False, True):
        body = {**GREEDY, "stream": stream, "stream_options": {"include_usage": True}} if stream else GREEDY
        response = complete(ops, body)
        assert response.status_code == 200
        if stream:
            events = [json.loads(line[6:]) for line in response.text.splitlines() if line[6:].startswith("{")]
            stats.append(next(e["speculative"] for e in events if "speculative" in e))
        else:
            stats.append(response.json()["speculative"])
    success = value(before, "requests_total", outcome="success") + 2
    after = eventually(
        lambda: metrics(ops), lambda m: value(m, "requests_total", outcome="success") >= success
    )

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    drafts, drafted = delta("spec_decode_num_drafts_total"), delta("spec_decode_num_draft_tokens_total")
    accepted = delta("spec_decode_num_accepted_tokens_total")
    assert drafts == sum(s["num_drafts"] for s in stats) > 0
    assert drafted == sum(s["num_draft_tokens"] for s in stats)
    assert accepted == sum(s["num_accepted_tokens"] for s in stats) <= drafted
    per_pos = sum(delta("spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(64))
    assert per_pos == accepted
    # per drafter: the totals, split by name
    by_name = ("ngram", "suffix", "draft-model", "grammar", "dflash2")
    assert sum(delta("spec_decode_drafter_num_drafts_total", drafter=n) for n in by_name) == drafts
    assert sum(delta("spec_decode_drafter_num_draft_tokens_total", drafter=n) for n in by_name) == drafted
    assert sum(delta("spec_decode_drafter_num_accepted_tokens_total", drafter=n) for n in by_name) == accepted
    mean = 1 + stats[0]["num_accepted_tokens"] / stats[0]["num_drafts"]
    assert mean == pytest.approx(stats[0]["mean_acceptance_length"], abs=1e-3)
    assert delta("requests_total", outcome="success") == 2
    assert delta("request_success_total", finished_reason="length") == 2
    assert delta("generation_tokens_total") == 48
    assert delta("prompt_tokens_total") > 0
    histograms = ("time_to_first_token", "e2e_request_latency", "request_queue_time", "time_per_output_token")
    for histogram in histograms:
        assert delta(f"{histogram}_seconds_count") == 2
    assert delta("draft_time_seconds_count") > 0 and delta("verify_time_seconds_count") > 0
    idle = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "spec_decode_degraded")
    for gauge in (*idle, "drafter_failures_total"):
        assert value(after, gauge) == 0
    assert value(after, "spec_decode_enabled") == 1 and value(after, "spec_decode_draft_length") > 0
    assert after[("process_resident_memory_bytes", ())] > 1e6
    assert after[("engine_process_resident_memory_bytes", ())] > 1e6  # the engine process, models and all


def test_request_ids_and_json_summary_lines(ops: ServerProcess) -> None:
    given = complete(ops, GREEDY, **{"X-Request-ID": "ops-test-given-id"})
    assert given.headers["x-request-id"] == "ops-test-given-id"
    generated = complete(ops, {**GREEDY, "stream": True})
    new_id = generated.headers["x-request-id"]
    assert len(new_id) == 32 and new_id != "ops-test-given-id"
    refused = httpx.post(
        f"{ops.url}/v1/completions", json=GREEDY, headers={"X-Request-ID": "ops-test-refused"}
    )
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "ops-test-refused"

    def summaries_of(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {line["request_id"]: line for line in lines if line["msg"] == "request finished"}

    wanted = {"ops-test-given-id", new_id, "ops-test-refused"}
    lines = eventually(lambda: log_lines(ops), lambda ls: wanted <= set(summaries_of(ls)))
    # every line of the server's output is a JSON object (log_lines parses them all)
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    summaries = summaries_of(lines)
    line = summaries["ops-test-given-id"]
    assert (line["outcome"], line["status"], line["output_tokens"], line["finish_reason"]) == (
        "success", 200, 24, "length",
    )  # fmt: skip
    speculative = given.json()["speculative"]
    assert line["num_drafts"] == speculative["num_drafts"] > 0
    assert line["num_accepted_tokens"] == speculative["num_accepted_tokens"]
    assert line["mean_acceptance_length"] == pytest.approx(speculative["mean_acceptance_length"], abs=1e-3)
    assert sum(line["drafters"].values()) == line["num_drafts"]
    for key in ("prompt_tokens", "first_rejections", "draft_s", "verify_s", "ttft_s", "queue_s", "total_s"):
        assert key in line
    assert summaries[new_id]["stream"] is True and summaries[new_id]["outcome"] == "success"
    assert summaries["ops-test-refused"]["outcome"] == "unauthorized"
    assert "zebra_marker" not in ops.log()  # no prompt text by default
    assert "prompt" not in line and "output" not in line


def test_switch_speculation_off_and_on_during_a_stream(ops: ServerProcess) -> None:
    long = {**GREEDY, "max_tokens": 400}
    plain = complete(ops, {**long, "speculative": {"enabled": False}}).json()["choices"][0]["text"]
    switch = f"{ops.url}/admin/speculation"
    pieces: list[str] = []
    after_switch = 0
    final: dict[str, Any] = {}
    done = False
    with httpx.stream(
        "POST", f"{ops.url}/v1/completions", json={**long, "stream": True}, headers=K1
    ) as stream:
        for line in stream.iter_lines():
            done = done or line == "data: [DONE]"
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            pieces.append(event["choices"][0]["text"])
            final = event
            if len(pieces) == 3:
                off = httpx.post(switch, json={"enabled": False}, headers=ADMIN)
                assert off.status_code == 200 and off.json()["enabled"] is False
            elif len(pieces) > 3:
                after_switch += 1
    try:
        assert done
        assert after_switch > 0, "the stream ended before the switch"
        assert "".join(pieces) == plain  # lossless across the switch
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["speculative"]["num_drafts"] > 0  # drafted before the switch
        assert complete(ops, GREEDY).json()["speculative"]["num_drafts"] == 0
        assert value(metrics(ops), "spec_decode_enabled") == 0
        state = httpx.get(switch, headers=ADMIN).json()
        assert state["enabled"] is False and state["active"] is False
    finally:
        on = httpx.post(switch, json={"enabled": True}, headers=ADMIN)
    assert on.status_code == 200 and on.json()["enabled"] is True
    assert complete(ops, GREEDY).json()["speculative"]["num_drafts"] > 0
    bad = httpx.post(switch, json={"enabled": "maybe"}, headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "enabled"


def test_rate_limit_per_key(ops: ServerProcess) -> None:
    k2 = {"Authorization": "Bearer k2"}
    before = value(metrics(ops), "requests_total", outcome="rejected_429")
    tiny = {"prompt": "x", "max_tokens": 1}
    served = 0
    while (refused := httpx.post(f"{ops.url}/v1/completions", json=tiny, headers=k2)).status_code == 200:
        served += 1
        assert served <= 40, "never limited"
    assert served >= 30  # a burst of 30 per key (more if a refill comes while they run)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    eventually(
        lambda: metrics(ops), lambda m: value(m, "requests_total", outcome="rejected_429") == before + 1
    )
    assert httpx.get(f"{ops.url}/v1/models", headers=K1).status_code == 200  # other keys unaffected
