"""``hstu doctor``, step 2: the checks, each (Environment, CompatTable) -> Check; they never raise on odd versions."""

from __future__ import annotations

import os
import re

from hstu.ops._common import ascend_release, ascend_version_key, base_version, major_minor, version_tuple
from hstu.ops.compat import CompatTable
from hstu.ops.doctor_env import LOW_FREE_RATIO, Check, Environment


def _spec_ok(version: str, spec: str) -> bool | None:
    """Whether ``version`` satisfies PEP 440 ``spec``; None when ``packaging`` cannot judge."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return Version(version) in SpecifierSet(spec, prereleases=True)
    except Exception:  # noqa: BLE001 - InvalidVersion / InvalidSpecifier / ImportError
        return None


def check_python(env: Environment, table: CompatTable) -> Check:
    pv = env.python_version
    pt = version_tuple(pv)[:2]
    if env.hstu_requires_python and _spec_ok(pv, env.hstu_requires_python) is False:
        return Check(
            "python",
            "fail",
            f"Python {pv} does not satisfy hstu's Requires-Python {env.hstu_requires_python}",
            fix="python3.11 -m venv .venv && . .venv/bin/activate && pip install hstu  # any Python hstu supports",
        )
    if not env.torch.version:
        return Check("python", "warn", f"Python {pv}; torch not installed, cannot check the pairing")
    row = table.torch_row(env.torch.version)
    if row is None:
        return Check(
            "python",
            "warn",
            f"Python {pv}; torch {major_minor(env.torch.version)} is not in the table",
            detail=f"table covers torch {', '.join(table.torch_minors())}",
        )
    lo, hi = version_tuple(row["python_min"]), version_tuple(row["python_max"])
    if lo <= pt <= hi:
        return Check(
            "python",
            "pass",
            f"Python {pv} (torch {row['torch']} supports {row['python_min']}-{row['python_max']})",
            source=row["source"],
        )
    return Check(
        "python",
        "fail",
        f"Python {pv} is outside torch {row['torch']}'s range {row['python_min']}-{row['python_max']}",
        fix=f"use Python {row['python_max']} or older (>= {row['python_min']}) for torch {row['torch']}",
        source=row["source"],
    )


def check_torch(env: Environment, table: CompatTable) -> Check:
    t = env.torch
    if t.version is None:
        return Check("torch", "fail", "torch is not installed", fix='pip install "torch>=2.4,<2.15"')
    if t.error:
        return Check(
            "torch",
            "fail",
            f"torch {t.version} is installed but `import torch` fails: {t.error}",
            detail="run `hstu diagnose` on the traceback for the likely cause",
            fix="pip install --force-reinstall torch==" + base_version(t.version),
        )
    build = f"CUDA {t.cuda}" if t.cuda else "built without CUDA"
    row = table.torch_row(t.version)
    if row is None:
        return Check(
            "torch",
            "warn",
            f"torch {t.version} ({build}) is not in the compatibility table",
            detail=f"table covers torch {', '.join(table.torch_minors())}",
            fix=f"pip install 'torch=={table.torch_minors()[0]}.*'  # a release the table covers",
        )
    if t.cuda and major_minor(t.cuda) not in row["cuda"]:
        return Check(
            "torch",
            "warn",
            f"torch {t.version} built with CUDA {t.cuda}, not a listed build ({', '.join(row['cuda'])})",
            fix=f"pip install torch=={base_version(t.version)} "
            f"--index-url https://download.pytorch.org/whl/cu{row['cuda'][0].replace('.', '')}",
            source=row["source"],
        )
    return Check("torch", "pass", f"torch {t.version} ({build})", source=row["source"])


_UNDEF_RE = re.compile(r"undefined symbol: (\S+)")
_NOLIB_RE = re.compile(r"(\S+\.so[.\d]*): cannot open shared object file")


def _import_failure_hint(stderr: str) -> tuple[str, str]:
    """(what happened, fix) for a failed ``import torch_npu`` from its stderr."""
    m = _UNDEF_RE.search(stderr)
    if m:
        return (
            f"undefined symbol {m.group(1)} (a library built against another torch/libstdc++ was loaded)",
            "pip install torch-npu==<version matching torch exactly>; if it persists, check `ldd` for conda libraries",
        )
    m = _NOLIB_RE.search(stderr)
    if m:
        return (
            f"{m.group(1)} not found (CANN environment not loaded)",
            "source /usr/local/Ascend/ascend-toolkit/set_env.sh",
        )
    last = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
    return last[:300], "hstu diagnose <file with the traceback>"


def check_torch_npu(env: Environment, table: CompatTable) -> Check:
    if not env.torch_npu_version:
        return Check("torch_npu", "skip", "torch_npu not installed (not an Ascend setup)")
    tn, tv = env.torch_npu_version, env.torch.version
    if tv is None:
        return Check("torch_npu", "fail", f"torch_npu {tn} installed without torch", fix=f"pip install torch=={base_version(tn)}")
    if base_version(tn) != base_version(tv):
        rows = table.npu_rows_for_torch(tv)
        if env.ascend.cann_version:  # prefer the build paired with the installed CANN
            rows = sorted(
                rows,
                key=lambda r: ascend_version_key(r["cann"]) != ascend_version_key(ascend_release(env.ascend.cann_version)),
            )
        want = rows[0]["torch_npu"] if rows else base_version(tv)
        return Check(
            "torch_npu",
            "fail",
            f"torch_npu {tn} requires torch {base_version(tn)} exactly, but torch {tv} is installed",
            detail="torch_npu is built against one torch release; any other raises 'undefined symbol' on import",
            fix=f'pip install "torch-npu=={want}"  # or: pip install "torch=={base_version(tn)}"',
            source=rows[0]["source"] if rows else None,
        )
    if env.torch_npu_import is not None and not env.torch_npu_import.ok:
        what, fix = _import_failure_hint(env.torch_npu_import.stderr)
        return Check("torch_npu", "fail", f"torch_npu {tn} matches torch {tv}, but `import torch_npu` fails: {what}", fix=fix)
    return Check("torch_npu", "pass", f"torch_npu {tn} matches torch {base_version(tv)}")


def check_cann(env: Environment, table: CompatTable) -> Check:
    a = env.ascend
    if not a.cann_version:
        if env.torch_npu_version:
            return Check(
                "cann",
                "fail",
                "torch_npu is installed but no CANN toolkit was found",
                detail="searched: " + ", ".join(a.searched),
                fix="install the CANN toolkit matching torch_npu, then: source /usr/local/Ascend/ascend-toolkit/set_env.sh",
            )
        return Check("cann", "skip", "no CANN toolkit found (not an Ascend host)")
    rows = table.npu_rows_for_cann(a.cann_version)
    where = f"CANN {a.cann_version} (from {a.cann_file})"
    if not env.torch_npu_version:
        return Check(
            "cann",
            "warn",
            f"{where}, but torch_npu is not installed",
            fix=(
                f'pip install "torch-npu=={rows[0]["torch_npu"]}" "torch=={rows[0]["torch"]}"'
                if rows
                else "pip install torch-npu matching your torch and CANN"
            ),
            source=rows[0]["source"] if rows else None,
        )
    if not rows:
        return Check(
            "cann",
            "warn",
            f"{where} is not in the compatibility table; torch_npu {env.torch_npu_version} unverified",
            detail="known CANN releases: " + ", ".join(sorted({r["cann"] for r in table.tables["torch_npu"]}, key=ascend_version_key)),
        )
    match = [r for r in rows if r["torch_npu"] == env.torch_npu_version]
    if match:
        return Check("cann", "pass", f"{where} is paired with torch_npu {env.torch_npu_version}", source=match[0]["source"])
    same_torch = [r for r in rows if base_version(r["torch"]) == base_version(env.torch_npu_version)]
    if same_torch:
        return Check(
            "cann",
            "warn",
            f"{where} is paired with torch_npu {same_torch[0]['torch_npu']}, installed {env.torch_npu_version}",
            fix=f'pip install "torch-npu=={same_torch[0]["torch_npu"]}"',
            source=same_torch[0]["source"],
        )
    pairs = ", ".join(f"torch {r['torch']} + torch_npu {r['torch_npu']}" for r in rows)
    return Check(
        "cann",
        "fail",
        f"{where} does not support torch_npu {env.torch_npu_version} (release notes list: {pairs})",
        detail="a CANN/torch_npu mismatch often surfaces only as 'Install failed' or an opaque EZ/EE error",
        fix=f'pip install "torch=={rows[0]["torch"]}" "torch-npu=={rows[0]["torch_npu"]}"'
        "  # or install the CANN release for your torch_npu",
        source=rows[0]["source"],
    )


def check_npu_driver(env: Environment, table: CompatTable) -> Check:
    a = env.ascend
    drv = a.driver_version or env.npu_smi_version
    src = a.driver_file or ("npu-smi info" if env.npu_smi_version else None)
    if not drv:
        if a.cann_version or env.torch_npu_version:
            return Check(
                "npu_driver",
                "fail",
                "CANN/torch_npu present but no NPU driver found",
                detail=f"no <root>/driver/version.info; npu-smi: {env.npu_smi_reason}",
                fix="install the Ascend HDK driver and firmware (Ascend-hdk-*-npu-driver_*.run --full), then reboot",
            )
        return Check("npu_driver", "skip", "no Ascend NPU driver found (not an Ascend host)")
    fw = f" (firmware {a.firmware_version})" if a.firmware_version else " (firmware version not found)"
    summary = f"NPU driver {drv} (from {src})"  # the firmware goes after the comparison: "driver X >= Y required ... (firmware Z)"
    if not a.cann_version:
        return Check(
            "npu_driver",
            "warn",
            summary + fw + "; no CANN found to pair it with",
            fix="install CANN, then: source /usr/local/Ascend/ascend-toolkit/set_env.sh",
        )
    row = table.cann_driver_row(a.cann_version)
    if row is None:
        return Check("npu_driver", "warn", summary + fw + f"; CANN {a.cann_version} has no driver row in the table")
    try:
        ok = ascend_version_key(ascend_release(drv)) >= ascend_version_key(row["min_hdk"])
    except ValueError:
        return Check("npu_driver", "warn", summary + fw + f"; cannot compare version {drv!r}")
    if ok:
        return Check(
            "npu_driver",
            "pass",
            summary + f" >= {row['min_hdk']} required by CANN {a.cann_version}" + fw,
            source=row["source"],
        )
    return Check(
        "npu_driver",
        "fail",
        summary + f" is older than Ascend HDK {row['min_hdk']} required by CANN {a.cann_version}" + fw,
        detail="an old driver under a new CANN fails at aclInit / device setup (ACL_ERROR_RT_DEV_SETUP_ERROR 507033)",
        fix=f"upgrade driver+firmware to Ascend HDK {row['min_hdk']} or newer (firmware first, then driver, then reboot); "
        "check: npu-smi info",
        source=row["source"],
    )


def check_cuda(env: Environment, table: CompatTable) -> Check:
    t, nv = env.torch, env.nvidia
    gpu = bool(nv.driver_version)
    if not t.cuda:
        if gpu:
            names = ", ".join(nv.gpu_names) or "an NVIDIA GPU"
            tv = base_version(t.version or "")
            return Check(
                "cuda",
                "warn",
                f"{names} with driver {nv.driver_version} found, but torch {t.version} has no CUDA",
                fix=f"pip install torch=={tv} --index-url https://download.pytorch.org/whl/cu126",
            )
        return Check("cuda", "skip", f"no CUDA in torch and no NVIDIA driver ({nv.reason or 'not found'})")
    pkgs = ", ".join(f"{k} {v}" for k, v in env.cuda_runtime_pkgs.items())
    runtime = f"torch CUDA runtime {t.cuda}" + (f" ({pkgs})" if pkgs else "")
    for name, ver in env.cuda_runtime_pkgs.items():
        if name.endswith(f"cu{version_tuple(t.cuda)[0]}") and major_minor(ver) != major_minor(t.cuda):
            return Check(
                "cuda",
                "fail",
                f"{runtime}: pip package {name} {ver} does not match torch's CUDA {t.cuda}",
                fix=f'pip install --force-reinstall "torch=={base_version(t.version or "")}"  # reinstalls its nvidia-* wheels',
            )
    if not gpu:
        return Check(
            "cuda",
            "warn",
            f"{runtime}, but no NVIDIA driver found ({nv.reason})",
            fix="install the NVIDIA driver; check with: nvidia-smi",
        )
    row = table.cuda_driver_row(t.cuda)
    summary = f"{runtime}; driver {nv.driver_version} (supports CUDA {nv.cuda_driver_version}, via {nv.source})"
    if row is None:
        return Check("cuda", "warn", summary + f"; CUDA {t.cuda} not in the driver table")
    if version_tuple(nv.driver_version) < version_tuple(row["min_driver"]):
        return Check(
            "cuda",
            "fail",
            summary + f" is older than {row['min_driver']} required for CUDA {version_tuple(t.cuda)[0]}.x",
            fix=f"upgrade the NVIDIA driver to >= {row['min_driver']}, or install a torch built for an older CUDA",
            source=row["source"],
        )
    tk = table.cuda_toolkit_row(t.cuda)
    if tk and version_tuple(nv.driver_version) < version_tuple(tk["min_driver"]):
        return Check(
            "cuda",
            "warn",
            summary + f"; runs under minor-version compatibility (CUDA {major_minor(t.cuda)} GA driver is {tk['min_driver']}): "
            "no PTX JIT for newer code",
            fix=f"upgrade the NVIDIA driver to >= {tk['min_driver']} for full CUDA {major_minor(t.cuda)} support",
            source=tk["source"],
        )
    return Check("cuda", "pass", summary, source=row["source"])


def check_triton(env: Environment, table: CompatTable) -> Check:
    t = env.torch
    pin = t.requires.get("triton") or t.requires.get("pytorch-triton") or t.requires.get("pytorch-triton-rocm")
    if pin:
        want = pin.lstrip("=")
        if not env.triton_version:
            return Check(
                "triton",
                "fail",
                f"torch {t.version} requires triton{pin} (Requires-Dist) but triton is not installed",
                fix=f'pip install "triton{pin}"',
                source="torch wheel metadata (importlib.metadata.requires('torch'))",
            )
        ok = _spec_ok(env.triton_version, pin)
        if ok is False:
            return Check(
                "triton",
                "fail",
                f"{env.triton_dist} {env.triton_version} does not satisfy torch's pin triton{pin}",
                detail="torch.compile / inductor kernels fail to build with a mismatched Triton",
                fix=f'pip install "triton=={want}"',
                source="torch wheel metadata",
            )
        return Check(
            "triton",
            "pass",
            f"{env.triton_dist} {env.triton_version} satisfies torch's pin triton{pin}",
            source="torch wheel metadata",
        )
    if not env.triton_version:
        return Check("triton", "skip", f"torch {t.version} does not require Triton here and none is installed")
    row = table.triton_for(t.version or "")
    if row and not t.cuda:  # a CPU build: Inductor generates C++, Triton is not used (the pin is the CUDA wheels')
        return Check(
            "triton",
            "pass",
            f"{env.triton_dist} {env.triton_version} installed; this CPU build of torch does not use it "
            f"(torch {row['torch']}'s CUDA wheels pin triton {row['triton']})",
            source=row["source"],
        )
    if row and major_minor(row["triton"]) != major_minor(env.triton_version):
        return Check(
            "triton",
            "warn",
            f"{env.triton_dist} {env.triton_version} installed; torch {row['torch']} wheels pin triton {row['triton']}",
            fix=f'pip install "triton=={row["triton"]}"  # or uninstall it if unused',
            source=row["source"],
        )
    return Check("triton", "pass", f"{env.triton_dist} {env.triton_version} installed (not pinned by this torch build)")


_SYS_LIB_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib")


def check_env_libs(env: Environment, table: CompatTable) -> Check:
    """Conda-vs-venv mixing: the classic source of ``undefined symbol`` / ``GLIBCXX_x not found``."""
    problems, fixes = [], []
    in_venv = env.sys_prefix != env.base_prefix
    prefix = os.path.realpath(env.sys_prefix) if env.sys_prefix else ""
    conda = os.path.realpath(env.conda_prefix) if env.conda_prefix else None
    if conda and in_venv and not prefix.startswith(conda):
        problems.append(f"conda env {env.conda_prefix} is active while Python runs from venv {env.sys_prefix}")
        fixes.append("conda deactivate")
    conda_libs = [p for p in env.ld_library_path if ("conda" in p or "/envs/" in p) and not os.path.realpath(p).startswith(prefix or "\0")]
    if conda_libs:
        problems.append("LD_LIBRARY_PATH puts another environment's libraries first: " + ", ".join(conda_libs))
        fixes.append('export LD_LIBRARY_PATH=$(echo "$LD_LIBRARY_PATH" | tr ":" "\\n" | grep -v -e conda -e /envs/ | paste -sd:)')
    foreign = [p for p in env.loaded_libs if not p.startswith(_SYS_LIB_DIRS) and not os.path.realpath(p).startswith(prefix or "\0")]
    if foreign:
        problems.append("this process loaded runtime libraries from outside its environment: " + ", ".join(foreign))
        fixes.append("remove the directory of those libraries from LD_LIBRARY_PATH / LD_PRELOAD")
    for probe_name, probe in (
        ("import torch_npu", env.torch_npu_import),
        ("import torch (autoload on)", env.autoload_import),
    ):
        if probe is not None and not probe.ok and _UNDEF_RE.search(probe.stderr):
            problems.append(f"`{probe_name}`: {_UNDEF_RE.search(probe.stderr).group(0)}")
            fixes.append("reinstall torch and its extensions in one environment: pip install --force-reinstall torch torch-npu")
    kind = "venv" if in_venv else ("conda" if conda and prefix.startswith(conda) else "system")
    if problems:
        return Check(
            "env_libs",
            "fail" if any("undefined symbol" in p for p in problems) else "warn",
            "; ".join(problems),
            fix=" && ".join(dict.fromkeys(fixes)),
        )
    return Check("env_libs", "pass", f"{kind} Python at {env.sys_prefix}; no foreign runtime libraries on the search path")


def check_autoload(env: Environment, table: CompatTable) -> Check:
    """torch >= 2.5 imports every ``torch.backends`` entry point (torch_npu registers one) on ``import torch``."""
    tv = version_tuple(env.torch.version or "0")
    eps = env.backend_entry_points
    if tv < (2, 5):
        return Check("autoload", "skip", f"torch {env.torch.version} predates device-backend autoloading (2.5)")
    if not eps:
        return Check("autoload", "pass", "no torch.backends entry points installed; TORCH_DEVICE_BACKEND_AUTOLOAD not needed")
    setting = f"TORCH_DEVICE_BACKEND_AUTOLOAD={env.autoload_env}" if env.autoload_env is not None else "TORCH_DEVICE_BACKEND_AUTOLOAD unset"
    if env.autoload_import is not None and not env.autoload_import.ok:
        if env.autoload_env == "0":
            return Check("autoload", "pass", f"autoloading {', '.join(eps)} breaks `import torch`, and {setting} disables it")
        return Check(
            "autoload",
            "fail",
            f"`import torch` fails while autoloading {', '.join(eps)} ({setting})",
            detail=(env.autoload_import.stderr.strip().splitlines() or ["no output"])[-1][:300],
            fix="export TORCH_DEVICE_BACKEND_AUTOLOAD=0  # then fix the backend (see the torch_npu and cann checks)",
        )
    if env.autoload_env == "0":
        return Check(
            "autoload",
            "warn",
            f"{setting}, but autoloading {', '.join(eps)} works; torch_npu must be imported explicitly",
            fix="unset TORCH_DEVICE_BACKEND_AUTOLOAD",
        )
    return Check("autoload", "pass", f"autoloading {', '.join(eps)} works ({setting})")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory(env: Environment, table: CompatTable) -> Check:
    if not env.memory:
        return Check("device_memory", "warn", f"no memory reading ({env.backend_reason or 'no source'})")
    lines, low = [], []
    for m in env.memory:
        ratio = m.free_bytes / m.total_bytes if m.total_bytes else 0.0
        lines.append(f"{m.label}: {_gib(m.free_bytes)} free of {_gib(m.total_bytes)} ({ratio:.0%}, {m.source})")
        if ratio < LOW_FREE_RATIO:
            low.append(m.label)
    head = f"backend {env.backend}: " if env.backend else ""
    if low:
        return Check(
            "device_memory",
            "warn",
            head + "; ".join(lines),
            detail=f"below {LOW_FREE_RATIO:.0%} free: {', '.join(low)}",
            fix="find the holders: npu-smi info / nvidia-smi --query-compute-apps=pid,used_memory --format=csv; stop stale processes",
        )
    return Check("device_memory", "pass", head + "; ".join(lines))
