"""The Grafana dashboard (deploy/grafana): every query parses as PromQL and reads only exported metrics, the
panels show what operations need, and the provisioning wires it to the compose file's Prometheus."""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

import pytest

from .files import DASHBOARD, DEPLOY, compose, known_series, load_yaml, metric_defs, provisioned_datasource
from .promql import grafana_to_promql, query_refs


@cache
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p.get("targets", [])]


@pytest.mark.parametrize(
    "title,expr", dashboard_queries(), ids=[f"{t}#{n}" for n, (t, _) in enumerate(dashboard_queries())]
)
def test_dashboard_query_uses_exported_metrics(title: str, expr: str) -> None:
    try:
        refs = query_refs(grafana_to_promql(expr))
    except ValueError as exc:
        raise AssertionError(f"{title}: {expr}: {exc}") from exc
    assert refs.series, f"{title}: no metric in {expr}"
    series = known_series()
    allowed_grouping: set[str] = set()
    for name, labels in refs.series:
        assert name in series, f"{title}: {name} is not in deploy/metrics-names.txt"
        assert labels <= series[name], f"{title}: {name} has no label(s) {labels - series[name]}"
        allowed_grouping |= series[name]
    assert refs.grouping_labels <= allowed_grouping, f"{title}: unknown grouping labels in {expr}"


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
    used = {name for _, e in dashboard_queries() for name, _ in query_refs(grafana_to_promql(e)).series}
    unused = [d.name for d in metric_defs().values() if not set(d.series()) & used]
    assert not unused, f"listed in metrics-names.txt but not on the dashboard: {unused}"


def test_grafana_provisioning() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert provisioned_datasource()["url"] == "http://prometheus:9090"
    providers = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "specserve.yaml")["providers"]
    assert [p["options"]["path"] for p in providers] == [mounts["./grafana/dashboards"]]
    home = grafana["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home in (None, f"{mounts['./grafana/dashboards']}/{DASHBOARD.name}")


def test_query_refs_reads_selectors_and_grouping() -> None:
    """The tree walk the checks above rest on: selectors with their matchers, and every grouping list."""
    refs = query_refs(
        grafana_to_promql('histogram_quantile(0.95, sum by (le) (rate(a_bucket{x=~"$v"}[$__rate_interval])))')
    )
    assert refs.series == [("a_bucket", {"x"})] and refs.grouping_labels == {"le"}
    refs = query_refs("a / on (x) group_left (y) b or ignoring (z) (c unless d)")
    assert [name for name, _ in refs.series] == ["a", "b", "c", "d"]
    assert refs.grouping_labels == {"x", "y", "z"}
    for bad in ("sum(rate(a[5m])", "sum(a))", "a{x=}", "a[5m", "sum by (le (a)", "a{x=y}", "a}"):
        with pytest.raises(ValueError):
            query_refs(bad)
