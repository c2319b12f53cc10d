"""``python -m benchmarks.agent_replay``: recorded answers replayed through a drafter and the cost policy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from benchmarks import agent_replay, agent_replay_policy, agent_replay_waves
from specserve.drafters.base import DraftOption
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.builder import flat_costs
from specserve.engine.cost_model import CostModel
from specserve.engine.cost_policy import CostAwarePolicy
from specserve.tools.loadgen.agent import agent_traces
from support.tiny_models import TinyModels

XEON_MS = {1: 76.2, 2: 105.1, 4: 111.1, 8: 200.4, 16: 245.9, 24: 376.8, 32: 417.5}
"""The default pair's exact-mode table on Intel Xeon model 207 (2 cores), one-token to 32-row calls."""


def words(seed: int, n: int) -> str:
    """``n`` random five-letter words: text no other seed repeats."""
    letters = np.random.default_rng(seed).integers(0, 26, (n, 5))
    return " ".join("".join(chr(97 + int(c)) for c in word) for word in letters)


def plain_report(repeat: str) -> dict[str, Any]:
    """A plain run at concurrency 1 in which the ``repeat`` traces all answer one text and every other
    turn answers text of its own (random words: nothing to copy)."""
    turns, order = [], 0
    for i, trace in enumerate(agent_traces()):
        for turn in range(len(trace.turns)):
            text = words(1000, 120) if trace.kind == repeat else words(i * 10 + turn, 60)
            turns.append(
                {"trace": trace.name, "kind": trace.kind, "turn": turn, "order": order, "text": text}
            )
            order += 1
    return {"levels": {"1": {"turns": {"plain": turns}}}}


def replay(
    tmp_path: Path,
    models: TinyModels,
    capsys: pytest.CaptureFixture[str],
    *flags: str,
    tool: ModuleType = agent_replay,
) -> Any:
    report, costs = tmp_path / "report.json", tmp_path / "costs.json"
    report.write_text(json.dumps(plain_report("repeat-task")))
    costs.write_text(json.dumps({"engine": {"costs_ms": {"target_ms": XEON_MS}}}))
    argv = ["--report", str(report), "--costs", str(costs), "--model", str(models.target), *flags]
    assert tool.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_text_seen_before_is_drafted_and_new_text_stays_plain(
    tiny_models: TinyModels, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = replay(tmp_path, tiny_models, capsys)
    kinds = result["kinds"]
    # The same task's second and third runs copy the first's answer.
    assert kinds["repeat-task"]["speedup"] > 1.5 and kinds["repeat-task"]["mal"] > 2
    for kind in ("control", "file-edit", "extraction-batch"):  # nothing of their answers came before
        assert kinds[kind]["speedup"] >= 0.97, kind
    assert result["all"]["tokens"] == sum(k["tokens"] for k in kinds.values())


def test_the_copy_oracle_drafts_only_repeated_windows(
    tiny_models: TinyModels, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kinds = replay(tmp_path, tiny_models, capsys, "--drafter", "copy-oracle")["kinds"]
    assert (
        kinds["repeat-task"]["speedup"] > 2
        and kinds["repeat-task"]["accepted"] == kinds["repeat-task"]["drafted"]
    )
    # no drafts: plain's steps plus the oracle's measured lookups (tens of µs a step; 0.1 % of a step when
    # the machine is busy, which an exact 1.0 at three decimals did not allow)
    assert kinds["control"]["drafts"] == 0 and kinds["control"]["speedup"] == pytest.approx(1.0, abs=0.01)


def test_depth_makes_every_step_cost_more(
    tiny_models: TinyModels, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flat = replay(tmp_path, tiny_models, capsys)["all"]
    deep = replay(tmp_path, tiny_models, capsys, "--key-ms", "4")["all"]
    assert deep["plain_seconds"] > flat["plain_seconds"] and deep["seconds"] > flat["seconds"]


def test_waves_of_one_replay_as_the_requests_one_at_a_time(
    tiny_models: TinyModels, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    alone = replay(tmp_path, tiny_models, capsys)["kinds"]
    waves = replay(tmp_path, tiny_models, capsys, "--concurrency", "1", tool=agent_replay_waves)["kinds"]
    for kind, row in alone.items():
        for key in ("tokens", "steps", "drafts", "drafted", "accepted"):
            assert waves[kind][key] == row[key], (kind, key)
        assert waves[kind]["speedup"] == pytest.approx(row["speedup"], abs=0.01)


def test_the_policy_tool_replays_the_engine_policy_and_lists_one_kinds_drafts(
    tiny_models: TinyModels, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    alone = replay(tmp_path, tiny_models, capsys)["kinds"]
    traced = replay(tmp_path, tiny_models, capsys, "--trace", "repeat-task", tool=agent_replay_policy)
    for kind, row in alone.items():  # no --proof-ramp: the engine's own policy, the same drafts
        for key in ("tokens", "steps", "drafts", "drafted", "accepted"):
            assert traced["kinds"][kind][key] == row[key], (kind, key)
    drafts = traced["trace"]
    assert len(drafts) == alone["repeat-task"]["drafts"]
    assert sum(d["accepted"] for d in drafts) == alone["repeat-task"]["accepted"]
    assert all(len(d["estimates"]) == d["drafted"] for d in drafts)


def test_a_proof_ramp_lets_a_trusted_draft_grow_only_with_the_requests_accepted_tokens() -> None:
    policy = agent_replay_policy.RampProofPolicy(CostModel(flat_costs()), ramp=2.0)
    option = DraftOption(8, "match<=16")
    trusted = agent_replay_policy._RampOffer(NgramDrafter(), option, 0.9, 1.0, True, own_accepted=2.0)
    headroom = 0.5  # seconds: less than one extra verify row costs on the flat table (1 s)
    assert policy._candidate(trusted, 4, headroom, plain=False) is not None  # 4 <= 2 x 2 accepted
    assert policy._candidate(trusted, 5, headroom, plain=False) is None  # beyond the ramp: must fit
    grown = dataclasses.replace(trusted, own_accepted=3.0)
    assert policy._candidate(grown, 6, headroom, plain=False) is not None
    engine = CostAwarePolicy(CostModel(flat_costs()))  # the engine's rule: a trusted draft is not capped
    assert engine._candidate(trusted, 8, headroom, plain=False) is not None


def test_at_concurrency_four_copies_still_pay_and_their_batch_mates_pay_for_them(
    tiny_models: TinyModels, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The second and third runs of the repeated task share a wave with the two controls: they still copy
    the first run in long drafts, and the controls, which draft nothing that is kept, wait for those rows
    (the geometric mean's price on this table: about 12 % of their speed)."""
    kinds = replay(tmp_path, tiny_models, capsys, "--concurrency", "4", tool=agent_replay_waves)["kinds"]
    repeat, control = kinds["repeat-task"], kinds["control"]
    assert repeat["speedup"] > 1.2 and repeat["accepted"] / repeat["drafts"] > 8
    assert control["accepted"] <= 1 and 0.8 < control["speedup"] < 0.97
    ngram = replay(
        tmp_path, tiny_models, capsys, "--concurrency", "4", "--drafter", "ngram", tool=agent_replay_waves
    )
    assert ngram["all"]["tokens"] == sum(k["tokens"] for k in kinds.values())
