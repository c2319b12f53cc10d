"""The load generator's pure parts: URLs, metrics parsing, report arithmetic."""

from __future__ import annotations

import pytest

from specserve.tools.loadgen.bench import compare_targets
from specserve.tools.loadgen.client import RequestParams, RequestResult, chat_body, normalize_base_url
from specserve.tools.loadgen.report import cell_record
from specserve.tools.loadgen.runner import CellRun
from specserve.tools.loadgen.server_metrics import parse_spec_counters
from specserve.tools.workloads import ToolInputError


def test_base_url_normalisation() -> None:
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("https://h") == "https://h"
    with pytest.raises(ToolInputError):
        normalize_base_url("h:1")


def test_prometheus_counters_are_summed_by_name_and_position() -> None:
    text = """# HELP x
specserve:spec_decode_num_drafts_total 10.0
specserve:spec_decode_num_draft_tokens_total 40.0
specserve:spec_decode_num_accepted_tokens_total 25.0
specserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0
specserve:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 7.0
vllm:spec_decode_num_drafts_total{model_name="m",engine="1"} 5.0
other_metric 3
"""
    counters = parse_spec_counters(text)
    assert counters is not None
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (15, 40, 25)
    assert counters.per_position() == [9, 0, 7]
    before = parse_spec_counters('x:spec_decode_num_accepted_tokens_per_pos{position="0"} 4\n')
    assert before is not None and counters.minus(before).per_position() == [5, 0, 7]
    assert parse_spec_counters("process_cpu_seconds_total 1.0\n") is None


def test_cell_record_percentiles_and_sums() -> None:
    results = []
    for i in range(4):
        r = RequestResult("on", 0.0, ttft=0.1 * (i + 1), latency=1.0 + 0.1 * i, output_tokens=11)
        r.chunk_times = [0.1 * (i + 1), 0.5, 0.9]
        r.speculative = {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 4}
        results.append(r)
    results.append(RequestResult("on", 0.0, error="HTTP 500: boom"))
    record = cell_record(CellRun(results, seconds=2.0))
    assert (record["requests"], record["errors"], record["output_tokens"]) == (5, 1, 44)
    assert record["ttft_p50"] == pytest.approx(250.0)
    assert record["throughput_tokens_per_second"] == pytest.approx(22.0)
    assert record["acceptance_rate"] == 0.5 and record["mean_acceptance_length"] == 3.0  # 1 + 16 / 8
    assert record["accepted_per_position"] is None and record["speculation_source"] == "responses"
    # tokens/s = (output_tokens - 1) / (latency - ttft) = 10 / 0.9 for every request here
    assert record["tokens_per_second_p50"] == pytest.approx(10 / 0.9, rel=1e-3)
    assert record["itl_p50"] == pytest.approx(400.0)
    assert record["error_messages"] == ["HTTP 500: boom"]


def test_speculation_on_and_off_are_two_tenants_of_one_run() -> None:
    # The modes take turns on the same prompts: as one tenant, `on` copied `off`'s greedy answer from the
    # suffix drafter's cache (acceptance 100 % on a workload nothing else repeats).
    on, off = compare_targets("http://h:1", "m", {"enabled": True})
    salts = {chat_body(t, "hi", RequestParams())["cache_salt"] for t in (on, off)}
    assert len(salts) == 2 and all(salts)
    (again, _) = compare_targets("http://h:1", "m", {"enabled": True})
    assert again.tenant != on.tenant  # and no run drafts from an earlier run's answers
    assert chat_body(on, "hi", RequestParams(), {"cache_salt": "x"})["cache_salt"] == "x"
    assert off.extension == {"enabled": False} and on.extension == {"enabled": True}
