"""One Prometheus scrape for the whole application: the front's own series and every replica's, labelled.

Behind the Serve proxy, a scrape of ``/metrics`` would reach one random replica. The front instead asks each
running replica for its exposition and merges them: every replica sample gets a ``replica`` label (its Serve
replica id, also sent in ``X-Specserve-Replica``), and samples of one metric family stay together, as the
exposition format requires. Series of a replacement replica start from zero under a new label, as a restarted
pod's would; ``sum by (...)`` and ``rate()`` in the dashboards and alerts handle both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from specserve.rayserve import REPLICA_HEADER

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FrontMetrics:
    """The front's own series: replicas ready and desired, requests relayed per replica, and those that
    never got an answer from a replica (the replicas' own ``requests_total`` cannot count them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ready = Gauge(
            "specserve:replicas_ready", "Engine replicas ready to serve.", registry=self.registry
        )
        self.desired = Gauge(
            "specserve:replicas_desired", "Engine replicas Ray Serve is aiming for.", registry=self.registry
        )
        self.requests = Counter(
            "specserve:front_requests",
            "Requests the front relayed, by the replica that answered.",
            ("replica",),
            registry=self.registry,
        )

        self.failures = Counter(
            "specserve:front_failures",
            "Requests the front answered itself: queue_full (429, every replica busy and the front's queue "
            "full), replica_failed (503 or a stream's error event: the replica died).",
            ("reason",),
            registry=self.registry,
        )
        for reason in ("queue_full", "replica_failed"):
            self.failures.labels(reason)

    def set_replicas(self, ready: int, desired: int) -> None:
        self.ready.set(ready)
        self.desired.set(desired)

    def routed(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        for key, value in headers:
            if key.lower() == REPLICA_HEADER.encode():
                self.requests.labels(value.decode(errors="replace")).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_expositions(front: bytes, replicas: Mapping[str, bytes]) -> tuple[bytes, str]:
    """The front's exposition plus each replica's with ``replica="<id>"`` on every sample."""
    families: dict[str, Metric] = {}
    sources: list[tuple[str | None, bytes]] = [(None, front), *replicas.items()]
    for replica, text in sources:
        for family in text_string_to_metric_families(text.decode("utf-8")):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
            for s in family.samples:
                labels = dict(s.labels) if replica is None else {**s.labels, "replica": replica}
                merged.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(families.values())))
    return generate_latest(registry), CONTENT_TYPE
