"""The alerting rules (deploy/prometheus/alerts.yml) and their promtool unit tests (alerts.test.yml).

promtool checks the rules, runs the unit tests and checks prometheus.yml laid out as the compose file mounts
it; the binary comes from scripts/get-promtool.sh (PATH, a cached copy, or Debian's prometheus package).
Without it the promtool tests skip locally and fail under CI. The rest is plain Python: every metric the
rules read is in deploy/metrics-names.txt, every alert has a firing and a silent case in alerts.test.yml,
and every rule carries a severity, a for: duration and annotations whose runbook anchors exist.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from .files import COMPOSE, DEPLOY, ROOT, TARGET_LABELS, known_series
from .promql import query_refs

ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts.test.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
GET_PROMTOOL = ROOT / "scripts" / "get-promtool.sh"

SEVERITIES = ("warning", "critical")
# Added by the scrape where one target serves several engines (Ray Serve); grouping by it is harmless where
# it is absent, so the rules may group by it although no metric lists it.
OPTIONAL_LABELS = frozenset({"replica"})


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@cache
def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def rules() -> list[dict[str, Any]]:
    return [rule for group in load(ALERTS)["groups"] for rule in group["rules"]]


def alert_names() -> set[str]:
    return {rule["alert"] for rule in rules()}


# -- promtool -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def promtool() -> str:
    """A promtool binary from scripts/get-promtool.sh: skipped locally when none can be had, failed in CI."""
    try:
        result = subprocess.run(
            ["bash", str(GET_PROMTOOL)], capture_output=True, text=True, timeout=600, check=False
        )
    except subprocess.TimeoutExpired:
        why = "timed out after 600 s"
    else:
        path = result.stdout.strip().rpartition("\n")[2]
        if result.returncode == 0 and path and os.access(path, os.X_OK):
            return path
        why = f"exit status {result.returncode}: {result.stderr.strip()[-1500:]}"
    message = f"no promtool: scripts/get-promtool.sh failed ({why})"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message + "; set PROMTOOL=/path/to/promtool or put promtool on PATH")


def run_promtool(promtool: str, *args: str) -> str:
    result = subprocess.run(
        [promtool, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{output}"
    return output


def test_promtool_check_rules(promtool: str) -> None:
    output = run_promtool(promtool, "check", "rules", str(ALERTS.relative_to(ROOT)))
    assert f"SUCCESS: {len(rules())} rules found" in output, output


def test_promtool_unit_tests(promtool: str) -> None:
    output = run_promtool(promtool, "test", "rules", str(ALERT_TESTS.relative_to(ROOT)))
    assert "SUCCESS" in output and "FAILED" not in output, output


def prometheus_mounts() -> dict[str, str]:
    """The prometheus service's bind mounts from compose.yaml: container path → file under deploy/."""
    mounts = {}
    for volume in load(COMPOSE)["services"]["prometheus"]["volumes"]:
        source, target, *mode = volume.split(":")
        if source.startswith("."):
            mounts[target] = source
            assert mode == ["ro"], f"mount {volume} read-only"
    return mounts


def test_promtool_check_config_as_mounted(promtool: str, tmp_path: Path) -> None:
    """prometheus.yml and the rule files it names, at the paths the container sees them."""
    for target, source in prometheus_mounts().items():
        dest = tmp_path / target.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DEPLOY / source, dest)
    command = load(COMPOSE)["services"]["prometheus"]["command"]
    config = next(c.partition("=")[2] for c in command if c.startswith("--config.file="))
    output = run_promtool(promtool, "check", "config", str(tmp_path / config.lstrip("/")))
    assert "SUCCESS: 1 rule files found" in output, output
    assert f"SUCCESS: {len(rules())} rules found" in output, output


# -- the wiring, without promtool ---------------------------------------------------------------------------


def test_prometheus_loads_the_rules() -> None:
    rule_files = load(PROMETHEUS_CONFIG)["rule_files"]
    assert rule_files == [ALERTS.name], "rule_files is relative to prometheus.yml's directory"
    mounts = prometheus_mounts()
    assert mounts["/etc/prometheus/alerts.yml"] == "./prometheus/alerts.yml"
    assert (
        Path(mounts["/etc/prometheus/prometheus.yml"]).parent
        == Path(mounts["/etc/prometheus/alerts.yml"]).parent
    )
    assert load(ALERT_TESTS)["rule_files"] == [ALERTS.name]


# -- metric names -------------------------------------------------------------------------------------------


def alert_series() -> dict[str, frozenset[str]]:
    """Series name → labels a rule may use: the replicas' metrics, the front's (``#+`` entries), ``up``."""
    return {"up": TARGET_LABELS, **known_series(front=True)}


def test_query_refs_on_rule_syntax() -> None:
    refs = query_refs(
        'histogram_quantile(0.95, sum by (job, le) (rate(a_bucket{x=~"b|c"}[5m]))) > 5 '
        "and on (job) absent(up) or b:c_total / ignoring(x) d"
    )
    assert refs.series == [("a_bucket", {"x"}), ("up", set()), ("b:c_total", set()), ("d", set())]
    assert refs.grouping_labels == {"job", "le", "x"}


@pytest.mark.parametrize("rule", rules(), ids=lambda r: f"{r['alert']}-{r['labels']['severity']}")
def test_rule_reads_exported_metrics(rule: dict[str, Any]) -> None:
    try:
        refs = query_refs(rule["expr"])
    except ValueError as exc:
        raise AssertionError(f"{rule['alert']}: {rule['expr']}: {exc}") from exc
    names, grouping = refs.series, refs.grouping_labels
    assert names, rule["expr"]
    series = alert_series()
    allowed = set(OPTIONAL_LABELS)
    for name, labels in names:
        assert name in series, f"{rule['alert']}: {name} is not in deploy/metrics-names.txt"
        assert labels <= series[name], f"{rule['alert']}: {name} has no label(s) {labels - series[name]}"
        allowed |= series[name]
    assert grouping <= allowed, f"{rule['alert']}: unknown grouping labels {grouping - allowed}"


# -- rule conventions ---------------------------------------------------------------------------------------


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_rule_conventions() -> None:
    seen: set[tuple[str, str]] = set()
    for rule in rules():
        name, severity = rule["alert"], rule["labels"]["severity"]
        assert re.fullmatch(r"Specserve[A-Z]\w+", name), name
        assert severity in SEVERITIES, f"{name}: severity {severity}"
        assert (name, severity) not in seen, f"{name}: two {severity} rules"
        seen.add((name, severity))
        assert re.fullmatch(r"\d+[smh]", rule["for"]), f"{name}: a for: duration"
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(annotations), name
        path, _, anchor = annotations["runbook_url"].partition("#")
        assert (ROOT / path).is_file(), f"{name}: runbook {path} does not exist"
        assert anchor in heading_anchors((ROOT / path).read_text()), f"{name}: no heading #{anchor} in {path}"


# -- unit test coverage -------------------------------------------------------------------------------------


def unit_test_cases() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(test group, alert_rule_test entry) for every expectation in alerts.test.yml."""
    for group in load(ALERT_TESTS)["tests"]:
        for case in group.get("alert_rule_test", []):
            yield group, case


def input_targets(group: dict[str, Any]) -> set[tuple[str, ...]]:
    """The (job, instance, replica) of every input series: the targets an alert could fire for."""
    targets: set[tuple[str, ...]] = set()
    for series in group["input_series"]:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', series["series"]))
        targets.add((labels.get("job", ""), labels.get("instance", ""), labels.get("replica", "")))
    return targets


def test_every_alert_fires_and_stays_silent_in_a_unit_test() -> None:
    """Each alert and severity fires in some case; each alert has a case where some input must not fire it."""
    fired: set[tuple[str, str]] = set()
    silent: set[str] = set()
    for group, case in unit_test_cases():
        name = case["alertname"]
        assert name in alert_names(), f"alerts.test.yml tests {name}, which alerts.yml lacks"
        expected = case.get("exp_alerts") or []
        for alert in expected:
            labels = alert["exp_labels"]
            fired.add((name, labels["severity"]))
            assert {"summary", "description", "runbook_url"} <= set(alert.get("exp_annotations", {})), (
                f"{name}: expect its annotations too"
            )
        expected_targets = {
            (
                a["exp_labels"].get("job", ""),
                a["exp_labels"].get("instance", ""),
                a["exp_labels"].get("replica", ""),
            )
            for a in expected
        }
        if not expected or input_targets(group) - expected_targets:
            silent.add(name)
    wanted = {(rule["alert"], rule["labels"]["severity"]) for rule in rules()}
    assert not wanted - fired, f"never expected to fire in alerts.test.yml: {sorted(wanted - fired)}"
    assert not alert_names() - silent, f"no silent case in alerts.test.yml: {sorted(alert_names() - silent)}"
