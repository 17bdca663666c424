"""The HTTP service: ``create_app(cfg, recommender, ...)`` returns a FastAPI app (no global app).

Endpoints
---------
``POST /v1/generate``  next-k items for a history (:class:`~hstu.serve.schemas.GenerateRequest`).
``POST /v1/score``     target-aware scores of candidate items for a history, in input order.
``GET /healthz``       200 while the process is up.
``GET /readyz``        200 once the model is loaded and every bucket is warm (status "ready", or
                       "degraded" with the reason while requests were refused with 429 for load in
                       the last few seconds); 503 (with the reason) while warming, after a failed
                       warm-up, or while draining.
``GET /metrics``       Prometheus text format from the app's own registry (:mod:`hstu.serve.metrics`).
``GET /docs``          OpenAPI UI (``/openapi.json``).

Request path: parse and validate (pydantic, strict) → map the history to the run's dense ids
(``Recommender.prepare``: unknown ids dropped with a warning or rejected; out-of-order
timestamps sorted or rejected) → keep the most recent events that fit the largest bucket →
queue in the smallest bucket that holds the history (:mod:`hstu.serve.batcher`) → batch run
(:mod:`hstu.serve.runner`) → response with the bucket and the server latency.

Errors share one body, ``{"error": {"type", "message", "field"}}`` (vLLM's one-error-body habit):
422 invalid input (the field is named, e.g. ``history[3].timestamp``), 413 body over
``max_body_bytes``, 415 a Content-Type other than JSON, 408 a body that does not arrive within
``body_timeout_s`` of the headers (then the connection closes), 429 queue full (Retry-After), 503
timed out / memory shed / draining (Retry-After), 500 only for a bug. Every other answer, 500
included, keeps a keep-alive connection open.

Cold start: an empty history (or one left empty after dropping unknown ids) gets the run's most
popular training items (:mod:`hstu.serve.popularity`), marked ``"cold_start": true``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hstu import backend as backends
from hstu.backend.cpu import host_memory_info
from hstu.config import ServeConfig, check_k
from hstu.generate.recommend import History, HistoryError, Prepared, Recommender
from hstu.serve.batcher import MicroBatcher, Rejected
from hstu.serve.http_limits import error_body, is_json_media_type
from hstu.serve.metrics import ServeMetrics
from hstu.serve.popularity import Popularity
from hstu.serve.runner import BatchRunner, DecodeOptions, Job
from hstu.serve.schemas import ErrorBody, Event, GenerateRequest, GenerateResponse, ScoreRequest, ScoreResponse
from hstu.serve.worker import LocalModel, ProcessModel, WorkerSpec, batch_guard

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/generate", "/v1/score", "/healthz", "/readyz", "/metrics")
MODEL_ENDPOINTS = ("/v1/generate", "/v1/score")  # the ones admission may refuse


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
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        for name, valid in (("unknown_items", ("drop", "reject")), ("timestamp_order", ("sort", "reject")),
                            ("cold_start", ("popular", "reject")), ("use_engine", ("auto", "never", "require"))):
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


class BodyTooLarge(StarletteHTTPException):
    """Raised from the receive channel once a streamed body passes the limit (an HTTPException so
    that FastAPI's body reader re-raises it instead of wrapping it as a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class BodyTimeout(StarletteHTTPException):
    """Raised from the receive channel when the body has not fully arrived ``timeout_s`` after the
    headers (answered 408, ``Connection: close``: the rest of the body may still come)."""

    def __init__(self, timeout_s: float, received: int, length: int | None) -> None:
        of = f" of {length}" if length is not None else ""
        super().__init__(408, f"body: {received}{of} bytes arrived within the body timeout of {timeout_s:g} s",
                         headers={"Connection": "close"})


def _error(status: int, type_: str, message: str, field: str | None = None, headers: dict | None = None,
           errors: list[dict] | None = None) -> JSONResponse:
    body = error_body(type_, message, field)
    if errors:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, headers=headers)


class _EdgeMiddleware:
    """Pure ASGI middleware: 413 for bodies over the limit (by Content-Length, or while a chunked
    body streams in), 408 for a body not complete ``body_timeout_s`` after the headers (each
    ``receive()`` waits at most until then), the 500 error body for an unexpected exception (sent
    here, so the connection stays open: Starlette's ServerErrorMiddleware re-raises into uvicorn,
    which closes it), and ``hstu_serve_requests_total`` by endpoint and status. ``reject_early``
    (no argument; a :class:`Rejected` or None) is asked before a model endpoint's body is read:
    under overload a refused request then costs no JSON parsing or validation."""

    def __init__(self, app, *, limit: int, metrics: ServeMetrics, body_timeout_s: float = 5.0, reject_early=None) -> None:
        self.app, self.limit, self.metrics, self.body_timeout_s = app, limit, metrics, body_timeout_s
        self.reject_early = reject_early

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        state = {"code": 500, "started": False}
        scope["hstu_t0"] = time.perf_counter()  # arrival time, for latency_ms

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                state["code"], state["started"] = message["status"], True
            await send(message)

        try:
            length = next((int(v) for k, v in scope["headers"] if k == b"content-length"), None)
        except ValueError:
            length = None
        try:
            if length is not None and length > self.limit:
                self.metrics.reject("body_too_large")
                resp = _error(413, "body_too_large", f"request body of {length} bytes exceeds the limit of {self.limit} bytes", "body")
                return await resp(scope, receive, send_wrapper)
            early = self.reject_early is not None and endpoint in MODEL_ENDPOINTS and scope["method"] == "POST"
            refused = self.reject_early() if early else None
            if refused is not None:
                resp = _error(refused.status, refused.reason, refused.message, None, {"Retry-After": str(refused.retry_after)})
                return await resp(scope, receive, send_wrapper)
            received, complete = 0, False
            deadline = scope["hstu_t0"] + self.body_timeout_s

            async def receive_wrapper():
                nonlocal received, complete
                if complete:  # body read: now only a disconnect can come, which may take any time
                    return await receive()
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.perf_counter()))
                except TimeoutError:
                    raise BodyTimeout(self.body_timeout_s, received, length) from None
                complete = message["type"] != "http.request" or not message.get("more_body", False)
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > self.limit:
                        raise BodyTooLarge(self.limit)
                return message

            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            except Exception as exc:
                if state["started"]:
                    raise  # part of an answer is out: uvicorn closes the connection
                log.exception("unhandled error on %s", scope["path"], exc_info=exc)
                await _error(500, "internal_error", f"internal error: {type(exc).__name__}: {exc}")(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, code=str(state["code"])).inc()


async def read_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request body validated against ``model`` straight from its bytes (pydantic's JSON
    parser, ``model_validate_json``: one pass, no intermediate dict, none of FastAPI's
    per-parameter body handling; bare apps side by side on this project's 2-core box: ~0.57 ms
    of CPU per /v1/generate request against 0.7-1.0). Errors take FastAPI's path:
    RequestValidationError, loc under "body".

    Raises:
        ApiError: 415 when a Content-Type is given and is not JSON (``application/json`` or
            ``application/*+json``, UTF-8); a request without one is read as JSON (FastAPI's rule).
        RequestValidationError: the body is not valid JSON or not a valid ``model``.
    """
    ctype = request.headers.get("content-type")
    if ctype is not None and not is_json_media_type(ctype):
        raise ApiError(415, "unsupported_media_type", f"content-type: expected application/json (UTF-8), got {ctype!r}",
                       "content-type")
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) from None


def _json_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` of an endpoint that reads its body with :func:`read_body`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _add_schemas(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Put ``models`` (and the models they use) into the app's OpenAPI components, where the
    ``_json_body`` references point."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for m in models:
            js = m.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, d in js.pop("$defs", {}).items():
                comps.setdefault(name, d)
            comps[m.__name__] = js
        return schema

    app.openapi = openapi


class Service:
    """Everything one served run needs; lives on ``app.state.service``."""

    def __init__(self, cfg: ServeConfig, rec: Recommender, policy: ServePolicy, popularity: Popularity | None,
                 run_dir: str | None = None) -> None:
        self.cfg, self.rec, self.policy, self.popularity = cfg, rec, policy, popularity
        self.backend = backends.select(policy.device)
        if policy.model_process:
            if run_dir is None:
                raise ValueError("ServePolicy.model_process needs run_dir (the model process loads the run itself)")
            self.model = ProcessModel(WorkerSpec(str(run_dir), policy.device, policy.precision, tuple(cfg.buckets), cfg.max_batch,
                                                 policy.use_engine, policy.threads, cfg.memory_threshold, policy.model_workers))
        else:
            runner = BatchRunner(rec, list(cfg.buckets), cfg.max_batch, use_engine=policy.use_engine)
            self.model = LocalModel(runner, batch_guard(runner, self.backend, cfg.memory_threshold))
        kinds = ("host",) if self.backend.name == "cpu" else ("device", "host")
        self.metrics = ServeMetrics(self.model.buckets, kinds)
        self.precision = self.model.precision  # what the model thread / process loaded
        self.metrics.model_info.info(self.precision)
        self.dense = {int(r): i for i, r in enumerate(rec.raw_ids) if i > 0}  # original id -> dense id
        self.max_bucket = self.model.buckets[-1]
        self.batcher: MicroBatcher | None = None
        self.warm_task: asyncio.Task | None = None

    def update_memory(self) -> None:
        h = host_memory_info()
        self.metrics.set_memory("host", h.free_bytes, h.total_bytes)
        if self.backend.name != "cpu":
            d = self.backend.memory_info()
            self.metrics.set_memory("device", d.free_bytes, d.total_bytes)

    # ----- input -----
    def prepare(self, history: list[Event], request_time: int | None, exclude: list[int] | None, unknown: str | None,
                order: str | None) -> tuple[Prepared | None, list[str]]:
        """Validated, mapped, truncated history; (None, warnings) when nothing usable is left
        (empty, or every id unknown under the "drop" policy). Raises ApiError 422."""
        unknown = unknown or self.policy.unknown_items
        order = order or self.policy.timestamp_order
        if not history:
            return None, []
        h = History([e.item_id for e in history], [e.timestamp for e in history],
                    [e.action for e in history] if any(e.action is not None for e in history) else None, request_time, list(exclude or []))
        if unknown == "drop" and not any(e.item_id in self.dense for e in history):
            return None, [f"dropped {len(history)} event(s) with unknown item ids; no history left"]
        try:
            p = self.rec.prepare(h, unknown=unknown, order=order)
        except HistoryError as exc:
            msg = str(exc)
            raise ApiError(422, "validation_error", msg, msg.split(":", 1)[0]) from None
        warnings = list(p.warnings)
        n = len(p.ids)
        if n > self.max_bucket:
            m = self.max_bucket
            p = Prepared(p.ids[-m:], p.timestamps[-m:], p.actions[-m:], p.categories[-m:], p.request_time, p.warnings, p.block)
            warnings.append(f"history has {n} events; kept the most recent {m} (the largest bucket)")
        return p, warnings

    def check_room(self, prep: Prepared, req: GenerateRequest, dec: DecodeOptions) -> None:
        """ApiError 422 (field ``exclude``, or ``k`` without one) when the request's exclusions
        leave fewer than k items (beam: max(k, beam width)): checked per request, before batching."""
        need = max(req.k, dec.beam_width if dec.strategy == "beam" else 1)
        try:
            self.rec.check_room(prep, need, exclude_history=req.exclude_history, allow_untrained=req.allow_untrained_items,
                                field="exclude" if req.exclude else "k")
        except HistoryError as exc:
            msg = str(exc)
            raise ApiError(422, "validation_error", msg, msg.split(":", 1)[0]) from None

    def cold_start(self, k: int, exclude: list[int] | None) -> list[dict]:
        blocked = {self.dense[int(x)] for x in (exclude or []) if int(x) in self.dense}
        return [self.rec.describe(d, s) for d, s in self.popularity.top(k, blocked)]


def create_app(cfg: ServeConfig | None = None, recommender: Recommender | None = None, *, run_dir: str | None = None,
               policy: ServePolicy | None = None, popularity: Popularity | None = None) -> FastAPI:
    """Build the service for one run.

    Args:
        cfg: batching, queue, timeout and memory settings (defaults: ``ServeConfig()``).
        recommender: a loaded run; or give ``run_dir`` to load one with ``policy.device``.
        policy: input policies and limits (:class:`ServePolicy`).
        popularity: cold-start ranking; None disables cold start (empty history -> 422).
    Returns:
        a FastAPI app; state on ``app.state.service`` once its lifespan has started.
    Raises:
        ValueError: bad settings (buckets beyond the model's max_seq_len, ranges), naming the field.
        FileNotFoundError: ``run_dir`` is not a run directory.
    """
    cfg = cfg or ServeConfig()
    policy = policy or ServePolicy()
    policy.validate()
    if recommender is None:
        if run_dir is None:
            raise ValueError("create_app: give recommender or run_dir")
        recommender = Recommender.from_run(run_dir, policy.device)
    if not 0.0 <= cfg.memory_threshold <= 1.0:
        raise ValueError(f"memory_threshold must be in [0, 1], got {cfg.memory_threshold}")
    svc = Service(cfg, recommender, policy, popularity if policy.cold_start == "popular" else None, run_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Everything loaded so far (model, id maps, modules) lives as long as the process: move it out
        # of the collector's reach (gc.freeze), so that a full collection scans only per-request
        # garbage. Measured: without it, full collections stalled the event loop for 200-300 ms every
        # few seconds under load (P99 344 ms at 150 QPS; 77 ms with collections off).
        gc.collect()
        gc.freeze()
        svc.batcher = MicroBatcher(svc.model, svc.metrics, max_batch=cfg.max_batch, max_wait_ms=cfg.max_wait_ms,
                                   max_queue=cfg.max_queue, request_timeout_s=cfg.request_timeout_s,
                                   max_queue_delay_s=policy.max_queue_delay_ms / 1000.0)
        svc.batcher.start()
        if policy.warmup:
            svc.warm_task = asyncio.get_running_loop().create_task(svc.batcher.warmup())
        else:
            svc.model.warm.update(svc.model.buckets)
            svc.metrics.ready.set(1)
        log.info("serving %s (%d items) buckets %s, max batch %d, max wait %g ms, generation via %s", policy.device,
                 recommender.model.cfg.num_items, svc.model.buckets, cfg.max_batch, cfg.max_wait_ms, svc.model.backend_name)
        try:
            yield
        finally:
            if svc.warm_task is not None and not svc.warm_task.done():
                await asyncio.wait([svc.warm_task], timeout=cfg.request_timeout_s)
            await svc.batcher.drain(cfg.request_timeout_s)

    app = FastAPI(title="hstu", version="1", lifespan=lifespan,
                  description="HSTU generative recommender: next-k generation and target-aware scoring with micro-batching per length bucket.")
    app.state.service = svc
    app.add_middleware(_EdgeMiddleware, limit=policy.max_body_bytes, metrics=svc.metrics, body_timeout_s=cfg.body_timeout_s,
                       reject_early=lambda: svc.batcher.reject_early() if svc.batcher is not None else None)
    errors = {code: {"model": ErrorBody} for code in (408, 413, 415, 422, 429, 503)}

    # ----- error handlers: one body for all -----
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        items = []
        for e in exc.errors():
            loc = [p for p in e.get("loc", ()) if p != "body"]
            if e.get("type") == "json_invalid":  # pydantic's message names the line and column
                items.append({"type": "validation_error", "message": f"body: {e.get('msg', 'invalid JSON')}", "field": "body"})
                continue
            name = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "body"
            items.append({"type": "validation_error", "message": f"{name}: {e.get('msg', 'invalid')}", "field": name})
        svc.metrics.reject("invalid")
        first = items[0] if items else {"message": "invalid request", "field": None}
        return _error(422, "validation_error", first["message"], first["field"], errors=items)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        if exc.status == 422:
            svc.metrics.reject("invalid")
        elif exc.status == 415:
            svc.metrics.reject("unsupported_media_type")
        return _error(exc.status, exc.type, exc.message, exc.field, exc.headers)

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, exc: Rejected):
        return _error(exc.status, exc.reason, exc.message, None, {"Retry-After": str(exc.retry_after)})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 413:
            svc.metrics.reject("body_too_large")
            return _error(413, "body_too_large", str(exc.detail), "body")
        if isinstance(exc, BodyTimeout):
            svc.metrics.reject("body_timeout")
            return _error(408, "body_timeout", str(exc.detail), "body", exc.headers)
        return _error(exc.status_code, "http_error", str(exc.detail), None, getattr(exc, "headers", None))

    # ----- probes and metrics -----
    @app.get("/healthz", summary="process is up")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz", summary="model loaded and every bucket warm", responses={503: {"description": "not ready (reason given)"}})
    async def readyz():
        b = svc.batcher
        warm = {str(e): e in svc.model.warm for e in svc.model.buckets}
        body = {"buckets": warm, "generation": svc.model.backend_name, **svc.precision, "cold_start": svc.popularity is not None}
        if b is None:
            return JSONResponse({"status": "starting", **body}, status_code=503)
        if b.ready:
            if b.shedding:  # still HTTP 200: it answers, but refuses part of the load (429)
                return {"status": "degraded", "reason": f"shedding load: {b.shed_reason}", **body}
            return {"status": "ready", **body}
        status = ("draining" if b.draining else "failed" if b.warmup_error else
                  "restarting" if svc.model.available == 0 else "warming")
        return JSONResponse({"status": status, "reason": b.warmup_error, **body}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)  # documented as text/plain
    async def metrics():
        svc.update_memory()
        body, ctype = svc.metrics.exposition()
        return Response(body, media_type=ctype)

    # ----- model endpoints -----
    def check_request_k(k: int) -> None:
        try:
            check_k(k, svc.model.max_k)
        except ValueError as exc:
            raise ApiError(422, "validation_error", str(exc), "k") from None

    def since(request: Request) -> float:
        return time.perf_counter() - request.scope.get("hstu_t0", time.perf_counter())

    @app.post("/v1/generate", response_model=GenerateResponse, responses=errors, summary="next-k items for a history",
              openapi_extra=_json_body(GenerateRequest))
    async def generate(request: Request) -> Any:
        req: GenerateRequest = await read_body(request, GenerateRequest)
        check_request_k(req.k)
        prep, warnings = svc.prepare(req.history, req.request_time, req.exclude, req.unknown_items, req.timestamp_order)
        if prep is None:
            if svc.popularity is None:
                why = "cold start is disabled" if policy.cold_start == "reject" else "cold start is unavailable (the run's training data was not found)"
                raise ApiError(422, "validation_error", f"history: no usable events ({'; '.join(warnings) or 'empty'}) and {why}", "history")
            items, bucket, n, cold = svc.cold_start(req.k, req.exclude), None, 0, True
        else:
            d = req.decoding
            if d is not None and d.strategy == "beam" and svc.model.has_engine and d.beam_width > cfg.max_batch:
                raise ApiError(422, "validation_error", f"decoding.beam_width: at most the server's max batch {cfg.max_batch}, "
                               f"got {d.beam_width}", "decoding.beam_width")
            dec = DecodeOptions(d.strategy, d.top_k, d.temperature, d.beam_width, d.seed) if d else DecodeOptions()
            svc.check_room(prep, req, dec)  # before the request joins a batch: a 422 for it alone
            bucket = svc.model.bucket_for(len(prep.ids))
            items = await svc.batcher.submit(bucket, Job("generate", prep, k=req.k, decoding=dec, exclude_history=req.exclude_history,
                                                         allow_untrained=req.allow_untrained_items), since(request))
            n, cold = len(prep.ids), False
        dt = since(request)
        svc.metrics.request_duration.labels(endpoint="/v1/generate", bucket="cold_start" if cold else str(bucket)).observe(dt)
        svc.metrics.generated_items.inc(len(items))
        return JSONResponse({"user_id": req.user_id, "items": items, "bucket": bucket, "latency_ms": round(dt * 1e3, 3),
                             "history_length": n, "cold_start": cold, "warnings": warnings})

    @app.post("/v1/score", response_model=ScoreResponse, responses=errors,
              summary="target-aware scores of candidate items for a history, in input order", openapi_extra=_json_body(ScoreRequest))
    async def score(request: Request) -> Any:
        req: ScoreRequest = await read_body(request, ScoreRequest)
        if len(req.candidates) > policy.max_candidates:
            raise ApiError(422, "validation_error", f"candidates: at most {policy.max_candidates} per request, got {len(req.candidates)}",
                           "candidates")
        unknown = req.unknown_items or policy.unknown_items
        dense = np.zeros(len(req.candidates), dtype=np.int64)
        missing = []
        for i, c in enumerate(req.candidates):
            d = svc.dense.get(int(c))
            if d is None:
                if unknown == "reject":
                    raise ApiError(422, "validation_error", f"candidates[{i}]: unknown item id {c}", f"candidates[{i}]")
                missing.append(i)
            else:
                dense[i] = d
        prep, warnings = svc.prepare(req.history, req.request_time, None, req.unknown_items, req.timestamp_order)
        if prep is None:
            raise ApiError(422, "validation_error", f"history: no usable events ({'; '.join(warnings) or 'empty'}); "
                           "scoring needs at least one known event (cold start is offered by /v1/generate only)", "history")
        if missing:
            warnings.append(f"unknown candidate id(s) at {missing[:20]}{'...' if len(missing) > 20 else ''}: score null")
        bucket = svc.model.bucket_for(len(prep.ids))
        result = await svc.batcher.submit(bucket, Job("score", prep, candidates=dense), since(request))
        dt = since(request)
        svc.metrics.request_duration.labels(endpoint="/v1/score", bucket=str(bucket)).observe(dt)
        svc.metrics.scored_items.inc(len(req.candidates) - len(missing))
        return JSONResponse({"user_id": req.user_id, "scores": [None if np.isnan(s) else float(s) for s in result], "bucket": bucket,
                             "latency_ms": round(dt * 1e3, 3), "history_length": len(prep.ids), "warnings": warnings})

    _add_schemas(app, (GenerateRequest, ScoreRequest))
    return app


__all__ = ["ApiError", "ServePolicy", "Service", "create_app"]
