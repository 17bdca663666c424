"""CPU backend: host memory from /proc/meminfo (psutil where installed)."""

from __future__ import annotations

import os
import platform

import torch

from hstu.backend.base import Backend, MemoryInfo


def host_memory_info() -> MemoryInfo:
    """Available and total host memory in bytes (psutil, else /proc/meminfo, else sysconf)."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return MemoryInfo(free_bytes=int(vm.available), total_bytes=int(vm.total))
    except ImportError:
        pass
    try:
        fields = {}
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return MemoryInfo(free_bytes=fields["MemAvailable"], total_bytes=fields["MemTotal"])
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(free_bytes=os.sysconf("SC_AVPHYS_PAGES") * page, total_bytes=os.sysconf("SC_PHYS_PAGES") * page)


class CPUBackend(Backend):
    """The host: one device shared by every rank, no graphs, oneDNN / FBGEMM / QNNPACK integer GEMMs."""

    name = "cpu"
    is_host = True
    dist_backend = "gloo"
    torchrec_kernels = True  # fbgemm-gpu-cpu
    int8_gemms = ("onednn", "fbgemm", "qnnpack")  # oneDNN (VNNI / AMX), FBGEMM (x86), QNNPACK (ARM): hstu.quant.int8_kernels

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> MemoryInfo:
        return host_memory_info()

    def set_current(self) -> None:
        """No-op: the host has no current device."""

    def device_name(self) -> str:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
                return next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
        except (OSError, StopIteration):
            return platform.processor() or platform.machine()

    def lowp_unavailable_reason(self, precision: str) -> str | None:
        """oneDNN's own checks (ATen mkldnn matmul): bf16 needs AVX512-BF16 or AMX, fp16 AVX512-FP16 or AMX-FP16."""
        check = {"bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported, "fp16": torch.ops.mkldnn._is_mkldnn_fp16_supported}[precision]
        return None if check() else f"this CPU has no oneDNN {precision} matmul kernel (needs AVX512-{precision.upper()} or AMX): emulated"
