"""``specserve bench --url``: set up the servers, pick the modes, run the load, build the report.

Our server (it answers with a ``speculative`` object) is switched per request with the request extension:
mode ``on`` sends ``speculative: {"enabled": true, …}``, ``off`` sends ``{"enabled": false}``, each as a
tenant of its own (``cache_salt``): the modes take turns on the same prompts, and ``on`` would otherwise
copy ``off``'s answer from the suffix drafter's cache and reuse its prompt's KV. Any other
server (``peer``, or detected by the missing ``speculative`` object) gets plain OpenAI requests only, in
one mode, ``default``; ``peers`` adds more servers, each a mode of its own name, measured in the same
interleaved run (e.g. llama.cpp's ``llama-server -m target -md draft``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.tools.loadgen.client import (
    BenchClient,
    RequestParams,
    ServerOptions,
    Target,
    normalize_base_url,
)
from specserve.tools.loadgen.report import build_report
from specserve.tools.loadgen.runner import LoadPlan, run_load
from specserve.tools.workloads import ToolInputError, Workload

Progress = Callable[[str], None]
RESERVED_MODES = ("on", "off", "default")


@dataclass(frozen=True)
class HttpBenchOptions:
    """One HTTP benchmark: the server, the modes, the load and the requests' parameters."""

    server: ServerOptions
    workloads: list[Workload]
    concurrency: list[int] = field(default_factory=lambda: [1])
    rates: list[float] | None = None
    """Open-loop request rates per mode; None: the closed-loop concurrency sweep."""
    requests: int = 8
    """Requests per workload × mode × level."""
    params: RequestParams = RequestParams()
    compare_spec: bool = False
    """Speculation on vs off on the same specserve server, interleaved."""
    extension: dict[str, Any] = field(default_factory=lambda: {"enabled": True})
    """Mode ``on``'s ``speculative`` request object (see :func:`spec_extension`)."""
    peer: bool = False
    """The server is not specserve: send plain requests only."""
    peers: list[tuple[str, str]] = field(default_factory=list)
    """More servers as (mode name, base URL), from :func:`parse_peers`."""


def spec_extension(drafter: str | None, num_draft_tokens: int | None) -> dict[str, Any]:
    """The request extension of mode ``on``: the drafter and draft length when given."""
    extension: dict[str, Any] = {"enabled": True}
    if drafter is not None:
        extension["drafter"] = drafter
    if num_draft_tokens is not None:
        extension["num_draft_tokens"] = num_draft_tokens
    return extension


def compare_targets(base: str, model: str, extension: dict[str, Any]) -> list[Target]:
    """Modes ``on`` and ``off`` of one specserve server, each its own tenant for this run."""
    run = uuid.uuid4().hex[:12]
    return [
        Target("on", base, model, extension, tenant=f"bench-on-{run}"),
        Target("off", base, model, {"enabled": False}, tenant=f"bench-off-{run}"),
    ]


def parse_peers(values: list[str]) -> list[tuple[str, str]]:
    """``NAME=URL`` values → (mode name, base URL); a malformed or taken name is a ToolInputError."""
    peers: list[tuple[str, str]] = []
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or not url:
            raise ToolInputError(f"--peer-url expects NAME=URL, got {value!r}")
        if name in RESERVED_MODES or name in (n for n, _ in peers):
            raise ToolInputError(f"--peer-url name {name!r} is taken; choose another")
        peers.append((name, normalize_base_url(url)))
    return peers


async def run_http_bench(options: HttpBenchOptions, progress: Progress) -> dict[str, Any]:
    base = options.server.base_url
    width = max(options.concurrency) * (2 + len(options.peers)) + 4 if not options.rates else 256
    client = BenchClient(options.server.api_key, options.server.timeout, width)
    notes: list[str] = []
    try:
        model = options.server.model or await client.served_model(base)
        ours = False if options.peer else await client.reports_speculative(base, model)
        if not ours and not options.peer:
            notes.append(f"{base} reports no `speculative` object: measured as a peer (plain requests)")
        if options.compare_spec and not ours:
            raise ToolInputError(
                f"--compare-spec needs a specserve server; {base} cannot switch speculation per request "
                "(measure another server as its own mode with --peer-url NAME=URL)"
            )
        targets = (
            compare_targets(base, model, options.extension)
            if options.compare_spec
            else [Target("default", base, model)]
        )
        peer_info = {}
        for name, url in options.peers:
            peer_model = await client.served_model(url)
            targets.append(Target(name, url, peer_model))
            peer_info[name] = {"url": url, "model": peer_model}
        progress(
            f"{base}: model {model} ({'specserve' if ours else 'peer'}); modes {[t.mode for t in targets]}"
        )
        params = options.params
        plan = LoadPlan(
            options.workloads, targets, options.concurrency, options.rates, options.requests, params,
            params.seed or 0,
        )  # fmt: skip
        run = await run_load(client, plan, progress)
    finally:
        await client.aclose()
    meta = {
        "server": {"url": base, "model": model, "reports_speculative": ours, "peers": peer_info},
        "speculative_extension": options.extension if options.compare_spec else None,
        "requests_per_cell": options.requests,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "seed": params.seed,
        "ignore_eos": params.ignore_eos,
        "notes": notes,
    }
    report = build_report(run, meta)
    spec_records = [r for r in report["records"] if r["num_drafts"]]
    if spec_records and all(r["accepted_per_position"] is None for r in spec_records):
        report["notes"].append("the server reports no per-position acceptance (`accepted_per_position`)")
    return report
