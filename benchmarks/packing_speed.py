"""Training-step speed of packed rows against padded rows (issue 20 A, TrainConfig.packing), measured
side by side in one process: the same random batches of ML-1M users (small preset, clean protocol),
each step (batch, forward, loss, backward, AdamW) run padded then packed, alternating, for each
negatives scheme; prints and writes sequences/s of each, their ratio, the padding of each layout
(live tokens / tokens) and the load average before and after (the machine is shared).

    OMP_NUM_THREADS=1 python benchmarks/packing_speed.py --batches 12 --out benchmarks/results/packing_speed.json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from _quality import command, git_commit, machine, write_json
from hstu.config import TrainConfig, model_config_from_preset
from hstu.data.batching import packed_train_batch, train_batch
from hstu.data.prepare import DataSpec, model_config_for, prepare_data
from hstu.model.hstu import build_hstu
from hstu.train.loop import LocalStrategy, dense_adamw, epoch_batches


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="../shared/data/ml-1m")
    p.add_argument("--batches", type=int, default=12, help="timed batches per layout and scheme (after one warm-up)")
    p.add_argument("--chunks", default="1,16", help="negatives_chunk values to measure")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load0 = os.getloadavg()
    log_, split = prepare_data(DataSpec("ml-1m", str(Path(args.data_dir).resolve()), "clean"))
    results = {}
    for chunk in (int(c) for c in args.chunks.split(",")):
        tc = {m: TrainConfig(negatives_chunk=chunk, length_pool=1, packing=m) for m in ("off", "pack")}
        torch.manual_seed(0)
        model = build_hstu(model_config_for(log_, model_config_from_preset("small"), True))
        st = LocalStrategy()
        st.start("cpu", tc["off"])
        opt = dense_adamw(model.parameters(), tc["off"])
        batches = epoch_batches(log_, split, tc["off"], model.cfg.max_seq_len, 1)[: args.batches + 1]
        secs, seqs, tokens = {"off": 0.0, "pack": 0.0}, 0, {"off": [0, 0], "pack": [0, 0]}
        gen = torch.Generator().manual_seed(0)
        model.train()
        for i, ub in enumerate(batches):
            for mode in ("off", "pack"):  # alternate: both layouts see the same load
                t0 = time.perf_counter()
                loss, _ = st.step(model, log_, split, ub, tc[mode], gen)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if i:  # batch 0 warms up
                    secs[mode] += time.perf_counter() - t0
            if i:
                seqs += len(ub)
        for ub in batches[1:]:
            for mode, make in (("off", train_batch), ("pack", packed_train_batch)):
                b = make(log_, split, ub, model.cfg.max_seq_len)
                tokens[mode][0] += int(b.lengths.sum())
                tokens[mode][1] += b.ids.numel()
        r = {m: seqs / secs[m] for m in secs}
        results[f"chunk{chunk}"] = {
            "sequences_per_s": r,
            "pack_over_off": r["pack"] / r["off"],
            "live_token_fraction": {m: t[0] / t[1] for m, t in tokens.items()},
            "sequences_timed": seqs,
        }
        ratio = r["pack"] / r["off"]
        print(f"negatives_chunk {chunk}: padded {r['off']:.1f} seq/s, packed {r['pack']:.1f} seq/s, ratio {ratio:.2f}", flush=True)
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
