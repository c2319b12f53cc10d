"""``specserve`` command line: generate, models, config (serve and bench come from their own modules)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from specserve.config import Settings, SettingsError, add_arguments, load_settings, redacted

GENERATE_SETTINGS = (
    "target",
    "draft",
    "model_dir",
    "context_size",
    "threads",
    "exact",
    "drafter",
    "num_draft_tokens",
    "draft_policy",
    "ngram_min_n",
    "draft_p_min",
    "load_draft",
    "gpu_layers",
)


class CliError(Exception):
    """A user error reported as one line, exit status 2."""


def _fail(message: str) -> NoReturn:
    print(f"specserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="Python log level (DEBUG, INFO, WARNING).")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="Generate text from a prompt with speculative decoding.")
    gen.add_argument("--prompt", required=True, help="Prompt text (a user message with --chat).")
    gen.add_argument("--chat", action="store_true", help="Apply the model's chat template.")
    gen.add_argument("--system", default=None, help="System message (with --chat).")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="Stop string (repeatable).")
    gen.add_argument("--ignore-eos", action="store_true", help="Generate max tokens even past EOS.")
    gen.add_argument("--json", action="store_true", help="Print one JSON object.")
    gen.add_argument("--config", default=None, help="YAML settings file.")
    add_arguments(gen, GENERATE_SETTINGS)

    models = sub.add_parser("models", help="Pull, list and verify models.")
    models.add_argument("action", choices=["pull", "list", "verify"])
    models.add_argument("names", nargs="*", help="Catalog names or paths (default: the default pair).")
    models.add_argument("--model-dir", default=None)
    models.add_argument("--json", action="store_true")

    bench = sub.add_parser("bench", help="Benchmark speculative vs plain decoding.")
    bench.add_argument("--in-process", action="store_true", help="Benchmark the engine without a server.")
    bench.add_argument("--output-dir", default="bench-out", help="Where report.json and report.md go.")
    bench.add_argument("--modes", default="plain,ngram,draft-model,auto", help="Comma-separated modes.")
    bench.add_argument("--kinds", default=None, help="Comma-separated prompt kinds (default: all).")
    bench.add_argument("--prompts", default=None, help="JSONL file of {kind, prompt} (default: built-in).")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--limit", type=int, default=None, help="Prompts per kind.")
    bench.add_argument(
        "--exact-cost", action="store_true", help="Only measure exact vs fast mode decode cost (interleaved)."
    )
    bench.add_argument("--config", default=None)
    add_arguments(bench, GENERATE_SETTINGS)

    serve = sub.add_parser("serve", help="Run the OpenAI-compatible HTTP server.")
    serve.add_argument("--config", default=None, help="YAML settings file.")
    add_arguments(serve)

    config = sub.add_parser("config", help="Show the effective configuration.")
    config.add_argument("action", choices=["show"])
    config.add_argument("--config", default=None)
    add_arguments(config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "models":
            return _models(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "serve":
            from specserve.server.main import serve

            return serve(load_settings(args, config_file=args.config), log_level=args.log_level)
        if args.command == "config":
            print(json.dumps(redacted(load_settings(args, config_file=args.config)), indent=2))
            return 0
    except (CliError, SettingsError, ValueError) as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from specserve.backends.base import BackendError
        from specserve.models import ModelStoreError

        if isinstance(exc, BackendError | ModelStoreError):
            _fail(str(exc))
        raise
    return 1


def _sampling(args: argparse.Namespace) -> Any:
    from specserve.request import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _generate(args: argparse.Namespace) -> int:
    from specserve.chat import render_chat
    from specserve.engine.builder import build_engine

    params = _sampling(args)  # validate before loading anything
    settings: Settings = load_settings(args, config_file=args.config)
    settings = _with_single_sequence(settings)
    engine, report = build_engine(settings)
    try:
        runtime = engine.target
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}
            ]
            prompt_ids = runtime.tokenize(render_chat(runtime, messages), parse_special=True)
        else:
            prompt_ids = runtime.tokenize(args.prompt)
        start = time.perf_counter()
        seq = engine.add_request("cli-0", prompt_ids, params)
        while engine.has_work():
            for out in engine.step():
                if not args.json:
                    sys.stdout.write(out.text_delta)
                    sys.stdout.flush()
        end = time.perf_counter()
    finally:
        engine.close()
    prefill_end = seq.first_token_time or end
    generate_s = max(end - prefill_end, 1e-9)
    tokens_per_second = round(max(len(seq.output_ids) - 1, 0) / generate_s, 3)
    result = {
        "text": seq.text,
        "token_ids": seq.output_ids,
        "finish_reason": seq.finish_reason,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(seq.output_ids)},
        "speculative": seq.stats.as_dict(),
        "timings": {
            "prompt_ms": round((prefill_end - start) * 1000, 2),
            "generate_ms": round(generate_s * 1000, 2),
            "tokens_per_second": tokens_per_second,
        },
        "engine": {"drafters": report.drafters, "notes": report.notes, "costs_ms": engine.costs.as_dict()},
    }
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print()
        stats = seq.stats
        print(
            f"[{len(seq.output_ids)} tokens, {tokens_per_second} tok/s, "
            f"finish={seq.finish_reason}, drafts={stats.num_drafts}, "
            f"accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens}, "
            f"mean acceptance length {stats.mean_acceptance_length:.2f}]",
            file=sys.stderr,
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specserve.bench.engine_bench import MODES, builtin_prompts, run_engine_bench
    from specserve.bench.engine_report import render_markdown

    if not args.in_process:
        raise CliError("only --in-process is available in this version")
    command = "specserve " + " ".join(sys.argv[1:]) if sys.argv[1:] else "specserve bench --in-process"
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.exact_cost:
        from specserve.bench.engine_bench import measure_exact_cost
        from specserve.bench.engine_report import render_exact_cost

        cost = measure_exact_cost(_with_single_sequence(load_settings(args, config_file=args.config)))
        (out / "exact_cost.json").write_text(json.dumps(cost, indent=2))
        (out / "exact_cost.md").write_text(render_exact_cost(cost, command))
        print(render_exact_cost(cost, command))
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise CliError(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    if "plain" not in modes:
        modes.insert(0, "plain")
    prompts = builtin_prompts() if args.prompts is None else _read_jsonl(Path(args.prompts))
    if args.kinds:
        kinds = set(args.kinds.split(","))
        prompts = [p for p in prompts if p["kind"] in kinds]
    if args.limit:
        per_kind: dict[str, int] = {}
        kept = []
        for p in prompts:
            per_kind[p["kind"]] = per_kind.get(p["kind"], 0) + 1
            if per_kind[p["kind"]] <= args.limit:
                kept.append(p)
        prompts = kept
    settings = _with_single_sequence(load_settings(args, config_file=args.config))
    result = run_engine_bench(
        settings, prompts, modes, args.max_tokens, progress=lambda m: print(m, file=sys.stderr)
    )
    data = result.as_dict()
    (out / "report.json").write_text(json.dumps(data, indent=2))
    (out / "report.md").write_text(render_markdown(data, command))
    print(render_markdown(data, command))
    return 0


def _read_jsonl(path: Any) -> list[dict[str, str]]:
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise CliError(f"{path}:{n}: expected an object with a string 'prompt'")
        rows.append({"kind": str(row.get("kind", "custom")), "prompt": row["prompt"]})
    return rows


def _with_single_sequence(settings: Settings) -> Settings:
    import dataclasses

    return dataclasses.replace(settings, max_running=1)


def _models(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specserve.models import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET, ModelStore

    store = ModelStore(Path(args.model_dir) if args.model_dir else None)
    names = args.names or [DEFAULT_TARGET, DEFAULT_DRAFT]
    if args.action == "pull":
        for name in names:
            if name not in CATALOG:
                raise CliError(f"unknown model {name!r}; catalog: {', '.join(CATALOG)}")
            path = store.pull(CATALOG[name], progress=sys.stderr.isatty())
            print(f"{name}: {path}")
        return 0
    if args.action == "list":
        rows = store.list()
        if args.json:
            print(json.dumps([vars(r) for r in rows], indent=2, default=str))
        for r in rows:
            if not args.json:
                state = "verified" if r.verified else ("present" if r.present else "missing")
                print(f"{r.name:32} {state:9} {r.size or 0:>14,} {r.path}")
        return 0
    ok = True
    for name in names:
        report = store.verify(CATALOG.get(name) or name, progress=sys.stderr.isatty())
        ok = ok and report.ok
        print(f"{name}: {'OK' if report.ok else 'MISMATCH'} size={report.size} sha256={report.sha256}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
