"""The shipped Grafana dashboard (hstu/ops/grafana_dashboard.json, issue 23 item 6): Grafana-shaped
(unique panel ids, a Prometheus datasource on every panel and target, a grid without overlaps),
and every metric name and label its PromQL reads is one the code exports, read from the live
/metrics of a running service (tests/serving.py) and of hstu monitor's exporter."""

from __future__ import annotations

import json
import re
import urllib.request
from importlib import resources
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hstu.ops._common import CommandResult
from hstu.ops.alerts import AlertEngine, load_rules
from hstu.ops.metrics import HostSource, NpuSmiSource, NvidiaSmiSource, Source, gpu_samples
from hstu.ops.monitor import Monitor, MonitorServer
from hstu.ops.smi import GpuReading

SMI = Path(__file__).parent / "fixtures" / "ops" / "smi"
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def dashboard() -> dict:
    return json.loads(resources.files("hstu.ops").joinpath("grafana_dashboard.json").read_text())


def targets(d: dict):
    for p in d["panels"]:
        for t in p.get("targets", []):
            yield p, t


def used(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) a PromQL expression reads: names from hstu_…; labels from
    {matchers} and by / without / on / ignoring (...) clauses; string literals dropped first."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    names = set(re.findall(r"\b(hstu_[A-Za-z0-9_:]+)", bare))
    labels = {m for block in re.findall(r"\{([^}]*)\}", bare) for m in re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", block)}
    labels |= {x.strip() for grp in GROUPING.findall(bare) for x in grp.split(",") if x.strip()}
    return names, labels


def exported(text: str, into: dict[str, set[str]]) -> None:
    """Prometheus text -> {sample or family name: its label names} (a family without samples: none)."""
    for fam in text_string_to_metric_families(text):
        into.setdefault(fam.name, set())
        for s in fam.samples:
            into.setdefault(s.name, set()).update(s.labels)


def fixture_runner(table: dict[str, str]):
    def run(argv, timeout_s):
        key = " ".join(argv)
        for prefix, name in table.items():
            if key.startswith(prefix):
                return CommandResult(tuple(argv), 0, (SMI / name).read_text(), "")
        return CommandResult(tuple(argv), None, "", "", error=f"{argv[0]} not found on PATH")

    return run


class PcieSource(Source):
    """NVML's PCIe readings without a GPU: the samples of hstu.ops.metrics.gpu_samples."""

    name = "pcie"

    def unavailable_reason(self):
        return None

    def collect(self):
        return gpu_samples([GpuReading(0, "X", pcie_tx_bytes_per_second=9e9, pcie_rx_bytes_per_second=1e9)])


@pytest.fixture(scope="module")
def live_metrics(rec) -> dict[str, set[str]]:
    """What a running service and a running monitor (nvidia-smi and npu-smi fixture output, this
    host, NVML-shaped PCIe readings, the default alert rules) export."""
    from serving import serve

    out: dict[str, set[str]] = {}
    with serve(rec) as s:
        r = httpx.post(s.url + "/v1/generate", json={"history": [{"item_id": 1, "timestamp": 978300000}], "k": 2}, timeout=60)
        assert r.status_code == 200, r.text
        exported(httpx.get(s.url + "/metrics", timeout=10).text, out)
    sources = [
        HostSource(),
        NvidiaSmiSource(runner=fixture_runner({"nvidia-smi": "nvidia_smi_query.csv"})),
        NpuSmiSource(runner=fixture_runner({"npu-smi info -t usages": "npu_smi_usages_910b.txt", "npu-smi info": "npu_smi_info_910b.txt"})),
        PcieSource(),
    ]
    mon = Monitor(sources=sources, engine=AlertEngine(load_rules()), interval_s=0.2)
    server = MonitorServer(mon, "127.0.0.1", 0)
    host, port = server.start()
    try:
        mon.sample_once()
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as resp:
            exported(resp.read().decode(), out)
    finally:
        server.stop()
    return out


def test_dashboard_is_grafana_shaped():
    d = dashboard()
    assert isinstance(d["schemaVersion"], int) and d["uid"] and d["title"]
    assert any(v["name"] == "datasource" and v["type"] == "datasource" and v["query"] == "prometheus" for v in d["templating"]["list"])
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        here = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not here & cells, f"panel {p['title']!r} overlaps another"
        cells |= here
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["datasource"] == p["datasource"] and t["expr"].strip() for t in p["targets"]), p["title"]


def test_every_metric_and_label_the_dashboard_reads_is_exported(live_metrics):
    read: set[str] = set()
    for p, t in targets(dashboard()):
        names, labels = used(t["expr"])
        assert names, f"{p['title']!r}: {t['expr']!r} reads no hstu metric"
        missing = sorted(n for n in names if n not in live_metrics)
        assert not missing, f"{p['title']!r}: {missing} not exported (expr {t['expr']!r})"
        have = set().union(*(live_metrics[n] for n in names))
        assert labels <= have, f"{p['title']!r}: labels {sorted(labels - have)} not on {sorted(names)}"
        read |= names
    # the list: latency histograms per bucket, queue depth, rejections, batch sizes, memory, devices
    for name in (
        "hstu_serve_request_duration_seconds_bucket",
        "hstu_serve_queue_depth",
        "hstu_serve_rejected_requests_total",
        "hstu_serve_batch_size_bucket",
        "hstu_serve_predicted_queue_delay_seconds",
        "hstu_serve_queue_delay_limit_seconds",
        "hstu_serve_memory_free_bytes",
        "hstu_device_memory_used_bytes",
        "hstu_device_compute_utilization_ratio",
        "hstu_host_memory_utilization_ratio",
    ):
        assert name in read, name


def test_promql_reader_finds_names_and_labels():
    names, labels = used('histogram_quantile(0.99, sum by (le, bucket) (rate(hstu_x_bucket{endpoint="/v1/generate"}[5m]))) / on() hstu_y')
    assert names == {"hstu_x_bucket", "hstu_y"} and labels == {"le", "bucket", "endpoint"}
