"""The router's /metrics (`serve --data-parallel N`): every replica's own metrics, each sample
labelled `replica="i"`, then the router's counters.

Replica texts are parsed with prometheus_client's parser and families of one name are merged
(a name's HELP/TYPE once, every replica's samples under it), so the whole is one valid exposition.
The router's own numbers live in RouterStats, which only the router's event loop changes.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .routing import RULES


@dataclass(slots=True)
class RouterStats:
    num_replicas: int
    outstanding: list = field(default_factory=list)     # per replica: forwarded, not yet ended
    routed: Counter = field(default_factory=Counter)    # (replica, routing rule) -> requests
    failovers: list = field(default_factory=list)       # per replica: requests moved off it
    num_unavailable: int = 0                            # answered 503: no replica was ready

    def __post_init__(self):
        self.outstanding = [0] * self.num_replicas
        self.failovers = [0] * self.num_replicas


def merge_replica_texts(texts: Mapping[int, str]) -> list:
    """One Metric per family name over every replica's exposition, `replica` label added."""
    families: dict = {}
    for index, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                     fam.unit)
            for sample in fam.samples:
                merged.samples.append(sample._replace(
                    labels={"replica": str(index), **sample.labels}))
    return list(families.values())


def router_families(stats: RouterStats, replicas: list) -> list:
    """The router's own metrics; `replicas`: Supervisor.describe()."""
    routed = CounterMetricFamily("ninfer_router_requests",
                                 "requests forwarded, by replica and routing rule (session, "
                                 "prefix: affinity; load_bound: affinity overridden by load; "
                                 "any: a route without affinity)", labels=["replica", "rule"])
    for i in range(stats.num_replicas):
        for rule in RULES:
            routed.add_metric([str(i), rule], float(stats.routed[(i, rule)]))
    outstanding = GaugeMetricFamily("ninfer_router_outstanding",
                                    "requests forwarded to a replica whose answer has not ended",
                                    labels=["replica"])
    failovers = CounterMetricFamily("ninfer_router_failovers",
                                    "requests moved to another replica because this one could "
                                    "not take them (no connection, or a 503)", labels=["replica"])
    ready = GaugeMetricFamily("ninfer_router_replica_ready", "1 while the replica gets requests",
                              labels=["replica"])
    restarts = CounterMetricFamily("ninfer_router_replica_restarts",
                                   "times the replica's process was started again after it "
                                   "exited", labels=["replica"])
    for r in replicas:
        label = [str(r["index"])]
        outstanding.add_metric(label, float(stats.outstanding[r["index"]]))
        failovers.add_metric(label, float(stats.failovers[r["index"]]))
        ready.add_metric(label, 1.0 if r["state"] == "ready" else 0.0)
        restarts.add_metric(label, float(r["restarts"]))
    unavailable = CounterMetricFamily("ninfer_router_unavailable",
                                      "requests answered 503 because no replica was ready")
    unavailable.add_metric([], float(stats.num_unavailable))
    return [routed, outstanding, failovers, ready, restarts, unavailable]


class _Families:
    def __init__(self, families: list):
        self._families = families

    def collect(self):
        return self._families


def render(texts: Mapping[int, str], stats: RouterStats, replicas: list) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merge_replica_texts(texts) + router_families(stats, replicas)))
    return generate_latest(registry)
