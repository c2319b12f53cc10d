"""What the suffix drafter's structure costs: microseconds per appended token and per proposal, beside a
Python dict trie of every suffix up to the same depth (the textbook suffix tree's Python form).

    .venv/bin/python benchmarks/suffix_cost.py [--tokens 4000] [--outputs 256] [--depth 32]

The corpus is synthetic, with code-like repetition (lines drawn from a pool of phrases, so suffixes recur);
a proposal is what the engine asks per step:
``available`` on a request whose context is a prompt of ``--tokens`` tokens, with ``--outputs`` finished
outputs of its tenant in the cache. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

from specserve.drafters.suffix import SuffixDrafter
from specserve.request import PositionalUniforms, SamplingParams
from specserve.sequence import Sequence, SequenceStatus


def corpus(n: int, rng: random.Random) -> list[int]:
    """Code-like ids: lines drawn from a small pool of phrases, so suffixes recur as in source files."""
    phrases = [[rng.randrange(2000) for _ in range(rng.randrange(3, 12))] for _ in range(150)]
    out: list[int] = []
    while len(out) < n:
        out.extend(rng.choice(phrases))
    return out[:n]


class DictTrie:
    """Every suffix up to ``depth`` tokens inserted into nested dicts with counts (one node per token)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root: dict[int, Any] = {}
        self.tokens: list[int] = []

    def append(self, token: int) -> None:
        self.tokens.append(token)
        start = max(0, len(self.tokens) - self.depth)
        for i in range(start, len(self.tokens)):
            node = self.root
            for t in self.tokens[i:]:
                node = node.setdefault(t, [0, {}])
                node[0] += 1
                node = node[1]

    def propose(self, context: list[int], k: int) -> list[int]:
        for length in range(min(self.depth, len(context)), 0, -1):
            node: Any = self.root
            for t in context[-length:]:
                child = node.get(t)
                if child is None:
                    break
                node = child[1]
            else:
                out: list[int] = []
                while node and len(out) < k:
                    token, (_count, node) = max(node.items(), key=lambda kv: kv[1][0])
                    out.append(token)
                return out
        return []


def cpu_name() -> str:
    """The CPU's model name, family and model (as /proc/cpuinfo says; the machine kind varies)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    return f"{fields.get('model name', '?')} (family {family}, model {model})"


def make_seq(rid: str, prompt: list[int], salt: str = "") -> Sequence:
    seq = Sequence(rid, prompt, SamplingParams(), PositionalUniforms(0))
    seq.cache_salt = salt
    return seq


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--outputs", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=400)
    parser.add_argument("--depth", type=int, default=32)
    args = parser.parse_args()
    rng = random.Random(0)
    drafter = SuffixDrafter(depth=args.depth, cache_requests=args.outputs, cache_tokens=10**9)
    for i in range(args.outputs):  # the tenant's finished outputs
        done = make_seq(f"o{i}", corpus(64, rng))
        drafter.begin(done)
        done.output_ids = corpus(args.output_tokens, rng)
        done.status = SequenceStatus.FINISHED
        drafter.release(done)
    prompt = corpus(args.tokens, rng)
    start = time.perf_counter()
    seq = make_seq("live", prompt)
    drafter.begin(seq)
    index_us = (time.perf_counter() - start) / len(prompt) * 1e6
    steps = 300
    proposal_s = []
    for _ in range(steps):
        t0 = time.perf_counter()
        option = drafter.available(seq, 16)
        drafter.propose([seq], [option.max_tokens])
        proposal_s.append(time.perf_counter() - t0)
        seq.output_ids.append(rng.choice(prompt))
    trie = DictTrie(args.depth)
    t0 = time.perf_counter()
    for token in prompt[:1000]:
        trie.append(token)
    trie_us = (time.perf_counter() - t0) / 1000 * 1e6
    t0 = time.perf_counter()
    for i in range(100):
        trie.propose(prompt[: 900 + i], 16)
    trie_propose_us = (time.perf_counter() - t0) / 100 * 1e6
    proposal_s.sort()
    print(
        json.dumps(
            {
                "cpu": cpu_name(),
                "python": platform.python_version(),
                "prompt_tokens": args.tokens,
                "cached_outputs": args.outputs,
                "cached_output_tokens": drafter.cache.num_tokens,
                "depth": args.depth,
                "index_us_per_token": round(index_us, 2),
                "proposal_us_p50": round(proposal_s[steps // 2] * 1e6, 1),
                "proposal_us_p90": round(proposal_s[int(steps * 0.9)] * 1e6, 1),
                "dict_trie_us_per_token": round(trie_us, 2),
                "dict_trie_proposal_us": round(trie_propose_us, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
