"""Result files for the training-recipe comparison (issue 20, Part A): `hstu train` runs of the small
preset on ML-1M (clean protocol) that differ only in the recipe (negatives scheme, length pooling,
loss divisor), each written to benchmarks/results/recipe_small_<name>.json with the exact training
command, its recipe (metrics.json ``recipe``), the per-epoch validation curve, sequences/s, the
test metrics at the best validation epoch and, against a base run, the paired 95 % bootstrap
interval over users of the test HR@10 / NDCG@10 difference (benchmarks/ablate_ml1m.py's).

    python benchmarks/recipe_small.py --base both --run default=/tmp/hC/run_default \\
        --command default='hstu train --preset small --epochs 5 --out /tmp/hC/run_default' ... --out benchmarks/results

Trains nothing: the runs are made beforehand (one at a time, in the background). A run's name is only a label:
what it trained is its metrics.json ``recipe``. `hstu train` without recipe flags trains the default recipe,
since issue 20 the packed per-position one (negatives_chunk 1, length_pool 1, packing "auto"); the files named
``default`` committed before that (recipe_small_default*.json) hold the former default, which the flags
``--negatives-chunk 16 --length-pool 50 --packing off`` still train.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from _quality import command, git_commit, machine, write_json
from ablate_ml1m import paired_ci, per_user_hits
from hstu.data.prepare import DataSpec
from hstu.model.checkpoint import read_json


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for it in items:
        name, sep, value = it.partition("=")
        if not sep or not name:
            raise SystemExit(f"{flag} {it!r}: expected NAME=VALUE")
        out[name] = value
    return out


def run_record(run: Path, cmd: str) -> dict:
    """One run's result record from its run directory (config.json, history.json, metrics.json)."""
    cfg, hist, met = read_json(run / "config.json"), read_json(run / "history.json"), read_json(run / "metrics.json")
    return {
        "run_dir": str(run),
        "command": cmd,
        "recipe": met.get("recipe"),
        "train_config": cfg["train"],
        "model_config": cfg["model"],
        "status": met["status"],
        "epochs": met["epochs"],
        "best_epoch": met["best_epoch"],
        "sequences_per_s": met["sequences_per_s"],
        "train_seconds": met["train_seconds"],
        "valid_curve": [
            {"epoch": h["epoch"], "HR@10": h["valid"]["HR@10"], "NDCG@10": h["valid"]["NDCG@10"], "sequences_per_s": h["sequences_per_s"]}
            for h in hist
            if "valid" in h
        ],
        "valid": met["valid"],
        "test": met["test"],
        "machine_run": met["machine"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="append", required=True, help="NAME=RUN_DIR (repeatable)")
    p.add_argument("--command", action="append", default=[], help="NAME=the exact training command of that run")
    p.add_argument("--base", required=True, help="the run the paired intervals are taken against")
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--note", default="")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs, cmds = _pairs(args.run, "--run"), _pairs(args.command, "--command")
    if args.base not in runs:
        raise SystemExit(f"--base {args.base!r} is not one of the --run names {sorted(runs)}")
    prov = {"machine": machine(), "git_commit": git_commit(), "command": command(), "note": args.note}
    data = read_json(Path(runs[args.base]) / "config.json")["data"]
    spec = DataSpec(data["dataset"], data["data_dir"], data["protocol"], data.get("max_users"))
    per_user = {n: per_user_hits(Path(r), spec, "cpu") for n, r in runs.items()}
    summary = {}
    for name, run in runs.items():
        rec = run_record(Path(run), cmds.get(name, ""))
        for k in ("HR@10", "NDCG@10"):  # the per-user scores are the run's own test metrics
            assert abs(float(np.mean(per_user[name][k])) - rec["test"][k]) < 1e-9, (name, k)
        if name != args.base:
            assert np.array_equal(per_user[name]["users"], per_user[args.base]["users"])
            rec["test_minus_" + args.base + "_ci95"] = {
                k: paired_ci(per_user[name][k], per_user[args.base][k], args.resamples) for k in ("HR@10", "NDCG@10")
            }
        write_json(Path(args.out) / f"recipe_small_{name}.json", {**prov, "name": name, **rec})
        summary[name] = {
            "recipe": rec["recipe"],
            "valid_HR@10": rec["valid"]["HR@10"],
            "test_HR@10": rec["test"]["HR@10"],
            "test_NDCG@10": rec["test"]["NDCG@10"],
            "sequences_per_s": rec["sequences_per_s"],
            **({"ci95_vs_base": rec["test_minus_" + args.base + "_ci95"]} if name != args.base else {}),
        }
    write_json(Path(args.out) / "recipe_small_summary.json", {**prov, "base": args.base, "runs": summary})
    for n, s in summary.items():
        print(n, {k: v for k, v in s.items() if k != "recipe"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
