"""hstu monitor: metric sources fed with fixture tool output, the exporter served on 127.0.0.1:0 and
scraped twice, /alerts and /health, missing sources reported once, and the CLI on this host."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hstu.ops._common import CommandResult
from hstu.ops.alerts import AlertEngine, load_rules
from hstu.ops.cli import main
from hstu.ops.metrics import HostSource, NpuSmiSource, NvidiaSmiSource, Source, gpu_samples
from hstu.ops.monitor import Monitor, MonitorServer, parse_listen
from hstu.ops.smi import GpuReading

SMI = Path(__file__).parent / "fixtures" / "ops" / "smi"
MIB = 1 << 20


def fixture_runner(table: dict[str, str]):
    """A runner that answers commands with fixture text (keyed by the argv joined with spaces)."""

    def run(argv, timeout_s):
        key = " ".join(argv)
        for prefix, name in table.items():
            if key.startswith(prefix):
                return CommandResult(tuple(argv), 0, (SMI / name).read_text(), "")
        return CommandResult(tuple(argv), None, "", "", error=f"{argv[0]} not found on PATH")

    return run


NPU_RUNNER = fixture_runner({"npu-smi info -t usages": "npu_smi_usages_910b.txt", "npu-smi info": "npu_smi_info_910b.txt"})


def values(samples):
    return {(s.name, s.labels): s.value for s in samples}


def L(**kw):
    return tuple(sorted(kw.items()))


def test_npu_smi_source_from_fixture():
    src = NpuSmiSource(runner=NPU_RUNNER)
    assert src.unavailable_reason() is None
    v = values(src.collect())
    d0 = L(backend="npu", device="0/0")
    assert v[("hstu_device_memory_used_bytes", d0)] == 52791 * MIB
    assert v[("hstu_device_memory_total_bytes", d0)] == 65536 * MIB
    assert v[("hstu_device_memory_utilization_ratio", d0)] == pytest.approx(52791 / 65536)
    assert v[("hstu_device_memory_bandwidth_utilization_ratio", d0)] == pytest.approx(0.88)  # max(HBM 88 %, DDR 0 %)
    assert v[("hstu_device_compute_utilization_ratio", d0)] == pytest.approx(0.37)
    assert v[("hstu_device_temperature_celsius", d0)] == 41
    assert v[("hstu_device_power_watts", d0)] == pytest.approx(95.1)
    assert v[("hstu_device_info", L(backend="npu", device="1/0", health="Warning", name="910B3"))] == 1
    assert v[("hstu_device_temperature_celsius", L(backend="npu", device="1/0"))] == 78


def test_nvidia_smi_source_and_pcie_bandwidth():
    src = NvidiaSmiSource(runner=fixture_runner({"nvidia-smi": "nvidia_smi_query.csv"}))
    assert src.unavailable_reason() is None
    v = values(src.collect())
    g0 = L(backend="cuda", device="0")
    assert v[("hstu_device_memory_used_bytes", g0)] == 76012 * MIB
    assert v[("hstu_device_memory_bandwidth_utilization_ratio", g0)] == pytest.approx(0.91)
    assert ("hstu_device_compute_utilization_ratio", L(backend="cuda", device="2")) not in v  # [N/A]
    assert not any(k[0] == "hstu_device_copy_bandwidth_bytes_per_second" for k in v)  # not in nvidia-smi's CSV
    v = values(gpu_samples([GpuReading(0, "X", pcie_tx_bytes_per_second=9e9, pcie_rx_bytes_per_second=1e9)]))
    assert v[("hstu_device_copy_bandwidth_bytes_per_second", L(backend="cuda", device="0", direction="d2h"))] == 9e9
    assert v[("hstu_device_copy_bandwidth_bytes_per_second", L(backend="cuda", device="0", direction="h2d"))] == 1e9


class Flaky(Source):
    name = "flaky"

    def unavailable_reason(self):
        return None

    def collect(self):
        raise RuntimeError("tool crashed")


def test_missing_and_failing_sources_reported_once(caplog):
    caplog.set_level(logging.WARNING, logger="hstu.ops.monitor")
    absent = NpuSmiSource(runner=fixture_runner({}))
    mon = Monitor(sources=[HostSource(), absent, Flaky()], interval_s=1)
    for t in range(3):
        mon.sample_once(now=float(t))
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("npu-smi unavailable, skipped: npu-smi not found on PATH" in m for m in msgs) == 1
    assert sum("flaky failed: RuntimeError: tool crashed" in m for m in msgs) == 1
    _, up, last = mon.snapshot()
    assert up == {"psutil": 1, "npu-smi": 0, "flaky": 0} and last == 2.0


def scrape(host, port, path="/metrics"):
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as r:
        return r.status, r.headers.get("Content-Type"), r.read().decode()


def families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_server_scrapes_alerts_and_health():
    engine = AlertEngine(load_rules())
    mon = Monitor(sources=[HostSource(), NpuSmiSource(runner=NPU_RUNNER)], engine=engine, interval_s=0.2)
    server = MonitorServer(mon, "127.0.0.1", 0)
    host, port = server.start()
    try:
        assert port > 0
        status, ctype, first = scrape(host, port)
        assert status == 200 and ctype.startswith("text/plain")
        fams = families(first)
        total = fams["hstu_host_memory_total_bytes"].samples[0].value
        assert total == psutil.virtual_memory().total
        assert 0.0 <= fams["hstu_host_cpu_utilization_ratio"].samples[0].value <= 1.0
        used = {s.labels["device"]: s.value for s in fams["hstu_device_memory_used_bytes"].samples}
        assert used == {"0/0": 52791 * MIB, "1/0": 3345 * MIB}
        up = {s.labels["source"]: s.value for s in fams["hstu_monitor_source_up"].samples}
        assert up == {"psutil": 1.0, "npu-smi": 1.0}
        alerts = {(s.labels["alertname"], s.labels["state"]): s.value for s in fams["hstu_alerts"].samples}
        # npu 1/0 runs at 78 C > 75 C: ThermalThrottlingRisk is pending (for 15 s) from the first sample
        assert alerts[("ThermalThrottlingRisk", "pending")] == 1 and alerts[("ThermalThrottlingRisk", "firing")] == 0
        t_first = fams["hstu_monitor_last_sample_timestamp_seconds"].samples[0].value
        deadline = time.monotonic() + 10
        while True:  # the second scrape must see a newer sample from the sampler thread
            fams2 = families(scrape(host, port)[2])
            if fams2["hstu_monitor_last_sample_timestamp_seconds"].samples[0].value > t_first or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert fams2["hstu_monitor_last_sample_timestamp_seconds"].samples[0].value > t_first
        status, ctype, body = scrape(host, port, "/alerts")
        doc = json.loads(body)
        assert ctype == "application/json" and status == 200
        hot = [a for a in doc["alerts"] if a["alertname"] == "ThermalThrottlingRisk"]
        assert [(a["state"], a["labels"]["device"]) for a in hot] == [("pending", "1/0")]
        assert {r["name"] for r in doc["rules"]} >= {"MemoryBandwidthBottleneck", "DataMovementStorm"}
        assert scrape(host, port, "/health")[0] == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            scrape(host, port, "/nope")
        assert err.value.code == 404
    finally:
        server.stop()


def test_parse_listen():
    assert parse_listen("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_listen(":0") == ("0.0.0.0", 0)
    assert parse_listen("[::1]:9400") == ("::1", 9400)
    for bad in ("9400", "host:", "host:99999", "host:http"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listen(bad)


def test_cli_once_reports_this_host(capsys):
    assert main(["monitor", "--once", "--no-rules"]) == 0
    fams = families(capsys.readouterr().out)
    assert fams["hstu_host_memory_total_bytes"].samples[0].value == psutil.virtual_memory().total
    assert fams["hstu_host_cpu_count"].samples[0].value == psutil.cpu_count(logical=True)
    up = {s.labels["source"]: s.value for s in fams["hstu_monitor_source_up"].samples}
    assert up["psutil"] == 1.0 and {"npu-smi", "nvml"} <= set(up)
    assert "hstu_alerts" not in fams


def test_cli_export_rules_and_bad_listen(tmp_path, capsys):
    out = tmp_path / "hstu-rules.yml"
    assert main(["monitor", "--export-rules", str(out)]) == 0
    assert "alert: MemoryBandwidthBottleneck" in out.read_text()
    assert main(["monitor", "--listen", "nowhere"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - {name: X, when: 'a >'}\n")
    assert main(["monitor", "--rules", str(bad), "--once"]) == 2


def test_cli_serves_for_a_bounded_duration(capsys):
    assert main(["monitor", "--listen", "127.0.0.1:0", "--interval", "200ms", "--duration", "500ms"]) == 0
    assert "/metrics" in capsys.readouterr().out
    for zero in ("0", "0s"):  # a trial: ran forever ("0" read as no --duration)
        assert main(["monitor", "--listen", "127.0.0.1:0", "--duration", zero]) == 2
        assert "--duration must be > 0" in capsys.readouterr().err
    assert main(["monitor", "--once", "--no-rules", "--rules", "x.yaml"]) == 2  # was accepted: which one wins?
    assert "--no-rules and --rules together" in capsys.readouterr().err


def test_host_cpu_sample_right_after_start_measures_a_window(monkeypatch):
    """`hstu monitor --once` samples right after start: psutil's non-blocking reading would be 0.0
    (no time since the prime), so the first sample blocks for the rest of MIN_CPU_WINDOW_S; a later
    sample (past the window) reads non-blocking, over the time since the previous one."""
    import sys
    import types

    calls = []

    def cpu_percent(interval=None):
        calls.append(interval)
        return 0.0 if interval is None else 37.5

    vm = types.SimpleNamespace(total=100, available=40)
    fake = types.SimpleNamespace(cpu_percent=cpu_percent, virtual_memory=lambda: vm, cpu_count=lambda logical=True: 2)
    monkeypatch.setitem(sys.modules, "psutil", fake)
    src = HostSource()
    assert calls == [None]  # the prime
    got = {s.name: s.value for s in src.collect()}
    assert 0 < calls[1] <= HostSource.MIN_CPU_WINDOW_S  # blocked for the rest of the window
    assert got["hstu_host_cpu_utilization_ratio"] == 0.375
    src._last -= 10 * HostSource.MIN_CPU_WINDOW_S  # the next sample comes after the window
    src.collect()
    assert calls[2] is None


def test_rules_that_could_never_fire_are_refused(tmp_path, capsys, caplog):
    """A trial: a misspelled metric and a ratio compared with 90 (a percent slip) were accepted and could never
    fire; a rule on the server's queue depth cannot fire inside the monitor (it does in Prometheus): said once."""
    typo = tmp_path / "typo.yaml"
    typo.write_text("rules:\n  - {name: Typo, when: 'hstu_host_memry_utilization_ratio > 90%'}\n")
    assert main(["monitor", "--rules", str(typo), "--once"]) == 2
    assert f"{typo}:2 (Typo): when: unknown metric hstu_host_memry_utilization_ratio (hstu monitor exports: " in capsys.readouterr().err
    slip = tmp_path / "slip.yaml"
    slip.write_text("rules:\n  - {name: Slip, when: 'hstu_host_memory_utilization_ratio > 90'}\n")
    assert main(["monitor", "--rules", str(slip), "--once"]) == 2
    assert "hstu_host_memory_utilization_ratio is a 0..1 ratio, compared with 90: write 90% or 0.9" in capsys.readouterr().err
    serve = tmp_path / "serve.yaml"
    serve.write_text("rules:\n  - {name: Queue, when: 'hstu_serve_queue_depth > 200'}\n")
    with caplog.at_level("WARNING"):
        assert main(["monitor", "--rules", str(serve), "--once"]) == 0
    assert "rule Queue reads hstu_serve_queue_depth, which hstu serve exports, not hstu monitor" in caplog.text


def test_export_rules_refuses_what_the_monitor_refuses(tmp_path, capsys, caplog):
    """A trial: `--rules typo.yaml --export-rules out.yml` exited 0 and wrote a rule on an unknown metric that
    `--once` refused (exit 2); and that refusal said `rule R:` where the loader's errors say `typo.yaml:2 (R):`."""
    typo = tmp_path / "typo.yaml"
    ok, bad = "hstu_host_memory_utilization_ratio > 0.9", "hstu_host_memory_utilisation_ratio > 0.9"
    typo.write_text(f"rules:\n  - name: Ok\n    when: {ok}\n  - name: R\n    when: {bad}\n")
    out = tmp_path / "out.yml"
    for mode in (["--export-rules", str(out)], ["--export-rules", "-"], ["--once"]):
        assert main(["monitor", "--rules", str(typo), *mode]) == 2
        got = capsys.readouterr()
        assert got.err.startswith(f"hstu monitor: {typo}:4 (R): when: unknown metric hstu_host_memory_utilisation_ratio (")
        assert got.out == ""
    assert not out.exists()  # nothing written
    toml = tmp_path / "typo.toml"
    toml.write_text('[[rules]]\nname = "R"\nwhen = "hstu_nope > 1"\n')
    assert main(["monitor", "--rules", str(toml), "--export-rules", str(out)]) == 2
    assert f"{toml}: rules[0] (R): when: unknown metric hstu_nope" in capsys.readouterr().err and not out.exists()
    serve = tmp_path / "serve.yaml"  # a server metric fires in Prometheus: exported, without the monitor's warning
    serve.write_text("rules:\n  - {name: Queue, when: 'hstu_serve_queue_depth > 200'}\n")
    with caplog.at_level("WARNING"):
        assert main(["monitor", "--rules", str(serve), "--export-rules", str(out)]) == 0
    assert "alert: Queue" in out.read_text() and "never here" not in caplog.text
