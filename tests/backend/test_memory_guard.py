"""MemoryGuard: thresholds, actions, sampling, forward hook; parse_bytes."""

from __future__ import annotations

import logging

import pytest
import torch

from hstu.backend import select
from hstu.backend.base import Backend, MemoryInfo
from hstu.backend.memory_guard import MemoryGuard, MemoryPressureError, format_bytes, parse_bytes

GiB = 1024**3


class ScriptedBackend(Backend):
    """A backend whose free memory is set by the test; empty_cache frees ``release`` bytes."""

    name = "cpu"

    def __init__(self, free: int, total: int, release: int = 0) -> None:
        super().__init__(0)
        self.free, self.total, self.release, self.emptied = free, total, release, 0

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> MemoryInfo:
        return MemoryInfo(self.free, self.total)

    def empty_cache(self) -> None:
        self.emptied += 1
        self.free += self.release


def test_parse_and_format_bytes() -> None:
    assert parse_bytes("32GiB") == 32 * GiB
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512mib") == 512 * 1024**2
    assert parse_bytes(4096) == parse_bytes("4096") == 4096
    assert format_bytes(3 * GiB // 2) == "1.50 GiB"
    for bad in ("-1", "12 parsecs", "GiB", -5):
        with pytest.raises(ValueError, match="max_bytes"):
            parse_bytes(bad, field="max_bytes")


def test_no_action_above_threshold_and_empty_cache_below(caplog: pytest.LogCaptureFixture) -> None:
    be = ScriptedBackend(free=10 * GiB, total=16 * GiB, release=3 * GiB)
    guard = MemoryGuard(be, min_free_bytes="2GiB", min_free_ratio=0.25)  # threshold = max(2 GiB, 4 GiB)
    r = guard.check()
    assert r is not None and not r.triggered and r.threshold == 4 * GiB and be.emptied == 0
    be.free = 2 * GiB
    with caplog.at_level(logging.INFO, logger="hstu.backend.memory_guard"):
        r = guard.check()
    assert r.triggered and r.recovered and be.emptied == 1
    assert (r.free_before, r.free_after) == (2 * GiB, 5 * GiB)
    assert "below threshold" in caplog.text
    assert guard.stats() == {"checks": 2, "triggers": 1}


def test_raise_log_and_callable_actions() -> None:
    be = ScriptedBackend(free=GiB, total=16 * GiB)
    with pytest.raises(MemoryPressureError, match="below the guard threshold"):
        MemoryGuard(be, min_free_bytes="2GiB", min_free_ratio=None, action="raise").check()
    r = MemoryGuard(be, min_free_bytes="2GiB", action="log").check()
    assert r.triggered and not r.recovered and be.emptied == 0
    seen = []

    def shrink(info: MemoryInfo, guard: MemoryGuard) -> None:
        seen.append(info.free_bytes)
        be.free += 4 * GiB

    r = MemoryGuard(be, min_free_bytes="2GiB", action=shrink).check()
    assert seen == [GiB] and r.recovered and r.action == "shrink"


def test_every_and_forward_hook_on_real_cpu_backend() -> None:
    cpu = select("cpu")
    total = cpu.memory_info().total_bytes
    calls = []
    guard = MemoryGuard(cpu, min_free_bytes=total + 1, min_free_ratio=None, action=lambda i, g: calls.append(i), every=2)
    lin = torch.nn.Linear(2, 2)
    handle = guard.attach(lin)
    for _ in range(5):
        lin(torch.zeros(1, 2))
    handle.remove()
    lin(torch.zeros(1, 2))
    assert guard.checks == 3 and len(calls) == 3  # calls 1, 3, 5 of 5 (the 6th ran without the hook)
    quiet = MemoryGuard(cpu, min_free_bytes=0, min_free_ratio=None)
    assert not quiet.check().triggered


def test_bad_configuration() -> None:
    be = ScriptedBackend(GiB, GiB)
    with pytest.raises(ValueError, match="min_free_ratio"):
        MemoryGuard(be, min_free_ratio=1.5)
    with pytest.raises(ValueError, match="unknown action"):
        MemoryGuard(be, action="panic")
    with pytest.raises(ValueError, match="every"):
        MemoryGuard(be, every=0)
    with pytest.raises(ValueError, match="give min_free_bytes"):
        MemoryGuard(be, min_free_bytes=None, min_free_ratio=None)
