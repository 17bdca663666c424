"""The 120M-item catalogue path (benchmarks/catalogue.py) at 2M items: the generated Zipf log read by
the csv loader as the whole catalogue, a few training steps on the hashed, sharded, explicitly placed
table, then evaluation and generation on fp16 rows with no (B x 2M) float matrix (every tensor the
scoring creates is recorded through a TorchDispatchMode) and the same ranks / items as the full path."""

from __future__ import annotations

import math
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import REPO
from torch.utils._python_dispatch import TorchDispatchMode

from hstu.data.sequences import make_split
from hstu.generate.decode import generate
from hstu.generate.sampler import exclusion_mask
from hstu.model import item_index as ii
from hstu.train.evaluate import evaluate_ranks

N = 2_000_003  # items: a (100 x 2M) float32 score matrix is 800 MB
USERS, EVENTS = 240, 7200


@pytest.fixture(scope="module")
def catalogue():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import catalogue as mod
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    yield mod
    sys.modules.pop("catalogue", None)


def test_zipf_ids_follow_the_power_law(catalogue):
    n, a = 1000, 1.2
    ids = catalogue.zipf_ids(n, 200_000, a, np.random.default_rng(0))
    assert ids.min() >= 1 and ids.max() <= n
    # rank r <-> id (r - 1) * M mod n + 1; P(rank r) = ((r+1)^e - r^e) / ((n+1)^e - 1), e = 1 - a
    e = 1 - a
    for r in (1, 2, 10):
        want = ((r + 1) ** e - r**e) / ((n + 1) ** e - 1)
        got = np.mean(ids == ((r - 1) * catalogue.MULTIPLIER) % n + 1)
        assert abs(got - want) < 4 * math.sqrt(want / 200_000), (r, got, want)


# Peak RSS the build and training steps may take beyond the plan (hstu plan-memory: rows, hash index,
# row-wise AdaGrad state): the batches' activations, sampled rows and gradients (64 x 20 positions x 32
# negatives, d 16: a few MB). Measured 5.8 and 22 MiB over a plan of 76.3 MiB (2M items, two runs: the
# allocator's arenas vary); a table-sized extra (a bf16 copy of the rows or a dense table gradient, 61 MiB)
# exceeds it.
PLAN_SLACK = 32 << 20


def _build_and_train(catalogue, out, n: int):
    """The benchmark's steps 1 and 3 at ``n`` items (rowwise_adagrad, as the 120M run): (path, log,
    split, args, model, train stats with "peak_rss_growth", bytes of peak RSS over the build and training)."""
    path = catalogue.write_event_log(out / "events.parquet", n, EVENTS, USERS, seed=0)
    log_ = catalogue.catalogue_log(path, n)
    split = make_split(log_)
    argv = ["--items", str(n), "--events", str(EVENTS), "--users", str(USERS), "--out", str(out), "--table-optimizer", "rowwise_adagrad"]
    args = catalogue.parse_args([*argv, "--dim", "16", "--batch-size", "64", "--negatives", "32", "--max-seq-len", "20"])
    catalogue.reset_peak()
    base = catalogue.peak_rss()
    model = catalogue.build_model(args, log_)
    stats = catalogue.train(args, model, log_, split)
    stats["peak_rss"] = catalogue.peak_rss()
    stats["peak_rss_growth"] = stats["peak_rss"] - base
    return path, log_, split, args, model, stats


@pytest.fixture(scope="module")
def trained(catalogue, tmp_path_factory):
    # a 2003-item run first: a process's first build and training steps take ~85 MB whatever the table's
    # size (kernels, allocator arenas, autograd; measured at 2K, 1M, 2M and 4M items), not the plan's
    _build_and_train(catalogue, tmp_path_factory.mktemp("warm"), 2003)
    path, log_, split, args, model, stats = _build_and_train(catalogue, tmp_path_factory.mktemp("cat"), N)
    stats["plan"] = catalogue.plan_memory(args)  # hstu plan-memory --json for this table, as the benchmark runs it
    model.eval()
    model.item_emb.cast_storage("fp16")
    return path, log_, split, model, stats


@pytest.mark.slow
def test_the_log_is_the_whole_catalogue_and_its_events(trained):
    path, log_, _, model, _ = trained
    assert log_.num_items == N and model.cfg.num_items == N
    assert len(np.unique(log_.items)) < N // 100  # most items have no event, and still a row
    df = pd.read_parquet(path)
    assert np.array_equal(np.sort(log_.items), np.sort(df["item"].to_numpy()))  # raw id = dense id
    first = df[df["user"] == df["user"].iloc[0]]["item"].to_numpy()
    assert np.array_equal(log_.items[log_.offsets[0] : log_.offsets[1]], first)  # a user's events in time order


@pytest.mark.slow
def test_training_ran_on_the_hashed_sharded_table(trained):
    *_, model, stats = trained
    assert stats["steps"] >= 3  # 240 users in batches of 64
    assert math.isfinite(stats["first_loss"]) and math.isfinite(stats["last_loss"])
    emb = model.item_emb
    assert len(emb.shards) == 4 and {p.dtype for p in emb.shards} == {torch.float16}
    assert emb.host_tensors()  # explicit placement: shards 1 and 3 on the host


@pytest.mark.slow
def test_build_and_training_stay_within_the_memory_plan(trained):
    """Peak RSS over building the 2M-item table and training on it: its growth at most hstu plan-memory's
    estimate + PLAN_SLACK, the absolute peak at least the table's bytes (the issue's memory bound;
    the 120M run: benchmarks/results/catalogue_120m.json)."""
    *_, model, stats = trained
    plan, grew = stats["plan"], stats["peak_rss_growth"]
    assert plan["fits"] and plan["device_is_host"] and plan["optimizer"] == "rowwise_adagrad"
    planned = plan["device_bytes"] + plan["host_bytes"]  # CPU: "device" and host shards share the RAM
    assert planned == plan["table_bytes"] + plan["index_bytes"] + plan["optimizer_bytes"]
    assert plan["table_bytes"] == sum(p.numel() * p.element_size() for p in model.item_emb.shards)  # 2-byte rows (bf16, then fp16)
    assert plan["optimizer_bytes"] == (N + 2) * 4  # one float32 accumulator per row (padding and overflow rows included)
    # the growth can be anything from 0 up: a process that freed large blocks before (other tests) may place
    # the rows in memory it already holds (glibc's moving mmap threshold; CI measured 0), so the measure's
    # sanity check is the absolute peak, which holds the table whatever the allocator reused
    assert stats["peak_rss"] >= plan["table_bytes"], stats["peak_rss"]
    assert grew <= planned + PLAN_SLACK, (grew, planned)


class Largest(TorchDispatchMode):
    """Records the largest floating-point tensor any op creates (elements)."""

    def __init__(self):
        super().__init__()
        self.max_float = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.max_float = max(self.max_float, t.numel())
        return out


@pytest.mark.slow
def test_eval_streams_in_bounded_memory_with_the_full_ranks(trained, catalogue, monkeypatch):
    _, log_, split, model, stats = trained
    users = np.nonzero(split.targets("test") >= 0)[0][:100]
    with torch.inference_mode():
        index = model.item_index()
    assert isinstance(index, ii.ShardIndex)  # no float32 copy of the 2M rows: the shards scored in place
    assert index.nbytes == stats["plan"]["scoring_bytes"]  # hstu plan-memory's figure for it
    assert ii.streams(index, len(users))
    chunk = ii.chunk_rows(len(users), align=index.block)
    rec = Largest()
    catalogue.reset_peak()
    base = catalogue.peak_rss()
    with rec:
        order, ranks = evaluate_ranks(model, log_, split, "test", users=users, batch_size=len(users), exclude=True)
    grew = catalogue.peak_rss() - base
    full_bytes = len(users) * (N + 1) * 4
    assert rec.max_float <= len(users) * chunk < len(users) * (N + 1) // 20  # the largest float block: (B, chunk)
    # 800 MB would be the full matrix; measured 215-270 MB: the index (58 MB of inverse norms, ids and
    # hashing temporaries), a few (B, chunk) float32 blocks of 33 MB and the model's forward
    assert grew < full_bytes // 2
    monkeypatch.setattr(ii, "STREAM_BYTES", 1 << 62)  # the full (B, I+1) path
    order2, ranks2 = evaluate_ranks(model, log_, split, "test", users=users, batch_size=len(users), exclude=True)
    assert np.array_equal(order, order2) and np.array_equal(ranks, ranks2)


@pytest.mark.slow
def test_generation_streams_with_the_full_paths_items(trained, monkeypatch):
    from hstu.data.batching import eval_batch

    _, log_, split, model, _ = trained
    users = np.nonzero(split.targets("test") >= 0)[0][:40]  # 40 x 2M x 4 = 320 MB: streamed
    b = eval_batch(log_, split.targets("test"), users, model.cfg.max_seq_len)
    req = b.timestamps.gather(1, (b.lengths - 1).view(-1, 1)).view(-1) + 60

    def run():
        excl = exclusion_mask(N, len(users), b.ids, b.lengths)
        rec = Largest()
        with torch.inference_mode(), rec:
            res = generate(model, b.ids, b.timestamps, b.lengths, 5, request_time=req, exclude=excl)
        return res, rec.max_float

    streamed, largest = run()
    assert largest <= ii.STREAM_CHUNK_BYTES // 4 < len(users) * (N + 1) // 8  # one (B, chunk) block, not the (B, N) matrix
    monkeypatch.setattr(ii, "STREAM_BYTES", 1 << 62)
    full, largest_full = run()
    assert largest_full >= len(users) * (N + 1)  # the recorder sees the full matrix when there is one
    assert torch.equal(streamed.items, full.items)
    assert torch.allclose(streamed.scores, full.scores, rtol=0, atol=1e-6)
    hist = {(r, int(i)) for r in range(len(users)) for i in b.ids[r, : b.lengths[r]]}
    assert not any((r, int(i)) in hist for r in range(len(users)) for i in streamed.items[r])  # history excluded
