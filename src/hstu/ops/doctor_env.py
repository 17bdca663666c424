"""``hstu doctor``, step 1: collect this host's versions and memory into an :class:`Environment`.

Versions come from their real sources (:mod:`hstu.ops.probes`); memory from the backend
(``Backend.memory_info()``) and ``npu-smi``. Tests build an Environment by hand instead.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hstu.ops import probes
from hstu.ops._common import (
    dist_version,
)
from hstu.ops.smi import npu_smi_info

log = logging.getLogger(__name__)

STATUSES = ("pass", "warn", "fail", "skip")
LOW_FREE_RATIO = 0.10  # warn when less than 10 % of a device's memory is free
TRITON_DISTS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "triton-xpu")
CUDA_RUNTIME_DISTS = (
    "nvidia-cuda-runtime-cu13",
    "nvidia-cuda-runtime-cu12",
    "nvidia-cuda-runtime-cu11",
    "nvidia-cuda-runtime",
)


@dataclass
class Check:
    """One doctor finding. ``fix`` is a command (or short instruction) to run when not ``pass``."""

    name: str
    status: str
    summary: str
    detail: str = ""
    fix: str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name!r}: status must be one of {STATUSES}, got {self.status!r}")


@dataclass
class DeviceMemory:
    label: str  # e.g. "cpu (host)", "npu:0 910B3", "cuda:0 NVIDIA H100"
    free_bytes: int
    total_bytes: int
    source: str


@dataclass
class Environment:
    """Everything doctor looks at. Tests construct this directly; None means "not found"."""

    python_version: str
    python_executable: str = ""
    sys_prefix: str = ""
    base_prefix: str = ""
    conda_prefix: str | None = None
    ld_library_path: list[str] = field(default_factory=list)
    hstu_requires_python: str | None = None
    torch: probes.TorchInfo = field(default_factory=probes.TorchInfo)
    torch_npu_version: str | None = None
    torch_npu_import: probes.ImportProbe | None = None  # python -c "import torch, torch_npu"
    autoload_env: str | None = None  # TORCH_DEVICE_BACKEND_AUTOLOAD as set
    backend_entry_points: list[str] = field(default_factory=list)
    autoload_import: probes.ImportProbe | None = None  # python -c "import torch" with autoload on
    triton_dist: str | None = None
    triton_version: str | None = None
    cuda_runtime_pkgs: dict[str, str] = field(default_factory=dict)
    ascend: probes.AscendInstall = field(default_factory=probes.AscendInstall)
    npu_smi_version: str | None = None
    npu_smi_reason: str | None = None
    nvidia: probes.NvidiaDriver = field(default_factory=probes.NvidiaDriver)
    loaded_libs: list[str] = field(default_factory=list)
    memory: list[DeviceMemory] = field(default_factory=list)
    backend: str | None = None
    backend_reason: str | None = None


def collect_environment(ascend_roots: tuple[Path, ...] | None = None, *, import_probes: bool = True) -> Environment:
    """Probe this host. Slow parts (subprocess imports) only run where the package is installed.
    FileNotFoundError naming ``--ascend-root`` for a given root that is not a directory (a mistyped root read as
    "not an Ascend host")."""
    from importlib import metadata

    for root in ascend_roots or ():
        if not Path(root).is_dir():
            raise FileNotFoundError(f"--ascend-root {root}: no such directory")

    env = Environment(
        python_version=platform.python_version(),
        python_executable=sys.executable,
        sys_prefix=sys.prefix,
        base_prefix=sys.base_prefix,
        conda_prefix=os.environ.get("CONDA_PREFIX"),
        ld_library_path=[p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p],
        autoload_env=os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD"),
    )
    try:
        env.hstu_requires_python = metadata.metadata("hstu").get("Requires-Python")
    except metadata.PackageNotFoundError:
        env.hstu_requires_python = None
    env.torch = probes.probe_torch()
    env.torch_npu_version = dist_version("torch-npu") or dist_version("torch_npu")
    env.backend_entry_points = probes.torch_backend_entry_points()
    for name in TRITON_DISTS:
        v = dist_version(name)
        if v:
            env.triton_dist, env.triton_version = name, v
            break
    env.cuda_runtime_pkgs = {n: v for n in CUDA_RUNTIME_DISTS if (v := dist_version(n))}
    env.ascend = probes.probe_ascend(ascend_roots)
    info, why = npu_smi_info()
    env.npu_smi_version, env.npu_smi_reason = (info.version if info else None), why
    env.nvidia = probes.probe_nvidia_driver()
    env.loaded_libs = probes.loaded_native_libs()
    if import_probes and env.torch_npu_version:
        env.torch_npu_import = probes.import_probe(
            "import torch, torch_npu; print(torch_npu.__version__)", {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        )
    if import_probes and env.backend_entry_points:
        env.autoload_import = probes.import_probe("import torch", {"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    # if `import torch_npu` failed in the subprocess, do not import it here (it may abort the process)
    npu_broken = env.torch_npu_import is not None and not env.torch_npu_import.ok
    env.memory, env.backend, env.backend_reason = _collect_memory(info, skip_npu=npu_broken)
    return env


def _select_backend(skip_npu: bool):
    from hstu.backend import select

    if not skip_npu:
        return select("auto")
    for name in ("cuda", "cpu"):
        try:
            return select(name)
        except Exception:  # BackendUnavailableError  # noqa: BLE001
            continue
    raise RuntimeError("no backend")


def _collect_memory(npu_info, skip_npu: bool = False) -> tuple[list[DeviceMemory], str | None, str | None]:
    mems: list[DeviceMemory] = []
    backend_name, reason = None, None
    try:
        b = _select_backend(skip_npu)
        backend_name = b.name
        mi = b.memory_info()
        label = f"{b.name} (host)" if b.is_host else str(b.device)
        mems.append(DeviceMemory(label, mi.free_bytes, mi.total_bytes, f"hstu.backend {b.name}.memory_info()"))
    except Exception as exc:  # BackendUnavailableError, driver errors  # noqa: BLE001
        reason = f"{type(exc).__name__}: {exc}"
    if npu_info is not None:
        for chip in npu_info.chips:
            dm = chip.device_memory
            if dm:
                used, total = dm
                mems.append(DeviceMemory(f"npu {chip.npu_id}/{chip.chip_id} {chip.name}", total - used, total, "npu-smi info"))
    return mems, backend_name, reason
