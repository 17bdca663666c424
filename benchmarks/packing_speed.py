"""Training-step speed of packed rows against padded rows (issue 20 A, TrainConfig.packing), measured
side by side in one process: the same random batches of ML-1M users (small preset, clean protocol),
each step (batch, forward, loss, backward, AdamW) run padded then packed, alternating, for each
negatives scheme; prints and writes sequences/s of each, their ratio, the padding of each layout
(live tokens / tokens) and the load average before and after (the machine is shared).
``--scores``: also the packed per-position recipe (negatives_chunk 1) with its loss's sampled scores
computed by blocks (:func:`hstu.train.losses.sampled_scores`, the loss as it is) against the whole
(positions x items) product and its autograd gradient (the formula it replaced), and the packed chunked
scheme (negatives_chunk 16) and the former default recipe (before issue 20: chunk 16, length pools of 50, not
packed; its own length-bucketed batches of the same epoch; ``--batches 47``: the whole epoch) for scale,
alternating per batch. (The packed per-position recipe is today's default, TrainConfig().)

    OMP_NUM_THREADS=1 python benchmarks/packing_speed.py --batches 12 --scores --out benchmarks/results/packing_speed.json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import hstu.train.losses as losses
from _quality import command, git_commit, machine, write_json
from hstu.config import LEGACY_TRAIN_DEFAULTS, TrainConfig, model_config_from_preset
from hstu.data.batching import packed_train_batch, train_batch
from hstu.data.prepare import DataSpec, model_config_for, prepare_data
from hstu.model.hstu import build_hstu
from hstu.train.loop import LocalStrategy, dense_adamw, epoch_batches
from hstu.train.recipe import recipe


def whole_product_scores(q: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The formula :func:`hstu.train.losses.sampled_scores` replaced: the whole (P x K) product, picked."""
    return (q @ rows.T).gather(1, cols)


def timed_steps(log_, split, batches, variants: dict) -> tuple[dict, dict]:
    """Seconds and sequences of each variant's training steps (batch, forward, loss, backward, AdamW),
    alternating per batch, each variant with its own model from the same seed; ``variants``: name ->
    (TrainConfig, sampled-scores function[, its own batches]), by default ``batches`` (then the same
    batches and negatives for every variant). Each variant's batch 0 warms up."""
    models, opts = {}, {}
    for name, (tc, *_) in variants.items():
        torch.manual_seed(0)
        models[name] = build_hstu(model_config_for(log_, model_config_from_preset("small"), True)).train()
        opts[name] = dense_adamw(models[name].parameters(), tc)
    own = {name: (v[2] if len(v) > 2 else batches) for name, v in variants.items()}
    st = LocalStrategy()
    st.start("cpu", next(iter(variants.values()))[0])
    secs, seqs = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0)
    for i in range(max(len(b) for b in own.values())):
        for name, (tc, scores, *_) in variants.items():  # alternate: every variant sees the same load
            if i >= len(own[name]):
                continue
            losses.sampled_scores = scores
            gen = torch.Generator().manual_seed(i)  # the same negatives for every variant
            t0 = time.perf_counter()
            loss, _ = st.step(models[name], log_, split, own[name][i], tc, gen)
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            opts[name].step()
            if i:
                secs[name] += time.perf_counter() - t0
                seqs[name] += len(own[name][i])
    losses.sampled_scores = BLOCKED
    return secs, seqs


BLOCKED = losses.sampled_scores


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="../shared/data/ml-1m")
    p.add_argument("--batches", type=int, default=12, help="timed batches per layout and scheme (after one warm-up)")
    p.add_argument("--chunks", default="1,16", help="negatives_chunk values to measure")
    p.add_argument("--scores", action="store_true", help="also time the per-position loss's sampled scores against the whole product")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    log_, split = prepare_data(DataSpec("ml-1m", str(Path(args.data_dir).resolve()), "clean"))
    results, W = {}, model_config_from_preset("small").max_seq_len
    for chunk in (int(c) for c in args.chunks.split(",") if c):
        tc = {m: TrainConfig(negatives_chunk=chunk, length_pool=1, packing=m) for m in ("off", "pack")}
        batches = epoch_batches(log_, split, tc["off"], W, 1)[: args.batches + 1]
        secs, n = timed_steps(log_, split, batches, {m: (tc[m], BLOCKED) for m in tc})
        seqs = n["off"]
        tokens = {"off": [0, 0], "pack": [0, 0]}
        for ub in batches[1:]:
            for mode, make in (("off", train_batch), ("pack", packed_train_batch)):
                b = make(log_, split, ub, W)
                tokens[mode][0] += int(b.lengths.sum())
                tokens[mode][1] += b.ids.numel()
        r = {m: seqs / secs[m] for m in secs}
        results[f"chunk{chunk}"] = {
            "sequences_per_s": r,
            "pack_over_off": r["pack"] / r["off"],
            "live_token_fraction": {m: t[0] / t[1] for m, t in tokens.items()},
            "sequences_timed": seqs,
        }
        print(f"negatives_chunk {chunk}: padded {r['off']:.1f}, packed {r['pack']:.1f} seq/s, ratio {r['pack'] / r['off']:.2f}", flush=True)
    if args.scores:
        tc = TrainConfig(negatives_chunk=1, length_pool=1, packing="pack")
        batches = epoch_batches(log_, split, tc, W, 1)[: args.batches + 1]
        c16 = TrainConfig(negatives_chunk=16, length_pool=1, packing="pack")  # the chunked scheme, for scale
        variants = {"whole_product": (tc, whole_product_scores), "blocks": (tc, BLOCKED), "chunk16": (c16, BLOCKED)}
        dflt = TrainConfig(**LEGACY_TRAIN_DEFAULTS)  # the former default, on its own (length-bucketed) batches of the epoch
        variants["former_default"] = (dflt, BLOCKED, epoch_batches(log_, split, dflt, W, 1)[: args.batches + 1])
        secs, n = timed_steps(log_, split, batches, variants)
        r = {m: n[m] / secs[m] for m in secs}
        seqs = n["blocks"]
        ratio = r["blocks"] / r["whole_product"]
        results["chunk1_pack_scores"] = {
            "sequences_per_s": r,
            "blocks_over_whole_product": ratio,
            "blocks_over_chunk16": r["blocks"] / r["chunk16"],
            "blocks_over_former_default": r["blocks"] / r["former_default"],
            "former_default_recipe": recipe(dflt),
            "sequences_timed": n,
        }
        print(f"packed chunk 1: whole product {r['whole_product']:.1f}, blocks {r['blocks']:.1f} seq/s, ratio {ratio:.2f}", flush=True)
        print(f"packed chunk 16 (shared negatives): {r['chunk16']:.1f}, former default {r['former_default']:.1f} seq/s", flush=True)
    out = {
        "machine": machine(),
        "git_commit": git_commit(),
        "command": command(),
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
        "results": results,
    }
    print({"loadavg_before": load0, "loadavg_after": out["loadavg_after"]})
    if args.out:
        write_json(Path(args.out), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
