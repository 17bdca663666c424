"""The HTTP service: ``create_app(cfg, recommender, ...)`` returns a FastAPI app (no global app).

Layers, calls going down only: this module (routes, error handlers, middleware) → the service
(:mod:`hstu.serve.service`: input checks, admission, batching, buckets; the HTTP edge in
:mod:`hstu.serve.edge`) → the executor (:mod:`hstu.serve.executor`: a model thread, or model
processes, :mod:`hstu.serve.worker`). Building the app starts nothing: the executor starts (model
processes load the run) and stops in the app's lifespan.

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
``GET /docs``          OpenAPI UI (``/openapi.json``), Swagger UI from local files (``fastapi-offline``: works
                       offline); ``GET /redoc`` the same with ReDoc.

Request path: parse and validate (pydantic, strict) → map the history to the run's dense ids
(``Recommender.prepare``: unknown ids dropped with a warning or rejected; out-of-order
timestamps sorted or rejected) → keep the most recent events that fit the largest bucket →
queue in the smallest bucket that holds the history (:mod:`hstu.serve.batcher`) → batch run
(:mod:`hstu.serve.runner`) → response with the bucket and the server latency.

Errors share one body, ``{"error": {"type", "message", "field"}}`` (vLLM's one-error-body habit):
422 invalid input (the field is named, e.g. ``history[3].timestamp``), 413 body over
``max_body_bytes`` (then the connection closes: the rest of the body may still come), 415 a
Content-Type other than JSON, 404 a path with no endpoint (no trailing-slash redirect: the message
of ``/v1/generate/`` names ``/v1/generate``), 408 a body that does not arrive within
``body_timeout_s`` of the headers, or request headers not complete within ``header_timeout_s``
(:func:`hstu.serve.edge.header_timeout_response`, written by the HTTP protocol of
:mod:`hstu.serve.http_limits`; then the connection closes), 429 queue full or predicted
queueing delay over the bound (types ``queue_full``, ``queue_delay``; Retry-After), 503 timed out /
memory shed / draining (Retry-After), 500 only for a bug. Every other answer, 500 included, keeps a
keep-alive connection open.

Cold start: an empty history (or one left empty after dropping unknown ids) gets the run's most
popular training items (:mod:`hstu.serve.popularity`), marked ``"cold_start": true``.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from hstu.config import ServeConfig
from hstu.generate.recommend import Recommender
from hstu.serve.batcher import Rejected
from hstu.serve.edge import (
    ENDPOINTS,
    BodyTimeout,
    EdgeMiddleware,
    endpoint_of,
    error_response,
    header_timeout_response,
    json_response,
    read_body,
)
from hstu.serve.popularity import Popularity
from hstu.serve.schemas import public_errors, ErrorBody, GenerateRequest, GenerateResponse, ScoreRequest, ScoreResponse
from hstu.serve.service import ApiError, ServePolicy, Service

DESCRIPTION = "HSTU generative recommender: next-k generation and target-aware scoring with micro-batching per length bucket."


def create_app(
    cfg: ServeConfig | None = None,
    recommender: Recommender | None = None,
    *,
    run_dir: str | None = None,
    policy: ServePolicy | None = None,
    popularity: Popularity | None = None,
) -> FastAPI:
    """Build the service for one run; starts nothing (no model process, no thread) until its lifespan.

    Args:
        cfg: batching, queue, timeout and memory settings (defaults: ``ServeConfig()``).
        recommender: a loaded run; or give ``run_dir`` to load one with ``policy.device``.
        run_dir: the run directory (needed with ``policy.model_process``: each model process loads it).
        policy: input policies and limits (:class:`ServePolicy`).
        popularity: cold-start ranking; None disables cold start (empty history -> 422).
    Returns:
        a FastAPI app with its :class:`Service` on ``app.state.service`` and the header timeout's
        408 on ``app.state.header_timeout_answer`` (for :func:`hstu.serve.http_limits.http_protocol`);
        the lifespan's start-up starts the executor (raising what loading the run in a model
        process raised), the batcher and the warm-up, its shutdown drains.
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
    svc = Service(cfg, recommender, policy, popularity if policy.cold_start == "popular" else None, run_dir)
    # FastAPIOffline: FastAPI whose /docs and /redoc load Swagger UI / ReDoc from files it serves (no CDN);
    # validatorUrl None: Swagger UI does not send the spec's URL to its online validator (swagger.io);
    # redirect_slashes False: "/v1/generate/" is a 404 error body naming "/v1/generate" (_error_answers),
    # not Starlette's 307 with an empty body (which most clients would not follow with a POST body)
    app = FastAPIOffline(
        title="hstu",
        version="1",
        lifespan=_lifespan(svc),
        description=DESCRIPTION,
        swagger_ui_parameters={"validatorUrl": None},
        redirect_slashes=False,
    )
    app.state.service = svc
    # the header timeout's 408, for the HTTP protocol (hstu.serve.http_limits.http_protocol): the one error body, counted
    app.state.header_timeout_answer = partial(header_timeout_response, svc.metrics)
    on_error, kinds = _error_answers(svc)
    app.state.direct_routes = routes = {}  # the model endpoints, answered by the edge (EdgeMiddleware ``routes``)
    app.add_middleware(
        EdgeMiddleware,
        limit=policy.max_body_bytes,
        metrics=svc.metrics,
        body_timeout_s=cfg.body_timeout_s,
        reject_early=svc.reject_early,
        routes=routes,
        on_error=on_error,
    )
    _add_error_handlers(app, on_error, kinds)
    routes.update(_add_model_routes(app, svc))  # first: the router tries routes in order (the framework's path: docs, fallback)
    _add_probes(app, svc)
    _add_schemas(app, (GenerateRequest, ScoreRequest))
    return app


def _lifespan(svc: Service):
    """The app's lifespan: the service (its executor, batcher, warm-up) starts before the first
    request and drains after the last."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await svc.start()
        try:
            yield
        finally:
            await svc.stop()

    return lifespan


def _error_answers(svc: Service):
    """The one mapping of a request's errors to answers (module docstring), each refusal counted by
    reason: (``answer(exc, path)`` -> the error response to a request for ``path``, or None for an
    exception that is a bug (500); the exception classes it answers)."""

    def invalid(exc: RequestValidationError, path: str) -> Response:
        items = []
        for e in public_errors(exc.errors()):
            loc = [p for p in e.get("loc", ()) if p != "body"]
            if e.get("type") == "json_invalid":  # pydantic's message names the line and column
                items.append({"type": "validation_error", "message": f"body: {e.get('msg', 'invalid JSON')}", "field": "body"})
                continue
            name = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "body"
            items.append({"type": "validation_error", "message": f"{name}: {e.get('msg', 'invalid')}", "field": name})
        svc.metrics.reject("invalid")
        first = items[0] if items else {"message": "invalid request", "field": None}
        return error_response(422, "validation_error", first["message"], first["field"], errors=items)

    def api(exc: ApiError, path: str) -> Response:
        if exc.status == 422:
            svc.metrics.reject("invalid")
        elif exc.status == 415:
            svc.metrics.reject("unsupported_media_type")
        return error_response(exc.status, exc.type, exc.message, exc.field, exc.headers)

    def http(exc: StarletteHTTPException, path: str) -> Response:
        if exc.status_code == 404:  # no route (the router's): a known endpoint's path with a trailing slash is named
            known = endpoint_of(path)
            hint = f"; did you mean {known} (without the trailing slash)?" if known in ENDPOINTS else ""
            return error_response(404, "not_found", f"no endpoint at {path}{hint}", None)
        if exc.status_code == 413:
            svc.metrics.reject("body_too_large")
            return error_response(413, "body_too_large", str(exc.detail), "body", exc.headers)
        if isinstance(exc, BodyTimeout):
            svc.metrics.reject("body_timeout")
            return error_response(408, "body_timeout", str(exc.detail), "body", exc.headers)
        return error_response(exc.status_code, "http_error", str(exc.detail), None, getattr(exc, "headers", None))

    def rejected(exc: Rejected, path: str) -> Response:
        return error_response(exc.status, exc.reason, exc.message, None, {"Retry-After": str(exc.retry_after)})

    kinds = ((RequestValidationError, invalid), (ApiError, api), (Rejected, rejected), (StarletteHTTPException, http))

    def answer(exc: Exception, path: str) -> Response | None:
        return next((fn(exc, path) for kind, fn in kinds if isinstance(exc, kind)), None)

    return answer, tuple(k for k, _ in kinds)


def _add_error_handlers(app: FastAPI, answer, kinds: tuple[type[Exception], ...]) -> None:
    """The framework's exception handlers: each of ``kinds`` answered by ``answer``."""

    async def handler(request: Request, exc: Exception) -> Response:
        return answer(exc, request.scope["path"])

    for kind in kinds:
        app.add_exception_handler(kind, handler)


def _add_probes(app: FastAPI, svc: Service) -> None:
    """/healthz, /readyz and /metrics."""

    @app.get("/healthz", summary="process is up")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz", summary="model loaded and every bucket warm", responses={503: {"description": "not ready (reason given)"}})
    async def readyz():
        code, body = svc.readiness()
        return body if code == 200 else json_response(body, code)

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)  # documented as text/plain
    async def metrics():
        svc.update_memory()
        body, ctype = svc.metrics.exposition()
        return Response(body, media_type=ctype)

    for path, probe in (("/healthz", healthz), ("/readyz", readyz), ("/metrics", metrics)):  # HEAD too, as balancers probe (was 405)
        app.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)


def _arrival(request: Request) -> float:
    """When the request arrived (``time.perf_counter()``, set by the edge middleware)."""
    return request.scope.get("hstu_t0") or time.perf_counter()


def _add_model_routes(app: FastAPI, svc: Service) -> dict[str, Any]:
    """/v1/generate and /v1/score: the body read and validated here, the rest in the service.
    Returns {path: endpoint}, the same functions, for the edge's direct routes."""
    errors = {code: {"model": ErrorBody} for code in (408, 413, 415, 422, 429, 503)}
    endpoints = {}
    for name, body, response, summary, handle in (
        ("generate", GenerateRequest, GenerateResponse, "next-k items for a history", svc.generate),
        ("score", ScoreRequest, ScoreResponse, "target-aware scores of candidate items for a history, in input order", svc.score),
    ):
        endpoints[f"/v1/{name}"] = endpoint = _model_endpoint(body, handle)
        app.add_api_route(
            f"/v1/{name}",
            endpoint,
            methods=["POST"],
            name=name,
            response_model=response,
            responses=errors,
            summary=summary,
            openapi_extra=_json_body(body),
        )
    return endpoints


def _model_endpoint(body: type[BaseModel], handle):
    """The endpoint that reads a ``body`` request (:func:`read_body`: strict, size-limited) and
    answers ``await handle(req, arrival)`` as JSON (:func:`json_response`: orjson)."""

    async def endpoint(request: Request) -> Any:
        req = await read_body(request, body)
        return json_response(await handle(req, _arrival(request)))

    return endpoint


def _json_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` of an endpoint that reads its body with :func:`read_body`."""
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    }


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


__all__ = ["ApiError", "ServePolicy", "Service", "create_app"]
