"""Batch inference: next-k items for every user of a run's data set, to Parquet or JSON lines.

``hstu generate --run RUN --all-users --out recs.parquet`` (or ``recs.jsonl``) is the offline
job that precomputes recommendations for an application: each user's full history in the run's
data set (what ``hstu generate --user`` uses; the data set is read once), through the one
generation call, :meth:`hstu.generate.recommend.Recommender.recommend`.

Output, long format: one row per (user, rank), users in data-set order (or ``--users-file``
order), ranks 1..k:

==========  ===========  =====================================================
column      type         content
==========  ===========  =====================================================
user_id     int64        original user id (string for a data set of text user ids)
rank        int32        1..k, the generation order (greedy / top-k) or the best beam's order
item_id     int64        original item id (string for a data set of text item ids)
score       float32      the model's score of the item at that step (cosine / temperature)
title       string       the item's title (runs whose data set has titles; null where none)
action      string       the predicted action (runs with a next-action head)
category    int64        the item's original category id (runs with categories)
==========  ===========  =====================================================

A long table joins and filters in any engine (pandas, DuckDB, Spark) without list types.

Same results whatever the batching. A row's result must not depend on the other rows of its
engine call: greedy and beam users are grouped by length bucket (the engine's edges) and run
``batch_users`` per call, the last call of a bucket padded to ``batch_users`` with copies of its
first history (results dropped), each call padded to the bucket's edge (``bucket=E``), so every
call has one static shape; rows are independent within a shape. Seeded top-k runs each user alone
with ``seed``, as the server does (``hstu.serve.runner``: a top-k request never shares a batch),
so a user's items equal ``hstu generate --user U --strategy topk --seed S``. Hence the items are
the same for any ``--chunk-users`` and ``--workers`` (tests/generate/test_batch.py), and so are
the scores up to float32 rounding: within one process the file is bit-identical for any chunk
size, but another process (a worker) or another torch thread count can move a score by one ulp
(measured on the 200-user test run: 1 or 2 of 1,000 scores, 1 ulp, W = 2 at 7 users per chunk
vs one process at 50; the CPU kernels' summation order is not fixed across processes / thread
splits). The ranks and items do not move unless two items' scores tie within that ulp.

Resumable by chunks: users are cut into chunks of ``chunk_users``; each chunk is written to
``OUT.parts/chunk-000123.<fmt>`` atomically and durably (temp, fsync, rename), beside ``job.json`` (what the job
is: run fingerprint, k, decoding, users). A rerun of the same job skips finished chunks once checked (it parses and
holds its users x k rows; a bad part is logged and computed again; another job's parts are refused, naming the
field); at the end the parts are checked again as they are concatenated in chunk order into ``OUT`` (temp + rename)
and removed. ``OUT`` never exists half-written. The parts: :mod:`hstu.generate.batch_parts`.

Workers: ``workers`` = 1 runs in this process (torch threads as set, unless ``threads``); W > 1
runs W spawned processes (``concurrent.futures.ProcessPoolExecutor``), each loading the run once,
with torch threads = ``threads`` or cores // W, fed chunks as they finish (at most 2W in flight). The cluster version (Ray Data) is
:mod:`hstu.generate.batch_ray`; it writes the same parts and output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hstu.config import DecodeOptions
from hstu.data.sequences import as_id, is_text
from hstu.generate.batch_parts import PartStore, arrow_schema
from hstu.generate.recommend import History, HistoryError, Recommender

log = logging.getLogger(__name__)

BATCH_USERS = 64  # users per engine call (x beam width rows)
CHUNK_USERS = 1024  # users per resumable part
FORMATS = {".parquet": "parquet", ".jsonl": "jsonl"}
BASE_COLUMNS = (("user_id", "int64"), ("rank", "int32"), ("item_id", "int64"), ("score", "float32"))


@dataclass(frozen=True)
class BatchSpec:
    """What a batch job computes. ``k`` 1..max_output_len; ``exclude_history`` / ``allow_untrained``
    None = the run's defaults (as ``hstu generate``); ``request_time`` Unix s, None = each user's
    last event; ``batch_users`` users per engine call (the static shape, see the module docstring)."""

    run: str
    k: int
    decoding: DecodeOptions
    exclude_history: bool | None = None
    allow_untrained: bool | None = None
    request_time: int | None = None
    device: str = "cpu"
    precision: str | None = None
    batch_users: int = BATCH_USERS


def output_format(out: str | Path) -> str:
    """ "parquet" or "jsonl" from OUT's suffix; ValueError naming the suffix otherwise, or when
    Parquet is asked for without pyarrow, or when a file stands where OUT's directory would be (a missing directory is
    created by the job, :class:`PartStore`)."""
    fmt = FORMATS.get(Path(out).suffix.lower())
    if fmt is None:
        raise ValueError(f"--out {out}: unknown output suffix {Path(out).suffix!r}; valid: {', '.join(FORMATS)}")
    if blocker := next((p for p in Path(out).absolute().parents if p.exists() and not p.is_dir()), None):
        raise ValueError(f"--out {out}: not a directory: {blocker} is a file")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ModuleNotFoundError:
            raise ValueError(f"--out {out}: writing Parquet needs pyarrow (pip install pyarrow), or write .jsonl") from None
    return fmt


def output_columns(idmap: dict) -> list[tuple[str, str]]:
    """(name, type) of the output columns for a run's ``idmap.json`` content: the base columns,
    then title / action / category where the run has them (the table in the module docstring)."""
    text = {"user_id": idmap.get("user_ids") == "text", "item_id": is_text(idmap.get("item_raw_ids", [0]))}
    cols = [(name, "string" if text.get(name) else kind) for name, kind in BASE_COLUMNS]
    if idmap.get("titles"):
        cols.append(("title", "string"))
    if idmap.get("action_names"):
        cols.append(("action", "string"))
    if idmap.get("category_raw_ids") is not None:
        cols.append(("category", "int64"))
    return cols


def history_of(log_, user: int) -> History:
    """The full history of original user id ``user`` in an EventLog (original item ids, Unix s,
    action names, the events' raw side-feature values: NaN / missing as None), as ``hstu generate
    --user`` uses it. KeyError names an unknown user."""
    u = log_.user_index(user)
    s, e = log_.offsets[u], log_.offsets[u + 1]
    raw = log_.item_raw_ids[log_.items[s:e]].tolist()
    acts = [log_.action_names[a - 1] if a > 0 else None for a in log_.actions[s:e].tolist()] if log_.num_actions else None
    cols = {n: [None if v is None or v != v else v for v in vals[s:e].tolist()] for n, vals in log_.feature_raw.items()}  # v != v: NaN
    feats = [{n: c[i] for n, c in cols.items()} for i in range(e - s)] if cols else None
    return History(raw, log_.timestamps[s:e].tolist(), acts, features=feats)


def read_users_file(path: str | Path, log_) -> list[int]:
    """Original user ids, one per line ('#' comments and blank lines skipped), in file order.
    ValueError naming the file and line for a non-integer, a user not in the run's data set, a
    repeated user, or no users at all."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is allowed
    except FileNotFoundError:
        raise FileNotFoundError(f"--users-file {p}: not found") from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise ValueError(f"--users-file {p}: not a UTF-8 text file ({exc})") from None
    users, seen = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        s = line.split("#", 1)[0].strip()
        if not s:
            continue
        try:
            u = as_id(s, is_text(log_.users), f"{p}:{n}: user id")
        except ValueError as exc:
            raise ValueError(f"{exc} (one user id per line)") from None
        if u in seen:
            raise ValueError(f"{p}:{n}: user {u} repeats line {seen[u]}")
        try:
            log_.user_index(u)
        except KeyError:
            raise ValueError(f"{p}:{n}: user {u} is not among the {len(log_.users)} users of the run's data set") from None
        seen[u] = n
        users.append(u)
    if not users:
        raise ValueError(f"--users-file {p}: no user ids")
    return users


class ChunkGenerator:
    """One process's generator: the run loaded once (``Recommender.from_run``), one engine of the
    default buckets with ``batch_users`` x beam-width rows. Calling it on a chunk's users and
    histories returns the output columns ({name: list}, :func:`output_columns`), users in order.
    Raises HistoryError "user U: ..." when a user's exclusions leave fewer than k items."""

    def __init__(self, spec: BatchSpec, threads: int | None = None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.spec = spec
        self.rec = Recommender.from_run(spec.run, spec.device, spec.precision)
        d = spec.decoding
        self.width = d.beam_width if d.strategy == "beam" else 1
        self.engine = self.rec.build_engine(max_batch=spec.batch_users * self.width)
        self.columns = output_columns(self.rec.idmap)

    def __call__(self, users: list[int], histories: list[History]) -> dict[str, list]:
        spec, rec = self.spec, self.rec
        need = max(spec.k, self.width)
        preps = []
        for u, h in zip(users, histories):
            if spec.request_time is not None:
                h.request_time = spec.request_time
            p = rec.prepare(h)
            rec.check_room(p, need, exclude_history=spec.exclude_history, allow_untrained=spec.allow_untrained, field=f"user {u}")
            preps.append(p)
        items: list[list[dict] | None] = [None] * len(preps)
        for rows, E in self._calls(preps):
            batch = [preps[i] for i in rows]
            if spec.decoding.strategy != "topk":  # one static shape per bucket: pad with copies of the first row
                batch += [batch[0]] * (spec.batch_users - len(batch))
            out = rec.recommend(
                batch,
                spec.k,
                decoding=spec.decoding,
                exclude_history=spec.exclude_history,
                allow_untrained=spec.allow_untrained,
                engine=self.engine,
                bucket=E,
            )
            for i, res in zip(rows, out):
                items[i] = res
        return _columns(self.columns, users, items)

    def _calls(self, preps) -> Iterator[tuple[list[int], int]]:
        """(row indices, bucket edge) of each engine call: per bucket, in chunk order, up to
        ``batch_users`` rows (top-k: one row)."""
        per = 1 if self.spec.decoding.strategy == "topk" else self.spec.batch_users
        by_edge: dict[int, list[int]] = {}
        for i, p in enumerate(preps):
            by_edge.setdefault(self.engine.bucket_for(len(p.ids)), []).append(i)
        for E in sorted(by_edge):
            rows = by_edge[E]
            for s in range(0, len(rows), per):
                yield rows[s : s + per], E


def _columns(columns: list[tuple[str, str]], users: list[int], items: list[list[dict]]) -> dict[str, list]:
    """The long table of ``items`` (per user, k item dicts of Recommender.describe) as columns."""
    out: dict[str, list] = {name: [] for name, _ in columns}
    for u, lst in zip(users, items):
        for r, it in enumerate(lst, 1):
            row = {"user_id": u, "rank": r, **it}
            for name, _ in columns:
                out[name].append(row.get(name))
    return out


# ----- the job -----
def job_identity(spec: BatchSpec, users: list[int], chunk_users: int, fmt: str) -> dict:
    """What must match for a rerun to reuse parts: the run's files (size, mtime), the spec, the
    users (SHA-256 of the id list), the chunk size and format. Not the worker count or engine."""
    run = Path(spec.run)
    files = {}
    for name in ("config.json", "idmap.json", "items.npz", "model.safetensors", "model.quant.safetensors"):
        if (run / name).exists():
            st = (run / name).stat()
            files[name] = [st.st_size, st.st_mtime_ns]
    s = asdict(spec)
    s["run"] = str(run.resolve())
    return {
        **s,
        "run_files": files,
        "users": hashlib.sha256(
            json.dumps(users).encode() if any(isinstance(u, str) for u in users) else np.asarray(users, dtype=np.int64).tobytes()
        ).hexdigest(),
        "n_users": len(users),
        "chunk_users": chunk_users,
        "format": fmt,
    }


def run_batch(
    spec: BatchSpec,
    out: str | Path,
    log_,
    users: list[int] | None = None,
    *,
    chunk_users: int = CHUNK_USERS,
    workers: int = 1,
    engine: str = "local",
    ray_address: str | None = None,
    ray_gpus: float = 0.0,
    threads: int | None = None,
    progress: bool | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> dict:
    """Run the batch job (module docstring) over ``users`` (original ids, default every user of
    ``log_``, the run's EventLog) and write ``out`` (.parquet | .jsonl).

    ``engine`` "local" (``workers`` processes) or "ray" (:func:`hstu.generate.batch_ray.run_chunks`,
    ``workers`` actors, at ``ray_address``, ``ray_gpus`` GPUs each). ``threads``: torch threads per
    process (default: as set for one local worker, else cores // W). ``progress``: tqdm over users
    (None = only on a terminal). ``on_chunk(index, users)`` is called after each part is written.
    Returns {"users", "rows", "chunks", "computed" (chunks computed by this call), "out"}.
    Raises ValueError for bad arguments, another job's parts, or a user (HistoryError naming it).
    """
    from hstu.model.checkpoint import read_idmap

    fmt = output_format(out)
    if chunk_users < 1 or workers < 1 or spec.batch_users < 1:
        raise ValueError(f"chunk_users, workers and batch_users must be >= 1, got {chunk_users}, {workers}, {spec.batch_users}")
    users = (log_.users if users is None else np.asarray(users, dtype=log_.users.dtype)).tolist()  # int or text ids
    if engine == "ray":
        from hstu.generate.batch_ray import check_ray

        check_ray()
    elif engine != "local":
        raise ValueError(f"--engine: unknown {engine!r}; valid: local, ray")
    columns = output_columns(read_idmap(spec.run))  # a large catalogue's ids from items.npz (their kind: int or text)
    store = PartStore(out, fmt, columns, job_identity(spec, users, chunk_users, fmt))
    groups = [users[s : s + chunk_users] for s in range(0, len(users), chunk_users)]  # each chunk's users
    n = len(groups)
    try:
        todo = [i for i, us in enumerate(groups) if not store.done(i, len(us) * spec.k)]  # a bad part is computed again
        chunks = ((i, groups[i], [history_of(log_, u) for u in groups[i]]) for i in todo)
        from tqdm.auto import tqdm

        done = len(users) - sum(len(groups[i]) for i in todo)
        with tqdm(total=len(users), initial=done, unit="user", disable=None if progress is None else not progress) as bar:
            if engine == "ray":
                from hstu.generate.batch_ray import run_chunks

                results = run_chunks(spec, chunks, workers, address=ray_address, gpus=ray_gpus, threads=threads)
            else:
                results = _run_local(spec, chunks, workers, threads)
            for i, cols in results:
                store.write(i, cols)
                bar.update(len(groups[i]))
                if on_chunk is not None:
                    on_chunk(i, len(groups[i]))
    except BaseException:
        store.discard_if_empty()  # nothing to resume: leave no OUT.parts behind
        raise
    rows = store.assemble([len(us) * spec.k for us in groups])
    log.info("batch: %d users, %d rows in %d chunks (%d computed now) -> %s", len(users), rows, n, len(todo), out)
    return {"users": len(users), "rows": rows, "chunks": n, "computed": len(todo), "out": str(out)}


_WORKER: ChunkGenerator | None = None


def _init_worker(spec: BatchSpec, threads: int) -> None:
    global _WORKER
    _WORKER = ChunkGenerator(spec, threads)


def _work(i: int, users: list[int], histories: list[History]) -> tuple[int, dict[str, list]]:
    return i, _WORKER(users, histories)


def _run_local(spec: BatchSpec, chunks: Iterator, workers: int, threads: int | None = None) -> Iterator[tuple[int, dict[str, list]]]:
    """(chunk index, columns) of each chunk: in this process (workers = 1), else W spawned
    processes with ``threads`` (default cores // W) torch threads each, at most 2W chunks in flight."""
    if workers == 1:
        gen = None
        for i, us, hs in chunks:
            gen = gen or ChunkGenerator(spec, threads)
            yield i, gen(us, hs)
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
    per = threads or max(1, cores // workers)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(spec, per)) as pool:
        pending = set()
        try:
            for c in chunks:
                pending.add(pool.submit(_work, *c))
                while len(pending) >= 2 * workers:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in finished:
                        yield f.result()
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    yield f.result()
        finally:
            for f in pending:
                f.cancel()


__all__ = [
    "BatchSpec",
    "ChunkGenerator",
    "HistoryError",
    "PartStore",
    "arrow_schema",
    "history_of",
    "output_columns",
    "read_users_file",
    "run_batch",
]
