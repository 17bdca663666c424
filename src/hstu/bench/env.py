"""The environment a benchmark result was measured in: device and its name, driver / CUDA / CANN
versions, torch and torch_npu versions, threads, load average, git commit.

Versions come from the probes ``hstu doctor`` uses (:mod:`hstu.ops.probes`: NVML or nvidia-smi for
the NVIDIA driver, the CANN toolkit's install files, package metadata); the device name from the
backend (:meth:`hstu.backend.base.Backend.device_name`).
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

import hstu


def git_commit(repo: str | Path | None = None) -> str:
    """HEAD of the git checkout at ``repo`` (default: the one holding the hstu package), with "+dirty"
    when tracked files differ from it; "unknown" outside a checkout (read-only git calls)."""
    cwd = Path(repo) if repo is not None else Path(hstu.__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment(be) -> dict:
    """Facts about this machine and the backend ``be`` (a :class:`hstu.backend.base.Backend`):
    ``device``, ``device_name``, ``torch``, ``torch_cuda`` (the wheel's CUDA), ``torch_npu``,
    ``nvidia_driver`` / ``cuda_driver`` (NVML / nvidia-smi), ``cann`` / ``ascend_driver``,
    ``torch_threads``, ``cpu_count``, ``cpu``, ``platform``, ``python``, ``load_average``,
    ``git_commit``, ``hstu``. A value that could not be found is None."""
    from hstu.backend import CPUBackend
    from hstu.ops import probes
    from hstu.ops._common import dist_version

    nv = probes.probe_nvidia_driver() if not be.is_host else None
    asc = probes.probe_ascend() if not be.is_host else None
    return {
        "device": str(be.device),
        "device_name": be.device_name(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_npu": dist_version("torch-npu") or dist_version("torch_npu"),
        "nvidia_driver": nv.driver_version if nv else None,
        "cuda_driver": nv.cuda_driver_version if nv else None,
        "cann": asc.cann_version if asc else None,
        "ascend_driver": asc.driver_version if asc else None,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": CPUBackend().device_name(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": load_average(),
        "git_commit": git_commit(),
        "hstu": getattr(hstu, "__version__", None),
    }
