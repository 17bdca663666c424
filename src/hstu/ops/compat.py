"""The known-good compatibility table shipped as ``compat.toml``: loading, validation, look-ups.

Tables (each row cites its ``source``):

=====================  ===========================================================================
``torch``              torch minor -> python_min, python_max, CUDA builds (PyTorch RELEASE.md)
``triton``             torch minor -> triton pinned by the wheel (fallback to torch's metadata)
``torch_npu``          CANN release -> (torch, torch_npu) pairs (Ascend Extension release notes)
``cann_driver``        CANN release -> oldest Ascend HDK driver it is paired with
``cuda_driver``        CUDA major -> minimum driver under minor-version compatibility (NVIDIA)
``cuda_toolkit_driver``  CUDA minor -> driver of the toolkit's GA release (full features)
=====================  ===========================================================================
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hstu.ops._common import ascend_release, ascend_version_key, base_version, load_document, major_minor, version_tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_SCHEMA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "torch": {"torch": str, "python_min": str, "python_max": str, "cuda": list, "source": str},
    "triton": {"torch": str, "triton": str, "source": str},
    "torch_npu": {"cann": str, "torch": str, "torch_npu": str, "source": str},
    "cann_driver": {"cann": str, "min_hdk": str, "source": str},
    "cuda_driver": {"cuda_major": int, "min_driver": str, "source": str},
    "cuda_toolkit_driver": {"cuda": str, "min_driver": str, "source": str},
}


@dataclass(frozen=True)
class CompatTable:
    """Validated rows of ``compat.toml`` keyed by table name (list of dicts, as in the file)."""

    tables: dict[str, list[dict[str, Any]]]
    path: str

    # ---- look-ups ---------------------------------------------------------------------------------------
    def torch_row(self, torch_version: str) -> dict[str, Any] | None:
        mm = major_minor(torch_version)
        return next((r for r in self.tables["torch"] if r["torch"] == mm), None)

    def torch_minors(self) -> list[str]:
        return [r["torch"] for r in self.tables["torch"]]

    def triton_for(self, torch_version: str) -> dict[str, Any] | None:
        mm = major_minor(torch_version)
        return next((r for r in self.tables["triton"] if r["torch"] == mm), None)

    def npu_rows_for_cann(self, cann: str) -> list[dict[str, Any]]:
        key = ascend_version_key(ascend_release(cann))
        return [r for r in self.tables["torch_npu"] if ascend_version_key(r["cann"]) == key]

    def npu_rows_for_torch(self, torch_version: str) -> list[dict[str, Any]]:
        bv = base_version(torch_version)
        return [r for r in self.tables["torch_npu"] if r["torch"] == bv]

    def cann_driver_row(self, cann: str) -> dict[str, Any] | None:
        key = ascend_version_key(ascend_release(cann))
        return next((r for r in self.tables["cann_driver"] if ascend_version_key(r["cann"]) == key), None)

    def cuda_driver_row(self, cuda_version: str) -> dict[str, Any] | None:
        vt = version_tuple(cuda_version)
        if not vt:
            return None
        return next((r for r in self.tables["cuda_driver"] if r["cuda_major"] == vt[0]), None)

    def cuda_toolkit_row(self, cuda_version: str) -> dict[str, Any] | None:
        mm = major_minor(cuda_version)
        return next((r for r in self.tables["cuda_toolkit_driver"] if r["cuda"] == mm), None)


def validate(data: dict[str, Any], path: str) -> CompatTable:
    """Check ``data`` against the schema; raise ValueError naming file, table, row and field."""
    if data.get("schema_version") != 1:
        raise ValueError(f"{path}: schema_version must be 1, got {data.get('schema_version')!r}")
    unknown = set(data) - set(_SCHEMA) - {"schema_version"}
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {sorted(unknown)}; valid: {sorted(_SCHEMA)}")
    tables: dict[str, list[dict[str, Any]]] = {}
    for name, fields in _SCHEMA.items():
        rows = data.get(name, [])
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{path}: table [[{name}]] is missing or empty")
        for i, row in enumerate(rows):
            where = f"{path}: [[{name}]] row {i + 1}"
            missing = set(fields) - set(row)
            if missing:
                raise ValueError(f"{where}: missing field(s) {sorted(missing)}")
            extra = set(row) - set(fields)
            if extra:
                raise ValueError(f"{where}: unknown field(s) {sorted(extra)}")
            for key, typ in fields.items():
                if not isinstance(row[key], typ) or isinstance(row[key], bool):
                    raise ValueError(f"{where}: field {key!r} must be {typ.__name__}, got {row[key]!r}")
            if not row["source"].strip():
                raise ValueError(f"{where}: empty source")
            for key in ("cann", "min_hdk"):
                if key in row:
                    ascend_version_key(row[key])  # raises ValueError on a malformed version
        tables[name] = list(rows)
    return CompatTable(tables=tables, path=path)


def load_compat(path: str | Path | None = None) -> CompatTable:
    """Load and validate the table (the packaged ``compat.toml`` when ``path`` is None).

    Raises ValueError (bad content) or OSError (unreadable file).
    """
    data, where = load_document(path, "compat.toml", tomllib.loads, "TOML", tomllib.TOMLDecodeError)
    return validate(data, where)
