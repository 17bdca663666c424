"""No allocation in the decode loop, stated precisely.

What "allocation" means here. Every eager op returns a new tensor, so small temporaries (the
argmax of a row, one layer's activations of the new token) are allocations too and are not
claimed away on CPU (on CUDA / NPU graph replay they come from the graph's static pool). The
claims checked are the ones that matter for a growing sequence:

1. no factory op (empty / zeros / ones / full / arange / *_like / new_* / scalar_tensor ...)
   and no growth op (cat / stack / pad / repeat) is dispatched inside the decode loop
   (TorchDispatchMode sees every aten call);
2. the work per step does not grow with the step: the op counts of k = 3, 4, 5 differ by the
   same amount per extra step;
3. the KV-cache pool and the decode buffers keep their storage (same data_ptr, same shape)
   across calls of every strategy and bucket: they are written in place, never reallocated.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hstu.config import ModelConfig
from hstu.generate.engine import Engine
from hstu.model import build_hstu

FORBIDDEN = {
    "aten.empty",
    "aten.empty_strided",
    "aten.empty_like",
    "aten.zeros",
    "aten.zeros_like",
    "aten.ones",
    "aten.ones_like",
    "aten.full",
    "aten.full_like",
    "aten.new_empty",
    "aten.new_empty_strided",
    "aten.new_zeros",
    "aten.new_ones",
    "aten.new_full",
    "aten.arange",
    "aten.scalar_tensor",
    "aten.lift_fresh",
    "aten.cat",
    "aten.stack",
    "aten.pad",
    "aten.constant_pad_nd",
    "aten.repeat",
    "aten.repeat_interleave",
    "aten.resize_",
    "aten.clone",
}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_items=200,
        max_seq_len=40,
        max_output_len=6,
        embedding_dim=16,
        num_blocks=2,
        num_heads=2,
        d_qk=8,
        d_v=8,
        dropout=0.0,
        num_actions=3,
        num_categories=4,
    )
    return Engine(build_hstu(cfg).eval(), buckets=(10, 40), max_batch=4, k_max=6)


def run_counting(engine, monkeypatch, k, strategy):
    counted: list[collections.Counter] = []
    orig = Engine._decode

    def wrapped(self, *a, **kw):
        with OpCounter() as c:
            out = orig(self, *a, **kw)
        counted.append(c.ops)
        return out

    monkeypatch.setattr(Engine, "_decode", wrapped)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 201, (3, 40), generator=g)
    ts = torch.sort(torch.randint(0, 10**7, (3, 40), generator=g), dim=1).values
    lengths = torch.tensor([4, 25, 40])
    engine.generate(ids, ts, lengths, k, strategy=strategy, beam_width=2, item_category=torch.randint(0, 5, (201,), generator=g))
    monkeypatch.setattr(Engine, "_decode", orig)
    total = collections.Counter()
    for c in counted:
        total.update(c)
    return total, len(counted)


@pytest.mark.parametrize("strategy", ["greedy", "topk", "beam"])
def test_no_factory_or_growth_ops_in_decode_loop(engine, monkeypatch, strategy):
    ops, groups = run_counting(engine, monkeypatch, 5, strategy)
    assert groups >= 2 and sum(ops.values()) > 100  # the hook saw the loop
    assert not (set(ops) & FORBIDDEN), sorted(set(ops) & FORBIDDEN)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_work_per_step_is_constant(engine, monkeypatch, strategy):
    n = [sum(run_counting(engine, monkeypatch, k, strategy)[0].values()) for k in (3, 4, 5)]
    assert n[2] - n[1] == n[1] - n[0] > 0


def test_pool_is_written_in_place(engine):
    def snapshot():
        bufs = [*engine.kv_pool.buffers(), *(t for b in engine._buckets.values() for t in (*b.hk, *b.hv))]
        bufs += [engine._excl, engine._scores, engine._out_items]
        return [(t.data_ptr(), tuple(t.shape)) for t in bufs]

    before = snapshot()
    g = torch.Generator().manual_seed(1)
    for strategy in ("greedy", "topk", "beam"):
        for lengths in ([1, 10], [11, 40, 3]):
            L = torch.tensor(lengths)
            ids = torch.randint(1, 201, (len(lengths), 40), generator=g)
            ts = torch.sort(torch.randint(0, 10**7, (len(lengths), 40), generator=g), dim=1).values
            engine.generate(ids, ts, L, 6, strategy=strategy, beam_width=2)
    assert snapshot() == before


def test_one_kv_pool_viewed_by_every_bucket(engine):
    """The buckets' K/V are views of the engine's one KVPool (non-persistent buffers of an nn.Module):
    it holds the largest bucket's C + K slots per row, not the sum over the buckets."""
    pool, c = engine.kv_pool, engine.model.cfg
    assert isinstance(pool, torch.nn.Module) and pool.state_dict() == {}  # non-persistent: never in a checkpoint
    keys = [getattr(pool, f"k{i}") for i in range(c.num_blocks)]
    values = [getattr(pool, f"v{i}") for i in range(c.num_blocks)]
    for b in engine._buckets.values():
        assert [t.data_ptr() for t in b.hk + b.hv] == [t.data_ptr() for t in keys + values]  # slot 0 of the pool
        assert all(t.shape[2] == b.C + engine.k_max for t in b.hk + b.hv)
        assert b.gk_scratch is pool.k_scratch and b.gv_scratch is pool.v_scratch
    widest = max(engine.edges) + 1 + engine.k_max
    per_slot = engine.max_batch * c.num_heads * (c.d_qk + c.d_v) * c.num_blocks * torch.finfo(engine.dtype).bits // 8
    scratch = engine.max_batch * c.num_heads * engine.k_max * (c.d_qk + c.d_v) * torch.finfo(engine.dtype).bits // 8
    assert pool.nbytes() == widest * per_slot + scratch  # by hand
    assert engine.memory_report()["kv_pool"] == pool.nbytes() == max(engine.cache_bytes_per_bucket().values())
    assert pool.nbytes() < sum(engine.cache_bytes_per_bucket().values())


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_multi_channel_decode_loop_concatenates_its_channels_only(monkeypatch, strategy):
    """[model] multi_channel (FuXi-alpha's channels): the same claims, except one aten.cat per layer and step, the
    new row's semantic, position and time outputs side by side (a fixed (R, 1, 3 H d_v), not a growing sequence)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_items=200, max_seq_len=40, max_output_len=6, embedding_dim=16, num_blocks=2, num_heads=2, d_qk=8, d_v=8, dropout=0.0,
        multi_channel=True,
    )  # fmt: skip
    eng = Engine(build_hstu(cfg).eval(), buckets=(10, 40), max_batch=4, k_max=6)
    counts = [run_counting(eng, monkeypatch, k, strategy)[0] for k in (3, 4, 5)]
    assert not (set(counts[2]) & (FORBIDDEN - {"aten.cat"})), sorted(set(counts[2]) & FORBIDDEN)
    n, cats = [sum(c.values()) for c in counts], [c["aten.cat"] for c in counts]
    assert n[2] - n[1] == n[1] - n[0] > 0 and cats[2] - cats[1] == cats[1] - cats[0] == 2 * cfg.num_blocks  # 2 groups
