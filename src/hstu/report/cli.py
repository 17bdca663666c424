"""``hstu report --run RUN --out DIR [--vs RUN2 ...]``: training curves as PNG files and a Markdown
summary (:mod:`hstu.report.summary`) of a run, or of several overlaid and side by side.

Writes into DIR: ``loss.png`` (mean training loss per epoch), ``valid_hr10.png`` and
``valid_ndcg10.png`` (validation HR@10 / NDCG@10 per epoch), one line per run, and ``report.md``;
with ``--slices`` also ``slices.png`` and ``slices.json`` (:mod:`hstu.report.slices`).
Every run is read and checked before anything is written; each file is written atomically.
Errors a user can fix (a missing run or file, a malformed one, matplotlib absent) are one line and
exit 2 (:func:`hstu.cli.main`).
"""

from __future__ import annotations

import json
from pathlib import Path

from hstu.model.checkpoint import write_text
from hstu.report.plots import plot_curves
from hstu.report.slices import plot_slices, run_slices, slice_table
from hstu.report.summary import CURVE_METRICS, markdown, read_run_facts

REPORT = "report.md"


def add_subcommands(sub) -> None:
    from hstu.cli import number_in  # lazy: report -> cli (hstu.cli loads this module)

    r = sub.add_parser("report", help="PNG training curves and a Markdown summary of a run (or several: --vs)")
    r.add_argument("--run", required=True, help="run directory (hstu train --out)")
    r.add_argument("--vs", nargs="+", default=[], metavar="RUN", help="other run directories, overlaid and side by side")
    r.add_argument("--out", required=True, help="directory for report.md and the PNG files (created)")
    r.add_argument(
        "--slices",
        action="store_true",
        help="also evaluate each run's test slices (next item / action, purchases, repeats, cold start, long tail; "
        "95 %% bootstrap CIs): slices.png, slices.json and a table (loads each run's weights and data)",
    )
    r.add_argument("--resamples", type=number_in(int, 10), default=1000, help="bootstrap resamples for --slices (default 1000)")
    r.add_argument("--device", default="cpu", help="device for --slices (default cpu)")
    r.set_defaults(func=cmd_report)


def _labels(paths: list[str]) -> list[str]:
    """Each run's directory name; the whole path where two names are the same."""
    names = [Path(p).name or str(p) for p in paths]
    return [str(p) if names.count(n) > 1 else n for p, n in zip(paths, names)]


def write_report(runs: list[str], out: str | Path, slices: bool = False, device: str = "cpu", resamples: int = 1000) -> list[Path]:
    """Read ``runs`` (the first is the report's subject), write the plots and report.md into ``out``
    (with ``slices``: also :mod:`hstu.report.slices`' table, slices.png and slices.json); returns the
    files written. Raises FileNotFoundError / ValueError (a run's files; a run given twice), ImportError
    (matplotlib absent: ``pip install 'hstu[plot]'``)."""
    seen: dict[Path, str] = {}
    for p in runs:  # the curves are keyed by label: a repeated run drew one line for two and a doubled column
        if (key := Path(p).resolve()) in seen:
            raise ValueError(f"--vs {p}: the same run as {seen[key]} (compare different runs)")
        seen[key] = str(p)
    facts = [read_run_facts(p, label) for p, label in zip(runs, _labels(runs))]
    from hstu.report.plots import pyplot

    pyplot()  # ImportError before anything is written
    reports = [run_slices(f.path, device, resamples) for f in facts] if slices else None
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file at --out or on its path: [Errno 17] / [Errno 20] alone
        blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), out)
        raise ValueError(f"--out {out}: not a directory ({blocker} is a file)") from None
    what = facts[0].label if len(facts) == 1 else f"{len(facts)} runs"
    plots = [plot_curves(out / "loss.png", {f.label: f.curve("loss") for f in facts}, title=f"{what}: training loss", ylabel="mean loss")]
    for k in CURVE_METRICS:
        name = "valid_" + k.lower().replace("@", "") + ".png"
        curves = {f.label: f.curve(k, "valid") for f in facts}
        plots.append(plot_curves(out / name, curves, title=f"{what}: validation {k} per epoch", ylabel=f"validation {k}"))
    table, data = [], []
    if reports is not None:
        labels = [f.label for f in facts]
        plots.append(plot_slices(out / "slices.png", labels, reports))
        table = slice_table(labels, reports)
        write_text(out / "slices.json", json.dumps(dict(zip(labels, reports)), indent=2))
        data = [out / "slices.json"]
    write_text(out / REPORT, markdown(facts, plots, table))
    return [*plots, *data, out / REPORT]


def cmd_report(args) -> int:
    try:
        files = write_report([args.run, *args.vs], args.out, args.slices, args.device, args.resamples)
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    for f in files:
        print(f)
    return 0
