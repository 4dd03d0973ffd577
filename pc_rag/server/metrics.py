"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own.

Counted as requests finish: requests by endpoint and status, TTFT and latency histograms, prompt
tokens reused and computed, tokens generated; per API key, generations in flight and requests
refused for its ``max_in_flight`` or ``max_tokens_per_minute``. Read at each scrape: each key's
tokens of the last minute (the quota), and from the engine queue depth
and running rows (the scheduler), and where module KV came from (memory, disk and remote tier
hits, misses, tokens recomputed because a tier was slower than prefill: ``engine.store_stats()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..decode.request import Generation
from .tenants import Tenant

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# engine.store_stats() counters exported as pcrag_kv_<name>_total
_TIER_COUNTERS = ("hits_memory", "hits_disk", "hits_remote", "misses", "encoded", "recomputed_tokens", "passages_learned")


class _EngineCollector(Collector):
    """What the engine knows now, read at scrape time (no background thread)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        scheduler = self.engine.scheduler.stats()
        yield GaugeMetricFamily("pcrag_queue_depth", "Requests waiting for admission", value=scheduler["queued"])
        yield GaugeMetricFamily("pcrag_queue_awaiting_room", "Requests waiting for room in a full queue (queue_timeout_s)",
                                value=scheduler["awaiting_room"])
        yield GaugeMetricFamily("pcrag_running_rows", "Rows decoding now", value=scheduler["running"])
        yield CounterMetricFamily("pcrag_scheduler_cancelled", "Requests let go before they finished (cancelled, disconnected)",
                                  value=scheduler["cancelled"])
        yield CounterMetricFamily("pcrag_scheduler_steps", "Forward passes the scheduler ran", value=scheduler["steps"])
        yield GaugeMetricFamily("pcrag_kv_buffer_bytes", "KV buffer bytes held by running and admitted rows", value=scheduler["buffer_bytes"])
        yield GaugeMetricFamily("pcrag_kv_buffer_bytes_idle", "KV buffer bytes the buffer pool keeps for reuse",
                                value=scheduler["buffer_bytes_idle"])
        forward = self.engine.forward  # under --compile: how much of the decoding the compiled step runs
        yield CounterMetricFamily("pcrag_compiled_steps", "Decode steps run through torch.compile (--compile; the rest ran eagerly)",
                                  value=forward.compiled_steps)
        yield GaugeMetricFamily("pcrag_compiled_shapes", "(rows, capacity) shapes the compiled decode step has run at: "
                                "a CUDA graph each under --compile reduce-overhead", value=len(forward.compiled_shapes))
        store = self.engine.store_stats()
        for name in _TIER_COUNTERS:
            yield CounterMetricFamily(f"pcrag_kv_{name}", f"Module KV: {name.replace('_', ' ')} (engine.store_stats())", value=store.get(name, 0))
        yield GaugeMetricFamily("pcrag_kv_bytes_memory", "Module KV bytes held in memory", value=store.get("bytes_memory", 0))
        yield GaugeMetricFamily("pcrag_documents_pending", "Documents queued for background encoding", value=store.get("background_pending", 0))


class _TokensCollector(Collector):
    """Each key's tokens of the last minute and those its requests in flight hold (against its
    ``max_tokens_per_minute``), read at scrape time: the minute slides whether or not requests come."""

    def __init__(self, spending: Callable[[], dict[str, int]], holding: Callable[[], dict[str, int]]) -> None:
        self.spending, self.holding = spending, holding

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("pcrag_tenant_tokens_last_minute", "Tokens a key's generations used in the last minute "
                                   "(against its max_tokens_per_minute)", labels=["tenant"])
        for name, tokens in sorted(self.spending().items()):
            family.add_metric([name], tokens)
        yield family
        held = GaugeMetricFamily("pcrag_tenant_tokens_held", "Tokens a key's requests in flight may still use (their prompts "
                                 "and max_tokens, held against max_tokens_per_minute until they finish)", labels=["tenant"])
        for name, tokens in sorted(self.holding().items()):
            held.add_metric([name], tokens)
        yield held


class Metrics:
    """The server's metrics: :meth:`answered` once per request, :meth:`generation` once per
    finished generation, :meth:`first_token` once per streamed one, :meth:`cut_short` once per
    stream that ends early."""

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("pcrag_requests", "Requests answered, by endpoint and HTTP status", ["endpoint", "status"],
                                registry=self.registry)
        self.ttft = Histogram("pcrag_ttft_seconds", "Time from submission to the first token (streams: to the first text sent)", buckets=_SECONDS, registry=self.registry)
        self.latency = Histogram("pcrag_request_seconds", "Time from submission to the last token", buckets=_SECONDS, registry=self.registry)
        self.cached = Counter("pcrag_prompt_tokens_cached", "Prompt tokens whose KV was reused", registry=self.registry)
        self.computed = Counter("pcrag_prompt_tokens_computed", "Prompt tokens computed", registry=self.registry)
        self.generated = Counter("pcrag_generated_tokens", "Tokens generated", registry=self.registry)
        # per key, named by its place in the key file ("key #2"), never by the key
        self.tenant_in_flight = Gauge("pcrag_tenant_in_flight", "Generations a key has in flight (against its max_in_flight)",
                                      ["tenant"], registry=self.registry)
        self.tenant_refused = Counter("pcrag_tenant_refused", "Requests refused for their key's max_in_flight or max_tokens_per_minute (429)", ["tenant"],
                                      registry=self.registry)
        if engine is not None:  # an engine in this process (replicas report through Ray's metrics)
            self.registry.register(_EngineCollector(engine))

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def generation(self, result: Generation, *, streamed: bool = False) -> None:
        """A finished generation; a stream's first token was observed when it was sent (:meth:`first_token`)."""
        stats = result.stats
        if not streamed:
            self.ttft.observe(stats.ttft_s)
        self.latency.observe(stats.total_s)
        self.cached.inc(stats.cached_tokens)
        self.computed.inc(stats.computed_tokens)
        self.generated.inc(len(result.token_ids))

    def first_token(self, seconds: float) -> None:
        """A stream's first text is ready to send, ``seconds`` after its submission: observed
        whether or not its client stays to the end (else slow first tokens, those clients give
        up on, would be missing from the histogram)."""
        self.ttft.observe(seconds)

    def cut_short(self, tokens: int) -> None:
        """A stream ended before its last token (its client left, or it failed): the ``tokens``
        sent to it are counted as generated; its other counts, in its Generation, never came."""
        self.generated.inc(tokens)

    def tenant(self, tenant: Tenant, held: int, refused: bool) -> None:
        """A key's slots changed (:class:`pc_rag.server.quota.Quota`'s listener)."""
        self.tenant_in_flight.labels(tenant=tenant.name).set(held)
        if refused:
            self.tenant_refused.labels(tenant=tenant.name).inc()

    def watch_tokens(self, spending: Callable[[], dict[str, int]], holding: Callable[[], dict[str, int]]) -> None:
        """Report ``spending()`` (key name: tokens of the last minute) and ``holding()`` (key name:
        tokens its requests in flight hold) at each scrape."""
        self.registry.register(_TokensCollector(spending, holding))

    def scrape(self) -> bytes:
        return generate_latest(self.registry)
