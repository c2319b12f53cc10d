"""``specserve bench --url`` and ``specserve verify --url`` against a live tiny server: files, shapes, exits.

No timing assertions: the figures are whatever this (shared) machine measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runner import run_cli
from server.process import ServerProcess, free_port, start_server, stop_server
from specserve.tools.loadgen.agent import agent_traces
from support.tiny_models import TinyModels
from tools.helpers import one_error_line

CONTRACT_KEYS = {
    "workload", "mode", "concurrency", "requests", "errors", "tokens_per_second_p50",
    "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99", "itl_p50", "itl_p90", "itl_p99",
    "throughput_tokens_per_second", "acceptance_rate", "mean_acceptance_length", "accepted_per_position",
}  # fmt: skip
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_compare_spec_writes_the_contract(
    bench_server: ServerProcess, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        capfd, "bench", "--url", bench_server.url, "--output-dir", str(out),
        "--workload", "qa", "code-edit", "--concurrency", "1,2", "--requests", "2", "--max-tokens", "8",
        "--compare-spec",
    )  # fmt: skip
    assert code == 0, err
    assert "wave" in err  # progress on stderr
    report = json.loads((out / "report.json").read_text())
    records = report["records"]
    cells = {(r["workload"], r["mode"], r["concurrency"]) for r in records}
    assert cells == {(w, m, c) for w in ("qa", "code-edit") for m in ("on", "off") for c in (1, 2)}
    assert len(records) == 8
    for record in records:
        assert set(record) >= CONTRACT_KEYS
        assert record["requests"] == 2 and record["errors"] == 0
        assert record["output_tokens"] == 16  # the tiny models never end early: max_tokens each
        for key in (
            "tokens_per_second_p50",
            "ttft_p50",
            "tpot_p99",
            "itl_p50",
            "throughput_tokens_per_second",
        ):
            assert record[key] > 0, key
        assert record["ttft_p50"] <= record["ttft_p90"] <= record["ttft_p99"]
    for record in (r for r in records if r["mode"] == "on"):  # the server drafts with a fixed length
        assert record["num_drafts"] > 0
        assert 0.0 <= record["acceptance_rate"] <= 1.0
        assert record["mean_acceptance_length"] >= 1.0
        positions = record["accepted_per_position"]  # from the server's /metrics counters
        assert positions and sum(positions) == record["num_accepted_tokens"]
    for record in (r for r in records if r["mode"] == "off"):
        assert record["num_drafts"] == 0 and record["acceptance_rate"] is None
    assert {(c["workload"], c["concurrency"]) for c in report["comparisons"]} >= {("qa", 1), ("all", 2)}
    markdown = (out / "report.md").read_text()
    assert markdown == stdout and "| code-edit | on | 2 |" in markdown
    for name in ("speedup_by_workload.png", "latency_by_concurrency.png", "acceptance_by_position.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name


def test_bench_user_prompts_and_peer_mode(
    bench_server: ServerProcess, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "Say hello.", "workload": "greet"}\n\n{"prompt": "Count to three."}\n')
    out = tmp_path / "out"
    code, _, err = run_cli(
        capfd, "bench", "--url", bench_server.url + "/v1/", "--output-dir", str(out),
        "--prompts", str(prompts), "--requests", "1", "--max-tokens", "4", "--peer",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["server"]["reports_speculative"] is False
    assert [(r["workload"], r["mode"]) for r in report["records"]] == [
        ("greet", "default"),
        ("custom", "default"),
    ]
    assert report["comparisons"] == []
    assert (out / "speedup_by_workload.png").read_bytes().startswith(PNG_MAGIC)


def test_bench_malformed_jsonl_is_one_line(
    bench_server: ServerProcess, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": \n')
    code, _, err = run_cli(
        capfd, "bench", "--url", bench_server.url, "--prompts", str(prompts), "--output-dir", str(tmp_path)
    )
    assert code == 2
    assert "bad.jsonl:2: invalid JSON" in one_error_line(err)
    assert not (tmp_path / "report.json").exists()


def test_bench_unreachable_server_is_one_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, _, err = run_cli(capfd, "bench", "--url", url, "--output-dir", str(tmp_path), "--compare-spec")
    assert code == 2
    assert f"cannot reach {url}" in one_error_line(err)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--workload", "poetry"], "unknown workload 'poetry'"),
        (["--concurrency", "1,x"], "--concurrency: expected comma-separated integers"),
        (["--peer-url", "nourl"], "--peer-url expects NAME=URL"),
    ],
)
def test_bench_bad_arguments_are_one_line(
    extra: list[str], message: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(
        capfd, "bench", "--url", "http://127.0.0.1:9", "--output-dir", str(tmp_path), *extra
    )
    assert code == 2
    assert message in one_error_line(err)


def test_verify_over_http_passes_in_exact_mode(
    bench_server: ServerProcess, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, stdout, err = run_cli(
        capfd, "verify", "--url", bench_server.url, "--output-dir", str(tmp_path),
        "--workload", "code-edit", "--limit", "1", "--max-tokens", "16",
        "--seeds", "6", "--sample-tokens", "1", "--top-k", "2",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is True and report["unit"] == "text"
    assert report["greedy"]["equal"] == report["greedy"]["total"] == 2  # speculative, then from the cache
    assert report["sampled"]["tests"] == 1 and 0.0 <= report["sampled"]["p_value"] <= 1.0
    assert "**PASS**" in stdout


def test_prefix_bench_measures_cached_against_cold(
    bench_server: ServerProcess, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "prefix"
    code, _, err = run_cli(
        capfd, "bench", "--url", bench_server.url, "--output-dir", str(out),
        "--workload", "chat-multiturn", "shared-system-prompt", "--requests", "2", "--max-tokens", "4",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    multiturn = report["workloads"]["chat-multiturn"]
    assert len(multiturn["turns"]["cached"]) == 4 + 5  # two conversations of 4 and 5 turns
    for workload in ("chat-multiturn", "shared-system-prompt"):
        summary = report["workloads"][workload]["summary"]
        cached, cold = summary["cached"], summary["cold"]
        assert cached["errors"] == cold["errors"] == 0
        assert cold["cached_tokens"] == 0 and cached["hit_rate"] > 0.3, workload
        assert cached["same_output_as_cold"] == cached["requests"]  # reuse never changes greedy output
        assert cached["ttft_vs_cold"] is not None
    assert "| chat-multiturn | cached |" in (out / "report.md").read_text()


def test_bench_takes_the_key_from_openai_api_key(
    tiny_models: TinyModels,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keyed = start_server(tiny_models, tmp_path, "--max-running", "1", env={"SPECSERVE_API_KEYS": "k-env"})
    try:
        args = ("bench", "--url", keyed.url, "--output-dir", str(tmp_path / "o"), "--workload", "qa",
                "--requests", "1", "--max-tokens", "2")  # fmt: skip
        code, _, err = run_cli(capfd, *args)
        assert code == 2 and "OPENAI_API_KEY" in err
        monkeypatch.setenv("OPENAI_API_KEY", "k-env")
        code, _, err = run_cli(capfd, *args)
        assert code == 0, err
    finally:
        stop_server(keyed)


def test_agent_bench_runs_each_wave_in_every_mode_before_the_next(
    bench_server: ServerProcess, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Modes take turns wave by wave (a slow phase of the machine lands on every mode, not on one), the
    first mode moving along each wave; each mode still runs every trace's turns in order, as its own
    tenant, and the report keeps its table."""
    out = tmp_path / "out"
    code, stdout, err = run_cli(
        capfd, "bench", "--url", bench_server.url, "--output-dir", str(out), "--workload", "agent",
        "--concurrency", "4", "--max-tokens", "4", "--agent-modes", "plain,suffix,auto",
    )  # fmt: skip
    assert code == 0, err
    waves = [line.split("wave ")[1] for line in err.splitlines() if "agent traces: wave" in line]
    assert waves[:6] == [
        "1/3 at concurrency 4: plain",
        "1/3 at concurrency 4: suffix",
        "1/3 at concurrency 4: auto",
        "2/3 at concurrency 4: suffix",
        "2/3 at concurrency 4: auto",
        "2/3 at concurrency 4: plain",
    ]
    assert len(waves) == 9
    level = json.loads((out / "report.json").read_text())["levels"]["4"]
    traces = [trace.name for trace in agent_traces()]
    for mode in ("plain", "suffix", "auto"):
        turns = level["turns"][mode]
        assert {t["trace"] for t in turns} == set(traces)
        assert all(t["wave"] == traces.index(t["trace"]) // 4 for t in turns)
        for trace in traces:  # a trace's turns in order, each after the one before
            orders = [t["order"] for t in turns if t["trace"] == trace]
            assert orders == sorted(orders)
        assert level["summary"][mode]["all"]["errors"] == 0
    assert "| 4 | all |" in stdout
