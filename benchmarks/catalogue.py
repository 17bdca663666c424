"""Catalogue benchmark: an N-item catalogue end to end with bounded scoring memory (issue 21, item 8).

Steps, each with its wall time and its peak resident memory (Linux VmHWM, reset before the step
through /proc/self/clear_refs, so each figure is that step's own peak):
  1. log      a generated event log over N item ids with Zipf popularity (P(rank r) ~ r^-a, drawn by
              the inverse CDF of the continuous power law; rank -> id by a multiplicative bijection
              mod N), written as Parquet (user, item, time) and read back by the csv loader
              (``hstu.data.load_dataset("csv", ...)``); the catalogue is all N ids (items without events
              keep their rows, as a shop's unsold items do).
  2. plan     ``hstu plan-memory`` for the table (the same plan the model's table checks before allocating).
  3. train    one epoch of the training recipe (``train.loop.train_one_epoch``: sampled softmax, AdamW)
              with ``item_table = "hashed"``, --shards shards placed explicitly (--placement), fp16 rows
              under the row-wise table optimizer (bf16 under AdamW, whose moments underflow in fp16:
              ``train.sparse_optim.check_table_trainable``); per-step seconds.
  4. fp16     the shards cast to fp16 (``ShardedEmbedding.cast_storage``, what ``hstu quantize`` stores).
  5. eval     full-ranking HR@10 / NDCG@10 of --eval-users test targets: ``train.evaluate.evaluate``,
              whose ranks are streamed over table blocks above ``item_index.STREAM_BYTES``
              (``item_index.stream_ranks``: no (B, N) score matrix).
     (--no-train: skipped, the rows built in fp16 at their seeded init: the scoring path alone, for a
     catalogue whose training state (rows, gradient, two AdamW moments) does not fit in memory.)
  6. generate next-10 greedy for --gen-users users through the product's ``generate.engine.Engine``
              (streamed picks, no (rows, N) score / exclusion buffers above ``item_index.STREAM_BYTES``).
  7. ann      optional (faiss): an approximate index (--ann, a faiss factory string) over the normalised
              rows, recall@10 against the exact streamed top-k of the same user vectors, and per-batch
              latency of both.
  8. serve    optional (--serve): the model written as a run directory (what ``hstu train`` writes;
              idmap.json's per-item arrays in its items.npz sidecar), the benchmark's copy freed, then
              ``hstu serve --run OUT/run --ann FACTORY`` started as a user starts it: seconds to ready
              (the approximate index built into RUN/ann/ on the first start), --serve-requests
              sequential /v1/generate next-10 calls (latency), the served items against step 6's
              exact engine for the same users (overlap@10), and the server processes' peak RSS.
Memory is reported against the plan's table bytes (what the rows take) and the (B, N) float32 matrix a
full-ranking step would have built.

Usage:
  python benchmarks/catalogue.py --items 2000000 --events 400000 --out /tmp/cat --json benchmarks/results/catalogue_2m.json
  python benchmarks/catalogue.py --items 120000000 --events 3000000 --out /tmp/cat120 (check the plan first: 23 GiB here)
  python benchmarks/catalogue.py --items 120000000 --events 3000000 --table-optimizer rowwise_adagrad --ann IVF1024,SQ8 --serve ...
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

MULTIPLIER = 2_654_435_761  # Knuth's multiplicative-hash constant (prime): rank -> id, a bijection mod N when gcd(N, it) = 1


def zipf_ids(n_items: int, n: int, a: float, rng: np.random.Generator) -> np.ndarray:
    """(n,) int64 item ids in 1..n_items with P(popularity rank r) ~ r^-a (a > 0, a != 1): the inverse
    CDF of the continuous power law on [1, n_items + 1), floored; ranks spread over ids by
    r -> (r - 1) * MULTIPLIER mod n_items + 1 (popular items are not the low ids)."""
    if math.gcd(n_items, MULTIPLIER) != 1:
        raise ValueError(f"--items {n_items} shares a factor with the id bijection's multiplier {MULTIPLIER}")
    e = 1.0 - a
    u = rng.random(n)
    r = np.floor(((np.power(n_items + 1.0, e) - 1.0) * u + 1.0) ** (1.0 / e)).astype(np.int64)
    r = np.clip(r, 1, n_items)
    return ((r - 1) * MULTIPLIER) % n_items + 1


def write_event_log(path: Path, n_items: int, n_events: int, n_users: int, a: float = 1.05, seed: int = 0) -> Path:
    """A Parquet log (user, item, time) of ``n_events`` events: users uniform, items :func:`zipf_ids`,
    times increasing per user (one minute apart); written atomically (a .tmp renamed)."""
    rng = np.random.default_rng(seed)
    users = np.sort(rng.integers(1, n_users + 1, n_events))
    items = zipf_ids(n_items, n_events, a, rng)
    time_ = 1_600_000_000 + np.arange(n_events, dtype=np.int64) * 60
    tmp = path.with_suffix(".tmp")
    pd.DataFrame({"user": users, "item": items, "time": time_}).to_parquet(tmp, index=False)
    tmp.replace(path)
    return path


def catalogue_log(path: Path, n_items: int):
    """The csv loader's EventLog of ``path`` with the whole catalogue 1..n_items as dense ids (raw id =
    dense id: the loader's dense ids follow ascending raw ids, so the seen items keep their order)."""
    from hstu.data import load_dataset

    log_ = load_dataset("csv", str(path), columns="user=user,item=item,time=time", exclude_history=True)
    raw = log_.item_raw_ids.astype(np.int64)
    if raw[1:].max() > n_items:
        raise ValueError(f"{path}: item id {raw[1:].max()} outside the catalogue 1..{n_items}")
    return dataclasses.replace(
        log_, items=raw[log_.items], item_raw_ids=np.arange(n_items + 1, dtype=np.int64), item_category=np.zeros(n_items + 1, np.int64)
    )


def reset_peak() -> None:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss(pid: int | str = "self") -> int:
    """A process's peak resident bytes (VmHWM; this one's since :func:`reset_peak`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def measured(fn):
    """(fn(), seconds, peak RSS bytes of the call)."""
    reset_peak()
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t, peak_rss()


def row_dtype(args) -> str:
    """The table's row dtype: fp16, except bf16 when AdamW trains it (fp16 moments underflow)."""
    return "bf16" if args.table_optimizer == "adamw" and not args.no_train else "fp16"


def plan_memory(args) -> dict:
    """``hstu plan-memory --json`` for the table (exit 3 = refused: raised with its message)."""
    cmd = [sys.executable, "-m", "hstu", "plan-memory", "--items", str(args.items), "--dim", str(args.dim), "--dtype", row_dtype(args)]
    cmd += ["--shards", str(args.shards), "--placement", args.placement, "--overflow-rows", "1", "--json"]
    cmd += [] if args.no_train else ["--optimizer", args.table_optimizer]  # the plan counts the training optimizer's state
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"hstu plan-memory refused the table (exit {p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return json.loads(p.stdout)


def build_model(args, log_):
    from hstu.config import ModelConfig
    from hstu.model.hstu import build_hstu

    d = args.dim
    cfg = ModelConfig(num_items=log_.num_items, max_seq_len=args.max_seq_len, embedding_dim=d, d_qk=d, d_v=d, num_blocks=1, num_heads=1)
    cfg.item_table, cfg.item_table_shards, cfg.item_table_dtype = "hashed", args.shards, row_dtype(args)
    cfg.item_table_placement = args.placement
    torch.manual_seed(args.seed)
    return build_hstu(cfg, device="cpu")


def train(args, model, log_, split) -> dict:
    from hstu.config import TrainConfig
    from hstu.train.loop import LocalStrategy, train_one_epoch

    tcfg = TrainConfig(
        epochs=1, batch_size=args.batch_size, num_negatives=args.negatives, seed=args.seed, table_optimizer=args.table_optimizer
    )
    strategy = LocalStrategy()
    strategy.start("cpu", tcfg)
    opt = strategy.prepare(model, tcfg)
    stamps, losses = [time.perf_counter()], []

    def on_step(epoch, i, loss):
        stamps.append(time.perf_counter())
        losses.append(loss)

    out = train_one_epoch(strategy, model, log_, split, tcfg, opt, torch.Generator().manual_seed(args.seed), 1, False, on_step)
    steps = np.diff(stamps)
    return {
        "table_optimizer": args.table_optimizer,
        "steps": len(steps),
        "step_seconds_p50": float(np.median(steps)),
        "step_seconds_p90": float(np.percentile(steps, 90)),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "sequences_per_s": out["sequences_per_s"],
    }


def evaluate_users(args, model, log_, split) -> dict:
    from hstu.train.evaluate import evaluate

    targets = split.targets("test")
    users = np.nonzero(targets >= 0)[0][: args.eval_users]
    m = evaluate(model, log_, split, "test", users=users, batch_size=args.eval_batch, exclude=True)
    return {k: m[k] for k in ("HR@10", "NDCG@10", "MRR", "users")}


def user_vectors(model, log_, split, users: np.ndarray) -> tuple[torch.Tensor, object]:
    """(U, d) user vectors at each user's test position, and the eval batch."""
    from hstu.data.batching import eval_batch

    b = eval_batch(log_, split.targets("test"), users, model.cfg.max_seq_len)
    with torch.inference_mode():
        return model.last_rows(model.encode(b.ids, b.timestamps, b.lengths), b.lengths), b


def generate(args, model, log_, split) -> dict:
    """Next-10 greedy, history and items without training events excluded (what a served request
    excludes by default), through the product's Engine (what ``hstu generate``, the Recommender and
    ``hstu serve`` run): --gen-users rows in one chunk, streamed picks and no (R, N + 1) buffers when
    ``item_index.streams`` says so for those rows (exclusions as sparse pairs + one shared row)."""
    from hstu.data.prepare import train_item_counts
    from hstu.generate.engine import Engine
    from hstu.generate.sampler import exclusion_pairs

    users = np.nonzero(split.targets("test") >= 0)[0][: args.gen_users]
    _, b = user_vectors(model, log_, split, users)
    never = torch.from_numpy(train_item_counts(log_, split) == 0)  # (I+1,) bool: untrained items
    excl = exclusion_pairs(model.cfg.num_items, len(users), b.ids, b.lengths, never=never)
    req = b.timestamps.gather(1, (b.lengths - 1).view(-1, 1)).view(-1) + 60
    eng = Engine(model, buckets=(model.cfg.max_seq_len,), max_batch=len(users), k_max=10, graphs="eager")
    res = eng.generate(b.ids, b.timestamps, b.lengths, 10, request_time=req, exclude=excl)
    report = {"streamed": eng.streamed, "decode_buffer_bytes": eng.memory_report()["shared_decode_buffers"]}
    return {"users": len(users), "engine": report, "items": res.items.tolist()}


@torch.inference_mode()
def ann(args, model, log_, split, run_dir: Path | None = None) -> dict:
    """Recall@10 and latency of the approximate index against the exact streamed top-k; with
    ``run_dir`` (--serve) the index is the run's (``hstu.model.ann.ann_for_run``: built and stored in
    RUN/ann/, where the server then loads it instead of building it again)."""
    from hstu.model.ann import AnnIndex, ann_for_run, recall_at_k
    from hstu.model.item_index import stream_topk

    users = np.nonzero(split.targets("test") >= 0)[0][: args.ann_users]
    user, _ = user_vectors(model, log_, split, users)
    V = model.cfg.num_items + 1
    index = model.item_index()

    def rows(a, b):
        return model.item_vectors(a, b).detach().float()

    t = time.perf_counter()
    exact = torch.cat([stream_topk(index, user[s : s + 16], 1.0, 11)[1] for s in range(0, len(user), 16)])
    exact_s = (time.perf_counter() - t) / math.ceil(len(user) / 16)
    if run_dir is None:
        (idx, build_s, build_peak) = measured(lambda: AnnIndex(rows, V, args.dim, args.ann, nprobe=args.nprobe))
    else:
        (idx, build_s, build_peak) = measured(lambda: ann_for_run(run_dir, model, args.ann, nprobe=args.nprobe))
    out = {"factory": args.ann, "build_seconds": build_s, "build_peak_rss": build_peak, "exact_seconds_per_16": exact_s}
    for nprobe in sorted({1, 4, args.nprobe, 4 * args.nprobe}):
        idx.set_search(nprobe=nprobe)
        t = time.perf_counter()
        approx = torch.cat([idx.search(user[s : s + 16], 11)[1] for s in range(0, len(user), 16)])
        out[f"nprobe_{nprobe}"] = {
            "recall@10": recall_at_k(approx[:, :10], exact[:, :10]),
            "seconds_per_16": (time.perf_counter() - t) / math.ceil(len(user) / 16),
        }
    return out


def write_run(args, model, log_, split) -> Path:
    """The benchmark's model as the run directory ``hstu train`` writes (OUT/run: config.json,
    idmap.json with its items.npz sidecar, model.safetensors), for ``hstu serve``."""
    from hstu import runs
    from hstu.config import TrainConfig
    from hstu.data.prepare import DataSpec

    run = Path(args.out) / "run"
    run.mkdir(exist_ok=True)
    spec = DataSpec(
        "csv", str(Path(args.out) / "events.parquet"), options={"columns": "user=user,item=item,time=time"}, exclude_history=True
    )
    tcfg = TrainConfig(
        epochs=1, batch_size=args.batch_size, num_negatives=args.negatives, seed=args.seed, table_optimizer=args.table_optimizer
    )
    runs.write_config(run, runs.config_json(model.cfg, tcfg, spec))
    runs.write_idmap(run, log_, split)
    runs.save_best_weights(run, model)
    return run


def tree_peak_rss(pid: int) -> int:
    """Summed peak resident bytes (:func:`peak_rss`) of process ``pid`` and its children (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        q = todo.pop()
        try:
            todo += [int(c) for t in Path(f"/proc/{q}/task").iterdir() for c in (t / "children").read_text().split()]
            total += peak_rss(q)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def request_bodies(log_, split, users: np.ndarray, max_len: int) -> list[dict]:
    """/v1/generate bodies for ``users``' test histories (the events before the test target), next-10,
    request time 60 s after the last event (as :func:`generate`)."""
    from hstu.data.batching import eval_batch

    b = eval_batch(log_, split.targets("test"), users, max_len)
    raw = log_.item_raw_ids
    out = []
    for r in range(len(users)):
        n = int(b.lengths[r])
        ids, ts = b.ids[r, :n].tolist(), b.timestamps[r, :n].tolist()
        out.append(
            {"history": [{"item_id": int(raw[i]), "timestamp": int(t)} for i, t in zip(ids, ts)], "k": 10, "request_time": int(ts[-1]) + 60}
        )
    return out


def serve(args, run: Path, bodies: list[dict], exact: list[list[int]]) -> dict:
    """``hstu serve --run RUN --ann FACTORY`` started as a user starts it (``hstu.bench.load.start_server``:
    an OS-chosen port, waited for until /readyz answers 200): its seconds to ready, then --serve-requests
    sequential /v1/generate calls (client-side latency), the served next-10 against the in-process
    exact engine's (:func:`generate`: overlap@10 and first-item agreement), and the server's peak RSS
    (its processes together). The server's log goes to this process's stderr."""
    import httpx

    from hstu.bench import load

    extra = shlex.split(args.serve_args) + (["--ann", args.ann, "--ann-nprobe", str(args.nprobe)] if args.ann else [])
    opts = argparse.Namespace(
        url=None, run=str(run), max_batch=16, max_wait_ms=5.0, threads=args.threads, buckets=None, precision=None,
        model_workers=0 if "--no-model-process" in extra else 1, server_args=[f for f in extra if f != "--no-model-process"],
        server_cpus=None, client_cpus_rest=False, verbose=True, ready_timeout_s=args.serve_timeout,
    )  # fmt: skip
    t = time.perf_counter()
    try:
        proc, url, _ = load.start_server(opts)
    except load.ServerStartError as exc:
        raise SystemExit(f"hstu serve --run {run}: {exc}") from None
    try:
        out = {"command": "hstu serve --run RUN " + " ".join(extra), "ready_seconds": time.perf_counter() - t}
        out["ready_peak_rss"] = tree_peak_rss(proc.pid)
        lat, served, codes = [], [], {}
        with httpx.Client(base_url=url, timeout=120) as c:
            for j in range(args.serve_requests):
                t1 = time.perf_counter()
                r = c.post("/v1/generate", json=bodies[j % len(bodies)])
                lat.append(time.perf_counter() - t1)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                if r.status_code == 200 and j < len(bodies):
                    served.append([int(i["item_id"]) for i in r.json()["items"]])
        lat_ms = np.asarray(lat) * 1e3
        pairs = list(zip(served, exact))
        out.update(
            requests=len(lat),
            status=codes,
            latency_ms={"p50": float(np.percentile(lat_ms, 50)), "p99": float(np.percentile(lat_ms, 99)), "max": float(lat_ms.max())},
            overlap_at_10=float(np.mean([len(set(a) & set(b)) / 10 for a, b in pairs])) if pairs else None,
            first_item_agreement=float(np.mean([a[0] == b[0] for a, b in pairs])) if pairs else None,
            compared_users=len(pairs),
            peak_rss=tree_peak_rss(proc.pid),
        )
        return out
    finally:
        load.stop_server(proc)


def serve_again(args) -> dict:
    """--serve-again FILE: step 8 alone on the run and log an earlier --serve run left in --out (other
    server flags, e.g. --serve-args); the exact items to compare with are FILE's (its step 6)."""
    from hstu.data.sequences import make_split

    torch.set_num_threads(args.threads)
    prev = json.loads(Path(args.serve_again).read_text())
    log_ = catalogue_log(Path(args.out) / "events.parquet", args.items)
    split = make_split(log_)
    users = np.nonzero(split.targets("test") >= 0)[0][: args.gen_users]
    bodies = request_bodies(log_, split, users, args.max_seq_len)
    del log_, split
    gc.collect()
    res = {"args": vars(args), "machine": {"cpu": platform.processor() or platform.machine(), "loadavg_start": os.getloadavg()}}
    res["serve"] = serve(args, Path(args.out) / "run", bodies, prev["generate"]["items"])
    res["machine"]["loadavg_end"] = os.getloadavg()
    return res


def run(args) -> dict:
    from hstu.data.sequences import make_split
    from hstu.model import item_index as ii

    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"args": vars(args), "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}}
    res["machine"]["loadavg_start"] = os.getloadavg()  # the machine is shared: other jobs may run
    res["plan"] = plan_memory(args)
    path = out_dir / "events.parquet"
    _, res["write_seconds"], _ = measured(lambda: write_event_log(path, args.items, args.events, args.users, args.zipf, args.seed))
    (log_, res["load_seconds"], res["load_peak_rss"]) = measured(lambda: catalogue_log(path, args.items))
    split = make_split(log_)
    res["log"] = {"events": int(log_.num_events), "users": int(log_.num_users), "items": int(log_.num_items)}
    res["log"]["items_with_events"] = int(len(np.unique(log_.items)))
    (model, res["build_seconds"], res["build_peak_rss"]) = measured(lambda: build_model(args, log_))
    table_bytes = sum(p.numel() * p.element_size() for p in model.item_emb.shards)
    res["table_bytes_built"] = {"bytes": table_bytes, "dtype": model.cfg.item_table_dtype}
    res["train_state_bytes"] = res["plan"].get("optimizer_bytes", 0)  # the table optimizer's state + the table's gradient
    if not args.no_train:
        (res["train"], res["train_seconds"], res["train_peak_rss"]) = measured(lambda: train(args, model, log_, split))
    model.eval()
    model.item_emb.cast_storage("fp16")
    res["table_bytes_fp16"] = sum(p.numel() * p.element_size() for p in model.item_emb.shards)
    res["full_score_matrix_bytes"] = {"eval": args.eval_batch * (args.items + 1) * 4, "generate": args.gen_users * (args.items + 1) * 4}
    with torch.inference_mode():
        index = model.item_index()
    res["index"] = type(index).__name__
    res["streams"] = {"eval": ii.streams(index, args.eval_batch), "generate": ii.streams(index, args.gen_users)}
    (res["eval"], res["eval_seconds"], res["eval_peak_rss"]) = measured(lambda: evaluate_users(args, model, log_, split))
    (res["generate"], res["generate_seconds"], res["generate_peak_rss"]) = measured(lambda: generate(args, model, log_, split))
    run_dir = None
    if args.serve:  # the run first: the approximate index below is then built into RUN/ann/ for the server
        users = np.nonzero(split.targets("test") >= 0)[0][: args.gen_users]
        bodies = request_bodies(log_, split, users, args.max_seq_len)
        (run_dir, res["write_run_seconds"], res["write_run_peak_rss"]) = measured(lambda: write_run(args, model, log_, split))
        res["run_bytes"] = {f.name: f.stat().st_size for f in run_dir.iterdir() if f.is_file()}
    if args.ann:
        try:
            res["ann"] = ann(args, model, log_, split, run_dir)
        except ImportError as exc:
            res["ann"] = {"skipped": str(exc)}
    if args.serve:
        del model, index, log_, split  # the server loads its own copy (the log's per-item arrays: 2 GB at 120M)
        gc.collect()
        try:
            res["serve"] = serve(args, run_dir, bodies, res["generate"]["items"])
        except SystemExit as exc:  # the measurements so far are kept
            res["serve"] = {"error": str(exc)}
    res["machine"]["loadavg_end"] = os.getloadavg()
    return res


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, required=True, help="catalogue size N (item ids 1..N)")
    p.add_argument("--events", type=int, required=True, help="events in the generated log")
    p.add_argument("--users", type=int, default=None, help="users (default: events / 20)")
    p.add_argument("--out", required=True, help="directory for the generated log")
    p.add_argument("--json", help="write the results here (e.g. benchmarks/results/catalogue_2m.json)")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--placement", default="device,host,device,host", help="one value or one per shard (explicit placement)")
    p.add_argument("--max-seq-len", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--negatives", type=int, default=128)
    p.add_argument("--eval-users", type=int, default=1024)
    p.add_argument("--eval-batch", type=int, default=256)
    p.add_argument("--gen-users", type=int, default=16)
    p.add_argument("--ann", default="IVF1024,Flat", help="faiss index_factory string, or '' for none")
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("--ann-users", type=int, default=256)
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent a (P(rank r) ~ r^-a)")
    p.add_argument("--no-train", action="store_true", help="skip training: fp16 rows at their seeded init (eval / generation only)")
    p.add_argument(
        "--table-optimizer",
        choices=["adamw", "rowwise_adagrad"],
        default="adamw",
        help="[train] table_optimizer: adamw (dense state and update) or rowwise_adagrad (looked-up rows only, R x 4 bytes of state)",
    )
    p.add_argument("--serve", action="store_true", help="then write the run and serve it: hstu serve --run OUT/run --ann FACTORY")
    p.add_argument("--serve-requests", type=int, default=64, help="sequential /v1/generate calls to the served run")
    p.add_argument("--serve-timeout", type=float, default=3600, help="seconds to wait for the server's /readyz")
    p.add_argument("--serve-again", metavar="FILE", help="only step 8, on the run and log in --out, compared with FILE's exact items")
    p.add_argument("--serve-args", default="", help="more hstu serve flags, e.g. '--no-model-process' (one copy of the id map, not two)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.users is None:
        args.users = max(1, args.events // 20)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    res = serve_again(args) if args.serve_again else run(args)
    text = json.dumps(res, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
