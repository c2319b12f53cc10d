"""deploy/metrics-names.txt: the metric names the dashboard and alerts read, as the server exports them."""

from __future__ import annotations

import asyncio
import re

from specserve.server.metrics import Metrics

from .files import metric_defs


def test_metric_names_file() -> None:
    defs = metric_defs()
    assert len(defs) >= 15
    for d in metric_defs(front=True).values():
        assert re.fullmatch(r"specserve:[a-z][a-z0-9_]*", d.name), d.name
        assert d.type in ("counter", "gauge", "histogram"), d
        assert d.name.endswith("_total") == (d.type == "counter"), (
            f"{d.name}: counters, and only they, end in _total"
        )
        if d.type == "histogram":
            assert d.name.endswith("_seconds"), f"{d.name}: histograms here are latencies in seconds"
        assert all(re.fullmatch(r"[a-z_][a-z0-9_]*", label) for label in d.labels), d


def test_the_server_exports_every_listed_metric_as_listed() -> None:
    body, _ = asyncio.run(Metrics().scrape())
    text = body.decode()
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
