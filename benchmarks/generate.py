"""Benchmark the generative inference engine: ratios measured side by side in one run.

    python benchmarks/generate.py --quick --json benchmarks/results/generate_quick.json   # < 60 s on 2 cores
    python benchmarks/generate.py --json benchmarks/results/generate_full.json            # more repeats, bigger mixes
    python benchmarks/generate.py --graphs compiled ...                                   # compiled bucket graphs
    python benchmarks/generate.py --graphs eager,compiled --json ...                      # section 0 only: side by side
    python benchmarks/generate.py --graphs compiled,cached --json ...                     # torch.compile vs a graph cache's packages

Model: random weights, the "small" preset (2 blocks, 1 head, d = 50, N = 210) with
num_items = 3706 (ML-1M's catalogue); no training needed, the cost does not depend on weights.
Every comparison alternates its two sides call by call (A, B, A, B, ...) so that a noisy,
shared machine slows both alike; each side reports P50 / P99 of its calls in ms and the
speedup is P50(slow side) / P50(fast side). Histories: random items, increasing timestamps.

1. KV cache vs full recompute: next-5, batch 1 and 16, length 50 / 100 / 200, by the same
   engine (same buckets, kernels, padding; ``use_cache=False`` reruns the bucket's prefill at
   width E + k_max on the grown sequence). Ideal about 4.5x (5 prefills against 1 prefill and
   4 one-token steps); the fraction of the ideal reached is reported.
2. Bucketed (edges 20/50/100/200) vs one bucket padded to 200, next-5 over a mix of users
   whose history lengths follow a real distribution: ML-1M (hstu.data.load_dataset, capped at
   200), Taobao (rows per user of UserBehavior_head.csv) and uniform 1..200. Throughput =
   users / s over the mix, each engine called with the whole mix (it groups by bucket and
   runs chunks of 16). Ideal gains from the mix itself: linear work sum(200) / sum(edge),
   attention sum(200²) / sum(edge²).
3. User-prefix cache hit (a returning user with one new event, 199 cached events) vs miss
   (prefix dropped first) at length 200, batch 16: next-5 end to end and the encode alone
   (k = 1: prefill or extension plus one scoring pass).
4. Latency growth from length 50 to 200 at batch 32 (next-5, max_batch 32): the ratio
   P50(L=200) / P50(L=50) (the reference port: +123 % on A100, +387 % on an unoptimised NPU).
5. next-5 against its FLOP floor (benchmarks/_flop_floor.py): B16 L200 vs a GEMM of its FLOPs; B1 L200 in ms.
Memory: peak RSS (getrusage), device peak where present, KV pool bytes per bucket.

0. ``--graphs A,B`` (e.g. eager,compiled) runs only this section: next-5 at batch 1 and 16, length
   50 / 100 / 200, by two engines of the same model (buckets 50/100/200, batch sizes 1 and 16), one
   per graph mode ("cached": the AOTInductor packages of a graph cache, what a served run loads),
   called alternately; P50 ratio A / B per shape, each shape's compile seconds
   (``Engine.graph_report``: first call = compilation + one run) and the load average around it.
   ``--preset`` picks the model size (small, large, prod).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from _flop_floor import flop_floor, summary_part
from hstu.backend import Backend, CPUBackend, select
from hstu.backend.graph_cache import GraphCache
from hstu.bench.timing import interleaved, latency_stats
from hstu.bench.timing import percentile_ms as pct
from hstu.config import PRESETS, ModelConfig
from hstu.generate.engine import Engine
from hstu.model import build_hstu
from hstu.model.hstu import HSTUModel

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # ../shared/data beside the repository
EDGES = (20, 50, 100, 200)
log = logging.getLogger("bench.generate")


def make_model(device, preset: str = "small") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(num_items=3706, dropout=0.0, **PRESETS[preset])
    return build_hstu(cfg).to(device).eval()


def histories(lengths: np.ndarray, width: int, num_items: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    L = torch.as_tensor(lengths, dtype=torch.int64)
    ids = torch.randint(1, num_items + 1, (B, width), generator=g)
    ts = 10**9 + torch.cumsum(torch.randint(1, 10**5, (B, width), generator=g), dim=1)
    live = torch.arange(width).view(1, -1) < L.view(-1, 1)
    ids, ts = ids * live, ts * live
    rt = ts.max(dim=1).values + 60
    return ids.to(device), ts.to(device), L.to(device), rt.to(device)


def summary(times) -> dict:
    st = latency_stats(times, 1)
    return {"p50_ms": round(st["p50_ms"], 3), "p99_ms": round(st["p99_ms"], 3), "min_ms": round(st["min_ms"], 3), "n": st["calls"]}


def ratio(slow: list[float], fast: list[float]) -> dict:
    """P50 ratio (the headline) and the ratio of the best calls (less sensitive to a loaded machine)."""
    return {"speedup": round(pct(slow, 50) / pct(fast, 50), 3), "speedup_of_min": round(min(slow) / min(fast), 3)}


def ml1m_lengths(quick: bool) -> np.ndarray | None:
    """Events per user of ML-1M: hstu.data.load_dataset (full run), or a count of the user-id
    column of ratings.dat (--quick: the same numbers, ML-1M has one row per rated movie, in a
    fraction of the parse time)."""
    path = DATA / "ml-1m"
    if not (path / "ratings.dat").exists():
        return None
    if quick:
        with open(path / "ratings.dat", "rb") as fh:
            users = np.fromiter((int(line.split(b"::", 1)[0]) for line in fh if line.strip()), dtype=np.int64)
        return np.unique(users, return_counts=True)[1]
    from hstu.data import load_dataset

    log_ = load_dataset("ml-1m", path)
    return np.diff(log_.offsets)


def taobao_lengths() -> np.ndarray | None:
    path = DATA / "taobao-userbehavior-head" / "UserBehavior_head.csv"
    if not path.exists():
        return None
    import pandas as pd

    users = pd.read_csv(path, header=None, usecols=[0], names=["user"])["user"]
    return users.value_counts().to_numpy()


def bucket_edge(n: int) -> int:
    return next(e for e in EDGES if n <= e)


@dataclass
class Bench:
    """What every section of the benchmark reads: arguments, backend, model, repeat counts, the two engines."""

    args: argparse.Namespace
    be: Backend
    dev: torch.device
    sync: Callable[[], None]
    model: HSTUModel
    I: int
    reps: int
    mix_users: int
    mix_reps: int
    eng_kw: dict
    eng: Engine
    flat: Engine
    t_start: float


def _kv_vs_recompute(b: Bench, out: dict) -> None:
    """1. next-5 with the KV cache vs a full recompute, into out."""
    dev, sync, I, reps, eng = b.dev, b.sync, b.I, b.reps, b.eng
    # ---- 1. KV cache vs recompute ----
    kv = {}
    print("\n1. next-5: KV cache vs full recompute (same engine); ideal 4.5x")
    for B in (1, 16):
        for L in (50, 100, 200):
            ids, ts, Ls, rt = histories(np.full(B, L), L, I, dev, seed=L + B)
            t = interleaved(
                {
                    "cached": lambda: eng.generate(ids, ts, Ls, 5, request_time=rt),
                    "recompute": lambda: eng.generate(ids, ts, Ls, 5, request_time=rt, use_cache=False),
                },
                reps,
                sync=sync,
                rotate=False,
            )
            sp = pct(t["recompute"], 50) / pct(t["cached"], 50)
            kv[f"L{L}_B{B}"] = {
                "cached": summary(t["cached"]),
                "recompute": summary(t["recompute"]),
                **ratio(t["recompute"], t["cached"]),
                "fraction_of_ideal_4.5": round(sp / 4.5, 3),
            }
            print(
                f"  B={B:2d} L={L:3d}: cached P50 {pct(t['cached'], 50):7.2f} ms (P99 {pct(t['cached'], 99):7.2f}), "
                f"recompute P50 {pct(t['recompute'], 50):7.2f} ms (P99 {pct(t['recompute'], 99):7.2f})  -> {sp:.2f}x "
                f"({sp / 4.5:.0%} of ideal; best-call ratio {kv[f'L{L}_B{B}']['speedup_of_min']:.2f}x)"
            )
    out["kv_vs_recompute"] = kv
    k = kv["L200_B16"]
    out["kv_vs_recompute_speedup_L200_B16"] = {
        "speedup": k["speedup"],
        "speedup_of_min": k["speedup_of_min"],
        "fraction_of_ideal": k["fraction_of_ideal_4.5"],
        "cached_p50_ms": k["cached"]["p50_ms"],
        "cached_p99_ms": k["cached"]["p99_ms"],
        "recompute_p50_ms": k["recompute"]["p50_ms"],
        "recompute_p99_ms": k["recompute"]["p99_ms"],
    }


def _bucketed_vs_padded(b: Bench, out: dict) -> None:
    """2. next-5 over user mixes: bucketed vs one bucket padded to 200, into out."""
    args, dev, sync, I, mix_users, mix_reps, eng, flat = b.args, b.dev, b.sync, b.I, b.mix_users, b.mix_reps, b.eng, b.flat
    # ---- 2. bucketed vs pad-to-200 ----
    print("\n2. next-5 over a user mix: bucketed (20/50/100/200) vs one bucket padded to 200")
    rng = np.random.default_rng(0)
    dists = {"ml-1m": ml1m_lengths(args.quick), "taobao": taobao_lengths(), "uniform_1_200": np.arange(1, 201)}
    bucketed = {}
    for name, pool in dists.items():
        if pool is None:
            print(f"  {name}: data absent under {DATA}, skipped")
            continue
        lens = np.minimum(rng.choice(pool, size=mix_users, replace=True), 200)
        ids, ts, Ls, rt = histories(lens, 200, I, dev, seed=1)
        t = interleaved(
            {
                "bucketed": lambda: eng.generate(ids, ts, Ls, 5, request_time=rt),
                "padded": lambda: flat.generate(ids, ts, Ls, 5, request_time=rt),
            },
            mix_reps,
            sync=sync,
            rotate=False,
        )
        edges = np.array([bucket_edge(int(n)) for n in lens])
        ideal_lin = 200.0 * len(lens) / edges.sum()
        ideal_att = 200.0**2 * len(lens) / (edges.astype(np.float64) ** 2).sum()
        sp = pct(t["padded"], 50) / pct(t["bucketed"], 50)
        full_pool = np.minimum(pool, 200)
        bucketed[name] = {
            "users": int(len(lens)),
            "median_len": float(np.median(full_pool)),
            "share_at_cap": round(float((full_pool >= 200).mean()), 3),
            "bucketed": summary(t["bucketed"]),
            "padded": summary(t["padded"]),
            "bucketed_users_per_s": round(len(lens) / np.median(t["bucketed"]), 1),
            "padded_users_per_s": round(len(lens) / np.median(t["padded"]), 1),
            **ratio(t["padded"], t["bucketed"]),
            "ideal_linear": round(ideal_lin, 3),
            "ideal_attention": round(ideal_att, 3),
            "fraction_of_ideal_linear": round(sp / ideal_lin, 3),
            "fraction_of_ideal_attention": round(sp / ideal_att, 3),
        }
        print(
            f"  {name:13s} (median {np.median(full_pool):.0f}, {(full_pool >= 200).mean():.0%} at the cap; {len(lens)} users): "
            f"bucketed P50 {pct(t['bucketed'], 50):8.1f} ms, padded P50 {pct(t['padded'], 50):8.1f} ms -> {sp:.2f}x throughput "
            f"(ideal {ideal_lin:.2f}x linear, {ideal_att:.2f}x attention; {sp / ideal_lin:.0%} / {sp / ideal_att:.0%}; "
            f"best-call ratio {bucketed[name]['speedup_of_min']:.2f}x)"
        )
    out["bucketed_vs_padded"] = bucketed
    main_mix = bucketed.get("ml-1m") or bucketed.get("uniform_1_200")
    out["bucketed_vs_padded_speedup"] = {
        "distribution": "ml-1m" if "ml-1m" in bucketed else "uniform_1_200",
        "speedup": main_mix["speedup"],
        "speedup_of_min": main_mix["speedup_of_min"],
        "fraction_of_ideal_linear": main_mix["fraction_of_ideal_linear"],
        "fraction_of_ideal_attention": main_mix["fraction_of_ideal_attention"],
        "bucketed_p50_ms": main_mix["bucketed"]["p50_ms"],
        "bucketed_p99_ms": main_mix["bucketed"]["p99_ms"],
        "padded_p50_ms": main_mix["padded"]["p50_ms"],
        "padded_p99_ms": main_mix["padded"]["p99_ms"],
    }


def _prefix_cache(b: Bench, out: dict) -> None:
    """3. the user-prefix cache at length 200, batch 16: hit vs miss, into out."""
    dev, sync, model, I, reps, eng_kw = b.dev, b.sync, b.model, b.I, b.reps, b.eng_kw
    # ---- 3. prefix cache hit vs miss ----
    print("\n3. user-prefix cache at length 200, batch 16: hit (199 cached events + 1 new) vs miss")
    peng = Engine(model, buckets=EDGES, max_batch=16, k_max=10, prefix_cache_bytes=256 * 2**20, **eng_kw)
    B = 16
    ids, ts, Ls, rt = histories(np.full(B, 200), 200, I, dev, seed=7)
    users = [f"user{i}" for i in range(B)]
    prev = Ls - 1
    prefix = {}
    for kk in (5, 1):

        def setup(name):
            peng.prefix.clear()
            if name == "hit":  # the previous visit: 199 events, an earlier request time
                peng.generate(ids, ts, prev, 1, request_time=ts[:, 198] + 30, user_ids=users)

        t = interleaved(
            {
                "hit": lambda: peng.generate(ids, ts, Ls, kk, request_time=rt, user_ids=users),
                "miss": lambda: peng.generate(ids, ts, Ls, kk, request_time=rt, user_ids=users),
            },
            reps,
            sync=sync,
            rotate=False,
            setup=setup,
        )
        chk = peng.generate(ids, ts, Ls, kk, request_time=rt, user_ids=users)  # sanity: a stored entry is reused
        assert int(chk.prefix_rows.min()) == 199, chk.prefix_rows
        sp = pct(t["miss"], 50) / pct(t["hit"], 50)
        key = "next5" if kk == 5 else "encode_only_k1"
        prefix[key] = {"hit": summary(t["hit"]), "miss": summary(t["miss"]), **ratio(t["miss"], t["hit"])}
        print(
            f"  {key:15s}: hit P50 {pct(t['hit'], 50):7.2f} ms (P99 {pct(t['hit'], 99):7.2f}), miss P50 {pct(t['miss'], 50):7.2f} ms "
            f"(P99 {pct(t['miss'], 99):7.2f}) -> {sp:.2f}x (best-call ratio {prefix[key]['speedup_of_min']:.2f}x)"
        )
    out["prefix_cache"] = prefix
    p = prefix["next5"]
    out["prefix_hit_vs_miss_speedup_L200"] = {
        "speedup": p["speedup"],
        "speedup_of_min": p["speedup_of_min"],
        "what": "next-5, batch 16, one new event",
        "hit_p50_ms": p["hit"]["p50_ms"],
        "hit_p99_ms": p["hit"]["p99_ms"],
        "miss_p50_ms": p["miss"]["p50_ms"],
        "miss_p99_ms": p["miss"]["p99_ms"],
        "encode_only_speedup": prefix["encode_only_k1"]["speedup"],
        "encode_only_speedup_of_min": prefix["encode_only_k1"]["speedup_of_min"],
    }


def _latency_growth(b: Bench, out: dict) -> float:
    """4. next-5 latency growth from length 50 to 200 at batch 32, into out; returns the P50 ratio."""
    dev, sync, model, I, reps, eng_kw = b.dev, b.sync, b.model, b.I, b.reps, b.eng_kw
    print("\n4. next-5 latency growth from length 50 to 200 at batch 32")
    e32 = Engine(model, buckets=EDGES, max_batch=32, k_max=10, **eng_kw)
    if e32.graphs != "eager":
        e32.warmup()
    h50 = histories(np.full(32, 50), 200, I, dev, seed=50)
    h200 = histories(np.full(32, 200), 200, I, dev, seed=200)
    t = interleaved(
        {"L50": lambda: e32.generate(*h50[:3], 5, request_time=h50[3]), "L200": lambda: e32.generate(*h200[:3], 5, request_time=h200[3])},
        reps,
        sync=sync,
        rotate=False,
    )
    growth = pct(t["L200"], 50) / pct(t["L50"], 50)
    out["latency_growth_L50_to_L200_B32"] = {
        "ratio": round(growth, 3),
        "increase_percent": round(100 * (growth - 1), 1),
        "ratio_of_min": round(min(t["L200"]) / min(t["L50"]), 3),
        "L50_p50_ms": round(pct(t["L50"], 50), 3),
        "L50_p99_ms": round(pct(t["L50"], 99), 3),
        "L200_p50_ms": round(pct(t["L200"], 50), 3),
        "L200_p99_ms": round(pct(t["L200"], 99), 3),
        "reference_port": {"A100": "+123 %", "NPU unoptimised": "+387 %"},
    }
    print(
        f"  L=50 P50 {pct(t['L50'], 50):.2f} ms (P99 {pct(t['L50'], 99):.2f}), L=200 P50 {pct(t['L200'], 50):.2f} ms "
        f"(P99 {pct(t['L200'], 99):.2f}) -> x{growth:.2f} ({100 * (growth - 1):+.0f} %)"
    )
    return growth


def _memory_and_summary(b: Bench, out: dict, growth: float) -> None:
    """Peak memory into out, the summary line, and out written to --json."""
    args, be, eng, t_start = b.args, b.be, b.eng, b.t_start
    # ---- memory ----
    mem = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    peak = be.peak_memory_bytes()  # None on the host (peak RSS above)
    if peak is not None:
        mem["device_peak_bytes"] = peak
    mem["engine_memory"] = {str(k): v for k, v in eng.memory_report()["buckets"].items()}
    out["memory"] = mem
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    out["machine"]["load_avg_at_end"] = list(os.getloadavg())
    print(
        f"\nmemory: peak RSS {mem['peak_rss_bytes'] / 2**20:.0f} MiB"
        + (f", device peak {mem['device_peak_bytes'] / 2**20:.0f} MiB" if "device_peak_bytes" in mem else "")
    )
    print(
        f"summary: kv/recompute L200 B16 {out['kv_vs_recompute_speedup_L200_B16']['speedup']:.2f}x (floor 4.05: 90 % of 4.5), "
        f"bucketed/padded {out['bucketed_vs_padded_speedup']['speedup']:.2f}x (floor 1.35), "
        f"prefix hit/miss {out['prefix_hit_vs_miss_speedup_L200']['speedup']:.2f}x (floor 3), growth L50->L200 B32 x{growth:.2f}, "
        f"{summary_part(out['flop_floor'])}; {out['seconds']} s"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


def graphs_side_by_side(args: argparse.Namespace, be: Backend, model: HSTUModel, reps: int) -> dict:
    """0. next-5 under two graph modes (``args.graphs`` "A,B"), same model and inputs, alternated call by
    call; returns the figures (also written to --json)."""
    modes = args.graphs.split(",")
    dev, I, edges = be.device, model.cfg.num_items, (50, 100, 200)
    out: dict = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "device": str(dev), "torch": torch.__version__}
    out |= {"preset": args.preset, "precision": args.precision, "threads": torch.get_num_threads(), "reps": reps}
    out["load_avg_at_start"] = list(os.getloadavg())
    engines, warm = {}, {}
    tmp = tempfile.TemporaryDirectory(prefix="hstu-graphs-")  # "cached": the packages, removed at exit
    for m in modes:
        t0 = time.perf_counter()
        mode, _, guards = m.partition("+")  # "compiled+guards": TorchDynamo's per-call guard checks kept (Engine.guard_checks)
        cache = None
        if mode == "cached":  # what `hstu serve` loads from a run's `hstu export --graphs`: AOTInductor packages
            mode, cache = "compile", GraphCache(Path(tmp.name) / "graphs", model, dev, layout=(edges, 16))
        engines[m] = Engine(
            model, buckets=edges, max_batch=16, k_max=10, batch_sizes=(1, 16), device=dev, graphs=mode, kernels=args.kernels,
            graph_cache=cache,
        )  # fmt: skip
        engines[m].guard_checks = guards == "guards"
        engines[m].warmup()
        warm[m] = {"seconds": round(time.perf_counter() - t0, 1), "mode": engines[m].graphs, "graphs": engines[m].graph_report()}
        print(f"{m} ({engines[m].graphs}): engine + warm-up {warm[m]['seconds']} s")
        for g in warm[m]["graphs"]:
            print(f"  bucket {g['bucket']} {g['key']}: {g['mode']} in {g['compile_s']:.1f} s" + (f" ({g['error']})" if g["error"] else ""))
    out["warmup"] = warm
    out["load_avg_after_warmup"] = list(os.getloadavg())
    a, b = modes
    print(f"\n0. next-5, {a} vs {b} (P50 ms; ratio = {a} / {b})")
    rows = {}
    for B in (1, 16):
        for L in edges:
            ids, ts, Ls, rt = histories(np.full(B, L), L, I, dev, seed=L + B)
            res = {m: engines[m].generate(ids, ts, Ls, 5, request_time=rt) for m in modes}
            same = torch.equal(res[a].items, res[b].items)
            diff = float((res[a].scores - res[b].scores).abs().max())
            fns = {m: (lambda e=engines[m]: e.generate(ids, ts, Ls, 5, request_time=rt)) for m in modes}
            t = interleaved(fns, reps, warmup=1, sync=be.synchronize)
            rows[f"L{L}_B{B}"] = {m: summary(t[m]) for m in modes} | ratio(t[a], t[b]) | {"same_items": same, "max_score_diff": diff}
            r = rows[f"L{L}_B{B}"]
            print(
                f"  B={B:2d} L={L:3d}: {a} {r[a]['p50_ms']:7.2f} ms, {b} {r[b]['p50_ms']:7.2f} ms -> {r['speedup']:.2f}x "
                f"(best calls {r['speedup_of_min']:.2f}x); same items {same}, max |score diff| {diff:.1e}; load {os.getloadavg()[0]:.2f}"
            )
    out["next5"] = rows
    out["load_avg_at_end"] = list(os.getloadavg())
    tmp.cleanup()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return out


def main(argv: list[str] | None = None) -> int:
    global DATA
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="few repeats and small mixes (< 60 s on 2 cores; graph builds with a compiled or cached side add ~3 minutes)",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--graphs",
        default="auto",
        help="engine graph mode: auto | eager | compiled | compile | cuda_graph | npu_graph; two, comma-separated "
        "(eager,compiled): section 0 only, side by side; a mode with '+guards' keeps TorchDynamo's per-call guard checks "
        "(compiled+guards,compiled: what skipping them saves); 'cached' (side by side only): AOTInductor packages built "
        "into a temporary graph cache, as `hstu serve` loads a run's `hstu export --graphs`",
    )
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model size (section 0; the others use small)")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine two OpenMP threads spin-wait on "
        "each other whenever another process holds a core, which made every op ~15x slower in our runs; "
        "0 = torch default)",
    )
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "fp16", "int8"],
        help="model precision (hstu.quant.apply_precision on the random-weight model)",
    )
    ap.add_argument(
        "--data-root",
        type=Path,
        default=DATA,
        help="folder holding ml-1m/ and taobao-userbehavior-head/ for the length mixes (default ../shared/data)",
    )
    args = ap.parse_args(argv)
    DATA = args.data_root
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    be = select(args.device)
    dev = be.device
    sync = be.synchronize
    side_by_side = "," in args.graphs
    if side_by_side and len(args.graphs.split(",")) != 2:
        ap.error(f"--graphs: two modes to compare, comma-separated (eager,compiled), got {args.graphs!r}")
    model = make_model(dev, args.preset if side_by_side else "small")
    if args.precision != "fp32":
        from hstu.quant import apply_precision

        model = apply_precision(model, args.precision)
    I = model.cfg.num_items
    reps = 6 if args.quick else 40
    if side_by_side:
        graphs_side_by_side(args, be, model, reps)
        return 0
    mix_users = 96 if args.quick else 512
    mix_reps = 3 if args.quick else 8
    eng_kw = dict(device=dev, graphs=args.graphs, kernels=args.kernels)
    eng = Engine(model, buckets=EDGES, max_batch=16, k_max=10, **eng_kw)
    flat = Engine(model, buckets=(200,), max_batch=16, k_max=10, **eng_kw)
    warm = {"bucketed": eng.warmup(), "padded": flat.warmup()} if eng.graphs != "eager" else {}
    out: dict = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "quick": args.quick,
        "device": str(dev),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu": CPUBackend().device_name(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "load_avg_at_start": list(os.getloadavg()),
        },
        "model": {"preset": "small", "num_items": I, "width_N": model.cfg.width, "weights": "random", "precision": args.precision},
        "engine": {"buckets": list(EDGES), "max_batch": 16, "k_max": 10, "graphs": eng.graphs, "kernels": eng.kernels.name},
        "warmup_s": warm,
        "kv_pool_bytes_per_bucket": eng.cache_bytes_per_bucket(),
    }
    print(
        f"device {dev}, graphs {eng.graphs}, kernels {eng.kernels.name}, reps {reps}; KV pool bytes per bucket "
        f"{eng.cache_bytes_per_bucket()}"
    )

    b = Bench(args, be, dev, sync, model, I, reps, mix_users, mix_reps, eng_kw, eng, flat, t_start)
    _kv_vs_recompute(b, out)
    _bucketed_vs_padded(b, out)
    _prefix_cache(b, out)
    growth = _latency_growth(b, out)
    flop_floor(b, histories, EDGES, out)
    _memory_and_summary(b, out, growth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
