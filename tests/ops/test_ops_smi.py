"""npu-smi / nvidia-smi parsers against hand-written fixture outputs (values read off the fixtures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hstu.ops._common import (
    ascend_release,
    ascend_version_key,
    base_version,
    format_prom_duration,
    parse_duration,
    parse_quantity,
    read_kv_file,
)
from hstu.ops.smi import (
    parse_npu_smi_info,
    parse_npu_smi_usages,
    parse_nvidia_smi_header,
    parse_nvidia_smi_query,
)

FIX = Path(__file__).parent / "fixtures" / "ops"
MIB = 1 << 20


def read(name: str) -> str:
    return (FIX / "smi" / name).read_text()


def test_npu_smi_910b_two_chips_and_process_table():
    info = parse_npu_smi_info(read("npu_smi_info_910b.txt"))
    assert info.version == "24.1.rc3"
    assert [(c.npu_id, c.chip_id, c.name, c.health) for c in info.chips] == [
        (0, 0, "910B3", "OK"),
        (1, 0, "910B3", "Warning"),
    ]
    c0, c1 = info.chips
    assert c0.bus_id == "0000:C1:00.0"
    assert c0.power_watts == pytest.approx(95.1) and c0.temperature_celsius == 41
    assert c0.aicore_ratio == pytest.approx(0.37)
    # "52791/ 65536" (no space before the slash) is HBM used/total in MB (MiB)
    assert c0.hbm_used_bytes == 52791 * MIB and c0.hbm_total_bytes == 65536 * MIB
    assert c0.memory_used_bytes == 0 and c0.memory_total_bytes == 0
    assert c0.device_memory == (52791 * MIB, 65536 * MIB)  # HBM preferred over the empty DDR pair
    assert c1.temperature_celsius == 78 and c1.aicore_ratio == pytest.approx(0.99)
    assert info.processes == [{"npu_id": 0, "chip_id": 0, "pid": 171423, "name": "python3.10", "memory_bytes": 49505 * MIB}]


def test_npu_smi_910a_na_readings_are_none():
    info = parse_npu_smi_info(read("npu_smi_info_910a.txt"))
    assert info.version == "22.0.4"
    c0, c1 = info.chips
    assert c0.memory_used_bytes == 2289 * MIB and c0.memory_total_bytes == 15039 * MIB
    assert c0.hbm_used_bytes == 0 and c0.hbm_total_bytes == 32768 * MIB
    assert c0.device_memory == (0, 32768 * MIB)
    assert c1.health == "Critical"
    assert c1.power_watts is None and c1.temperature_celsius is None and c1.aicore_ratio is None


def test_npu_smi_310p_device_column_and_ddr_only():
    info = parse_npu_smi_info(read("npu_smi_info_310p.txt"))
    (c,) = info.chips
    assert (c.npu_id, c.chip_id, c.device_id, c.name) == (8, 0, 0, "310P3")
    assert c.power_watts is None and c.temperature_celsius == 46
    assert c.hbm_total_bytes is None
    assert c.device_memory == (1782 * MIB, 21527 * MIB)


def test_npu_smi_garbage_gives_no_chips():
    info = parse_npu_smi_info("command not found\n| random | table |\n")
    assert info.chips == [] and info.version is None


def test_npu_smi_usages():
    u = parse_npu_smi_usages(read("npu_smi_usages_910b.txt"))
    assert u["HBM Bandwidth Usage Rate(%)"] == 88
    assert u["Aicore Usage Rate(%)"] == 37
    assert u["HBM Capacity(MB)"] == 65536


def test_nvidia_smi_query_csv_with_unsupported_fields():
    gpus = parse_nvidia_smi_query(read("nvidia_smi_query.csv"))
    assert [g.index for g in gpus] == [0, 1, 2]
    g0, _, g2 = gpus
    assert g0.name == "NVIDIA H100 80GB HBM3" and g0.driver_version == "550.54.15"
    assert g0.memory_total_bytes == 81559 * MIB and g0.memory_used_bytes == 76012 * MIB
    assert g0.utilization_ratio == pytest.approx(0.37) and g0.memory_utilization_ratio == pytest.approx(0.91)
    assert g0.temperature_celsius == 71 and g0.power_watts == pytest.approx(512.35)
    assert g2.utilization_ratio is None and g2.memory_utilization_ratio is None  # [N/A]
    assert g2.power_watts is None and g2.power_limit_watts == 150  # [Not Supported]


def test_nvidia_smi_banner():
    assert parse_nvidia_smi_header(read("nvidia_smi.txt")) == {"driver": "550.54.15", "cuda": "12.4"}
    assert parse_nvidia_smi_header("no banner") == {}


@pytest.mark.parametrize(
    "text,seconds",
    [("30s", 30), ("1m30s", 90), ("500ms", 0.5), ("2h", 7200), ("0", 0), (15, 15), ("1.5s", 1.5), ("1d", 86400)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "30x", "s30", "-1", "1m 30s", True])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError, match="field-x"):
        parse_duration(bad, field="field-x")


def test_format_prom_duration_round_trip():
    for s in (0, 1, 30, 60, 90, 0.5, 1.25):
        assert parse_duration(format_prom_duration(s)) == pytest.approx(s)


@pytest.mark.parametrize(
    "text,value",
    [
        ("0.85", 0.85),
        ("85%", 0.85),
        ("8GB/s", 8e9),
        ("8 GB/s", 8e9),
        ("2GiB", 2 * 2**30),
        ("200", 200),
        ("1e3", 1000),
        ("512MiB", 512 * MIB),
        ("3k", 3000),
        ("10/s", 10),
    ],
)
def test_parse_quantity(text, value):
    assert parse_quantity(text) == pytest.approx(value)


def test_parse_quantity_rejects():
    with pytest.raises(ValueError, match="8XB"):
        parse_quantity("8XB")


def test_ascend_version_order():
    order = ["7.0.0", "8.0.RC1", "8.0.RC2", "8.0.RC3", "8.0.0", "8.1.RC1", "8.5.0", "9.0.0"]
    keys = [ascend_version_key(v) for v in order]
    assert keys == sorted(keys)
    assert ascend_version_key("24.1.rc3.b999") == ascend_version_key("24.1.RC3")
    assert ascend_version_key("8.0.RC3.beta1") == ascend_version_key("8.0.RC3")
    assert ascend_release("24.1.rc2.b030") == "24.1.RC2"
    assert ascend_release("25.3.0") == "25.3.0"
    with pytest.raises(ValueError):
        ascend_version_key("latest")


def test_base_version_and_kv_file(tmp_path):
    assert base_version("2.1.0.post10") == "2.1.0" and base_version("2.13.0+cpu") == "2.13.0"
    f = tmp_path / "version.info"
    f.write_text("# comment\nVersion=24.1.rc3\npath: /x\n\nbroken line\n")
    assert read_kv_file(f) == {"version": "24.1.rc3", "path": "/x"}
    assert read_kv_file(tmp_path / "absent") == {}
