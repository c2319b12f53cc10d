"""Where the tools' results go: progress lines on stderr, a JSON and a Markdown report in a directory."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def command_line() -> str:
    """The command as the user typed it (reports record what produced them)."""
    return "specserve " + shlex.join(sys.argv[1:])


def stamped(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` preceded by the command that made it and the date."""
    return {"command": command_line(), "date": time.strftime("%Y-%m-%d %H:%M"), **report}


def write_report(out_dir: str | Path, data: dict[str, Any], markdown: str, stem: str = "report") -> Path:
    """``<stem>.json`` and ``<stem>.md`` in ``out_dir``, and the Markdown on stdout."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2, ensure_ascii=False))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown, end="" if markdown.endswith("\n") else "\n")
    return out
