"""Section 5 of benchmarks/generate.py: next-5 against its arithmetic (issue 19's floors).

- next-5 for 16 users at length 200 against the FLOP floor: the call's floating-point operations are
  counted on an eager engine of the same model (``torch.utils.flop_counter.FlopCounterMode``: every
  matmul, batched matmul and attention op it dispatches, 2 per multiply-add), and a plain GEMM of the
  same count, shaped like the model's projections ((16 * 200, d) @ (d, N)), is timed on the same
  machine in the same run, alternated call by call with next-5. Floor: ratio <= 3.
- next-5 for one history of 200 events, P50 in ms. Floor: <= 1 ms. Beside it the same call's own FLOP
  floor: its FLOPs counted the same way as one GEMM shaped (200, d) @ (d, N), timed in the same
  alternation: what this machine's arithmetic alone needs for the call (on a 2-core AMD EPYC VM
  at one thread 0.46-0.48 ms, `generate_quick_s64_compiled.json`, so the 1 ms floor leaves ~0.5 ms there for
  everything that is not arithmetic: the request's checks, the loads, the picks, the graph calls' own cost).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from hstu.bench.timing import interleaved
from hstu.bench.timing import percentile_ms as pct
from hstu.generate.engine import Engine

FLOP_RATIO_FLOOR = 3.0  # next-5 B16 L200 within 3x of a GEMM of the same FLOPs
B1_L200_FLOOR_MS = 1.0


def count_flops(fn) -> int:
    """Floating-point operations of one call of ``fn`` (FlopCounterMode: matmul-family ops only)."""
    with FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())


def gemm_operands(M: int, K: int, flops: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands (M, K) and (K, N) float32 of a GEMM of about ``flops`` (2 M K N) operations."""
    N = max(1, round(flops / (2 * M * K)))
    return torch.randn(M, K, device=device), torch.randn(K, N, device=device)


def flop_floor(b, histories, edges, out: dict) -> dict:
    """5. into ``out["flop_floor"]``: next-5 at B16 L200 and B1 L200 by the benchmark's engine, and a
    GEMM of next-5 B16's FLOPs, alternated; returns the section's dict."""
    print("\n5. next-5 against its FLOP floor (a plain GEMM of the same FLOPs, alternated)")
    if b.args.precision == "int8":  # FlopCounterMode does not count the integer GEMMs: the ratio would be meaningless
        print("  skipped under --precision int8 (the integer GEMMs are not counted); run it at fp32")
        out["flop_floor"] = {"skipped": "--precision int8: FlopCounterMode does not count integer GEMMs"}
        return out["flop_floor"]
    eager = b.eng if b.eng.graphs == "eager" else Engine(b.model, buckets=edges, max_batch=16, k_max=10, device=b.dev, graphs="eager")
    h16 = histories(np.full(16, 200), 200, b.I, b.dev, seed=16)
    h1 = histories(np.full(1, 200), 200, b.I, b.dev, seed=1)
    flops = count_flops(lambda: eager.generate(*h16[:3], 5, request_time=h16[3]))
    flops1 = count_flops(lambda: eager.generate(*h1[:3], 5, request_time=h1[3]))
    K = b.model.cfg.embedding_dim
    (a, w), (a1, w1) = (gemm_operands(n, K, f, b.dev) for n, f in ((16 * 200, flops), (200, flops1)))
    fns = {
        "next5_B16": lambda: b.eng.generate(*h16[:3], 5, request_time=h16[3]),
        "gemm": lambda: torch.mm(a, w),
        "next5_B1": lambda: b.eng.generate(*h1[:3], 5, request_time=h1[3]),
        "gemm_B1": lambda: torch.mm(a1, w1),
    }
    t = interleaved(fns, b.reps, warmup=2, sync=b.sync)
    ratio = pct(t["next5_B16"], 50) / pct(t["gemm"], 50)
    M, N = a.shape[0], w.shape[1]
    gflops = 2 * M * K * N / (pct(t["gemm"], 50) / 1000) / 1e9
    sec = {
        "next5_B16_L200_gflop": round(flops / 1e9, 4),
        "gemm_shape": [M, K, N],
        "gemm_gflop_per_s": round(gflops, 1),
        "next5_B16_L200_p50_ms": round(pct(t["next5_B16"], 50), 3),
        "gemm_p50_ms": round(pct(t["gemm"], 50), 3),
        "ratio_to_flop_floor": round(ratio, 2),
        "ratio_floor": FLOP_RATIO_FLOOR,
        "next5_B1_L200_p50_ms": round(pct(t["next5_B1"], 50), 3),
        "next5_B1_L200_p99_ms": round(pct(t["next5_B1"], 99), 3),
        "B1_floor_ms": B1_L200_FLOOR_MS,
        "next5_B1_L200_gflop": round(flops1 / 1e9, 5),
        "gemm_B1_shape": [a1.shape[0], K, w1.shape[1]],
        "gemm_B1_p50_ms": round(pct(t["gemm_B1"], 50), 3),
        "B1_ratio_to_flop_floor": round(pct(t["next5_B1"], 50) / pct(t["gemm_B1"], 50), 2),
    }
    print(
        f"  next-5 B16 L200: {flops / 1e9:.3f} GFLOP in {sec['next5_B16_L200_p50_ms']:.2f} ms; the same FLOPs as one GEMM "
        f"{M}x{K}x{N}: {sec['gemm_p50_ms']:.2f} ms ({gflops:.0f} GFLOP/s) -> {ratio:.2f}x the floor (floor <= {FLOP_RATIO_FLOOR:g})"
    )
    print(
        f"  next-5 B1 L200: P50 {sec['next5_B1_L200_p50_ms']:.2f} ms, P99 {sec['next5_B1_L200_p99_ms']:.2f} ms (floor <= 1 ms); "
        f"its {flops1 / 1e9:.4f} GFLOP as one GEMM: {sec['gemm_B1_p50_ms']:.2f} ms ({sec['B1_ratio_to_flop_floor']:.2f}x)"
    )
    out["flop_floor"] = sec
    return sec


def summary_part(sec: dict) -> str:
    """The section's part of the benchmark's summary line."""
    if "skipped" in sec:
        return "FLOP floor skipped (int8)"
    ratio, b1 = sec["ratio_to_flop_floor"], sec["next5_B1_L200_p50_ms"]
    own = f", its GEMM {sec['gemm_B1_p50_ms']:.2f} ms" if "gemm_B1_p50_ms" in sec else ""
    return f"next-5 B16 / FLOP floor {ratio:.2f}x (floor {FLOP_RATIO_FLOOR:g}), B1 L200 {b1:.2f} ms (floor {B1_L200_FLOOR_MS:g}{own})"
