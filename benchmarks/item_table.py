"""Dense vs hashed item table on full ML-1M at equal epochs (issue 18: `hstu train` with
``item_table = "hashed"`` reaches a test HR@10 within the bootstrap interval of the dense table).

Per training seed, two runs with the product's defaults (small preset, clean protocol, TrainConfig
defaults but ``--epochs``): ``RUNS/ml1m-dense-s{seed}`` ([model] item_table = "dense") and
``RUNS/ml1m-hashed-s{seed}`` (item_table = "hashed", 4 shards, shard 1 host-placed). Each is read when
finished, resumed when interrupted, trained otherwise, one after the other. Then every test user of
every run is ranked against all items (train.evaluate.evaluate_ranks, history excluded) and test
HR@10 / NDCG@10 get 95 % percentile bootstrap intervals over users (hstu.train.slices.bootstrap_weights
/ ci_mean), with the same resamples for all runs, so paired differences (hashed - dense at one seed;
dense at the second seed - dense at the first: the size of a seed change) have their own intervals.
The two tables draw different initial rows from one seed, so hashed - dense includes a seed effect.

    python benchmarks/item_table.py --runs /tmp/h2/runs --epochs 8 --threads 1 --seeds 42,43

Writes benchmarks/results/item_table_ml1m.json (figures, intervals, epochs, per-epoch seconds,
machine, load average, commit, command). Runs live outside the repository (``--runs``).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from _quality import REPO, command, git_commit, machine, train_or_resume, write_json
from hstu.config import TrainConfig, model_config_from_preset
from hstu.data.prepare import DataSpec, prepare_data
from hstu.model.checkpoint import read_json
from hstu.runs import load_run
from hstu.train.evaluate import evaluate_ranks
from hstu.train.slices import bootstrap_weights, ci_mean

TABLES = {
    "dense": {},
    "hashed": {"item_table": "hashed", "item_table_shards": 4, "item_table_placement": "device,host,device,device"},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True, help="directory of the two runs (ml1m-dense, ml1m-hashed); not in the repository")
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "ml-1m"))
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads for training and scoring")
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--seeds", default="42", help="training seeds, comma-separated (the first is the headline comparison)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--note", default="", help="free text stored in the result (e.g. how the runs were trained)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "item_table_ml1m.json"))
    return p.parse_args(argv)


def per_user(run: Path, spec: DataSpec) -> dict[str, np.ndarray]:
    """Test HR@10 and NDCG@10 of every test user (in EventLog order) of ``run``'s best weights."""
    model, _, _ = load_run(run, "cpu")
    log_, split = prepare_data(spec)
    users, ranks = evaluate_ranks(model, log_, split, "test")
    hit = (ranks <= 10).astype(np.float64)
    return {"users": users, "HR@10": hit, "NDCG@10": hit / np.log2(ranks + 1.0)}


def train_and_score(run: Path, fields: dict, tcfg: TrainConfig, spec: DataSpec) -> tuple[dict, dict[str, np.ndarray]]:
    """(the run's summary for the report, its per-user test metrics); trains or resumes it if unfinished."""
    metrics, history = train_or_resume(run, model_config_from_preset("small", **fields), tcfg, spec)
    cfg = read_json(run / "config.json")
    want = fields.get("item_table", "dense")
    if cfg["model"]["item_table"] != want or metrics["epochs"] != tcfg.epochs or cfg["train"]["seed"] != tcfg.seed:
        have = f"item_table={cfg['model']['item_table']!r}, {metrics['epochs']} epochs, seed {cfg['train']['seed']}"
        raise SystemExit(f"{run}: holds {have}; expected {want}, {tcfg.epochs}, {tcfg.seed}")
    load = os.getloadavg()
    t0 = time.perf_counter()
    scores = per_user(run, spec)
    hr = float(scores["HR@10"].mean())
    if abs(hr - metrics["test"]["HR@10"]) > 1e-9:  # the same ranks as fit's own report
        raise SystemExit(f"{run}: rescored test HR@10 {hr} differs from metrics.json {metrics['test']['HR@10']}")
    summary = {
        "run": str(run),
        "model": {k: v for k, v in cfg["model"].items() if k.startswith("item_table")},
        "train": cfg["train"],
        "epochs": metrics["epochs"],
        "best_epoch": metrics["best_epoch"],
        "train_seconds": metrics["train_seconds"],
        "epoch_seconds": [h["seconds"] for h in history],
        "test_metrics_json": metrics["test"],
        "scoring_seconds": round(time.perf_counter() - t0, 1),
        "load_average_at_scoring": [round(x, 2) for x in load],
    }
    return summary, scores


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray], weights: np.ndarray) -> dict:
    """Per metric: b and a with intervals, the paired b - a, and whether b lies in a's interval."""
    if not np.array_equal(a["users"], b["users"]):
        raise SystemExit("the runs were tested on different users")
    out = {}
    for metric in ("HR@10", "NDCG@10"):
        ca, cb = ci_mean(a[metric], weights), ci_mean(b[metric], weights)
        out[metric] = {
            "a": ca,
            "b": cb,
            "b_minus_a": ci_mean(b[metric] - a[metric], weights),
            "b_within_a_interval": bool(ca["ci"][0] <= cb["value"] <= ca["ci"][1]),
        }
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    spec = DataSpec("ml-1m", args.data_dir, "clean")
    seeds = [int(x) for x in args.seeds.split(",")]
    report: dict = {"machine": machine(), "git_commit": git_commit(), "command": command(), "note": args.note, "runs": {}}
    scores = {}
    for seed in seeds:
        tcfg = TrainConfig(epochs=args.epochs, num_threads=args.threads, seed=seed)
        for name, fields in TABLES.items():
            key = f"{name}-s{seed}"
            report["runs"][key], scores[key] = train_and_score(Path(args.runs) / f"ml1m-{key}", fields, tcfg, spec)
    users = scores[f"dense-s{seeds[0]}"]["users"]
    weights = bootstrap_weights(len(users), args.resamples, seed=args.seed)  # shared by every comparison: paired
    by_seed = {s: compare(scores[f"dense-s{s}"], scores[f"hashed-s{s}"], weights) for s in seeds}
    report.update(
        users=int(len(users)),
        protocol="clean",
        epochs=args.epochs,
        bootstrap={"resamples": args.resamples, "level": 0.95, "unit": "user", "seed": args.seed, "paired": True},
        test={"a": "dense", "b": "hashed", "seed": seeds[0], **by_seed[seeds[0]]},
        test_by_seed={str(s): {"a": "dense", "b": "hashed", **c} for s, c in by_seed.items()},
    )
    if len(seeds) > 1:  # the size of a seed change alone, for scale
        report["dense_seed_change"] = {
            "a": f"dense s{seeds[0]}",
            "b": f"dense s{seeds[1]}",
            **compare(scores[f"dense-s{seeds[0]}"], scores[f"dense-s{seeds[1]}"], weights),
        }
    write_json(Path(args.out), report)
    for s, c in by_seed.items():
        for metric, r in c.items():
            a, b, d = r["a"], r["b"], r["b_minus_a"]
            logging.info(
                "seed %d %s: dense %.4f %s, hashed %.4f %s, hashed - dense %.4f %s, within: %s",
                s, metric, a["value"], a["ci"], b["value"], b["ci"], d["value"], d["ci"], r["b_within_a_interval"],
            )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
