"""``hstu report --slices``: the evaluation slices of each run on its test split
(:func:`hstu.train.slices.scorer_slices`: next item, next action, purchases, repeat / new targets,
cold start, long-tail coverage, each with a 95 % bootstrap interval over users), as a table, a PNG
(value and interval per slice, a bar per run) and ``slices.json`` (the whole reports).

Computing them loads each run's weights (``hstu.runs.load_run``) and data set (as ``hstu eval``
reads it), so it is opt-in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hstu.report.plots import pyplot, save_png

# (row name, path into a slice_report dict)
SLICES = (
    ("HR@10, all users", ("next_item", "HR@10")),
    ("NDCG@10, all users", ("next_item", "NDCG@10")),
    ("HR@10, purchase targets", ("purchase", "HR@10")),
    ("HR@10, repeat targets", ("repeat", "repeat_targets", "HR@10")),
    ("HR@10, new targets", ("repeat", "new_targets", "HR@10")),
    ("HR@10, history cut to 1 event", ("cold_start", "by_history", "1", "HR@10")),
    ("HR@10, history cut to 2 events", ("cold_start", "by_history", "2", "HR@10")),
    ("next-action accuracy", ("next_action", "accuracy")),
    ("long-tail share of next-10", ("diversity", "long_tail_coverage")),
)


def run_slices(run: Path, device: str = "cpu", resamples: int = 1000, seed: int = 0) -> dict:
    """The slice report (:func:`hstu.train.slices.slice_report`'s dict) of a float run on test."""
    from hstu.cli import _run_data  # the run's data set as hstu eval reads it (lazy: report -> cli)
    from hstu.runs import load_run
    from hstu.train.baselines import training_counts
    from hstu.train.slices import ModelScorer, scorer_slices

    model, cfg, _ = load_run(run, device)
    log_, split, _ = _run_data(cfg)
    scorer = ModelScorer(model, Path(run).name, device)
    report, _ = scorer_slices(scorer, log_, split, "test", popularity=training_counts(log_, split), resamples=resamples, seed=seed)
    return report


def cells(report: dict) -> dict[str, dict]:
    """Row name -> {"value", "ci"} for each of :data:`SLICES` the report has."""
    out = {}
    for name, path in SLICES:
        node = report
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and "value" in node:
            out[name] = node
    return out


def slice_table(labels: list[str], reports: list[dict]) -> list[str]:
    """Markdown lines: a row per slice, a column per run, ``value [lo, hi]`` (4 decimals)."""
    per_run = [cells(r) for r in reports]
    names = [n for n, _ in SLICES if any(n in c for c in per_run)]
    lines = ["| slice (test, 95 % CI) | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for n in names:
        row = [f"{c[n]['value']:.4f} [{c[n]['ci'][0]:.4f}, {c[n]['ci'][1]:.4f}]" if n in c else "—" for c in per_run]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    return lines


def plot_slices(path: Path, labels: list[str], reports: list[dict]) -> Path:
    """Horizontal bars: a group per slice, a bar per run, the 95 % interval as an error bar."""
    plt = pyplot()
    per_run = [cells(r) for r in reports]
    names = [n for n, _ in SLICES if any(n in c for c in per_run)]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(names) * max(len(labels), 1) + 1.5), dpi=120)
    h = 0.8 / max(len(labels), 1)
    y = np.arange(len(names))
    for i, (label, c) in enumerate(zip(labels, per_run)):
        v = np.array([c[n]["value"] if n in c else np.nan for n in names])
        lo = np.array([c[n]["value"] - c[n]["ci"][0] if n in c else 0.0 for n in names])
        hi = np.array([c[n]["ci"][1] - c[n]["value"] if n in c else 0.0 for n in names])
        ax.barh(y + i * h, v, height=h, xerr=[lo, hi], capsize=3, label=label)
    ax.set_yticks(y + h * (len(labels) - 1) / 2, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("value (test split, 95 % bootstrap CI)")
    ax.set_title("evaluation slices")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8)
    return save_png(fig, path, dpi=120)
