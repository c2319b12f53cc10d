"""What a PromQL expression reads, from promql-parser's syntax tree (the Prometheus grammar, not a regex).

Used for the dashboard's queries and the alerting rules alike: every selector must name an exported series
with labels it has, and every ``by`` / ``on`` / ``group_left`` list must name labels those series carry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import promql_parser

# Grafana's range variables become a duration, its other variables (label values) plain text.
GRAFANA_DURATIONS = re.compile(r"\$\{?__(?:rate_interval|interval|range)(?:_ms|_s)?\}?")
GRAFANA_VARIABLE = re.compile(r"\$\{[^}]+\}|\$\w+|\[\[\w+\]\]")


@dataclass
class QueryRefs:
    series: list[tuple[str, set[str]]] = field(default_factory=list)
    """(series name, labels of its matchers) per selector, in order."""
    grouping_labels: set[str] = field(default_factory=set)
    """Labels of ``by`` / ``without`` / ``on`` / ``ignoring`` / ``group_left`` / ``group_right``."""


def grafana_to_promql(expr: str) -> str:
    return GRAFANA_VARIABLE.sub("x", GRAFANA_DURATIONS.sub("5m", expr))


def query_refs(expr: str) -> QueryRefs:
    """Parse ``expr`` (raises ValueError on a syntax error) and collect what it refers to."""
    refs = QueryRefs()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            labels = {m.name for m in node.matchers.matchers if m.name != "__name__"}
            refs.series.append((node.name or "", labels))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            refs.grouping_labels |= set(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                refs.grouping_labels |= set(node.modifier.matching.labels)
            refs.grouping_labels |= set(node.modifier.group_labels or ())

    promql_parser.walk(promql_parser.parse(expr), visit)
    return refs
