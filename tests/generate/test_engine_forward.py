"""The engine runs the model's one layer forward (HSTULayer.forward(x, meta, kv)) on every path.

1. Prefill, extend (prefix-cache hit) and the decode steps of greedy, top-k and beam search give,
   at every step, the scores a full recompute of the grown sequence gives through
   HSTUModel.encode in float64 (the training forward), with actions and categories fed.
2. The engine reaches into no layer's parts: a layer subclass with another internal layout
   (its own module names, no ``uvqk`` / ``o`` / ``rel_bias``, its own forward) generates
   exactly what the stock layer with the same weights generates.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hstu.config import ModelConfig
from hstu.generate.engine import Engine
from hstu.model import HSTULayer, build_hstu
from hstu.model.meta import AttentionMeta, KVView, hstu_attention

I = 90  # noqa: E741  items


def make_model(seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        num_items=I,
        max_seq_len=40,
        max_output_len=5,
        embedding_dim=16,
        num_blocks=2,
        num_heads=2,
        d_qk=8,
        d_v=8,
        dropout=0.0,
        num_actions=3,
        num_categories=4,
        **kw,
    )
    m = build_hstu(cfg).eval()
    with torch.no_grad():  # biases large enough that a wrong position or time bucket shows in the scores
        for layer in m.layers:
            layer.rel_bias.pos_w.normal_(0, 0.5)
            layer.rel_bias.ts_w.normal_(0, 0.5)
    return m


def histories(lengths: list[int], width: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    L = torch.tensor(lengths)
    live = torch.arange(width).view(1, -1) < L.view(-1, 1)
    ids = torch.randint(1, I + 1, (B, width), generator=g) * live
    ts = torch.sort(torch.randint(10**8, 10**8 + 10**6, (B, width), generator=g), dim=1).values * live
    acts = torch.randint(1, 4, (B, width), generator=g) * live
    item_cat = torch.randint(0, 5, (I + 1,), generator=g)
    rt = ts.max(dim=1).values + torch.randint(1, 10**4, (B,), generator=g)
    return ids, ts, acts, item_cat, L, rt


def recompute_scores(m64, ids, ts, acts, item_cat, L, rt, items, actions) -> torch.Tensor:
    """Score of items[b, s] after the history plus items[b, :s], by a float64 full encode (B, k)."""
    B, k = items.shape
    N = m64.cfg.width
    out = torch.zeros(B, k, dtype=torch.float64)
    for b in range(B):
        n = int(L[b])
        for s in range(k):
            row_ids = torch.zeros(1, N, dtype=torch.int64)
            row_ts = torch.full((1, N), int(rt[b]), dtype=torch.int64)  # generated tokens and the query: request time
            row_act = torch.zeros(1, N, dtype=torch.int64)
            row_ids[0, :n], row_ts[0, :n], row_act[0, :n] = ids[b, :n], ts[b, :n], acts[b, :n]
            row_ids[0, n : n + s], row_act[0, n : n + s] = items[b, :s], actions[b, :s]
            Ls = torch.tensor([n + s])
            with torch.no_grad():
                seq = m64.encode(row_ids, row_ts, Ls, actions=row_act, categories=item_cat[row_ids] * (row_ids > 0))
                out[b, s] = m64.score_all(m64.last_rows(seq, Ls))[0, items[b, s]]
    return out


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.double(), b.double(), rtol=2e-5, atol=2e-5 * float(b.abs().max()))


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.mark.parametrize("strategy", ["greedy", "topk", "beam"])
def test_prefill_and_decode_equal_full_recompute(model, strategy):
    ids, ts, acts, item_cat, L, rt = histories([1, 7, 20, 33, 40], width=40)
    eng = Engine(copy.deepcopy(model), buckets=(20, 40), max_batch=8, k_max=5)
    res = eng.generate(
        ids,
        ts,
        L,
        5,
        request_time=rt,
        actions=acts,
        categories=item_cat[ids] * (ids > 0),
        item_category=item_cat,
        strategy=strategy,
        beam_width=3,
        top_k=10,
        seed=4,
    )
    want = recompute_scores(copy.deepcopy(model).double(), ids, ts, acts, item_cat, L, rt, res.items, res.actions)
    close(res.scores, want)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_sasrec_runs_the_same_engine(strategy):
    """SASRec blocks keep the layer contract too (softmax attention: one softmax over the beams'
    history and generated keys), so the engine's paths equal its full recompute."""
    torch.manual_seed(1)
    cfg = ModelConfig(
        architecture="sasrec",
        num_items=I,
        max_seq_len=40,
        max_output_len=5,
        embedding_dim=16,
        num_blocks=2,
        num_heads=2,
        d_qk=8,
        d_v=8,
        dropout=0.0,
        num_actions=3,
        num_categories=4,
    )
    m = build_hstu(cfg).eval()
    ids, ts, acts, item_cat, L, rt = histories([1, 9, 20, 40], width=40, seed=8)
    res = Engine(copy.deepcopy(m), buckets=(20, 40), max_batch=8, k_max=5).generate(
        ids,
        ts,
        L,
        5,
        request_time=rt,
        actions=acts,
        categories=item_cat[ids] * (ids > 0),
        item_category=item_cat,
        strategy=strategy,
        beam_width=2,
    )
    close(res.scores, recompute_scores(copy.deepcopy(m).double(), ids, ts, acts, item_cat, L, rt, res.items, res.actions))


def test_prefix_extension_equals_full_recompute(model):
    """A returning user (cached prefix, two new events) runs the extend path; its generation equals
    a full recompute of the whole history and a cold engine's answer."""
    ids, ts, acts, item_cat, L, rt = histories([12, 30, 38], width=40, seed=5)
    cats = item_cat[ids] * (ids > 0)
    eng = Engine(copy.deepcopy(model), buckets=(20, 40), max_batch=4, k_max=5, prefix_cache_bytes=1 << 24)
    users = ["a", "b", "c"]
    first_L = L - 2
    eng.generate(
        ids,
        ts,
        first_L,
        2,
        request_time=ts.gather(1, first_L.view(-1, 1)).view(-1),
        actions=acts,
        categories=cats,
        item_category=item_cat,
        user_ids=users,
    )
    res = eng.generate(ids, ts, L, 4, request_time=rt, actions=acts, categories=cats, item_category=item_cat, user_ids=users)
    assert (res.prefix_rows == first_L - 1).all()  # the extend path ran (last row recomputed: its query time changed)
    cold = Engine(copy.deepcopy(model), buckets=(20, 40), max_batch=4, k_max=5).generate(
        ids, ts, L, 4, request_time=rt, actions=acts, categories=cats, item_category=item_cat
    )
    assert torch.equal(res.items, cold.items)
    want = recompute_scores(copy.deepcopy(model).double(), ids, ts, acts, item_cat, L, rt, res.items, res.actions)
    close(res.scores, want)


class RenamedLayer(HSTULayer):
    """The same block with another internal layout: separate U/V and Q/K projections under new
    names, the output projection and bias tables renamed, and its own forward. Only the layer
    contract (forward(x, meta, kv), relative_bias(meta, dtype)) is left for callers."""

    def __init__(self, stock: HSTULayer) -> None:
        nn.Module.__init__(self)
        self.dim, self.num_heads, self.d_qk, self.d_v, self.width, self.eps = (
            stock.dim,
            stock.num_heads,
            stock.d_qk,
            stock.d_v,
            stock.width,
            stock.eps,
        )
        self.attention_norm, self.index = stock.attention_norm, stock.index
        hv = stock.num_heads * stock.d_v
        w = stock.uvqk.weight.detach()
        self.w_uv = nn.Linear(stock.dim, 2 * hv, bias=False)
        self.w_qk = nn.Linear(stock.dim, w.shape[0] - 2 * hv, bias=False)
        with torch.no_grad():
            self.w_uv.weight.copy_(w[: 2 * hv])
            self.w_qk.weight.copy_(w[2 * hv :])
        self.w_out = copy.deepcopy(stock.o)
        self.tables = copy.deepcopy(stock.rel_bias)

    def relative_bias(self, meta: AttentionMeta, dtype: torch.dtype) -> torch.Tensor:
        t = self.tables
        return meta.kernels.decode_bias(
            meta.q_pos, meta.k_pos, meta.k_valid, meta.tb, t.pos_w, t.ts_w if meta.tb is not None else None, dtype
        )

    def forward(self, x: torch.Tensor, meta: AttentionMeta, kv: KVView | None = None) -> torch.Tensor:
        h = F.layer_norm(x, (self.dim,), eps=self.eps)
        u, v = F.silu(self.w_uv(h)).chunk(2, dim=-1)
        q, k = F.silu(self.w_qk(h)).chunk(2, dim=-1)
        q, k, v = self.heads(q, self.d_qk), self.heads(k, self.d_qk), self.heads(v, self.d_v)
        if kv is None:
            kv = KVView(k, v)
        else:
            kv.append(k, v, meta)
        if meta.rows is not None:
            B = x.shape[0]
            r = meta.rows
            q, u, x = q[torch.arange(B), :, r].unsqueeze(2), u[torch.arange(B), r].unsqueeze(1), x[torch.arange(B), r].unsqueeze(1)
        av = hstu_attention(
            q, kv, meta, rel_bias=self.tables, width=self.width, fixed_norm=self.attention_norm == "fixed", layer_index=self.index
        )
        y = x + self.w_out(u * F.layer_norm(av, (av.shape[-1],), eps=self.eps))
        return y if meta.valid is None or meta.rows is not None else y * meta.valid


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_engine_uses_only_the_layer_contract(model, strategy):
    renamed = copy.deepcopy(model)
    renamed.layers = nn.ModuleList(RenamedLayer(layer) for layer in renamed.layers)
    assert not any(hasattr(layer, name) for layer in renamed.layers for name in ("uvqk", "o", "rel_bias"))
    ids, ts, acts, item_cat, L, rt = histories([3, 18, 25, 40], width=40, seed=7)
    kw = dict(request_time=rt, actions=acts, categories=item_cat[ids] * (ids > 0), item_category=item_cat, strategy=strategy, beam_width=2)
    want = Engine(copy.deepcopy(model), buckets=(20, 40), max_batch=8, k_max=5).generate(ids, ts, L, 5, **kw)
    got = Engine(renamed, buckets=(20, 40), max_batch=8, k_max=5).generate(ids, ts, L, 5, **kw)
    assert torch.equal(got.items, want.items)
    close(got.scores, want.scores)
