"""``specserve bench --url URL --workload chat-multiturn shared-system-prompt``: KV reuse across requests.

Two workloads where requests share prefixes:

* ``chat-multiturn``: conversations of 4-8 turns; each turn's request is the whole history (earlier user
  messages and the server's own answers) plus a new user message. Turn order is kept per conversation and
  conversations are interleaved, so the server holds several histories at once.
* ``shared-system-prompt``: one ~1,000-token system prompt and short, varying questions.

Modes, run one after the other against the same server (order alternating by round):

* ``cached``: requests as any client sends them; the server reuses what it can.
* ``cold``: each request carries a fresh ``cache_salt`` (specserve, vLLM), so nothing can be reused: the
  same server and requests, without the cache.
* every ``--peer-url NAME=URL`` (e.g. llama-server, whose ``cache_prompt`` is on by default), as is.

Reported per workload and mode: TTFT p50 of requests that could reuse something (turns >= 2; questions after
the first), the ratio to ``cold``, the prefix-cache hit rate from ``usage.prompt_tokens_details``, and whether
greedy output is the same as ``cold`` request for request.
"""

from __future__ import annotations

import statistics
import uuid
from dataclasses import dataclass, field
from typing import Any

from specserve.tools.loadgen.bench import Progress
from specserve.tools.loadgen.client import BenchClient, RequestParams, ServerOptions, Target
from specserve.tools.workloads import builtin_workload

PREFIX_WORKLOADS = ("chat-multiturn", "shared-system-prompt")

FOLLOW_UPS = (
    "Thanks. Now add type hints and a docstring.",
    "Explain the trickiest line in two sentences.",
    "Rewrite it to handle empty input.",
    "Write one pytest test for it.",
    "Make the names clearer, keep the behaviour.",
    "What is its time complexity?",
    "Show the final version once more, complete.",
)


@dataclass(frozen=True)
class Conversation:
    system: str | None
    user_turns: tuple[str, ...]


def chat_multiturn(count: int) -> list[Conversation]:
    """``count`` conversations of 4-8 turns: a coding request, then follow-ups on the answer."""
    openers = list(builtin_workload("code-writing").prompts) + list(builtin_workload("code-edit").prompts)
    conversations = []
    for i in range(count):
        turns = 4 + i % 5
        follow = [FOLLOW_UPS[(i + j) % len(FOLLOW_UPS)] for j in range(turns - 1)]
        conversations.append(Conversation(None, (openers[i % len(openers)], *follow)))
    return conversations


def shared_system_prompt(count: int) -> list[Conversation]:
    """``count`` one-question conversations under the same long system prompt."""
    rules = list(builtin_workload("summarization").prompts) + list(
        builtin_workload("code-completion").prompts
    )  # ~960 tokens of the default target
    system = "You are the support assistant of a software company. House rules and reference material:\n\n"
    system += "\n\n".join(rules)
    questions = list(builtin_workload("qa").prompts)
    return [Conversation(system, (questions[i % len(questions)],)) for i in range(count)]


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    text: str
    error: str | None


@dataclass
class ModeRun:
    turns: list[Turn] = field(default_factory=list)


async def _run_mode(
    client: BenchClient,
    target: Target,
    conversations: list[Conversation],
    params: RequestParams,
    cold: bool,
) -> ModeRun:
    """Every conversation, turns in order, conversations interleaved round-robin (one request at a time)."""
    run = ModeRun()
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": c.system}] if c.system else [] for c in conversations
    ]
    for turn in range(max(len(c.user_turns) for c in conversations)):
        for i, conv in enumerate(conversations):
            if turn >= len(conv.user_turns):
                continue
            histories[i].append({"role": "user", "content": conv.user_turns[turn]})
            extra = {"cache_salt": uuid.uuid4().hex} if cold else None
            result = await client.chat(target, histories[i], params, extra)
            histories[i].append({"role": "assistant", "content": result.text})
            run.turns.append(
                Turn(
                    i,
                    turn,
                    result.ttft,
                    result.prompt_tokens,
                    result.cached_tokens,
                    result.text,
                    result.error,
                )
            )
    return run


def _reusable(workload: str, turn: Turn) -> bool:
    """Requests that a cache could serve in part: later turns, and every question after the first."""
    return turn.turn >= 1 if workload == "chat-multiturn" else turn.conversation >= 1


def summarize(workload: str, runs: dict[str, ModeRun]) -> dict[str, Any]:
    cold = runs.get("cold")
    rows: dict[str, Any] = {}
    for mode, run in runs.items():
        ttfts = [t.ttft for t in run.turns if _reusable(workload, t) and t.ttft is not None]
        prompt = sum(t.prompt_tokens or 0 for t in run.turns)
        cached = [t.cached_tokens for t in run.turns if t.cached_tokens is not None]
        row: dict[str, Any] = {
            "requests": len(run.turns),
            "errors": sum(t.error is not None for t in run.turns),
            "ttft_p50_reusable": statistics.median(ttfts) if ttfts else None,
            "ttft_p50_all": statistics.median([t.ttft for t in run.turns if t.ttft is not None] or [0.0]),
            "prompt_tokens": prompt,
            "cached_tokens": sum(cached) if cached else None,
            "hit_rate": sum(cached) / prompt if cached and prompt else None,
        }
        if cold is not None and mode != "cold":
            base = rows.get("cold") or {}
            cold_p50 = base.get("ttft_p50_reusable")
            row["ttft_vs_cold"] = row["ttft_p50_reusable"] / cold_p50 if cold_p50 and ttfts else None
            row["same_output_as_cold"] = sum(
                a.text == b.text for a, b in zip(run.turns, cold.turns, strict=True)
            )
        rows[mode] = row
    return rows


@dataclass(frozen=True)
class PrefixBenchOptions:
    """One prefix-cache benchmark: the server, the workloads (of ``PREFIX_WORKLOADS``), their size."""

    server: ServerOptions
    workloads: list[str]
    conversations: int = 8
    """Conversations (chat-multiturn) or questions (shared-system-prompt) per workload."""
    params: RequestParams = RequestParams()
    peers: list[tuple[str, str]] = field(default_factory=list)


async def run_prefix_bench(options: PrefixBenchOptions, progress: Progress) -> dict[str, Any]:
    base = options.server.base_url
    client = BenchClient(options.server.api_key, options.server.timeout, 4)
    params = options.params
    count = options.conversations
    results: dict[str, Any] = {}
    try:
        model = options.server.model or await client.served_model(base)
        ours = await client.reports_speculative(base, model)
        targets = [("cached", Target("cached", base, model), False)]
        if ours:
            targets.append(("cold", Target("cold", base, model), True))
        for name, url in options.peers:
            targets.append((name, Target(name, url, await client.served_model(url)), False))
        for workload in options.workloads:
            conversations = (chat_multiturn if workload == "chat-multiturn" else shared_system_prompt)(count)
            runs: dict[str, ModeRun] = {}
            # cold first: it warms nothing up for the others (its salts are never seen again)
            for mode, target, cold in sorted(targets, key=lambda t: t[0] != "cold"):
                progress(f"{workload}: {mode} ({len(conversations)} conversations)")
                runs[mode] = await _run_mode(client, target, conversations, params, cold)
            results[workload] = {
                "summary": summarize(workload, runs),
                "turns": {m: [t.__dict__ for t in r.turns] for m, r in runs.items()},
            }
    finally:
        await client.aclose()
    return {"server": {"url": base, "model": model, "specserve": ours}, "workloads": results}


def render_prefix(report: dict[str, Any]) -> str:
    out = [
        "## Prefix cache",
        "",
        f"Command: `{report['command']}`",
        "",
        "TTFT p50 of requests that can reuse a prefix (turns >= 2; questions after the first), cached vs "
        "`cold` (a fresh `cache_salt` per request: same server, nothing reused); hit rate = cached / prompt "
        "tokens (`usage.prompt_tokens_details.cached_tokens`); same output = greedy text equal to `cold`.",
        "",
        "| workload | mode | requests | TTFT p50 (s) | vs cold | hit rate | same output |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, data in report["workloads"].items():
        for mode, row in data["summary"].items():
            p50 = row["ttft_p50_reusable"]
            ratio = row.get("ttft_vs_cold")
            hit = row["hit_rate"]
            same = row.get("same_output_as_cold")
            out.append(
                f"| {workload} | {mode} | {row['requests']} | {'-' if p50 is None else f'{p50:.3f}'} | "
                f"{'-' if ratio is None else f'{ratio:.2f}x'} | {'-' if hit is None else f'{hit:.0%}'} | "
                f"{'-' if same is None else f'{same}/' + str(row['requests'])} |"
            )
    return "\n".join(out) + "\n"
