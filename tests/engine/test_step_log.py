"""The step log (``step_log``): one JSON line per engine step, whose counts add up to the requests' own."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.drafters.suffix import SuffixDrafter
from specserve.engine.cost_model import CostModel, StepCostTable
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.offline import OfflineEngine
from specserve.engine.options import EngineOptions
from specserve.engine.step_log import StepLog
from specserve.request import SamplingParams
from specserve.sequence import SpeculationOptions
from support.tiny_models import TinyModels

PROMPT = "def area(self):\n    return self.width * self.height\n" * 2


def test_each_step_is_a_line_and_its_counts_add_up_to_the_requests(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    target = LlamaCppRuntime(tiny_models.target, context_per_sequence=512, max_sequences=2, n_threads=1)
    costs = CostModel(StepCostTable.from_samples({1: 0.01, 64: 0.64}))
    drafter = SuffixDrafter(min_prob=0.0, factor=4.0)
    engine = SpeculativeEngine(
        target, {"suffix": drafter}, FixedLengthPolicy(), costs, EngineOptions(("suffix",), 6)
    )
    path = tmp_path / "steps.jsonl"
    engine.step_log = StepLog(path)
    offline = OfflineEngine(engine)
    ids = target.tokenize(PROMPT)
    params = SamplingParams(max_tokens=40)
    try:
        first = offline.add_request("first", ids, params, SpeculationOptions(drafter="suffix"))
        offline.run()
        # Two re-runs side by side: they copy the first answer, in one step each time.
        again = [
            offline.add_request(rid, ids, params, SpeculationOptions(drafter="suffix")) for rid in ("a", "b")
        ]
        offline.run()
    finally:
        engine.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines and all(line["passes"] and line["seconds"] > 0 and line["priced"] > 0 for line in lines)
    for state in (first, *again):
        mine = [s for line in lines for s in line["sequences"] if s["id"] == state.request_id]
        assert sum("first_token" in s for s in mine) == 1
        drafted = [s for s in mine if s.get("drafted")]
        assert sum(s["drafted"] for s in drafted) == state.stats.num_draft_tokens
        assert sum(s["kept"] for s in drafted) == state.stats.num_accepted_tokens
        assert all(s["drafter"] == "suffix" and s["expected"] >= 1 for s in drafted)
    assert any(len(line["sequences"]) == 2 for line in lines)  # the re-runs shared steps
    assert again[0].stats.num_accepted_tokens > 0
    # Counts only: the prompt's text and token ids never reach the log.
    assert "width" not in path.read_text()
    keys = {key for line in lines for s in line["sequences"] for key in s}
    assert keys <= {
        "id",
        "slot",
        "first_token",
        "drafted",
        "kept",
        "drafter",
        "bucket",
        "expected",
        "estimates",
        "error",
    }


class DoublingTable(StepCostTable):
    """Every observed step doubles the table: a logged price shows whether that step's time is in it."""

    def observe(self, n_tokens: int, seconds: float) -> None:
        self.seconds *= 2
        self.observations += 1


def test_a_step_is_logged_at_the_price_it_was_planned_with(tiny_models: TinyModels, tmp_path: Path) -> None:
    """benchmarks/step_log_pricing.py replays the table from the log: the price must be the one the policy
    saw, before the step's own time refines the table."""
    target = LlamaCppRuntime(tiny_models.target, context_per_sequence=256, max_sequences=1, n_threads=1)
    table = DoublingTable(StepCostTable.from_samples({1: 0.01, 64: 0.64}).seconds)
    engine = SpeculativeEngine(target, {}, FixedLengthPolicy(), CostModel(table), EngineOptions((), 0))
    path = tmp_path / "steps.jsonl"
    engine.step_log = StepLog(path)
    offline = OfflineEngine(engine)
    try:
        offline.add_request("r", target.tokenize(PROMPT), SamplingParams(max_tokens=4))
        offline.run()
    finally:
        engine.close()
    decodes = [json.loads(line) for line in path.read_text().splitlines() if '"prefill":[]' in line]
    assert [d["passes"] for d in decodes] == [[1], [1], [1]]
    assert [d["priced"] for d in decodes] == [0.01, 0.02, 0.04]  # 0.02, 0.04, 0.08 priced after observing
