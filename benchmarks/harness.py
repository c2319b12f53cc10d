"""What the engine measurements' entry points share: their flags, their settings, their command line in a
report, and a user error as one line.

Each measurement that ``specserve bench --in-process`` ran under a flag (``--exact-cost``,
``--vs-llama-bench``, ``--fresh-process``, ``--grammar-cost``) is ``python -m benchmarks.<name>`` now, with
the flags it read there: ``--output-dir``, ``--repeats``, ``--config`` and the engine settings' flags
(``--target``, ``--threads``, ``--exact`` …, as ``specserve generate`` takes them), plus its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import sys
from collections.abc import Callable, Sequence

from specserve.config import ENGINE_GROUPS, Settings
from specserve.config_sources import add_arguments, load_settings
from specserve.errors import UserError


def engine_parser(module: str, description: str | None) -> argparse.ArgumentParser:
    """A parser for ``python -m <module>`` with the flags every engine measurement reads; the caller adds
    its own and ``engine_flags`` adds the engine settings' last (as ``specserve bench`` listed them)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output-dir", default="bench-out", help="Where the JSON and Markdown reports go.")
    parser.add_argument("--repeats", type=int, default=1, help="Rounds (each measurement has its minimum).")
    parser.add_argument("--log-level", default=None, help="Python log level (DEBUG, INFO, WARNING).")
    return parser


def engine_flags(parser: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per engine setting (models and speculation), as ``specserve bench``."""
    parser.add_argument("--config", default=None, help="YAML settings file.")
    add_arguments(parser, ENGINE_GROUPS)


def settings_of(args: argparse.Namespace) -> Settings:
    """The settings of the flags, the environment and ``--config``; one sequence at a time (as bench)."""
    return dataclasses.replace(load_settings(args, config_file=args.config), max_running=1)


def threads_of(settings: Settings) -> int:
    return settings.threads or os.cpu_count() or 1


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command as typed (reports record what produced them)."""
    return shlex.join(["python", "-m", module, *argv])


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The parsed flags; logging set up at ``--log-level`` (WARNING by default, as ``specserve``)."""
    args = parser.parse_args(list(argv))
    logging.basicConfig(
        level=(args.log_level or "WARNING").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args


def run(module: str, main: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    """``main(argv)``; a user error (a bad flag value, setting, model or prompt file) is one line,
    ``python -m <module>: error: …``, and exit status 2, as the ``specserve`` command line reports it."""
    try:
        return main(list(sys.argv[1:] if argv is None else argv))
    except UserError as exc:
        print(f"python -m {module}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
