"""``hstu doctor``: check this host's Python / torch / torch_npu / CANN / driver / CUDA / Triton stack
against the shipped known-good table (``compat.toml``) and print pass / warn / fail with the fix.

Two steps, so the checks are testable without the hardware (each step a module of its own;
every name is importable from here):

1. :func:`collect_environment` (:mod:`hstu.ops.doctor_env`) reads versions from their real sources
   (see :mod:`hstu.ops.probes`) into an :class:`Environment` (a plain dataclass; tests build one by hand
   or from fixture files).
2. :func:`run_checks` turns an Environment and a :class:`~hstu.ops.compat.CompatTable` into a list of
   :class:`Check` results with the checks of :mod:`hstu.ops.doctor_checks`. Checks never raise on odd
   versions; they report them.

Status meaning: ``pass`` known good; ``warn`` works but outside the table or degraded; ``fail`` will not
work (the fix says what to run); ``skip`` not applicable on this host (e.g. CANN on a CUDA box).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

from hstu.ops.compat import CompatTable, load_compat
from hstu.ops.doctor_checks import (
    check_autoload,
    check_cann,
    check_cuda,
    check_env_libs,
    check_memory,
    check_npu_driver,
    check_python,
    check_torch,
    check_torch_npu,
    check_triton,
)
from hstu.ops.doctor_env import (
    CUDA_RUNTIME_DISTS,
    LOW_FREE_RATIO,
    STATUSES,
    TRITON_DISTS,
    Check,
    DeviceMemory,
    Environment,
    collect_environment,
)

log = logging.getLogger(__name__)

CHECKS = (
    check_python,
    check_torch,
    check_torch_npu,
    check_cann,
    check_npu_driver,
    check_cuda,
    check_triton,
    check_env_libs,
    check_autoload,
    check_memory,
)


def run_checks(env: Environment, table: CompatTable | None = None) -> list[Check]:
    """Run every check; a check that raises is reported as ``fail`` naming the exception (a doctor bug)."""
    table = table or load_compat()
    out = []
    for fn in CHECKS:
        try:
            out.append(fn(env, table))
        except Exception as exc:  # noqa: BLE001 - report, don't crash the report
            log.exception("doctor check %s crashed", fn.__name__)
            out.append(Check(fn.__name__.removeprefix("check_"), "fail", f"check crashed: {type(exc).__name__}: {exc}"))
    return out


def render_text(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{c.status.upper():<5} {c.name:<14} {c.summary}")
        if c.detail:
            lines.append(f"      {'':<14} {c.detail}")
        if c.fix and c.status in ("warn", "fail"):
            lines.append(f"      {'':<14} fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def render_json(checks: list[Check], env: Environment | None = None) -> str:
    doc: dict = {"checks": [asdict(c) for c in checks]}
    if env is not None:
        doc["environment"] = asdict(env)
    return json.dumps(doc, indent=2, default=str)


def exit_code(checks: list[Check]) -> int:
    """1 if any check failed, else 0."""
    return 1 if any(c.status == "fail" for c in checks) else 0


__all__ = [
    "STATUSES",
    "LOW_FREE_RATIO",
    "TRITON_DISTS",
    "CUDA_RUNTIME_DISTS",
    "Check",
    "DeviceMemory",
    "Environment",
    "collect_environment",
    "CHECKS",
    "run_checks",
    "render_text",
    "render_json",
    "exit_code",
    "check_python",
    "check_torch",
    "check_torch_npu",
    "check_cann",
    "check_npu_driver",
    "check_cuda",
    "check_triton",
    "check_env_libs",
    "check_autoload",
    "check_memory",
]
