"""Dense vs hashed item table on full ML-1M at equal epochs (issue 18: `hstu train` with
``item_table = "hashed"`` reaches a test HR@10 within the bootstrap interval of the dense table).

Two runs with the product's defaults (small preset, clean protocol, seed 42, TrainConfig defaults
but ``--epochs``): ``RUNS/ml1m-dense`` ([model] item_table = "dense") and ``RUNS/ml1m-hashed``
(item_table = "hashed", 4 shards, shard 1 host-placed). Each is read when finished, resumed when
interrupted, trained otherwise, one after the other. Then every test user of both is ranked against
all items (train.evaluate.evaluate_ranks, history excluded) and test HR@10 / NDCG@10 get 95 %
percentile bootstrap intervals over users (hstu.train.slices.bootstrap_weights / ci_mean), with the
same resamples for both runs, so the paired difference hashed - dense has its own interval.

    python benchmarks/item_table.py --runs /tmp/h2/runs --epochs 8 --threads 1

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


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    spec = DataSpec("ml-1m", args.data_dir, "clean")
    tcfg = TrainConfig(epochs=args.epochs, num_threads=args.threads)
    report: dict = {"machine": machine(), "git_commit": git_commit(), "command": command(), "note": args.note, "runs": {}}
    scores = {}
    for name, fields in TABLES.items():
        run = Path(args.runs) / f"ml1m-{name}"
        metrics, history = train_or_resume(run, model_config_from_preset("small", **fields), tcfg, spec)
        cfg = read_json(run / "config.json")
        if cfg["model"]["item_table"] != (fields.get("item_table") or "dense") or metrics["epochs"] != args.epochs:
            have = f"item_table={cfg['model']['item_table']!r}, {metrics['epochs']} epochs"
            raise SystemExit(f"{run}: holds {have}; expected {name}, {args.epochs}")
        load = os.getloadavg()
        t0 = time.perf_counter()
        scores[name] = per_user(run, spec)
        hr = float(scores[name]["HR@10"].mean())
        if abs(hr - metrics["test"]["HR@10"]) > 1e-9:  # the same ranks as fit's own report
            raise SystemExit(f"{run}: rescored test HR@10 {hr} differs from metrics.json {metrics['test']['HR@10']}")
        report["runs"][name] = {
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
    d, h = scores["dense"], scores["hashed"]
    if not np.array_equal(d["users"], h["users"]):
        raise SystemExit("the two runs were tested on different users")
    weights = bootstrap_weights(len(d["users"]), args.resamples, seed=args.seed)  # shared: a paired comparison
    result = {}
    for metric in ("HR@10", "NDCG@10"):
        cd, ch = ci_mean(d[metric], weights), ci_mean(h[metric], weights)
        result[metric] = {
            "dense": cd,
            "hashed": ch,
            "hashed_minus_dense": ci_mean(h[metric] - d[metric], weights),
            "hashed_within_dense_interval": bool(cd["ci"][0] <= ch["value"] <= cd["ci"][1]),
        }
    report.update(
        users=int(len(d["users"])),
        protocol="clean",
        epochs=args.epochs,
        bootstrap={"resamples": args.resamples, "level": 0.95, "unit": "user", "seed": args.seed, "paired": True},
        test=result,
    )
    write_json(Path(args.out), report)
    for metric, r in result.items():
        logging.info(
            "%s dense %.4f %s, hashed %.4f %s, within: %s",
            metric,
            r["dense"]["value"],
            r["dense"]["ci"],
            r["hashed"]["value"],
            r["hashed"]["ci"],
            r["hashed_within_dense_interval"],
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
