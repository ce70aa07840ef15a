"""GET /metrics: the server's state and speed in Prometheus text format (prometheus_client writes it).

Engine-wide counts are read from the worker's latest snapshot at scrape time; latencies are histograms observed per
request as it finishes. Names follow Prometheus' conventions (`_total` counters, `_seconds` units). The counters
themselves are kept in stats.py (`EngineMetrics`, each request's `GenerationStats`); this module exports them, times
requests and adds the process's own (memory, CPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from verispec.engine.request import Update
from verispec.serve.worker import EngineFailure, Snapshot
from verispec.stats import peak_resident_bytes

PEAK_RSS = "verispec_process_peak_resident_memory_bytes"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


@dataclass
class _FinishedTotals:
    """Tokens and target calls summed over finished requests: each sequence's calls are the forwards it took part
    in (the engine's own count is of batched forwards, so its ratio would be tokens per batch, not tau)."""

    tokens: int = 0
    target_calls: int = 0


class _EngineCollector:
    """The engine's gauges and totals as of the worker's last step, and tau over finished requests."""

    def __init__(self, snapshot: Callable[[], Snapshot], finished: _FinishedTotals) -> None:
        self._snapshot, self._finished = snapshot, finished

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        m = snap.metrics
        yield GaugeMetricFamily("verispec_requests_running", "Requests in the engine's batch", value=m.running)
        yield GaugeMetricFamily(
            "verispec_requests_waiting", "Requests waiting for a slot in the batch", value=m.waiting + snap.queued
        )
        yield CounterMetricFamily("verispec_generation_tokens", "Output tokens generated", value=m.generated_tokens)
        yield CounterMetricFamily(
            "verispec_target_forwards",
            "Batched target verification forwards (one per engine step, whatever the batch size)",
            value=m.target_calls,
        )
        yield CounterMetricFamily("verispec_draft_tokens", "Tokens drafted", value=m.drafted_tokens)
        yield CounterMetricFamily(
            "verispec_draft_accepted_tokens", "Drafted tokens the target accepted", value=m.accepted_tokens
        )
        rate = m.accepted_tokens / m.drafted_tokens if m.drafted_tokens else 0.0
        yield GaugeMetricFamily("verispec_acceptance_rate", "Accepted / drafted tokens since the start", value=rate)
        yield GaugeMetricFamily(
            "verispec_exact",
            "1 where each request's tokens are bitwise those it gets alone (batch-invariant forwards)",
            value=int(m.exact),
        )
        yield GaugeMetricFamily(
            "verispec_kv_cache_budget_bytes",
            "Keys and values the running requests may hold together (--kv-cache-memory)",
            value=m.kv_budget_bytes,
        )
        yield GaugeMetricFamily(
            "verispec_kv_cache_reserved_bytes",
            "What the running requests reserve of the budget",
            value=m.kv_reserved_bytes,
        )
        yield GaugeMetricFamily("verispec_kv_cache_bytes", "What the key/value cache holds now", value=m.kv_bytes)
        done = self._finished
        tau = done.tokens / done.target_calls if done.target_calls else 0.0
        # The peak, not only the current size (prometheus_client's process_resident_memory_bytes): a client that
        # scrapes after a load sees what the load took, however briefly.
        yield GaugeMetricFamily(
            PEAK_RSS, "The server process's peak resident memory since it started", value=peak_resident_bytes()
        )
        yield GaugeMetricFamily(
            "verispec_mean_tokens_per_target_call",
            "tau: tokens per target forward a sequence took part in, over finished requests",
            value=tau,
        )


class ServerMetrics:
    """The server's registry: the engine collector plus per-request latency histograms and finish reasons."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry()
        self._totals = _FinishedTotals()
        self.registry.register(_EngineCollector(snapshot, self._totals))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds, open files
        self._ttft = Histogram(
            "verispec_time_to_first_token_seconds",
            "From a request's arrival to its first output token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._tpot = Histogram(
            "verispec_time_per_output_token_seconds",
            "A request's mean time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._finished = Counter(
            "verispec_requests_finished",
            'Requests that ended, by finish reason ("error": failed in the engine)',
            ["finish_reason"],
            registry=self.registry,
        )

    def clock(self) -> RequestClock:
        """Start timing one request (call at its arrival)."""
        return RequestClock(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def failed(self) -> None:
        self._finished.labels("error").inc()

    def finished(self, update: Update, seconds_per_token: float | None) -> None:
        self._finished.labels(update.finish_reason).inc()
        self._totals.tokens += update.stats.new_tokens
        self._totals.target_calls += update.stats.target_calls
        if seconds_per_token is not None:
            self._tpot.observe(seconds_per_token)


class RequestClock:
    """Times one request from its arrival: first token, then the mean time per token after it."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics, self._start = metrics, time.perf_counter()
        self._first: float | None = None
        self.tokens = 0

    def observe(self, update: Update | Exception) -> None:
        if isinstance(update, Exception):  # the end of the request: refused (bad input, not counted) or failed
            if isinstance(update, EngineFailure):
                self._metrics.failed()
            return
        now = time.perf_counter()
        if update.tokens and self._first is None:
            self._first = now
            self._metrics.first_token(now - self._start)
        self.tokens += len(update.tokens)
        if update.finished:
            per_token = (now - self._first) / (self.tokens - 1) if self._first is not None and self.tokens > 1 else None
            self._metrics.finished(update, per_token)
