"""hstu doctor: the compatibility table's schema, each check on synthetic environments and fixture
install trees, and a real run on this host (a CPU host in CI, reported as such)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from hstu.ops import doctor
from hstu.ops.compat import load_compat
from hstu.ops.doctor import DeviceMemory, Environment
from hstu.ops.probes import AscendInstall, ImportProbe, NvidiaDriver, TorchInfo, probe_ascend

FIX = Path(__file__).parent / "fixtures" / "ops" / "versions"
TABLE = load_compat()


def by_name(checks):
    return {c.name: c for c in checks}


def env(**kw) -> Environment:
    base = Environment(python_version="3.11.7", sys_prefix="/srv/venv", base_prefix="/usr", torch=TorchInfo(version="2.4.0", cuda=None))
    return replace(base, **kw)


# ------------------------------------------------------------------------------------------ table


def test_compat_table_schema_and_sources():
    for name, rows in TABLE.tables.items():
        assert rows, name
        for row in rows:
            assert row["source"].strip(), (name, row)
    # every torch_npu row keeps torch_npu's release segment equal to torch's (the rule doctor enforces)
    for row in TABLE.tables["torch_npu"]:
        assert row["torch_npu"].split(".post")[0] == row["torch"], row
    # every CANN with torch_npu rows has a driver row
    canns = {r["cann"] for r in TABLE.tables["torch_npu"]}
    assert canns <= {r["cann"] for r in TABLE.tables["cann_driver"]}


@pytest.mark.parametrize(
    "text,match",
    [
        ("schema_version = 2\n", "schema_version"),
        ("schema_version = 1\n[[bogus]]\nx = 1\n", "unknown table"),
        ('schema_version = 1\n[[torch]]\ntorch = "2.4"\n', r"\[\[torch\]\] row 1: missing field"),
        ("schema_version = 1\nthis is not toml", "invalid TOML"),
    ],
)
def test_compat_table_rejects_bad_files(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_compat(f)


def test_compat_table_rejects_bad_cann_version(tmp_path):
    src = (Path(doctor.__file__).parent / "compat.toml").read_text()
    f = tmp_path / "c.toml"
    f.write_text(src.replace('cann = "8.0.RC1"\nmin_hdk', 'cann = "latest"\nmin_hdk', 1))
    with pytest.raises(ValueError, match="not an Ascend version"):
        load_compat(f)


# ------------------------------------------------------------------------------------------ Ascend


def test_probe_ascend_reads_fixture_install_tree():
    a = probe_ascend((FIX / "ascend_8.0.RC3",), use_env=False)
    assert a.cann_version == "8.0.RC3"
    assert a.cann_file.endswith("aarch64-linux/ascend_toolkit_install.info")
    assert a.driver_version == "24.1.rc2.b030" and a.driver_release == "24.1.RC2"
    assert a.firmware_version == "7.3.0.1.231"
    b = probe_ascend((FIX / "ascend_8.5.0",), use_env=False)  # newer cann-<ver> layout, no firmware file
    assert (b.cann_version, b.driver_release, b.firmware_version) == ("8.5.0", "25.3.RC1", None)
    none = probe_ascend((FIX / "does-not-exist",), use_env=False)
    assert none.cann_version is None and none.driver_version is None and none.searched


def test_ascend_driver_older_than_cann_needs_fails_with_fix():
    e = env(torch_npu_version="2.4.0", ascend=probe_ascend((FIX / "ascend_8.0.RC3",), use_env=False))
    c = by_name(doctor.run_checks(e, TABLE))
    assert c["torch_npu"].status == "pass"
    assert c["cann"].status == "pass" and "8.0.RC3" in c["cann"].summary  # 8.0.RC3 pairs with torch_npu 2.4.0
    assert c["npu_driver"].status == "fail"
    assert "24.1.RC3" in c["npu_driver"].fix and "24.1.rc2.b030" in c["npu_driver"].summary
    assert "7.3.0.1.231" in c["npu_driver"].summary


def test_ascend_new_layout_all_pass():
    e = env(
        torch=TorchInfo(version="2.9.0"),
        torch_npu_version="2.9.0",
        python_version="3.11.2",
        ascend=probe_ascend((FIX / "ascend_8.5.0",), use_env=False),
    )
    c = by_name(doctor.run_checks(e, TABLE))
    assert (c["torch_npu"].status, c["cann"].status, c["npu_driver"].status) == ("pass", "pass", "pass")
    assert c["cann"].source and c["npu_driver"].source
    s = c["npu_driver"].summary  # the comparison reads whole, the firmware after it (a trial: "firmware ... not found >= ...")
    assert re.fullmatch(r"NPU driver \S+ \(from .+\) >= \S+ required by CANN 8\.5\.0 \(firmware (\S+|version not found)\)", s), s


def test_torch_npu_must_match_torch_exactly():
    e = env(torch=TorchInfo(version="2.4.0"), torch_npu_version="2.3.1.post2", ascend=AscendInstall(cann_version="8.0.RC3"))
    c = by_name(doctor.run_checks(e, TABLE))["torch_npu"]
    assert c.status == "fail" and "requires torch 2.3.1 exactly" in c.summary
    assert 'torch-npu==2.4.0"' in c.fix  # the 2.4.0 build paired with the installed CANN 8.0.RC3


def test_cann_that_does_not_list_torch_npu_fails():
    e = env(torch=TorchInfo(version="2.6.0"), torch_npu_version="2.6.0", ascend=AscendInstall(cann_version="8.0.RC3"))
    c = by_name(doctor.run_checks(e, TABLE))["cann"]
    assert c.status == "fail" and "torch 2.4.0 + torch_npu 2.4.0" in c.summary
    assert c.fix.startswith('pip install "torch==')


def test_cann_pairs_another_post_release_warns():
    e = env(torch=TorchInfo(version="2.1.0"), torch_npu_version="2.1.0.post3", ascend=AscendInstall(cann_version="8.0.RC3"))
    c = by_name(doctor.run_checks(e, TABLE))["cann"]
    assert c.status == "warn" and c.fix == 'pip install "torch-npu==2.1.0.post8"'


def test_torch_npu_without_cann_fails_and_import_error_is_explained():
    stderr = "ImportError: /x/libtorch_npu.so: undefined symbol: _ZN3c104impl3cowE\n"
    e = env(torch_npu_version="2.4.0", torch_npu_import=ImportProbe(False, 1, "", stderr))
    c = by_name(doctor.run_checks(e, TABLE))
    assert c["cann"].status == "fail" and "set_env.sh" in c["cann"].fix
    assert c["torch_npu"].status == "fail" and "undefined symbol _ZN3c104impl3cowE" in c["torch_npu"].summary
    assert c["env_libs"].status == "fail"  # undefined symbol is also reported as a library mix-up


def test_autoload():
    failing = ImportProbe(False, 1, "", "RuntimeError: Failed to load the backend extension: torch_npu.")
    base = dict(torch=TorchInfo(version="2.6.0"), backend_entry_points=["torch_npu"], autoload_import=failing)
    c = by_name(doctor.run_checks(env(**base), TABLE))["autoload"]
    assert c.status == "fail" and c.fix.startswith("export TORCH_DEVICE_BACKEND_AUTOLOAD=0")
    assert by_name(doctor.run_checks(env(**base, autoload_env="0"), TABLE))["autoload"].status == "pass"
    ok = dict(base, autoload_import=ImportProbe(True, 0, "", ""))
    c = by_name(doctor.run_checks(env(**ok, autoload_env="0"), TABLE))["autoload"]
    assert c.status == "warn" and c.fix == "unset TORCH_DEVICE_BACKEND_AUTOLOAD"
    assert by_name(doctor.run_checks(env(), TABLE))["autoload"].status == "skip"  # torch 2.4 predates autoload


# ------------------------------------------------------------------------------------------ CUDA / Triton


@pytest.mark.parametrize(
    "driver,status",
    [("470.82.01", "fail"), ("535.104.05", "warn"), ("550.54.15", "pass")],
)
def test_cuda_driver_vs_torch_runtime(driver, status):
    # torch 2.4 + CUDA 12.4: needs >= 525.60.13 (minor-version compat), full features from 550.54.14
    e = env(
        torch=TorchInfo(version="2.4.0+cu124", cuda="12.4"),
        nvidia=NvidiaDriver(driver, "12.4", "nvml", ["NVIDIA H100 80GB HBM3"]),
    )
    c = by_name(doctor.run_checks(e, TABLE))["cuda"]
    assert c.status == status, c
    if status != "pass":
        assert c.fix and c.source


def test_cpu_torch_on_gpu_host_warns_and_runtime_wheel_mismatch_fails():
    e = env(nvidia=NvidiaDriver("550.54.15", "12.4", "nvidia-smi", ["NVIDIA A10"]))
    c = by_name(doctor.run_checks(e, TABLE))["cuda"]
    assert c.status == "warn" and "download.pytorch.org/whl/cu" in c.fix
    e = env(
        torch=TorchInfo(version="2.4.0", cuda="12.1"),
        cuda_runtime_pkgs={"nvidia-cuda-runtime-cu12": "12.4.127"},
        nvidia=NvidiaDriver("550.54.15", "12.4", "nvml"),
    )
    assert by_name(doctor.run_checks(e, TABLE))["cuda"].status == "fail"


def test_triton_pin_from_torch_metadata():
    t = TorchInfo(version="2.5.1", cuda="12.4", requires={"triton": "==3.1.0"})
    assert by_name(doctor.run_checks(env(torch=t, triton_dist="triton", triton_version="3.1.0"), TABLE))["triton"].status == "pass"
    c = by_name(doctor.run_checks(env(torch=t, triton_dist="triton", triton_version="3.0.0"), TABLE))["triton"]
    assert c.status == "fail" and c.fix == 'pip install "triton==3.1.0"'
    assert by_name(doctor.run_checks(env(torch=t), TABLE))["triton"].status == "fail"
    assert by_name(doctor.run_checks(env(), TABLE))["triton"].status == "skip"
    # a CUDA torch without the pin in its metadata (e.g. a conda build) and a stray triton: compared with the table's pin
    cuda = TorchInfo(version="2.4.0", cuda="12.1")
    c = by_name(doctor.run_checks(env(torch=cuda, triton_dist="triton", triton_version="2.3.1"), TABLE))["triton"]
    assert c.status == "warn" and "3.0.0" in c.fix
    # a CPU build: Triton is not used, so no downgrade is suggested (a trial: "torch 2.13 wheels pin triton 3.7.1")
    c = by_name(doctor.run_checks(env(triton_dist="triton", triton_version="2.3.1"), TABLE))["triton"]
    assert c.status == "pass" and c.fix is None and "this CPU build of torch does not use it" in c.summary


def test_python_outside_torch_range_fails():
    c = by_name(doctor.run_checks(env(python_version="3.13.1"), TABLE))["python"]  # torch 2.4: 3.8-3.12
    assert c.status == "fail" and "3.8-3.12" in c.summary
    c = by_name(doctor.run_checks(env(torch=TorchInfo(version="3.0.0")), TABLE))
    assert c["python"].status == "warn" and c["torch"].status == "warn"


# ------------------------------------------------------------------------------------------ libs, memory


def test_conda_and_venv_mixed():
    e = env(
        conda_prefix="/opt/conda/envs/old",
        ld_library_path=["/opt/conda/envs/old/lib", "/usr/local/cuda/lib64"],
        loaded_libs=["/opt/conda/envs/old/lib/libstdc++.so.6.0.29", "/usr/lib/x86_64-linux-gnu/libgomp.so.1"],
    )
    c = by_name(doctor.run_checks(e, TABLE))["env_libs"]
    assert c.status == "warn"
    assert "conda env /opt/conda/envs/old is active" in c.summary
    assert "/opt/conda/envs/old/lib/libstdc++.so.6.0.29" in c.summary
    assert "libgomp" not in c.summary  # system directories are fine
    assert "conda deactivate" in c.fix


def test_low_device_memory_warns():
    gib = 2**30
    e = env(memory=[DeviceMemory("npu 0/0 910B3", 3 * gib, 64 * gib, "npu-smi info")], backend="npu")
    c = by_name(doctor.run_checks(e, TABLE))["device_memory"]
    assert c.status == "warn" and "3.0 GiB free of 64.0 GiB (5%" in c.summary and c.fix


def test_render_and_exit_code():
    checks = doctor.run_checks(env(python_version="3.13.0"), TABLE)
    text = doctor.render_text(checks)
    assert "FAIL  python" in text and "fix: use Python 3.12" in text
    assert doctor.exit_code(checks) == 1
    doc = json.loads(doctor.render_json(checks, env()))
    assert {c["name"] for c in doc["checks"]} >= {
        "python",
        "torch",
        "torch_npu",
        "cann",
        "npu_driver",
        "cuda",
        "triton",
        "env_libs",
        "autoload",
        "device_memory",
    }
    assert doc["environment"]["python_version"] == "3.11.7"


# ------------------------------------------------------------------------------------------ this host


def test_real_host_report(capsys):
    import platform

    import psutil
    import torch

    from hstu.ops.cli import main

    rc = main(["doctor", "--json", "--no-import-probes"])
    doc = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in doc["checks"]}
    assert rc == (1 if any(c["status"] == "fail" for c in doc["checks"]) else 0)
    assert checks["python"]["summary"].startswith(f"Python {platform.python_version()}")
    assert torch.__version__ in checks["torch"]["summary"]
    envd = doc["environment"]
    if torch.version.cuda is None and not envd["torch_npu_version"]:  # a CPU host, like CI
        assert checks["torch_npu"]["status"] == "skip"
        assert envd["backend"] == "cpu"
        mem = envd["memory"][0]
        assert mem["label"] == "cpu (host)"
        assert mem["total_bytes"] == psutil.virtual_memory().total
        assert 0 < mem["free_bytes"] <= mem["total_bytes"]
        assert checks["device_memory"]["status"] in ("pass", "warn")


def test_a_missing_compat_file_names_the_flag(tmp_path, capsys):
    """`hstu doctor --compat nope.toml` printed the raw errno ("[Errno 2] No such file or directory: ...")."""
    from hstu.ops.cli import main

    assert main(["doctor", "--compat", str(tmp_path / "nope.toml"), "--no-import-probes"]) == 2
    assert capsys.readouterr().err.strip() == f"hstu doctor: --compat {tmp_path / 'nope.toml'}: No such file or directory"


def test_a_missing_ascend_root_is_refused(tmp_path, capsys):
    """`hstu doctor --ascend-root /nonexistent` said "SKIP cann: not an Ascend host" and exited 0: a mistyped root
    went unnoticed."""
    from hstu.cli import main

    assert main(["doctor", "--ascend-root", str(tmp_path / "nope"), "--no-import-probes"]) == 2
    assert f"--ascend-root {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
