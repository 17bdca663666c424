"""HTTP edge faults (issue 22, fault 10 and the server-robustness list), on a real uvicorn server.

Each test drives the app over loopback with a raw socket or an httpx client: a body shorter than
its Content-Length (408 within ``body_timeout_s``, then the connection closes), request headers
that never complete or an idle connection (``header_timeout_s``), a body over the limit (413, then
the connection closes), a non-JSON Content-Type (415), and one keep-alive connection that carries a
422, 415 and 500 and then a good request.
The HTTP protocol is the one ``hstu serve`` runs (:func:`hstu.serve.http_limits.http_protocol`),
both of uvicorn's parsers (httptools, h11) where the code path differs.
"""

from __future__ import annotations

import email.utils
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from conftest import REPO
from serving import LiveServer, metrics

from hstu.config import ServeConfig
from hstu.serve.app import ServePolicy, create_app
from hstu.serve.edge import error_response
from hstu.serve.http_limits import http_protocol

BUCKETS = [10, 20, 50]
GOOD = {"history": [{"item_id": 1, "timestamp": 978300760}, {"item_id": 48, "timestamp": 978300761}], "k": 3}
PARTIAL = b'{"history": [{"item'  # 19 bytes of a body
RECV_S = 20.0  # a socket read gives up after this long: on the old code these reads hung until the client's own timeout


class Server(LiveServer):
    """:class:`test_serve.LiveServer` with the uvicorn options ``hstu serve`` passes (its HTTP protocol)."""

    def __init__(self, app, cfg: ServeConfig, impl: str) -> None:
        super().__init__(app, wait_ready=False)
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=30,
                http=http_protocol(cfg.header_timeout_s, app.state.header_timeout_answer, impl),
            )
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.port = self.sock.getsockname()[1]


def make_server(rec, popularity, impl: str = "auto", **cfg_kw) -> Server:  # noqa: F811 - fixture values
    cfg = ServeConfig(buckets=BUCKETS, **cfg_kw)
    app = create_app(cfg, rec, policy=ServePolicy(max_body_bytes=64 * 1024, warmup=False), popularity=popularity)
    return Server(app, cfg, impl)


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=RECV_S)
    s.settimeout(RECV_S)
    return s


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response by its Content-Length, leaving the connection open."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += s.recv(65536)
    status, headers, body = parse(raw)
    while len(body) < int(headers["content-length"]):
        body += s.recv(65536)
    return status, headers, body


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def request_head(path: str, length: int | None, ctype: str = "application/json") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {ctype}"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# ----------------------------------------------------------------------------------------------
# slow clients: body-read and header-read timeouts
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["httptools", "h11"])
def test_body_shorter_than_content_length_gets_408_and_close_and_blocks_nobody(rec, popularity, impl) -> None:  # noqa: F811
    """Three connections promise 1000 bytes and send 19 (a slow-loris): each is answered 408 with
    the one error body (field "body") and closed once ``body_timeout_s`` passes, and a normal
    request sent while they hang is served. The old code held them open for as long as the
    client waited (here the socket read gave up after RECV_S)."""
    with make_server(rec, popularity, impl, body_timeout_s=1.0, header_timeout_s=30.0) as s:
        slow = []
        for _ in range(3):
            c = connect(s.port)
            c.sendall(request_head("/v1/generate", 1000) + PARTIAL)
            slow.append(c)
        r = httpx.post(s.url + "/v1/generate", json=GOOD, timeout=60)
        assert r.status_code == 200 and len(r.json()["items"]) == 3
        for c in slow:
            status, headers, body = parse(read_until_closed(c))
            c.close()
            assert status == 408 and headers["connection"] == "close"
            err = json.loads(body)["error"]
            assert err["type"] == "body_timeout" and err["field"] == "body"
            assert err["message"] == f"body: {len(PARTIAL)} of 1000 bytes arrived within the body timeout of 1 s"
        assert metrics(s.url)[("hstu_serve_rejected_requests_total", (("reason", "body_timeout"),))] == 3


@pytest.mark.parametrize("impl", ["httptools", "h11"])
def test_incomplete_headers_get_408_and_idle_connections_close(rec, popularity, impl) -> None:  # noqa: F811
    """Headers that stop half-way, on a new connection or on a keep-alive one after a good
    request, get a 408 error body and the connection closes once ``header_timeout_s`` passes; a
    connection that sends nothing is closed. The old code waited for the rest indefinitely
    (uvicorn's keep-alive timer stops at the first byte of the next request)."""
    with make_server(rec, popularity, impl, header_timeout_s=1.0) as s:
        c = connect(s.port)
        c.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        status, headers, body = parse(read_until_closed(c))
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(body)["error"] == {
            "type": "header_timeout",
            "field": None,
            "message": "request headers did not complete within the header timeout of 1 s",
        }
        c.close()

        idle = connect(s.port)
        assert read_until_closed(idle) == b""  # closed without a word: no request was started
        idle.close()

        c = connect(s.port)
        body = json.dumps(GOOD).encode()
        c.sendall(request_head("/v1/generate", len(body)) + body)
        assert read_response(c)[0] == 200
        c.sendall(b"GET /healthz HTTP/1.1\r\nHo")  # the next request on the kept-alive connection stalls
        status, _, body = parse(read_until_closed(c))
        assert status == 408 and json.loads(body)["error"]["type"] == "header_timeout"
        c.close()


@pytest.mark.parametrize("impl", ["httptools", "h11"])
def test_header_timeout_408_is_the_one_error_body_and_is_counted(rec, popularity, impl) -> None:  # noqa: F811
    """The header timeout's 408 is written by the HTTP protocol (the app never sees the request), yet
    its bytes are :func:`hstu.serve.edge.error_response`'s, as every other error's, and it is counted:
    in ``hstu_serve_requests_total`` under endpoint "incomplete" and in the rejections as
    "header_timeout" (it was formatted apart and counted nowhere). An idle connection closed without
    an answer is no request and counts nothing."""

    def count(m: dict, key: tuple) -> float:
        return m.get(key, 0.0)

    requests_408 = ("hstu_serve_requests_total", (("code", "408"), ("endpoint", "incomplete")))
    rejected = ("hstu_serve_rejected_requests_total", (("reason", "header_timeout"),))
    with make_server(rec, popularity, impl, header_timeout_s=1.0) as s:
        before = metrics(s.url)
        c = connect(s.port)
        c.sendall(b"POST /v1/score HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        status, headers, body = parse(read_until_closed(c))
        c.close()
        want = error_response(408, "header_timeout", "request headers did not complete within the header timeout of 1 s", None)
        assert status == 408 and body == want.body
        other = httpx.get(s.url + "/healthz").headers  # uvicorn's date / server headers, as on every other answer (they were missing)
        assert headers.pop("server") == other["server"] and set(headers) == {"date", "content-type", "content-length", "connection"}
        assert email.utils.parsedate_to_datetime(headers.pop("date")).tzinfo is not None
        assert headers == {"content-type": "application/json", "content-length": str(len(body)), "connection": "close"}
        idle = connect(s.port)
        assert read_until_closed(idle) == b""
        idle.close()
        after = metrics(s.url)
        assert count(after, requests_408) - count(before, requests_408) == 1
        assert count(after, rejected) - count(before, rejected) == 1
        answered = [k for k in after if k[0] == "hstu_serve_requests_total" and k[1][0] == ("code", "408")]
        assert sum(count(after, k) - count(before, k) for k in answered) == 1


# ----------------------------------------------------------------------------------------------
# a body over the limit: 413, then the connection closes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["httptools", "h11"])
def test_413_closes_the_connection_so_the_next_request_starts_clean(rec, popularity, impl) -> None:  # noqa: F811
    """A Content-Length over the limit is answered 413 before its body arrives, and a chunked body
    once it passes the limit: the rest of either may still come, so the answer says
    ``Connection: close`` and the server closes the connection. The old code kept it open and read
    the client's next request as the rest of the body (then a misleading 408 "request headers did
    not complete"); a new connection is served at once."""
    limit = 64 * 1024
    chunk = b"x" * (limit + 1)
    chunked = request_head("/v1/generate", None).replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    with make_server(rec, popularity, impl, body_timeout_s=30.0, header_timeout_s=30.0) as s:
        for sent, message in (
            (request_head("/v1/generate", 100_000) + PARTIAL, f"request body of 100000 bytes exceeds the limit of {limit} bytes"),
            (chunked + b"%x\r\n" % len(chunk) + chunk + b"\r\n", f"request body exceeds the limit of {limit} bytes"),
        ):
            c = connect(s.port)
            c.sendall(sent)
            status, headers, body = read_response(c)
            assert status == 413 and headers["connection"] == "close", (status, headers)
            assert json.loads(body) == {"error": {"type": "body_too_large", "message": message, "field": "body"}}
            assert read_until_closed(c) == b""  # closed by the server: no next request is read as this body
            c.close()
        c = connect(s.port)
        good = json.dumps(GOOD).encode()
        c.sendall(request_head("/v1/generate", len(good)) + good)
        status, headers, body = read_response(c)
        assert status == 200 and len(json.loads(body)["items"]) == 3 and "connection" not in headers
        c.close()
        m = metrics(s.url)
        assert m[("hstu_serve_requests_total", (("code", "413"), ("endpoint", "/v1/generate")))] == 2
        assert m[("hstu_serve_rejected_requests_total", (("reason", "body_too_large"),))] == 2


# ----------------------------------------------------------------------------------------------
# content type
# ----------------------------------------------------------------------------------------------
def test_non_json_content_type_is_415_naming_content_type(rec, popularity) -> None:  # noqa: F811
    """text/plain (the break-it finding) and a form body (curl -d) are 415 on both JSON endpoints;
    application/json with a UTF-8 (or US-ASCII, its subset) charset, an application/*+json type and a request without any
    Content-Type (FastAPI's convention: parsed as JSON) are served."""
    score = {"history": GOOD["history"], "candidates": [1, 48]}
    with make_server(rec, popularity) as s:
        for path, body in (("/v1/generate", GOOD), ("/v1/score", score)):
            data = json.dumps(body).encode()
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"):
                r = httpx.post(s.url + path, content=data, headers={"content-type": ctype}, timeout=60)
                assert r.status_code == 415, (path, ctype, r.text)
                assert r.json()["error"] == {
                    "type": "unsupported_media_type",
                    "field": "content-type",
                    "message": f"content-type: expected application/json (UTF-8), got {ctype!r}",
                }
            for ctype in ("application/json; charset=utf-8", "application/json; charset=US-ASCII", "application/vnd.hstu+json", None):
                headers = {"content-type": ctype} if ctype else {}
                r = httpx.post(s.url + path, content=data, headers=headers, timeout=60)
                assert r.status_code == 200, (path, ctype, r.text)
        assert metrics(s.url)[("hstu_serve_rejected_requests_total", (("reason", "unsupported_media_type"),))] == 6
        spec = httpx.get(s.url + "/openapi.json", timeout=10).json()
        assert "415" in spec["paths"]["/v1/generate"]["post"]["responses"]


def test_encoded_body_is_415_naming_content_encoding(rec, popularity) -> None:  # noqa: F811
    """A gzip body (or any Content-Encoding but identity) is refused with 415 naming content-encoding:
    it was read as JSON (a 422 'Invalid JSON' for gzip, and a 'br' label on a plain body passed)."""
    import gzip

    data = json.dumps(GOOD).encode()
    with make_server(rec, popularity) as s:
        for enc, body in (("gzip", gzip.compress(data)), ("br", data), ("deflate, gzip", data)):
            r = httpx.post(
                s.url + "/v1/generate", content=body, headers={"content-type": "application/json", "content-encoding": enc}, timeout=60
            )
            assert r.status_code == 415, (enc, r.text)
            assert r.json()["error"]["field"] == "content-encoding" and enc in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/generate", content=data, headers={"content-encoding": "identity"}, timeout=60)
        assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------------------------
# keep-alive across error answers
# ----------------------------------------------------------------------------------------------
def test_one_keep_alive_connection_survives_422_415_and_500(rec, popularity) -> None:  # noqa: F811
    """One httpx.Client connection (pool of one) carries a 422, a 415, a 500 and then a good
    request: the client's local port is the same for all four. The 500 comes from a route added
    to the app for this test, as no real request should produce one (every 500 is a bug): the
    failure path under test is the app's handling of an unexpected exception, whichever route
    raises it. The old code answered the 500 and then reset the connection (Starlette's
    ServerErrorMiddleware re-raised the exception into uvicorn, which closes the transport).
    A 413 closes its connection (the rest of the body may still come): the next request goes on a
    new one."""
    cfg = ServeConfig(buckets=BUCKETS)
    app = create_app(cfg, rec, policy=ServePolicy(max_body_bytes=64 * 1024, warmup=False), popularity=popularity)

    async def boom() -> None:
        raise RuntimeError("deliberate failure for the keep-alive test")

    app.add_api_route("/test/boom", boom, methods=["POST"])
    big = {"history": [{"item_id": 1, "timestamp": i} for i in range(3000)]}  # ~100 KB > 64 KiB
    with Server(app, cfg, "auto") as s, httpx.Client(base_url=s.url, timeout=60, limits=httpx.Limits(max_connections=1)) as c:
        ports, codes = [], []

        def send(path: str, **kw) -> httpx.Response:
            with c.stream("POST", path, **kw) as r:  # the port while the response is open
                ports.append(r.extensions["network_stream"].get_extra_info("client_addr")[1])
                codes.append(r.status_code)
                r.read()
            return r

        send("/v1/generate", json={"history": "x"})
        send("/v1/generate", content=json.dumps(GOOD).encode(), headers={"content-type": "text/plain"})
        r = send("/test/boom", json={})
        assert r.json()["error"] == {
            "type": "internal_error",
            "field": None,
            "message": "internal error: RuntimeError: deliberate failure for the keep-alive test",
        }
        r = send("/v1/generate", json=GOOD)
        assert len(r.json()["items"]) == 3
        r = send("/v1/generate", json=big)
        assert r.headers["connection"] == "close"
        send("/v1/generate", json=GOOD)
        assert codes == [422, 415, 500, 200, 413, 200]
        assert len(set(ports[:5])) == 1 and ports[5] != ports[4], ports


# ----------------------------------------------------------------------------------------------
# hstu serve: the flags and the [serve] fields reach the server
# ----------------------------------------------------------------------------------------------
def test_cli_serve_applies_body_and_header_timeouts(run_dir, tmp_path) -> None:  # noqa: F811
    """`hstu serve` with ``body_timeout_s`` from a [serve] config file and ``--header-timeout-s``:
    an idle connection is closed, a short body gets its 408, a good request is served."""
    (tmp_path / "serve.toml").write_text("[serve]\nbody_timeout_s = 1.0\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [
        sys.executable,
        "-m",
        "hstu.cli",
        "serve",
        "--run",
        str(run_dir),
        "--port",
        "0",
        "--buckets",
        "10,20,50",
        "--threads",
        "1",
        "--no-model-process",
        "--config",
        str(tmp_path / "serve.toml"),
        "--header-timeout-s",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        url = line.split("listening on ")[1].split()[0]
        port = int(url.rsplit(":", 1)[1])
        idle = connect(port)  # accepted into the backlog at once, timed from when the server takes it
        assert read_until_closed(idle) == b""
        idle.close()
        c = connect(port)
        c.sendall(request_head("/v1/score", 500) + PARTIAL)
        status, _, body = parse(read_until_closed(c))
        c.close()
        assert (
            status == 408
            and json.loads(body)["error"]["message"] == f"body: {len(PARTIAL)} of 500 bytes arrived within the body timeout of 1 s"
        )
        deadline = time.monotonic() + 120
        while httpx.get(url + "/readyz", timeout=5).status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        assert httpx.post(url + "/v1/generate", json=GOOD, timeout=60).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0


@pytest.mark.parametrize(
    "args, toml, message",
    [
        (["--body-timeout-s", "0"], None, "argument --body-timeout-s: must be > 0, got 0"),
        (["--header-timeout-s", "inf"], None, "argument --header-timeout-s: must be a finite number > 0, got inf"),
        ([], "header_timeout_s = 0", "serve.toml [serve]: ServeConfig.header_timeout_s must be a finite number of seconds > 0, got 0"),
        ([], 'body_timeout_s = "5"', "serve.toml [serve]: body_timeout_s must be float, got '5'"),
    ],
)
def test_cli_serve_rejects_bad_timeouts(tmp_path, capsys, monkeypatch, args, toml, message) -> None:
    from hstu.cli import main

    monkeypatch.chdir(tmp_path)
    if toml is not None:
        (tmp_path / "serve.toml").write_text(f"[serve]\n{toml}\n")
        args = [*args, "--config", "serve.toml"]
    try:
        rc = main(["serve", "--run", str(tmp_path / "no_run"), "--port", "0", *args])
    except SystemExit as exc:  # argparse's refusal
        rc = exc.code
    assert rc == 2
    assert f"hstu serve: error: {message}" in capsys.readouterr().err
