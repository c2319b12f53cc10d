"""Prompt sets: the built-in workloads and user JSONL files."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.tools.workloads import BUILTIN_WORKLOADS, ToolInputError, select_workloads


def test_builtin_workloads_ship_with_the_package() -> None:
    workloads = select_workloads(None, None)
    assert [w.name for w in workloads] == list(BUILTIN_WORKLOADS)
    assert all(len(w.prompts) >= 5 and all(p.strip() for p in w.prompts) for w in workloads)
    assert [len(w.prompts) for w in select_workloads(["qa", "qa"], None, limit=2)] == [2]


def test_user_file_groups_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "kind": "x"}\n{"prompt": "b"}\n{"prompt": "c", "workload": "x"}\n')
    workloads = select_workloads(None, str(path))
    assert [(w.name, w.prompts) for w in workloads] == [("x", ("a", "c")), ("custom", ("b",))]
    assert [w.name for w in select_workloads(["x", "qa"], str(path))] == ["x", "qa"]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ToolInputError, match=r"p.jsonl:1: expected an object"):
        select_workloads(None, str(path))
    with pytest.raises(ToolInputError, match="cannot read"):
        select_workloads(None, str(tmp_path / "missing.jsonl"))
