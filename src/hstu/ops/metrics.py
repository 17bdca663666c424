"""Device and host metric sources for ``hstu monitor``: ``npu-smi`` (parsed), NVML
(``nvidia-ml-py``), ``nvidia-smi`` (fallback when NVML is absent) and psutil.

Every source has ``unavailable_reason()`` (None when usable) and ``collect() -> list[Sample]``.
Metric names follow the Prometheus naming guide (base units in the name: ``_bytes``, ``_celsius``,
``_watts``, ``_ratio`` for 0..1, ``_bytes_per_second``; https://prometheus.io/docs/practices/naming/).
Device series carry ``backend`` ("npu" / "cuda") and ``device`` (index as the tool prints it, NPU
"<npu>/<chip>") labels and nothing else, so rules can join them with ``and``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hstu.ops._common import CommandResult, run_command
from hstu.ops.alerts import Sample
from hstu.ops.smi import (
    NVIDIA_QUERY_FIELDS,
    GpuReading,
    parse_npu_smi_info,
    parse_npu_smi_usages,
    parse_nvidia_smi_query,
)

log = logging.getLogger(__name__)

# name -> help text. Everything is a gauge.
METRICS: dict[str, str] = {
    "hstu_device_memory_used_bytes": "Device memory in use (HBM where present, else on-chip DDR), bytes.",
    "hstu_device_memory_total_bytes": "Device memory capacity, bytes.",
    "hstu_device_memory_utilization_ratio": "Device memory in use / capacity (0..1).",
    "hstu_device_memory_bandwidth_utilization_ratio": (
        "Fraction of time device memory was being read or written (NVML utilization.memory; npu-smi 'HBM Bandwidth Usage Rate'), 0..1."
    ),
    "hstu_device_compute_utilization_ratio": "Compute utilisation (NVML utilization.gpu; npu-smi AI Core %), 0..1.",
    "hstu_device_temperature_celsius": "Device temperature, degrees Celsius.",
    "hstu_device_power_watts": "Device power draw, watts.",
    "hstu_device_copy_bandwidth_bytes_per_second": (
        "Host<->device PCIe traffic (NVML PCIe throughput), bytes per second; direction=h2d|d2h."
    ),
    "hstu_device_info": "Device identity (always 1); labels name the model and health.",
    "hstu_host_memory_used_bytes": "Host memory in use (total - available), bytes.",
    "hstu_host_memory_total_bytes": "Host memory capacity, bytes.",
    "hstu_host_memory_utilization_ratio": "Host memory in use / capacity (0..1).",
    "hstu_host_cpu_utilization_ratio": "Host CPU utilisation since the previous sample, all cores (0..1).",
    "hstu_host_cpu_count": "Logical CPUs on the host.",
    "hstu_monitor_source_up": "1 if the metric source answered at the last sample, else 0.",
    "hstu_monitor_last_sample_timestamp_seconds": "Unix time of the last completed sample.",
}

Runner = Callable[[list[str], float], CommandResult]


def _run(argv: list[str], timeout_s: float) -> CommandResult:
    return run_command(argv, timeout_s)


class Source:
    name = "source"

    def unavailable_reason(self) -> str | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def collect(self) -> list[Sample]:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (NVML handle)."""


def _device_samples(
    backend: str,
    device: str,
    *,
    used: int | None,
    total: int | None,
    bw: float | None,
    compute: float | None,
    temp: float | None,
    power: float | None,
) -> list[Sample]:
    lb = {"backend": backend, "device": device}
    out = []
    if used is not None:
        out.append(Sample.of("hstu_device_memory_used_bytes", used, **lb))
    if total:
        out.append(Sample.of("hstu_device_memory_total_bytes", total, **lb))
        if used is not None:
            out.append(Sample.of("hstu_device_memory_utilization_ratio", used / total, **lb))
    if bw is not None:
        out.append(Sample.of("hstu_device_memory_bandwidth_utilization_ratio", bw, **lb))
    if compute is not None:
        out.append(Sample.of("hstu_device_compute_utilization_ratio", compute, **lb))
    if temp is not None:
        out.append(Sample.of("hstu_device_temperature_celsius", temp, **lb))
    if power is not None:
        out.append(Sample.of("hstu_device_power_watts", power, **lb))
    return out


class HostSource(Source):
    """Host CPU and memory via psutil. The CPU utilisation is over the time since the previous
    sample, at least ``MIN_CPU_WINDOW_S`` (a sample taken sooner, e.g. ``hstu monitor --once`` right
    after start, waits out the rest: psutil's first non-blocking reading is 0.0)."""

    name = "psutil"
    MIN_CPU_WINDOW_S = 0.1

    def __init__(self) -> None:
        self._psutil = None
        try:
            import psutil

            self._psutil = psutil
            psutil.cpu_percent(interval=None)  # prime: the first call has no reference point
            self._last = time.monotonic()
        except ImportError:
            pass

    def _cpu_ratio(self) -> float:
        """Host CPU utilisation in [0, 1] since the last reading (>= MIN_CPU_WINDOW_S)."""
        short = self.MIN_CPU_WINDOW_S - (time.monotonic() - self._last)
        pct = self._psutil.cpu_percent(interval=short if short > 0 else None)  # blocking over `short`: its own window
        self._last = time.monotonic()
        return pct / 100.0

    def unavailable_reason(self) -> str | None:
        return None if self._psutil else "psutil is not installed (pip install 'hstu[ops]')"

    def collect(self) -> list[Sample]:
        ps = self._psutil
        vm = ps.virtual_memory()
        used = int(vm.total - vm.available)
        return [
            Sample.of("hstu_host_memory_used_bytes", used),
            Sample.of("hstu_host_memory_total_bytes", int(vm.total)),
            Sample.of("hstu_host_memory_utilization_ratio", used / vm.total if vm.total else 0.0),
            Sample.of("hstu_host_cpu_utilization_ratio", self._cpu_ratio()),
            Sample.of("hstu_host_cpu_count", ps.cpu_count(logical=True) or 0),
        ]


USAGE_BANDWIDTH_KEYS = ("HBM Bandwidth Usage Rate(%)", "DDR Bandwidth Usage Rate(%)")


class NpuSmiSource(Source):
    """Ascend NPUs from ``npu-smi info`` (+ ``npu-smi info -t usages`` for memory bandwidth)."""

    name = "npu-smi"

    def __init__(self, runner: Runner = _run, usages: bool = True, timeout_s: float = 10.0) -> None:
        self.runner, self.usages, self.timeout_s = runner, usages, timeout_s
        self._reason: str | None = None
        self._probed = False

    def unavailable_reason(self) -> str | None:
        if not self._probed:
            res = self.runner(["npu-smi", "info"], self.timeout_s)
            self._probed = True
            if not res.ok:
                self._reason = res.error or f"npu-smi info exited {res.returncode}"
            elif not parse_npu_smi_info(res.stdout).chips:
                self._reason = "npu-smi info lists no NPU"
        return self._reason

    def collect(self) -> list[Sample]:
        res = self.runner(["npu-smi", "info"], self.timeout_s)
        if not res.ok:
            raise RuntimeError(res.error or f"npu-smi info exited {res.returncode}: {res.stderr.strip()[:200]}")
        info = parse_npu_smi_info(res.stdout)
        out: list[Sample] = []
        for chip in info.chips:
            dev = f"{chip.npu_id}/{chip.chip_id}"
            bw = None
            if self.usages:
                u = self.runner(["npu-smi", "info", "-t", "usages", "-i", str(chip.npu_id), "-c", str(chip.chip_id)], self.timeout_s)
                vals = parse_npu_smi_usages(u.stdout) if u.ok else {}
                rates = [vals[k] for k in USAGE_BANDWIDTH_KEYS if vals.get(k) is not None]
                bw = max(rates) / 100.0 if rates else None
            dm = chip.device_memory
            out += _device_samples(
                "npu",
                dev,
                used=dm[0] if dm else None,
                total=dm[1] if dm else None,
                bw=bw,
                compute=chip.aicore_ratio,
                temp=chip.temperature_celsius,
                power=chip.power_watts,
            )
            out.append(Sample.of("hstu_device_info", 1, backend="npu", device=dev, name=chip.name, health=chip.health))
        return out


class NvidiaSmiSource(Source):
    """NVIDIA GPUs from the ``nvidia-smi --query-gpu`` CSV (used when NVML is not importable)."""

    name = "nvidia-smi"

    def __init__(self, runner: Runner = _run, timeout_s: float = 10.0) -> None:
        self.runner, self.timeout_s = runner, timeout_s
        self.argv = ["nvidia-smi", f"--query-gpu={','.join(NVIDIA_QUERY_FIELDS)}", "--format=csv,noheader,nounits"]
        self._reason: str | None = None
        self._probed = False

    def unavailable_reason(self) -> str | None:
        if not self._probed:
            res = self.runner(self.argv, self.timeout_s)
            self._probed = True
            if not res.ok:
                self._reason = res.error or f"nvidia-smi exited {res.returncode}"
            elif not parse_nvidia_smi_query(res.stdout):
                self._reason = "nvidia-smi lists no GPU"
        return self._reason

    def collect(self) -> list[Sample]:
        res = self.runner(self.argv, self.timeout_s)
        if not res.ok:
            raise RuntimeError(res.error or f"nvidia-smi exited {res.returncode}: {res.stderr.strip()[:200]}")
        return gpu_samples(parse_nvidia_smi_query(res.stdout))


def gpu_samples(readings: list[GpuReading]) -> list[Sample]:
    out: list[Sample] = []
    for g in readings:
        dev = str(g.index)
        out += _device_samples(
            "cuda",
            dev,
            used=g.memory_used_bytes,
            total=g.memory_total_bytes,
            bw=g.memory_utilization_ratio,
            compute=g.utilization_ratio,
            temp=g.temperature_celsius,
            power=g.power_watts,
        )
        for rate, direction in ((g.pcie_tx_bytes_per_second, "d2h"), (g.pcie_rx_bytes_per_second, "h2d")):
            if rate is not None:
                out.append(Sample.of("hstu_device_copy_bandwidth_bytes_per_second", rate, backend="cuda", device=dev, direction=direction))
        out.append(Sample.of("hstu_device_info", 1, backend="cuda", device=dev, name=g.name, health=""))
    return out


class NvmlSource(Source):
    """NVIDIA GPUs through NVML (``pip install nvidia-ml-py``), including PCIe throughput.

    NVML reports PCIe throughput in KB/s over a 20 ms window; KB is taken as 1024 bytes. TX (sent by
    the GPU) is device-to-host, RX host-to-device. Source: NVML API reference, nvmlDeviceGetPcieThroughput.
    """

    name = "nvml"

    def __init__(self) -> None:
        self._nvml = None
        self._reason: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() == 0:
                self._reason = "NVML sees no GPU"
                pynvml.nvmlShutdown()
            else:
                self._nvml = pynvml
        except ImportError:
            self._reason = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...  # noqa: BLE001
            self._reason = f"NVML init failed: {type(exc).__name__}: {exc}"

    def unavailable_reason(self) -> str | None:
        return self._reason

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except Exception:  # NVMLError_NotSupported and friends  # noqa: BLE001
            return None

    def collect(self) -> list[Sample]:
        nv = self._nvml
        readings = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            name = self._try(nv.nvmlDeviceGetName, h) or "unknown"
            mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
            util = self._try(nv.nvmlDeviceGetUtilizationRates, h)
            power = self._try(nv.nvmlDeviceGetPowerUsage, h)  # milliwatts
            tx = self._try(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
            rx = self._try(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
            readings.append(
                GpuReading(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else name,
                    memory_total_bytes=int(mem.total) if mem else None,
                    memory_used_bytes=int(mem.used) if mem else None,
                    utilization_ratio=util.gpu / 100.0 if util else None,
                    memory_utilization_ratio=util.memory / 100.0 if util else None,
                    temperature_celsius=self._try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                    power_watts=power / 1000.0 if power is not None else None,
                    pcie_tx_bytes_per_second=tx * 1024.0 if tx is not None else None,
                    pcie_rx_bytes_per_second=rx * 1024.0 if rx is not None else None,
                )
            )
        return gpu_samples(readings)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None


def default_sources() -> list[Source]:
    """psutil, npu-smi and NVML; nvidia-smi is added as the GPU source only when NVML is unusable."""
    nvml = NvmlSource()
    gpu: list[Source] = [nvml] if nvml.unavailable_reason() is None else [nvml, NvidiaSmiSource()]
    return [HostSource(), NpuSmiSource(), *gpu]
