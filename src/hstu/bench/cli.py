"""``hstu bench``: the reference port's benchmark table for a run on this machine, in one command.

    hstu bench --run RUN [--device auto|cpu|cuda|npu] [--precisions fp32,fp16,bf16,int8] [--batch 16]
               [--lengths 50,100,200] [--serve] [--out DIR [--overwrite]] [--compare FILE.json ...] [--quick]
    hstu bench --preset small|large|prod ...      (random weights: no run, no quality)
    hstu bench --compare A.json --compare B.json  (print saved results side by side)

For each precision: next-k generation P50 / P99 latency per call at --batch (histories of the
longest --lengths value that fits the model), QPS (users / s), peak memory (device, else host RSS),
model bytes, test HR@10 / NDCG@10; the length sweep at --sweep-batch (P50 per length, growth from
the shortest to the longest); with --serve the HTTP figures of ``hstu serve`` at that precision
(the highest offered rate whose step kept P99 <= 100 ms, P50 / P99 there). A precision without a fast
kernel here, or one the model does not run at (a SASRec run is fp32 only; a quantized run only its
scheme), is an n/a column with a footnote saying why, named in --precisions or not. Prints a Markdown
table with the reference port's published columns; --out writes bench.json (every figure, raw call
times, the environment), bench.md and PNG plots: built in a hidden directory beside --out and moved
there when complete (an error or Ctrl-C leaves --out as it was). --out must be new or empty, or hold
an earlier bench's output with --overwrite (replaced whole); it is checked before anything is measured.

A run whose weights do not open (missing, truncated) is refused before anything is measured or written; so is a
--compare file named twice.

Exit codes: 0 done; 2 bad flag, run, result file or --out (one line naming it).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from hstu.bench.cells import PRECISIONS, Settings

OUT_FILES = ("bench.json", "bench.md", "latency_per_length.png", "latency_cdf.png")  # what --out holds; bench.json (its marker) last

QUICK = {"repeats": 5, "warmup": 1, "steps": [5.0, 10.0, 20.0, 40.0], "step_s": 2.0, "serve_budget_s": 30.0}
FULL = {
    "repeats": 30,
    "warmup": 3,
    "steps": [10.0, 25.0, 50.0, 100.0, 150.0, 200.0, 300.0, 400.0, 600.0],
    "step_s": 8.0,
    "serve_budget_s": 180.0,
}


def _precisions(text: str) -> tuple[str, ...]:
    got = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in got if p not in PRECISIONS]
    if bad or not got or len(set(got)) != len(got):
        raise argparse.ArgumentTypeError(f"expected distinct values of {','.join(PRECISIONS)}, got {text!r}")
    return got


def _lengths(text: str) -> tuple[int, ...]:
    try:
        got = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None
    if not got or got[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return got


def add_subcommands(subparsers) -> None:
    """Add ``bench`` to the ``hstu`` command line."""
    from hstu.cli import number_in
    from hstu.config import PRESETS

    p = subparsers.add_parser(
        "bench",
        help="benchmark table of a run (latency, QPS, memory, quality per precision)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", help="run directory written by `hstu train` or `hstu quantize`")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a preset's model with random weights instead of a run")
    p.add_argument("--num-items", type=number_in(int, 1), default=3706, help="--preset: catalogue size (default 3706, ML-1M's)")
    p.add_argument("--data-dir", help="the run's data directory if it moved (as hstu eval --data-dir)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    p.add_argument("--precisions", type=_precisions, default=PRECISIONS, help="comma-separated (default fp32,fp16,bf16,int8)")
    p.add_argument("--batch", type=number_in(int, 1), default=16, help="users per generation call (default 16)")
    p.add_argument("--lengths", type=_lengths, default=(50, 100, 200), help="history lengths of the sweep (default 50,100,200)")
    p.add_argument("--sweep-batch", type=number_in(int, 1), default=32, help="users per call in the length sweep (default 32)")
    p.add_argument("-k", type=number_in(int, 1), default=5, help="items generated per user (default 5)")
    p.add_argument("--repeats", type=number_in(int, 1), help="timed calls per figure (default 30; --quick 5)")
    p.add_argument("--warmup", type=number_in(int, 0), help="untimed calls first (default 3; --quick 1)")
    p.add_argument("--graphs", default="auto", help="engine graph mode: auto | eager | compiled | compile | cuda_graph | npu_graph")
    p.add_argument("--threads", type=number_in(int, 0), default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument(
        "--serve", action="store_true", help="also the HTTP figures of hstu serve per precision (needs the serve and bench extras)"
    )
    p.add_argument("--no-quality", action="store_true", help="skip HR@10 / NDCG@10 on the test split")
    p.add_argument("--out", help="directory for bench.json, bench.md and the PNG plots (must not exist or be empty, unless --overwrite)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier bench in --out (it holds bench.json) once the new one is complete; never other files",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="FILE.json",
        help="another bench.json to put beside these (repeatable, each file once)",
    )
    p.add_argument("--quick", action="store_true", help="few calls per figure and short HTTP steps (CI, smoke tests)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    """Run ``hstu bench``; ValueError / FileNotFoundError / BackendUnavailableError are one line, exit 2 (hstu.cli.main)."""
    from hstu.bench.table import load_result, markdown

    _check_compare(args.compare)
    others = [load_result(f) for f in args.compare]  # before any measuring: a bad file fails fast
    if args.run is None and args.preset is None and not others:
        raise ValueError("give --run RUN_DIR or --preset NAME (or --compare FILE.json to print saved results)")
    _check_out(args.out, args.overwrite)  # so is a bad --out
    results = others if args.run is None and args.preset is None else [_measure(args), *others]
    _emit(results, args.out, args.overwrite, markdown)
    return 0


def _check_compare(files: list[str]) -> None:
    """ValueError (exit 2) naming a --compare file given twice (the same file by another path too): its columns came
    out twice, told apart only by "(result N)"."""
    seen: dict[Path, str] = {}
    for f in files:
        key = Path(f).resolve()
        if key in seen:
            same = "" if f == seen[key] else f" (the same file as {seen[key]})"
            raise ValueError(f"--compare {f}: given twice{same}; name each result file once")
        seen[key] = f


def _check_out(out: str | None, overwrite: bool) -> None:
    """:func:`hstu.model.checkpoint.check_out_dir` for ``hstu bench`` (:data:`OUT_FILES`, marked by bench.json)."""
    from hstu.model.checkpoint import check_out_dir

    check_out_dir(out, overwrite, OUT_FILES, "bench")


def _settings(args, mode: dict) -> Settings:
    return Settings(
        device=args.device,
        precisions=tuple(args.precisions),
        batch=args.batch,
        lengths=tuple(args.lengths),
        sweep_batch=args.sweep_batch,
        k=args.k,
        repeats=args.repeats or mode["repeats"],
        warmup=mode["warmup"] if args.warmup is None else args.warmup,
        graphs=args.graphs,
        quality=not args.no_quality,
    )


def _measure(args) -> dict:
    """Every column of this run (a temporary run directory for --preset), with the environment."""
    import torch
    from tqdm import tqdm

    from hstu.backend import select
    from hstu.bench.cells import Source, measure_isolated, open_run, write_preset_run
    from hstu.bench.env import environment

    if args.threads:
        torch.set_num_threads(args.threads)
    mode = QUICK if args.quick else FULL
    st = _settings(args, mode)
    be = select(args.device)
    if args.serve:
        _check_serve_extras()
    with tempfile.TemporaryDirectory(prefix="hstu-bench-") as tmp:
        if args.run is not None:
            src = open_run(Path(args.run), args.data_dir)
        else:
            run = write_preset_run(args.preset, args.num_items, Path(tmp) / "run")
            src = Source(run, f"preset {args.preset}, random weights ({args.num_items} items)")
        _check_lengths(src.run, st.lengths)
        cells = []
        with tqdm(total=len(st.precisions) * (2 if args.serve else 1), desc="hstu bench", unit="cell", file=sys.stderr) as bar:
            for prec in st.precisions:
                bar.set_postfix_str(prec)
                cells.append(measure_isolated(src, prec, st, be, args.threads))
                bar.update()
            if args.serve:
                for cell in cells:
                    bar.set_postfix_str(f"serve {cell['precision']}")
                    if "unavailable" not in cell:
                        cell["serve"] = _serve_cell(src, cell, st, mode)
                    bar.update()
    return {
        "hstu_bench": 1,
        "command": shlex.join(["hstu", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else None,
        "source": src.label,
        "environment": environment(be),
        "settings": {**st.__dict__, "quick": args.quick},
        "notes": src.notes,
        "cells": cells,
    }


def _check_lengths(run: Path, lengths: tuple[int, ...]) -> None:
    """ValueError (exit 2) when no --lengths value fits the model: every figure would be n/a."""
    from hstu.model.checkpoint import read_json

    max_len = int(read_json(run / "config.json")["model"]["max_seq_len"])
    if all(L > max_len for L in lengths):
        raise ValueError(
            f"--lengths {','.join(map(str, lengths))}: every value exceeds the model's max_seq_len {max_len}; nothing to measure"
        )


def _check_serve_extras() -> None:
    import importlib.util

    missing = [m for m in ("aiohttp", "httpx", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"--serve needs {', '.join(missing)}: pip install 'hstu[serve,bench]'")


def _serve_cell(src, cell: dict, st: Settings, mode: dict) -> dict:
    """HTTP figures of one precision; a server that does not start is the figure's reason."""
    from hstu.bench.cells import histories
    from hstu.bench.load import ServerStartError, request_body, serve_figures
    from hstu.generate.recommend import Recommender

    rec = Recommender.mapping_only(src.run)
    preps, _ = histories(src, rec, cell["history"], 64, st.seed)
    bodies = [request_body(i, rec.raw_ids[p.ids], p.timestamps, st.k) for i, p in enumerate(preps)]
    try:
        return serve_figures(
            src.run,
            cell["precision"],
            bodies,
            steps=mode["steps"],
            step_s=mode["step_s"],
            max_batch=st.batch,
            buckets=str(cell["history"]),
            budget_s=mode["serve_budget_s"],
            seed=st.seed,
        )
    except ServerStartError as exc:
        return {"unavailable": str(exc), "max_qps": None}


def _emit(results: list[dict], out: str | None, overwrite: bool, markdown) -> None:
    """Print the table; with ``out``, write bench.json (this run's result, or the merged files),
    bench.md and the plots there, all or nothing (:func:`hstu.model.checkpoint.staged_dir`: an old
    bench in ``out`` is replaced whole, only once the new one is complete)."""
    from hstu.bench.plots import write_plots
    from hstu.model.checkpoint import staged_dir, write_text

    text = markdown(results)
    if out is not None:
        _check_out(out, overwrite)  # again: files may have appeared in --out while this measured
        payload = results[0] if results[0].get("source_file") is None else {"hstu_bench": 1, "merged": results}
        with staged_dir(out, last="bench.json") as tmp:
            write_text(tmp / "bench.md", text)
            files, why = write_plots(results, tmp)
            write_text(tmp / "bench.json", json.dumps(payload, indent=2) + "\n")
        d = Path(out)
        print(
            f"wrote {d / 'bench.json'}, {d / 'bench.md'}" + "".join(f", {d / f.name}" for f in files) + (f" ({why})" if why else ""),
            file=sys.stderr,
        )
    print(text, end="")
