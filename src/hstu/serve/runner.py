"""Batch execution for the service: the one place where a bucket's batch meets the model.

:meth:`BatchRunner.run_batch` takes the jobs of one length bucket (each a prepared history plus
what to do with it) and returns one result per job. Two kinds of job share a batch:

- ``generate``: next-k items. Jobs are grouped so that grouping never changes a result:
  greedy jobs with the same history-exclusion setting run together with k = the group's largest
  k, and each job keeps its first k items (greedy step j depends only on steps < j, so the
  prefix of a longer run equals the shorter run); beam jobs group by (beam width, k, exclusion)
  since a beam's final ranking depends on k; seeded top-k sampling runs each job alone so a
  seed always gives the same items whatever else is in the batch. Jobs that differ in whether
  items without training events may be generated (``allow_untrained``) never share a group.
- ``score``: target-aware candidate scoring. The histories are encoded once at the bucket's
  static width ``edge + 1`` (the last slot holds the query time, DESIGN.md "The model"), the
  user vector is the last live row, and each candidate's score is
  ``user · normalised candidate embedding / temperature`` (``HSTUModel.score_items``). No
  candidate is appended to the sequence, so no candidate sees another one.

``generate`` runs :meth:`hstu.generate.recommend.Recommender.recommend`, the one generation call
of the CLI, the Python API and the service, through :class:`hstu.generate.engine.Engine`: by
default an engine of the service's own buckets and max_batch (static (B, E) inputs padded to the
bucket's edge, KV-cache pools, graph capture at warm-up); with ``use_engine="never"`` the
Recommender's default engine (:func:`hstu.generate.recommend.default_buckets`, eager, each batch
in the smallest bucket of its rows). Results are the same either way (the attention divisor is the
fixed width N, so padding never changes a live row). ``BatchRunner.backend_name`` says which runs.

A group that raises (one bad job, e.g. exclusions that leave fewer than k items when the app's
check was bypassed) is run again job by job, so that only the faulty job gets the exception and
the others their results.

Symbols: B jobs in the batch, E the bucket's upper edge (events), C candidates per job.
Input is trusted here (validated by the app): histories hold 1..E known dense ids.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hstu.config import DecodeOptions  # re-exported: the one decoding-options type (hstu.serve.schemas.Decoding maps onto it)
from hstu.generate.recommend import Prepared, Ranked, Recommender
from hstu.generate.requests import smallest_edge

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One request's work inside a batch.

    kind: "generate" or "score". prepared: the validated history (dense ids, length 1..E).
    k, decoding, exclude_history: generate only (exclude_history None = the data set's default).
    allow_untrained: generate only; may items without training events be generated (None = the
    run's default, :meth:`hstu.generate.recommend.Recommender.allows_untrained`).
    candidates: score only, (C,) int64 dense ids, 0 where the original id is unknown (scored
    then discarded). Fields below ``candidates`` belong to the batcher.
    """

    kind: str
    prepared: Prepared
    k: int = 0
    decoding: DecodeOptions = field(default_factory=DecodeOptions)
    exclude_history: bool | None = None
    candidates: np.ndarray | None = None
    allow_untrained: bool | None = None
    user_id: int | str | None = None  # generate: the key of the engine's user-prefix cache (None: not cached)
    # batcher bookkeeping
    future: Any = None
    enqueued_at: float = 0.0
    expired: bool = False


class BatchRunner:
    """Runs a bucket's batch on the model; one instance per served run.

    Args:
        recommender: the loaded run (model, id map).
        buckets: ascending bucket edges (events), each <= the model's max_seq_len.
        max_batch: the largest batch the batcher forms (used for warm-up and the engine's pools).
        use_engine: "auto" / "require" (an engine of these buckets and max_batch; equal, kept for
            callers of the time the engine was optional) or "never" (the Recommender's default engine).
        graphs: the engine's graph mode ("auto" | "eager" | "compiled" ...; :class:`hstu.generate.engine.Engine`);
            a graph whose compilation fails runs eager with a warning.
        prefix_cache_mb: the engine's user-prefix cache (MiB; 0 = off), keyed by each generate job's user_id.

    Raises:
        ValueError: bad buckets (not ascending, < 1 or > max_seq_len) or max_batch < 1.
        ValueError: as :class:`hstu.generate.engine.Engine` for these buckets and max_batch.

    Thread safety: ``run_batch`` / ``warmup`` are called from the service's single model thread;
    a lock makes concurrent calls safe but serial.
    """

    def __init__(
        self,
        recommender: Recommender,
        buckets: list[int],
        max_batch: int,
        use_engine: str = "auto",
        graphs: str = "auto",
        prefix_cache_mb: float = 0.0,
    ) -> None:
        cfg = recommender.model.cfg
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be distinct ascending positive edges, got {buckets}")
        if buckets[-1] > cfg.max_seq_len:
            raise ValueError(f"bucket {buckets[-1]} exceeds the model's max_seq_len={cfg.max_seq_len}; use edges <= {cfg.max_seq_len}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if use_engine not in ("auto", "never", "require"):
            raise ValueError(f"use_engine must be auto, never or require, got {use_engine!r}")
        self.rec = recommender
        self.model = recommender.model
        self.buckets = list(buckets)
        self.max_batch = max_batch
        self.max_k = cfg.max_output_len
        self.num_items = cfg.num_items
        self._lock = threading.Lock()
        self.graphs = graphs
        self.prefix_cache_bytes = int(prefix_cache_mb * 2**20)
        self.engine = self._make_engine(use_engine)
        if self.engine is not None:  # graphs are compiled in warm-up only: a request never waits for a compilation
            self.engine.compile_new = False
        self.backend_name = self._describe()
        self.warm: set[int] = set()
        self.costs: dict[int, tuple[float, float]] = {}  # bucket -> (fixed s, s per request), from warm-up

    # ----- backend choice -----
    def _describe(self) -> str:
        """What generates, with the graph mode the engine resolved (/readyz "generation", the start-up log)
        and, once warm-up has called them, how its compiled graphs run (:meth:`graph_counts`), e.g.
        "engine, graphs from the run's graph cache (eager where it has none): 58 loaded, 2 eager" (nothing is compiled
        then: under ``--graphs auto`` the packages load and the rest run eager)."""
        e = self.engine
        if e is None:
            return "engine (the recommender's default buckets)"
        if e.graphs != "compile":
            return f"engine, graphs {e.graphs}"
        if e.graph_cache is None:
            how = "engine, graphs compile (compiled at warm-up)"
        else:
            how = "engine, graphs from the run's graph cache (" + ("eager where it has none)" if e.cache_only else "built where missing)")
        counts = self.graph_counts()
        return how + (": " + ", ".join(f"{n} {runs}" for runs, n in sorted(counts.items())) if counts else "")

    def graph_counts(self) -> dict[str, int]:
        """How many of the engine's compiled graphs run which way so far: {"loaded" | "built" | "compiled"
        | "eager": n} (:func:`hstu.backend.graphs.runs_as`; graphs not yet called are not counted);
        {} without compiled graphs."""
        e = self.engine
        if e is None or e.graphs != "compile":
            return {}
        return dict(Counter(g["runs"] for g in e.graph_report() if g["runs"] != "pending"))

    def _make_engine(self, use_engine: str):
        """The service's engine (its buckets and max_batch), or None for the Recommender's default."""
        if use_engine == "never":
            return None
        return self.rec.build_engine(self.buckets, self.max_batch, graphs=self.graphs, prefix_cache_bytes=self.prefix_cache_bytes)

    def prefix_counts(self) -> tuple[int, ...] | None:
        """The engine's user-prefix cache: counts so far (hits, misses, rows reused, evictions), then its
        bytes and entries now; None without one."""
        p = self.engine.prefix if self.engine is not None else None
        return None if p is None else (p.stats.hits, p.stats.misses, p.stats.rows_reused, p.stats.evictions, p.bytes, len(p))

    @property
    def precision(self) -> dict[str, str]:
        """What runs: {"precision": "fp32" | "bf16" | "fp16" | "int8", "embeddings": the item table's storage}."""
        q = getattr(self.rec.model, "quant_meta", None) or {}
        return {"precision": q.get("scheme", "fp32"), "embeddings": q.get("embeddings", "fp32")}

    def bucket_for(self, length: int) -> int:
        """The smallest edge >= ``length``; ValueError if none (the app truncates first)."""
        return smallest_edge(self.buckets, length)

    # ----- execution -----
    @torch.inference_mode()
    def run_batch(self, bucket: int, jobs: list[Job], describe: bool = True) -> list[Any]:
        """Execute one bucket's batch; returns, per job in order, a result or the exception it raised.

        A generate result is the list of k item dicts of ``Recommender.describe``
        ({"item_id" (original id), "score", "title"?, "action"?, "category"?}), or with
        ``describe=False`` its :class:`~hstu.generate.recommend.Ranked` dense ids, scores and
        actions (what the executors answer: the service describes them, so a model process sends
        arrays, :mod:`hstu.serve.wire`); a score result is a (C,) float64 NumPy array of scores in
        candidate order (NaN where the id is unknown).
        """
        if bucket not in self.buckets:
            raise ValueError(f"unknown bucket {bucket}; valid: {self.buckets}")
        for j in jobs:
            if len(j.prepared.ids) > bucket:
                raise ValueError(f"history of {len(j.prepared.ids)} events does not fit bucket {bucket}")
        out: list[Any] = [None] * len(jobs)
        with self._lock:
            score_idx = [i for i, j in enumerate(jobs) if j.kind == "score"]
            if score_idx:
                self._guarded(out, score_idx, lambda sub: self._score(bucket, [jobs[i] for i in sub]))
            for idx, run in self._generate_groups(bucket, jobs):
                self._guarded(out, idx, run)
        if describe:
            out = [self.rec.describe_ranked(r) if isinstance(r, Ranked) else r for r in out]
        return out

    @staticmethod
    def _guarded(out: list[Any], idx: list[int], run) -> None:
        """``run(sub)`` returns one result per job index of ``sub``; fill ``out`` at ``idx``. When
        the group raises, each job runs again alone, so an exception reaches only the job(s) that
        raise alone (one bad request does not fail its batch)."""
        try:
            res = run(idx)
            if len(res) != len(idx):
                raise RuntimeError(f"batch group returned {len(res)} results for {len(idx)} jobs")
            for i, r in zip(idx, res):
                out[i] = r
            return
        except Exception as exc:  # retried job by job below
            if len(idx) == 1:
                log.exception("batch job failed")
                out[idx[0]] = exc
                return
            log.warning("batch group of %d jobs failed (%s: %s); running each job alone", len(idx), type(exc).__name__, exc)
        for i in idx:
            try:
                out[i] = run([i])[0]
            except Exception as exc:  # reported to this job only
                log.exception("batch job failed alone")
                out[i] = exc

    def _generate_groups(self, bucket: int, jobs: list[Job]):
        groups: dict[tuple, list[int]] = {}
        for i, j in enumerate(jobs):
            if j.kind != "generate":
                continue
            d = j.decoding
            excl = self.rec.exclude_history_default if j.exclude_history is None else bool(j.exclude_history)
            allow = self.rec.allows_untrained(j.allow_untrained)
            if d.strategy == "greedy":
                key = ("greedy", excl, allow)
            elif d.strategy == "beam":
                key = ("beam", excl, allow, d.beam_width, j.k)
            else:
                key = ("topk", i)
            groups.setdefault(key, []).append(i)
        for idx in groups.values():
            j0 = jobs[idx[0]]
            excl = self.rec.exclude_history_default if j0.exclude_history is None else bool(j0.exclude_history)
            allow = self.rec.allows_untrained(j0.allow_untrained)
            yield idx, (lambda sub, e=excl, a=allow: self._generate(bucket, [jobs[i] for i in sub], e, a))

    def _generate(self, bucket: int, group: list[Job], excl: bool, allow: bool) -> list[Ranked]:
        d = group[0].decoding
        kmax = max(j.k for j in group)
        preps = [j.prepared for j in group]
        ranked = self.rec.rank(
            preps,
            kmax,
            decoding=d,
            exclude_history=excl,
            allow_untrained=allow,
            engine=self.engine,
            bucket=bucket if self.engine is not None else None,
            user_ids=[j.user_id for j in group] if any(j.user_id is not None for j in group) else None,
        )
        return [Ranked(r.items[: j.k], r.scores[: j.k], None if r.actions is None else r.actions[: j.k]) for r, j in zip(ranked, group)]

    def _score(self, bucket: int, jobs: list[Job]) -> list[np.ndarray]:
        model = self.model
        b = self.rec.batch([j.prepared for j in jobs], width=bucket + 1)  # static (B, E + 1)
        B = len(jobs)
        bidx = torch.arange(B, device=b["ids"].device)
        b["timestamps"][bidx, b["lengths"]] = b["request_time"]  # query-time slot
        seq = model.encode(b["ids"], b["timestamps"], b["lengths"], actions=b["actions"], categories=b["categories"])  # (B, E+1, d)
        user = model.last_rows(seq, b["lengths"])  # (B, d)
        C = max(len(j.candidates) for j in jobs)
        cand = torch.zeros(B, C, dtype=torch.int64)
        for r, j in enumerate(jobs):
            cand[r, : len(j.candidates)] = torch.from_numpy(np.asarray(j.candidates, dtype=np.int64))
        scores = model.score_items(user, cand.to(user.device)).double().cpu().numpy()  # (B, C)
        out = []
        for r, j in enumerate(jobs):
            s = scores[r, : len(j.candidates)].copy()
            s[np.asarray(j.candidates) == 0] = np.nan
            out.append(s)
        return out

    # ----- warm-up and memory -----
    def synthetic_jobs(self, bucket: int, n: int) -> list[Job]:
        """``n`` full-length (``bucket`` events) generate and score jobs over real item ids, for warm-up."""
        ids = (np.arange(bucket, dtype=np.int64) % self.num_items) + 1
        ts = 1_000_000_000 + 60 * np.arange(bucket, dtype=np.int64)
        cats = self.rec.item_tokens_np[ids]  # (bucket,) or (bucket, 1+F) with side features
        prep = Prepared(ids, ts, np.zeros(bucket, np.int64), cats, int(ts[-1]), [], [])
        # every item may be generated: warm-up must not depend on how much of the catalogue was trained
        jobs = [Job("generate", prep, k=self.max_k, allow_untrained=True) for _ in range(n)]
        jobs += [Job("score", prep, candidates=ids[: min(bucket, 8)]) for _ in range(n)]
        return jobs

    def warmup(self, bucket: int) -> float:
        """Run the bucket's generate and score paths at full batch and alone (with an engine that
        captures graphs or compiles: at every batch size of its ladder); returns seconds taken.
        Marks the bucket warm. Only here may the engine compile a graph (``Engine.compile_new``): a
        graph first needed by a request (a beam width, a prefix-cache extension) runs eager, since
        compiling it (minutes on a CPU) would outlast the request timeout."""
        t0 = time.perf_counter()
        sizes = [self.max_batch, 1]
        if self.engine is not None and self.engine.graphs != "eager":  # capture every padded batch size now, not on a request
            sizes = sorted(set(self.engine.batch_sizes), reverse=True)
        if self.engine is not None:
            self.engine.compile_new = True  # the greedy graphs compile here; a later first use (beam, extension) runs eager
        try:
            for n in sizes:
                res = self.run_batch(bucket, self.synthetic_jobs(bucket, n))
                err = next((r for r in res if isinstance(r, Exception)), None)
                if err is not None:
                    raise RuntimeError(f"warm-up of bucket {bucket} failed: {err}") from err
        finally:
            if self.engine is not None:
                self.engine.compile_new = False
        self.costs[bucket] = self._measure_cost(bucket)
        self.warm.add(bucket)
        self.backend_name = self._describe()  # with the graphs this warm-up loaded, built or compiled
        return time.perf_counter() - t0

    def _measure_cost(self, bucket: int, k: int = 5) -> tuple[float, float]:
        """(fixed s, s per request) of a greedy next-``k`` batch at this bucket: the best of two
        timed runs at 1 and at ``max_batch`` full-length histories, a line through the two."""
        k = min(k, self.max_k)
        times = {}
        for n in sorted({1, self.max_batch}):
            jobs = [Job("generate", j.prepared, k=k) for j in self.synthetic_jobs(bucket, n)[:n]]
            best = float("inf")
            for _ in range(2):
                t = time.perf_counter()
                self.run_batch(bucket, jobs)
                best = min(best, time.perf_counter() - t)
            times[n] = best
        per_row = max(0.0, (times[self.max_batch] - times[1]) / (self.max_batch - 1)) if self.max_batch > 1 else 0.0
        return max(0.0, times[1] - per_row), per_row

    def release_caches(self) -> None:
        """Drop what can be rebuilt (the engine's user-prefix cache, Python garbage; the engine's
        KV-cache pools are preallocated once and kept); called by the memory guard before the
        backend's ``empty_cache``."""
        if self.engine is not None:
            self.engine.release_caches()
        gc.collect()


__all__ = ["BatchRunner", "DecodeOptions", "Job"]
