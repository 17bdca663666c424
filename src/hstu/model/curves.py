"""Training curves as a table: RUN_DIR/metrics.csv, one row per committed epoch, rendered from the
run's history (the manifest's ``history``, the same list as history.json).

Columns: ``epoch``, ``loss`` (mean training loss, weighted by sequences), ``seconds`` (the epoch's
training time, s), ``sequences_per_s``, ``positions`` (target positions trained), then one column
per evaluation metric of the epoch, named ``valid_<metric>`` (``valid_HR@10``, ``valid_NDCG@10``,
..., ``valid_users``) and, under ``--protocol paper``, ``test_<metric>``. An epoch without an
evaluation (``eval_every`` > 1) leaves those cells empty. The learning rate is not a column: the
recipe's AdamW has no schedule (it is ``[train] learning_rate`` in config.json).

The file is a function of the history only and is rewritten whole at each epoch's commit
(:func:`hstu.runs.save_train_state`, after history.json) and by :func:`hstu.runs.repair_run_files`
on ``--resume``, so after a kill and resume every epoch appears exactly once and the file equals
history.json. Floats are written with ``repr`` (shortest round-trip form), so each cell reads back
as the exact float history.json holds. Format: RFC 4180 CSV through the :mod:`csv` module.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from hstu.model.checkpoint import write_text

METRICS_CSV = "metrics.csv"
BASE_COLUMNS = ("epoch", "loss", "seconds", "sequences_per_s", "positions")
SPLITS = ("valid", "test")  # the nested tables of a history entry that become columns


def columns(history: list[dict]) -> list[str]:
    """The CSV header for ``history`` (entries as in history.json): :data:`BASE_COLUMNS`, then
    ``<split>_<metric>`` for every metric of every split in the order first seen."""
    cols = list(BASE_COLUMNS)
    for entry in history:
        for split in SPLITS:
            for name in entry.get(split, {}):
                col = f"{split}_{name}"
                if col not in cols:
                    cols.append(col)
    return cols


def rows(history: list[dict]) -> list[dict]:
    """One flat dict per epoch (column -> value; a metric the epoch lacks is absent)."""
    out = []
    for entry in history:
        row = {c: entry[c] for c in BASE_COLUMNS if c in entry}
        for split in SPLITS:
            row.update({f"{split}_{k}": v for k, v in entry.get(split, {}).items()})
        out.append(row)
    return out


def render(history: list[dict]) -> str:
    """metrics.csv's text for ``history`` (header line, then one line per entry; ``\\n`` line ends)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns(history), lineterminator="\n", restval="")
    w.writeheader()
    for row in rows(history):
        w.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
    return buf.getvalue()


def write_curves(run: str | Path, history: list[dict]) -> None:
    """Write RUN/metrics.csv for ``history`` atomically (temp file + rename, with the test seam
    :func:`hstu.model.checkpoint.write_text`, with its test seam)."""
    write_text(Path(run) / METRICS_CSV, render(history))


def read_curves(run: str | Path) -> list[dict]:
    """RUN/metrics.csv as a list of dicts (column -> int / float; empty cells left out).
    Raises FileNotFoundError naming the file, ValueError naming file, line and column of a cell
    that is not a number."""
    path = Path(run) / METRICS_CSV
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found (runs trained before metrics.csv existed have only history.json)")
    out = []
    with path.open(encoding="utf-8", newline="") as f:
        for line, rec in enumerate(csv.DictReader(f), start=2):
            row = {}
            for k, v in rec.items():
                if v in ("", None):
                    continue
                try:
                    row[k] = int(v) if k in ("epoch", "positions") or k.endswith("_users") else float(v)
                except ValueError:
                    raise ValueError(f"{path}: line {line}, column {k!r}: not a number ({v!r})") from None
            out.append(row)
    return out
