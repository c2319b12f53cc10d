"""Prometheus metrics for ``GET /metrics``: vLLM's names under the ``specserve:`` prefix.

Three feeds, all on the event loop:

- every step's message (an ``AsyncEngine`` step observer): the step's draft and verify time; and at each
  scrape, the engine's counters fetched between two steps (``AsyncEngine.refresh``): the speculative
  decoding counters, generated tokens, drafter failures and the prefix cache's, all as deltas of the
  engine's own ``EngineStats``, so the exported counters equal the engine's and stay consistent;
- the request middleware, when a generation request ends: requests by outcome, finish reasons, prompt
  tokens, time to first token, time per output token, end-to-end latency and queue time;
- callbacks at scrape time: running and waiting requests, KV cache usage, speculation state.

Counters are exported with prometheus' ``_total`` suffix (``specserve:spec_decode_num_drafts_total``). Mean
acceptance length = 1 + num_accepted_tokens / num_drafts; acceptance rate = accepted / draft tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from specserve.engine.async_engine import AsyncEngine, EngineDeadError
from specserve.engine.core import EngineSnapshot, StepMessage
from specserve.engine.output_processor import RequestState
from specserve.engine.prefix_cache import PrefixCacheStats
from specserve.engine.stats import EngineStats

PREFIX = "specserve:"
OUTCOMES = (
    "success",  # finished with stop or length
    "aborted",  # the client went away (or the server stopped) before the end
    "timed_out",  # ran past request_timeout (504, or an error event in a stream)
    "rejected_429",  # waiting queue full or rate limit
    "invalid_request",  # 400, 404, 413, 422
    "unauthorized",  # 401, 403
    "unavailable",  # 503: loading, shutting down, engine stopped
    "error",  # 500 and anything else
)
FINISH_REASONS = ("stop", "length")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
SCRAPE_TIMEOUT_S = 5.0
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """Every metric of one server, in its own registry (two apps in one process do not collide)."""

    def __init__(self) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call] # no *_created series: counters only, let queries derive rates
        self.registry = registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=registry)

        def gauge(name: str, doc: str, value: Callable[[], float]) -> Gauge:
            g = Gauge(PREFIX + name, doc, registry=registry)
            g.set_function(value)
            return g

        self.num_drafts = counter(
            "spec_decode_num_drafts", "Verify steps that checked at least one draft token."
        )
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft.",
            ("position",),
        )
        self.drafter_drafts = counter(
            "spec_decode_drafter_num_drafts", "Verify steps with drafts, by drafter.", ("drafter",)
        )
        self.drafter_draft_tokens = counter(
            "spec_decode_drafter_num_draft_tokens", "Draft tokens verified, by drafter.", ("drafter",)
        )
        self.drafter_accepted_tokens = counter(
            "spec_decode_drafter_num_accepted_tokens", "Draft tokens accepted, by drafter.", ("drafter",)
        )
        self.drafter_failures = counter(
            "drafter_failures", "Drafter calls that raised; their requests continued as plain decoding."
        )
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's name)."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache (vLLM's name)."
        )
        self.prefix_cache_drops = counter(
            "prefix_cache_host_drops", "Host-tier KV blobs dropped: failed checksum or did not load."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached the engine.")
        self.requests = counter("requests", "Generation requests by outcome.", ("outcome",))
        self.request_success = counter(
            "request_success", "Requests that finished normally, by finish reason.", ("finished_reason",)
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Engine arrival to first token.", _LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first.", _TOKEN_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Engine arrival to finish.", _E2E_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Engine arrival to getting a sequence slot.", _LATENCY_BUCKETS
        )
        self.draft_time = histogram("draft_time_seconds", "Drafting time of one engine step.", _STEP_BUCKETS)
        self.verify_time = histogram(
            "verify_time_seconds", "Target model pass of one engine step (verify and prefill).", _STEP_BUCKETS
        )

        self._engine: AsyncEngine | None = None
        self._degraded: Callable[[], bool] = lambda: False
        self._last = EngineStats()  # the engine counters at the previous scrape
        self._last_cache = PrefixCacheStats()
        self._draft_length = 0.0
        gauge(
            "num_requests_running",
            "Sequences decoding.",
            lambda: self._engine.num_running if self._engine else 0,
        )
        gauge("num_requests_waiting", "Requests waiting for a slot.", self._waiting)
        gauge("kv_cache_usage_perc", "Tokens held / (context size x max running), 0..1.", self._kv_usage)
        gauge("spec_decode_enabled", "1 when speculation is on and a drafter is available.", self._enabled)
        gauge(
            "spec_decode_degraded", "1 when a drafter failed to load or was disabled.", self._degraded_value
        )
        gauge("spec_decode_draft_length", "Mean draft length of the latest step that drafted.", self._length)
        cached_tokens = Gauge(
            PREFIX + "prefix_cache_tokens",
            "Tokens of reusable KV held, by tier.",
            ("tier",),
            registry=registry,
        )
        cached_bytes = Gauge(
            PREFIX + "prefix_cache_bytes", "Bytes of reusable KV held, by tier.", ("tier",), registry=registry
        )
        for tier in ("slot", "host"):
            cached_tokens.labels(tier).set_function(partial(self._cache_gauge, f"{tier}_tier_tokens"))
            cached_bytes.labels(tier).set_function(partial(self._cache_gauge, f"{tier}_tier_bytes"))
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, CPU seconds, open fds

    def attach(self, engine: AsyncEngine, degraded: Callable[[], bool]) -> None:
        """Start feeding from ``engine`` (called once, before it serves requests)."""
        self._last = EngineStats()
        self._engine = engine
        self._degraded = degraded
        engine.step_observers.append(self.observe_step)
        pid = engine.engine_pid
        if (
            pid is not None
        ):  # the models' memory is the engine process's (engine_process_resident_memory_bytes)
            ProcessCollector(namespace="engine", pid=lambda: pid, registry=self.registry)

    # -- the engine's feeds ------------------------------------------------------------------------

    def observe_step(self, message: StepMessage) -> None:
        """One step's draft and verify time (the step observer)."""
        if message.draft_seconds > 0:
            self.draft_time.observe(message.draft_seconds)
        if message.verify_seconds > 0:
            self.verify_time.observe(message.verify_seconds)

    def observe_counters(self, snapshot: EngineSnapshot) -> None:
        """Export what the engine's counters gained since the last scrape."""
        stats, last = snapshot.stats, self._last
        drafts = stats.num_drafts - last.num_drafts
        draft_tokens = stats.num_draft_tokens - last.num_draft_tokens
        if drafts:  # drafts and draft tokens before accepted ones: a scrape never sees accepted > drafted
            self.num_drafts.inc(drafts)
            self.num_draft_tokens.inc(draft_tokens)
            self._draft_length = draft_tokens / drafts
        for position, count in enumerate(stats.accepted_per_position):
            before = last.accepted_per_position[position] if position < len(last.accepted_per_position) else 0
            if count > before:
                self.accepted_per_pos.labels(str(position)).inc(count - before)
        for name, count in stats.draft_tokens_by_drafter.items():  # drafted before accepted, as above
            if count > last.draft_tokens_by_drafter[name]:
                self.drafter_drafts.labels(name).inc(
                    stats.drafts_by_drafter[name] - last.drafts_by_drafter[name]
                )
                self.drafter_draft_tokens.labels(name).inc(count - last.draft_tokens_by_drafter[name])
        for name, count in stats.accepted_by_drafter.items():
            if count > last.accepted_by_drafter[name]:
                self.drafter_accepted_tokens.labels(name).inc(count - last.accepted_by_drafter[name])
        if stats.num_accepted_tokens > last.num_accepted_tokens:
            self.num_accepted_tokens.inc(stats.num_accepted_tokens - last.num_accepted_tokens)
        if stats.generated_tokens > last.generated_tokens:
            self.generation_tokens.inc(stats.generated_tokens - last.generated_tokens)
        if stats.drafter_failures > last.drafter_failures:
            self.drafter_failures.inc(stats.drafter_failures - last.drafter_failures)
        cstats = snapshot.prefix_cache
        if cstats is not None:
            prev = self._last_cache
            self.prefix_cache_queries.inc(cstats.queries - prev.queries)
            self.prefix_cache_hits.inc(cstats.hits - prev.hits)
            self.prefix_cache_drops.inc(cstats.host_drops - prev.host_drops)
            self._last_cache = cstats
        self._last = stats

    # -- event loop -------------------------------------------------------------------------------

    def observe_request(self, outcome: str, request: RequestState | None) -> None:
        """A generation request ended with ``outcome`` (one of OUTCOMES); request if it reached the engine."""
        self.requests.labels(outcome).inc()
        if request is None:
            return
        self.prompt_tokens.inc(len(request.prompt_ids))
        if outcome == "success" and request.finish_reason in FINISH_REASONS:
            self.request_success.labels(request.finish_reason).inc()
        if request.scheduled_time is not None:
            self.queue_time.observe(request.scheduled_time - request.arrival_time)
        if request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - request.arrival_time)
        if request.finish_time is not None and outcome == "success":
            self.e2e.observe(request.finish_time - request.arrival_time)
            if request.first_token_time is not None and len(request.output_ids) > 1:
                self.tpot.observe(
                    (request.finish_time - request.first_token_time) / (len(request.output_ids) - 1)
                )

    async def scrape(self) -> tuple[bytes, str]:
        """The engine's counters fetched now (between two steps), then the exposition text and its content
        type; a stopped or stalled engine leaves its counters where they were."""
        if self._engine is not None:
            with contextlib.suppress(EngineDeadError, TimeoutError, RuntimeError):
                self.observe_counters(await self._engine.refresh(SCRAPE_TIMEOUT_S))
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- scrape-time values -----------------------------------------------------------------------

    def _waiting(self) -> float:
        return self._engine.num_waiting if self._engine else 0

    def _kv_usage(self) -> float:
        return self._engine.kv_usage() if self._engine is not None else 0.0

    def _cache_gauge(self, name: str) -> float:
        usage = self._engine.prefix_cache_usage() if self._engine is not None else {}
        return float(usage.get(name, 0))

    def _enabled(self) -> float:
        return 1.0 if self._engine is not None and self._engine.speculation_active() else 0.0

    def _degraded_value(self) -> float:
        return 1.0 if self._degraded() else 0.0

    def _length(self) -> float:
        return self._draft_length if self._enabled() else 0.0
