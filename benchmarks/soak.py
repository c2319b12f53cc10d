"""``python -m benchmarks.soak``: one server under moderate load for long; does it leak?

Starts ``specserve serve`` with ``PYTHONTRACEMALLOC=1`` (and an admin key, for ``GET /admin/heap``), drives
it with ``--clients`` clients of the load campaign's request mix (``benchmarks.load``), and every
``--interval`` seconds samples the server process: resident memory, open file descriptors and threads from
``/proc``, and the Python heap traced by tracemalloc. Writes ``soak.json`` and ``soak.png``.

Passes when, after ``--warmup`` seconds, resident memory at the end is within 5 % of memory after warm-up,
file descriptors and threads are back where they were, and the traced Python heap has not grown by more
than 5 % — not counting the prefix cache's host-RAM tier (``prefix_cache_bytes{tier="host"}``), which is
meant to fill up to its budget and is sampled alongside.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.load import Tally, one_request

ADMIN_KEY = "soak-admin"
HOST_TIER_METRIC = 'specserve:prefix_cache_bytes{tier="host"}'


def proc_sample(pid: int) -> dict[str, int]:
    """Resident KiB, threads and file descriptors of the server and its engine process, summed."""
    total = {"rss_kib": 0, "threads": 0, "fds": 0}
    children = [int(c) for t in os.listdir(f"/proc/{pid}/task") for c in _children(pid, t)]
    for process in (pid, *children):
        status = Path(f"/proc/{process}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        total["rss_kib"] += int(fields["VmRSS"].split()[0])
        total["threads"] += int(fields["Threads"])
        total["fds"] += len(os.listdir(f"/proc/{process}/fd"))
    return total


def _children(pid: int, task: str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/task/{task}/children").read_text().split()
    except OSError:
        return []


async def sample(client: httpx.AsyncClient, url: str, pid: int, started: float) -> dict[str, Any]:
    heap = (await client.get(f"{url}/admin/heap", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).json()
    metrics = (await client.get(f"{url}/metrics")).text
    host = next((float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(HOST_TIER_METRIC)), 0.0)
    return {
        "t": round(time.monotonic() - started, 1),
        **proc_sample(pid),
        # the API process's and the engine process's (the prefix cache's host tier is the engine's)
        "heap_bytes": heap.get("traced_bytes", 0) + heap.get("engine", {}).get("traced_bytes", 0),
        "host_tier_bytes": int(host),
        "top_heap_sites": heap.get("top", [])[:5] + heap.get("engine", {}).get("top", [])[:5],
    }


@dataclass(frozen=True)
class SoakOptions:
    """How long to drive the server, how hard, and how often to sample it (seconds)."""

    duration: float = 3600.0
    warmup: float = 300.0
    """Growth is measured from the first sample after this."""
    interval: float = 60.0
    clients: int = 4
    seed: int = 0


async def sampler(
    client: httpx.AsyncClient,
    url: str,
    pid: int,
    options: SoakOptions,
    started: float,
    out: list[dict[str, Any]],
) -> None:
    while time.monotonic() - started < options.duration:
        out.append(await sample(client, url, pid, started))
        await asyncio.sleep(options.interval)


async def drive(client: httpx.AsyncClient, url: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        await one_request(client, url, rng, tally)


async def soak(url: str, pid: int, options: SoakOptions) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    tally = Tally()
    started = time.monotonic()
    until = started + options.duration
    async with httpx.AsyncClient(timeout=httpx.Timeout(330.0)) as client:
        await asyncio.gather(
            sampler(client, url, pid, options, started, samples),
            *(drive(client, url, options.seed + i, until, tally) for i in range(options.clients)),
        )
        await asyncio.sleep(2.0)
        final = await sample(client, url, pid, started)
    samples.append(final)
    warm = next(s for s in samples if s["t"] >= options.warmup)
    cache_growth = final["host_tier_bytes"] - warm["host_tier_bytes"]
    growth = {  # relative growth, the host tier's own growth taken out
        "rss_kib": (final["rss_kib"] - warm["rss_kib"] - cache_growth / 1024) / warm["rss_kib"],
        "heap_bytes": (final["heap_bytes"] - warm["heap_bytes"] - cache_growth)
        / max(1, warm["heap_bytes"] - warm["host_tier_bytes"]),
        "host_tier_bytes": cache_growth,
    }
    return {
        "duration_s": options.duration,
        "clients": options.clients,
        "requests": dict(tally.outcomes),
        "after_warmup": warm,
        "end": final,
        "growth": growth,
        "top_heap_sites_at_end": final["top_heap_sites"],
        "samples": samples,
        "passed": growth["rss_kib"] <= 0.05
        and growth["heap_bytes"] <= 0.05
        and final["fds"] <= warm["fds"]
        and final["threads"] <= warm["threads"],
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    axes[0].plot(t, [s["rss_kib"] / 1024 for s in samples])
    axes[0].set_ylabel("resident MiB")
    axes[1].plot(t, [(s["heap_bytes"] or 0) / 2**20 for s in samples], label="traced Python heap")
    axes[1].plot(t, [s.get("host_tier_bytes", 0) / 2**20 for s in samples], label="prefix cache, host tier")
    axes[1].set_ylabel("MiB")
    axes[1].legend()
    axes[2].plot(t, [s["fds"] for s in samples], label="fds")
    axes[2].plot(t, [s["threads"] for s in samples], label="threads")
    axes[2].legend()
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.axvline(report["after_warmup"]["t"] / 60, color="grey", linestyle=":")
    fig.suptitle(f"soak: {report['clients']} clients, {report['duration_s'] / 60:g} min")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--warmup", type=float, default=300.0)
    parser.add_argument("--interval", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--port", type=int, default=8126)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="docs/reliability")
    parser.add_argument("serve_args", nargs="*", help="Extra arguments for specserve serve (after --).")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONTRACEMALLOC": "1", "SPECSERVE_ADMIN_KEY": ADMIN_KEY}
    command = [
        sys.executable,
        "-m",
        "specserve.cli",
        "serve",
        "--port",
        str(args.port),
        "--log-level",
        "warning",
    ]
    with open(out / "soak-server.log", "wb") as log:
        server = subprocess.Popen([*command, *args.serve_args], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    try:
        while not _ready(url):
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}; see {out / 'soak-server.log'}")
            time.sleep(2)
        options = SoakOptions(args.duration, args.warmup, args.interval, args.clients, args.seed)
        report = asyncio.run(soak(url, server.pid, options))
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
    report["server_exit_status"] = code
    (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "soak.png")
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    return 0 if report["passed"] and code == 0 else 1


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
