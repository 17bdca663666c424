"""Fair batching under mixed traffic (issue 19): :func:`hstu.serve.batcher.pick_fair` and the dispatcher.

Deterministic: the executor is a fake that holds each batch until the test releases it and records what
each batch held; waits are counted in a virtual clock (a batch of r rows takes 1 + 0.5 r ms, a cost line
of the shape warm-up measures), never measured. No assert is on a wall-clock time.
"""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np
import pytest

from hstu.generate.recommend import Prepared
from hstu.serve.batcher import MicroBatcher, fair_key, job_rows, pick_fair
from hstu.serve.executor import BatchOutcome
from hstu.serve.metrics import ServeMetrics
from hstu.serve.runner import DecodeOptions, Job


def _prep(n: int = 3) -> Prepared:
    ids = np.arange(1, n + 1, dtype=np.int64)
    return Prepared(ids, ids * 10, np.zeros(n, np.int64), np.zeros(n, np.int64), int(n * 10), [], [])


def _greedy(t: float = 0.0) -> Job:
    return Job("generate", _prep(), k=5, enqueued_at=t)


def _beam(width: int, t: float = 0.0) -> Job:
    return Job("generate", _prep(), k=5, decoding=DecodeOptions("beam", beam_width=width), enqueued_at=t)


def test_rows_and_priority() -> None:
    """A beam-W job counts W rows, everything else 1; below the aging bound fewer rows go first, above it age alone."""
    assert job_rows(_beam(16)) == 16 and job_rows(_greedy()) == 1
    assert job_rows(Job("score", _prep(), candidates=np.array([1, 2]))) == 1
    assert job_rows(Job("generate", _prep(), k=5, decoding=DecodeOptions("topk", beam_width=16))) == 1  # width only for beam
    now = 1.0
    young_beam, young_greedy, old_beam = _beam(16, 0.99), _greedy(0.995), _beam(16, 0.90)
    keys = sorted([young_beam, young_greedy, old_beam], key=lambda j: fair_key(j, now, aging_s=0.05))
    assert keys == [old_beam, young_greedy, young_beam]


def test_pick_fair_first_fit_within_the_row_budget() -> None:
    """Hand-built queues, budget 16 rows: the greedy jobs behind a beam burst go first and the beams
    are passed over while they do not fit; the first job is taken even when wider than the budget;
    per-bucket counts from plan_batch are kept; the jobs left keep their order."""
    now = 1.0
    beams = [_beam(16, 0.90 + 0.001 * i) for i in range(3)]
    greedy = [_greedy(0.95 + 0.001 * i) for i in range(4)]
    q = {20: deque([*beams, *greedy])}
    got = pick_fair(q, {20: 16}, rows=16, now=now, aging_s=10.0)
    assert [j for _, j in got] == greedy  # 4 rows; the next beam (16) does not fit the 12 left
    assert list(q[20]) == beams
    got = pick_fair(q, {20: 16}, rows=16, now=now, aging_s=10.0)
    assert [j for _, j in got] == [beams[0]] and list(q[20]) == beams[1:]  # alone: 16 rows
    wide = _beam(16, 0.5)
    q = {20: deque([wide, _greedy(0.6)])}
    assert [j for _, j in pick_fair(q, {20: 16}, 8, now, 10.0)][0] is not wide  # the greedy one first ...
    assert [j for _, j in pick_fair(q, {20: 16}, 8, now, 10.0)] == [wide]  # ... then the 16-row beam alone in 8 rows
    # aged: the oldest job goes first although wider, and narrower ones fill the room left
    old, g1, g2 = _beam(8, 0.5), _greedy(0.99), _greedy(0.995)
    q = {20: deque([old, g1, g2])}
    assert [j for _, j in pick_fair(q, {20: 16}, 16, now, aging_s=0.05)] == [old, g1, g2]
    # two buckets, at most take[e] jobs of each: the greedy one of bucket 20 before the beam of 200
    b200, g20a, g20b = _beam(16, 0.98), _greedy(0.99), _greedy(0.991)
    q = {20: deque([g20a, g20b]), 200: deque([b200])}
    got = pick_fair(q, {200: 1, 20: 1}, 16, now, 10.0)
    assert got == [(20, g20a)] and list(q[20]) == [g20b] and list(q[200]) == [b200]
    with pytest.raises(KeyError):
        pick_fair({20: deque([_greedy()])}, {50: 1}, 16, now, 10.0)  # take names only buckets that exist


class _HeldModel:
    """An executor whose batches finish only when the test releases them; records each batch."""

    def __init__(self) -> None:
        self.buckets, self.warm = [20, 200], {20, 200}
        self.slots = self.available = 1
        self.costs: dict = {}  # no cost lines: buckets never mix (plan_batch)
        self.cost_model: dict = {}
        self.batches: list[tuple[int, list[Job]]] = []
        self.release = asyncio.Semaphore(0)

    async def run(self, edge: int, jobs: list[Job]) -> BatchOutcome:
        self.batches.append((edge, list(jobs)))
        await self.release.acquire()
        return BatchOutcome([j.k for j in jobs], seconds=0.0)

    def close(self) -> None:
        pass


def _virtual_waits(batches: list[tuple[int, list[Job]]]) -> dict[int, float]:
    """Completion time (ms) of each job (by id) when batches run back to back, a batch of r rows taking 1 + 0.5 r ms."""
    t, done = 0.0, {}
    for _, jobs in batches:
        t += 1.0 + 0.5 * sum(job_rows(j) for j in jobs)
        done.update({id(j): t for j in jobs})
    return done


@pytest.mark.parametrize("aging_ms", [60_000.0, 0.0])
def test_greedy_wait_is_bounded_under_a_beam_burst(aging_ms: float) -> None:
    """One greedy batch runs; meanwhile 8 beam-16 requests arrive, then 8 greedy ones. Fair (aging bound
    far away): the greedy ones form the very next batch, the beams follow one per batch (16 rows each),
    so the greedy ones are answered after 2 batches (virtual 6.5 + 5 ms) instead of after all 8 beams.
    With aging_ms 0 the policy is oldest first within the row budget: the greedy requests wait for every beam."""

    async def main() -> list[tuple[int, list[Job]]]:
        model = _HeldModel()
        metrics = ServeMetrics(model.buckets)
        b = MicroBatcher(model, metrics, max_batch=16, max_wait_ms=0, max_queue=64, request_timeout_s=30, aging_ms=aging_ms)
        b.start()
        first = asyncio.ensure_future(b.submit(20, _greedy()))
        while not model.batches:
            await asyncio.sleep(0)
        beams = [asyncio.ensure_future(b.submit(20, _beam(16))) for _ in range(8)]
        greedy = [asyncio.ensure_future(b.submit(20, _greedy())) for _ in range(8)]
        await asyncio.sleep(0)
        tasks = [first, *beams, *greedy]
        while not all(t.done() for t in tasks):
            model.release.release()
            await asyncio.sleep(0.001)
        assert [t.result() for t in tasks] == [5] * 17
        await b.drain(1.0)
        return model.batches

    batches = asyncio.run(main())
    rows = [sum(job_rows(j) for j in jobs) for _, jobs in batches]
    assert all(r <= 16 for r in rows) and sum(rows) == 1 + 8 * 16 + 8
    greedy_ids = {id(j) for _, jobs in batches[1:] for j in jobs if job_rows(j) == 1}
    done = _virtual_waits(batches)
    worst_greedy = max(done[i] for i in greedy_ids)
    if aging_ms:
        assert rows == [1, 8] + [16] * 8
        assert worst_greedy == pytest.approx((1 + 0.5) + (1 + 0.5 * 8))  # the running batch, then its own
    else:
        assert rows == [1] + [16] * 8 + [8]
        assert worst_greedy == pytest.approx((1 + 0.5) + 8 * (1 + 0.5 * 16) + (1 + 0.5 * 8))


def test_wire_round_trip_and_bad_messages() -> None:
    """A batch packed for the model-process pipe (hstu.serve.wire) comes back field for field, arrays
    equal in dtype, shape and values (a 2-D token matrix, a block list, candidates and none), writable;
    a foreign or truncated message is refused with a message, never read as a batch."""
    from hstu.serve.wire import pack_jobs, unpack_jobs

    p = _prep(4)
    p2 = Prepared(p.ids, p.timestamps, p.actions, np.arange(8, dtype=np.int64).reshape(4, 2), 77, ["dropped 1 unknown id"], [5, 9])
    jobs = [
        Job("generate", p2, k=3, decoding=DecodeOptions("beam", beam_width=4), exclude_history=False, allow_untrained=True, user_id=42),
        Job("score", _prep(2), candidates=np.array([7, 0, 3], dtype=np.int64)),
        Job("generate", _prep(1), k=2, decoding=DecodeOptions("topk", top_k=7, temperature=0.5, seed=11), user_id="u-7"),
    ]
    edge, got = unpack_jobs(pack_jobs(50, jobs))
    assert edge == 50 and len(got) == 3
    for a, b in zip(jobs, got):
        fields = ("kind", "k", "decoding", "exclude_history", "allow_untrained", "user_id")
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        pa, pb = a.prepared, b.prepared
        assert (pa.request_time, pa.warnings, pa.block) == (pb.request_time, pb.warnings, pb.block)
        for x, y in ((pa.ids, pb.ids), (pa.timestamps, pb.timestamps), (pa.actions, pb.actions), (pa.categories, pb.categories)):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y) and y.flags.writeable
        assert (a.candidates is None) == (b.candidates is None)
    assert np.array_equal(got[1].candidates, [7, 0, 3])
    msg = pack_jobs(50, jobs)
    with pytest.raises(ValueError, match="not a packed batch"):
        unpack_jobs(b"\x80" + msg[1:])
    with pytest.raises(ValueError, match="past the message"):
        unpack_jobs(msg[:-8])
