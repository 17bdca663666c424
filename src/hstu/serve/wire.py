"""The pipe format between the serving process and a model process (:mod:`hstu.serve.worker`): no pickle on the batch path.

One frame format carries both directions (:func:`pack` / :func:`unpack`), sent with ``send_bytes``:

    tag (1 byte) | header length (uint32, little-endian) | header (JSON, orjson) | array bytes

The JSON header is ``[header, specs]``: the message's scalars and, for every NumPy array it
carries, its dtype, shape and byte offset (or null for an absent array); the arrays follow back to
back (C order). The receiver rebuilds them as ``np.frombuffer`` views of one writable copy of the
frame's array bytes, so no per-array object is unpickled. Two messages use it:

- ``b"J"``, a batch (:func:`pack_jobs`): the bucket edge, each job's scalars (kind, k, decoding
  options, exclusion and untrained-item settings, request time, warnings, user id) and seven arrays per job
  (ids, timestamps, actions, categories, block list, candidates or none, the older history's ids).
- ``b"A"``, its answer (:func:`pack_answer`): the :class:`~hstu.serve.executor.BatchOutcome`'s
  scalars (seconds, memory, guard trigger, shed message, prefix-cache counts) and per job a generate result
  (:class:`~hstu.generate.recommend.Ranked`: dense item ids, scores, action ids, concatenated over
  the batch into three arrays), a score result ((C,) float64) or an error; or one error for the
  whole call.

An error travels as its type's name, module and message (and its arguments when they are plain
JSON scalars); :func:`error_from` rebuilds a built-in exception, :class:`~hstu.serve.batcher.Rejected`
(with its status, reason and retry-after), :class:`~hstu.serve.executor.ModelRestart` and
:class:`~hstu.generate.recommend.HistoryError` as themselves, any other type as a
:class:`ModelProcessError` subclass of the same name (so a 500 body still names the original type).

A frame's leading tag tells it apart from a pickled call or answer (pickle protocol 2+ starts with
``b"\\x80"``), which the rare calls (info, warm-up, stop) and their answers still are. A frame that
does not decode (wrong tag, truncated or trailing bytes, bad header) raises :class:`WireError`.
Measured side by side against pickle by ``benchmarks/serve_wire.py``.
"""

from __future__ import annotations

import builtins
import math
import struct
from typing import Any

import numpy as np
import orjson

from hstu.config import DecodeOptions
from hstu.generate.recommend import HistoryError, Prepared, Ranked
from hstu.serve.batcher import Rejected
from hstu.serve.executor import BatchOutcome, ModelRestart
from hstu.serve.runner import Job

TAG = b"J"  # a batch, serving process -> model process
ANSWER = b"A"  # a batch's answer (or the call's error), model process -> serving process
_LEN = struct.Struct("<I")
_PER_JOB = 7  # arrays per job: ids, timestamps, actions, categories, block, candidates, older


class WireError(ValueError):
    """A frame that is not a valid message of the expected kind; the message says what is wrong."""


class ModelProcessError(RuntimeError):
    """Base of the exceptions rebuilt from an error of a type this process does not rebuild as
    itself (:func:`error_from`): each such type gets a subclass of the original's name."""


def pack(tag: bytes, header: Any, arrays: list[np.ndarray | None]) -> bytes:
    """One frame (module docstring): ``header`` any JSON value orjson encodes, ``arrays`` numeric
    NumPy arrays of any dtype and shape, or None.

    Raises:
        TypeError: an array of dtype object, or a header value JSON cannot hold.
    """
    specs: list[tuple | None] = []
    chunks: list[bytes] = []
    offset = 0
    for a in arrays:
        if a is None:
            specs.append(None)
            continue
        a = np.ascontiguousarray(a)
        if a.dtype.hasobject:
            raise TypeError(f"wire.pack: arrays must be numeric, got dtype {a.dtype}")
        specs.append((a.dtype.str, a.shape, offset))
        chunks.append(a.tobytes())
        offset += a.nbytes
    head = orjson.dumps([header, specs])
    return b"".join([tag, _LEN.pack(len(head)), head, *chunks])


def unpack(buf: bytes | bytearray | memoryview, tag: bytes) -> tuple[Any, list[np.ndarray | None]]:
    """``(header, arrays)`` of a :func:`pack` frame tagged ``tag``; the arrays are writable views
    of one copy of the frame's array bytes (a runner may write into its inputs).

    Raises:
        WireError: another tag, a header truncated or not JSON, an array past the frame's end, or
            bytes after the last array.
    """
    mv = memoryview(buf)
    what = {TAG: "batch", ANSWER: "answer"}.get(tag, repr(tag))
    if len(mv) < 1 + _LEN.size or mv[:1] != tag:
        raise WireError(f"wire: not a packed {what} message ({len(mv)} bytes, first byte {bytes(mv[:1])!r}, expected {tag!r})")
    (n,) = _LEN.unpack_from(mv, 1)
    start = 1 + _LEN.size + n
    if len(mv) < start:
        raise WireError(f"wire: {what} header of {n} bytes truncated at {len(mv) - 1 - _LEN.size}")
    try:
        header, specs = orjson.loads(mv[1 + _LEN.size : start])
    except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
        raise WireError(f"wire: {what} header is not [header, array specs] JSON: {exc}") from None
    data = bytearray(mv[start:]) if len(mv) > start else bytearray()
    arrays: list[np.ndarray | None] = []
    end = 0
    for spec in specs:
        if spec is None:
            arrays.append(None)
            continue
        dtype, shape, off = np.dtype(spec[0]), tuple(spec[1]), spec[2]
        count = math.prod(shape)
        if off + count * dtype.itemsize > len(data):
            raise WireError(f"wire: {what} array of {count} x {dtype} at byte {off} past the message's {len(data)} array bytes")
        arrays.append(np.frombuffer(data, dtype=dtype, count=count, offset=off).reshape(shape))
        end = max(end, off + count * dtype.itemsize)
    if end != len(data):
        raise WireError(f"wire: {what} has {len(data) - end} byte(s) after its last array (a framing error)")
    return header, arrays


# ----- batches -----
def pack_jobs(edge: int, jobs: list[Job]) -> bytes:
    """One message for ``execute(edge, jobs)`` (module docstring); ``job.future`` and the batcher's
    bookkeeping are not sent.

    Raises:
        TypeError: an array of dtype object (text ids never reach a Job: they are mapped to dense ids first).
    """
    meta, arrays = [], []
    for j in jobs:
        d, p = j.decoding, j.prepared
        arrays += [p.ids, p.timestamps, p.actions, p.categories, np.asarray(p.block, dtype=np.int64), j.candidates, p.older]
        meta.append(
            (j.kind, j.k, (d.strategy, d.top_k, d.temperature, d.beam_width, d.seed), j.exclude_history, j.allow_untrained)
            + (p.request_time, p.warnings, j.user_id)
        )
    return pack(TAG, (edge, meta), arrays)


def unpack_jobs(buf: bytes | bytearray | memoryview) -> tuple[int, list[Job]]:
    """``(edge, jobs)`` from a :func:`pack_jobs` message. Raises WireError as :func:`unpack`."""
    (edge, meta), arrays = unpack(buf, TAG)
    if len(arrays) != _PER_JOB * len(meta):
        raise WireError(f"wire: batch of {len(meta)} jobs carries {len(arrays)} arrays, expected {_PER_JOB * len(meta)}")
    jobs = []
    for i, (kind, k, dec, exclude_history, allow_untrained, request_time, warnings, user_id) in enumerate(meta):
        ids, ts, acts, cats, block, cands, older = arrays[_PER_JOB * i : _PER_JOB * (i + 1)]
        prep = Prepared(ids, ts, acts, cats, request_time, warnings, block.tolist(), older)
        jobs.append(Job(kind, prep, k, DecodeOptions(*dec), exclude_history, cands, allow_untrained, user_id))
    return edge, jobs


# ----- answers -----
_SCALARS = (str, int, float, bool, type(None))


def error_of(exc: BaseException) -> dict:
    """An exception as JSON: type name, module, message (``str(exc)``), the arguments when all
    are JSON scalars, and a :class:`Rejected`'s status, reason and retry-after."""
    cls = type(exc)
    out: dict[str, Any] = {"type": cls.__name__, "module": cls.__module__, "message": str(exc)}
    if all(isinstance(a, _SCALARS) for a in exc.args):
        out["args"] = list(exc.args)
    if isinstance(exc, Rejected):
        out.update(status=exc.status, reason=exc.reason, retry_after=exc.retry_after)
    return out


_REBUILT: dict[str, type] = {c.__name__: c for c in (ModelRestart, HistoryError)}
_REMOTE: dict[tuple[str, str], type] = {}


def error_from(e: dict) -> Exception:
    """The exception :func:`error_of` described (module docstring: which types come back as themselves)."""
    name, module, message = e["type"], e.get("module", ""), e["message"]
    if name == "Rejected" and "status" in e:
        return Rejected(e["status"], e["reason"], message, e["retry_after"])
    cls = _REBUILT.get(name)
    builtin = getattr(builtins, name, None)
    if cls is None and module == "builtins" and isinstance(builtin, type) and issubclass(builtin, Exception):
        cls = builtin
    if cls is not None:
        try:
            return cls(*e["args"]) if "args" in e else cls(message)
        except Exception:  # noqa: BLE001 - a constructor of other arguments: the message, as the type below
            pass
    remote = _REMOTE.get((module, name))
    if remote is None:
        remote = _REMOTE[(module, name)] = type(name, (ModelProcessError,), {"__module__": module or __name__})
    return remote(message)


def pack_answer(answer: BatchOutcome | BaseException) -> bytes:
    """The model process's answer to an ``execute`` call: its outcome, or the error it raised.

    The generate results travel as three arrays for the whole batch, whatever its size: every
    job's item ids (int64), scores (in their common dtype, ``np.result_type``: the engine gives one
    per batch) and action ids (int64; jobs without actions take no room), each job's share named by
    its k in the header; a score result as its own (C,) array.

    Raises:
        TypeError: a result that is none of Ranked, a NumPy array, an exception or None.
    """
    if isinstance(answer, BaseException):
        return pack(ANSWER, {"error": error_of(answer)}, [])
    results: list | None = None
    ranked: list[Ranked] = []
    arrays: list[np.ndarray | None] = [None, None, None]  # all items, all scores, all actions
    if answer.results is not None:
        results = []
        for r in answer.results:
            if isinstance(r, Ranked):
                results.append(("ranked", len(r.items), r.actions is not None))
                ranked.append(r)
            elif isinstance(r, np.ndarray):
                results.append(("scores", len(arrays)))
                arrays.append(r)
            elif isinstance(r, BaseException):
                results.append(("error", error_of(r)))
            elif r is None:
                results.append(None)
            else:
                raise TypeError(f"wire.pack_answer: a result of type {type(r).__name__} (expected Ranked, ndarray, an exception)")
    if ranked:
        arrays[0] = np.concatenate([r.items for r in ranked]).astype(np.int64, copy=False)
        arrays[1] = np.concatenate([r.scores for r in ranked])
        acts = [r.actions for r in ranked if r.actions is not None]
        arrays[2] = np.concatenate(acts).astype(np.int64, copy=False) if acts else None
    head = {"results": results, "seconds": answer.seconds, "memory": answer.memory, "triggered": answer.triggered, "shed": answer.shed}
    head["prefix"] = answer.prefix
    return pack(ANSWER, head, arrays)


def unpack_answer(buf: bytes | bytearray | memoryview) -> BatchOutcome | Exception:
    """The :class:`BatchOutcome` of a :func:`pack_answer` message, or the call's error (an
    exception to raise, not raised here); a job's Ranked arrays are views of the batch's three.
    Raises WireError as :func:`unpack`."""
    head, arrays = unpack(buf, ANSWER)
    if "error" in head:
        return error_from(head["error"])
    results = None
    if head["results"] is not None:
        items, scores, actions = arrays[:3]
        results, at, act_at = [], 0, 0
        for r in head["results"]:
            if r is None:
                results.append(None)
            elif r[0] == "ranked":
                k, has_actions = r[1], r[2]
                if items is None or at + k > len(items) or (has_actions and (actions is None or act_at + k > len(actions))):
                    raise WireError(f"wire: answer's item arrays end before job {len(results)}'s {k} items")
                results.append(Ranked(items[at : at + k], scores[at : at + k], actions[act_at : act_at + k] if has_actions else None))
                at, act_at = at + k, act_at + (k if has_actions else 0)
            elif r[0] == "scores":
                results.append(arrays[r[1]])
            else:
                results.append(error_from(r[1]))
    memory = tuple(head["memory"]) if head["memory"] is not None else None
    prefix = tuple(head["prefix"]) if head.get("prefix") is not None else None
    return BatchOutcome(results, head["seconds"], memory, head["triggered"], head["shed"], prefix)


__all__ = [
    "ANSWER",
    "TAG",
    "ModelProcessError",
    "WireError",
    "error_from",
    "error_of",
    "pack",
    "pack_answer",
    "pack_jobs",
    "unpack",
    "unpack_answer",
    "unpack_jobs",
]
