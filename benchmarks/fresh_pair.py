"""A fresh process's first speculative request under the default policy, and the same prompt plainly, in
that process.

``python -m benchmarks.fresh_generate --paired`` runs this once per prompt and round. Two fresh
processes (fresh_generate.py's unpaired comparison) also differ by this VM's drift between processes (up
to ±20 %), which hides a policy's loss of a few per cent; here both decodes run seconds apart in one
process, so their ratio is what the policy did to a first request: no acceptance history, the cost table
as a fresh process loads it. A short plain warm-up comes first so that neither decode is the process's
first pass over the weights; the order of the two alternates by round (``--plain-first``), since the
second decode of a process ran a few per cent faster than the first in an auto-first run. Plain decoding
drafts nothing, so auto's request is the first the policy sees drafts for either way; each decode is its own
tenant, so the suffix drafter cannot copy the other decode's answer.

    python -m benchmarks.fresh_pair --prompt TEXT --max-tokens N [--plain-first] [engine flags]

prints one JSON object: ``{"auto": result, "plain": result}``, each as ``specserve generate --json`` would,
auto's with ``within_request`` added: what its speculative steps cost against the plain steps of the same
request. Two decodes seconds apart still differ by ±5 % on this VM; a step of the same request a few tokens
earlier does not, so that figure resolves a policy's loss of 1-2 % where the tok/s ratio cannot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.config import ENGINE_GROUPS
from specserve.sequence import SpeculationOptions, decode_timings

WARM_UP_TOKENS = 8


@dataclass(frozen=True)
class DecodeStep:
    """One decoding step of a request (the steps after its first token)."""

    seconds: float
    """Its target pass plus the drafting done for it."""
    drafts: int
    """Drafts verified in it (0 or 1 for a request alone)."""
    tokens: int
    """Tokens it emitted."""


def decode(engine: Any, request_id: str, prompt_ids: list[int], params: Any, plain: bool) -> dict[str, Any]:
    """One request alone in ``engine``; its result in ``specserve generate --json``'s shape, and its
    decoding steps (``steps``, not JSON)."""
    speculation = SpeculationOptions(drafter="none") if plain else None
    start = time.perf_counter()
    # Each decode its own tenant: the suffix drafter keeps a tenant's finished outputs, and auto copying
    # the plain decode's answer (or the warm-up's) is not what a fresh process's first request sees.
    seq = engine.add_request(request_id, prompt_ids, params, speculation, cache_salt=request_id)
    steps: list[DecodeStep] = []
    while engine.has_work():
        drafts, emitted, drafting = seq.stats.num_drafts, len(seq.output_ids), seq.draft_seconds
        engine.step()
        if emitted:  # a decoding step (the prompt's steps emit the first token)
            seconds = engine.last_pass.seconds + seq.draft_seconds - drafting
            steps.append(DecodeStep(seconds, seq.stats.num_drafts - drafts, len(seq.output_ids) - emitted))
    return {
        "token_ids": list(seq.output_ids),
        "speculative": seq.stats.as_dict(),
        "timings": decode_timings(seq.first_token_time, len(seq.output_ids), start, time.perf_counter()),
        "steps": steps,
    }


def within_request(
    steps: list[DecodeStep], plain_steps: list[DecodeStep], decode_ms: float
) -> dict[str, Any]:
    """What ``steps``' drafting steps cost beyond the plain steps their tokens would have taken, priced at
    the median plain step of the same request (of ``plain_steps``, the plain decode of the same prompt,
    when it drafted at every step). ``ratio``: the request's decode time without that net cost over its
    decode time (``decode_ms``), i.e. auto / plain in tokens/s with the drift between two decodes removed;
    below 1 where speculation lost time. A step cut short by max_tokens counts only what it emitted."""
    plain = [s.seconds for s in steps if s.drafts == 0] or [s.seconds for s in plain_steps]
    step = statistics.median(plain) if plain else 0.0
    drafting = [s for s in steps if s.drafts > 0]
    net = sum(s.seconds - s.tokens * step for s in drafting)
    seconds = decode_ms / 1000
    return {
        "plain_step_ms": round(step * 1000, 3),
        "drafting_steps": len(drafting),
        "net_ms": round(net * 1000, 2),
        "ratio": round((seconds - net) / seconds, 4) if seconds > 0 else 1.0,
    }


def main(argv: Sequence[str]) -> int:
    from specserve.chat import chat_prompt_ids
    from specserve.config_sources import add_arguments, load_settings
    from specserve.engine.builder import build_engine
    from specserve.request import SamplingParams

    parser = argparse.ArgumentParser(prog="python -m benchmarks.fresh_pair")
    parser.add_argument("--prompt", required=True, help="A user message (the chat template is applied).")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--plain-first", action="store_true", help="Decode plainly first, then under auto.")
    add_arguments(parser, ENGINE_GROUPS)
    args = parser.parse_args(argv)
    settings = dataclasses.replace(load_settings(args), max_running=1)  # as generate: one sequence
    engine, report = build_engine(settings)
    try:
        hello = chat_prompt_ids(engine.target, [{"role": "user", "content": "Say hello."}])
        decode(engine, "warm-up", hello, SamplingParams(max_tokens=WARM_UP_TOKENS), plain=True)
        prompt_ids = chat_prompt_ids(engine.target, [{"role": "user", "content": args.prompt}])
        params = SamplingParams(max_tokens=args.max_tokens)  # greedy
        if args.plain_first:
            plain = decode(engine, "plain", prompt_ids, params, plain=True)
        auto = decode(engine, "auto", prompt_ids, params, plain=False)
        if not args.plain_first:
            plain = decode(engine, "plain", prompt_ids, params, plain=True)
    finally:
        engine.close()
    auto["within_request"] = within_request(auto["steps"], plain["steps"], auto["timings"]["generate_ms"])
    del auto["steps"], plain["steps"]
    auto["engine"] = {"drafters": report.drafters}
    print(json.dumps({"auto": auto, "plain": plain}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
