"""Routing a batch to the model process that holds its users' cached prefixes (hstu.serve.affinity)."""

from __future__ import annotations

import asyncio

import pytest

from hstu.serve import worker as worker_mod
from hstu.serve.affinity import UserAffinity
from hstu.serve.runner import Job
from hstu.serve.worker import ProcessModel, WorkerSpec


def test_choose_goes_where_most_users_ran_else_to_the_first_idle() -> None:
    a = UserAffinity()
    assert a.choose([1, 0], ["u", "v"]) == 1  # nobody seen: the first idle
    assert (a.where("u"), a.where("v")) == (1, 1)
    assert a.choose([0, 1], ["w"]) == 0
    assert a.choose([0, 1], ["u", "w", "v"]) == 1  # two of three ran on 1
    assert a.choose([0, 1], ["w", None, None]) == 1  # None is no user; w moved to 1 with the last batch
    assert a.choose([0], ["u", "v", "w"]) == 0  # the only idle one; everyone is there now
    assert {a.where(u) for u in "uvw"} == {0} and len(a) == 3
    assert a.choose([2, 0], [7, "7"]) == 2 and a.where(7) == 2  # 7 and "7" are two users, as in the prefix cache


def test_capacity_forgets_the_least_recently_dispatched_user() -> None:
    a = UserAffinity(capacity=2)
    a.choose([0], ["old"])
    a.choose([1], ["mid"])
    a.choose([0], ["old"])  # old is recent again
    a.choose([1], ["new"])
    assert (a.where("old"), a.where("mid"), a.where("new"), len(a)) == (0, None, 1, 2)
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        UserAffinity(capacity=0)


class _Channel:  # answers a batch at once with the channel's index, as a model process would answer its batch
    def __init__(self, i: int, log: list[int]) -> None:
        self.i, self.log = i, log

    def send(self, message):
        self.log.append(self.i)
        done = asyncio.get_running_loop().create_future()
        done.set_result(self.i)
        return done


def _ran_on(monkeypatch, prefix_cache_mb: float, users: list) -> list[int]:
    """The process index each one-job batch of ``users`` ran on, dispatched one after another with
    both of two processes idle."""
    monkeypatch.setattr(worker_mod, "pack_jobs", lambda edge, jobs: jobs)
    procs = ProcessModel(WorkerSpec("unused", buckets=(10,), workers=2, prefix_cache_mb=prefix_cache_mb), start=False)
    log: list[int] = []
    procs.channels, procs.up = [_Channel(0, log), _Channel(1, log)], {0, 1}

    async def serially() -> None:
        for u in users:
            await procs.run(10, [Job("generate", None, k=1, user_id=u)])

    asyncio.run(serially())
    return log


def test_with_the_prefix_cache_a_returning_user_runs_where_it_ran_before(monkeypatch) -> None:
    """Two idle model processes: with per-process prefix caches the same user's batches stay on one
    process (a returning user finds its prefix there); without the cache batches alternate as
    before (the process idle longest first), and so do requests without a user id."""
    assert _ran_on(monkeypatch, 4.0, ["a", "a", "b", "a", "b", "b"]) == [0, 0, 1, 0, 1, 1]
    assert _ran_on(monkeypatch, 0.0, ["a", "a", "b", "a", "b", "b"]) == [0, 1, 0, 1, 0, 1]
    assert _ran_on(monkeypatch, 4.0, [None, None, None]) == [0, 1, 0]
