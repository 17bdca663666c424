"""Ablations of HSTU small on ML-1M (issue 3: "if a floor is missed, find out why: ablate relative
bias off, time bias off, n normalisation, negatives count").

Every run trains HSTU small under the paper protocol (test = the last event, reported after every
epoch, as the reference trajectory is) with one change from the base recipe, the same seed and
the same data order, for --epochs epochs; the report gives test HR@10 / NDCG@10 per epoch, the
difference to the base run at the same epoch, and a 95 % bootstrap interval of that difference
over users (paired: the same users, both models scored on each), so that an effect can be told
from noise.

    python benchmarks/ablate_ml1m.py --threads 1                         # all ablations, 10 epochs each
    python benchmarks/ablate_ml1m.py --ablations base,no-time-bias --epochs 2 --max-users 300 --runs /tmp/a --out /tmp/a  # smoke

Ablations (name -> change):
    base            the recipe of reproduce_ml1m.py's clean protocol (length-sorted batches in pools of
                    50, one set of 128 negatives per 16 positions: ~2x faster per epoch than the
                    reference's recipe, which keeps the ablations affordable on 2 cores)
    no-pos-bias     relative position bias off (ModelConfig.use_position_bias = False)
    no-time-bias    relative time bias off (use_time_bias = False)
    no-rel-bias     both off
    n-causal        attention divisor n = i + 1 for row i (the keys it attends) instead of the fixed
                    width N (ModelConfig.attention_norm = "causal")
    negatives-32    32 negatives instead of 128
    negatives-512   512 negatives
    seed-7          the base with another seed (data order, initialisation, negatives): the noise
                    floor the other differences are read against

Runs live in RUNS/<name> (checkpointed every epoch; an interrupted run resumes). Writes
OUT/ml1m_ablations.json (per run: the per-epoch test metrics, the differences to base, the command,
machine and git commit).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import torch

from _quality import command, git_commit, machine, run_spec, train_or_resume, write_json
from hstu.config import LEGACY_TRAIN_DEFAULTS, TrainConfig, model_config_from_preset
from hstu.data.prepare import DataSpec, prepare_data
from hstu.model.checkpoint import read_json
from hstu.runs import load_run
from hstu.train.slices import ModelScorer, collect, hits, ndcgs
from reproduce_ml1m import DEFAULT_DATA, RECIPE

log = logging.getLogger("benchmarks.ablate")

# name -> (ModelConfig overrides, TrainConfig overrides)
ABLATIONS: dict[str, tuple[dict, dict]] = {
    "base": ({}, {}),
    "no-pos-bias": ({"use_position_bias": False}, {}),
    "no-time-bias": ({"use_time_bias": False}, {}),
    "no-rel-bias": ({"use_position_bias": False, "use_time_bias": False}, {}),
    "n-causal": ({"attention_norm": "causal"}, {}),
    "negatives-32": ({}, {"num_negatives": 32}),
    "negatives-512": ({}, {"num_negatives": 512}),
    "seed-7": ({}, {"seed": 7}),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA))
    p.add_argument("--runs", default="runs/ml1m/ablate")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--ablations", default=",".join(ABLATIONS), help=f"comma list of {list(ABLATIONS)}")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--report-only", action="store_true", help="do not train; report the runs found")
    p.add_argument("--max-users", type=int, help="first N users only (smoke runs)")
    return p.parse_args(argv)


def base_train(epochs: int, threads: int) -> dict:
    """The base run's TrainConfig fields: the reference recipe with the clean-protocol batching the committed
    ablations were measured on (one set of negatives per 16 positions, length-sorted pools of 50 batches, no
    packing: the defaults before issue 20, pinned so that the runs in RUNS/ keep their meaning)."""
    return dict(
        RECIPE,
        epochs=epochs,
        negatives_chunk=LEGACY_TRAIN_DEFAULTS["negatives_chunk"],
        length_pool=LEGACY_TRAIN_DEFAULTS["length_pool"],
        packing=LEGACY_TRAIN_DEFAULTS["packing"],
        seed=42,
        early_stopping_patience=epochs,
        num_threads=threads,
    )


def per_user_hits(run: Path, spec: DataSpec, device: str) -> dict[str, np.ndarray]:
    """Test HR@10 and NDCG@10 of every user (the final checkpoint), for paired bootstrap intervals."""
    model, _, _ = load_run(run, device)
    log_, split = prepare_data(spec)
    res = collect(ModelScorer(model, run.name, device), log_, split, "test", k=10, generate=False)
    return {"HR@10": hits(res.ranks, 10), "NDCG@10": ndcgs(res.ranks, 10), "users": np.asarray(res.users)}


def paired_ci(a: np.ndarray, b: np.ndarray, resamples: int, seed: int = 0) -> list[float]:
    """95 % percentile bootstrap interval of mean(a - b) over users (a, b aligned per user)."""
    d = a - b
    g = np.random.default_rng(seed)
    means = d[g.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    names = [n for n in args.ablations.split(",") if n]
    for n in names:
        if n not in ABLATIONS:
            raise SystemExit(f"unknown ablation {n!r}; valid: {list(ABLATIONS)}")
    runs, out = Path(args.runs), Path(args.out)
    spec = DataSpec("ml-1m", args.data_dir, "paper", max_users=args.max_users)
    tbase = base_train(args.epochs, args.threads)
    prov = {"machine": machine(), "git_commit": git_commit(), "command": command()}
    report: dict = {**prov, "protocol": "paper", "epochs": args.epochs, "base_train": tbase, "runs": {}}
    per_user = {}
    for name in names:
        mo, to = ABLATIONS[name]
        run = runs / name
        if args.report_only:
            if not (run / "metrics.json").exists():
                log.info("%s: no finished run, skipped (--report-only)", run)
                continue
            history = read_json(run / "history.json")
        else:
            run.mkdir(parents=True, exist_ok=True)
            if not (run / "metrics.json").exists():
                (run / "command.txt").write_text(prov["command"] + "\n")
            _, history = train_or_resume(
                run, model_config_from_preset("small", **mo), TrainConfig(**{**tbase, **to}), spec, device=args.device
            )
        rspec = run_spec(run, spec)  # the run's own --max-users, whatever this invocation got
        per_user[name] = per_user_hits(run, rspec, args.device)
        report["runs"][name] = {
            "run_dir": str(run),
            "model_overrides": mo,
            "train_overrides": to,
            "max_users": rspec.max_users,
            "command": (run / "command.txt").read_text().strip() if (run / "command.txt").exists() else None,
            "sequences_per_s": round(float(np.mean([h["sequences_per_s"] for h in history])), 1),
            "test": {h["epoch"]: {"HR@10": h["test"]["HR@10"], "NDCG@10": h["test"]["NDCG@10"]} for h in history if "test" in h},
            # the saved model rescored per user (must equal the last epoch's test metrics)
            "final_rescored": {k: float(per_user[name][k].mean()) for k in ("HR@10", "NDCG@10")},
        }
    base = report["runs"].get("base")
    if base:
        for name, r in report["runs"].items():
            if name == "base":
                continue
            r["minus_base"] = {ep: {k: v[k] - base["test"][ep][k] for k in v} for ep, v in r["test"].items() if ep in base["test"]}
            hb, hr = per_user["base"], per_user[name]
            if not np.array_equal(hb["users"], hr["users"]):
                raise SystemExit(
                    f"{name} and base were tested on different users (max_users {r['max_users']} vs "
                    f"{base['max_users']}): no paired interval; rerun one of them"
                )
            r["final_minus_base_ci95"] = {k: paired_ci(hr[k], hb[k], args.resamples) for k in ("HR@10", "NDCG@10")}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "ml1m_ablations.json", report)
    for name, r in report["runs"].items():
        last = r["test"][max(r["test"])]
        log.info(
            "%-14s epoch %d: HR@10 %.4f NDCG@10 %.4f  minus base (CI95): %s",
            name,
            max(r["test"]),
            last["HR@10"],
            last["NDCG@10"],
            r.get("final_minus_base_ci95"),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
