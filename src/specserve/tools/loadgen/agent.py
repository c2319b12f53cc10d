"""``specserve bench --url URL --workload agent``: multi-turn agent traces, where output repeats text.

The traces (``prompts/agent-traces.jsonl``, written for this project) are what a coding agent sends: a tool
result carrying a source file and an answer that re-emits it fixed, then a follow-up that changes one line
of that answer (``file-edit``); a JSON plan restated with one field changed (``plan-restate``); one
extraction schema over several records (``extraction-batch``); the same task run again (``repeat-task``);
and plain prompts as a control (``control``). Each turn's request is the whole history, the server's own
answers included, as an agent loop sends it.

Modes: specserve with the request extension (``plain`` = speculation off, ``ngram``, ``suffix``, ``auto``),
and every ``--peer-url NAME=URL`` as it is (e.g. llama-server with ``--spec-type ngram-mod``). Each
(mode, concurrency) run is its own tenant on specserve (a fresh ``cache_salt``): no run drafts from another
run's outputs or reuses its KV, while the requests of one run share both, as one agent's would. A peer keeps
whatever it keeps (run a fresh peer per level for the same footing: ``scripts/bench-agent.sh`` does).

The modes take turns wave by wave: ``concurrency`` traces at a time (in file order), run in every mode, the
first mode moving one place along each wave, before the next wave starts. Run one mode after another, a
slow phase of a shared machine (this project's VMs lose 20-40 % for minutes) landed on whole modes: one run
measured a copy-free control at 0.80x plain where modes with no drafts at all moved 0.95-1.21x. Taking
turns spreads such a phase over every mode, as ``--compare-spec`` does for the built-in workloads.

Reported per trace kind and mode: output tokens, decode tokens/s (output tokens after the first over the
time after the first, summed over the kind's requests), the mean acceptance length (specserve; llama-server
reports drafted and accepted tokens: their ratio), and for each kind the share of output tokens that repeat
text seen before (the request's history or an earlier request's output in the same run: tokens covered by
an 8-token window seen there, counted on the ``plain`` run's outputs, tokenized by the server).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from specserve.tools.loadgen.bench import Progress
from specserve.tools.loadgen.client import BenchClient, RequestParams, ServerOptions, Target

AGENT_WORKLOADS = ("agent",)
SPEC_MODES: dict[str, dict[str, Any]] = {
    "plain": {"enabled": False},
    "ngram": {"enabled": True, "drafter": "ngram"},
    "suffix": {"enabled": True, "drafter": "suffix"},
    "auto": {"enabled": True},
}
COPY_WINDOW = 8
"""Tokens a window of output must match, earlier, to count as repeated text."""


@dataclass(frozen=True)
class Trace:
    name: str
    kind: str
    system: str | None
    turns: tuple[str, ...]


def agent_traces() -> list[Trace]:
    text = resources.files("specserve.tools").joinpath("prompts/agent-traces.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [Trace(r["trace"], r["kind"], r.get("system"), tuple(r["turns"])) for r in rows]


@dataclass
class TurnResult:
    trace: str
    kind: str
    turn: int
    order: int
    """When the request was sent within its run (0 = first)."""
    wave: int
    """The wave of traces it belongs to (every mode runs wave ``w`` before any runs ``w + 1``)."""
    history: str
    output_tokens: int
    decode_seconds: float
    text: str
    speculative: dict[str, Any] | None
    timings: dict[str, Any] | None
    error: str | None


@dataclass
class _Run:
    turns: list[TurnResult] = field(default_factory=list)
    sent: int = 0


async def _run_trace(
    client: BenchClient,
    target: Target,
    trace: Trace,
    params: RequestParams,
    salt: str | None,
    run: _Run,
    wave: int,
) -> None:
    history: list[dict[str, str]] = [{"role": "system", "content": trace.system}] if trace.system else []
    for i, turn in enumerate(trace.turns):
        history.append({"role": "user", "content": turn})
        order, run.sent = run.sent, run.sent + 1
        result = await client.chat(target, list(history), params, {"cache_salt": salt} if salt else None)
        decode = result.latency - result.ttft if result.ttft is not None else 0.0
        seen = "\n".join(m["content"] for m in history)
        run.turns.append(
            TurnResult(
                trace.name, trace.kind, i, order, wave, seen, result.output_tokens, decode, result.text,
                result.speculative, result.timings, result.error,
            )
        )  # fmt: skip
        history.append({"role": "assistant", "content": result.text})


async def _run_level(
    client: BenchClient,
    targets: list[Target],
    traces: list[Trace],
    params: RequestParams,
    level: int,
    progress: Progress,
) -> dict[str, _Run]:
    """Every trace in every mode, turns in order: ``level`` traces at a time (in file order, so repeats
    follow each other), each wave in every mode in turn (see the module docstring)."""
    runs = {target.mode: _Run() for target in targets}
    if not targets:
        return runs
    salts = {t.mode: uuid.uuid4().hex if t.extension is not None else None for t in targets}
    waves = [traces[i : i + level] for i in range(0, len(traces), level)]
    for w, wave in enumerate(waves):
        shift = w % len(targets)
        for target in targets[shift:] + targets[:shift]:
            progress(f"agent traces: wave {w + 1}/{len(waves)} at concurrency {level}: {target.mode}")
            run, salt = runs[target.mode], salts[target.mode]
            await asyncio.gather(*(_run_trace(client, target, t, params, salt, run, w) for t in wave))
    return runs


def _mal(turns: list[TurnResult]) -> float | None:
    drafts = sum((t.speculative or {}).get("num_drafts", 0) for t in turns)
    accepted = sum((t.speculative or {}).get("num_accepted_tokens", 0) for t in turns)
    return 1.0 + accepted / drafts if drafts else None


def _peer_acceptance(turns: list[TurnResult]) -> float | None:
    drafted = sum((t.timings or {}).get("draft_n", 0) or 0 for t in turns)
    accepted = sum((t.timings or {}).get("draft_n_accepted", 0) or 0 for t in turns)
    return accepted / drafted if drafted else None


def summarize(run: _Run, plain: _Run | None) -> dict[str, Any]:
    """Per trace kind (and ``all``); ``same_as_plain``: answers equal to the ``plain`` run's, turn by turn
    (greedy speculation must change none)."""
    rows: dict[str, Any] = {}
    kinds = dict.fromkeys(t.kind for t in run.turns)
    reference = {(t.trace, t.turn): t.text for t in plain.turns} if plain is not None else {}
    for kind in [*kinds, "all"]:
        turns = [t for t in run.turns if kind in ("all", t.kind)]
        decoded = sum(max(t.output_tokens - 1, 0) for t in turns if t.error is None)
        seconds = sum(t.decode_seconds for t in turns if t.error is None)
        rows[kind] = {
            "requests": len(turns),
            "errors": sum(t.error is not None for t in turns),
            "output_tokens": sum(t.output_tokens for t in turns),
            "tokens_per_second": decoded / seconds if seconds > 0 else None,
            "mean_acceptance_length": _mal(turns),
            "peer_draft_acceptance": _peer_acceptance(turns),
            "same_as_plain": sum(reference.get((t.trace, t.turn)) == t.text for t in turns)
            if reference
            else None,
        }
    return rows


def _windows(ids: list[int]) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + COPY_WINDOW]) for i in range(len(ids) - COPY_WINDOW + 1)}


def copy_share(outputs: list[list[int]], seen_before: list[set[tuple[int, ...]]]) -> float | None:
    """Share of output tokens covered by a ``COPY_WINDOW``-token window that ``seen_before[i]`` holds."""
    covered = total = 0
    for ids, seen in zip(outputs, seen_before, strict=True):
        mark = [False] * len(ids)
        for i in range(len(ids) - COPY_WINDOW + 1):
            if tuple(ids[i : i + COPY_WINDOW]) in seen:
                mark[i : i + COPY_WINDOW] = [True] * COPY_WINDOW
        covered += sum(mark)
        total += len(ids)
    return covered / total if total else None


async def copy_shares(client: BenchClient, base: str, model: str, run: _Run) -> dict[str, float | None]:
    """Per kind, the share of the run's output tokens that repeat earlier text (see the module docstring)."""
    turns = sorted(run.turns, key=lambda t: t.order)
    outputs = [await client.tokenize(base, model, t.text) for t in turns]
    histories = [await client.tokenize(base, model, t.history) for t in turns]
    earlier: set[tuple[int, ...]] = set()
    seen: list[set[tuple[int, ...]]] = []
    for ids, history in zip(outputs, histories, strict=True):
        seen.append(earlier | _windows(history))
        earlier |= _windows(ids)
    shares: dict[str, float | None] = {}
    for kind in [*dict.fromkeys(t.kind for t in turns), "all"]:
        idx = [i for i, t in enumerate(turns) if kind in ("all", t.kind)]
        shares[kind] = copy_share([outputs[i] for i in idx], [seen[i] for i in idx])
    return shares


@dataclass(frozen=True)
class AgentBenchOptions:
    server: ServerOptions
    modes: list[str]
    """specserve modes (of ``SPEC_MODES``) measured on ``server``."""
    concurrency: list[int]
    params: RequestParams = RequestParams(max_tokens=256)
    peers: list[tuple[str, str]] = field(default_factory=list)


async def run_agent_bench(options: AgentBenchOptions, progress: Progress) -> dict[str, Any]:
    base = options.server.base_url
    client = BenchClient(options.server.api_key, options.server.timeout, max(options.concurrency) + 4)
    traces = agent_traces()
    levels: dict[str, Any] = {}
    try:
        model = options.server.model or await client.served_model(base)
        ours = await client.reports_speculative(base, model)
        targets = [Target(m, base, model, SPEC_MODES[m]) for m in options.modes if ours]
        targets += [Target(name, url, await client.served_model(url)) for name, url in options.peers]
        for level in options.concurrency:
            runs = await _run_level(client, targets, traces, options.params, level, progress)
            reference = runs.get("plain") or next(iter(runs.values()))
            levels[str(level)] = {
                "summary": {mode: summarize(run, runs.get("plain")) for mode, run in runs.items()},
                "copy_share": await copy_shares(client, base, model, reference) if ours else {},
                "turns": {m: [t.__dict__ for t in r.turns] for m, r in runs.items()},
            }
    finally:
        await client.aclose()
    return {"server": {"url": base, "model": model, "specserve": ours}, "levels": levels}


def render_agent(report: dict[str, Any]) -> str:
    out = [
        "## Agent traces",
        "",
        f"Command: `{report['command']}`",
        "",
        "Decode tokens/s per trace kind (output tokens after the first over the time after the first, summed "
        "over the kind's requests); x plain = the ratio to specserve's `plain` mode of the same level; MAL "
        "= mean acceptance length (specserve), or drafted-token acceptance (`acc`, a peer's own count); "
        "repeated = share of output tokens covered by an 8-token window of earlier text; same as plain = "
        "answers equal to the `plain` run's (greedy).",
        "",
        "| level | kind | repeated | mode | requests | tokens | tok/s | x plain | MAL / acc | same |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level, data in report["levels"].items():
        summary = data["summary"]
        plain = summary.get("plain", {})
        for kind in next(iter(summary.values())):
            share = data["copy_share"].get(kind)
            for mode, rows in summary.items():
                row, base = rows[kind], plain.get(kind, {})
                tps, ref = row["tokens_per_second"], base.get("tokens_per_second")
                mal, acc = row["mean_acceptance_length"], row["peer_draft_acceptance"]
                quality = f"{mal:.2f}" if mal else (f"acc {acc:.0%}" if acc is not None else "-")
                same, requests = row["same_as_plain"], row["requests"]
                out.append(
                    f"| {level} | {kind} | {'-' if share is None else f'{share:.0%}'} | {mode} | "
                    f"{requests}{'' if not row['errors'] else ' (' + str(row['errors']) + ' err)'} | "
                    f"{row['output_tokens']} | {'-' if tps is None else f'{tps:.1f}'} | "
                    f"{'-' if not (tps and ref) else f'{tps / ref:.2f}x'} | {quality} | "
                    f"{'-' if same is None else f'{same}/{requests}'} |"
                )
    return "\n".join(out) + "\n"
