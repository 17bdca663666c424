"""Read versions from their real sources; every probe tolerates its source being absent.

Sources, in the order each probe tries them:

- Python packages: ``importlib.metadata`` (never imports the package).
- torch: ``torch.__version__`` and ``torch.version.cuda`` (torch is a hard dependency of hstu, but an
  import failure is still reported, not raised); torch's own ``Requires-Dist`` for the pins it declares.
- CANN toolkit: ``<toolkit>/<arch>-linux/ascend_toolkit_install.info`` (``version=``), then
  ``<toolkit>/{runtime,compiler}/version.info`` (``version_dir=`` / ``Version=``), where ``<toolkit>``
  is ``$ASCEND_TOOLKIT_HOME``, ``$ASCEND_HOME_PATH``, ``<root>/ascend-toolkit/latest``,
  ``<root>/cann-*`` or ``<root>/nnae/latest`` and ``<root>`` is ``/usr/local/Ascend`` or ``~/Ascend``.
- NPU driver / firmware: ``<root>/driver/version.info`` and ``<root>/firmware/version.info``; the
  ``npu-smi info`` banner as a second source for the driver.
- NVIDIA driver: NVML (``nvidia-ml-py``, imported lazily) ``nvmlSystemGetDriverVersion`` and
  ``nvmlSystemGetCudaDriverVersion``; else the ``nvidia-smi`` banner.
- Torch import health: ``python -c 'import torch, torch_npu'`` in a subprocess with a timeout, so an
  ``undefined symbol`` or an abort in a native library cannot take the calling process down.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from hstu.ops._common import ascend_release, dist_version, read_kv_file, run_command
from hstu.ops.smi import parse_nvidia_smi_header

log = logging.getLogger(__name__)

DEFAULT_ASCEND_ROOTS = (Path("/usr/local/Ascend"), Path.home() / "Ascend")


@dataclass
class AscendInstall:
    """What was found of an Ascend software stack; None fields were not found."""

    cann_version: str | None = None  # release, e.g. "8.0.RC3"
    cann_file: str | None = None  # file the version was read from
    toolkit_home: str | None = None
    driver_version: str | None = None  # raw, e.g. "24.1.rc2.b030"
    driver_file: str | None = None
    firmware_version: str | None = None
    firmware_file: str | None = None
    searched: list[str] = field(default_factory=list)

    @property
    def driver_release(self) -> str | None:
        return ascend_release(self.driver_version) if self.driver_version else None


def _toolkit_candidates(roots: tuple[Path, ...], use_env: bool) -> list[Path]:
    cands: list[Path] = []
    if use_env:
        for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
            if os.environ.get(var):
                cands.append(Path(os.environ[var]))
    for root in roots:
        cands.append(root / "ascend-toolkit" / "latest")
        cands.extend(Path(p) for p in sorted(glob.glob(str(root / "cann-*")), reverse=True))
        cands.append(root / "cann")
        cands.append(root / "nnae" / "latest")
    return cands


def _cann_version_in(toolkit: Path) -> tuple[str, str] | None:
    files = sorted(glob.glob(str(toolkit / "*-linux" / "ascend_toolkit_install.info")))
    files.append(str(toolkit / "ascend_toolkit_install.info"))
    for f in files:
        kv = read_kv_file(Path(f))
        if kv.get("version"):
            return ascend_release(kv["version"]), f
    for sub in ("runtime", "compiler", "."):
        f = toolkit / sub / "version.info"
        kv = read_kv_file(f)
        # version_dir names the CANN release; Version= in a component file is the component's own number
        v = kv.get("version_dir") or (kv.get("version") if sub == "." else None)
        if v:
            return ascend_release(v), str(f)
    return None


def probe_ascend(roots: tuple[Path, ...] | None = None, *, use_env: bool = True) -> AscendInstall:
    """Find the CANN toolkit, NPU driver and firmware versions under ``roots``. Never raises."""
    roots = DEFAULT_ASCEND_ROOTS if roots is None else roots
    info = AscendInstall()
    for toolkit in _toolkit_candidates(roots, use_env):
        info.searched.append(str(toolkit))
        if not toolkit.is_dir():
            continue
        found = _cann_version_in(toolkit)
        if found:
            info.cann_version, info.cann_file = found
            info.toolkit_home = str(toolkit)
            break
    for root in roots:
        drv = read_kv_file(root / "driver" / "version.info")
        if drv.get("version") and info.driver_version is None:
            info.driver_version, info.driver_file = drv["version"], str(root / "driver" / "version.info")
        fw = read_kv_file(root / "firmware" / "version.info")
        if fw.get("version") and info.firmware_version is None:
            info.firmware_version, info.firmware_file = fw["version"], str(root / "firmware" / "version.info")
    return info


@dataclass
class NvidiaDriver:
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # newest CUDA the driver supports, e.g. "12.4"
    source: str | None = None
    gpu_names: list[str] = field(default_factory=list)
    reason: str | None = None  # why nothing was found


def probe_nvidia_driver() -> NvidiaDriver:
    """Driver version via NVML, else ``nvidia-smi``; ``reason`` says why neither worked."""
    reasons = []
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            drv = pynvml.nvmlSystemGetDriverVersion()
            drv = drv.decode() if isinstance(drv, bytes) else drv
            cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
            names = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                n = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                names.append(n.decode() if isinstance(n, bytes) else n)
            return NvidiaDriver(drv, f"{cuda // 1000}.{(cuda % 1000) // 10}", "nvml", names)
        finally:
            pynvml.nvmlShutdown()
    except ImportError:
        reasons.append("nvidia-ml-py not installed")
    except Exception as exc:  # NVMLError subclasses; the library raises many kinds  # noqa: BLE001
        reasons.append(f"NVML: {type(exc).__name__}: {exc}")
    res = run_command(["nvidia-smi"], timeout_s=15)
    if res.ok:
        hdr = parse_nvidia_smi_header(res.stdout)
        if hdr:
            names = re.findall(r"^\|\s+\d+\s+(.+?)\s{2,}(?:On|Off)\s+\|", res.stdout, re.MULTILINE)
            return NvidiaDriver(hdr["driver"], hdr["cuda"], "nvidia-smi", names)
        reasons.append("nvidia-smi output had no driver banner")
    else:
        reasons.append(res.error or f"nvidia-smi exited {res.returncode}")
    return NvidiaDriver(reason="; ".join(reasons))


@dataclass
class TorchInfo:
    version: str | None = None
    cuda: str | None = None  # CUDA runtime the wheel was built with; None for CPU/NPU wheels
    error: str | None = None
    requires: dict[str, str] = field(default_factory=dict)  # dist name -> specifier, markers applied


def _requires(dist: str) -> dict[str, str]:
    """``Requires-Dist`` of ``dist`` whose environment markers hold here, as {name: specifier}."""
    out: dict[str, str] = {}
    try:
        reqs = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return out
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - packaging ships with pip/pytest
        Requirement = None  # type: ignore[assignment]
    for line in reqs:
        if Requirement is None:
            name = re.split(r"[\s;<>=!~\[]", line, maxsplit=1)[0]
            out[name.lower()] = line[len(name) :].split(";")[0].strip()
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        out[req.name.lower()] = str(req.specifier)
    return out


def probe_torch() -> TorchInfo:
    """Version and CUDA build of the importable torch; ``error`` if ``import torch`` fails."""
    info = TorchInfo(version=dist_version("torch"), requires=_requires("torch"))
    try:
        import torch

        info.version = torch.__version__
        info.cuda = torch.version.cuda
    except Exception as exc:  # ImportError, OSError, RuntimeError from native libs  # noqa: BLE001
        info.error = f"{type(exc).__name__}: {exc}"
    return info


@dataclass
class ImportProbe:
    ok: bool
    returncode: int | None
    stdout: str
    stderr: str


def import_probe(code: str, env_overrides: dict[str, str] | None = None, timeout_s: float = 120.0) -> ImportProbe:
    """Run ``python -c code`` in a fresh interpreter; a crash or hang there cannot reach this one."""
    env = dict(os.environ)
    env.update(env_overrides or {})
    try:
        proc = subprocess.run(  # noqa: S603 - our own interpreter, fixed code string
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env, errors="replace"
        )
    except subprocess.TimeoutExpired:
        return ImportProbe(False, None, "", f"timed out after {timeout_s:g} s")
    return ImportProbe(proc.returncode == 0, proc.returncode, proc.stdout, proc.stderr)


def loaded_native_libs(names: tuple[str, ...] = ("libstdc++", "libgomp", "libgcc_s")) -> list[str]:
    """Paths of shared libraries named ``names`` mapped into this process (Linux /proc/self/maps)."""
    found: set[str] = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rstrip("\n").split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/") and any(os.path.basename(path).startswith(n) for n in names):
                    found.add(path)
    except OSError:
        return []
    return sorted(found)


def torch_backend_entry_points() -> list[str]:
    """Names registered in the ``torch.backends`` entry-point group (autoloaded by torch >= 2.5)."""
    try:
        return sorted(ep.name for ep in metadata.entry_points(group="torch.backends"))
    except Exception:  # noqa: BLE001 - broken metadata of a third-party dist
        return []
