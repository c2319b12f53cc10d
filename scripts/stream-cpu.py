#!/usr/bin/env python3
"""CPU per streamed token, by thread, of a running server (specserve's, llama-server's): what the server's
own work costs beside the matrix products (docs/BENCHMARKS.md, "Side by side with stock llama-server").

    .venv/bin/python scripts/stream-cpu.py URL PID [--model NAME] [--tokens 200] [--rounds 3] [--plain]

Streams one greedy chat of ``--tokens`` tokens (end of text ignored) per round and prints the inter-token
latency and, per thread of process PID, CPU milliseconds per streamed token, read from
``/proc/PID/task/TID/schedstat`` (nanoseconds, unlike ``stat``'s 10 ms ticks). ``--plain`` asks specserve
for plain decoding (``speculative.enabled = false``); the main thread (``main``) runs the event loop.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import httpx

PROMPT = "Write a long story about a dragon who learns to program in Python."


def thread_cpu_ms(pid: int) -> dict[str, float]:
    """CPU milliseconds so far of each thread of ``pid``, by ``TID name`` (``main`` for the main thread)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = "main" if int(tid) == pid else f.read().strip()
        except OSError:  # the thread ended
            continue
        out[f"{tid} {name}"] = ns / 1e6
    return out


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("url")
    parser.add_argument("pid", type=int)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    body: dict[str, object] = {
        "model": args.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": args.tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    if args.plain:
        body["speculative"] = {"enabled": False}
    for round_ in range(args.rounds):
        before = thread_cpu_ms(args.pid)
        arrivals = []
        with httpx.stream("POST", args.url + "/v1/chat/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data:") and '"content"' in line:
                    arrivals.append(time.perf_counter())
        after = thread_cpu_ms(args.pid)
        tokens = max(len(arrivals) - 1, 1)
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
        per_thread = sorted(
            ((after[k] - before.get(k, 0.0)) / tokens, k) for k in after if after[k] - before.get(k, 0.0) > 1
        )
        print(f"round {round_}: {len(arrivals)} chunks, ITL p50 {statistics.median(gaps):.2f} ms")
        for ms, thread in reversed(per_thread):
            print(f"  {thread:28} {ms:7.3f} ms CPU per token")


if __name__ == "__main__":
    main()
