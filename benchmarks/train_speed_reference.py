"""Training speed (sequences/s) of `hstu train` beside the public reference implementation (Meta's
generative-recommenders, research path: trainer/train.py ``train_fn``) on ML-1M: same config, same machine, one run.

    python benchmarks/train_speed_reference.py --reference /work/.mirror/meta-recsys+generative-recommenders/repo \\
        --data-dir ../shared/data/ml-1m --config small --threads 2 --repeats 2 --out benchmarks/results/train_speed_reference_small.json

``--config small``: the reference's configs/ml-1m/hstu-sampled-softmax-n128-final.gin beside ``hstu train --preset small``
(2 blocks, 1 head, d = d_qk = d_v = 50, batch 128, 128 negatives, max_seq_len 200, lr 1e-3); ``large``: ...-large-final.gin
beside ``--preset large``. hstu runs its default recipe, ``--protocol paper`` by default (all but each user's last event: the
reference's train split). Per repeat one epoch of each, reference first (ABAB), each in its own process, OMP_NUM_THREADS and
torch threads = ``--threads``. Both numbers exclude start-up, data set-up, model building and all evaluation:
- hstu: its history.json ``sequences_per_s`` (hstu.train.loop.train_one_epoch): the epoch's users / the seconds of its step
  loop: building each packed batch from the EventLog, forward, loss, backward, AdamW, ``loss.item()``.
- reference: train_fn as published, one epoch (gin ``train_fn.num_epochs = 1``); the clock runs from the first batch request on
  its train DataLoader until that loader is exhausted (after the last AdamW step), minus the in-loop evaluation at batch 0
  (``batch_id % eval_interval == 0``: get_eval_state, eval_metrics_v2_from_tensors, add_to_summary_writer, timed and subtracted);
  its end-of-epoch evaluation is not run (its first call ends the process). Included as published: the DataLoader's start and
  its 8 worker processes parsing the CSV rows (gin ``create_data_loader.num_workers``; part of that overlaps the subtracted
  evaluation; ``--ref-workers 0``: parsed in the loop), DDP over one rank, ``torch.autograd.set_detect_anomaly(True)``
  (``--ref-no-anomaly``: off), 2 TensorBoard scalars per batch, rows padded to 211 (200 + 11 output slots). Sequences: 6040.

The reference runs from a copy made at run time in a temporary directory (``--work DIR``: kept, reused), never from this
project: ``git archive HEAD configs generative_recommenders`` of ``--reference`` (a checkout or a git directory). Runtime
substitutions in that copy's research/trainer/train.py (each must match once): ``init_process_group("nccl"`` -> ``"gloo"``,
``device = rank`` -> ``torch.device("cpu")``, DDP ``device_ids=[rank]`` -> ``None``. Its ML-1M download is replaced by a zip
of ``--data-dir``'s ratings.dat, users.dat, movies.dat at tmp/movielens1m.zip, where its download() looks first; its own
preprocessing then runs there. In its process this script wraps the train module's names create_data_loader,
get_eval_state, eval_metrics_v2_from_tensors, add_to_summary_writer, get_weighted_loss, get_sequential_encoder (clock,
per-batch loss, model sizes; no result changes) and calls ``train_fn(0, 1, port)`` as main.py's mp.spawn would.
``--max-batches N`` (a smoke check): the reference stops after N batches; hstu trains ``--max-users N x 128`` users.
The reference needs ``pip install gin-config`` and fbgemm_gpu (CPU build: ``fbgemm_gpu-cpu``, in this project's ``dist`` extra).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

GIN = {"small": "configs/ml-1m/hstu-sampled-softmax-n128-final.gin", "large": "configs/ml-1m/hstu-sampled-softmax-n128-large-final.gin"}
TRAIN_PY = "generative_recommenders/research/trainer/train.py"
SUBSTITUTIONS = [  # (reference text, replacement): CPU, one process
    ('dist.init_process_group("nccl"', 'dist.init_process_group("gloo"'),
    ("    device = rank\n", '    device = torch.device("cpu")\n'),
    ("device_ids=[rank]", "device_ids=None"),
]
BATCH = 128  # both configs' batch size (gin train_fn.local_batch_size, TrainConfig.batch_size)


def prepare_reference(src: Path, data_dir: Path, work: Path) -> str:
    """Extract ``src``'s HEAD into ``work``, apply SUBSTITUTIONS, stage the local ML-1M files and run the
    reference's own ML-1M preprocessing there (skipped when ``work`` already holds its output). Returns the commit."""
    git = ["git", "-C", str(src)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    tar = subprocess.run([*git, "archive", "--format=tar", "HEAD", "configs", "generative_recommenders"], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(work, filter="data")
    train_py = work / TRAIN_PY
    text = train_py.read_text()
    for old, new in SUBSTITUTIONS:
        if text.count(old) != 1:
            raise RuntimeError(f"{TRAIN_PY}: expected {old!r} once, found it {text.count(old)} times (reference changed?)")
        text = text.replace(old, new)
    train_py.write_text(text)
    if (work / "tmp/ml-1m/sasrec_format.csv").exists() and (work / "tmp/processed/ml-1m/movies.csv").exists():
        return commit
    (work / "tmp").mkdir(exist_ok=True)
    with zipfile.ZipFile(work / "tmp/movielens1m.zip", "w") as z:  # what its download() would have fetched
        for name in ("ratings.dat", "users.dat", "movies.dat"):
            z.write(data_dir / name, f"ml-1m/{name}")
    code = "from generative_recommenders.research.data.preprocessor import get_common_preprocessors as g; g()['ml-1m'].preprocess_rating()"
    checked([sys.executable, "-c", code], cwd=work, env={**os.environ, "PYTHONPATH": str(work)})
    return commit


class EpochDone(Exception):
    """Raised by the first evaluation call after the timed train loader ran out: the epoch's training is over."""


def timed_batches(loader, st: dict, max_batches: int):
    """The reference's train DataLoader, clocked (train_fn's one epoch iterates it once): ``st["start"]`` at the first
    batch request, ``st["end"]`` when it runs out (or after ``max_batches``, 0: all); counts sequences and batches."""
    st["start"] = time.perf_counter()
    for row in loader:
        st["seqs"], st["batches"] = st["seqs"] + len(row["history_lengths"]), st["batches"] + 1
        st["first"] = st["first"] or time.perf_counter()
        yield row
        if max_batches and st["batches"] >= max_batches:
            break
    st["end"] = time.perf_counter()


def model_summary(m) -> dict:
    """The sizes of the model train_fn built, from its HSTU class's own attributes."""
    layer = m._hstu._attention_layers[0]
    return {"class": type(m).__name__, "debug_str": m.debug_str(), "blocks": len(m._hstu._attention_layers)} | {
        "heads": layer._num_heads,
        "uvqk": list(layer._uvqk.shape),  # (d, 2 H d_v + 2 H d_qk)
        "item_emb": list(m._embedding_module._item_emb.weight.shape),
        "attention_width": m._attn_mask.shape[0],  # max_seq_len + max_output_len: every row is padded to it
        "parameters": sum(p.numel() for p in m.parameters()),
    }


def hook_reference(t, st: dict, max_batches: int) -> None:
    """Wrap module-level names of the reference's train module ``t`` (train_fn looks them up at call time)."""
    loaders, weighted, encoder = t.create_data_loader, t.get_weighted_loss, t.get_sequential_encoder

    def timed(fn, ends_epoch=False):
        def wrapper(*a, **k):
            if ends_epoch and st["end"] is not None:
                raise EpochDone  # the end-of-epoch evaluation: not run
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                st["eval"] += time.perf_counter() - t0

        return wrapper

    def create_data_loader(*a, **k):
        sampler, loader = loaders(*a, **k)
        st["loaders"] += 1  # train_fn makes the train loader first, then the eval loader
        return sampler, (timed_batches(loader, st, max_batches) if st["loaders"] == 1 else loader)

    def get_weighted_loss(*a, **k):
        out = weighted(*a, **k)
        st["losses"].append(float(out.detach()))
        return out

    def get_sequential_encoder(*a, **k):
        m = encoder(*a, **k)
        st["model_summary"] = model_summary(m)
        return m

    t.create_data_loader, t.get_weighted_loss, t.get_sequential_encoder = create_data_loader, get_weighted_loss, get_sequential_encoder
    t.get_eval_state = timed(t.get_eval_state, ends_epoch=True)
    t.eval_metrics_v2_from_tensors = timed(t.eval_metrics_v2_from_tensors)
    t.add_to_summary_writer = timed(t.add_to_summary_writer)


def reference_child(args) -> None:
    """In the reference copy (cwd): one epoch of its train_fn, timed; prints ``RESULT {json}``."""
    import torch

    torch.set_num_threads(args.threads)
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm, as the reference's main.py does)
    import generative_recommenders.research.trainer.train as t
    import gin

    logging.basicConfig(stream=sys.stdout, level=logging.INFO, force=True)  # as the reference's main.py
    st = {"eval": 0.0, "seqs": 0, "batches": 0, "losses": [], "start": None, "first": None, "end": None, "loaders": 0}
    hook_reference(t, st, args.max_batches)
    if args.ref_no_anomaly:
        torch.autograd.set_detect_anomaly = lambda *a, **k: None
    w = args.ref_workers
    bindings = ["train_fn.num_epochs = 1"] + ([f"create_data_loader.num_workers = {w}"] if w is not None else [])
    bindings += ["create_data_loader.prefetch_factor = None"] if w == 0 else []  # DataLoader refuses a prefetch without workers
    gin.parse_config_files_and_bindings([GIN[args.config]], bindings)
    try:
        t.train_fn(0, 1, args.port)
    except EpochDone:
        pass
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    secs = st["end"] - st["start"] - st["eval"]
    out = {k: st[k] for k in ("seqs", "batches", "model_summary", "losses")} | {"seconds": secs, "eval_seconds_excluded": st["eval"]}
    out |= {"first_batch_wait_s": st["first"] - st["start"], "sequences_per_s": st["seqs"] / secs}
    print("RESULT " + json.dumps(out), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        return s.bind(("127.0.0.1", 0)) or s.getsockname()[1]


def child_env(threads: int, **extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra}


def checked(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}")
    return p


def run_reference(args, work: Path) -> dict:
    """One reference epoch in its own process (:func:`reference_child`); returns its RESULT object."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--reference-child", "--config", args.config]
    cmd += ["--threads", str(args.threads), "--port", str(free_port()), "--max-batches", str(args.max_batches)]
    cmd += ["--ref-no-anomaly"] if args.ref_no_anomaly else []
    cmd += ["--ref-workers", str(args.ref_workers)] if args.ref_workers is not None else []
    p = checked(cmd, cwd=work, env=child_env(args.threads, PYTHONPATH=str(work)))
    return json.loads([line for line in p.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT ") :])


def run_hstu(args, out: Path, flags: tuple[str, ...] = ()) -> dict:
    """One `hstu train` epoch (default recipe, plus ``flags``) in its own process; its history.json entry."""
    cmd = [sys.executable, "-m", "hstu", "train", "--preset", args.config, "--epochs", "1", "--threads", str(args.threads), *flags]
    cmd += ["--data-dir", str(args.data_dir), "--protocol", args.protocol, "--out", str(out), "--overwrite", "--quiet"]
    cmd += ["--max-users", str(args.max_batches * BATCH)] if args.max_batches else []
    checked(cmd, env=child_env(args.threads))
    h, met, cfg = (json.loads((out / f).read_text()) for f in ("history.json", "metrics.json", "config.json"))
    keys = ("num_blocks", "num_heads", "embedding_dim", "d_qk", "d_v", "max_seq_len", "num_items", "multi_channel", "query_key_map")
    model = {k: cfg["model"][k] for k in keys if k in cfg["model"]}
    res = {"seqs": round(h[0]["sequences_per_s"] * h[0]["seconds"]), "recipe": met["recipe"], "model": model}
    return res | {k: h[0][k] for k in ("seconds", "sequences_per_s", "loss")}


def timed_run(fn, *a) -> dict:
    before, t0 = os.getloadavg(), time.perf_counter()
    res = fn(*a)
    return res | {"load_before": before, "load_after": os.getloadavg(), "process_seconds": round(time.perf_counter() - t0, 1)}


def describe(name: str, r: dict) -> str:
    """One line per run: sequences, seconds, loss (the reference's first and last batch) and load."""
    ls = r.get("losses")
    loss = f"batch loss first {ls[0]:.4f} last {ls[-1]:.4f} ({len(ls)} batches)" if ls else f"epoch mean loss {r['loss']:.4f}"
    loss += f", eval {r['eval_seconds_excluded']:.2f} s excluded, first batch waited {r['first_batch_wait_s']:.2f} s" if ls else ""
    load = f"load {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f}"
    return f"  {name:9s} {r['seqs']:5d} seq in {r['seconds']:7.2f} s = {r['sequences_per_s']:7.1f} seq/s; {loss}; {load}"


def measure(args, work: Path) -> dict:
    """ABAB: per repeat one reference epoch, then one hstu epoch; prints each run and the table."""
    rows = []
    for i in range(args.repeats):
        ref = timed_run(run_reference, args, work)
        hs = timed_run(run_hstu, args, work / f"hstu_run{i}")
        extra = {v: timed_run(run_hstu, args, work / f"hstu_{v}_run{i}", tuple(v.split())) for v in args.hstu_variant}
        rm, hm = ref["model_summary"], hs["model"]
        want = hm["num_blocks"], hm["num_heads"], hm["embedding_dim"], 2 * hm["num_heads"] * (hm["d_qk"] + hm["d_v"])  # U, V, Q, K
        if (rm["blocks"], rm["heads"], rm["item_emb"][1], rm["uvqk"][1]) != want:
            raise RuntimeError(f"the two models differ: reference {rm}, hstu {hm}")
        if i == 0:
            print(f"reference model: {json.dumps(rm)}")
            print(f"hstu model: {json.dumps(hs['model'])}\nhstu recipe: {json.dumps(hs['recipe'])}")
        print(f"repeat {i + 1}:\n{describe('reference', ref)}\n{describe('hstu', hs)}", flush=True)
        for v, r in extra.items():
            print(f"{describe('hstu', r)}  [{v}: {r['sequences_per_s'] / ref['sequences_per_s']:.2f}x the reference]", flush=True)
        row = {"repeat": i + 1, "reference": ref, "hstu": hs, "ratio": hs["sequences_per_s"] / ref["sequences_per_s"]}
        rows.append(row | {"variants": {v: r | {"ratio": r["sequences_per_s"] / ref["sequences_per_s"]} for v, r in extra.items()}})
    print(f"\n{'repeat':>6} {'reference seq/s':>16} {'hstu seq/s':>11} {'hstu / reference':>17}")
    for r in rows:
        print(f"{r['repeat']:>6} {r['reference']['sequences_per_s']:>16.1f} {r['hstu']['sequences_per_s']:>11.1f} {r['ratio']:>17.2f}")
    median = statistics.median(r["ratio"] for r in rows)
    print(f"median ratio (hstu seq/s / reference seq/s): {median:.2f}")
    variants = {v: statistics.median(r["variants"][v]["ratio"] for r in rows) for v in args.hstu_variant}
    for v, m in variants.items():
        print(f"median ratio of hstu {v}: {m:.2f}")
    return {"rows": rows, "median_ratio": median, "variant_median_ratios": variants}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", type=Path, help="generative-recommenders checkout or git directory (its HEAD is run)")
    p.add_argument("--data-dir", type=Path, default=Path("../shared/data/ml-1m"), help="ML-1M: ratings.dat, users.dat, movies.dat")
    p.add_argument("--config", choices=sorted(GIN), default="small", help="small: n128-final.gin / --preset small; large: ...-large")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS and torch threads of every run")
    p.add_argument("--repeats", type=int, default=2, help="reference-then-hstu pairs")
    p.add_argument("--protocol", choices=["paper", "clean"], default="paper", help="hstu's split (paper: the reference's train split)")
    p.add_argument("--max-batches", type=int, default=0, help="smoke: N batches per side (0: the whole epoch)")
    p.add_argument(
        "--hstu-variant",
        action="append",
        default=[],
        help="also time `hstu train` with these flags after the default in every repeat (e.g. '--softmax full'; repeatable)",
    )
    p.add_argument("--ref-workers", type=int, help="reference DataLoader workers (default: the gin config's, 8)")
    p.add_argument("--ref-no-anomaly", action="store_true", help="reference without its torch.autograd.set_detect_anomaly(True)")
    p.add_argument("--work", type=Path, help="keep (and reuse) the reference copy and runs here instead of a temporary directory")
    p.add_argument("--out", type=Path, help="result JSON")
    p.add_argument("--reference-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reference_child:
        return reference_child(args) or 0
    if args.reference is None:
        p.error("--reference is required")
    import torch

    from _quality import command, git_commit, machine, write_json

    torch.set_num_threads(args.threads)
    args.data_dir = args.data_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="gr-reference-") as tmp:  # removed at the end; --work DIR is kept
        work = (args.work or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        ref_commit = prepare_reference(args.reference.resolve(), args.data_dir, work)
        info = {"machine": machine(), "hstu_commit": git_commit(), "reference_commit": ref_commit, "command": command()}
        print(json.dumps(info))
        result = {**info, **{k: v for k, v in vars(args).items() if k not in ("reference_child", "port")}, **measure(args, work)}
    result = {k: str(v) if isinstance(v, Path) else v for k, v in result.items()}
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
