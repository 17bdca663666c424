"""Admission: the predicted queueing delay of a new request, from the work actually queued.

A request is admitted when the work ahead of it (what is queued in every bucket plus what is
left of the batches now running, divided among the live model workers) is predicted to take no
longer than the delay bound. The cost of a batch at bucket edge E follows how
:class:`~hstu.serve.runner.BatchRunner` runs it: one model call per group, generate groups by
strategy, score jobs together. With M = max_batch and K a group's largest k (seconds):

=============================== ======================================================================
group (n jobs at bucket E)      predicted time
=============================== ======================================================================
greedy (same exclusion)         ceil(n / M) (F + F_k K) + n (R + R_k K)
beam (width W, k K)             ceil(n / u) (F + F_k K) + n R + n W K R_k,   u = max(1, M // W) users
                                per call (the engine's pool rows hold u users x W beams)
top-k sampling (each alone)     n (F + F_k K + R + R_k K)
score                           ceil(n / M) S + n S_r
=============================== ======================================================================

F, F_k, R, R_k (a call's fixed cost, its part per decode step, a row's cost, its part per step)
and S, S_r (score call, score row) are :class:`BucketCost`, measured per bucket at warm-up
(:func:`measure_bucket_cost`: greedy batches of 1 and M rows at k = 1 and k = max_k, score batches
of 1 and M). Every finished batch corrects them: per (bucket, kind) a scale, the log-space EWMA of
measured / predicted time (``ALPHA``; each ratio clipped to ``RATIO_CLIP``, the scale to
``SCALE_BOUNDS``), so a busy machine or a mis-modelled decoding path is learnt within a few
batches, and one freak batch moves the scale by at most ``RATIO_CLIP ** ALPHA``. A batch's time
is taken from its start to its answer in the serving process (pipe and event loop included).
What batch times miss (the dispatcher waiting for a busy event loop between batches) is learnt
from the quantity admission bounds itself: each admitted request's actual queue wait against the
delay predicted when it was admitted: ``wait_scale``, a factor on the whole prediction, tracks
the ``WAIT_QUANTILE`` quantile of that ratio (stochastic approximation in log space, ``WAIT_STEP``:
up by step x q when a request waited longer than predicted, down by step x (1 - q) otherwise; over
requests whose prediction was at least ``WAIT_MIN_S``, within ``WAIT_BOUNDS``), so that 99 % of the
requests admitted near the bound wait no longer than it. Because the prediction only counts work that exists, an empty queue with no batch running predicts 0 and
always admits: the service cannot lock itself out.

Measured on the 2-core dev box (small ML-1M model, engine, one thread), bucket 200: F ~1.3 ms,
F_k ~0.26 ms, R ~0.61 ms, R_k ~0.04 ms; a beam-16 next-10 job 13.6 ms (predicted 10.8 before any
correction), a greedy next-10 batch of 16: 20.1 ms.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass

ALPHA = 0.3  # EWMA weight of a finished batch's log(measured / predicted)
RATIO_CLIP = (0.125, 8.0)  # one batch's ratio is clipped to this before it enters the EWMA
SCALE_BOUNDS = (0.1, 10.0)  # the learnt correction stays within these factors of the warm-up costs
WAIT_QUANTILE = 0.99  # wait_scale tracks this quantile of (queue wait / delay predicted at admission)
WAIT_STEP = 0.02  # log-space step of that tracking per admitted request
WAIT_MIN_S = 0.05  # predictions shorter than this teach nothing (the batch window and scheduling noise dominate)
WAIT_BOUNDS = (0.25, 4.0)  # the queue-wait correction stays within these factors
KINDS = ("generate", "score")


@dataclass(frozen=True)
class BucketCost:
    """Cost line of one bucket (seconds, all >= 0): see the module table for the symbols.

    fixed (F), fixed_step (F_k), row (R), row_step (R_k): generate; score_fixed (S), score_row (S_r).
    """

    fixed: float
    fixed_step: float
    row: float
    row_step: float
    score_fixed: float
    score_row: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# Used for a bucket with no warm-up measurement (warm-up off); the scale then learns the rest.
DEFAULT_COST = BucketCost(fixed=2e-3, fixed_step=2e-4, row=5e-4, row_step=5e-5, score_fixed=1e-3, score_row=5e-4)


def group_key(job) -> tuple:
    """The runner's group of a job, with its k: (kind, group id..., k). ``job`` is a
    :class:`~hstu.serve.runner.Job`."""
    if job.kind == "score":
        return ("score",)
    d = job.decoding
    if d.strategy == "beam":
        return ("beam", job.exclude_history, int(d.beam_width), int(job.k))
    if d.strategy == "topk":
        return ("topk", int(job.k))
    return ("greedy", job.exclude_history)


class WorkTally:
    """Jobs queued in one bucket, counted per runner group (add / remove are O(1)).

    ``groups`` maps a greedy key to Counter{k: jobs}, every other key to Counter{key's k: jobs}.
    """

    def __init__(self, jobs=()) -> None:
        self.groups: dict[tuple, Counter] = {}
        for j in jobs:
            self.add(j)

    def add(self, job) -> None:
        key = group_key(job)
        self.groups.setdefault(key, Counter())[int(job.k)] += 1

    def remove(self, job) -> None:
        key = group_key(job)
        c = self.groups.get(key)
        if c is None:
            return
        c[int(job.k)] -= 1
        if c[int(job.k)] <= 0:
            del c[int(job.k)]
        if not c:
            del self.groups[key]

    def seconds(self, cost: BucketCost, max_batch: int) -> dict[str, float]:
        """Predicted model time of these jobs by kind, {"generate": s, "score": s}, from ``cost``
        (uncorrected; the module table's formulas)."""
        M = max(1, int(max_batch))
        gen = score = 0.0
        for key, ks in self.groups.items():
            n = sum(ks.values())
            if key[0] == "score":
                score += math.ceil(n / M) * cost.score_fixed + n * cost.score_row
                continue
            K = max(ks)
            call = cost.fixed + cost.fixed_step * K
            if key[0] == "greedy":
                gen += math.ceil(n / M) * call + n * (cost.row + cost.row_step * K)
            elif key[0] == "beam":
                W = key[2]
                gen += math.ceil(n / max(1, M // W)) * call + n * cost.row + n * W * K * cost.row_step
            else:  # top-k sampling: each job alone
                gen += sum(c * (cost.fixed + cost.row + (cost.fixed_step + cost.row_step) * k) for k, c in ks.items())
        return {"generate": gen, "score": score}


class DelayModel:
    """Per-bucket costs and their learnt scales; predicts batch times and learns from measured ones.

    Args:
        max_batch: requests per batch (M in the table).
        costs: bucket edge -> :class:`BucketCost` measured at warm-up (missing: ``DEFAULT_COST``).
    """

    def __init__(self, max_batch: int, costs: dict[int, BucketCost] | None = None) -> None:
        self.max_batch = int(max_batch)
        self.costs = costs if costs is not None else {}
        self.scale: dict[tuple[int, str], float] = {}
        self.wait_scale = 1.0  # queue wait / predicted delay, learnt from admitted requests

    def cost(self, edge: int) -> BucketCost:
        return self.costs.get(edge, DEFAULT_COST)

    def predict(self, edge: int, tally: WorkTally) -> dict[str, float]:
        """Corrected predicted seconds by kind of the tallied jobs run at ``edge``."""
        raw = tally.seconds(self.cost(edge), self.max_batch)
        return {k: v * self.scale.get((edge, k), 1.0) for k, v in raw.items()}

    def learn(self, edge: int, predicted: dict[str, float], measured_s: float) -> float | None:
        """Fold one finished batch into the scales of the kinds it held; returns the clipped ratio
        measured / predicted (None when nothing was predicted)."""
        total = sum(predicted.values())
        if total <= 0 or not math.isfinite(measured_s) or measured_s < 0:
            return None
        ratio = min(max(measured_s / total, RATIO_CLIP[0]), RATIO_CLIP[1])
        for kind, p in predicted.items():
            if p > 0:
                s = self.scale.get((edge, kind), 1.0) * ratio**ALPHA
                self.scale[(edge, kind)] = min(max(s, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
        return ratio

    def learn_wait(self, predicted_s: float, waited_s: float) -> None:
        """Fold one admitted request's queue wait into ``wait_scale`` (``predicted_s``: the delay
        predicted at its admission, ``wait_scale`` included; ignored below ``WAIT_MIN_S``)."""
        if predicted_s < WAIT_MIN_S or not math.isfinite(waited_s):
            return
        step = WAIT_STEP * WAIT_QUANTILE if waited_s > predicted_s else -WAIT_STEP * (1.0 - WAIT_QUANTILE)
        self.wait_scale = min(max(self.wait_scale * math.exp(step), WAIT_BOUNDS[0]), WAIT_BOUNDS[1])


def measure_bucket_cost(runner, edge: int, reps: int = 2) -> BucketCost:
    """Time greedy generate batches of 1 and ``runner.max_batch`` full-length histories at k = 1 and
    k = ``runner.max_k``, and score batches of 1 and max_batch (best of ``reps`` each), and solve the
    module table's lines. Call after the bucket's warm-up. ``runner``: a
    :class:`~hstu.serve.runner.BatchRunner`."""
    from hstu.serve.runner import Job

    M, kmax = runner.max_batch, max(1, runner.max_k)
    base = runner.synthetic_jobs(edge, M)
    gen, sco = base[:M], base[M:]

    def best(jobs) -> float:
        t = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.run_batch(edge, jobs, describe=False)  # as served: the executors answer undescribed items
            t = min(t, time.perf_counter() - t0)
        return t

    def line(t1: float, tm: float) -> tuple[float, float]:
        per = max(0.0, (tm - t1) / (M - 1)) if M > 1 else 0.0
        return max(0.0, t1 - per), per  # (call, row)

    at = {}
    for k in sorted({1, kmax}):
        jobs = [Job("generate", j.prepared, k=k) for j in gen]
        at[k] = line(best(jobs[:1]), best(jobs))
    (f1, r1), (fk, rk) = at[1], at[kmax]
    steps = kmax - 1
    f_step = max(0.0, (fk - f1) / steps) if steps else 0.0
    r_step = max(0.0, (rk - r1) / steps) if steps else 0.0
    s_fixed, s_row = line(best(sco[:1]), best(sco))
    return BucketCost(max(0.0, f1 - f_step), f_step, max(0.0, r1 - r_step), r_step, s_fixed, s_row)


__all__ = [
    "ALPHA",
    "DEFAULT_COST",
    "KINDS",
    "RATIO_CLIP",
    "SCALE_BOUNDS",
    "WAIT_BOUNDS",
    "WAIT_MIN_S",
    "WAIT_QUANTILE",
    "WAIT_STEP",
    "BucketCost",
    "DelayModel",
    "WorkTally",
    "group_key",
    "measure_bucket_cost",
]
