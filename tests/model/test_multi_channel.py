"""``[model] multi_channel = true`` (issue 20, Part B: FuXi-alpha's adaptive multi-channel self-attention,
Ye et al. 2025 §4.2): the relative position and time biases leave the scores and become channels of their own,
A_p · V and A_t · V beside SiLU(Q Kᵀ) / n · V. Checked against a float64 hand computation of one block, for
padding invariance, on the generation paths (KV-cached = recompute = the serving engine, greedy and beam), for
packed training rows (tests/train/test_packing.py runs it too), under INT8 and through `hstu train` / `eval`.
With ``query_key_map = false`` it is FuXi-beta's attention-free block (Ye et al. 2025, arXiv:2508.10615): the
semantic channel goes, A·V = [A_p · V, A_t · V]; checked the same ways."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import three_histories

from hstu.config import ModelConfig
from hstu.generate.decode import exclusion_mask, generate, generate_recompute
from hstu.generate.engine import Engine
from hstu.model import HSTUModel
from hstu.model.bias import time_buckets
from hstu.quant.int8 import quantize_model_int8

T0 = 978_300_000


def _cfg(**kw) -> ModelConfig:
    base = dict(num_items=40, max_seq_len=10, max_output_len=4, embedding_dim=12, num_blocks=2, num_heads=2, d_qk=6, d_v=6, dropout=0.0)
    return ModelConfig(**{**base, "multi_channel": True, **kw})


def _model(seed: int = 0, **kw) -> HSTUModel:
    torch.manual_seed(seed)
    m = HSTUModel(_cfg(**kw)).eval()
    with torch.no_grad():
        for layer in m.layers:  # larger than their N(0, 0.02) start, so that the channels weigh in the outputs
            layer.rel_bias.ts_w.normal_(0, 0.5)
            layer.rel_bias.pos_w.normal_(0, 0.5)
    return m


def test_the_projection_and_output_widths() -> None:
    m = _model()
    hv = 2 * 6
    for layer in m.layers:
        assert layer.uvqk.weight.shape == (3 * hv + hv + 2 * hv, 12) and layer.o.weight.shape == (12, 3 * hv)
    one = _model(use_time_bias=False).layers[0]  # a channel whose bias is off is absent
    assert one.channels == 2 and one.o.weight.shape == (12, 2 * hv)


def test_without_the_query_key_map_the_semantic_channel_goes() -> None:
    """FuXi-beta's block: U and W_o's input two channels wide, no Q or K in W_uvqk; a preset keeps its
    multi-channel block when the map is turned off (before: it fell back to the HSTU block)."""
    from hstu.config import model_config_from_preset

    layer, hv = _model(query_key_map=False).layers[0], 2 * 6
    assert (layer.channels, layer.bias_channels, layer.semantic) == (2, 2, False)
    assert layer.uvqk.weight.shape == (2 * hv + hv, 12) and layer.o.weight.shape == (12, 2 * hv)
    assert model_config_from_preset("small", query_key_map=False).multi_channel is True


@pytest.mark.parametrize("qk", [True, False])
def test_one_block_equals_a_float64_hand_computation(qk: bool) -> None:
    """y = x + W_o(U ⊙ LN([SiLU(q_h k_hᵀ) / N · v_h]_h, [A_p v_h]_h, [A_t v_h]_h)), A_p[i, j] = pos_w[N-1+j-i] and
    A_t[i, j] = ts_w[bucket(t[i+1] - t[j])] for j <= i, else 0 (no SiLU, no 1/N on the bias channels); without
    the query-key map (FuXi-beta) the first channel is absent."""
    m = _model(1, num_blocks=1, query_key_map=qk).double()
    layer = m.layers[0]
    W, N, d, H, dv = 5, m.cfg.width, 12, 2, 6
    C = 3 if qk else 2
    x = torch.randn(2, W, d, dtype=torch.float64)
    ts = T0 + torch.tensor([[0, 30, 400, 5000, 90000], [0, 1, 2, 86400, 86500]])
    got = layer(x, m.attention_meta(ts, torch.ones(2, W, 1, dtype=torch.float64)))
    h = F.silu(F.layer_norm(x, (d,), eps=layer.eps) @ layer.uvqk.weight.T)  # (2, W, C Hdv + Hdv [+ 2Hdqk])
    u, v, q, k = h.split([C * H * dv, H * dv, H * 6, H * 6], dim=-1) if qk else (*h.split([C * H * dv, H * dv], dim=-1), None, None)
    i, j = torch.arange(W).view(W, 1), torch.arange(W).view(1, W)
    causal = (j <= i).double()
    a_p = layer.rel_bias.pos_w[N - 1 + j - i] * causal  # (W, W)
    a_t = layer.rel_bias.ts_w[time_buckets(ts)] * causal  # (2, W, W)
    want = []
    for b in range(2):
        vh = [v[b, :, hh * dv : (hh + 1) * dv] for hh in range(H)]
        sem = [F.silu(q[b, :, hh * 6 : (hh + 1) * 6] @ k[b, :, hh * 6 : (hh + 1) * 6].T) / N * causal @ vh[hh] for hh in range(H) if qk]
        av = torch.cat(sem + [a_p @ t for t in vh] + [a_t[b] @ t for t in vh], dim=-1)  # (W, C Hdv)
        want.append(x[b] + layer.o(u[b] * F.layer_norm(av, (C * H * dv,), eps=layer.eps)))
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("qk", [True, False])
def test_padding_does_not_change_live_rows_and_it_trains(qk: bool) -> None:
    m = _model(2, query_key_map=qk)
    ids, ts, lengths, _ = three_histories(T0)
    ts = torch.where(torch.arange(8) < lengths.view(-1, 1), ts, ts.gather(1, (lengths - 1).view(-1, 1)))
    full = m.encode(ids, ts, lengths)
    for b in range(3):
        L = int(lengths[b])
        one = m.encode(ids[b : b + 1, :L], ts[b : b + 1, :L], lengths[b : b + 1])
        torch.testing.assert_close(one[0], full[b, :L], rtol=1e-5, atol=1e-6)
        assert not full[b, L:].any()
    m.train()
    m.encode(ids, ts, lengths).square().sum().backward()  # the gradient reaches both bias tables through their channels
    assert all(layer.rel_bias.pos_w.grad.abs().sum() > 0 and layer.rel_bias.ts_w.grad.abs().sum() > 0 for layer in m.layers)


@pytest.mark.parametrize("qk", [True, False])
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_generation_paths_agree(strategy: str, qk: bool) -> None:
    m = _model(3, query_key_map=qk)
    ids, ts, lengths, req = three_histories(T0)

    def ex():
        return exclusion_mask(40, 3, ids, lengths)

    kw = dict(request_time=req, strategy=strategy, beam_width=3)
    cached = generate(m, ids, ts, lengths, 4, exclude=ex(), **kw)
    if strategy == "greedy":
        again = generate_recompute(m, ids, ts, lengths, 4, request_time=req, exclude=ex())
        assert torch.equal(cached.items, again.items)
        torch.testing.assert_close(cached.scores, again.scores, rtol=1e-5, atol=1e-5)
    served = Engine(m, buckets=(8,), max_batch=8, k_max=4).generate(ids, ts, lengths, 4, exclude=ex(), **kw)
    assert torch.equal(served.items, cached.items)
    torch.testing.assert_close(served.scores, cached.scores, rtol=1e-5, atol=1e-5)


def test_int8_keeps_the_outputs_close() -> None:
    m = _model(4)
    ids, ts, lengths, _ = three_histories(T0)
    want = m.encode(ids, ts, lengths)
    got = quantize_model_int8(m, embeddings="fp32").encode(ids, ts, lengths)
    assert (got - want).abs().max() < 0.05  # per-channel INT8 weights on unit-norm outputs


def test_the_report_names_the_option() -> None:
    from hstu.report.summary import _block

    want = "FuXi-alpha block (semantic, position and time channels) + SwiGLU FFN stage (hidden 50)"
    assert _block({"max_seq_len": 20, "num_items": 9, "multi_channel": True, "ffn_hidden": 50}) == want


def test_bad_combinations_are_refused() -> None:
    with pytest.raises(ValueError, match="multi_channel = true needs"):
        _cfg(use_position_bias=False, use_time_bias=False).validate()
    with pytest.raises(ValueError, match="HSTU block options"):
        ModelConfig(num_items=9, architecture="sasrec", multi_channel=True).validate()


def test_train_and_eval_a_multi_channel_run(tmp_path) -> None:
    """`hstu train` with ``[model] multi_channel = true`` saves it; the run reloads for `hstu eval` and scores as it trained."""
    import json
    import subprocess
    import sys

    from conftest import tiny_csv_flags

    run = tmp_path / "run"
    flags = tiny_csv_flags(tmp_path, model={"multi_channel": "true"}, train={"epochs": 2})

    def ok(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "hstu", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    ok("train", *flags, "--threads", "1", "--quiet", "--out", str(run))
    assert json.loads((run / "config.json").read_text())["model"]["multi_channel"] is True
    got = json.loads(ok("eval", "--run", str(run), "--json"))
    want = json.loads((run / "metrics.json").read_text())["test"]
    assert {k: got[k] for k in want} == pytest.approx(want, abs=1e-9)
