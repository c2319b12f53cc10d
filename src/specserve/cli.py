"""``specserve`` command line: generate, models, config (serve and bench come from their own modules)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from specserve.config import ENGINE_GROUPS, Settings
from specserve.config_sources import add_arguments, load_settings, redacted
from specserve.errors import UserError

# Modules that add their own subcommands: each has ``add_subcommands(subparsers)`` and sets a ``handler``
# default (a function of the parsed arguments returning the exit status) on its parsers.
PLUGIN_COMMANDS: tuple[str, ...] = ("specserve.tools.commands",)


class CliError(UserError):
    """A user error reported as one line, exit status 2."""


def _fail(message: str) -> NoReturn:
    print(f"specserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    parser.add_argument(
        "--log-level", dest="global_log_level", default=None, help="Python log level (DEBUG, INFO, WARNING)."
    )
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
    add_arguments(gen, ENGINE_GROUPS)

    models = sub.add_parser("models", help="Pull, list and verify models.")
    models.add_argument("action", choices=["pull", "list", "verify"])
    models.add_argument("names", nargs="*", help="Catalog names or paths (default: the default pair).")
    models.add_argument("--model-dir", default=None)
    models.add_argument("--json", action="store_true")

    serve = sub.add_parser("serve", help="Run the OpenAI-compatible HTTP server.")
    serve.add_argument("--config", default=None, help="YAML settings file.")
    add_arguments(serve)

    config = sub.add_parser("config", help="Show the effective configuration, or document every setting.")
    config.add_argument(
        "action", choices=["show", "docs"], help="show: effective values; docs: Markdown table."
    )
    config.add_argument("--config", default=None)
    add_arguments(config)
    for module in PLUGIN_COMMANDS:
        importlib.import_module(module).add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "log_level", None) is None:  # `specserve --log-level X serve` sets the serve setting too
        args.log_level = args.global_log_level and args.global_log_level.lower()
    logging.basicConfig(
        level=(args.log_level or "WARNING").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if getattr(args, "handler", None) is not None:
            return int(args.handler(args))
        if args.command == "generate":
            return _generate(args)
        if args.command == "models":
            return _models(args)
        if args.command == "serve":
            settings = load_settings(args, config_file=args.config)
            if settings.replicas > 0:
                return _serve_replicas(settings)
            from specserve.server.main import serve

            return serve(settings)
        if args.command == "config" and args.action == "docs":
            from specserve.config_docs import settings_table

            print(settings_table())
            return 0
        if args.command == "config":
            settings = load_settings(args, config_file=args.config)
            shown = redacted(settings) | {"exactness": _planned_exactness(settings.exact)}
            print(json.dumps(shown, indent=2))
            return 0
    except UserError as exc:  # ours: a bad flag, setting, model or file; anything else is a bug
        _fail(str(exc))
    except KeyboardInterrupt:
        return 130
    return 1


def _serve_replicas(settings: Settings) -> int:
    """Ray Serve: N engine replicas behind one endpoint (specserve.rayserve), if the extra is installed."""
    from specserve.rayserve import require_ray

    try:
        require_ray()
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    from specserve.logging import configure_logging
    from specserve.rayserve.app import run

    configure_logging(settings.log_level, settings.log_format)
    return run(settings)


def _planned_exactness(exact: bool) -> dict[str, object]:
    """What exact mode will run as with the installed llama.cpp (the model's own self-check comes at load)."""
    from specserve.backends.llama_cpp import EXACT_MAX_ROWS, build_is_batch_invariant

    invariant = build_is_batch_invariant()
    if not exact:
        mode, why = "off", "exact = false: fastest kernels, no token-for-token promise"
    elif invariant:
        mode, why = "batch-invariant", "patched build; proved on the model by a self-check at load"
    else:
        mode, why = "capped", f"stock llama.cpp build: no weight repacking, calls of <= {EXACT_MAX_ROWS} rows"
    return {"mode": mode, "build_batch_invariant": invariant, "why": why}


def _sampling(args: argparse.Namespace) -> Any:
    from specserve.request import SamplingParams

    if args.max_tokens < 1:  # 0 is the HTTP API's prompt-only request; generate always generates
        raise CliError(f"max_tokens must be >= 1, got {args.max_tokens}")
    try:
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
    except ValueError as exc:  # SamplingParams names the bad value
        raise CliError(str(exc)) from None


def _generate(args: argparse.Namespace) -> int:
    from specserve.chat import chat_prompt_ids
    from specserve.engine.builder import build_engine
    from specserve.engine.offline import OfflineEngine

    params = _sampling(args)  # validate before loading anything
    settings: Settings = load_settings(args, config_file=args.config)
    settings = _with_single_sequence(settings)
    built, report = build_engine(settings)
    engine = OfflineEngine(built)
    try:
        runtime = built.target
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}
            ]
            prompt_ids = chat_prompt_ids(runtime, messages)
        else:
            prompt_ids = runtime.tokenize(args.prompt)
        start = time.perf_counter()
        try:
            request = engine.add_request("cli-0", prompt_ids, params)
        except ValueError as exc:  # the prompt does not fit the context
            raise CliError(str(exc)) from None
        while engine.has_work():
            for out in engine.step():
                if not args.json:
                    sys.stdout.write(out.text_delta)
                    sys.stdout.flush()
        end = time.perf_counter()
    finally:
        engine.close()
    timings = request.timings(start, end)
    tokens_per_second = timings["tokens_per_second"]
    result = {
        "text": request.text,
        "token_ids": request.output_ids,
        "finish_reason": request.finish_reason,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(request.output_ids)},
        "speculative": request.stats.as_dict(),
        "timings": timings,
        "engine": {"drafters": report.drafters, "notes": report.notes, "costs_ms": built.costs.as_dict()},
    }
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print()
        stats = request.stats
        print(
            f"[{len(request.output_ids)} tokens, {tokens_per_second} tok/s, "
            f"finish={request.finish_reason}, drafts={stats.num_drafts}, "
            f"accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens}, "
            f"mean acceptance length {stats.mean_acceptance_length:.2f}]",
            file=sys.stderr,
        )
    return 0


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
            # "verified": the word of `models verify` (the JSON keeps the name users see)
            shown = [{"name": r.name, "path": str(r.path), "present": r.present, "size": r.size,
                      "verified": r.checksum_ok} for r in rows]  # fmt: skip
            print(json.dumps(shown, indent=2))
        for r in rows:
            if not args.json:
                state = "verified" if r.checksum_ok else ("present" if r.present else "missing")
                print(f"{r.name:32} {state:9} {r.size or 0:>14,} {r.path}")
        return 0
    ok = True
    for name in names:
        report = store.check_checksum(CATALOG.get(name) or name, progress=sys.stderr.isatty())
        ok = ok and report.ok
        print(f"{name}: {'OK' if report.ok else 'MISMATCH'} size={report.size} sha256={report.sha256}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
