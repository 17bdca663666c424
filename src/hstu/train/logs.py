"""What training tells a person while it runs: one readable line per epoch, the step progress (a
tqdm bar on a terminal only; a few rate-limited log lines otherwise) and, optionally, TensorBoard
scalars. The per-epoch CSV is part of the run's commit (:mod:`hstu.model.curves`), not of this module.

Epoch line (through :mod:`logging`, logger ``hstu.train.loop``)::

    epoch 3/10  loss 5.8120  valid HR@10 .2011  NDCG@10 .1093  312 seq/s  41.2 s  (best)

TensorBoard: ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` extra), one scalar per
metrics.csv column at ``global_step`` = epoch, tags ``train/loss``, ``train/sequences_per_s``, ...,
``valid/HR@10``, ...; on resume, ``purge_step`` drops the events of epochs past the last commit.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from hstu.model.curves import BASE_COLUMNS, rows

log = logging.getLogger("hstu.train.loop")

LINE_METRICS = ("HR@10", "NDCG@10")  # the validation metrics an epoch line shows
PROGRESS_SHARE = 0.25  # without a terminal: a progress line at each quarter of an epoch's steps ...
PROGRESS_MIN_S = 30.0  # ... at most one every 30 s


def _metric(v: float) -> str:
    """A metric in [0, 1] as ``.2011`` (4 decimals, no leading zero)."""
    return f"{v:.4f}".removeprefix("0")


def policy_text(exclude_history: bool) -> str:
    """The candidate policy as printed beside a metric: ``exclude_history=on`` / ``=off``."""
    return f"exclude_history={'on' if exclude_history else 'off'}"


def epoch_line(entry: dict, epochs: int, best: bool, exclude_history: bool | None = None) -> str:
    """One history entry (history.json's form) as a line: epoch i/n, mean loss, the validation
    :data:`LINE_METRICS` when the epoch was evaluated (with the candidate policy, e.g.
    ``exclude_history=on``, when given), throughput (sequences/s), seconds, and
    ``(best)`` when it holds the best validation NDCG@10 so far."""
    parts = [f"epoch {entry['epoch']}/{epochs}", f"loss {entry['loss']:.4f}"]
    valid = entry.get("valid")
    if valid:
        policy = "" if exclude_history is None else f"  {policy_text(exclude_history)}"
        parts.append("valid " + "  ".join(f"{k} {_metric(valid[k])}" for k in LINE_METRICS if k in valid) + policy)
    parts += [f"{entry['sequences_per_s']:.0f} seq/s", f"{entry['seconds']:.1f} s"]
    if best:
        parts.append("(best)")
    return "  ".join(parts)


def progress(batches: list, desc: str, enabled: bool, stream=None, clock=time.perf_counter) -> Iterator[tuple[int, object, tqdm]]:
    """Iterate ``batches`` as (step, batch, bar), showing progress when ``enabled``: a tqdm bar on
    ``stream`` (default stderr) only when it is a terminal (tqdm's ``disable=None``); otherwise an
    INFO line at each :data:`PROGRESS_SHARE` of the steps, at most one per :data:`PROGRESS_MIN_S`
    seconds. The caller sets ``bar.set_postfix(...)``; the last postfix is in the log line."""
    stream = sys.stderr if stream is None else stream
    bar = tqdm(batches, desc=desc, disable=None if enabled else True, leave=False, mininterval=2.0, file=stream)
    quiet_lines = enabled and bar.disable
    t0 = last = clock()
    n, mark = len(batches), PROGRESS_SHARE
    try:
        for i, b in enumerate(bar):
            yield i, b, bar
            if quiet_lines and (i + 1) / n >= mark:
                while (i + 1) / n >= mark:
                    mark += PROGRESS_SHARE
                now = clock()
                if now - last >= PROGRESS_MIN_S and i + 1 < n:
                    log.info("%s: %d/%d steps (%.0f%%), %.0f s%s", desc, i + 1, n, 100 * (i + 1) / n, now - t0, _postfix(bar))
                    last = now
    finally:
        bar.close()


def _postfix(bar: tqdm) -> str:
    post = getattr(bar, "postfix", None)
    return f", {post}" if post else ""


def _tag(column: str) -> str:
    """metrics.csv column -> TensorBoard tag: ``loss`` -> ``train/loss``, ``valid_HR@10`` -> ``valid/HR@10``."""
    if column in BASE_COLUMNS:
        return f"train/{column}"
    split, _, name = column.partition("_")
    return f"{split}/{name}"


class TensorBoardCurves:
    """Epoch scalars to a TensorBoard log directory (``--tensorboard DIR``).

    Raises ValueError (one line naming the extra) when the ``tensorboard`` package is absent."""

    def __init__(self, logdir: str | Path, first_epoch: int = 1) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("--tensorboard needs the optional package 'tensorboard': pip install 'hstu[tensorboard]'") from None
        # purge_step: events of epochs >= first_epoch (written before a kill, never committed) are dropped
        self.writer = SummaryWriter(str(logdir), purge_step=first_epoch if first_epoch > 1 else None)

    def epoch(self, entry: dict) -> None:
        """One history entry's scalars at global_step = its epoch."""
        (row,) = rows([entry])
        for col, value in row.items():
            if col != "epoch":
                self.writer.add_scalar(_tag(col), value, entry["epoch"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
