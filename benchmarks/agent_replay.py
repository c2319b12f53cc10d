"""Replay the agent traces' recorded greedy answers through a model-free drafter and the cost policy on a
fixed cost table: what each drafter setting would gain, without this VM's timing noise.

    .venv/bin/python -m benchmarks.agent_replay --report docs/bench/<dir>/report.json \
        --costs ~/.cache/specserve/models/calibration/<target>.json [--drafter suffix] [--factor 1.0] ...

Greedy speculative output equals plain output, so the target's choice at every position is known from a
plain run (``specserve bench --workload agent``'s ``plain`` turns at concurrency 1): a draft is accepted up
to its first token that differs from the recorded answer. The requests run one at a time in the run's
order, each rebuilt as the agent sent it (the trace's turns and the recorded earlier answers, through the
model's chat template), through one drafter and one policy that live for the whole run, as in a server
(the tenant's suffix cache and the policy's acceptance records carry over). A step costs the table's price
of its rows, which the table never refines, plus ``--key-ms`` per row per 1,000 cached positions (what
attention at depth adds; the table is measured at an empty context), plus the drafter's own measured time;
plain decoding costs a one-token step per token, at its depth too. ``--drafter copy-oracle`` knows the
answer and drafts it exactly wherever the next token lies in a ``COPY_WINDOW``-token window of earlier
text (the bench's "repeated" share), rating each token 0.995: the most a model-free drafter could get from
the same policy. Left out: prompt processing, the host path, the draft model (it needs the model), and a
table's drift while serving. Answers are the recorded texts tokenized again, which may split a few tokens
differently from what the model emitted.

Prints one JSON object: per trace kind and in all, output tokens, steps, drafts, mean acceptance length and
the modelled speed-up over plain decoding.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.batch_pass import cpu_model
from specserve.backends.llama_cpp_vocab import LlamaCppVocabulary
from specserve.chat import chat_prompt_ids
from specserve.config import NUM_DRAFT_TOKENS, SUFFIX_DEPTH, SUFFIX_FACTOR, SUFFIX_MIN_PROB
from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.suffix import SuffixDrafter
from specserve.engine.cost_model import CostModel, StepCostTable
from specserve.engine.cost_policy import CostAwarePolicy
from specserve.engine.speculation_budget import StepTiming
from specserve.models import CATALOG, DEFAULT_TARGET, ModelStore
from specserve.request import PositionalUniforms, SamplingParams
from specserve.sequence import FinishReason, Sequence, SequenceStatus
from specserve.tools.loadgen.agent import COPY_WINDOW, agent_traces

CALIBRATION_DEPTH = 48
"""Cached positions before the calls a calibration times (``cost_model.calibrate``'s context)."""


class CopyOracle(Drafter):
    """Drafts the recorded answer wherever it repeats earlier text (``answers``: request id → ids)."""

    name = "copy-oracle"

    def __init__(self) -> None:
        self.answers: dict[str, list[int]] = {}
        self.repeated: dict[str, list[bool]] = {}
        self.seen: set[tuple[int, ...]] = set()

    def expect(self, rid: str, prompt: list[int], answer: list[int]) -> None:
        """The next request's answer, its tokens marked where a window of the prompt or an earlier answer
        covers them."""
        windows = self.seen | _windows(prompt)
        mark = [False] * len(answer)
        for i in range(len(answer) - COPY_WINDOW + 1):
            if tuple(answer[i : i + COPY_WINDOW]) in windows:
                mark[i : i + COPY_WINDOW] = [True] * COPY_WINDOW
        self.answers[rid], self.repeated[rid] = answer, mark
        self.seen |= _windows(answer)

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        answer, mark = self.answers[seq.request_id], self.repeated[seq.request_id]
        at, n = len(seq.output_ids), 0
        while n < limit and at + n < len(answer) and mark[at + n]:
            n += 1
        return DraftOption(n, "match>16", token_probs=(0.995,) * n)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:  # type: ignore[override]
        return [
            Proposal(self.answers[s.request_id][len(s.output_ids) : len(s.output_ids) + k])
            for s, k in zip(seqs, num_tokens, strict=True)
        ]


def _windows(ids: list[int]) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + COPY_WINDOW]) for i in range(len(ids) - COPY_WINDOW + 1)}


def load_costs(path: Path) -> StepCostTable:
    """A cost table from a calibration cache file (``seconds`` per rows) or ``specserve generate --json``'s
    output (``engine.costs_ms.target_ms``)."""
    data = json.loads(path.read_text())
    if "seconds" in data:
        return StepCostTable.from_samples({n: s for n, s in enumerate(data["seconds"]) if n > 0})
    ms = data["engine"]["costs_ms"]["target_ms"]
    return StepCostTable.from_samples({int(n): v / 1000 for n, v in ms.items()})


class Turn(NamedTuple):
    """One recorded request: its trace and turn, the prompt and answer as ids, and how it finished."""

    kind: str
    trace: str
    turn: int
    prompt: list[int]
    answer: list[int]
    finish_reason: FinishReason
    """``length`` where the answer reached the bench's ``--max-tokens``, else ``stop``."""


def requests(report: dict[str, Any], vocab: LlamaCppVocabulary) -> list[Turn]:
    """Every plain turn at concurrency 1, in the order they were sent."""
    traces = {t.name: t for t in agent_traces()}
    turns = sorted(report["levels"]["1"]["turns"]["plain"], key=lambda t: t["order"])
    limit = re.search(r"--max-tokens (\d+)", report.get("command", ""))
    max_tokens = int(limit.group(1)) if limit else None
    answers = {(t["trace"], t["turn"]): t["text"] for t in turns}
    out = []
    for turn in turns:
        trace = traces[turn["trace"]]
        messages = [{"role": "system", "content": trace.system}] if trace.system else []
        for i in range(turn["turn"] + 1):
            messages.append({"role": "user", "content": trace.turns[i]})
            if i < turn["turn"]:
                messages.append({"role": "assistant", "content": answers[(trace.name, i)]})
        answer = vocab.tokenize(turn["text"], add_special=False)
        reason: FinishReason = "length" if turn.get("output_tokens") == max_tokens else "stop"
        prompt = chat_prompt_ids(vocab, messages)
        out.append(Turn(turn["kind"], trace.name, turn["turn"], prompt, answer, reason))
    return out


def replay(
    drafter: Drafter,
    policy: CostAwarePolicy,
    key_seconds: float,
    prompt: list[int],
    answer: list[int],
    limit: int,
    rid: str,
    finish_reason: FinishReason = "stop",
) -> dict[str, float]:
    """Decode ``answer`` for ``prompt`` under the policy; a pass costs the table's price of its rows plus
    ``key_seconds`` per row per cached position beyond the calibration's."""
    table = policy.costs.target

    def cost(rows: int, start: int) -> float:
        return table(rows) + key_seconds * rows * max(start - CALIBRATION_DEPTH, 0)

    seq = Sequence(rid, list(prompt), SamplingParams(max_tokens=len(answer)), PositionalUniforms(0))
    drafter.begin(seq)
    seconds = drafting = 0.0
    steps = drafts = drafted = accepted_total = 0
    plain_seconds = sum(cost(1, len(prompt) + i) for i in range(len(answer)))
    while len(seq.output_ids) < len(answer):
        start = time.perf_counter()
        option = drafter.available(seq, min(limit, len(answer) - len(seq.output_ids) - 1))
        (plan,) = policy.plan([seq], [{drafter.name: (drafter, option)}])
        (proposal,) = drafter.propose([seq], [plan.num_tokens])
        spent = time.perf_counter() - start
        seq.draft_seconds += spent
        position, accepted = len(seq.output_ids), 0
        for token in proposal.token_ids:
            if answer[position + accepted] != token:
                break
            accepted += 1
        rows = 1 + len(proposal.token_ids)
        step = cost(rows, seq.num_tokens - 1)  # the pending token is written with the drafts
        seconds, drafting, steps = seconds + step + spent, drafting + spent, steps + 1
        if plan.drafter is not None and proposal.token_ids:
            drafts, drafted = drafts + 1, drafted + len(proposal.token_ids)
            accepted_total += accepted
            drafter.accept(seq, accepted)
            policy.observe(seq, plan, accepted)
        policy.observe_step(seq, len(proposal.token_ids), accepted, StepTiming(step, rows))
        seq.output_ids.extend(answer[position : position + accepted + 1])
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, finish_reason
    drafter.release(seq)
    return {
        "tokens": len(answer), "steps": steps, "drafts": drafts, "drafted": drafted,
        "accepted": accepted_total, "seconds": seconds, "plain_seconds": plain_seconds,
        "drafting_seconds": drafting,
    }  # fmt: skip


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    total = {key: sum(r[key] for r in rows) for key in rows[0]}
    total["mal"] = round(total["tokens"] / total["steps"], 2)
    total["speedup"] = round(total["plain_seconds"] / total["seconds"], 3)
    total["drafting_ms_per_step"] = round(1000 * total["drafting_seconds"] / total["steps"], 3)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in total.items()}


def arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """The replays' shared flags (the suffix drafter's settings, the report, the table and the tokenizer)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--report", type=Path, required=True, help="an agent bench's report.json (level 1)")
    parser.add_argument("--costs", type=Path, required=True, help="a calibration file or generate --json")
    parser.add_argument("--model", type=Path, default=None, help="the target GGUF (its tokenizer)")
    parser.add_argument("--drafter", choices=("suffix", "ngram", "copy-oracle"), default="suffix")
    parser.add_argument("--num-draft-tokens", type=int, default=NUM_DRAFT_TOKENS)
    parser.add_argument("--depth", type=int, default=SUFFIX_DEPTH)
    parser.add_argument("--factor", type=float, default=SUFFIX_FACTOR)
    parser.add_argument("--min-prob", type=float, default=SUFFIX_MIN_PROB)
    return parser


def recorded_turns(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Turn]:
    model = args.model or ModelStore().locate(CATALOG[DEFAULT_TARGET])
    if model is None:
        parser.error("the default target is not pulled (run: specserve models pull), or give --model")
    return requests(json.loads(args.report.read_text()), LlamaCppVocabulary(model))


def chosen_drafter(args: argparse.Namespace, oracle: CopyOracle) -> Drafter:
    drafters: dict[str, Drafter] = {
        "suffix": SuffixDrafter(args.depth, args.factor, args.min_prob),
        "ngram": NgramDrafter(),
        "copy-oracle": oracle,
    }
    return drafters[args.drafter]


def print_result(args: argparse.Namespace, by_kind: dict[str, list[dict[str, float]]], **extra: Any) -> None:
    result = {
        "machine": cpu_model(),  # where the drafter ran; the target's time is the table's
        "settings": {k: str(v) for k, v in vars(args).items()},
        "kinds": {kind: summary(rows) for kind, rows in by_kind.items()},
        "all": summary([r for rows in by_kind.values() for r in rows]),
        **extra,
    }
    print(json.dumps(result, indent=1))


def key_ms_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--key-ms", type=float, default=0.0, help="ms per row per 1,000 cached positions")


def run(
    args: argparse.Namespace, policy: CostAwarePolicy, turns: list[Turn]
) -> dict[str, list[dict[str, float]]]:
    """Every recorded turn replayed in the run's order through one drafter and ``policy``, by trace kind;
    turn ``i`` is request ``str(i)`` (``args`` with ``--key-ms``: ``key_ms_argument``)."""
    oracle = CopyOracle()
    drafter = chosen_drafter(args, oracle)
    by_kind: dict[str, list[dict[str, float]]] = {}
    for i, (kind, _, _, prompt, answer, reason) in enumerate(turns):
        oracle.expect(str(i), prompt, answer)
        key_seconds, limit = args.key_ms / 1e6, args.num_draft_tokens
        row = replay(drafter, policy, key_seconds, prompt, answer, limit, str(i), reason)
        by_kind.setdefault(kind, []).append(row)
    return by_kind


def main(argv: list[str] | None = None) -> int:
    parser = arguments("python -m benchmarks.agent_replay", __doc__.split("\n\n")[0])
    key_ms_argument(parser)
    args = parser.parse_args(argv)
    policy = CostAwarePolicy(CostModel(load_costs(args.costs)))
    print_result(args, run(args, policy, recorded_turns(parser, args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
