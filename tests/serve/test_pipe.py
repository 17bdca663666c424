"""hstu.serve.pipe: messages of any size between the event loop and a blocking Connection, on asyncio's
loop and uvloop's (which makes a watched descriptor non-blocking), and a model process's batch larger
than the pipe's buffer (it used to be taken for a dead process: 503 model_restart)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading

import numpy as np
import pytest

from hstu.serve.pipe import PipeEnd, frame, split_frames

LOOPS = ["asyncio", "uvloop"]


def _run(kind: str, coro):
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.run(coro)
    return asyncio.run(coro)


def test_frames_split_whole_messages_only():
    msgs = [b"", b"a", os.urandom(70_000), b"xyz"]
    stream = b"".join(b"".join(frame(m)) for m in msgs)
    buf, got = bytearray(), []
    for i in range(0, len(stream), 997):  # arriving in pieces that cut headers and bodies
        buf += stream[i : i + 997]
        got += split_frames(buf)
    assert got == msgs and not buf
    long_form = bytearray(b"\xff\xff\xff\xff" + (5).to_bytes(8, "big") + b"hello" + b"\x00\x00")  # Connection's >2 GiB header
    assert split_frames(long_form) == [b"hello"] and long_form == b"\x00\x00"


def test_frame_is_what_connection_reads():
    a, b = multiprocessing.Pipe()
    msg = os.urandom(300_000)
    t = threading.Thread(target=lambda: [os.write(a.fileno(), part) for part in frame(msg)])
    t.start()
    assert b.recv_bytes() == msg
    t.join()


@pytest.mark.parametrize("kind", LOOPS)
def test_pipe_end_sends_and_reads_messages_larger_than_the_buffer(kind):
    """An echo on the blocking end: 3 MB and 500 KB messages go out and come back whole, in order."""
    ours, theirs = multiprocessing.Pipe()
    msgs = [b"small", os.urandom(3_000_000), os.urandom(500_000), b""]

    def echo():
        for _ in msgs:
            theirs.send_bytes(theirs.recv_bytes())

    t = threading.Thread(target=echo, daemon=True)
    t.start()

    async def main():
        got, done = [], asyncio.get_running_loop().create_future()

        def on_message(m):
            got.append(m)
            if len(got) == len(msgs):
                done.set_result(True)

        end = PipeEnd(ours, on_message, lambda: done.set_exception(AssertionError("closed")))
        end.attach(asyncio.get_running_loop())
        for m in msgs:
            end.send(m)
        await asyncio.wait_for(done, 30)
        end.detach()
        return got

    assert _run(kind, main()) == msgs
    t.join(5)
    assert os.get_blocking(ours.fileno())  # blocking again once detached


@pytest.mark.parametrize("kind", LOOPS)
def test_pipe_end_reports_the_other_end_closing(kind):
    ours, theirs = multiprocessing.Pipe()

    async def main():
        closed = asyncio.get_running_loop().create_future()
        got = []
        end = PipeEnd(ours, got.append, lambda: closed.set_result(True))
        end.attach(asyncio.get_running_loop())
        theirs.send_bytes(b"last words")
        theirs.close()
        await asyncio.wait_for(closed, 10)
        return got

    assert _run(kind, main()) == [b"last words"]  # what arrived whole before the end is delivered


def test_model_process_takes_a_batch_larger_than_the_pipe_buffer(run_dir, rec):
    """Under uvloop (the server's loop): a generate job with a 300,000-id block list (a 2.4 MB message)
    and a score job with 300,000 candidates (a 2.4 MB answer) are answered as the local runner answers
    them, by the same process (no restart)."""
    uvloop = pytest.importorskip("uvloop")
    from hstu.generate.recommend import History
    from hstu.serve.runner import BatchRunner, Job
    from hstu.serve.worker import ProcessModel, WorkerSpec

    prep = rec.prepare(History([1, 2, 3], [978_300_000, 978_300_060, 978_300_120]))
    I = rec.model.cfg.num_items
    big_block = (np.arange(300_000) % (I // 2) + 1).tolist()
    cands = np.arange(300_000, dtype=np.int64) % I + 1

    def jobs():
        blocked = type(prep)(prep.ids, prep.timestamps, prep.actions, prep.categories, prep.request_time, [], big_block)
        return [Job("generate", blocked, k=3), Job("score", prep, candidates=cands)]

    local = BatchRunner(rec, [50], 4, use_engine="never").run_batch(50, jobs(), describe=False)
    model = ProcessModel(WorkerSpec(str(run_dir), buckets=(50,), max_batch=4, threads=1, use_engine="never"))
    try:
        pid = model.pid(0)
        out = uvloop.run(model.run(50, jobs()))
        assert model.pid(0) == pid and model.restarts == 0
    finally:
        model.close()
    assert out.results[0].items.tolist() == local[0].items.tolist()
    assert (out.results[0].items > I // 2).all()  # the block list was applied
    assert out.results[1].tobytes() == local[1].tobytes()
