"""The pipe format of a batch sent to a model process (:mod:`hstu.serve.worker`): no pickled request objects.

A batch of :class:`~hstu.serve.runner.Job` goes down the pipe as one message (``send_bytes``):

    b"J" | header length (uint32, little-endian) | header (JSON, orjson) | array bytes

The header holds the bucket edge, each job's scalars (kind, k, decoding options, exclusion and
untrained-item settings, request time, warnings) and, for every NumPy array of the batch (per job:
ids, timestamps, actions, categories, block list, candidates or none), its dtype, shape and byte
offset; the arrays follow back to back (C order). The model process rebuilds them as
``np.frombuffer`` views of one writable copy of the message, so no per-array object is unpickled.
The leading ``b"J"`` tells the message apart from a pickled call (pickle protocol 2+ starts with
``b"\\x80"``), which the other calls (info, warm-up, stop) and every answer still are.

Measured side by side by ``benchmarks/serve_load.py --wire`` (a batch of 16 jobs of 20..200 events).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import orjson

from hstu.config import DecodeOptions
from hstu.generate.recommend import Prepared
from hstu.serve.runner import Job

TAG = b"J"
_LEN = struct.Struct("<I")


def _arrays(job: Job) -> list[np.ndarray | None]:
    p = job.prepared
    block = np.asarray(p.block, dtype=np.int64)
    return [p.ids, p.timestamps, p.actions, p.categories, block, job.candidates]


def pack_jobs(edge: int, jobs: list[Job]) -> bytes:
    """One message for ``execute(edge, jobs)`` (module docstring). Arrays must be numeric NumPy
    arrays (any dtype, any shape); ``job.future`` and the batcher's bookkeeping are not sent.

    Raises:
        TypeError: an array of dtype object (text ids never reach a Job: they are mapped to dense ids first).
    """
    chunks: list[bytes] = []
    meta, offset = [], 0
    for j in jobs:
        d, p = j.decoding, j.prepared
        specs = []
        for a in _arrays(j):
            if a is None:
                specs.append(None)
                continue
            a = np.ascontiguousarray(a)
            if a.dtype.hasobject:
                raise TypeError(f"pack_jobs: arrays must be numeric, got dtype {a.dtype}")
            specs.append((a.dtype.str, a.shape, offset))
            chunks.append(a.tobytes())
            offset += a.nbytes
        meta.append(
            (j.kind, j.k, (d.strategy, d.top_k, d.temperature, d.beam_width, d.seed), j.exclude_history, j.allow_untrained)
            + (p.request_time, p.warnings, specs)
        )
    header = orjson.dumps((edge, meta))
    return b"".join([TAG, _LEN.pack(len(header)), header, *chunks])


def unpack_jobs(buf: bytes | bytearray | memoryview) -> tuple[int, list[Job]]:
    """``(edge, jobs)`` from a :func:`pack_jobs` message; the arrays are writable views of one copy of ``buf``.

    Raises:
        ValueError: not such a message (wrong tag, truncated header or arrays).
    """
    mv = memoryview(buf)
    if mv[:1] != TAG or len(mv) < 1 + _LEN.size:
        raise ValueError("unpack_jobs: not a packed batch message")
    (n,) = _LEN.unpack_from(mv, 1)
    start = 1 + _LEN.size + n
    if len(mv) < start:
        raise ValueError(f"unpack_jobs: header of {n} bytes truncated at {len(mv) - 1 - _LEN.size}")
    edge, meta = orjson.loads(mv[1 + _LEN.size : start])
    data = bytearray(mv[start:])  # one writable copy: the runner may write into its inputs

    def array(spec):
        if spec is None:
            return None
        dtype, shape, off = np.dtype(spec[0]), tuple(spec[1]), spec[2]
        count = math.prod(shape)
        if off + count * dtype.itemsize > len(data):
            raise ValueError(f"unpack_jobs: array of {count} x {dtype} at byte {off} past the message's {len(data)} bytes")
        return np.frombuffer(data, dtype=dtype, count=count, offset=off).reshape(shape)

    jobs = []
    for kind, k, dec, exclude_history, allow_untrained, request_time, warnings, specs in meta:
        ids, ts, acts, cats, block, cands = (array(s) for s in specs)
        prep = Prepared(ids, ts, acts, cats, request_time, warnings, block.tolist())
        jobs.append(Job(kind, prep, k, DecodeOptions(*dec), exclude_history, cands, allow_untrained))
    return edge, jobs


__all__ = ["TAG", "pack_jobs", "unpack_jobs"]
