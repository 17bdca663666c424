"""Prometheus metrics of the service, in an explicit registry (no global default registry).

Names follow the Prometheus conventions (https://prometheus.io/docs/practices/naming/): the
``hstu_serve_`` prefix, base units in the name (``_seconds``, ``_bytes``), ``_total`` on counters.

=========================================== ========= ================= ==========================================
name                                        type      labels            meaning
=========================================== ========= ================= ==========================================
hstu_serve_request_duration_seconds         histogram endpoint, bucket  server time of answered (200) requests
hstu_serve_requests_total                   counter   endpoint, code    every answered request by HTTP status;
                                                                        endpoint: hstu.serve.edge.endpoint_of
                                                                        (an endpoint's path, also for that path
                                                                        with a trailing slash, a 404; else "other");
                                                                        "incomplete": headers that never completed
                                                                        (the header timeout's 408)
hstu_serve_batch_size                       histogram bucket            requests per executed batch
hstu_serve_batch_duration_seconds           histogram bucket            model time of one batch
hstu_serve_queue_wait_seconds               histogram bucket            admitted request's wait in its queue until
                                                                        its batch started (the delay admission bounds)
hstu_serve_queue_depth                      gauge     bucket            requests waiting in a bucket's queue
hstu_serve_generated_items_total            counter   (none)            items returned by /v1/generate
hstu_serve_scored_items_total               counter   (none)            candidates scored by /v1/score
hstu_serve_rejected_requests_total          counter   reason            shed or refused requests (see REASONS)
hstu_serve_memory_free_bytes                gauge     memory            free device / host memory
hstu_serve_memory_total_bytes               gauge     memory            total device / host memory
hstu_serve_memory_guard_triggers_total      counter   (none)            checks that found memory below threshold
hstu_serve_ready                            gauge     (none)            1 once every bucket is warm
hstu_serve_bucket_warm                      gauge     bucket            1 once that bucket is warm
hstu_serve_predicted_queue_delay_seconds    gauge     (none)            admission's predicted queueing delay, now
hstu_serve_queue_delay_limit_seconds        gauge     (none)            the bound it is held to (429 above it)
hstu_serve_event_loop_lag_seconds           gauge     (none)            decaying peak of the HTTP event loop's lag;
                                                                        admission reserves twice it (in and out)
hstu_serve_shedding                         gauge     (none)            1 while 429s for load were given in the last
                                                                        few seconds (/readyz "degraded")
hstu_serve_batch_cost_seconds               gauge     bucket, term      warm-up cost line (hstu.serve.admission:
                                                                        fixed, fixed_step, row, row_step,
                                                                        score_fixed, score_row)
hstu_serve_batch_cost_scale                 gauge     bucket, kind      learnt correction of those costs per kind
                                                                        (generate, score): predicted = cost x scale
=========================================== ========= ================= ==========================================

The bucket label is the bucket's upper edge in events (``"20"``), or ``"cold_start"`` for the
popularity path. ``hstu_serve_queue_depth`` is the exact name read by the ops alert rule
"data-movement storm" (``hstu/ops/default_alerts.yaml``); do not rename it.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

REASONS = (
    "queue_full",  # 429: the request's bucket holds max_queue requests
    "queue_delay",  # 429: its predicted queueing delay is over the bound (hstu_serve_queue_delay_limit_seconds)
    "timeout",
    "memory",
    "draining",
    "invalid",
    "body_too_large",
    "body_timeout",
    "header_timeout",  # 408: request headers not complete within header_timeout_s (hstu.serve.http_limits)
    "unsupported_media_type",
    "model_restart",
    "warming",
)

# Latency buckets (s): dense around the 100 ms P99 target.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Queue-wait buckets (s): fine around the default 1 s delay bound.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.1, 1.25, 1.5, 2.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """All serving metrics, registered in ``self.registry`` (a fresh :class:`CollectorRegistry`).

    Args:
        buckets: length-bucket edges, pre-created so every per-bucket series exists at 0.
        memory_kinds: ("host",) on CPU, ("device", "host") on an accelerator.
    """

    def __init__(self, buckets: list[int], memory_kinds: tuple[str, ...] = ("host",)) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.request_duration = Histogram(
            "hstu_serve_request_duration_seconds",
            "Server time of answered requests (s)",
            ["endpoint", "bucket"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter("hstu_serve_requests", "Answered requests by endpoint and HTTP status", ["endpoint", "code"], registry=r)
        self.batch_size = Histogram("hstu_serve_batch_size", "Requests per executed batch", ["bucket"], buckets=BATCH_BUCKETS, registry=r)
        self.batch_duration = Histogram(
            "hstu_serve_batch_duration_seconds", "Model time of one batch (s)", ["bucket"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "hstu_serve_queue_wait_seconds",
            "Wait of an admitted request in its queue until its batch started (s)",
            ["bucket"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("hstu_serve_queue_depth", "Requests waiting in a length bucket's queue", ["bucket"], registry=r)
        self.generated_items = Counter("hstu_serve_generated_items", "Items returned by /v1/generate", registry=r)
        self.scored_items = Counter("hstu_serve_scored_items", "Candidates scored by /v1/score", registry=r)
        self.rejected = Counter("hstu_serve_rejected_requests", "Requests shed or refused, by reason", ["reason"], registry=r)
        self.memory_free = Gauge("hstu_serve_memory_free_bytes", "Free memory (bytes)", ["memory"], registry=r)
        self.memory_total = Gauge("hstu_serve_memory_total_bytes", "Total memory (bytes)", ["memory"], registry=r)
        self.guard_triggers = Counter("hstu_serve_memory_guard_triggers", "Memory checks below the threshold", registry=r)
        self.prefix_lookups = Counter(
            "hstu_serve_prefix_cache_lookups", "User-prefix cache lookups of requests with a user_id, by result", ["result"], registry=r
        )
        self.prefix_rows = Counter("hstu_serve_prefix_cache_rows_reused", "History rows taken from the user-prefix cache", registry=r)
        self.prefix_evictions = Counter(
            "hstu_serve_prefix_cache_evictions", "Entries the bound pushed out of the user-prefix cache", registry=r
        )
        self.prefix_bytes = Gauge(
            "hstu_serve_prefix_cache_bytes", "User-prefix cache bytes after the latest batch (its process's)", registry=r
        )
        self.prefix_entries = Gauge("hstu_serve_prefix_cache_entries", "User-prefix cache users after the latest batch", registry=r)
        self.model_info = Info("hstu_serve_model", "The served model: precision and item-table storage", registry=r)
        self.ready = Gauge("hstu_serve_ready", "1 once the model is loaded and every bucket is warm", registry=r)
        self.bucket_warm = Gauge("hstu_serve_bucket_warm", "1 once the bucket is warm", ["bucket"], registry=r)
        self.predicted_delay = Gauge(
            "hstu_serve_predicted_queue_delay_seconds", "Predicted queueing delay of a request arriving now (s)", registry=r
        )
        self.delay_limit = Gauge("hstu_serve_queue_delay_limit_seconds", "Queueing-delay bound; above it requests get 429 (s)", registry=r)
        self.loop_lag = Gauge(
            "hstu_serve_event_loop_lag_seconds", "Decaying peak of the HTTP event loop's lag, reserved twice in admission (s)", registry=r
        )
        self.shedding = Gauge("hstu_serve_shedding", "1 while requests were refused (429) for load in the last few seconds", registry=r)
        self.batch_cost = Gauge(
            "hstu_serve_batch_cost_seconds", "Warm-up cost line of a bucket's batches (s), by term", ["bucket", "term"], registry=r
        )
        self.cost_scale = Gauge(
            "hstu_serve_batch_cost_scale", "Learnt correction of the warm-up costs, by kind of job", ["bucket", "kind"], registry=r
        )
        for b in buckets:
            self.queue_depth.labels(bucket=str(b)).set(0)
            self.bucket_warm.labels(bucket=str(b)).set(0)
            self.batch_size.labels(bucket=str(b))
            self.batch_duration.labels(bucket=str(b))  # every labelled series at 0 from the start (rate() needs a first sample)
            self.queue_wait.labels(bucket=str(b))
            for kind in ("generate", "score"):
                self.cost_scale.labels(bucket=str(b), kind=kind).set(1.0)
        for b in [*map(str, buckets), "cold_start"]:
            self.request_duration.labels(endpoint="/v1/generate", bucket=b)
        for b in buckets:
            self.request_duration.labels(endpoint="/v1/score", bucket=str(b))
        for reason in REASONS:
            self.rejected.labels(reason=reason)
        for result in ("hit", "miss"):
            self.prefix_lookups.labels(result=result)
        self.memory_kinds = memory_kinds

    def record_prefix(self, hits: int, misses: int, rows: int, evictions: int, nbytes: int, entries: int) -> None:
        """One batch's user-prefix cache figures (:attr:`hstu.serve.executor.BatchOutcome.prefix`)."""
        self.prefix_lookups.labels(result="hit").inc(hits)
        self.prefix_lookups.labels(result="miss").inc(misses)
        self.prefix_rows.inc(rows)
        self.prefix_evictions.inc(evictions)
        self.prefix_bytes.set(nbytes)
        self.prefix_entries.set(entries)

    def set_memory(self, kind: str, free_bytes: int, total_bytes: int) -> None:
        self.memory_free.labels(memory=kind).set(free_bytes)
        self.memory_total.labels(memory=kind).set(total_bytes)

    def set_cost(self, bucket: int, terms: dict[str, float]) -> None:
        """Publish a bucket's warm-up cost line (term -> seconds)."""
        for term, seconds in terms.items():
            self.batch_cost.labels(bucket=str(bucket), term=term).set(seconds)

    def reject(self, reason: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; valid: {REASONS}")
        self.rejected.labels(reason=reason).inc()

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["ServeMetrics", "REASONS", "LATENCY_BUCKETS", "BATCH_BUCKETS", "WAIT_BUCKETS"]
