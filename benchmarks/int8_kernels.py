"""The INT8 Linear kernels side by side: FBGEMM (``fbgemm``) against oneDNN (the ``onednn`` kernel's
large-call path), the same per-row 7-bit recipe and the same prepacked weights, called alternately, one
torch thread; the basis of ``hstu.quant.int8_kernels.ONEDNN_MIN_OUTPUTS``.

    python benchmarks/int8_kernels.py --json benchmarks/results/int8_kernels.json

Shapes (K -> N): the blocks' Linears of the presets (prod 256 -> 1024 and 256 -> 256, small / large
50 -> 200 and 150 -> 50 for the multi-channel output map) and an ML-1M item table as a Linear (256 ->
3706), at M = 1 .. 3200 rows (decode steps to a batch of 16 histories of 200 events). Prints the P50 of
each side, the ratio FBGEMM / oneDNN (> 1: oneDNN faster) and whether the outputs are bit-identical;
random weights and inputs. Needs a CPU where the ``onednn`` kernel runs (VNNI); elsewhere it says why
and exits 1.
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
from hstu.bench.timing import interleaved
from hstu.quant.int8_kernels import ONEDNN_MIN_OUTPUTS, _probe_onednn, packed_linear, prepack, quantize_per_channel

SHAPES = ((256, 1024), (256, 256), (50, 200), (150, 50), (256, 3706))
ROWS = (1, 16, 64, 128, 256, 512, 3200)


def measure(K: int, N: int, M: int, reps: int, g: torch.Generator) -> dict:
    q, s = quantize_per_channel(torch.randn(N, K, generator=g) * 0.05)
    p = prepack(q, s, "onednn")
    x = torch.randn(M, K, generator=g)
    fns = {"fbgemm": lambda: packed_linear(x, p, None, force_onednn=False), "onednn": lambda: packed_linear(x, p, None, force_onednn=True)}
    same = torch.equal(fns["fbgemm"](), fns["onednn"]())
    t = interleaved(fns, reps, warmup=3)
    fb, od = (float(np.median(t[k])) * 1e3 for k in ("fbgemm", "onednn"))
    times = {"fbgemm_p50_ms": round(fb, 4), "onednn_p50_ms": round(od, 4), "ratio": round(fb / od, 3)}
    return {"M": M, "outputs": M * N, **times, "bit_identical": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    why = _probe_onednn()
    if why:
        print(f"the onednn INT8 kernel does not run here: {why}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    out = {"command": " ".join(["python", *sys.argv]), "machine": machine(), "threads": args.threads, "load_avg_at_start": os.getloadavg()}
    out["onednn_min_outputs"] = ONEDNN_MIN_OUTPUTS
    rows = []
    for K, N in SHAPES:
        for M in ROWS:
            r = {"K": K, "N": N, **measure(K, N, M, max(15, 4000 // M), g)}
            rows.append(r)
            side = "oneDNN" if M * N >= ONEDNN_MIN_OUTPUTS else "FBGEMM"
            print(
                f"{K:4d} -> {N:4d}  M {M:5d} ({M * N:8d} outputs, runs {side}): FBGEMM {r['fbgemm_p50_ms']:8.3f} ms  "
                f"oneDNN {r['onednn_p50_ms']:8.3f} ms  ratio {r['ratio']:5.2f}  bit-identical {r['bit_identical']}"
            )
    out["rows"] = rows
    out["load_avg_at_end"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
