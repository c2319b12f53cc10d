"""``specserve bench --url``: the parsed flags → the load generator's typed options → a report on disk."""

from __future__ import annotations

import argparse
import asyncio
import os

from specserve.tools.flags import names, parse_float_list, parse_int_list
from specserve.tools.loadgen.agent import (
    AGENT_WORKLOADS,
    SPEC_MODES,
    AgentBenchOptions,
    render_agent,
    run_agent_bench,
)
from specserve.tools.loadgen.bench import HttpBenchOptions, parse_peers, run_http_bench, spec_extension
from specserve.tools.loadgen.client import RequestParams, ServerOptions, normalize_base_url
from specserve.tools.loadgen.prefix import (
    PREFIX_WORKLOADS,
    PrefixBenchOptions,
    render_prefix,
    run_prefix_bench,
)
from specserve.tools.output import progress, stamped, write_report
from specserve.tools.workloads import ToolInputError, select_workloads


def server_options(args: argparse.Namespace) -> ServerOptions:
    """``--url`` with ``--api-key`` (default: ``$OPENAI_API_KEY``), ``--model`` and ``--timeout``."""
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    return ServerOptions(normalize_base_url(args.url), api_key, args.model, args.timeout)


def bench_over_http(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.max_tokens < 1:
        raise ToolInputError("--requests and --max-tokens must be >= 1")
    workload_names = names(args.workload)
    params = RequestParams(args.max_tokens, args.temperature, args.seed, args.ignore_eos)
    if any(n in AGENT_WORKLOADS for n in workload_names):
        return _agent_bench(args, workload_names, params)
    if any(n in PREFIX_WORKLOADS for n in workload_names):
        if not all(n in PREFIX_WORKLOADS for n in workload_names):
            raise ToolInputError(f"run {', '.join(PREFIX_WORKLOADS)} apart from other workloads")
        prefix = PrefixBenchOptions(
            server_options(args), workload_names, args.requests, params, parse_peers(args.peer_url)
        )
        report = stamped(asyncio.run(run_prefix_bench(prefix, progress)))
        write_report(args.output_dir, report, render_prefix(report))
        return 0
    from specserve.tools.loadgen.plots import write_plots
    from specserve.tools.loadgen.report import render_markdown

    options = HttpBenchOptions(
        server=server_options(args),
        workloads=select_workloads(workload_names, args.prompts, args.limit),
        concurrency=parse_int_list(args.concurrency, "--concurrency"),
        rates=parse_float_list(args.rate, "--rate") if args.rate else None,
        requests=args.requests,
        params=params,
        compare_spec=args.compare_spec,
        extension=spec_extension(args.drafter, args.num_draft_tokens),
        peer=args.peer,
        peers=parse_peers(args.peer_url),
    )
    report = stamped(asyncio.run(run_http_bench(options, progress)))
    out = write_report(args.output_dir, report, render_markdown(report))
    write_plots(report, out)
    return 0


def _agent_bench(args: argparse.Namespace, workload_names: list[str], params: RequestParams) -> int:
    if workload_names != list(AGENT_WORKLOADS):
        raise ToolInputError(f"run {', '.join(AGENT_WORKLOADS)} apart from other workloads")
    modes = names(args.agent_modes) or list(SPEC_MODES)
    unknown = [m for m in modes if m not in SPEC_MODES]
    if unknown:
        raise ToolInputError(f"--agent-modes: unknown {', '.join(unknown)}; known: {', '.join(SPEC_MODES)}")
    options = AgentBenchOptions(
        server_options(args),
        modes,
        parse_int_list(args.concurrency, "--concurrency"),
        params,
        parse_peers(args.peer_url),
    )
    report = stamped(asyncio.run(run_agent_bench(options, progress)))
    write_report(args.output_dir, report, render_agent(report))
    return 0
