"""Our encoder against a naive float64 re-implementation with explicit loops (DESIGN.md
"The model"), on tiny shapes with random weights; plus hand-computed time buckets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hstu.config import ModelConfig
from hstu.model import HSTUModel
from hstu.model.bias import time_buckets


def bucket_ref(dt: float) -> int:
    return min(max(int(math.floor(math.log(max(abs(dt), 1)) / 0.301)), 0), 128)


@pytest.mark.parametrize("dt,expected", [(0, 0), (1, 0), (2, 2), (60, 13), (3600, 27), (86400, 37), (-86400, 37), (10**12, 91)])
def test_time_bucket_hand_values(dt, expected):
    # ln(60)/0.301 = 13.6 -> 13; ln(3600)/0.301 = 27.2 -> 27; ln(86400)/0.301 = 37.8 -> 37;
    # ln(2)/0.301 = 2.30 -> 2; ln(1e12)/0.301 = 91.8 -> 91
    ts = torch.tensor([[0, dt]], dtype=torch.int64)
    assert int(time_buckets(ts)[0, 0, 0]) == expected == bucket_ref(dt)


def layer_norm(z, eps=1e-6):
    return (z - z.mean()) / math.sqrt(z.var() + eps)  # numpy var is the biased one, like LN


def silu(z):
    return z / (1 + np.exp(-z))


def reference_encoder(m: HSTUModel, ids, ts, lengths):
    """Loops over batch, rows and keys in float64. Divisor n: N, or i + 1 for row i ("causal")."""
    c = m.cfg
    eps = c.layer_norm_eps
    N, d, H, dqk, dv = c.width, c.embedding_dim, c.num_heads, c.d_qk, c.d_v
    P = {k: v.detach().double().numpy() for k, v in m.state_dict().items()}
    B, W = ids.shape
    out = np.zeros((B, W, d))
    for b in range(B):
        L = int(lengths[b])
        t = list(ts[b]) + [ts[b][-1]]
        x = np.zeros((W, d))
        for i in range(L):
            x[i] = P["item_emb.weight"][ids[b, i]] * math.sqrt(d) + P["pos_emb.weight"][i]
        for li in range(c.num_blocks):
            pre = f"layers.{li}."
            Wuvqk, Wo, bo = P[pre + "uvqk.weight"].T, P[pre + "o.weight"], P[pre + "o.bias"]
            pos_w, ts_w = P[pre + "rel_bias.pos_w"], P[pre + "rel_bias.ts_w"]
            h = np.array([silu(layer_norm(x[i], eps) @ Wuvqk) for i in range(W)])
            u, v, q, k = h[:, : H * dv], h[:, H * dv : 2 * H * dv], h[:, 2 * H * dv : 2 * H * dv + H * dqk], h[:, 2 * H * dv + H * dqk :]
            y = np.zeros((W, d))
            for i in range(L):
                n = N if c.attention_norm == "fixed" else i + 1
                av = np.zeros(H * dv)
                for hh in range(H):
                    for j in range(i + 1):
                        rab = pos_w[N - 1 + j - i] + ts_w[bucket_ref(t[i + 1] - t[j])]
                        s = q[i, hh * dqk : (hh + 1) * dqk] @ k[j, hh * dqk : (hh + 1) * dqk] + rab
                        av[hh * dv : (hh + 1) * dv] += silu(s) / n * v[j, hh * dv : (hh + 1) * dv]
                y[i] = Wo @ (u[i] * layer_norm(av, eps)) + bo + x[i]
            x = y
        for i in range(L):
            out[b, i] = x[i] / max(np.linalg.norm(x[i]), 1e-6)
    return out


def tiny_model(seed=0, heads=2, **kw) -> HSTUModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        num_items=30, max_seq_len=7, max_output_len=3, embedding_dim=8, num_blocks=2, num_heads=heads, d_qk=4, d_v=3, dropout=0.0, **kw
    )
    m = HSTUModel(cfg).eval()
    with torch.no_grad():  # larger biases than the init, so the bias terms matter in the check
        for layer in m.layers:
            layer.rel_bias.pos_w.normal_(0, 0.5)
            layer.rel_bias.ts_w.normal_(0, 0.5)
    return m


# LN(A·V) cancels a per-row scale of A·V up to its eps, so a large eps makes the divisor visible
@pytest.mark.parametrize(
    "kw", [{}, dict(attention_norm="causal"), dict(attention_norm="causal", layer_norm_eps=0.5), dict(layer_norm_eps=0.5)]
)
def test_encoder_matches_float64_loops(kw):
    m = tiny_model(**kw)
    ids = torch.tensor([[3, 9, 27, 4, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8][:8]])
    ids[2, 7] = 0
    lengths = torch.tensor([4, 1, 7])
    base = 978_300_000
    ts = torch.tensor(
        [
            [base, base + 5, base + 3600, base + 86400 * 3, base + 86400 * 4, 0, 0, 0],
            [base, base + 60, 0, 0, 0, 0, 0, 0],
            [base, base, base + 1, base + 100, base + 10**5, base + 10**6, base + 10**6, base + 10**7],
        ]
    )
    with torch.no_grad():
        got = m.encode(ids, ts, lengths).double().numpy()
    ref = reference_encoder(m, ids.numpy(), ts.numpy(), lengths.numpy())
    np.testing.assert_allclose(got, ref, atol=2e-6)  # float32 vs float64 sums of ~10 terms


def test_padding_rows_are_zero_and_do_not_leak():
    m = tiny_model(seed=1)
    ids = torch.tensor([[3, 9, 27, 4, 0, 0], [3, 9, 27, 4, 11, 12]])
    ts = torch.tensor([[10, 20, 30, 40, 50, 0], [10, 20, 30, 40, 50, 60]])
    with torch.no_grad():
        out = m.encode(ids, ts, torch.tensor([4, 6]))
    assert torch.all(out[0, 4:] == 0)
    # row 3 of both sequences sees the same keys and the same t[4] = 50
    torch.testing.assert_close(out[0, :4], out[1, :4], atol=1e-6, rtol=1e-6)
