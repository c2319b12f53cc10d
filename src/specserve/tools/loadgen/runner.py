"""The HTTP load generator: workloads × modes × concurrency (closed loop) or request rate (open loop).

Modes are interleaved so that machine drift (other processes, thermal state, a server warming up) falls
on every mode alike:

* closed loop, concurrency c: requests go in *waves* of c concurrent requests of one mode; every wave is
  followed by a wave of the next mode on the same prompts, and the order of the modes rotates from wave to
  wave. At c = 1 that is on, off, off, on, on, off ... request by request. A wave keeps the server's batch
  pure (all of one mode), so the comparison is speculation on vs off at the same concurrency.
* open loop, rate r: Poisson arrivals at r requests/s per mode; consecutive arrivals cycle through the
  modes on the same prompt, so the modes share the server (a mixed batch) and the time window.

Throughput of a mode is its output tokens over the wall time of its own waves (closed loop) or over the
whole window (open loop).
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.tools.loadgen.client import BenchClient, RequestParams, RequestResult, Target
from specserve.tools.loadgen.server_metrics import SpecCounters
from specserve.tools.workloads import Workload

Progress = Callable[[str], None]


@dataclass
class CellRun:
    """Requests of one (workload, mode, level) and the wall time they were measured over."""

    results: list[RequestResult] = field(default_factory=list)
    seconds: float = 0.0
    counters: SpecCounters | None = None
    """The server's /metrics speculation counters over this cell's requests, when it exports them."""

    def add_counters(self, delta: SpecCounters) -> None:
        if self.counters is None:
            self.counters = SpecCounters()
        self.counters.add(delta)


@dataclass(frozen=True)
class LoadPlan:
    workloads: list[Workload]
    targets: list[Target]
    concurrency: list[int]
    rates: list[float] | None = None
    """Open-loop request rates (requests/s per mode); None = the closed-loop concurrency sweep."""
    requests: int = 8
    """Requests per (workload, mode, level); at least the concurrency, so that it is reached."""
    params: RequestParams = RequestParams()
    seed: int = 0

    @property
    def level_name(self) -> str:
        return "rate" if self.rates else "concurrency"

    @property
    def levels(self) -> list[float]:
        return list(self.rates) if self.rates else [float(c) for c in self.concurrency]


@dataclass
class LoadRun:
    plan: LoadPlan
    cells: dict[tuple[str, str, float], CellRun] = field(default_factory=dict)
    """(workload, mode, level) → its requests."""
    seconds: float = 0.0
    metered: set[str] = field(default_factory=set)
    """Base URLs that export speculation counters on /metrics."""

    def cell(self, workload: str, mode: str, level: float) -> CellRun:
        return self.cells.setdefault((workload, mode, level), CellRun())


async def run_load(client: BenchClient, plan: LoadPlan, progress: Progress) -> LoadRun:
    run = LoadRun(plan)
    for url in {t.base_url for t in plan.targets}:
        if await client.spec_counters(url) is not None:
            run.metered.add(url)
    start = time.perf_counter()
    for level in plan.levels:
        for workload in plan.workloads:
            if plan.rates:
                await _open_loop(client, plan, workload, level, run, progress)
            else:
                await _closed_loop(client, plan, workload, int(level), run, progress)
    run.seconds = time.perf_counter() - start
    return run


async def _closed_loop(
    client: BenchClient,
    plan: LoadPlan,
    workload: Workload,
    concurrency: int,
    run: LoadRun,
    progress: Progress,
) -> None:
    total = max(plan.requests, concurrency)
    waves = math.ceil(total / concurrency)
    targets = plan.targets
    for wave in range(waves):
        size = min(concurrency, total - wave * concurrency)
        prompts = [workload.prompts[(wave * concurrency + j) % len(workload.prompts)] for j in range(size)]
        shift = wave % len(targets)
        summary = []
        for target in targets[shift:] + targets[:shift]:
            before = await _counters(client, run, target.base_url)
            started = time.perf_counter()
            results = await asyncio.gather(*(client.chat(target, p, plan.params) for p in prompts))
            cell = run.cell(workload.name, target.mode, float(concurrency))
            cell.seconds += time.perf_counter() - started
            cell.results.extend(results)
            after = await _counters(client, run, target.base_url)
            if before is not None and after is not None:
                cell.add_counters(after.minus(before))
            summary.append(f"{target.mode} {_summary(results)}")
        progress(f"[{workload.name} c={concurrency}] wave {wave + 1}/{waves}: " + " · ".join(summary))


async def _open_loop(
    client: BenchClient, plan: LoadPlan, workload: Workload, rate: float, run: LoadRun, progress: Progress
) -> None:
    targets = plan.targets
    total = plan.requests * len(targets)
    rng = random.Random(plan.seed)
    before = {url: await _counters(client, run, url) for url in run.metered}
    start = time.perf_counter()
    arrival = 0.0
    tasks = []
    for i in range(total):
        pair = i // len(targets)
        target = targets[(i + pair) % len(targets)]  # the first mode of each group rotates too
        prompt = workload.prompts[pair % len(workload.prompts)]
        tasks.append(asyncio.create_task(client.chat(target, prompt, plan.params)))
        arrival += rng.expovariate(rate * len(targets))
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    results = await asyncio.gather(*tasks)
    seconds = time.perf_counter() - start
    for target in targets:
        cell = run.cell(workload.name, target.mode, rate)
        cell.results.extend(r for r in results if r.mode == target.mode)
        cell.seconds = seconds
    for url, start_counters in before.items():
        # Modes share a server here: its counters go to the one mode there that may draft (not "off").
        drafting = [t for t in targets if t.base_url == url and t.mode != "off"]
        end_counters = await _counters(client, run, url)
        if len(drafting) == 1 and start_counters is not None and end_counters is not None:
            run.cell(workload.name, drafting[0].mode, rate).add_counters(end_counters.minus(start_counters))
    summary = " · ".join(f"{t.mode} {_summary([r for r in results if r.mode == t.mode])}" for t in targets)
    progress(f"[{workload.name} rate={rate:g}/s] {total} requests in {seconds:.1f} s: {summary}")


async def _counters(client: BenchClient, run: LoadRun, url: str) -> SpecCounters | None:
    return await client.spec_counters(url) if url in run.metered else None


def _summary(results: list[RequestResult]) -> str:
    speeds = [s for r in results if (s := r.tokens_per_second) is not None]
    errors = sum(r.error is not None for r in results)
    text = f"{statistics.median(speeds):.1f} tok/s" if speeds else "- tok/s"
    return text + (f" ({errors} errors)" if errors else "")
