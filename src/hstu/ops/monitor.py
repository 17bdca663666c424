"""``hstu monitor``: sample device and host metrics every ``interval`` seconds, evaluate the alert
rules on each sample, and serve them over HTTP for Prometheus.

Endpoints (plain ``http.server``; one thread per request):

- ``/metrics`` Prometheus text format from an explicit registry: the last sample of every source,
  ``hstu_monitor_source_up{source}``, and ``hstu_alerts{alertname,severity,state}`` (instances per
  rule and state, zeros included, so the series exist before the first alert).
- ``/alerts`` JSON: ``{"evaluated_at": ..., "alerts": [...], "rules": [...]}``.
- ``/health`` ``ok`` once the first sample is in, else 503.

Sampling runs in its own thread, so a slow ``npu-smi`` never blocks a scrape. A source that is
unavailable at start is reported once (WARNING) and skipped; a source that fails later is logged
once per distinct error and reported with ``hstu_monitor_source_up 0`` until it answers again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from hstu.ops.alerts import AlertEngine, Sample
from hstu.ops.metrics import METRICS, Source, default_sources

log = logging.getLogger(__name__)


class Monitor:
    """Owns the sources, the latest samples and the alert engine."""

    def __init__(self, sources: list[Source] | None = None, engine: AlertEngine | None = None, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval_s}")
        self.sources = default_sources() if sources is None else sources
        self.engine = engine
        self.interval_s = interval_s
        self.active: list[Source] = []
        self.up: dict[str, int] = {}
        self.skipped: dict[str, str] = {}
        for s in self.sources:
            why = s.unavailable_reason()
            if why is None:
                self.active.append(s)
                self.up[s.name] = 1
            else:
                self.skipped[s.name] = why
                self.up[s.name] = 0
                log.warning("metric source %s unavailable, skipped: %s", s.name, why)
        self.samples: list[Sample] = []
        self.last_sample_at: float | None = None
        self._errors_logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self, now: float | None = None) -> list[Sample]:
        """Collect from every active source, evaluate the rules, keep the result; returns the samples."""
        samples: list[Sample] = []
        up = dict(self.up)
        for s in self.active:
            try:
                samples.extend(s.collect())
                up[s.name] = 1
            except Exception as exc:  # a tool crashed / timed out: report, keep the other sources  # noqa: BLE001
                up[s.name] = 0
                key = (s.name, f"{type(exc).__name__}: {exc}")
                if key not in self._errors_logged:
                    self._errors_logged.add(key)
                    log.warning("metric source %s failed: %s", s.name, key[1])
        now = time.time() if now is None else now
        if self.engine is not None:
            self.engine.evaluate(samples, now)
        with self._lock:
            self.samples, self.up, self.last_sample_at = samples, up, now
        return samples

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.sample_once()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        """Take the first sample now, then keep sampling in a daemon thread."""
        self.sample_once()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="hstu-monitor-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for s in self.sources:
            s.close()

    def snapshot(self) -> tuple[list[Sample], dict[str, int], float | None]:
        with self._lock:
            return list(self.samples), dict(self.up), self.last_sample_at

    def alerts_doc(self) -> dict[str, Any]:
        eng = self.engine
        return {
            "evaluated_at": eng.last_evaluated if eng else None,
            "alerts": [a.to_dict() for a in eng.alerts()] if eng else [],
            "rules": [
                {
                    "name": r.name,
                    "when": r.when,
                    "promql": r.expr.promql(),
                    "for_s": r.for_s,
                    "severity": r.severity,
                    "summary": r.summary,
                }
                for r in (eng.rules if eng else [])
            ],
            "sources": {"up": self.snapshot()[1], "skipped": self.skipped},
        }


class MonitorCollector(Collector):
    """prometheus_client collector that renders the monitor's latest snapshot."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def collect(self):
        samples, up, last = self.monitor.snapshot()
        by_name: dict[str, list[Sample]] = {}
        for s in samples:
            by_name.setdefault(s.name, []).append(s)
        for name, group in by_name.items():
            label_names = sorted({k for s in group for k, _ in s.labels})
            fam = GaugeMetricFamily(name, METRICS.get(name, name), labels=label_names)
            for s in group:
                d = dict(s.labels)
                fam.add_metric([d.get(k, "") for k in label_names], s.value)
            yield fam
        fam = GaugeMetricFamily("hstu_monitor_source_up", METRICS["hstu_monitor_source_up"], labels=["source"])
        for name, v in sorted(up.items()):
            fam.add_metric([name], v)
        yield fam
        if last is not None:
            yield GaugeMetricFamily(
                "hstu_monitor_last_sample_timestamp_seconds",
                METRICS["hstu_monitor_last_sample_timestamp_seconds"],
                value=last,
            )
        if self.monitor.engine is not None:
            fam = GaugeMetricFamily(
                "hstu_alerts",
                "Alert instances per rule and state (pending/firing).",
                labels=["alertname", "severity", "state"],
            )
            sev = {r.name: r.severity for r in self.monitor.engine.rules}
            for (rule, state), n in sorted(self.monitor.engine.counts().items()):
                fam.add_metric([rule, sev[rule], state], n)
            yield fam


def make_registry(monitor: Monitor) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(MonitorCollector(monitor))
    return reg


class MonitorServer:
    """HTTP front of a :class:`Monitor`. ``port=0`` picks a free port (see :attr:`address`)."""

    def __init__(self, monitor: Monitor, host: str = "127.0.0.1", port: int = 9400) -> None:
        self.monitor = monitor
        self.registry = make_registry(monitor)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging
                log.debug("%s %s", self.address_string(), fmt % args)

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                elif path == "/alerts":
                    self._send(200, json.dumps(server.monitor.alerts_doc(), indent=2).encode(), "application/json")
                elif path in ("/health", "/healthz"):
                    ok = server.monitor.snapshot()[2] is not None
                    self._send(200 if ok else 503, b"ok\n" if ok else b"no sample yet\n", "text/plain; charset=utf-8")
                elif path == "/":
                    self._send(200, b"hstu monitor: /metrics /alerts /health\n", "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found: try /metrics, /alerts or /health\n", "text/plain; charset=utf-8")

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> tuple[str, int]:
        """Start sampling and serving in background threads; returns (host, port)."""
        self.monitor.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hstu-monitor-http", daemon=True)
        self._thread.start()
        log.info("hstu monitor serving on http://%s:%d/metrics", *self.address)
        return self.address

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.monitor.stop()


def parse_listen(text: str) -> tuple[str, int]:
    """``"127.0.0.1:9400"`` / ``":9400"`` / ``"[::1]:9400"`` -> (host, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen expects HOST:PORT (e.g. 127.0.0.1:9400), got {text!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)
