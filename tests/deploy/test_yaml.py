"""Every YAML file under deploy/ parses and passes yamllint."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from yamllint import linter  # type: ignore[import-untyped]
from yamllint.config import YamlLintConfig  # type: ignore[import-untyped]

from .files import DEPLOY, rel

YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


@pytest.mark.parametrize("path", YAML_FILES, ids=rel)
def test_yaml_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)


def test_yamllint() -> None:
    config = YamlLintConfig("extends: relaxed\nrules:\n  line-length: {max: 110}\n")
    problems = [
        f"{rel(p)}:{e.line}: {e.level} {e.message}"
        for p in YAML_FILES
        for e in linter.run(p.read_text(), config)
    ]
    assert not problems, "\n".join(problems)
