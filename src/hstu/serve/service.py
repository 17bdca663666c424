"""The service layer: one served run's input checks, admission and batching, between the HTTP
routes (:mod:`hstu.serve.app`) and the executor (:mod:`hstu.serve.executor`).

:class:`Service` maps a validated request to the run's dense ids (unknown ids dropped or
rejected, out-of-order timestamps sorted or rejected, the history cut to the largest bucket),
answers cold starts from popularity, queues the rest in the smallest bucket that holds the history
(:class:`~hstu.serve.batcher.MicroBatcher`: admission, batching, deadlines) and builds the answer
body. Its executor is built with it but started only by :meth:`Service.start`, which the app's
lifespan calls (model processes load the run then), and stopped by :meth:`Service.stop` (drain).
Input errors are :class:`ApiError` (answered with the common error body by the app).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hstu import backend as backends
from hstu.backend.cpu import host_memory_info
from hstu.config import ServeConfig, check_k
from hstu.generate.api_checks import ignored_decoding
from hstu.generate.prefix_cache import entry_bytes
from hstu.generate.recommend import History, HistoryError, Prepared, Recommender
from hstu.serve.batcher import MicroBatcher, Rejected
from hstu.serve.executor import Executor, LocalModel, batch_guard
from hstu.serve.metrics import ServeMetrics
from hstu.serve.popularity import Popularity
from hstu.serve.runner import BatchRunner, DecodeOptions, Job
from hstu.serve import fast_body
from hstu.serve.schemas import Event, GenerateRequest, ScoreRequest
from hstu.serve.worker import ProcessModel, WorkerSpec

# a body in either form read_body returns (hstu.serve.fast_body: the same attributes)
GenerateBody = GenerateRequest | fast_body.GenerateRequest
ScoreBody = ScoreRequest | fast_body.ScoreRequest

log = logging.getLogger(__name__)


@dataclass
class ServePolicy:
    """Input policies and limits beyond :class:`hstu.config.ServeConfig`.

    unknown_items: "drop" (with a warning in the response) or "reject" (422) unknown item ids.
    timestamp_order: "sort" (stable, with a warning) or "reject" (422) out-of-order histories.
    max_body_bytes: larger request bodies answer 413 (default 1 MiB, ~15k events).
    max_candidates: most candidates per /v1/score request.
    cold_start: "popular" (most popular training items) or "reject" (422) for empty histories.
    max_queue_delay_ms: refuse with 429 when the predicted queueing delay is longer (default 1000).
    use_engine: "auto" | "never" | "require" (see :class:`hstu.serve.runner.BatchRunner`).
    warmup: warm every bucket at start-up (readiness waits for it).
    model_process: run batches in a model process of their own (:class:`hstu.serve.worker.ProcessModel`,
        needs ``run_dir``) instead of a thread of this process; ``hstu serve`` does by default.
    precision, threads: the model process's inference precision and torch threads.
    model_workers: model processes (each with its own copy of the model, one batch each at a time).
    exclude_history: the candidate policy of requests that do not set ``exclude_history`` (None:
        the run's, idmap.json ``exclude_history_default``); ``hstu serve --[no-]exclude-history``.
    """

    unknown_items: str = "drop"
    timestamp_order: str = "sort"
    max_body_bytes: int = 1 << 20
    max_candidates: int = 1000
    cold_start: str = "popular"
    max_queue_delay_ms: float = 1000.0
    use_engine: str = "auto"
    warmup: bool = True
    device: str = "cpu"
    model_process: bool = False
    precision: str | None = None
    threads: int | None = None
    model_workers: int = 1
    exclude_history: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        for name, valid in (
            ("unknown_items", ("drop", "reject")),
            ("timestamp_order", ("sort", "reject")),
            ("cold_start", ("popular", "reject")),
            ("use_engine", ("auto", "never", "require")),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(f"ServePolicy.{name} must be one of {valid}, got {getattr(self, name)!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"ServePolicy.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_queue_delay_ms <= 0:
            raise ValueError(f"ServePolicy.max_queue_delay_ms must be > 0, got {self.max_queue_delay_ms}")
        if self.max_candidates < 1:
            raise ValueError(f"ServePolicy.max_candidates must be >= 1, got {self.max_candidates}")


class ApiError(Exception):
    """An error answered with the common body; ``field`` names the offending input."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.field, self.headers = status, type_, message, field, headers


def _invalid(exc: HistoryError) -> ApiError:
    """The 422 of a history the Recommender refused; its message starts with the field's name."""
    msg = str(exc)
    return ApiError(422, "validation_error", msg, msg.split(":", 1)[0])


class Service:
    """Everything one served run needs; lives on ``app.state.service``.

    Args: as :func:`hstu.serve.app.create_app` (``popularity`` None: no cold start). Building it
    starts nothing: the executor (``model``) starts in :meth:`start`.

    Raises:
        ValueError: ``memory_threshold`` outside [0, 1]; ``model_process`` without ``run_dir``;
            a bucket past the model's max_seq_len.
    """

    def __init__(
        self, cfg: ServeConfig, rec: Recommender, policy: ServePolicy, popularity: Popularity | None, run_dir: str | None = None
    ) -> None:
        if not 0.0 <= cfg.memory_threshold <= 1.0:
            raise ValueError(f"memory_threshold must be in [0, 1], got {cfg.memory_threshold}")
        self.cfg, self.rec, self.policy, self.popularity = cfg, rec, policy, popularity
        self.backend = backends.select(policy.device)
        self.model: Executor = self._executor(run_dir)
        kinds = ("host",) if self.backend.is_host else ("device", "host")  # one memory budget on a host backend
        self.metrics = ServeMetrics(self.model.buckets, kinds)
        self.max_bucket = self.model.buckets[-1]
        self.batcher: MicroBatcher | None = None
        self.warm_task: asyncio.Task | None = None

    def _executor(self, run_dir: str | None) -> Executor:
        """The model thread (its runner built here), or model processes (not started yet)."""
        cfg, policy = self.cfg, self.policy
        if not policy.model_process:
            if cfg.ann:
                self.rec.attach_ann(cfg.ann, cfg.ann_nprobe, cfg.ann_candidates)
            runner = BatchRunner(
                self.rec,
                list(cfg.buckets),
                cfg.max_batch,
                use_engine=policy.use_engine,
                graphs=cfg.graphs,
                prefix_cache_mb=cfg.prefix_cache_mb,
            )
            return LocalModel(runner, batch_guard(runner, self.backend, cfg.memory_threshold))
        if run_dir is None:
            raise ValueError("ServePolicy.model_process needs run_dir (the model process loads the run itself)")
        if cfg.buckets[-1] > self.rec.max_len:  # what the model process's runner would say, said before it starts
            raise ValueError(
                f"bucket {cfg.buckets[-1]} exceeds the model's max_seq_len={self.rec.max_len}; use edges <= {self.rec.max_len}"
            )
        spec = WorkerSpec(
            str(run_dir),
            policy.device,
            policy.precision,
            tuple(cfg.buckets),
            cfg.max_batch,
            policy.use_engine,
            policy.threads,
            cfg.memory_threshold,
            policy.model_workers,
            cfg.graphs,
            cfg.ann,
            cfg.ann_nprobe,
            cfg.ann_candidates,
            cfg.prefix_cache_mb,
        )
        return ProcessModel(spec, start=False)

    @property
    def precision(self) -> dict[str, str]:
        """What the model thread / process loaded (once started)."""
        return self.model.precision

    # ----- lifecycle (the app's lifespan) -----
    async def start(self) -> None:
        """Start the executor (model processes load the run), then the micro-batcher and the
        warm-up of every bucket (readiness waits for it; ``policy.warmup`` False: none).
        Raises what the executor's start raised (ModelProcessDied, TimeoutError, FileNotFoundError, ...)."""
        cfg, policy = self.cfg, self.policy
        await self.model.start()
        self.metrics.model_info.info(self.model.precision)
        # Everything loaded so far (model, id maps, modules) lives as long as the process: move it out
        # of the collector's reach (gc.freeze), so that a full collection scans only per-request
        # garbage. Measured: without it, full collections stalled the event loop for 200-300 ms every
        # few seconds under load (P99 344 ms at 150 QPS; 77 ms with collections off).
        gc.collect()
        gc.freeze()
        self.batcher = MicroBatcher(
            self.model,
            self.metrics,
            max_batch=cfg.max_batch,
            max_wait_ms=cfg.max_wait_ms,
            max_queue=cfg.max_queue,
            request_timeout_s=cfg.request_timeout_s,
            max_queue_delay_s=policy.max_queue_delay_ms / 1000.0,
        )
        self.batcher.start()
        if policy.warmup:
            self.warm_task = asyncio.get_running_loop().create_task(self.batcher.warmup())
        else:
            self.model.warm.update(self.model.buckets)
            self.metrics.ready.set(1)
        log.info(
            "serving %s (%d items) buckets %s, max batch %d, max wait %g ms, generation via %s, picks %s, user-prefix cache %s",
            policy.device,
            self.rec.model.cfg.num_items,
            self.model.buckets,
            cfg.max_batch,
            cfg.max_wait_ms,
            self.model.backend_name,
            f"among approximate candidates ({cfg.ann}, nprobe {cfg.ann_nprobe}, {cfg.ann_candidates} per row)" if cfg.ann else "exact",
            self._prefix_line(),
        )

    def _prefix_line(self) -> str:
        """The start-up line's user-prefix cache: its bound, where it lives and about how many users of the
        largest bucket's length it holds; a warning when it holds none, or when several model processes
        each cache the users they served (routed by :mod:`hstu.serve.affinity` only while several are idle)."""
        cfg, policy = self.cfg, self.policy
        if not cfg.prefix_cache_mb:
            return "off"
        per = entry_bytes(self.rec.model.cfg, self.max_bucket)
        users = int(cfg.prefix_cache_mb * 2**20 // per)
        n = policy.model_workers
        where = ("the model process" if n == 1 else f"each of {n} model processes") if policy.model_process else "the model thread"
        if users < 1:
            log.warning(
                "--prefix-cache-mb %g holds no user of %d events (%.0f KiB each): users with histories that long always miss",
                cfg.prefix_cache_mb,
                self.max_bucket,
                per / 1024,
            )
        if policy.model_process and n > 1:
            log.warning(
                "--prefix-cache-mb with %d model processes: each caches the users it served; a batch goes to the idle one "
                "that last ran most of its users, but under load to the first that frees (a user may then miss, or be cached twice)",
                n,
            )
        size = f"~{users} users of {self.max_bucket} events, {per / 1024:.0f} KiB each"
        return f"{cfg.prefix_cache_mb:g} MiB in {where}, keyed by user_id ({size})"

    async def stop(self) -> None:
        """Let the warm-up end (up to the request timeout), then drain: queued requests finish,
        new ones get 503, and the executor stops."""
        if self.warm_task is not None and not self.warm_task.done():
            await asyncio.wait([self.warm_task], timeout=self.cfg.request_timeout_s)
        await self.batcher.drain(self.cfg.request_timeout_s)

    def reject_early(self) -> Rejected | None:
        """:meth:`MicroBatcher.reject_early`, None before the batcher runs (for the HTTP edge)."""
        return self.batcher.reject_early() if self.batcher is not None else None

    def readiness(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /readyz: 200 "ready" or "degraded" (shedding load); 503 "starting",
        "draining", "failed" (warm-up), "restarting" (no live model process) or "warming"."""
        b = self.batcher
        warm = {str(e): e in self.model.warm for e in self.model.buckets}
        body = {"buckets": warm, "generation": self.model.backend_name, **self.precision, "cold_start": self.popularity is not None}
        if b is None:
            return 503, {"status": "starting", **body}
        if b.ready:
            if b.shedding:  # still HTTP 200: it answers, but refuses part of the load (429)
                return 200, {"status": "degraded", "reason": f"shedding load: {b.shed_reason}", **body}
            return 200, {"status": "ready", **body}
        status = "draining" if b.draining else "failed" if b.warmup_error else "restarting" if self.model.available == 0 else "warming"
        return 503, {"status": status, "reason": b.warmup_error, **body}

    def update_memory(self) -> None:
        h = host_memory_info()
        self.metrics.set_memory("host", h.free_bytes, h.total_bytes)
        if self.backend.name != "cpu":
            d = self.backend.memory_info()
            self.metrics.set_memory("device", d.free_bytes, d.total_bytes)

    # ----- input -----
    def prepare(
        self,
        history: list[Event] | list[fast_body.Event],
        request_time: int | None,
        exclude: list[int] | None,
        unknown: str | None,
        order: str | None,
    ) -> tuple[Prepared | None, list[str]]:
        """Validated, mapped, truncated history; (None, warnings) when nothing usable is left
        (empty, or every id unknown under the "drop" policy). Raises ApiError 422."""
        unknown = unknown or self.policy.unknown_items
        order = order or self.policy.timestamp_order
        if not history:
            return None, []
        n = len(history)
        actions = [e.action for e in history]
        features = [e.features for e in history]
        h = History(
            [e.item_id for e in history],
            [e.timestamp for e in history],
            None if actions.count(None) == n else actions,  # list.count: one pass in C, not a generator per event
            request_time,
            list(exclude or []),
            features=None if features.count(None) == n else features,
        )
        try:
            p = self.rec.prepare(h, unknown=unknown, order=order)  # maps the ids once
        except HistoryError as exc:
            try:  # only on a refusal: was every id unknown (then no history, not an error)?
                none_known = unknown == "drop" and not (self.rec.dense_ids(h.items) > 0).any()
            except HistoryError as bad_id:
                raise _invalid(bad_id) from None
            if none_known:
                gone = [e.item_id for e in history[:5]]  # named, as Recommender.prepare's drop warning names them
                more = f" and {len(history) - 5} more" if len(history) > 5 else ""
                return None, [f"dropped {len(history)} event(s) with unknown item ids: {', '.join(map(repr, gone))}{more}; no history left"]
            raise _invalid(exc) from None
        warnings = list(p.warnings)
        n = len(p.ids)
        if n > self.max_bucket:
            m = self.max_bucket
            older = np.concatenate([p.older, p.ids[:-m]])
            p = Prepared(p.ids[-m:], p.timestamps[-m:], p.actions[-m:], p.categories[-m:], p.request_time, p.warnings, p.block, older)
            warnings.append(f"history has {n} events; kept the most recent {m} (the largest bucket)")
        return p, warnings

    def exclude_history(self, req: GenerateBody) -> bool | None:
        """The request's candidate policy: its ``exclude_history``, else the server's, else None (the run's)."""
        return req.exclude_history if req.exclude_history is not None else self.policy.exclude_history

    def check_room(self, prep: Prepared, req: GenerateBody, dec: DecodeOptions) -> None:
        """ApiError 422 (field ``exclude``, or ``k`` without one) when the request's exclusions
        leave fewer than k items (beam: max(k, beam width)): checked per request, before batching."""
        need = max(req.k, dec.beam_width if dec.strategy == "beam" else 1)
        try:
            self.rec.check_room(
                prep,
                need,
                exclude_history=self.exclude_history(req),
                allow_untrained=req.allow_untrained_items,
                field="exclude" if req.exclude else "k",
            )
        except HistoryError as exc:
            raise _invalid(exc) from None

    def cold_start(self, k: int, exclude: list[int] | None, allow_untrained: bool | None = None) -> list[dict]:
        """The ``k`` most popular training items not in ``exclude``, and with training events
        unless ``allow_untrained`` (the run's default as for a request with a history:
        Recommender.allows_untrained); ApiError 422 naming ``exclude`` when fewer are left (as a
        request with a history gets: Recommender.check_room)."""
        try:
            blocked = {int(d) for d in self.rec.dense_ids(exclude or [], "exclude[{i}]") if d > 0}
        except HistoryError as exc:
            raise _invalid(exc) from None
        trained_only = not self.rec.allows_untrained(allow_untrained)
        top = self.popularity.top(k, blocked, trained_only)
        if len(top) < k:
            which = "popular items with training events" if trained_only else "popular items"
            raise _invalid(
                HistoryError(
                    f"exclude: only {len(top)} of the run's {which} (the cold-start answer) are left to generate "
                    f"({len(blocked)} excluded by 'exclude'), fewer than the {k} needed"
                )
            )
        return [self.rec.describe(d, s) for d, s in top]

    # ----- requests -----
    async def generate(self, req: GenerateBody, t0: float) -> dict[str, Any]:
        """The /v1/generate body for ``req``, which arrived at ``t0`` (``time.perf_counter()``).
        Raises ApiError 422 (k, history, exclusions, beam width) and what the batcher raises (Rejected)."""
        try:
            check_k(req.k, self.model.max_k)
        except ValueError as exc:
            raise ApiError(422, "validation_error", str(exc), "k") from None
        d, max_batch = req.decoding, self.cfg.max_batch
        if d is not None and d.strategy == "beam" and self.model.has_engine and d.beam_width > max_batch:  # cold start too: one answer
            raise ApiError(
                422,
                "validation_error",
                f"decoding.beam_width: at most the server's max batch {max_batch}, got {d.beam_width}",
                "decoding.beam_width",
            )
        prep, warnings = self.prepare(req.history, req.request_time, req.exclude, req.unknown_items, req.timestamp_order)
        if prep is None:
            if self.popularity is None:
                why = (
                    "cold start is disabled"
                    if self.policy.cold_start == "reject"
                    else "cold start is unavailable (the run's training data was not found)"
                )
                raise ApiError(
                    422, "validation_error", f"history: no usable events ({'; '.join(warnings) or 'empty'}) and {why}", "history"
                )
            items, bucket, n, cold = self.cold_start(req.k, req.exclude, req.allow_untrained_items), None, 0, True
            if d is not None and d.strategy != "greedy":
                warnings.append(f"decoding: strategy '{d.strategy}' is not used for a cold-start answer (the most popular items, in order)")
        else:
            dec = d.options() if d else DecodeOptions()
            warnings += filter(None, [ignored_decoding(dec)])  # e.g. top_k with strategy beam: said, not silently dropped
            self.check_room(prep, req, dec)  # before the request joins a batch: a 422 for it alone
            bucket = self.model.bucket_for(len(prep.ids))
            ranked = await self.batcher.submit(
                bucket,
                Job(
                    "generate",
                    prep,
                    k=req.k,
                    decoding=dec,
                    exclude_history=self.exclude_history(req),
                    allow_untrained=req.allow_untrained_items,
                    user_id=req.user_id,
                ),
                time.perf_counter() - t0,
            )
            items, n, cold = self.rec.describe_ranked(ranked), len(prep.ids), False  # dense ids -> original ids, titles
        dt = time.perf_counter() - t0
        self.metrics.request_duration.labels(endpoint="/v1/generate", bucket="cold_start" if cold else str(bucket)).observe(dt)
        self.metrics.generated_items.inc(len(items))
        return {
            "user_id": req.user_id,
            "items": items,
            "bucket": bucket,
            "latency_ms": round(dt * 1e3, 3),
            "history_length": n,
            "cold_start": cold,
            "warnings": warnings,
        }

    async def score(self, req: ScoreBody, t0: float) -> dict[str, Any]:
        """The /v1/score body for ``req`` (scores in candidate order, null for an unknown candidate),
        which arrived at ``t0``. Raises ApiError 422 (candidates, history) and Rejected."""
        policy = self.policy
        if len(req.candidates) > policy.max_candidates:
            raise ApiError(
                422, "validation_error", f"candidates: at most {policy.max_candidates} per request, got {len(req.candidates)}", "candidates"
            )
        unknown = req.unknown_items or policy.unknown_items
        try:
            dense = self.rec.dense_ids(req.candidates, "candidates[{i}]")  # (C,) 0 = unknown
        except HistoryError as exc:
            raise _invalid(exc) from None
        missing = np.nonzero(dense == 0)[0].tolist()
        if missing and unknown == "reject":
            i = missing[0]
            raise ApiError(422, "validation_error", f"candidates[{i}]: unknown item id {req.candidates[i]!r}", f"candidates[{i}]")
        prep, warnings = self.prepare(req.history, req.request_time, None, req.unknown_items, req.timestamp_order)
        if prep is None:
            raise ApiError(
                422,
                "validation_error",
                f"history: no usable events ({'; '.join(warnings) or 'empty'}); "
                "scoring needs at least one known event (cold start is offered by /v1/generate only)",
                "history",
            )
        if missing:
            warnings.append(f"unknown candidate id(s) at {missing[:20]}{'...' if len(missing) > 20 else ''}: score null")
        bucket = self.model.bucket_for(len(prep.ids))
        result = await self.batcher.submit(bucket, Job("score", prep, candidates=dense), time.perf_counter() - t0)
        dt = time.perf_counter() - t0
        self.metrics.request_duration.labels(endpoint="/v1/score", bucket=str(bucket)).observe(dt)
        self.metrics.scored_items.inc(len(req.candidates) - len(missing))
        return {
            "user_id": req.user_id,
            "scores": [None if np.isnan(s) else float(s) for s in result],
            "bucket": bucket,
            "latency_ms": round(dt * 1e3, 3),
            "history_length": len(prep.ids),
            "warnings": warnings,
        }


__all__ = ["ApiError", "ServePolicy", "Service"]
