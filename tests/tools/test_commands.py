"""The tools' subcommands: without the tools extra they say so in one line; the parser loads no tool."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec

import pytest

from cli_runner import run_cli
from specserve.tools import commands
from tools.helpers import one_error_line


@pytest.mark.parametrize("command", [["bench", "--url", "http://127.0.0.1:9"], ["verify", "--in-process"]])
def test_a_tool_without_its_extra_names_the_extra(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def without_scipy(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == "scipy" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_scipy)
    code, _, err = run_cli(capfd, *command)
    assert code == 2
    line = one_error_line(err)
    assert "needs the tools extra (missing: scipy)" in line and "specserve[tools]" in line


def test_the_extra_lists_what_the_tools_import() -> None:
    """pyproject's ``tools`` extra and the check agree (a tool dependency added to one only fails here)."""
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["tools"]
    names = {spec.split(">")[0].split("=")[0].split("[")[0] for spec in extra}
    assert names == set(commands.TOOL_DEPENDENCIES)
