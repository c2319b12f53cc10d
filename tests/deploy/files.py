"""The deployment files and what the tests read from them, parsed once with real parsers.

YAML with PyYAML, the Dockerfile with the official BuildKit parser (the ``dockerfile`` package), PromQL with
``promql-parser`` (see ``promql.py``); the settings through specserve's own CLI parser and loader.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import dockerfile
import yaml

from specserve.cli import build_parser
from specserve.config import Settings, env_name

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "specserve.json"
METRIC_NAMES = DEPLOY / "metrics-names.txt"
BUILD_SCRIPT = ROOT / "scripts" / "build-llama-cpp.sh"
K8S_SCHEMA_VERSION = "1.30"  # the oldest Kubernetes the manifests are validated for
TARGET_LABELS = frozenset({"job", "instance"})  # added by Prometheus to every scraped series
SETTINGS_ENV = {env_name(f.name): f for f in dataclasses.fields(Settings)}
SECRET_ENV = {name for name, f in SETTINGS_ENV.items() if f.metadata.get("secret")}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def k8s_one(kind: str) -> dict[str, Any]:
    docs = [d for _, d in k8s_docs() if d["kind"] == kind]
    assert len(docs) == 1, f"expected one {kind} in deploy/k8s, found {len(docs)}"
    return docs[0]


def image_pinned(ref: str) -> bool:
    """A digest, or an explicit tag that names a version (not latest)."""
    if "@sha256:" in ref:
        return True
    name, _, tag = ref.rpartition(":")
    return bool(name) and "/" not in tag and tag != "latest" and any(c.isdigit() for c in tag)


def cli_args(argv: list[str]) -> argparse.Namespace:
    """Parse a container command line (after the program name) with specserve's own parser."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"specserve rejects the arguments {argv}") from exc


def duration_seconds(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text))
    assert parts and "".join(a + b for a, b in parts) == str(text), f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def build_variables() -> set[str]:
    """The SPECSERVE_* variables the llama.cpp build script reads (build time, not settings)."""
    return set(re.findall(r"\bSPECSERVE_[A-Z0-9_]+", BUILD_SCRIPT.read_text()))


# -- metrics-names.txt --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricDef:
    name: str
    type: str
    labels: frozenset[str]
    front: bool = False
    """A ``#+`` entry: exported by the Ray Serve front only (the alerts may read it, the dashboard not)."""

    def series(self) -> dict[str, frozenset[str]]:
        """Series name → labels a query may use (scrape labels included)."""
        labels = self.labels | TARGET_LABELS
        if self.type == "histogram":
            return {
                self.name + "_bucket": labels | {"le"},
                self.name + "_sum": labels,
                self.name + "_count": labels,
            }
        return {self.name: labels}


@cache
def metric_defs(front: bool = False) -> dict[str, MetricDef]:
    """The metrics of deploy/metrics-names.txt; ``front`` adds the front's ``#+`` entries."""
    defs = {}
    for line in METRIC_NAMES.read_text().splitlines():
        is_front = line.startswith("#+ ")
        entry = line.removeprefix("#+ ") if is_front and front else line
        if not entry.strip() or entry.lstrip().startswith("#"):
            continue
        name, kind, *rest = entry.split()
        assert len(rest) <= 1 and name not in defs, line
        labels = frozenset(rest[0].split(",")) if rest else frozenset()
        defs[name] = MetricDef(name, kind, labels, is_front)
    return defs


@cache
def known_series(front: bool = False) -> dict[str, frozenset[str]]:
    return {s: labels for d in metric_defs(front).values() for s, labels in d.series().items()}


# -- the Dockerfile -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    image: str
    name: str
    instructions: tuple[dockerfile.Command, ...]

    def of(self, keyword: str) -> list[dockerfile.Command]:
        return [i for i in self.instructions if i.cmd.lower() == keyword.lower()]


@cache
def stages() -> tuple[Stage, ...]:
    """The build stages, with the ARG defaults before the first FROM substituted into the images."""
    args: dict[str, str] = {}
    found: list[tuple[str, str, list[dockerfile.Command]]] = []
    for ins in dockerfile.parse_file(str(DOCKERFILE)):
        if ins.cmd.lower() == "arg" and not found:
            name, _, default = ins.value[0].partition("=")
            args[name] = default.strip('"')
        elif ins.cmd.lower() == "from":
            image, *rest = ins.value
            name = rest[1] if len(rest) == 2 and rest[0].lower() == "as" else ""
            found.append((re.sub(r"\$\{?(\w+)\}?", lambda v: args[v.group(1)], image), name, []))
        else:
            assert found, f"line {ins.start_line}: {ins.cmd} before FROM"
            found[-1][2].append(ins)
    return tuple(Stage(image, name, tuple(instructions)) for image, name, instructions in found)


def runtime_env() -> dict[str, str]:
    """ENV of the runtime stage (ENV values come as name, value pairs)."""
    env: dict[str, str] = {}
    for ins in stages()[-1].of("env"):
        pairs = ins.value
        env.update({pairs[i]: pairs[i + 1].strip('"') for i in range(0, len(pairs), 2)})
    return env


def runtime_cmd() -> list[str]:
    (cmd,) = stages()[-1].of("cmd")
    assert cmd.json, "CMD in exec form"
    return list(cmd.value)


# -- .dockerignore -----------------------------------------------------------------------------------------


def dockerignore_patterns() -> list[tuple[bool, str]]:
    lines = [x.strip() for x in (ROOT / ".dockerignore").read_text().splitlines()]
    return [(x.startswith("!"), x.lstrip("!").rstrip("/")) for x in lines if x and not x.startswith("#")]


def dockerignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins (a pattern also matches everything under it)."""
    ignored = False
    for negated, pattern in dockerignore_patterns():
        glob = pattern.removeprefix("**/")
        for candidate in (path, *(str(p) for p in Path(path).parents if str(p) != ".")):
            if fnmatch.fnmatch(candidate, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatch(Path(candidate).name, glob)
            ):
                ignored = not negated
                break
    return ignored


# -- compose and Grafana ------------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(COMPOSE)
    return data


def provisioned_datasource() -> dict[str, Any]:
    path = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
    sources = load_yaml(path)["datasources"]
    assert len(sources) == 1 and sources[0]["type"] == "prometheus"
    source: dict[str, Any] = sources[0]
    return source
