"""Every supported data set found under a directory: HSTU, SASRec and most-popular trained and
evaluated on each under one budget, in one table beside the published full-ranking figures.

    python benchmarks/datasets.py --data-root ../shared/data                  # all found, 20 epochs each at most
    python benchmarks/datasets.py --data-root DIR --epochs 3 --max-users 300 --out /tmp/ds   # a quick smoke run
    python benchmarks/datasets.py --data-root DIR --minutes 10 --only ml-1m,taobao

Discovery (:func:`discover`): each directory under ``--data-root`` (and the root itself) is matched
by its files to one loader of :func:`hstu.data.load_dataset`: ``u.data`` + ``u.item`` (ml-100k),
``ratings.dat`` + ``movies.dat`` (ml-1m, or ml-10m when the directory name says 10m), ``ratings.csv``
+ ``movies.csv`` (ml-20m / ml-25m / ml-latest / ml-latest-small by the directory name),
``UserBehavior*.csv`` (taobao), ``events.csv`` (retailrocket), one Amazon reviews file
(``ratings_<Cat>.csv`` or ``reviews_<Cat>_5.json[.gz]``: amazon) and one ``.txt`` sequence file
(``user item item ...``: sequences). A directory that matches nothing is listed as skipped.

Protocol: clean leave-one-out (train on all events but the last two, early stopping on validation
NDCG@10, test at the best validation epoch), full ranking over the catalogue, each data set's own
candidate policy (history items excluded for MovieLens, Amazon and sequence files; kept for
e-commerce logs), stated in every row. Budget: ``--epochs`` (upper bound, early stopping with
``--patience``) and optionally ``--minutes`` per model (training stops after the epoch in which
the time ran out; :func:`hstu.train.loop.fit` ``max_minutes``). The same budget for every model.

Published figures (:data:`PUBLISHED`) come from the papers named beside them; most of them select
the model on the test set and some use other splits, so they are context, not a like-for-like
comparison. Writes OUT/datasets.json (every row with metrics, budget, seconds, machine, git commit
and the exact command) and OUT/datasets.md (the table). Runs go to RUNS/<data set>-<model>/ and a
rerun reuses finished runs and resumes interrupted ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import time
from pathlib import Path

import torch

from _quality import command, git_commit, machine, train_or_resume, write_json
from hstu.config import TrainConfig, model_config_from_preset
from hstu.data.prepare import DataSpec, prepare_data
from hstu.train.baselines import evaluate_baseline, make_baseline

log = logging.getLogger("benchmarks.datasets")

# (model, HR@10, NDCG@10, source): full ranking, leave-one-out, as published
PUBLISHED: dict[str, list[tuple[str, float, float, str]]] = {
    "ml-1m": [
        ("HSTU-large", 0.3294, 0.1893, "Zhai et al., ICML 2024 (test used for model selection)"),
        ("FuXi-alpha-Large", 0.3359, 0.1934, "Ye et al., WWW 2025, Table 2"),
        ("FuXi-beta-Large", 0.3428, 0.1947, "FuXi-beta, 2025, Table 3"),
    ],
    "amazon-beauty": [
        # the S3-Rec 5-core split (Zhou et al., CIKM 2020); figures as quoted in the project's issue 21
        ("SASRec", 0.0605, 0.0318, "Kang & McAuley, ICDM 2018, on the S3-Rec 5-core split"),
        ("S3-Rec", 0.0647, 0.0327, "Zhou et al., CIKM 2020"),
        ("DuoRec", 0.0845, 0.0443, "Qiu et al., WSDM 2022"),
    ],
}


@dataclasses.dataclass(frozen=True)
class Found:
    """A data set found on disk: its label in the table, the loader name, the path given to it."""

    label: str
    dataset: str
    path: Path


_MOVIELENS_CSV = (("25m", "ml-25m"), ("20m", "ml-20m"), ("latest-small", "ml-latest-small"), ("latest", "ml-latest"))


def _match(d: Path) -> tuple[str, str] | None:
    """(label, loader name) of the data set in directory ``d``, or None."""
    names = {p.name.lower() for p in d.iterdir() if p.is_file()}
    low = d.name.lower()
    if {"u.data", "u.item"} <= names:
        return "ml-100k", "ml-100k"
    if {"ratings.dat", "movies.dat"} <= names:
        name = "ml-10m" if "10m" in low else "ml-1m"
        return name, name
    if {"ratings.csv", "movies.csv"} <= names:
        name = next((n for key, n in _MOVIELENS_CSV if key in low), "ml-latest")
        return name, name
    if any(n.startswith("userbehavior") and n.endswith(".csv") for n in names):
        return "taobao", "taobao"
    if "events.csv" in names:
        return "retailrocket", "retailrocket"
    reviews = [n for n in names if re.match(r"(ratings_.+\.csv|reviews_.+\.json(l)?(\.gz)?)$", n)]
    if len(reviews) == 1:
        cat = re.sub(r"^(ratings|reviews)_|(_5)?\.(csv|jsonl?)(\.gz)?$", "", reviews[0])
        return f"amazon-{cat.replace('_', '-')}", "amazon"
    texts = [n for n in names if n.endswith(".txt") and n not in ("readme.txt", "license.txt")]
    if len(texts) == 1:
        return f"sequences-{low}", "sequences"
    return None


def discover(root: str | Path) -> tuple[list[Found], list[Path]]:
    """The data sets under ``root`` (the root itself and its direct subdirectories, sorted by
    name), and the directories that matched no loader. Raises FileNotFoundError for no ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--data-root {root}: not a directory")
    found, skipped = [], []
    for d in [root, *sorted(p for p in root.iterdir() if p.is_dir())]:
        m = _match(d)
        if m is not None:
            found.append(Found(m[0], m[1], d))
        elif d != root:
            skipped.append(d)
    return found, skipped


def train_eval(found: Found, arch: str, spec: DataSpec, data, args) -> dict:
    """Train (or reuse / resume) one model on one data set; its test metrics at the best epoch."""
    seq = args.max_seq_len or (200 if found.dataset.startswith("ml-") else 50)
    mcfg = model_config_from_preset(args.preset, architecture=arch, max_seq_len=seq)
    tcfg = TrainConfig(epochs=args.epochs, early_stopping_patience=args.patience, seed=args.seed, num_threads=args.threads)
    run = Path(args.runs) / f"{found.label}-{arch}"
    t0 = time.perf_counter()
    metrics, _ = train_or_resume(run, mcfg, tcfg, spec, device=args.device, data=data, max_minutes=args.minutes)
    return {
        "test": metrics["test"],
        "epochs": metrics.get("epochs"),
        "best_epoch": metrics.get("best_epoch"),
        "train_seconds": metrics.get("train_seconds"),
        "status": metrics.get("status", "completed"),
        "run": str(run),
        "max_seq_len": seq,
        "wall_seconds_this_invocation": round(time.perf_counter() - t0, 1),
    }


def bench_one(found: Found, args) -> dict:
    """Every model of the benchmark on one data set: a row of the table."""
    spec = DataSpec(found.dataset, str(found.path), "clean", max_users=args.max_users)
    log_, split = prepare_data(spec)
    exclude = log_.exclude_history_default
    row = {
        "data_set": found.label,
        "loader": found.dataset,
        "path": str(found.path),
        "users": log_.num_users,
        "items": log_.num_items,
        "events": log_.num_events,
        "exclude_history": exclude,
        "models": {},
    }
    for arch in ("hstu", "sasrec"):
        log.info("%s: training %s", found.label, arch)
        row["models"][arch] = train_eval(found, arch, spec, (log_, split), args)
    pop = evaluate_baseline(make_baseline("most-popular", log_, split), log_, split, "test")
    row["models"]["most-popular"] = {"test": pop}
    row["published"] = [{"model": m, "HR@10": h, "NDCG@10": n, "source": s} for m, h, n, s in PUBLISHED.get(found.label, [])]
    return row


def markdown(rows: list[dict]) -> str:
    """The table: one line per data set, HR@10 / NDCG@10 of each model and the published figures."""
    head = "| data set | users | items | events | candidates | HSTU | SASRec | most-popular | published (HR@10 / NDCG@10) |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['data_set']} | not run: {r['error'][:200]} |" + " |" * 7)
            continue
        cell = lambda m, r=r: "{:.4f} / {:.4f}".format(r["models"][m]["test"]["HR@10"], r["models"][m]["test"]["NDCG@10"])  # noqa: E731
        pub = "; ".join(f"{p['model']} {p['HR@10']:.4f} / {p['NDCG@10']:.4f}" for p in r["published"]) or "-"
        cand = "history excluded" if r["exclude_history"] else "history kept"
        lines.append(
            f"| {r['data_set']} | {r['users']:,} | {r['items']:,} | {r['events']:,} | {cand} | {cell('hstu')} | {cell('sasrec')} "
            f"| {cell('most-popular')} | {pub} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", required=True, help="a directory of data sets, one per subdirectory")
    p.add_argument("--only", help="comma-separated labels to run (e.g. ml-1m,taobao); default: every one found")
    p.add_argument("--runs", default="runs/datasets", help="run directories (reused / resumed)")
    p.add_argument("--out", default="benchmarks/results", help="where datasets.json and datasets.md go")
    p.add_argument("--preset", default="small", help="model preset of HSTU and SASRec")
    p.add_argument("--max-seq-len", type=int, help="default: 200 for MovieLens, 50 for the others")
    p.add_argument("--epochs", type=int, default=20, help="upper bound per model; early stopping on validation NDCG@10")
    p.add_argument("--minutes", type=float, help="also stop a model's training after the epoch in which this many minutes passed")
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--max-users", type=int, help="first N users of each data set (smoke runs)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    found, skipped = discover(args.data_root)
    if args.only:
        want = set(args.only.split(","))
        unknown = want - {f.label for f in found}
        if unknown:
            raise SystemExit(f"--only: {sorted(unknown)} not found under {args.data_root}; found {[f.label for f in found]}")
        found = [f for f in found if f.label in want]
    for d in skipped:
        log.info("skipped %s: no supported data set layout", d)
    if not found:
        raise SystemExit(f"no supported data set under {args.data_root} (see the module docstring for the layouts)")
    rows = []
    for f in found:
        try:
            rows.append(bench_one(f, args))
        except (ValueError, OSError) as exc:  # too little data, a malformed file: say so, go on with the others
            log.error("%s (%s): %s", f.label, f.path, exc)
            rows.append({"data_set": f.label, "loader": f.dataset, "path": str(f.path), "error": str(exc)})
    budget = {"epochs_max": args.epochs, "minutes": args.minutes, "patience": args.patience, "preset": args.preset, "seed": args.seed}
    out = Path(args.out)
    result = {"rows": rows, "budget": budget, "protocol": "clean", "machine": machine(), "git_commit": git_commit(), "command": command()}
    write_json(out / "datasets.json", result)
    (out / "datasets.md").write_text(markdown(rows), encoding="utf-8")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
