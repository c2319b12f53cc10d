"""Set up the servers for ``bench --url`` and ``verify --url``: reach them, find their models, pick modes.

Our server (it answers with a ``speculative`` object) is switched per request with the request extension:
mode ``on`` sends ``speculative: {"enabled": true, …}``, ``off`` sends ``{"enabled": false}``. Any other
server (``--peer``, or detected by the missing ``speculative`` object) gets plain OpenAI requests only, in
one mode, ``default``; ``--peer-url NAME=URL`` adds more servers, each a mode named NAME, measured in the
same interleaved run (e.g. llama.cpp's ``llama-server -m target -md draft``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from specserve.bench.bench_report import build_report
from specserve.bench.http_client import BenchClient, RequestParams, Target, normalize_base_url
from specserve.bench.loadgen import LoadPlan, run_load
from specserve.bench.verify_tool import VerifyOptions, VerifyResult, verify_http
from specserve.bench.workloads import BenchInputError, Workload

Progress = Callable[[str], None]
RESERVED_MODES = ("on", "off", "default")


def spec_extension(args: argparse.Namespace) -> dict[str, Any]:
    """The request extension of mode ``on``: --drafter and --num-draft-tokens when given."""
    extension: dict[str, Any] = {"enabled": True}
    if getattr(args, "drafter", None) is not None:
        extension["drafter"] = args.drafter
    if getattr(args, "num_draft_tokens", None) is not None:
        extension["num_draft_tokens"] = args.num_draft_tokens
    return extension


def parse_peers(values: list[str]) -> list[tuple[str, str]]:
    peers: list[tuple[str, str]] = []
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or not url:
            raise BenchInputError(f"--peer-url expects NAME=URL, got {value!r}")
        if name in RESERVED_MODES or name in (n for n, _ in peers):
            raise BenchInputError(f"--peer-url name {name!r} is taken; choose another")
        peers.append((name, normalize_base_url(url)))
    return peers


async def run_http_bench(
    args: argparse.Namespace,
    workloads: list[Workload],
    concurrency: list[int],
    rates: list[float] | None,
    progress: Progress,
) -> dict[str, Any]:
    base = normalize_base_url(args.url)
    peers = parse_peers(args.peer_url)
    width = max(concurrency) * (2 + len(peers)) + 4 if not rates else 256
    client = BenchClient(args.api_key, args.timeout, width)
    notes: list[str] = []
    try:
        model = args.model or await client.served_model(base)
        ours = False if args.peer else await client.reports_speculative(base, model)
        if not ours and not args.peer:
            notes.append(f"{base} reports no `speculative` object: measured as a peer (plain requests)")
        if args.compare_spec and not ours:
            raise BenchInputError(
                f"--compare-spec needs a specserve server; {base} cannot switch speculation per request "
                "(measure another server as its own mode with --peer-url NAME=URL)"
            )
        extension = spec_extension(args)
        targets = (
            [Target("on", base, model, extension), Target("off", base, model, {"enabled": False})]
            if args.compare_spec
            else [Target("default", base, model)]
        )
        peer_info = {}
        for name, url in peers:
            peer_model = await client.served_model(url)
            targets.append(Target(name, url, peer_model))
            peer_info[name] = {"url": url, "model": peer_model}
        progress(
            f"{base}: model {model} ({'specserve' if ours else 'peer'}); modes {[t.mode for t in targets]}"
        )
        params = RequestParams(args.max_tokens, args.temperature, args.seed, args.ignore_eos)
        plan = LoadPlan(workloads, targets, concurrency, rates, args.requests, params, args.seed or 0)
        run = await run_load(client, plan, progress)
    finally:
        await client.aclose()
    meta = {
        "server": {"url": base, "model": model, "reports_speculative": ours, "peers": peer_info},
        "speculative_extension": extension if args.compare_spec else None,
        "requests_per_cell": args.requests,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "notes": notes,
    }
    report = build_report(run, meta)
    spec_records = [r for r in report["records"] if r["num_drafts"]]
    if spec_records and all(r["accepted_per_position"] is None for r in spec_records):
        report["notes"].append("the server reports no per-position acceptance (`accepted_per_position`)")
    return report


async def run_http_verify(
    args: argparse.Namespace, workloads: list[Workload], options: VerifyOptions, progress: Progress
) -> tuple[VerifyResult, dict[str, Any]]:
    base = normalize_base_url(args.url)
    client = BenchClient(args.api_key, args.timeout, 8)
    try:
        model = args.model or await client.served_model(base)
        if not await client.reports_speculative(base, model):
            raise BenchInputError(
                f"{base} reports no `speculative` object: verify --url needs a specserve server"
            )
        spec = Target("speculative", base, model, spec_extension(args))
        plain = Target("plain", base, model, {"enabled": False})
        if args.reference_url:
            ref = normalize_base_url(args.reference_url)
            plain = Target("reference", ref, await client.served_model(ref))
        result = await verify_http(client, spec, plain, workloads, options, progress)
    finally:
        await client.aclose()
    meta = {
        "mode": "http",
        "url": base,
        "model": model,
        "speculative_extension": spec.extension,
        "reference_url": plain.base_url if args.reference_url else None,
    }
    return result, meta
