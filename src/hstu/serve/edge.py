"""The HTTP edge: what happens to a request before a route sees it, and its body's parsing.

:class:`EdgeMiddleware` (pure ASGI, outermost) bounds the body (413 by Content-Length or while it
streams in, 408 when it does not arrive within ``body_timeout_s`` of the headers), refuses model
requests before their body is read while admission refuses everything (429), answers an
unexpected exception with the 500 error body on a connection that stays open, and counts
``hstu_serve_requests_total`` (a client that leaves before its body is whole gets no answer and counts
nothing). :func:`read_body` validates a body straight from its bytes.
:func:`error_response` is the one error body (``{"error": {"type", "message", "field"}}``) as a
response. The header-read timeout, which needs the protocol, is :mod:`hstu.serve.http_limits`; its
408 is :func:`header_timeout_response`, counted here too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hstu.serve import fast_body
from hstu.serve.batcher import Rejected
from hstu.serve.http_limits import is_json_media_type
from hstu.serve.metrics import ServeMetrics
from hstu.serve.service import ApiError

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/generate", "/v1/score", "/healthz", "/readyz", "/metrics")
MODEL_ENDPOINTS = ("/v1/generate", "/v1/score")  # the ones admission may refuse
INCOMPLETE = "incomplete"  # the endpoint label of a request whose headers never completed (the header timeout's 408)


def endpoint_of(path: str) -> str:
    """The ``endpoint`` label of a request for ``path``: one of :data:`ENDPOINTS` for that path, or
    for that path with trailing slashes (a 404 naming the path without them: the app does not
    redirect), else "other"."""
    if path in ENDPOINTS:
        return path
    bare = path.rstrip("/")
    return bare if bare in ENDPOINTS else "other"


class BodyTooLarge(StarletteHTTPException):
    """A body over the limit: by its Content-Length (``length``), answered before it is read, or raised
    from the receive channel once a streamed body passes the limit (an HTTPException so that
    FastAPI's body reader re-raises it instead of wrapping it as a 400). Answered 413 with
    ``Connection: close``: the rest of the body may still come, and on a kept-alive connection it
    would be read as the next request."""

    def __init__(self, limit: int, length: int | None = None) -> None:
        of = f" of {length} bytes" if length is not None else ""
        super().__init__(413, f"request body{of} exceeds the limit of {limit} bytes", headers={"Connection": "close"})


class BodyTimeout(StarletteHTTPException):
    """Raised from the receive channel when the body has not fully arrived ``timeout_s`` after the
    headers (answered 408, ``Connection: close``: the rest of the body may still come)."""

    def __init__(self, timeout_s: float, received: int, length: int | None) -> None:
        of = f" of {length}" if length is not None else ""
        super().__init__(
            408, f"body: {received}{of} bytes arrived within the body timeout of {timeout_s:g} s", headers={"Connection": "close"}
        )


def json_response(body: Any, status: int = 200, headers: dict | None = None) -> Response:
    """``body`` (dicts, lists, str, int, float, bool, None) as an ``application/json`` response, encoded
    by orjson: one pass in native code (a 5-item /v1/generate answer: ~1.4 us against ~11 us for
    Starlette's JSONResponse, ``json.dumps``; ``benchmarks/serve_wire.py`` measures both).
    Compact UTF-8 as JSONResponse, except that a non-finite float is written as ``null`` (where
    JSONResponse raises).

    Raises:
        TypeError: (orjson.JSONEncodeError) a value JSON cannot hold (an integer beyond 64 bits, a non-str key).
    """
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type="application/json")


def error_response(
    status: int, type_: str, message: str, field: str | None = None, headers: dict | None = None, errors: list[dict] | None = None
) -> Response:
    """The service's one error body, ``{"error": {"type", "message", "field"}}``, as a response
    (``errors``: every validation error, when several)."""
    body: dict[str, Any] = {"error": {"type": type_, "message": message, "field": field}}
    if errors:
        body["errors"] = errors
    return json_response(body, status, headers)


def header_timeout_response(metrics: ServeMetrics, timeout_s: float) -> Response:
    """The 408 of a connection whose request headers did not complete within ``timeout_s`` (s)
    (``Connection: close``), counted in ``metrics`` as a request (endpoint :data:`INCOMPLETE`) and a
    rejection ("header_timeout"). The HTTP protocol writes it (:func:`hstu.serve.http_limits.http_protocol`):
    the app never sees that request."""
    metrics.reject("header_timeout")
    metrics.requests.labels(endpoint=INCOMPLETE, code="408").inc()
    message = f"request headers did not complete within the header timeout of {timeout_s:g} s"
    return error_response(408, "header_timeout", message, None, {"Connection": "close"})


class EdgeMiddleware:
    """Pure ASGI middleware: 413 for bodies over the limit (by Content-Length, or while a chunked
    body streams in; then the connection closes), 408 for a body not complete ``body_timeout_s`` after the headers (each
    ``receive()`` waits at most until then), the 500 error body for an unexpected exception (sent
    here, so the connection stays open: Starlette's ServerErrorMiddleware re-raises into uvicorn,
    which closes it), and ``hstu_serve_requests_total`` by endpoint and status. ``reject_early``
    (no argument; a :class:`Rejected` or None) is asked before a model endpoint's body is read:
    under overload a refused request then costs no JSON parsing or validation.

    ``routes`` (path -> ``async endpoint(request) -> Response``) are answered here for POST, past
    the framework's router, exception and request layers (about a fifth of the HTTP process's CPU
    per request, measured with py-spy at 150 QPS); ``on_error`` ((exception, request path) -> Response,
    or None to re-raise) maps their errors to the same answers as the app's exception handlers. The dict is
    read at each request: empty, every request takes the framework's route (the tests compare the two)."""

    def __init__(
        self,
        app,
        *,
        limit: int,
        metrics: ServeMetrics,
        body_timeout_s: float = 5.0,
        reject_early: Callable[[], Rejected | None] | None = None,
        routes: dict[str, Callable[[Request], Any]] | None = None,
        on_error: Callable[[Exception, str], Response | None] | None = None,
    ) -> None:
        self.app, self.limit, self.metrics, self.body_timeout_s = app, limit, metrics, body_timeout_s
        self.reject_early = reject_early
        self.routes, self.on_error = routes if routes is not None else {}, on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = endpoint_of(scope["path"])
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
                too_large = BodyTooLarge(self.limit, length)
                resp = error_response(413, "body_too_large", too_large.detail, "body", too_large.headers)
                return await resp(scope, receive, send_wrapper)
            early = self.reject_early is not None and scope["path"] in MODEL_ENDPOINTS and scope["method"] == "POST"
            refused = self.reject_early() if early else None
            if refused is not None:
                resp = error_response(refused.status, refused.reason, refused.message, None, {"Retry-After": str(refused.retry_after)})
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

            direct = self.routes.get(scope["path"]) if scope["method"] == "POST" else None
            try:
                if direct is not None:
                    await self._direct(direct, scope, receive_wrapper, send_wrapper)
                else:
                    await self.app(scope, receive_wrapper, send_wrapper)
            except ClientDisconnect:  # the client left before its body was whole: no one to answer
                state["code"] = None  # counts nothing, as an idle connection closed
                log.debug("client left during its %s request body", scope["path"])
            except Exception as exc:
                if state["started"]:
                    raise  # part of an answer is out: uvicorn closes the connection
                log.exception("unhandled error on %s", scope["path"], exc_info=exc)
                await error_response(500, "internal_error", f"internal error: {type(exc).__name__}: {exc}")(scope, receive, send_wrapper)
        finally:
            if state["code"] is not None:
                self.metrics.requests.labels(endpoint=endpoint, code=str(state["code"])).inc()

    async def _direct(self, endpoint, scope, receive, send) -> None:
        """Answer a ``routes`` request: ``endpoint``'s response, or ``on_error``'s for what it raised
        (an exception it does not map goes up to the 500 of :meth:`__call__`)."""
        try:
            resp = await endpoint(Request(scope, receive))
        except Exception as exc:
            resp = self.on_error(exc, scope["path"]) if self.on_error is not None else None
            if resp is None:
                raise
        await resp(scope, receive, send)


async def read_body(request: Request, model: type[BaseModel]) -> Any:
    """The request body validated against ``model`` straight from its bytes: first by msgspec into
    the Struct that mirrors ``model`` (:mod:`hstu.serve.fast_body`: the same fields, values and
    constraints, ~5x less CPU for a 200-event history), else by pydantic's JSON parser
    (``model_validate_json``: one pass, no intermediate dict, none of FastAPI's per-parameter body
    handling), which gives every error. Returns either form (the same attributes). Errors take
    FastAPI's path: RequestValidationError, loc under "body".

    Raises:
        ApiError: 415 when a Content-Type is given and is not JSON (``application/json`` or
            ``application/*+json``, UTF-8); a request without one is read as JSON (FastAPI's rule);
            415 naming ``content-encoding`` for an encoded (e.g. gzip) body: bodies are read as sent.
        RequestValidationError: the body is not valid JSON or not a valid ``model``.
    """
    ctype = request.headers.get("content-type")
    if ctype is not None and not is_json_media_type(ctype):
        raise ApiError(415, "unsupported_media_type", f"content-type: expected application/json (UTF-8), got {ctype!r}", "content-type")
    encoding = request.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise ApiError(
            415,
            "unsupported_media_type",
            f"content-encoding: not supported, got {encoding!r}; send the body uncompressed",
            "content-encoding",
        )
    body = await request.body()
    fast = fast_body.decode(model.__name__, body)
    if fast is not None:
        return fast
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) from None


__all__ = [
    "ENDPOINTS",
    "INCOMPLETE",
    "MODEL_ENDPOINTS",
    "endpoint_of",
    "BodyTimeout",
    "BodyTooLarge",
    "EdgeMiddleware",
    "error_response",
    "header_timeout_response",
    "json_response",
    "read_body",
]
