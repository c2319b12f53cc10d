"""Replay the agent traces at a concurrency above one, wave by wave, on a fixed cost table: what the draft
policy's choices cost and gain each request when its steps are shared, without this VM's timing noise.

    .venv/bin/python -m benchmarks.agent_replay_waves --report docs/bench/<dir>/agent-c1/report.json \
        --costs docs/bench/<dir>/costs-target-exact.json [--concurrency 4] [--drafter suffix]

As ``specserve bench --workload agent`` runs them: the traces in file order, ``concurrency`` at a time (a
wave), each trace's turns one after another in its own slot, the next wave once the whole wave is done.
The answers are a plain run's, recorded at concurrency 1 (greedy speculative output equals plain output, and
exact mode makes it the same at any batch), so a draft is accepted up to its first token that differs from
the answer (benchmarks/agent_replay.py). Every step, the policy plans for the running sequences together
(one drafter, one policy and one tenant for the whole run, as in a server); a step costs the table's price
of each pass llama.cpp makes of it (one per run of consecutive slots with the same rows:
``llama_cpp_passes.stream_passes``, the packing the policy prices), plus the drafter's own measured time.
Every running request waits for the whole step. The same waves decoded plainly give each request's plain
time, so a trace kind's speed-up is its requests' plain seconds over their seconds: the bench's "x plain"
at this concurrency. Left out, as in the one-at-a-time replay: prompt processing (a new turn joins the
next step already prefilled), the host path, and the table's drift while serving.

Prints one JSON object: per trace kind and in all, as benchmarks/agent_replay.py, at this concurrency.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from benchmarks.agent_replay import (
    CopyOracle,
    Turn,
    arguments,
    chosen_drafter,
    load_costs,
    print_result,
    recorded_turns,
)
from specserve.backends.llama_cpp_passes import stream_passes
from specserve.drafters.base import Drafter
from specserve.engine.cost_model import CostModel, StepCostTable
from specserve.engine.cost_policy import CostAwarePolicy
from specserve.engine.draft_policy import DraftPlan
from specserve.engine.speculation_budget import StepTiming
from specserve.request import PositionalUniforms, SamplingParams
from specserve.sequence import Sequence, SequenceStatus

BATCH_CAPACITY = 512
"""llama.cpp's micro-batch size in the server (``n_ubatch``)."""


def call_rows(chunk_rows: Seq[int], slots: Seq[int] | None = None) -> list[int]:
    """Rows of each pass of one call, as llama.cpp splits it over one KV stream per slot."""
    ids = range(len(chunk_rows)) if slots is None else slots
    return stream_passes(sorted(zip(ids, chunk_rows, strict=True)), BATCH_CAPACITY)


@dataclass
class _Lane:
    """One trace in its slot: the turns still to send, and the request decoding now."""

    slot: int
    turns: list[Turn]
    seq: Sequence | None = None
    row: dict[str, float] = field(default_factory=dict)


@dataclass
class Replay:
    """One run of every wave under one drafter (None: plain decoding) and one policy."""

    table: StepCostTable
    drafter: Drafter | None
    limit: int
    oracle: CopyOracle
    rows: dict[str, tuple[str, dict[str, float]]] = field(default_factory=dict)
    """Request id (its wave, slot and turn) → its trace kind and counters."""
    policy: CostAwarePolicy = field(init=False)

    def __post_init__(self) -> None:
        self.policy = CostAwarePolicy(CostModel(self.table), call_rows=call_rows)
        self._answers: dict[str, Turn] = {}

    def run(self, waves: list[list[list[Turn]]]) -> None:
        for w, wave in enumerate(waves):
            lanes = [_Lane(slot, list(turns)) for slot, turns in enumerate(wave)]
            while any(lane.seq is not None or lane.turns for lane in lanes):
                waiting = [lane for lane in lanes if lane.seq is None and lane.turns]
                if waiting:  # one a step, as prompt processing staggers them in the server
                    self._start(waiting[0], f"{w}-{waiting[0].slot}-{len(waiting[0].turns)}")
                self._step([lane for lane in lanes if lane.seq is not None])

    def _start(self, lane: _Lane, rid: str) -> None:
        turn = lane.turns.pop(0)
        params = SamplingParams(max_tokens=len(turn.answer))
        seq = Sequence(rid, list(turn.prompt), params, PositionalUniforms(0))
        seq.slot, seq.cache_salt, seq.status = lane.slot, "replay", SequenceStatus.RUNNING
        self.oracle.expect(rid, turn.prompt, turn.answer)
        self._answers[rid] = turn
        if self.drafter is not None:
            self.drafter.begin(seq)
        lane.seq = seq
        lane.row = {"tokens": len(turn.answer), "steps": 0, "drafts": 0, "drafted": 0, "accepted": 0,
                    "seconds": 0.0, "drafting_seconds": 0.0}  # fmt: skip

    def _step(self, lanes: list[_Lane]) -> None:
        seqs = [lane.seq for lane in lanes if lane.seq is not None]
        start = time.perf_counter()
        plans, drafts = self._drafts(seqs)
        spent = time.perf_counter() - start
        chunk_rows = [1 + len(d) for d in drafts]
        seconds = sum(self.table(n) for n in call_rows(chunk_rows, [s.slot for s in seqs])) + spent
        for lane, seq, plan, draft in zip(lanes, seqs, plans, drafts, strict=True):
            answer = self._answers[seq.request_id].answer
            position, accepted = len(seq.output_ids), 0
            while accepted < len(draft) and answer[position + accepted] == draft[accepted]:
                accepted += 1
            row = lane.row
            row["steps"] += 1
            row["seconds"] += seconds
            row["drafting_seconds"] += spent / len(seqs)
            if draft:
                row["drafts"] += 1
                row["drafted"] += len(draft)
                row["accepted"] += accepted
                assert self.drafter is not None and plan is not None
                self.drafter.accept(seq, accepted)
                self.policy.observe(seq, plan, accepted)
            if self.drafter is not None:
                self.policy.observe_step(seq, len(draft), accepted, StepTiming(seconds, sum(chunk_rows)))
            seq.output_ids.extend(answer[position : position + accepted + 1])
            if len(seq.output_ids) >= len(answer):
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = self._answers[seq.request_id].finish_reason
                if self.drafter is not None:
                    self.drafter.release(seq)
                self.rows[seq.request_id] = (self._answers[seq.request_id].kind, row)
                lane.seq = None

    def _drafts(self, seqs: list[Sequence]) -> tuple[list[DraftPlan | None], list[list[int]]]:
        """Each sequence's plan (None when decoding plainly) and the tokens it drafts."""
        drafter = self.drafter
        if drafter is None:
            return [None] * len(seqs), [[] for _ in seqs]
        options = [
            {drafter.name: (drafter, drafter.available(seq, min(self.limit, self._left(seq) - 1)))}
            for seq in seqs
        ]
        plans = self.policy.plan(seqs, options, (), [])
        proposals = drafter.propose(seqs, [plan.num_tokens for plan in plans])
        drafts = [
            list(p.token_ids) if plan.drafter is not None else []
            for p, plan in zip(proposals, plans, strict=True)
        ]
        return [plan if plan.drafter is not None else None for plan in plans], drafts

    def _left(self, seq: Sequence) -> int:
        return len(self._answers[seq.request_id].answer) - len(seq.output_ids)


def waves(turns: list[Turn], concurrency: int) -> list[list[list[Turn]]]:
    """The traces in file order (their first turn's order in the recording), ``concurrency`` at a time,
    each its turns in order."""
    traces: dict[str, list[Turn]] = {}
    for turn in turns:
        traces.setdefault(turn.trace, []).append(turn)
    ordered = [sorted(t, key=lambda turn: turn.turn) for t in traces.values()]
    return [ordered[i : i + concurrency] for i in range(0, len(ordered), concurrency)]


def main(argv: list[str] | None = None) -> int:
    parser = arguments("python -m benchmarks.agent_replay_waves", __doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    turns = recorded_turns(parser, args)
    table = load_costs(args.costs)
    plain = Replay(table, None, args.num_draft_tokens, CopyOracle())
    plain.run(waves(turns, args.concurrency))
    oracle = CopyOracle()
    spec = Replay(table, chosen_drafter(args, oracle), args.num_draft_tokens, oracle)
    spec.run(waves(turns, args.concurrency))
    by_kind: dict[str, list[dict[str, float]]] = {}
    for rid, (kind, row) in spec.rows.items():
        by_kind.setdefault(kind, []).append({**row, "plain_seconds": plain.rows[rid][1]["seconds"]})
    print_result(args, by_kind)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
