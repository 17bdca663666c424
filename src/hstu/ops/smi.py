"""Parsers for ``npu-smi`` and ``nvidia-smi`` text output, plus the calls that produce it.

``npu-smi info`` (Ascend HDK) prints a box table, two rows per chip::

    | NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
    | Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
    | 0     910B3               | OK            | 95.1        41                0    / 0             |
    | 0                         | 0000:C1:00.0  | 37          0    / 0          52791/ 65536         |

The first row holds NPU id, name, health, power (W), temperature (C), huge pages; the second holds
chip id (and on 310P the logical device id), bus id, AI Core utilisation (%), DDR memory used/total
(MB) and, on 910-class chips, HBM used/total (MB). ``NA`` marks an unsupported reading.
Source: Ascend HDK "npu-smi Command Reference", ``info`` and ``info -t usages``.

``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` is NVIDIA's stable machine interface
(``nvidia-smi --help-query-gpu``); memory is in MiB, power in W, utilisation in %.

All parse functions take text and raise nothing on odd lines: rows they cannot read are skipped
and logged at DEBUG. Memory is returned in bytes (MB in these tools means MiB = 2**20 bytes).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from hstu.ops._common import run_command

log = logging.getLogger(__name__)

MIB = 2**20


@dataclass
class NpuChip:
    """One Ascend chip as reported by ``npu-smi info``; None where the tool printed NA."""

    npu_id: int
    chip_id: int
    name: str
    health: str
    bus_id: str | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    aicore_ratio: float | None = None  # 0..1
    memory_used_bytes: int | None = None  # DDR ("Memory-Usage")
    memory_total_bytes: int | None = None
    hbm_used_bytes: int | None = None
    hbm_total_bytes: int | None = None
    device_id: int | None = None  # logical device id (310P "Device" column)
    extra: dict[str, float] = field(default_factory=dict)  # from ``info -t usages``

    @property
    def device_memory(self) -> tuple[int, int] | None:
        """(used, total) bytes of the memory models run in: HBM where present, else DDR."""
        if self.hbm_total_bytes:
            return self.hbm_used_bytes or 0, self.hbm_total_bytes
        if self.memory_total_bytes:
            return self.memory_used_bytes or 0, self.memory_total_bytes
        return None


@dataclass
class NpuSmiInfo:
    version: str | None
    chips: list[NpuChip]
    processes: list[dict[str, object]]


def _num(tok: str) -> float | None:
    try:
        return float(tok)
    except ValueError:
        return None


_PAIR_RE = re.compile(r"(\d+)\s*/\s*(\d+)")
_VERSION_RE = re.compile(r"npu-smi\s+(\S+)\s+Version:\s*(\S+)", re.IGNORECASE)


def parse_npu_smi_info(text: str) -> NpuSmiInfo:
    """Parse ``npu-smi info`` output (910A, 910B/C, 310P layouts). Returns chips in printed order."""
    version = None
    m = _VERSION_RE.search(text)
    if m:
        version = m.group(2)
    chips: list[NpuChip] = []
    processes: list[dict[str, object]] = []
    pending: list[str] | None = None  # cells of an NPU row waiting for its chip row
    in_process_table = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        head = cells[0]
        if head.startswith("NPU") and len(cells) >= 3 and "Process id" in line:
            in_process_table = True
            continue
        if head.startswith(("NPU", "Chip", "npu-smi")) or head.startswith("No running"):
            continue
        if in_process_table:
            toks = head.split()
            if len(cells) >= 4 and len(toks) >= 2 and toks[0].isdigit():
                mem = _num(cells[3].split()[0]) if cells[3].split() else None
                processes.append(
                    {
                        "npu_id": int(toks[0]),
                        "chip_id": int(toks[1]),
                        "pid": int(cells[1]) if cells[1].isdigit() else cells[1],
                        "name": cells[2],
                        "memory_bytes": int(mem * MIB) if mem is not None else None,
                    }
                )
            continue
        if len(cells) < 3:
            continue
        toks = head.split()
        if not toks or not toks[0].isdigit():
            continue
        if ":" not in cells[1]:
            pending = cells  # NPU row: "<id> <name>" | health | ...; chip rows carry a bus id
            continue
        if pending is None:
            log.debug("npu-smi: chip row without NPU row skipped: %s", line)
            continue
        npu_toks = pending[0].split()
        first = pending[2].split()  # power, temperature, huge pages "used / total" (not exported)
        chip = NpuChip(
            npu_id=int(npu_toks[0]),
            chip_id=int(toks[0]),
            device_id=int(toks[1]) if len(toks) > 1 and toks[1].isdigit() else None,
            name=" ".join(npu_toks[1:]),
            health=pending[1],
            bus_id=cells[1] or None,
            power_watts=_num(first[0]) if first else None,
            temperature_celsius=_num(first[1]) if len(first) > 1 else None,
        )
        second = cells[2]
        aicore_tok = second.split()[0] if second.split() else "NA"
        aicore = _num(aicore_tok)
        chip.aicore_ratio = aicore / 100.0 if aicore is not None else None
        pairs = [(int(a), int(b)) for a, b in _PAIR_RE.findall(second)]
        if pairs:
            chip.memory_used_bytes, chip.memory_total_bytes = pairs[0][0] * MIB, pairs[0][1] * MIB
        if len(pairs) > 1:
            chip.hbm_used_bytes, chip.hbm_total_bytes = pairs[1][0] * MIB, pairs[1][1] * MIB
        chips.append(chip)
        pending = None
    return NpuSmiInfo(version=version, chips=chips, processes=processes)


_USAGE_RE = re.compile(r"^\s*(.+?)\s*:\s*(\S+)\s*$")


def parse_npu_smi_usages(text: str) -> dict[str, float]:
    """Parse ``npu-smi info -t usages -i N`` ("Key(unit) : value" lines) into {key: value}.

    Keys keep the tool's spelling, e.g. ``"HBM Bandwidth Usage Rate(%)"``; non-numeric values are dropped.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _USAGE_RE.match(line)
        if not m:
            continue
        v = _num(m.group(2))
        if v is not None:
            out[m.group(1)] = v
    return out


NVIDIA_QUERY_FIELDS = (
    "index",
    "name",
    "driver_version",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "utilization.memory",
    "temperature.gpu",
    "power.draw",
    "power.limit",
)


@dataclass
class GpuReading:
    index: int
    name: str
    driver_version: str | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    utilization_ratio: float | None = None  # 0..1, "GPU-Util": time a kernel was running
    memory_utilization_ratio: float | None = None  # 0..1, time device memory was read or written
    temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    pcie_tx_bytes_per_second: float | None = None  # device -> host
    pcie_rx_bytes_per_second: float | None = None  # host -> device


def _csv_num(tok: str) -> float | None:
    tok = tok.strip()
    if not tok or tok.startswith("[") or tok.upper() in ("N/A", "NA"):
        return None
    return _num(tok)


def parse_nvidia_smi_query(text: str) -> list[GpuReading]:
    """Parse ``nvidia-smi --query-gpu=<NVIDIA_QUERY_FIELDS> --format=csv,noheader,nounits``."""
    out: list[GpuReading] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(NVIDIA_QUERY_FIELDS) or not cells[0].isdigit():
            if line.strip():
                log.debug("nvidia-smi: unreadable row skipped: %s", line)
            continue
        mem_total, mem_used = _csv_num(cells[3]), _csv_num(cells[4])
        util, mutil = _csv_num(cells[5]), _csv_num(cells[6])
        out.append(
            GpuReading(
                index=int(cells[0]),
                name=cells[1],
                driver_version=cells[2] or None,
                memory_total_bytes=int(mem_total * MIB) if mem_total is not None else None,
                memory_used_bytes=int(mem_used * MIB) if mem_used is not None else None,
                utilization_ratio=util / 100.0 if util is not None else None,
                memory_utilization_ratio=mutil / 100.0 if mutil is not None else None,
                temperature_celsius=_csv_num(cells[7]),
                power_watts=_csv_num(cells[8]),
                power_limit_watts=_csv_num(cells[9]),
            )
        )
    return out


_NV_HEADER_RE = re.compile(r"NVIDIA-SMI\s+(?P<smi>\S+)\s+Driver Version:\s*(?P<driver>\S+)\s+CUDA Version:\s*(?P<cuda>\S+)")


def parse_nvidia_smi_header(text: str) -> dict[str, str]:
    """Driver and maximum CUDA (driver API) version from plain ``nvidia-smi`` output; {} if absent."""
    m = _NV_HEADER_RE.search(text)
    return {"driver": m.group("driver"), "cuda": m.group("cuda")} if m else {}


def npu_smi_info(timeout_s: float = 10.0) -> tuple[NpuSmiInfo | None, str | None]:
    """Run and parse ``npu-smi info``; return (info, None) or (None, reason)."""
    res = run_command(["npu-smi", "info"], timeout_s)
    if not res.ok:
        return None, res.error or f"npu-smi info exited {res.returncode}: {res.stderr.strip()[:200]}"
    return parse_npu_smi_info(res.stdout), None


def npu_smi_usages(npu_id: int, chip_id: int = 0, timeout_s: float = 10.0) -> dict[str, float]:
    """Run ``npu-smi info -t usages -i NPU -c CHIP``; {} when it fails."""
    res = run_command(["npu-smi", "info", "-t", "usages", "-i", str(npu_id), "-c", str(chip_id)], timeout_s)
    return parse_npu_smi_usages(res.stdout) if res.ok else {}


def nvidia_smi_query(timeout_s: float = 10.0) -> tuple[list[GpuReading] | None, str | None]:
    """Run and parse the nvidia-smi CSV query; return (readings, None) or (None, reason)."""
    res = run_command(["nvidia-smi", f"--query-gpu={','.join(NVIDIA_QUERY_FIELDS)}", "--format=csv,noheader,nounits"], timeout_s)
    if not res.ok:
        return None, res.error or f"nvidia-smi exited {res.returncode}: {res.stderr.strip()[:200]}"
    return parse_nvidia_smi_query(res.stdout), None
