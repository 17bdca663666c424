"""``hstu report --run RUN --out DIR [--vs RUN2 ...]``: training curves as PNG files and a Markdown
summary (:mod:`hstu.report.summary`) of a run, or of several overlaid and side by side.

Writes into DIR: ``loss.png`` (mean training loss per epoch), ``valid_hr10.png`` and
``valid_ndcg10.png`` (validation HR@10 / NDCG@10 per epoch), one line per run, and ``report.md``;
with ``--slices`` also ``slices.png`` and ``slices.json`` (:mod:`hstu.report.slices`).
Every run is read and checked before anything is written. DIR must be new or empty, or hold an earlier
report's files only (report.md, the PNG files, slices.json) with ``--overwrite``: the rule of ``hstu bench --out``
(:func:`hstu.model.checkpoint.check_out_dir`), checked before any run is evaluated; a run directory (config.json and
idmap.json) is refused, as its own report.md and plots are there. The report is built in a hidden directory
beside DIR and moved there when complete (:func:`hstu.model.checkpoint.staged_dir`): an error or Ctrl-C
leaves DIR as it was. A quantized run (quant.json) has no training history: refused, naming the float run
it was made from. Errors a user can fix (a missing run or file, a malformed one, matplotlib absent, a bad
--out, ``--resamples`` without ``--slices``) are one line and exit 2 (:func:`hstu.cli.main`).
"""

from __future__ import annotations

import json
from pathlib import Path

from hstu.model.checkpoint import staged_dir, write_text
from hstu.report.plots import plot_curves
from hstu.report.slices import plot_slices, run_slices, slice_table
from hstu.report.summary import CURVE_METRICS, markdown, read_run_facts

REPORT = "report.md"
OUT_FILES = (REPORT, "loss.png", "valid_hr10.png", "valid_ndcg10.png", "slices.png", "slices.json")  # report.md: the marker
RESAMPLES = 1000  # --slices' default bootstrap resamples


def add_subcommands(sub) -> None:
    from hstu.cli import number_in  # lazy: report -> cli (hstu.cli loads this module)

    r = sub.add_parser("report", help="PNG training curves and a Markdown summary of a run (or several: --vs)")
    r.add_argument("--run", required=True, help="run directory (hstu train --out)")
    r.add_argument("--vs", nargs="+", default=[], metavar="RUN", help="other run directories, overlaid and side by side")
    r.add_argument("--out", required=True, help="directory for report.md and the PNG files (new or empty, unless --overwrite)")
    r.add_argument("--overwrite", action="store_true", help="replace an earlier report in --out (it holds report.md); never other files")
    r.add_argument(
        "--slices",
        action="store_true",
        help="also evaluate each run's test slices (next item / action, purchases, repeats, cold start, long tail; "
        "95 %% bootstrap CIs): slices.png, slices.json and a table (loads each run's weights and data)",
    )
    r.add_argument("--resamples", type=number_in(int, 10), help=f"bootstrap resamples for --slices (default {RESAMPLES})")
    r.add_argument("--device", default="cpu", help="device for --slices (default cpu)")
    r.set_defaults(func=cmd_report)


def _labels(paths: list[str]) -> list[str]:
    """Each run's directory name; the whole path where two names are the same."""
    names = [Path(p).name or str(p) for p in paths]
    return [str(p) if names.count(n) > 1 else n for p, n in zip(paths, names)]


def check_out(out: str | Path, overwrite: bool = False) -> None:
    """Refuse an --out that would lose something (exit 2, one line): a file at it or on its path (ValueError), a run
    directory (FileExistsError: its own report.md and plots are there), else :func:`hstu.model.checkpoint.check_out_dir`'s rule
    with :data:`OUT_FILES` (new or empty, or an earlier report's files only with ``overwrite``)."""
    from hstu.model.checkpoint import check_out_dir
    from hstu.model.run_files import CONFIG, IDMAP

    out = Path(out)
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # a file at --out or on its path: [Errno 17] / [Errno 20] alone
        raise ValueError(f"--out {out}: not a directory ({blocker} is a file)")
    if (out / CONFIG).is_file() and (out / IDMAP).is_file():
        raise FileExistsError(f"--out {out}: is a run directory (it holds {CONFIG} and {IDMAP}); write the report to another directory")
    check_out_dir(str(out), overwrite, OUT_FILES, "report")


def write_report(
    runs: list[str], out: str | Path, slices: bool = False, device: str = "cpu", resamples: int = RESAMPLES, overwrite: bool = False
) -> list[Path]:
    """Read ``runs`` (the first is the report's subject), write the plots and report.md into ``out``
    (with ``slices``: also :mod:`hstu.report.slices`' table, slices.png and slices.json), all or nothing;
    returns the files written. Raises FileNotFoundError / ValueError (a run's files; a run given twice; a
    quantized run), FileExistsError / ValueError (``out``, :func:`check_out`), ImportError
    (matplotlib absent: ``pip install 'hstu[plot]'``)."""
    seen: dict[Path, str] = {}
    for p in runs:  # the curves are keyed by label: a repeated run drew one line for two and a doubled column
        if (key := Path(p).resolve()) in seen:
            raise ValueError(f"--vs {p}: the same run as {seen[key]} (compare different runs)")
        seen[key] = str(p)
    check_out(out, overwrite)  # before any run is read or evaluated
    facts = [read_run_facts(p, label) for p, label in zip(runs, _labels(runs))]
    from hstu.report.plots import pyplot

    pyplot()  # ImportError before anything is written
    reports = [run_slices(f.path, device, resamples) for f in facts] if slices else None
    check_out(out, overwrite)  # again: files may have appeared in --out while the slices were evaluated
    out = Path(out)
    with staged_dir(out, last=REPORT) as tmp:
        names = _write_files(tmp, facts, reports)
    return [out / n for n in names]


def _write_files(d: Path, facts: list, reports: list[dict] | None) -> list[str]:
    """The plots, slices.json (with ``reports``) and report.md in directory ``d``; their names, report.md last."""
    what = facts[0].label if len(facts) == 1 else f"{len(facts)} runs"
    plots = [plot_curves(d / "loss.png", {f.label: f.curve("loss") for f in facts}, title=f"{what}: training loss", ylabel="mean loss")]
    for k in CURVE_METRICS:
        name = "valid_" + k.lower().replace("@", "") + ".png"
        curves = {f.label: f.curve(k, "valid") for f in facts}
        plots.append(plot_curves(d / name, curves, title=f"{what}: validation {k} per epoch", ylabel=f"validation {k}"))
    table, data = [], []
    if reports is not None:
        labels = [f.label for f in facts]
        plots.append(plot_slices(d / "slices.png", labels, reports))
        table = slice_table(labels, reports)
        write_text(d / "slices.json", json.dumps(dict(zip(labels, reports)), indent=2))
        data = ["slices.json"]
    write_text(d / REPORT, markdown(facts, plots, table))
    return [*(p.name for p in plots), *data, REPORT]


def cmd_report(args) -> int:
    if args.resamples is not None and not args.slices:
        raise ValueError(f"--resamples {args.resamples}: needs --slices (the bootstrap resamples of the slice intervals)")
    try:
        files = write_report(
            [args.run, *args.vs], args.out, args.slices, args.device, args.resamples or RESAMPLES, overwrite=args.overwrite
        )
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    for f in files:
        print(f)
    return 0
