"""``[model] query_key_map = false`` (issue 20, Part B: FuXi-beta's attention without the query-key map):
A = SiLU(rab) / n. Checked against a float64 hand computation of one block, against the stock layer whose
Q and K rows of W_uvqk are zero (SiLU(0) = 0, a second parameterisation of the same function), and on the
generation paths: KV-cached generation equals recompute, and the serving engine gives the same items."""

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

T0 = 978_300_000


def _cfg(qk: bool, **kw) -> ModelConfig:
    base = dict(num_items=40, max_seq_len=10, max_output_len=4, embedding_dim=12, num_blocks=2, num_heads=2, d_qk=6, d_v=6, dropout=0.0)
    return ModelConfig(**{**base, **kw}, query_key_map=qk)


def _pair(seed: int = 0) -> tuple[HSTUModel, HSTUModel]:
    """(no-qk model, stock model with its Q and K projections zero), the same function by construction."""
    torch.manual_seed(seed)
    no_qk = HSTUModel(_cfg(False)).eval()
    with torch.no_grad():
        for layer in no_qk.layers:
            layer.rel_bias.ts_w.normal_(0, 0.5)
            layer.rel_bias.pos_w.normal_(0, 0.5)
    stock = HSTUModel(_cfg(True)).eval()
    state = stock.state_dict()
    for name, w in no_qk.state_dict().items():
        if name.endswith("uvqk.weight"):
            state[name] = torch.cat([w, torch.zeros(state[name].shape[0] - w.shape[0], w.shape[1])])  # Q, K rows 0
        else:
            state[name] = w
    stock.load_state_dict(state)
    return no_qk, stock


def test_the_projection_drops_q_and_k() -> None:
    no_qk, stock = _pair()
    for a, b in zip(no_qk.layers, stock.layers):
        assert a.uvqk.weight.shape == (2 * 2 * 6, 12) and b.uvqk.weight.shape == (2 * 2 * (6 + 6), 12)
    assert sum(p.numel() for p in stock.parameters()) - sum(p.numel() for p in no_qk.parameters()) == 2 * (2 * 2 * 6 * 12)


def test_one_block_equals_a_float64_hand_computation() -> None:
    """y = x + W_o(U ⊙ LN(A V)), A[i, j] = SiLU(pos_w[N-1+j-i] + ts_w[bucket(t[i+1] - t[j])]) / N for j <= i."""
    torch.manual_seed(1)
    m = HSTUModel(_cfg(False, num_blocks=1, num_heads=1)).eval().double()
    layer = m.layers[0]
    with torch.no_grad():
        layer.rel_bias.ts_w.normal_(0, 0.5)
        layer.rel_bias.pos_w.normal_(0, 0.5)
    W, N, d = 5, m.cfg.width, 12
    x = torch.randn(1, W, d, dtype=torch.float64)
    ts = T0 + torch.tensor([[0, 30, 400, 5000, 90000]])
    meta = m.attention_meta(ts, torch.ones(1, W, 1, dtype=torch.float64))
    got = layer(x, meta)
    h = F.silu(F.layer_norm(x, (d,), eps=layer.eps) @ layer.uvqk.weight.T)
    u, v = h[..., :6], h[..., 6:]
    i, j = torch.arange(W).view(W, 1), torch.arange(W).view(1, W)
    rab = layer.rel_bias.pos_w[N - 1 + j - i] + layer.rel_bias.ts_w[time_buckets(ts)[0]]
    a = F.silu(rab) / N * (j <= i)
    want = x + layer.o(u * F.layer_norm(a @ v[0], (6,), eps=layer.eps))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_encoder_equals_the_stock_model_with_zero_q_and_k() -> None:
    no_qk, stock = _pair(2)
    ids, ts, lengths, _ = three_histories(T0)
    torch.testing.assert_close(no_qk.encode(ids, ts, lengths), stock.encode(ids, ts, lengths), rtol=1e-5, atol=1e-6)
    no_qk.train()
    no_qk.encode(ids, ts, lengths).square().sum().backward()  # trains: the gradient reaches W_uvqk and the bias tables
    assert all(layer.uvqk.weight.grad.abs().sum() > 0 and layer.rel_bias.pos_w.grad.abs().sum() > 0 for layer in no_qk.layers)


def test_generation_paths_agree() -> None:
    no_qk, stock = _pair(3)
    ids, ts, lengths, req = three_histories(T0)

    def ex():  # the history exclusion, fresh per call (generation marks its own items in it)
        return exclusion_mask(40, 3, ids, lengths)

    cached = generate(no_qk, ids, ts, lengths, 4, request_time=req, exclude=ex())
    again = generate_recompute(no_qk, ids, ts, lengths, 4, request_time=req, exclude=ex())
    zero_qk = generate(stock, ids, ts, lengths, 4, request_time=req, exclude=ex())
    assert torch.equal(cached.items, again.items) and torch.equal(cached.items, zero_qk.items)
    torch.testing.assert_close(cached.scores, again.scores, rtol=1e-5, atol=1e-5)
    served = Engine(no_qk, buckets=(8,), max_batch=4, k_max=4).generate(ids, ts, lengths, 4, request_time=req, exclude=ex())
    assert torch.equal(served.items, cached.items)


def test_train_quantize_and_eval_a_run_without_the_query_key_map(tmp_path) -> None:
    """`hstu train` with ``[model] query_key_map = false`` saves it; the run reloads for `hstu eval`, and its
    INT8 copy (`hstu quantize`, the projection of U and V only) evaluates to metrics near the float run's."""
    import json
    import subprocess
    import sys

    from conftest import tiny_csv_flags

    run, q = tmp_path / "run", tmp_path / "run_q"
    hstu = [sys.executable, "-m", "hstu"]
    flags = tiny_csv_flags(tmp_path, model={"query_key_map": "false"}, train={"epochs": 2})

    def ok(*args: str) -> str:
        r = subprocess.run([*hstu, *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    ok("train", *flags, "--threads", "1", "--quiet", "--out", str(run))
    assert json.loads((run / "config.json").read_text())["model"]["query_key_map"] is False
    ok("quantize", "--run", str(run), "--scheme", "int8", "--out", str(q))
    fp, i8 = (json.loads(ok("eval", "--run", str(r), "--json")) for r in (run, q))
    want = json.loads((run / "metrics.json").read_text())["test"]
    assert {k: fp[k] for k in want} == pytest.approx(want, abs=1e-9)  # the reloaded run scores as it trained
    assert abs(fp["NDCG@10"] - i8["NDCG@10"]) < 0.05


def test_the_report_names_the_block() -> None:
    from hstu.report.summary import _block

    m = {"max_seq_len": 20, "num_items": 9}  # config.json's model table; a run saved before the block fields lacks them
    want = "HSTU block without the query-key map (A = SiLU(rab) / n) + SwiGLU FFN stage (hidden 200)"
    assert _block({**m, "query_key_map": False, "ffn_hidden": 200}) == want
    assert _block({**m, "query_key_map": True, "ffn_hidden": 0}) == _block(m) == "HSTU block"
    assert _block({**m, "architecture": "sasrec"}) == "—"


def test_a_config_model_table_applies_over_the_preset(tmp_path) -> None:
    """`hstu train --preset large --config F` with F's [model] query_key_map = false trains the large sizes without
    the query-key map (the table's fields over the preset's values); without --preset, over small's."""
    import argparse

    from hstu.config import model_config_from_preset
    from hstu.train.cli import _model_cfg

    f = tmp_path / "f.toml"
    f.write_text("[model]\nquery_key_map = false\nffn_hidden = 8\n[train]\nepochs = 3\n")
    for preset in ("large", None):
        mcfg, tcfg = _model_cfg(argparse.Namespace(config=str(f), preset=preset, arch=None))
        want = model_config_from_preset(preset or "small", query_key_map=False, ffn_hidden=8)
        assert mcfg == want and tcfg.epochs == 3
    assert want.num_blocks == 2 and model_config_from_preset("large").num_blocks == 8


def test_preset_and_config_parse_together_and_bad_combinations_are_refused(tmp_path) -> None:
    from hstu.cli import build_parser
    from hstu.train.cli import _model_cfg

    f = tmp_path / "f.toml"
    f.write_text("[model]\nquery_key_map = false\n")
    args = build_parser().parse_args(["train", "--preset", "large", "--config", str(f), "--out", str(tmp_path / "r")])
    mcfg, _ = _model_cfg(args)
    assert (mcfg.num_blocks, mcfg.query_key_map) == (8, False)
    with pytest.raises(ValueError, match="needs use_position_bias or use_time_bias"):
        _cfg(False, use_position_bias=False, use_time_bias=False).validate()
    for field, named in (({"query_key_map": False}, "query_key_map = false"), ({"ffn_hidden": 4}, "ffn_hidden = 4")):
        bad = ModelConfig(num_items=9, architecture="sasrec", **field)  # only the option set is named (all three were)
        with pytest.raises(ValueError, match=rf"^ModelConfig\.{named}: HSTU block options; architecture 'sasrec' has none of them$"):
            bad.validate()


def test_a_dropped_preset_multi_channel_is_logged(tmp_path, caplog) -> None:
    """The small / large presets train the multi-channel block; a [model] table or --arch that it cannot go with
    gives the HSTU block (or SASRec) and says so once; the preset alone, or prod (HSTU block already), says nothing.
    Without the query-key map the preset keeps its channels (FuXi-beta's attention-free block), silently."""
    import argparse
    import logging

    from hstu.train.cli import _model_cfg

    f, g = tmp_path / "f.toml", tmp_path / "g.toml"
    f.write_text("[model]\nuse_position_bias = false\nuse_time_bias = false\n")
    g.write_text("[model]\nquery_key_map = false\n")
    cases = [(str(f), "large", None, False, True), (None, None, "sasrec", False, True), (None, "large", None, True, False)]
    cases += [(None, "prod", None, False, False), (str(g), "large", None, True, False), (str(f), "small", None, False, True)]
    for config, preset, arch, mc, logged in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hstu"):
            mcfg, _ = _model_cfg(argparse.Namespace(config=config, preset=preset, arch=arch))
        assert mcfg.multi_channel is mc and mcfg.query_key_map is (config != str(g))
        msgs = [r.getMessage() for r in caplog.records if "multi-channel" in r.getMessage()]
        assert len(msgs) == int(logged), (preset, arch, msgs)
        if logged:
            said = preset or "small (the default)"
            assert f"--preset {said}: multi_channel off (the multi-channel block" in msgs[0]
