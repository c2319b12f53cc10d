"""The benchmark tools' pure parts: workloads, metrics parsing, statistics, report arithmetic."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from specserve.bench.bench_report import cell_record
from specserve.bench.evaluate_tool import Tally
from specserve.bench.http_client import RequestResult, normalize_base_url
from specserve.bench.loadgen import CellRun
from specserve.bench.server_metrics import parse_spec_counters
from specserve.bench.verify_stats import bonferroni, chi_square_p_value
from specserve.bench.verify_tool import first_difference
from specserve.bench.workloads import BUILTIN_WORKLOADS, BenchInputError, select_workloads
from specserve.engine.cost_model import CostModel, StepCostTable


def test_builtin_workloads_ship_with_the_package() -> None:
    workloads = select_workloads(None, None)
    assert [w.name for w in workloads] == list(BUILTIN_WORKLOADS)
    assert all(len(w.prompts) >= 5 and all(p.strip() for p in w.prompts) for w in workloads)
    assert [len(w.prompts) for w in select_workloads(["qa", "qa"], None, limit=2)] == [2]


def test_user_file_groups_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "kind": "x"}\n{"prompt": "b"}\n{"prompt": "c", "workload": "x"}\n')
    workloads = select_workloads(None, str(path))
    assert [(w.name, w.prompts) for w in workloads] == [("x", ("a", "c")), ("custom", ("b",))]
    assert [w.name for w in select_workloads(["x", "qa"], str(path))] == ["x", "qa"]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(BenchInputError, match=r"p.jsonl:1: expected an object"):
        select_workloads(None, str(path))
    with pytest.raises(BenchInputError, match="cannot read"):
        select_workloads(None, str(tmp_path / "missing.jsonl"))


def test_base_url_normalisation() -> None:
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("https://h") == "https://h"
    with pytest.raises(BenchInputError):
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


def test_chi_square_tells_same_from_different_distributions() -> None:
    rng = random.Random(0)
    a = rng.choices("abc", weights=[5, 3, 2], k=400)
    b = rng.choices("abc", weights=[5, 3, 2], k=400)
    c = rng.choices("abc", weights=[2, 3, 5], k=400)
    assert chi_square_p_value(a, b)[0] > 0.01
    p, columns = chi_square_p_value(a, c)
    assert p < 1e-6 and columns == 3
    assert chi_square_p_value(["a"] * 10, ["a"] * 10) == (1.0, 1)  # one outcome: nothing to test
    assert chi_square_p_value(list("abcdefgh"), list("ijklmnop"))[1] == 1  # all rare: pooled into "other"
    assert bonferroni([0.2, 0.004]) == pytest.approx(0.008)
    assert bonferroni([]) == 1.0


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference("abc", "ab") == 2


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


def test_expected_speedup_from_the_cost_model() -> None:
    """target(n) = n ms for n ≤ 2, then flat: a 2-token verify costs 2 ms, 5 tokens 2 ms too."""
    costs = CostModel(StepCostTable.from_samples({1: 1.0, 2: 2.0, 8: 2.0}))
    tally = Tally(decode_tokens=10)
    tally.steps = [("ngram", 4, 4), ("ngram", 4, 1)]  # 5 + 2 tokens; 3 more from plain steps
    assert tally.expected_seconds(costs) == pytest.approx(2.0 + 2.0 + 3 * 1.0)
    costs.draft = StepCostTable.from_samples({1: 0.5, 8: 4.0})
    tally.steps = [("draft-model", 4, 4)]  # 5 tokens, 5 plain steps; drafting costs 4 x 0.5
    assert tally.expected_seconds(costs) == pytest.approx(2.0 + 2.0 + 5 * 1.0)
