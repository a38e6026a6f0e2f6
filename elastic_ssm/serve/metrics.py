"""The server's Prometheus metrics (``GET /metrics``): ``prometheus_client`` counters in a registry per app."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine import COUNTERS

__all__ = ["Metrics", "CONTENT_TYPE"]

#: the text exposition format ``generate_latest`` writes
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_POOL = {"slots": "Slots of the one pool every tier shares (its decode batch bucket)",
         "busy": "Slots holding a running request at the tier",
         "waiting": "Requests of the tier queued for a free slot"}


class Metrics:
    """Counters of one server process; when scraped it reads the slots and the loop's counters of ``engine()``."""

    def __init__(self, engine: Callable[[], object | None] = lambda: None) -> None:
        self.registry, self.engine, self.started = CollectorRegistry(), engine, time.time()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"elastic_ssm_{name}", doc, labels, registry=self.registry)

        self.requests = counter("requests", "Completion requests by tier and HTTP status.", ("tier", "status"))
        self.rejected = counter("rejected", "Requests refused before reaching a tier, by reason.", ("reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled, by tier.", ("tier",))
        self.generated_tokens = counter("generated_tokens", "Tokens generated, by tier.", ("tier",))
        self.server_errors = counter("server_errors", "Requests ended by an unexpected exception (HTTP 500).")
        self.registry.register(self)

    def add_tokens(self, tier: str, n: int) -> None:
        self.generated_tokens.labels(tier).inc(n)

    def request(self, tier: str, status: int, prompt_tokens: int = 0) -> None:
        self.requests.labels(tier, str(status)).inc()
        self.prompt_tokens.labels(tier).inc(prompt_tokens)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def collect(self):
        """The engine's gauges and counters at scrape time (``Metrics`` is a registry collector)."""
        engine = self.engine()
        if engine is not None:
            snap, counters = engine.snapshot(), engine.counters()
            for key, doc in _POOL.items():
                family = GaugeMetricFamily(f"elastic_ssm_{key}", f"{doc}.", labels=["tier"])
                for tier, v in snap.items():
                    family.add_metric([tier], v[key])
                yield family
            for key, doc in COUNTERS.items():
                yield CounterMetricFamily(f"elastic_ssm_{key}", f"{doc}.", value=counters[key])
        yield GaugeMetricFamily("elastic_ssm_uptime_seconds", "Seconds since the server started.",
                                value=time.time() - self.started)
