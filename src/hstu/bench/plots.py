"""PNG plots of an ``hstu bench`` result: P50 latency per history length (the sweep at its batch
size; one line per column) and the latency CDF per precision (every timed call at the batch size).
matplotlib is the ``plot`` extra; without it no file is written and the reason is returned."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hstu.bench.table import columns
from hstu.report.plots import pyplot, save_png


def write_plots(results: list[dict], out: Path) -> tuple[list[Path], str | None]:
    """``latency_per_length.png`` and ``latency_cdf.png`` under ``out`` for every measured column of
    ``results``; returns (files written, None) or ([], why none were: matplotlib absent)."""
    try:
        plt = pyplot()
    except ImportError as exc:
        return [], f"{exc}: no PNG plots"
    cols = [(label, c) for label, c in columns(results) if "unavailable" not in c and c.get("times_ms")]
    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, c in cols:
        lengths = (c.get("sweep") or {}).get("lengths") or {}
        pts = sorted((int(L), v["p50_ms"]) for L, v in lengths.items() if v.get("p50_ms") is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set(xlabel="history length (events)", ylabel="P50 latency per call (ms)", title="next-k latency per history length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(save_png(fig, out / "latency_per_length.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, c in cols:
        t = np.sort(np.asarray(c["times_ms"]))
        ax.step(t, np.arange(1, t.size + 1) / t.size, where="post", label=f"{label} (batch {c.get('batch', '?')})")
    ax.set(xlabel="latency per call (ms)", ylabel="fraction of calls", title="latency CDF per precision")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(save_png(fig, out / "latency_cdf.png"))
    return files, None
