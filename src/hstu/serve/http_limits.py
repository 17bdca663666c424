"""Limits at the HTTP edge that uvicorn does not enforce itself: a header-read timeout and the
JSON content-type rule.

uvicorn (0.54) arms its keep-alive timer (``timeout_keep_alive``) only once a response is complete
and cancels it at the first byte received, and a new connection has no timer at all: a client
that opens a connection and sends nothing, or half a request line, holds the connection for ever
(a slow-loris needs only a few per worker). :func:`http_protocol` returns uvicorn's HTTP protocol
(httptools or h11) with one more timer: the request headers must be complete within
``header_timeout_s`` of the connection opening or of the previous response; otherwise the
connection is answered 408 with the service's error body (if any bytes of a request arrived) and
closed. That 408 is the app's (``answer``: :func:`hstu.serve.edge.header_timeout_response`, the
one error body, counted in the app's metrics); this module only writes its bytes. The body-read
timeout (a Content-Length the body never reaches) is in the app's ASGI middleware
(:class:`hstu.serve.edge.EdgeMiddleware`), where the headers are known.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.responses import Response

log = logging.getLogger(__name__)


def is_json_media_type(value: str) -> bool:
    """True for ``application/json`` and ``application/*+json`` (case-insensitive), with no
    ``charset`` parameter or a UTF-8 one (RFC 8259 §8.1: JSON exchanged between systems is UTF-8; US-ASCII, its
    subset, too)."""
    media, *params = (p.strip().lower() for p in value.split(";"))
    kind, _, sub = media.partition("/")
    if kind != "application" or not (sub == "json" or sub.endswith("+json")):
        return False
    for p in params:
        name, _, v = p.partition("=")
        if name.strip() == "charset" and v.strip().strip('"') not in ("utf-8", "utf8", "us-ascii", "ascii"):
            return False
    return True


def _wire(resp: Response, default_headers: Iterable[tuple[bytes, bytes]] = ()) -> bytes:
    """A complete (not streamed) response as HTTP/1.1 bytes: status line, ``default_headers``
    (uvicorn's ``server_state.default_headers``: date, server, as on its other answers), the
    response's headers (content-length and content-type among them), body."""
    status = b"HTTP/1.1 %d %s\r\n" % (resp.status_code, HTTPStatus(resp.status_code).phrase.encode())
    headers = [*default_headers, *resp.raw_headers]
    return status + b"".join(b"%s: %s\r\n" % kv for kv in headers) + b"\r\n" + resp.body


class _HeaderTimeout:
    """Mixin over a uvicorn HTTP protocol class (uses its ``loop``, ``transport`` and ``cycle``);
    ``header_timeout_answer(timeout_s)`` is the 408's response."""

    header_timeout_s: float = 5.0
    header_timeout_answer: Callable[[float], Response]

    def _awaiting_headers(self) -> bool:
        cycle = self.cycle
        return cycle is None or cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._hstu_bytes = False  # bytes of a next request received since the timer was armed
        self._hstu_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        timer = getattr(self, "_hstu_timer", None)
        if timer is not None:
            timer.cancel()
        self._hstu_timer = None

    def _header_timed_out(self) -> None:
        self._hstu_timer = None
        if self.transport.is_closing() or not self._awaiting_headers():
            return
        if self._hstu_bytes:
            log.info("408: request headers from %s incomplete after %g s; closing", self.client, self.header_timeout_s)
            self.transport.write(_wire(self.header_timeout_answer(self.header_timeout_s), self.server_state.default_headers))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        self._hstu_bytes = True
        super().data_received(data)
        if not self._awaiting_headers():  # the parser saw a whole request head: the app has it now
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._awaiting_headers():  # none pipelined: wait for the next head
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)


def http_protocol(header_timeout_s: float, answer: Callable[[float], Response], impl: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with a header-read timeout, for ``uvicorn.Config(http=...)``.

    Args:
        header_timeout_s: seconds (> 0) within which a request's headers must be complete, counted
            from the connection opening or from the previous response on a kept-alive connection.
        answer: ``answer(header_timeout_s)`` -> the 408 response (complete, with ``Connection: close``)
            for a connection that sent part of a request; the app's ``app.state.header_timeout_answer``
            (:func:`hstu.serve.edge.header_timeout_response`: the one error body, counted).
        impl: "httptools", "h11", or "auto" (httptools when installed, as uvicorn picks).
    Returns:
        a subclass of uvicorn's ``HttpToolsProtocol`` or ``H11Protocol``.
    Raises:
        ValueError: ``impl`` is unknown or ``header_timeout_s`` is not > 0.
    """
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    if impl == "auto":
        try:
            import httptools  # noqa: F401

            impl = "httptools"
        except ImportError:
            impl = "h11"
    if impl == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    elif impl == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        raise ValueError(f"http protocol must be one of ('auto', 'httptools', 'h11'), got {impl!r}")
    fields = {"header_timeout_s": float(header_timeout_s), "header_timeout_answer": staticmethod(answer)}
    return type(f"HeaderTimeout{base.__name__}", (_HeaderTimeout, base), fields)


__all__ = ["http_protocol", "is_json_media_type"]
