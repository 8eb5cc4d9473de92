"""Prometheus metrics of one app (its own registry, so several apps can live in one process).

Engine gauges are read from `Engine.stats()` at scrape time; request counters and latency
histograms are updated by the Gateway as responses stream.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Engine.stats() keys exported under a stable name (the rest as ninfer_engine_<key>)
_NAMED_STATS = {
    "queue_depth": ("ninfer_queue_depth", "requests waiting in the engine's FIFO queue"),
    "num_waiting": ("ninfer_queue_depth", "requests waiting in the engine's FIFO queue"),
    "residents": ("ninfer_resident_requests", "requests holding a resident lane"),
    "num_resident": ("ninfer_resident_requests", "requests holding a resident lane"),
    "num_residents": ("ninfer_resident_requests", "requests holding a resident lane"),
    "paused": ("ninfer_paused_requests", "requests paused under resource pressure"),
    "num_paused": ("ninfer_paused_requests", "requests paused under resource pressure"),
}

# the context cache's Engine.stats() keys, exported by _cache_metrics under names of their own
_CACHE_COUNTERS = (
    ("prefix_cache_lookups", "ninfer_prefix_cache_lookups",
     "requests that looked for a context-cache checkpoint to start from"),
    ("prefix_cache_hits", "ninfer_prefix_cache_hits",
     "requests that started from a context-cache checkpoint"),
    ("prefix_cache_tokens_reused", "ninfer_prefix_cache_reused_tokens",
     "prompt tokens the context cache supplied (not prefilled again)"),
)
_CACHE_BYTES = (("prefix_cache_device_bytes", "device"), ("prefix_cache_host_bytes", "host"))
# wall seconds of the copies between the cache's tiers (demotions, host captures; host binds)
_CACHE_COPIES = (("prefix_cache_copy_seconds_to_host", "to_host"),
                 ("prefix_cache_copy_seconds_to_device", "to_device"))
_CACHE_KEYS = frozenset([key for key, _, _ in _CACHE_COUNTERS] + [key for key, _ in _CACHE_BYTES]
                        + [key for key, _ in _CACHE_COPIES]
                        + ["prefix_cache_entries", "prefix_cache_slots_total",
                           "prefix_cache_capture_seconds"])

# speculative decoding's Engine.stats() keys (Engine(speculative="mtp")), exported by _spec_metrics
_SPEC_COUNTERS = (
    ("spec_draft_tokens", "ninfer_spec_draft_tokens", "tokens the MTP head drafted"),
    ("spec_accepted_tokens", "ninfer_spec_accepted_tokens",
     "drafted tokens the target verified and the engine accepted"),
    ("spec_verify_rows", "ninfer_spec_verify_steps", "decode steps that verified drafts"),
    ("spec_emitted_tokens", "ninfer_spec_emitted_tokens",
     "tokens those verify steps emitted (accepted drafts + one target token each)"),
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineCollector:
    def __init__(self, gateway):
        self._gateway = gateway

    def collect(self):
        healthy = GaugeMetricFamily("ninfer_engine_ready", "1 when the engine is ready to serve")
        healthy.add_metric([], 1.0 if self._gateway.health_state() == "ready" else 0.0)
        yield healthy
        stats = self._gateway.engine_stats()
        yield from _cache_metrics(stats)
        yield from _spec_metrics(stats)
        seen = set()
        for key, value in sorted(stats.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or key in _CACHE_KEYS or key.startswith("spec_"):
                continue
            name, doc = _NAMED_STATS.get(key, (f"ninfer_engine_{_clean(key)}",
                                               f"Engine.stats()['{key}']"))
            if name in seen:
                continue
            seen.add(name)
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g


def _cache_metrics(stats: dict):
    """The context cache: lookups, hits and reused tokens (counters), the hit rate (hits per
    lookup so far), checkpoint bytes per tier and entries. Nothing before the Engine is ready
    (its stats are empty then)."""
    if "prefix_cache_lookups" not in stats:
        return
    yield from _counters(stats, _CACHE_COUNTERS)
    lookups = stats.get("prefix_cache_lookups", 0)
    rate = GaugeMetricFamily("ninfer_prefix_cache_hit_rate",
                             "context-cache hits per lookup since start (0 before any lookup)")
    rate.add_metric([], stats.get("prefix_cache_hits", 0) / lookups if lookups else 0.0)
    yield rate
    held = GaugeMetricFamily("ninfer_prefix_cache_bytes",
                             "bytes the context cache's checkpoints hold, by tier", labels=["tier"])
    for key, tier in _CACHE_BYTES:
        held.add_metric([tier], float(stats.get(key, 0)))
    yield held
    entries = GaugeMetricFamily("ninfer_prefix_cache_entries", "context-cache checkpoints held")
    entries.add_metric([], float(stats.get("prefix_cache_entries", 0)))
    yield entries
    slots = GaugeMetricFamily("ninfer_prefix_cache_state_slots",
                              "device State slots for context-cache checkpoints (the most "
                              "checkpoints the device tier holds)")
    slots.add_metric([], float(stats.get("prefix_cache_slots_total", 0)))
    yield slots
    copies = CounterMetricFamily("ninfer_prefix_cache_copy_seconds",
                                 "seconds spent copying checkpoints between the device and the "
                                 "host tier, by direction", labels=["direction"])
    for key, direction in _CACHE_COPIES:
        copies.add_metric([direction], float(stats.get(key, 0.0)))
    yield copies
    capture = CounterMetricFamily("ninfer_prefix_cache_capture_seconds",
                                  "seconds the engine's commit path spent taking checkpoints "
                                  "(making room for them included)")
    capture.add_metric([], float(stats.get("prefix_cache_capture_seconds", 0.0)))
    yield capture


def _spec_metrics(stats: dict):
    """Speculative decoding (only when the Engine runs it): drafted / accepted tokens, verify
    steps and their tokens (counters), per draft position (label position = 1..k) the drafts
    proposed, accepted, and the acceptance rate so far, and the units run at each k."""
    if "spec_draft_tokens" not in stats:
        return
    yield from _counters(stats, _SPEC_COUNTERS)
    for key, name, doc, family in (
            ("spec_drafted_by_position", "ninfer_spec_position_draft_tokens",
             "drafts proposed at each draft position", CounterMetricFamily),
            ("spec_accepted_by_position", "ninfer_spec_position_accepted_tokens",
             "drafts accepted at each draft position", CounterMetricFamily),
            ("spec_acceptance_by_position", "ninfer_spec_acceptance",
             "accepted / drafted at each draft position since start", GaugeMetricFamily)):
        m = family(name, doc, labels=["position"])
        for i, value in enumerate(stats.get(key, ())):
            m.add_metric([str(i + 1)], float(value))
        yield m
    units = CounterMetricFamily("ninfer_spec_units", "decode units run at each draft count k "
                                "(the draft policy's choices; k = 0: plain decoding)", labels=["k"])
    for k, value in enumerate(stats.get("spec_units_by_k", ())):
        units.add_metric([str(k)], float(value))
    yield units


def _counters(stats: dict, table):
    """One counter family per (Engine.stats() key, metric name, help) of the table."""
    for key, name, doc in table:
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(stats.get(key, 0)))
        yield c


def _clean(key: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in str(key)).lower()


class Metrics:
    def __init__(self, gateway):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ninfer_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.in_flight = Gauge("ninfer_generations_in_flight",
                               "generation requests the gateway is serving", registry=r)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.generated_tokens = Counter("ninfer_generated_tokens",
                                        "tokens generated by finished requests", registry=r)
        self.finished = Counter("ninfer_generations_finished", "finished generations by reason",
                                ["reason"], registry=r)
        self.ttft = Histogram("ninfer_time_to_first_token_seconds",
                              "submit -> first generated token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("ninfer_inter_token_latency_seconds",
                             "time between consecutive generated tokens (per token)",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("ninfer_request_duration_seconds",
                                  "submit -> finished", buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(gateway))

    def render(self) -> bytes:
        return generate_latest(self.registry)
