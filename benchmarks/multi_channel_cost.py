"""Inference cost of the presets' multi-channel block ([model] multi_channel, FuXi-alpha §4.2) against the
paper's HSTU block: next-5 generation at length 200, batch 1 and 16, by two eager engines of the same preset
that differ only in ``multi_channel``, called alternately (A, B, A, B, ...) so a noisy machine slows both alike.

    python benchmarks/multi_channel_cost.py --json benchmarks/results/multi_channel_cost.json

Random weights (the cost does not depend on them), num_items 3706 (ML-1M), one bucket of 200, one torch
thread (``--threads``). Prints P50 per side and the ratio P50(multi-channel) / P50(HSTU block) with the
ratio of the best calls, and the load average before and after.
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


def engine(preset: str, multi_channel: bool) -> Engine:
    torch.manual_seed(0)
    cfg = ModelConfig(num_items=3706, dropout=0.0, **{**PRESETS[preset], "multi_channel": multi_channel})
    eng = Engine(build_hstu(cfg).eval(), buckets=(200,), max_batch=16, k_max=10, batch_sizes=(1, 16), graphs="eager")
    eng.warmup()
    return eng


def measure(preset: str, reps: int) -> dict:
    engines = {"multi_channel": engine(preset, True), "hstu_block": engine(preset, False)}
    rows = {}
    for B in (1, 16):
        ids, ts, lens, rt = histories(np.full(B, 200), 200, 3706, "cpu", seed=B)
        fns = {k: (lambda e=e, h=(ids, ts, lens), r=rt: e.generate(*h, 5, request_time=r)) for k, e in engines.items()}
        t = interleaved(fns, reps if B == 1 else max(reps // 3, 5), warmup=2, sync=lambda: None)
        row = {k: summary(v) for k, v in t.items()} | ratio(t["multi_channel"], t["hstu_block"])
        rows[f"B{B}_L200"] = row
        print(
            f"{preset:5s} next-5 B={B:2d} L=200: multi-channel {row['multi_channel']['p50_ms']:7.2f} ms, "
            f"HSTU block {row['hstu_block']['p50_ms']:7.2f} ms -> {row['speedup']:.2f}x (best calls {row['speedup_of_min']:.2f}x); "
            f"load {os.getloadavg()[0]:.2f}",
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
