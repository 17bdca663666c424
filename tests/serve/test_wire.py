"""The model-process pipe's answers (hstu.serve.wire.pack_answer / unpack_answer): every field and
dtype round trip, errors keep their type, code and message, a broken frame is refused clearly; and a
real model process answers a batch exactly as the runner in this process does."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from hstu.config import DecodeOptions
from hstu.generate.recommend import HistoryError, Ranked
from hstu.serve.batcher import Rejected
from hstu.serve.executor import BatchOutcome, ModelRestart
from hstu.serve.wire import ANSWER, ModelProcessError, WireError, error_from, error_of, pack, pack_answer, pack_jobs, unpack, unpack_answer


class Unpicklable(Exception):
    """A type the serving process does not rebuild as itself (as a torch or third-party error)."""


def _outcome(scores=np.float32) -> BatchOutcome:
    results = [
        Ranked(np.array([7, 3, 11], np.int64), np.array([0.5, -1.25, 3e-8], scores), np.array([2, 0, 1], np.int64)),
        Ranked(np.array([1], np.int64), np.array([2.0**-14], scores)),  # no actions
        Ranked(np.zeros(0, np.int64), np.zeros(0, scores), np.zeros(0, np.int64)),  # k = 0 edge: empty arrays
        np.array([0.25, np.nan, -7.5], np.float64),  # a score job (NaN: unknown candidate)
        ValueError("history of 60 events does not fit bucket 50"),
        Rejected(429, "queue_full", "bucket 20 queue is full (3 waiting)", 4),
        KeyError("item 9"),
        Unpicklable("a library's own error"),
        HistoryError("exclude: leaves 2 items, 5 needed"),
        None,
        Ranked(np.array([9, 8], np.int64), np.array([1.5, 1.25], scores), np.array([0, 3], np.int64)),  # after the others
    ]
    return BatchOutcome(
        results, seconds=0.0123, memory=(123_456_789_012, 987_654_321_098), triggered=True, shed=None, prefix=(3, 5, 597, 1, 123_456, 7)
    )


@pytest.mark.parametrize("scores", [np.float32, np.float64, np.float16])
def test_answer_round_trips_every_field_dtype_and_error(scores) -> None:
    want = _outcome(scores)
    got = unpack_answer(pack_answer(want))
    assert isinstance(got, BatchOutcome)
    assert (got.seconds, got.memory, got.triggered, got.shed) == (0.0123, (123_456_789_012, 987_654_321_098), True, None)
    assert got.prefix == (3, 5, 597, 1, 123_456, 7)
    assert len(got.results) == len(want.results)
    for i in (0, 1, 2, 10):
        a, b = want.results[i], got.results[i]
        for x, y in ((a.items, b.items), (a.scores, b.scores), (a.actions, b.actions)):
            if x is None:
                assert y is None
            else:
                assert y.dtype == x.dtype and y.shape == x.shape and y.tobytes() == x.tobytes() and y.flags.writeable
    s = got.results[3]
    assert s.dtype == np.float64 and s.tobytes() == want.results[3].tobytes()  # NaN bit for bit
    v, r, k, u, h = got.results[4:9]
    assert type(v) is ValueError and str(v) == "history of 60 events does not fit bucket 50"
    assert type(r) is Rejected and (r.status, r.reason, r.message, r.retry_after) == (429, "queue_full", want.results[5].message, 4)
    assert type(k) is KeyError and str(k) == str(KeyError("item 9"))  # its args, not its quoted str
    # another type keeps its name (a 500 body says "Unpicklable: ...") under ModelProcessError
    assert isinstance(u, ModelProcessError) and type(u).__name__ == "Unpicklable" and str(u) == "a library's own error"
    assert type(h) is HistoryError and str(h) == "exclude: leaves 2 items, 5 needed"
    assert got.results[9] is None
    shed = unpack_answer(pack_answer(BatchOutcome(None, 0.0, (1, 2), True, "free memory 1 B is below the guard threshold")))
    assert shed.results is None and shed.shed.startswith("free memory") and shed.memory == (1, 2) and shed.prefix is None


def test_a_batchs_items_travel_as_three_arrays() -> None:
    """16 jobs' items, scores and actions: three arrays in the frame, not 48 (the serving side's cost)."""
    ranked = [Ranked(np.arange(5, dtype=np.int64) + i, np.full(5, i, np.float32), np.ones(5, np.int64)) for i in range(16)]
    _, arrays = unpack(pack_answer(BatchOutcome(ranked)), ANSWER)
    assert [a.shape for a in arrays] == [(80,), (80,), (80,)]
    got = unpack_answer(pack_answer(BatchOutcome(ranked))).results
    assert all(g.items.tolist() == list(range(i, i + 5)) and g.scores.tolist() == [i] * 5 for i, g in enumerate(got))


def test_a_calls_error_comes_back_as_itself() -> None:
    """The answer to a call that raised: the exception to raise here, with its type and message."""
    got = unpack_answer(pack_answer(ModelRestart("the model process stopped")))
    assert type(got) is ModelRestart and str(got) == "the model process stopped"
    got = unpack_answer(pack_answer(MemoryError()))
    assert type(got) is MemoryError and got.args == ()
    # a built-in type whose constructor wants other arguments: still its type, with the message
    err = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    got = error_from(error_of(err))
    assert isinstance(got, (UnicodeDecodeError, ModelProcessError)) and "invalid start byte" in str(got)
    with pytest.raises(TypeError, match="a result of type dict"):
        pack_answer(BatchOutcome([{"item_id": 1}]))


def test_broken_frames_are_refused_with_a_message() -> None:
    msg = pack_answer(_outcome())
    with pytest.raises(WireError, match="past the message"):
        unpack_answer(msg[:-4])  # arrays truncated
    head, arrays = unpack(msg, ANSWER)
    arrays[0] = arrays[0][:-1]  # a frame whose header names more items than it carries
    with pytest.raises(WireError, match="end before job 10's 2 items"):
        unpack_answer(pack(ANSWER, head, arrays))
    with pytest.raises(WireError, match="header of .* truncated"):
        unpack_answer(msg[:12])
    with pytest.raises(WireError, match="not a packed answer"):
        unpack_answer(msg[:3])
    with pytest.raises(WireError, match="after its last array"):
        unpack_answer(msg + b"\0\0")
    with pytest.raises(WireError, match="not a packed answer"):  # a batch is not an answer
        unpack_answer(pack_jobs(20, []))
    bad = bytearray(msg)
    bad[5] = ord("}")  # the header's first byte: not JSON any more
    with pytest.raises(WireError, match="not \\[header, array specs\\] JSON"):
        unpack_answer(bytes(bad))


def test_model_process_answers_a_batch_as_the_local_runner(run_dir, ratings, rec, capfd) -> None:
    """One mixed batch (greedy, beam, score, one job that fails) through a real model process equals
    the same batch run here: item ids, scores and actions bit for bit, the failing job's error type
    and message, the others unaffected. The model process's log lines carry time, level, a
    "[model process]" tag and the logger (they were bare messages: its root logger had no handler)."""
    from hstu.serve.runner import BatchRunner, Job
    from hstu.serve.worker import ProcessModel, WorkerSpec

    users = sorted(ratings.user.unique())[:4]
    preps = []
    for u in users:
        h = ratings[ratings.user == u].tail(30)
        preps.append(rec.prepare(_history(h)))

    def jobs() -> list[Job]:
        return [
            Job("generate", preps[0], k=4),
            Job("generate", preps[1], k=3, decoding=DecodeOptions("beam", beam_width=2)),
            Job("score", preps[2], candidates=np.array([1, 2, 0, 3], np.int64)),
            Job("generate", preps[3], k=rec.model.cfg.num_items + 5),  # more items than exist: raises alone
        ]

    local = BatchRunner(rec, [50], 4, use_engine="never").run_batch(50, jobs(), describe=False)
    model = ProcessModel(WorkerSpec(str(run_dir), buckets=(50,), max_batch=4, threads=1, use_engine="never"))
    try:
        out = asyncio.run(model.run(50, jobs()))
    finally:
        model.close()
    assert isinstance(out, BatchOutcome) and out.seconds > 0
    err = capfd.readouterr().err
    assert re.search(r"^\S+ \S+ WARNING \[model process\] hstu\.serve\.runner: batch group of 2 jobs failed", err, re.M), err[-2000:]
    for a, b in zip(local, out.results):
        if isinstance(a, Ranked):
            assert a.items.tolist() == b.items.tolist() and a.scores.tobytes() == b.scores.tobytes()
            assert (a.actions is None) == (b.actions is None)
        elif isinstance(a, np.ndarray):
            assert a.tobytes() == b.tobytes()
        else:
            assert isinstance(a, Exception) and type(b).__name__ == type(a).__name__ and str(b) == str(a)
    assert isinstance(local[3], Exception)
    assert rec.describe_ranked(out.results[0]) == BatchRunner(rec, [50], 4, use_engine="never").run_batch(50, jobs()[:1])[0]


def _history(h):
    from hstu.generate.recommend import History

    return History(h.item.tolist(), h.ts.tolist())
