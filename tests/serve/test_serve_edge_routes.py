"""The edge answers the model endpoints itself (``EdgeMiddleware`` ``routes``, past the framework's
router and exception layers): for good and bad requests its answers equal the framework route's
(the second path: the same app with ``app.state.direct_routes`` cleared), and the framework's route
is not taken while the direct one is registered."""

from __future__ import annotations

import json

import httpx
import pytest
from serving import BUCKETS, LiveServer, metrics

from hstu.config import ServeConfig
from hstu.serve.app import ServePolicy, create_app

GOOD = {"history": [{"item_id": 1, "timestamp": 978300760}, {"item_id": 48, "timestamp": 978300761}], "k": 3}
SCORE = {"history": GOOD["history"], "candidates": [1, 48, 2]}
BIG = {"history": [{"item_id": 1, "timestamp": i} for i in range(3000)]}  # ~100 KB > 64 KiB

# (path, keyword arguments of httpx.post): good requests, cold start, and each kind of error answer
CASES = [
    ("/v1/generate", {"json": GOOD}),
    ("/v1/generate", {"json": {**GOOD, "decoding": {"strategy": "beam", "beam_width": 2}}}),
    ("/v1/generate", {"json": {"history": [], "k": 2}}),  # cold start
    ("/v1/score", {"json": SCORE}),
    ("/v1/generate", {"json": {"history": "x"}}),  # 422, the field named
    ("/v1/generate", {"content": b'{"history": [', "headers": {"content-type": "application/json"}}),  # 422 invalid JSON
    ("/v1/generate", {"json": {**GOOD, "k": 0}}),  # 422 from the model's checks
    ("/v1/score", {"json": {**SCORE, "candidates": []}}),
    ("/v1/generate", {"json": BIG}),  # 413 while the body streams in
    ("/v1/generate", {"content": json.dumps(GOOD).encode(), "headers": {"content-type": "text/plain"}}),  # 415
    ("/v1/generate/", {"json": GOOD}),  # not a direct route: the framework's answer (404) either way
]


def _answer(r: httpx.Response) -> tuple:
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
    if isinstance(body, dict):
        body.pop("latency_ms", None)
    headers = {k: v for k, v in r.headers.items() if k in ("content-type", "retry-after", "connection")}
    return r.status_code, headers, body


@pytest.fixture(scope="module")
def server(rec, popularity):
    cfg = ServeConfig(buckets=BUCKETS)
    with LiveServer(create_app(cfg, rec, policy=ServePolicy(max_body_bytes=64 * 1024), popularity=popularity)) as s:
        yield s


def test_direct_routes_answer_as_the_framework_route(server) -> None:
    app = server.app
    routes = dict(app.state.direct_routes)
    assert set(routes) == {"/v1/generate", "/v1/score"}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        direct = [_answer(c.post(path, **kw)) for path, kw in CASES]
        app.state.direct_routes.clear()  # read at each request: the framework's route from now on
        try:
            framework = [_answer(c.post(path, **kw)) for path, kw in CASES]
        finally:
            app.state.direct_routes.update(routes)
    assert [a[0] for a in direct] == [200, 200, 200, 200, 422, 422, 422, 422, 413, 415, 404]
    for (path, _), d, f in zip(CASES, direct, framework):
        assert d == f, path


def test_the_framework_route_is_not_taken_for_a_direct_one(server) -> None:
    app, taken = server.app, []
    route = next(r for r in app.router.routes if getattr(r, "path", None) == "/v1/generate")
    handle = route.handle

    async def spy(scope, receive, send):
        taken.append(scope["path"])
        await handle(scope, receive, send)

    route.handle = spy
    try:
        assert httpx.post(server.url + "/v1/generate", json=GOOD, timeout=60).status_code == 200
        assert taken == []
        routes = dict(app.state.direct_routes)
        app.state.direct_routes.clear()
        try:
            assert httpx.post(server.url + "/v1/generate", json=GOOD, timeout=60).status_code == 200
        finally:
            app.state.direct_routes.update(routes)
        assert taken == ["/v1/generate"]
    finally:
        route.handle = handle


def test_a_trailing_slash_is_a_404_naming_the_endpoint(server) -> None:
    """A known endpoint's path with a trailing slash is a 404 whose error body names the path without
    it, counted under that endpoint (it was Starlette's 307 redirect with an empty body, counted as
    "other"); an unknown path is a 404 with the same body, counted as "other"."""

    def count(m: dict, endpoint: str) -> float:
        return m.get(("hstu_serve_requests_total", (("code", "404"), ("endpoint", endpoint))), 0.0)

    cases = [("POST", "/v1/generate/"), ("POST", "/v1/score/"), ("GET", "/healthz/"), ("GET", "/metrics//")]
    before = metrics(server.url)
    with httpx.Client(base_url=server.url, timeout=60, follow_redirects=False) as c:
        for method, path in cases:
            r = c.request(method, path, json=GOOD if method == "POST" else None)
            assert r.status_code == 404 and r.headers["content-type"] == "application/json", (path, r.status_code, r.text)
            message = f"no endpoint at {path}; did you mean {path.rstrip('/')} (without the trailing slash)?"
            assert r.json() == {"error": {"type": "not_found", "message": message, "field": None}}
        r = c.post("/v2/generate", json=GOOD)
        assert r.status_code == 404
        assert r.json() == {"error": {"type": "not_found", "message": "no endpoint at /v2/generate", "field": None}}
    after = metrics(server.url)
    for endpoint in ("/v1/generate", "/v1/score", "/healthz", "/metrics", "other"):
        assert count(after, endpoint) - count(before, endpoint) == 1, endpoint


def test_client_leaving_mid_body_counts_nothing(server, caplog) -> None:
    """A client that closes its connection before its body is whole gets no answer (there is no one to
    answer), and, as an idle connection closed, counts nothing: no 500 in the request counter and no
    "unhandled error" in the log (it was both: starlette's ClientDisconnect reached the 500 path)."""
    import socket
    import time

    def count(code: str) -> float:
        m = metrics(server.url)
        return sum(v for (name, labels), v in m.items() if name == "hstu_serve_requests_total" and ("code", code) in labels)

    before = count("500")
    port = int(server.url.rsplit(":", 1)[1])
    for path in ("/v1/generate", "/v1/score"):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode())
            s.sendall(b'{"history":')
            time.sleep(0.2)
    time.sleep(0.5)
    assert count("500") == before
    assert not [r for r in caplog.records if "unhandled error" in r.getMessage()]
    assert httpx.post(server.url + "/v1/generate", json=GOOD, timeout=60).status_code == 200  # still serving
