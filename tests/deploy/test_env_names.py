"""Every SPECSERVE_* variable the deployment files and docs set or mention is a setting (or a build variable
of scripts/build-llama-cpp.sh)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from .files import DEPLOY, ROOT, SETTINGS_ENV, build_variables, compose, k8s_docs, rel, runtime_env


def env_names_in_use() -> Iterator[tuple[str, str]]:
    """(where, name) for every SPECSERVE_* variable the deployment files and docs set or mention."""
    for name in runtime_env():
        yield "Dockerfile", name
    for service in compose()["services"].values():
        for name in service.get("environment", {}):
            yield "compose.yaml", name
    for path, d in k8s_docs():
        if d["kind"] == "Deployment":
            spec = d["spec"]["template"]["spec"]
            for c in [*spec["containers"], *spec.get("initContainers", [])]:
                for e in c.get("env", []):
                    yield rel(path), e["name"]
    for path in (ROOT / "docs" / "DEPLOYMENT.md", DEPLOY / "metrics-names.txt"):
        for name in re.findall(r"\bSPECSERVE_[A-Z0-9_]+", path.read_text()):
            yield rel(path), name


def test_env_names_are_settings() -> None:
    used = [(where, name) for where, name in env_names_in_use() if name.startswith("SPECSERVE_")]
    assert used
    unknown = [
        f"{where}: {name}"
        for where, name in used
        if name not in SETTINGS_ENV and name not in build_variables()
    ]
    assert not unknown, "not a setting of specserve.config.Settings: " + ", ".join(unknown)
