"""``python -m benchmarks.load``: many misbehaving clients against one server, then an audit.

Clients (``--clients``, 64 by default) loop for ``--duration`` seconds, each request drawn at random:

* streamed or not (half each); speculation on or off; stop strings on some; ``max_tokens`` tiny (1-4),
  normal (16-64) or huge (2,000, which runs until the client's patience ends);
* 20 % of streams are dropped after a random number of chunks, 5 % of requests are abandoned before their
  first token (the connection closes while the request waits or prefills);
* every ``--burst-every`` seconds a burst of ``--burst`` extra requests arrives at once, past the queue;
* 5 % are greedy probes (fixed prompts, non-streamed; a 429 retried) whose outputs are re-generated alone
  afterwards.

A watcher polls ``/ready`` once a second throughout. The audit afterwards, written as JSON:

* the server answers; nothing stuck: within ``SETTLE_S`` (10 s) of the last client request,
  ``/v1/internal/state`` shows no running or waiting request and every request is counted;
* the client-side tally of requests that left the client (by outcome) and the server's ``requests_total``
  deltas (by outcome) add up to the same number of requests, and the server counted no ``error``;
* every greedy probe equals the same request run alone, with speculation off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from specserve.tools.workloads import builtin_workload

OUTCOME_METRIC = "specserve:requests_total"
SETTLE_S = 10.0
"""After the last client request, the server must be idle, with every request counted, within this."""
PROBE_ATTEMPTS = 20
"""Tries a greedy probe makes while the server answers 429."""


def _prompts() -> list[str]:
    names = ("code-edit", "qa", "creative", "code-writing")
    return [prompt for name in names for prompt in builtin_workload(name).prompts]


@dataclass(frozen=True)
class CampaignOptions:
    """One campaign against the server at ``url`` (see the module docstring)."""

    url: str
    clients: int = 64
    duration: float = 600.0
    """Seconds the clients loop."""
    burst: int = 80
    """Extra requests fired at once in a burst."""
    burst_every: float = 60.0
    max_probes: int = 40
    """Greedy probes re-run alone at the end."""
    seed: int = 0


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    probes: list[tuple[str, bool, str]] = field(default_factory=list)
    """(prompt, speculation on, output text) of greedy probes that completed."""
    ready_failures: int = 0
    ready_polls: int = 0
    errors: list[str] = field(default_factory=list)


async def server_outcomes(client: httpx.AsyncClient, url: str) -> Counter[str]:
    text = (await client.get(f"{url}/metrics")).text
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith(OUTCOME_METRIC + "{"):
            label = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[label] = int(float(line.rsplit(" ", 1)[1]))
    return counts


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally) -> None:
    prompts = _PROMPTS
    roll = rng.random()
    if roll < 0.05:  # a greedy probe
        prompt, spec = rng.choice(prompts[:6]), rng.random() < 0.5
        probe = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "speculative": {"enabled": spec}}
        # A probe retries a full queue, as a client with a retry policy does: with nearly every request
        # rejected, probes that try once can all be rejected and then nothing is checked.
        for _ in range(PROBE_ATTEMPTS):
            response = await client.post(f"{url}/v1/completions", json=probe)
            tally.outcomes[_classify(response.status_code)] += 1
            if response.status_code != 429:
                break
            await asyncio.sleep(0.2)
        if response.status_code == 200:
            tally.probes.append((prompt, spec, response.json()["choices"][0]["text"]))
        return
    stream = rng.random() < 0.5
    size = rng.random()
    max_tokens = rng.randint(1, 4) if size < 0.3 else 2000 if size > 0.97 else rng.randint(16, 64)
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": rng.choice(prompts)}],
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.7]),
        "stream": stream,
        "speculative": {"enabled": rng.random() < 0.7},
    }
    if rng.random() < 0.2:
        body["stop"] = rng.sample(["\n\n", "```", ".", "def ", "return"], 2)
    patience = 60.0 if max_tokens == 2000 else 300.0
    abandon = rng.random() < 0.05
    drop_after = rng.randint(0, 8) if stream and rng.random() < 0.2 else None
    sent = 0  # 1: the request started to leave this client, 2: all of it left

    async def trace(event: str, info: dict[str, Any]) -> None:
        nonlocal sent  # the server can only count requests that reached it
        if event == "http11.send_request_headers.started":
            sent = max(sent, 1)
        elif event == "http11.send_request_body.complete":
            sent = 2

    extensions = {"trace": trace}
    try:
        async with asyncio.timeout(rng.uniform(0.05, 1.0) if abandon else patience):
            if not stream:
                response = await client.post(f"{url}/v1/chat/completions", json=body, extensions=extensions)
                tally.outcomes[_classify(response.status_code)] += 1
                return
            async with client.stream(
                "POST", f"{url}/v1/chat/completions", json=body, extensions=extensions
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    tally.outcomes[_classify(response.status_code)] += 1
                    return
                chunks = 0
                async for line in response.aiter_lines():
                    if line.startswith("data:") and '"error"' in line:
                        tally.outcomes["stream_error"] += 1
                        return
                    if line.startswith("data:"):
                        chunks += 1
                        if drop_after is not None and chunks > drop_after:
                            tally.outcomes["client_dropped"] += 1
                            return
                tally.outcomes["success"] += 1
    except TimeoutError:
        kind = "client_abandoned" if abandon else "client_gave_up"
        tally.outcomes[(kind, f"{kind}_partly_sent", kind)[sent] if sent else f"{kind}_unsent"] += 1
    except httpx.HTTPError as exc:
        tally.outcomes["transport_error"] += 1
        tally.errors.append(f"{type(exc).__name__}: {exc}")


def _sent(tally: Tally) -> tuple[int, int]:
    """Requests that left the client whole, and abandoned ones that were cut off while leaving (the server
    may or may not have received those)."""
    whole = sum(n for kind, n in tally.outcomes.items() if not kind.endswith(("_unsent", "_partly_sent")))
    return whole, sum(n for kind, n in tally.outcomes.items() if kind.endswith("_partly_sent"))


def _classify(status: int) -> str:
    return {200: "success", 429: "rejected_429", 504: "timed_out", 503: "unavailable"}.get(
        status, "invalid_request" if 400 <= status < 500 else "error"
    )


async def client_loop(client: httpx.AsyncClient, url: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        await one_request(client, url, rng, tally)


async def bursts(
    client: httpx.AsyncClient, url: str, options: CampaignOptions, until: float, tally: Tally
) -> None:
    rng = random.Random(options.seed + 10_000)
    while time.monotonic() + options.burst_every < until:
        await asyncio.sleep(options.burst_every)
        await asyncio.gather(*(one_request(client, url, rng, tally) for _ in range(options.burst)))


async def watch_ready(client: httpx.AsyncClient, url: str, until: float, tally: Tally) -> None:
    while time.monotonic() < until:
        tally.ready_polls += 1
        try:
            ok = (await client.get(f"{url}/ready", timeout=5)).status_code == 200
        except httpx.HTTPError:
            ok = False
        tally.ready_failures += not ok
        await asyncio.sleep(1.0)


async def campaign(options: CampaignOptions) -> dict[str, Any]:
    url = options.url.rstrip("/")
    limits = httpx.Limits(max_connections=options.clients + options.burst + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(330.0), limits=limits) as client:
        before = await server_outcomes(client, url)
        tally = Tally()
        until = time.monotonic() + options.duration
        started = time.monotonic()
        await asyncio.gather(
            *(client_loop(client, url, options.seed + i, until, tally) for i in range(options.clients)),
            bursts(client, url, options, until, tally),
            watch_ready(client, url, until, tally),
        )
        elapsed = time.monotonic() - started
        # Settling: a request's record is written after its last byte, and the engine drops a request whose
        # client left between two steps; under load both lag the clients a little. Nothing may take long.
        sent = _sent(tally)[0]
        settle_deadline = time.monotonic() + SETTLE_S
        while True:
            state = (await client.get(f"{url}/v1/internal/state")).json()
            after = await server_outcomes(client, url)
            server = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
            idle = state["running"] == 0 and state["waiting"] == 0
            if (idle and sum(server.values()) >= sent) or time.monotonic() > settle_deadline:
                break
            await asyncio.sleep(0.2)
        settled_after = time.monotonic() - started - elapsed
        mismatches = []
        for prompt, spec, text in tally.probes[: options.max_probes]:
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "speculative": {"enabled": False}}
            alone = (await client.post(f"{url}/v1/completions", json=body)).json()["choices"][0]["text"]
            if alone != text:
                mismatches.append({"prompt": prompt[:60], "speculation": spec, "load": text, "alone": alone})
    client_total, partly = _sent(tally)
    report = {
        "duration_s": round(elapsed, 1),
        "clients": options.clients,
        "client_outcomes": dict(tally.outcomes),
        "client_requests_sent": client_total,
        "client_requests_partly_sent": partly,
        "server_outcomes": server,
        "server_requests": sum(server.values()),
        "ready_polls": tally.ready_polls,
        "ready_failures": tally.ready_failures,
        "state_after": state,
        "settled_after_s": round(settled_after, 2),
        "probes_checked": min(len(tally.probes), options.max_probes),
        "probe_mismatches": mismatches,
        "transport_errors": tally.errors[:20],
    }
    report["passed"] = (
        client_total <= report["server_requests"] <= client_total + partly
        and server.get("error", 0) == 0
        and tally.ready_failures == 0
        and state["running"] == 0
        and state["waiting"] == 0
        and not mismatches
        and not tally.errors
    )
    return report


_PROMPTS = _prompts()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--burst", type=int, default=80, help="Extra requests fired at once in a burst.")
    parser.add_argument("--burst-every", type=float, default=60.0)
    parser.add_argument("--max-probes", type=int, default=40, help="Greedy probes re-run alone at the end.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="Write the JSON report here too.")
    args = parser.parse_args(argv)
    options = CampaignOptions(
        args.url, args.clients, args.duration, args.burst, args.burst_every, args.max_probes, args.seed
    )
    report = asyncio.run(campaign(options))
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
