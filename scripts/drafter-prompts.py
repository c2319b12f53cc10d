#!/usr/bin/env python3
"""Write a JSONL prompt file for ``specserve train-drafter`` from this Python's standard library.

No dataset can be downloaded here, so the prompts are built from code every machine has: functions of
the standard library's pure-Python modules, each wrapped in one of several instructions (explain, complete,
document, review, rewrite, test, summarise), in a fixed pseudo-random order. None of them is one of the
built-in benchmark prompts (specserve/tools/prompts), which stay held out for measuring acceptance.

Usage: scripts/drafter-prompts.py OUT.jsonl [--count N] [--max-lines L] [--seed S]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

TEMPLATES = (
    "Explain what this Python function does, step by step:\n\n```python\n{code}\n```",
    "Complete this Python function. Output only the code.\n\n```python\n{head}\n```",
    "Write a docstring for this function and output the function with it:\n\n```python\n{code}\n```",
    "Review this code and point out one bug risk or improvement:\n\n```python\n{code}\n```",
    "Rewrite this function with type hints, unchanged otherwise:\n\n```python\n{code}\n```",
    "Write two pytest tests for this function:\n\n```python\n{code}\n```",
    "Summarize in two sentences what `{name}` is for:\n\n```python\n{code}\n```",
    "Write a Python function `{name}` that does what this description says: {doc}",
)


def functions(limit_lines: int = 40) -> list[tuple[str, str, str]]:
    """(name, source, first docstring line) of short documented top-level stdlib functions."""
    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and not node.name.startswith("_"):
                code = ast.get_source_segment(source, node) or ""
                if 4 <= code.count("\n") <= limit_lines:
                    doc = (ast.get_docstring(node) or "").strip().splitlines()[0]
                    found.append((node.name, code, doc))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--max-lines", type=int, default=40, help="Longest function used, in lines.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    pool = functions(args.max_lines)
    rng.shuffle(pool)
    with open(args.out, "w", encoding="utf-8") as out:
        for i, (name, code, doc) in enumerate(pool[: args.count]):
            lines = code.splitlines()
            head = "\n".join(lines[: max(2, len(lines) // 2)])
            template = TEMPLATES[i % len(TEMPLATES)]
            out.write(json.dumps({"prompt": template.format(code=code, head=head, name=name, doc=doc)}) + "\n")
    print(f"{min(args.count, len(pool))} prompts from {len(pool)} stdlib functions -> {args.out}")


if __name__ == "__main__":
    main()
