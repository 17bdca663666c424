"""Inference cost of the presets' multi-channel block ([model] multi_channel, FuXi-alpha §4.2) against the
paper's HSTU block, and of FuXi-beta's block (multi_channel without the query-key map, Ye et al. 2025,
arXiv:2508.10615) against the multi-channel one: next-5 generation at length 200, batch 1 and 16, by eager
engines of the same preset that differ only in those fields, called in turn (A, B, C, A, B, C, ...) so a noisy
machine slows all alike.

    python benchmarks/multi_channel_cost.py --json benchmarks/results/multi_channel_cost.json

Random weights (the cost does not depend on them), num_items 3706 (ML-1M), one bucket of 200, one torch
thread (``--threads``). Prints P50 per side, the ratios P50(multi-channel) / P50(HSTU block) and
P50(multi-channel) / P50(FuXi-beta) with those of the best calls, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from _quality import machine
from generate import histories, ratio, summary
from hstu.bench.timing import interleaved
from hstu.config import PRESETS, ModelConfig
from hstu.generate.engine import Engine
from hstu.model import build_hstu

BLOCKS = {  # the [model] fields of each block compared (whatever block the preset has)
    "multi_channel": {"multi_channel": True, "query_key_map": True},
    "hstu_block": {"multi_channel": False, "query_key_map": True},
    "fuxi_beta": {"multi_channel": True, "query_key_map": False},
}


def engine(preset: str, fields: dict) -> Engine:
    torch.manual_seed(0)
    cfg = ModelConfig(num_items=3706, dropout=0.0, **{**PRESETS[preset], **fields})
    eng = Engine(build_hstu(cfg).eval(), buckets=(200,), max_batch=16, k_max=10, batch_sizes=(1, 16), graphs="eager")
    eng.warmup()
    return eng


def measure(preset: str, reps: int) -> dict:
    engines = {name: engine(preset, fields) for name, fields in BLOCKS.items()}
    rows = {}
    for B in (1, 16):
        ids, ts, lens, rt = histories(np.full(B, 200), 200, 3706, "cpu", seed=B)
        fns = {k: (lambda e=e, h=(ids, ts, lens), r=rt: e.generate(*h, 5, request_time=r)) for k, e in engines.items()}
        t = interleaved(fns, reps if B == 1 else max(reps // 3, 5), warmup=2, sync=lambda: None)
        row = {k: summary(v) for k, v in t.items()} | ratio(t["multi_channel"], t["hstu_block"])
        row["multi_channel_over_fuxi_beta"] = ratio(t["multi_channel"], t["fuxi_beta"])  # > 1: FuXi-beta faster
        rows[f"B{B}_L200"] = row
        beta = row["multi_channel_over_fuxi_beta"]
        print(
            f"{preset:5s} next-5 B={B:2d} L=200: multi-channel {row['multi_channel']['p50_ms']:7.2f} ms, "
            f"HSTU block {row['hstu_block']['p50_ms']:7.2f} ms -> {row['speedup']:.2f}x (best calls {row['speedup_of_min']:.2f}x); "
            f"FuXi-beta {row['fuxi_beta']['p50_ms']:7.2f} ms, {beta['speedup']:.2f}x faster than the multi-channel block "
            f"(best calls {beta['speedup_of_min']:.2f}x); load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="small,large", help="comma list of presets (default small,large)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=40, help="calls per side at batch 1 (a third of it at batch 16)")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {"command": " ".join(["python", *sys.argv]), "machine": machine(), "load_avg_at_start": list(os.getloadavg())}
    out["next5"] = {name: measure(name, args.reps) for name in args.presets.split(",") if name}
    out["load_avg_at_end"] = list(os.getloadavg())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
