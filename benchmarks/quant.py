"""Quantization benchmark: float32 vs INT8 vs BF16, side by side in one process.

Measures, for two configs:
  small — the trained ML-1M run given by --run (HSTU small preset: d=50, 2 blocks, 1 head);
  prod  — the "prod" preset with random weights (ML-20M recipe size: d=256, 4 blocks, 4 heads,
          d_qk=d_v=64, max_seq_len 200) over --prod-items items (default 26,744, ML-20M's catalogue);
  * checkpoint bytes: whole file and dense part (everything but the embedding tables) of the
    quantized run written by hstu.quant.save_quantized_run vs the float32 tensors;
  * next-k generation (the serving Engine by default, --path decode for hstu.generate.generate;
    greedy, KV cache preallocated once per model) at
    batch B with histories of H events: per-batch latency P50 / P99 (ms) and QPS (users / s);
    variants are timed interleaved (one call each per round, order rotated every round) so that
    load from other processes on a shared machine hits all of them alike; throughput in two
    layouts of the 2 cores: one process at --threads threads, and --workers single-threaded
    processes generating at once (what `hstu serve --model-workers 2 --threads 1` runs), each
    variant's throughput ratio taken at its best layout (both layouts are reported);
  * Linear-only time: every Linear call of one float generate() (prefill + decode steps) is
    recorded and replayed through the float / INT8 / BF16 modules, interleaved the same way;
  * quality (small only): HR@10 / NDCG@10 on the ML-1M test split (full ranking,
    hstu.train.evaluate.evaluate) and AUC of candidate scoring (target vs --negatives uniformly
    sampled items the user never rated, same negatives for every variant; hstu.train.metrics.auc).

Usage (the ML-1M run: `hstu train --dataset ml-1m --data-dir ../shared/data/ml-1m --preset small --epochs 8 --out RUN_DIR`):
  python benchmarks/quant.py --run RUN_DIR --data-dir ../shared/data/ml-1m --json benchmarks/results/quant_ml1m.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hstu.backend import CPUBackend
from hstu.bench.timing import interleaved, latency_stats
from hstu.config import model_config_from_preset
from hstu.data.batching import eval_batch
from hstu.data.prepare import DataSpec, prepare_data
from hstu.data.sequences import make_split
from hstu.generate import KVCache, generate
from hstu.generate.decode import exclusion_mask
from hstu.model.checkpoint import save_weights, write_json
from hstu.model.hstu import build_hstu
from hstu.quant import apply_precision, load_quantized_run, save_quantized_run, select_int8_kernel, tensor_bytes
from hstu.quant.checkpoint import quantized_state
from hstu.runs import load_run
from hstu.train.evaluate import evaluate
from hstu.train.metrics import auc

log = logging.getLogger("bench.quant")
VARIANTS = ("fp32", "int8", "int8e", "bf16")
# variant -> (scheme, apply_precision options): "int8" is the scheme's default (fp16 item table, float
# similarity); "int8e" stores the item table row-wise INT8 (--embeddings int8), whose similarity then runs
# on the integer GEMM too (hstu.model.item_index.Int8Index)
SCHEMES = {"int8": ("int8", {}), "int8e": ("int8", {"embeddings": "int8"}), "bf16": ("bf16", {})}


def machine() -> dict:
    cpu = CPUBackend().device_name()
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
        isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8") if f" {f}" in flags]
    except OSError:
        isa = []
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "isa": isa,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "quantized_engines": torch.backends.quantized.supported_engines,
        "int8_kernel": select_int8_kernel("cpu").__dict__,
    }


# ----- models --------------------------------------------------------------------------------


def make_variants(float_model, src_run: Path, tmp: Path) -> tuple[dict, dict, dict]:
    """{"fp32", "int8", "int8e", "bf16"} -> model (quantized ones reloaded from their checkpoints),
    sizes, and the run directory each loads from (name -> (dir, scheme or None))."""
    models = {"fp32": float_model}
    dirs = {"fp32": (str(src_run), None)}
    fstate = {k: v.detach().cpu() for k, v in float_model.state_dict().items()}
    fbytes = tensor_bytes(fstate)
    sizes = {"fp32": {"tensors": fbytes, "file": (src_run / "model.safetensors").stat().st_size}}
    for name, (scheme, opts) in SCHEMES.items():
        q = apply_precision(copy.deepcopy(float_model), scheme, **opts)
        out = tmp / name
        meta = save_quantized_run(q, src_run, out)
        models[name], _, _ = load_quantized_run(out, "cpu", scheme=scheme)
        dirs[name] = (str(out), scheme)
        qb = tensor_bytes(quantized_state(q))
        linear_f = sum(t.numel() * 4 for k, t in fstate.items() if k.endswith((".uvqk.weight", ".o.weight")))
        linear_q = sum(
            t.numel() * t.element_size()
            for k, t in quantized_state(q).items()
            if k.endswith((".uvqk.weight", ".o.weight", ".uvqk.weight_int8", ".o.weight_int8", ".uvqk.weight_scale", ".o.weight_scale"))
        )
        sizes[name] = {
            "tensors": qb,
            "file": meta["bytes"]["file"],
            "dense_bytes_ratio": qb["dense"] / fbytes["dense"],
            "bytes_ratio": meta["bytes"]["file"] / sizes["fp32"]["file"],
            "linear_weight_bytes_ratio": linear_q / linear_f,
        }
    for m in models.values():
        m.eval()
        for p in m.parameters():
            p.requires_grad_(False)
    return models, sizes, dirs


# ----- timing --------------------------------------------------------------------------------


def generation_fns(models: dict, ids, ts, lengths, k: int, path: str = "engine") -> dict:
    """One next-k generation of the batch per call, for each variant: through the serving engine
    (hstu.generate.engine.Engine, what ``hstu serve`` runs; path="engine") or the model-level
    hstu.generate.generate (path="decode")."""
    if path == "engine":
        from hstu.generate.engine import Engine

        B, W = ids.shape[0], int(lengths.max())
        h_ids, h_ts = ids[:, :W].contiguous(), ts[:, :W].contiguous()
        rt = ts.gather(1, lengths.view(-1, 1)).squeeze(1)  # query time at position `length`
        excl = exclusion_mask(models["fp32"].cfg.num_items, B, ids, lengths)
        fns = {}
        for name, m in models.items():
            eng = Engine(m, buckets=(W,), max_batch=B, k_max=k, graphs="eager", batch_sizes=(B,))

            def fn(eng=eng):
                return eng.generate(h_ids, h_ts, lengths, k, request_time=rt, exclude=excl.clone())

            fns[name] = fn
        return fns
    B = ids.shape[0]
    rt = ts.gather(1, lengths.view(-1, 1)).squeeze(1)  # query time at position `length`
    base_excl = exclusion_mask(models["fp32"].cfg.num_items, B, ids, lengths)
    fns = {}
    for name, m in models.items():
        cache = KVCache.for_model(m, B, int(lengths.max()) + k + 1)

        def fn(m=m, cache=cache):
            return generate(m, ids, ts, lengths, k, request_time=rt, exclude=base_excl.clone(), cache=cache)

        fns[name] = fn
    return fns


def linear_fns(models: dict, ids, ts, lengths, k: int) -> tuple[dict, int]:
    """Replay every Linear call of one float generate() on each variant's Linear modules."""
    fm = models["fp32"]
    calls: list[tuple[str, torch.Tensor]] = []
    names = [f"layers.{i}.{p}" for i in range(len(fm.layers)) for p in ("uvqk", "o")]
    hooks = [fm.get_submodule(n).register_forward_hook(lambda mod, i, o, n=n: calls.append((n, i[0].clone()))) for n in names]
    try:
        generation_fns({"fp32": fm}, ids, ts, lengths, k, path="decode")["fp32"]()  # module calls (the engine reads weights)
    finally:
        for h in hooks:
            h.remove()
    fns = {}
    for name, m in models.items():
        mods = {n: m.get_submodule(n) for n in names}
        dt = torch.bfloat16 if name == "bf16" else torch.float32
        inputs = [(mods[n], x.to(dt)) for n, x in calls]

        @torch.inference_mode()
        def fn(inputs=inputs):
            for mod, x in inputs:
                mod(x)

        fns[name] = fn
    return fns, len(calls)


def speed(models: dict, ids, ts, lengths, k: int, repeats: int, warmup: int, path: str = "engine") -> dict:
    B = ids.shape[0]
    gen = interleaved(generation_fns(models, ids, ts, lengths, k, path), repeats, warmup=warmup)
    lin_fns, ncalls = linear_fns(models, ids, ts, lengths, k)
    lin = interleaved(lin_fns, repeats, warmup=warmup)
    out = {
        "generate": {n: latency_stats(t, B) for n, t in gen.items()},
        "linear_only": {n: {"p50_ms": float(np.percentile(t, 50) * 1e3), "mean_ms": float(t.mean() * 1e3)} for n, t in lin.items()},
        "linear_calls_per_generate": ncalls,
    }
    f = out["generate"]["fp32"]
    out["linear_share_of_fp32_generate"] = out["linear_only"]["fp32"]["mean_ms"] / f["mean_ms"]
    for n in models:
        if n == "fp32":
            continue
        out[f"{n}_throughput_ratio"] = out["generate"][n]["qps"] / f["qps"]
        out[f"{n}_p50_speedup"] = f["p50_ms"] / out["generate"][n]["p50_ms"]
        out[f"{n}_linear_speedup"] = out["linear_only"]["fp32"]["mean_ms"] / out["linear_only"][n]["mean_ms"]
        # calls of the same round run back to back: their ratio is the least disturbed by load drift
        out[f"{n}_paired_median_speedup"] = float(np.median(gen["fp32"] / gen[n]))
        out[f"{n}_linear_paired_median_speedup"] = float(np.median(lin["fp32"] / lin[n]))
    return out


def _worker(rank: int, dirs: dict, ids, ts, lengths, k: int, repeats: int, warmup: int, path: str, barrier, queue) -> None:
    """One single-threaded worker process of :func:`worker_speed` (spawned; loads every variant itself)."""
    torch.set_num_threads(1)
    models = {}
    for name, (d, scheme) in dirs.items():
        models[name] = load_run(d, "cpu")[0] if scheme is None else load_quantized_run(d, "cpu", scheme=scheme)[0]
    fns = generation_fns(models, ids, ts, lengths, k, path)
    names = list(fns)
    times = {n: [] for n in names}
    for r in range(warmup + repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            barrier.wait()  # every worker starts the same variant's call together
            t0 = time.perf_counter()
            fns[n]()
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
    queue.put((rank, times))


def worker_speed(dirs: dict, ids, ts, lengths, k: int, repeats: int, warmup: int, workers: int, path: str = "engine") -> dict:
    """Throughput of ``workers`` single-threaded processes generating at once (the layout of
    ``hstu serve --model-workers W --threads 1``): in every round each worker makes one call per
    variant, all workers starting the same variant's call at a barrier, so that the variants share
    the machine alike. QPS of a variant = workers * B * rounds / sum over rounds of the slowest
    worker's call; latency percentiles over every worker's calls (ms)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, dirs, ids, ts, lengths, k, repeats, warmup, path, barrier, queue)) for r in range(workers)
    ]
    for pr in procs:
        pr.start()
    got = dict(queue.get(timeout=3600) for _ in procs)
    for pr in procs:
        pr.join()
    B = ids.shape[0]
    out: dict = {"workers": workers, "threads_per_worker": 1, "generate": {}}
    for n in dirs:
        per = np.asarray([got[r][n] for r in range(workers)])  # (workers, rounds) seconds
        wall = per.max(axis=0)  # (rounds,)
        out["generate"][n] = {
            "p50_ms": float(np.percentile(per, 50) * 1e3),
            "p99_ms": float(np.percentile(per, 99) * 1e3),
            "qps": float(workers * B * len(wall) / wall.sum()),
            "rounds": int(len(wall)),
        }
    f = out["generate"]["fp32"]["qps"]
    for n in dirs:
        if n != "fp32":
            out[f"{n}_throughput_ratio"] = out["generate"][n]["qps"] / f
    return out


def summary_of(sp: dict) -> dict:
    return {k: v for k, v in sp.items() if not isinstance(v, dict)}


def best_qps(config: dict) -> dict[str, dict]:
    """Each variant's highest QPS over the layouts measured on the 2 cores (one process with
    --threads threads; --workers single-threaded processes), with the layout it came from."""
    layouts = {"1_process": config["speed"]["generate"]}
    if "speed_workers" in config:
        layouts[f"{config['speed_workers']['workers']}_workers"] = config["speed_workers"]["generate"]
    best = {}
    for n in config["speed"]["generate"]:
        lay = max(layouts, key=lambda L: layouts[L][n]["qps"])
        best[n] = {"qps": layouts[lay][n]["qps"], "layout": lay}
    return best


# ----- quality ---------------------------------------------------------------------------------


def sampled_negatives(log_, split, users: np.ndarray, m: int, seed: int) -> np.ndarray:
    """(U, m) items each user never interacted with, uniform, seeded (same for every variant)."""
    rng = np.random.default_rng(seed)
    I = log_.num_items
    out = np.zeros((len(users), m), np.int64)
    for r, u in enumerate(users):
        seen = set(log_.items[log_.offsets[u] : log_.offsets[u + 1]].tolist())
        got = []
        while len(got) < m:
            c = rng.integers(1, I + 1, size=2 * m)
            got += [int(x) for x in c if int(x) not in seen]
        out[r] = got[:m]
    return out


@torch.inference_mode()
def candidate_auc(model, log_, split, users: np.ndarray, negs: np.ndarray, batch: int = 256) -> float:
    targets = split.targets("test")
    pos, neg = [], []
    for s in range(0, len(users), batch):
        ub = users[s : s + batch]
        b = eval_batch(log_, targets, ub, model.cfg.max_seq_len)
        u = model.last_rows(model.encode(b.ids, b.timestamps, b.lengths, actions=b.actions, categories=b.categories), b.lengths)
        cand = torch.cat([b.targets.view(-1, 1), torch.from_numpy(negs[s : s + batch])], dim=1)  # (B, 1 + m)
        sc = model.score_items(u, cand).float().numpy()
        pos.append(sc[:, 0])
        neg.append(sc[:, 1:])
    return auc(np.concatenate(pos), np.concatenate(neg))


def quality(models: dict, run: Path, data_dir: str | None, negatives: int, seed: int) -> dict:
    from hstu.model.checkpoint import read_json

    spec = DataSpec(**read_json(run / "config.json")["data"])
    if data_dir:
        spec.data_dir = data_dir
    log_, _ = prepare_data(spec)
    split = make_split(log_, spec.protocol)
    users = np.nonzero(split.targets("test") >= 0)[0]
    negs = sampled_negatives(log_, split, users, negatives, seed)
    out = {}
    for name, m in models.items():
        t0 = time.perf_counter()
        ev = evaluate(m, log_, split, "test")
        out[name] = {
            "HR@10": ev["HR@10"],
            "NDCG@10": ev["NDCG@10"],
            "MRR": ev["MRR"],
            "users": ev["users"],
            "AUC": candidate_auc(m, log_, split, users, negs),
            "seconds": time.perf_counter() - t0,
        }
        log.info("quality %s: %s", name, out[name])
    return out, log_, split


def real_batch(log_, split, B: int, H: int, seed: int):
    """B users with >= H events before their test target; their last H events (real data)."""
    targets = split.test_target
    ok = np.nonzero((targets >= 0) & (targets - log_.offsets[:-1] >= H))[0]
    users = np.sort(np.random.default_rng(seed).choice(ok, size=B, replace=False))
    b = eval_batch(log_, targets, users, H)
    return b.ids, b.timestamps, b.lengths


def random_batch(num_items: int, B: int, H: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, H + 1, dtype=torch.int64)
    ids[:, :H] = torch.randint(1, num_items + 1, (B, H), generator=g)
    gaps = torch.randint(1, 86_400, (B, H + 1), generator=g)
    ts = 1_500_000_000 + gaps.cumsum(dim=1)  # increasing; position H holds the query time
    return ids, ts, torch.full((B,), H, dtype=torch.int64)


# ----- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="trained float ML-1M run (small preset)")
    p.add_argument("--data-dir", help="override the run's data directory")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--history", type=int, default=200)
    p.add_argument("-k", type=int, default=5)
    p.add_argument("--repeats", type=int, default=40, help="timed rounds per config (each round: one call per variant)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--negatives", type=int, default=100)
    p.add_argument("--prod-items", type=int, default=26_744)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="also time this many single-threaded worker processes at once (the `hstu serve --model-workers` "
        "layout); 1: the one-process layout only",
    )
    p.add_argument("--worker-repeats", type=int, default=20, help="timed rounds of the worker layout")
    p.add_argument(
        "--path",
        default="engine",
        choices=["engine", "decode"],
        help="generation path timed: the serving Engine (default) or hstu.generate.generate",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    run = Path(args.run)
    t_start = time.time()
    load0 = os.getloadavg()
    res: dict = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "settings": vars(args),
    }

    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        # --- small (trained ML-1M) ---
        fm, _, _ = load_run(run, "cpu")
        small, small_sizes, small_dirs = make_variants(fm, run, tmp / "small")
        from hstu.model.checkpoint import read_json

        rcfg = read_json(run / "config.json")
        res["base_run"] = {
            "path": str(run),
            "train": rcfg.get("train"),
            "data": rcfg.get("data"),
            "metrics_test": read_json(run / "metrics.json").get("test") if (run / "metrics.json").exists() else None,
        }
        res["small"] = {"config": fm.cfg.__dict__, "sizes": small_sizes}
        if not args.skip_quality:
            q, log_, split = quality(small, run, args.data_dir, args.negatives, args.seed)
            res["small"]["quality"] = q
        else:
            from hstu.model.checkpoint import read_json

            spec = DataSpec(**read_json(run / "config.json")["data"])
            if args.data_dir:
                spec.data_dir = args.data_dir
            log_, _ = prepare_data(spec)
            split = make_split(log_, spec.protocol)
        ids, ts, lens = real_batch(log_, split, args.batch, args.history, args.seed)
        res["small"]["speed"] = speed(small, ids, ts, lens, args.k, args.repeats, args.warmup, args.path)
        log.info("small speed: %s", {k: v for k, v in res["small"]["speed"].items() if not isinstance(v, dict)})
        if args.workers > 1:
            res["small"]["speed_workers"] = worker_speed(
                small_dirs, ids, ts, lens, args.k, args.worker_repeats, args.warmup, args.workers, args.path
            )
            log.info("small, %d workers: %s", args.workers, summary_of(res["small"]["speed_workers"]))
        del small

        # --- prod (random weights) ---
        pcfg = model_config_from_preset("prod", num_items=args.prod_items, dropout=0.0)
        pm = build_hstu(pcfg).eval()
        prun = tmp / "prod_float"
        prun.mkdir()
        save_weights(prun / "model.safetensors", pm)
        write_json(prun / "config.json", {"model": pcfg.__dict__})
        write_json(prun / "idmap.json", {"item_raw_ids": list(range(pcfg.num_items + 1))})
        prod, prod_sizes, prod_dirs = make_variants(pm, prun, tmp / "prod")
        res["prod"] = {"config": pcfg.__dict__, "sizes": prod_sizes}
        ids, ts, lens = random_batch(pcfg.num_items, args.batch, args.history, args.seed)
        res["prod"]["speed"] = speed(prod, ids, ts, lens, args.k, args.repeats, args.warmup, args.path)
        log.info("prod speed: %s", {k: v for k, v in res["prod"]["speed"].items() if not isinstance(v, dict)})
        if args.workers > 1:
            del prod  # the workers load their own copies
            res["prod"]["speed_workers"] = worker_speed(
                prod_dirs, ids, ts, lens, args.k, args.worker_repeats, args.warmup, args.workers, args.path
            )
            log.info("prod, %d workers: %s", args.workers, summary_of(res["prod"]["speed_workers"]))

    res["loadavg_start"], res["loadavg_end"] = list(load0), list(os.getloadavg())
    res["wall_seconds"] = time.time() - t_start
    for c in ("small", "prod"):
        res[c]["best_qps"] = best_qps(res[c])
    for s in SCHEMES:
        res[f"{s}_dense_bytes_ratio"] = res["small"]["sizes"][s]["dense_bytes_ratio"]
        res[f"{s}_dense_bytes_ratio_prod"] = res["prod"]["sizes"][s]["dense_bytes_ratio"]
        res[f"{s}_bytes_ratio"] = res["small"]["sizes"][s]["bytes_ratio"]
        res[f"{s}_bytes_ratio_prod"] = res["prod"]["sizes"][s]["bytes_ratio"]
        # QPS on the 2 cores: each variant at its best layout (see best_qps); the one-process figures too
        res[f"{s}_throughput_ratio"] = res["prod"]["best_qps"][s]["qps"] / res["prod"]["best_qps"]["fp32"]["qps"]
        res[f"{s}_throughput_ratio_small"] = res["small"]["best_qps"][s]["qps"] / res["small"]["best_qps"]["fp32"]["qps"]
        res[f"{s}_throughput_ratio_1process"] = res["prod"]["speed"][f"{s}_throughput_ratio"]
        res[f"{s}_throughput_ratio_1process_small"] = res["small"]["speed"][f"{s}_throughput_ratio"]
        res[f"{s}_linear_speedup"] = res["prod"]["speed"][f"{s}_linear_speedup"]
        res[f"{s}_linear_speedup_small"] = res["small"]["speed"][f"{s}_linear_speedup"]
        res[f"{s}_paired_median_speedup"] = res["prod"]["speed"][f"{s}_paired_median_speedup"]
        res[f"{s}_paired_median_speedup_small"] = res["small"]["speed"][f"{s}_paired_median_speedup"]
        if "quality" in res["small"]:
            qf, qs = res["small"]["quality"]["fp32"], res["small"]["quality"][s]
            res[f"{s}_hr10_drop"] = qf["HR@10"] - qs["HR@10"]
            res[f"{s}_ndcg10_drop"] = qf["NDCG@10"] - qs["NDCG@10"]
            res[f"{s}_auc_drop"] = qf["AUC"] - qs["AUC"]
    floors = {
        "int8_dense_bytes_ratio <= 0.3": res["int8_dense_bytes_ratio"] <= 0.3,
        "int8_throughput_ratio >= 1.3": res["int8_throughput_ratio"] >= 1.3,
    }
    if "int8_hr10_drop" in res:
        floors["int8_hr10_drop <= 0.003"] = res["int8_hr10_drop"] <= 0.003
        floors["int8_auc_drop <= 0.001"] = res["int8_auc_drop"] <= 0.001
    # the same floors for the scheme with the row-wise INT8 item table (--embeddings int8)
    floors["int8e_dense_bytes_ratio <= 0.3"] = res["int8e_dense_bytes_ratio"] <= 0.3
    floors["int8e_throughput_ratio >= 1.3"] = res["int8e_throughput_ratio"] >= 1.3
    if "int8e_hr10_drop" in res:
        floors["int8e_hr10_drop <= 0.003"] = res["int8e_hr10_drop"] <= 0.003
        floors["int8e_auc_drop <= 0.001"] = res["int8e_auc_drop"] <= 0.001
    res["floors"] = floors
    res["notes"] = (
        "Shared 2-core machine (see loadavg_start/_end): every variant is timed interleaved, one call each per round "
        "with the order rotated, so drift in load hits all alike; generation runs through the serving Engine unless "
        "settings.path is 'decode'; "
        "*_paired_median_speedup is the median over rounds of fp32_time / variant_time within a round. "
        "linear_share_of_fp32_generate = replayed Linear time / generate time: the INT8 gain is bounded by "
        "1 / (1 - share + share / linear_speedup) (Amdahl). int8 = the INT8 scheme as specified (fp16 item "
        "table, similarity in float); int8e = the same with the row-wise INT8 item table (--embeddings int8), "
        "whose full-catalogue similarity runs on the integer GEMM. BF16 on a CPU without avx512_bf16/AMX is emulated. "
        "Throughput on the 2 cores is measured in two layouts: one process with --threads threads (speed; its "
        "ratios are *_throughput_ratio_1process*) and --workers single-threaded processes generating at once, "
        "started together per call at a barrier (speed_workers, the layout of `hstu serve --model-workers 2 "
        "--threads 1`); *_throughput_ratio compares each variant's best QPS over the two (best_qps names the "
        "layout). P50/P99 latencies are reported for both."
    )
    summary = {k: v for k, v in res.items() if k.startswith(tuple(f"{s}_" for s in SCHEMES))}
    print(json.dumps({"summary": summary, "floors": floors}, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
