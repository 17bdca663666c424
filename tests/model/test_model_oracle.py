"""Cross-implementation check: our encoder with the reference implementation's weights
reproduces its outputs (../shared/oracle/README.md)."""

from __future__ import annotations

import numpy as np
import torch

from hstu.config import ModelConfig
from hstu.model import HSTUModel
from hstu.model.bias import time_buckets


def load_oracle_model(z) -> HSTUModel:
    d, H, dqk, dv, blocks, max_len, max_out, num_items = (int(x) for x in z["meta/config"])
    cfg = ModelConfig(
        num_items=num_items,
        max_seq_len=max_len,
        max_output_len=max_out,
        embedding_dim=d,
        num_blocks=blocks,
        num_heads=H,
        d_qk=dqk,
        d_v=dv,
        dropout=0.0,
    )
    m = HSTUModel(cfg).eval()
    p = lambda k: torch.from_numpy(z["param/" + k])  # noqa: E731
    with torch.no_grad():
        m.item_emb.weight.copy_(p("_embedding_module._item_emb.weight"))
        m.pos_emb.weight.copy_(p("_input_features_preproc._pos_emb.weight"))
        for i, layer in enumerate(m.layers):
            pre = f"_hstu._attention_layers.{i}."
            layer.uvqk.weight.copy_(p(pre + "_uvqk").T)  # reference computes x @ W
            layer.o.weight.copy_(p(pre + "_o.weight"))
            layer.o.bias.copy_(p(pre + "_o.bias"))
            layer.rel_bias.ts_w.copy_(p(pre + "_rel_attn_bias._ts_w"))
            layer.rel_bias.pos_w.copy_(p(pre + "_rel_attn_bias._pos_w"))
    return m


def test_time_buckets_match_oracle_check(oracle_path):
    z = np.load(oracle_path)
    deltas = torch.from_numpy(z["check/time_deltas"])
    expected = z["check/time_buckets_unclamped"]
    ts = torch.stack([torch.zeros_like(deltas), deltas], dim=1)  # row 0 compares t[1] with t[0]
    got = time_buckets(ts, num_buckets=10_000)[:, 0, 0].numpy()
    np.testing.assert_array_equal(got, expected)


def test_encoder_matches_reference_outputs(oracle_path):
    z = np.load(oracle_path)
    m = load_oracle_model(z)
    ids = torch.from_numpy(z["input/past_ids"])
    lengths = torch.from_numpy(z["input/past_lengths"])
    ts = torch.from_numpy(z["input/timestamps"])
    with torch.no_grad():
        rab = m.layers[0].rel_bias(m.buckets(ts))
        np.testing.assert_allclose(rab.numpy(), z["output/rab_layer0"], atol=1e-6)
        # layer-by-layer outputs on the live rows
        B, W = ids.shape
        pos = torch.arange(W)
        valid = (pos.view(1, W) < lengths.view(B, 1)).unsqueeze(-1).float()
        x = m.embed(ids, pos.expand(B, W)) * valid
        meta = m.attention_meta(ts, valid)
        live = valid.squeeze(-1).bool()
        for i, layer in enumerate(m.layers):
            x = layer(x, meta)
            np.testing.assert_allclose(x[live].numpy(), z[f"output/layer{i}_jagged"], atol=1e-5, rtol=1e-5)
        seq = m.encode(ids, ts, lengths)
        np.testing.assert_allclose(seq.numpy(), z["output/seq_embeddings"], atol=1e-5)
        np.testing.assert_allclose(m.last_rows(seq, lengths).numpy(), z["output/current_embeddings"], atol=1e-5)


def test_padding_width_does_not_change_live_rows(oracle_path):
    """Divisor n is the fixed N, so a narrower padded width gives the same live rows."""
    z = np.load(oracle_path)
    m = load_oracle_model(z)
    ids = torch.from_numpy(z["input/past_ids"])
    lengths = torch.from_numpy(z["input/past_lengths"])
    ts = torch.from_numpy(z["input/timestamps"])
    with torch.no_grad():
        full = m.encode(ids, ts, lengths)
        narrow = m.encode(ids[:, :21], ts[:, :21], lengths)
    torch.testing.assert_close(narrow, full[:, :21], atol=1e-6, rtol=1e-6)
