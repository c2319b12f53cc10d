"""Prompt sets for the tools (benchmarks, the consistency check, evaluate): the built-in workloads shipped
with the package, and user JSONL files.

A workload is a name and a list of user prompts. The built-in ones (``prompts/<name>.jsonl``) were written
for this project and cover the situations where speculation behaves differently: output that repeats the
input (``code-edit``: the n-gram drafter shines), predictable output (code, Q&A) and free text
(``creative``: low acceptance). A user file has one JSON object per line with a string ``prompt`` and
optionally ``workload`` (or ``kind``) naming the group it belongs to (default ``custom``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specserve.errors import UserError

BUILTIN_WORKLOADS = ("code-writing", "code-completion", "code-edit", "qa", "summarization", "creative")


class ToolInputError(UserError):
    """Bad input for a tool (a flag, a prompt file, a workload name, a server that is not specserve)."""


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[str, ...]

    def __post_init__(self) -> None:
        assert self.prompts, f"workload {self.name} has no prompts"


def builtin_rows(file: str) -> list[dict[str, Any]]:
    """The rows of ``prompts/<file>.jsonl`` shipped with the package (``{"prompt", …}`` objects)."""
    text = resources.files("specserve.tools").joinpath(f"prompts/{file}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def builtin_workload(name: str) -> Workload:
    if name not in BUILTIN_WORKLOADS:
        raise ToolInputError(f"unknown workload {name!r}; built-in: {', '.join(BUILTIN_WORKLOADS)}")
    return Workload(name, tuple(row["prompt"] for row in builtin_rows(name)))


def read_jsonl(path: Path) -> list[dict[str, str]]:
    """Rows ``{"kind", "prompt"}`` of a user JSONL file; any problem is a ToolInputError naming the line."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ToolInputError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ToolInputError(f"{path}: not UTF-8 text") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ToolInputError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ToolInputError(f"{path}:{n}: expected an object with a non-empty string 'prompt'")
        kind = row.get("workload", row.get("kind", "custom"))
        parsed: dict[str, Any] = {"kind": str(kind), "prompt": row["prompt"]}
        if "schema" in row:  # a JSON Schema the output must follow (bench --in-process)
            if not isinstance(row["schema"], dict):
                raise ToolInputError(f"{path}:{n}: 'schema' must be a JSON Schema object")
            parsed["schema"] = row["schema"]
        rows.append(parsed)
    if not rows:
        raise ToolInputError(f"{path}: no prompts")
    return rows


def select_workloads(
    names: list[str] | None, prompts_file: str | None, limit: int | None = None
) -> list[Workload]:
    """Workloads by name: built-in ones, and the groups of ``prompts_file``.

    Without names: every group of the file if one is given, else every built-in workload. ``limit`` keeps
    the first prompts of each workload.
    """
    from_file: dict[str, list[str]] = {}
    if prompts_file is not None:
        for row in read_jsonl(Path(prompts_file)):
            from_file.setdefault(row["kind"], []).append(row["prompt"])
    if not names:
        names = list(from_file) if from_file else list(BUILTIN_WORKLOADS)
    workloads = []
    for name in dict.fromkeys(names):
        if name in from_file:
            workloads.append(Workload(name, tuple(from_file[name])))
        elif name in BUILTIN_WORKLOADS:
            workloads.append(builtin_workload(name))
        else:
            known = [*from_file, *BUILTIN_WORKLOADS]
            raise ToolInputError(f"unknown workload {name!r}; known: {', '.join(known)}")
    if limit is not None:
        if limit < 1:
            raise ToolInputError(f"--limit must be >= 1, got {limit}")
        workloads = [Workload(w.name, w.prompts[:limit]) for w in workloads]
    return workloads
