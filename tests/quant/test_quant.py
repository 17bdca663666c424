"""hstu.quant: per-channel INT8 arithmetic, the integer Linear kernel, INT8 / BF16 models on real
data, the per-layer report, quantized checkpoints and the scheme check. Nothing here is timed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hstu.quant import QuantCheckpointError, apply_precision, load_quantized_run, save_quantized_run, select_int8_kernel, tensor_bytes
from hstu.quant.calibrate import calibration_batch, format_report, layer_report
from hstu.quant.checkpoint import quantized_state
from hstu.quant.int8 import Int8Embedding, Int8Linear, dequantize_per_channel, quantize_per_channel
from hstu.quant.int8_kernels import ONEDNN_MIN_OUTPUTS, _probe_onednn, packed_linear, prepack
from hstu.runs import load_run

ML1M = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ml-1m"
HAS_FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines


# ----- arithmetic -----------------------------------------------------------------------------


def test_per_channel_hand_example():
    w = torch.tensor([[0.5, -1.27, 0.0, 0.3], [2.54, 1.0, -0.061, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = quantize_per_channel(w)
    # row 0: s = 1.27 / 127 = 0.01 -> 0.5/0.01 = 50, -127, 0, 30
    # row 1: s = 2.54 / 127 = 0.02 -> 127, 50, -3.05 -> -3, 0
    # row 2: all zero -> scale 1, q = 0
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.tolist() == [[50, -127, 0, 30], [127, 50, -3, 0], [0, 0, 0, 0]]
    assert torch.allclose(s, torch.tensor([0.01, 0.02, 1.0]), rtol=1e-6)
    back = dequantize_per_channel(q, s)
    assert torch.allclose(back, torch.tensor([[0.5, -1.27, 0.0, 0.3], [2.54, 1.0, -0.06, 0.0], [0.0] * 4]), atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), k=st.integers(1, 17), seed=st.integers(0, 2**16), mag=st.floats(1e-4, 1e3))
def test_per_channel_error_bound(n, k, seed, mag):
    """|W - Q·s| <= s/2 per entry (round to nearest), |Q| <= 127 and the row maximum maps to ±127."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * mag
    q, s = quantize_per_channel(w)
    err = (w - q.double() * s.double()[:, None]).abs()
    assert (err <= s.double()[:, None] * (0.5 + 1e-5)).all()
    assert q.abs().max() <= 127
    assert (q.abs().amax(dim=1) == 127).all()


def test_quantize_rejects_bad_weights():
    with pytest.raises(ValueError, match="2-D float"):
        quantize_per_channel(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_per_channel(torch.tensor([[1.0, float("nan")]]))


# ----- the integer kernel -----------------------------------------------------------------------


@pytest.mark.skipif(not HAS_FBGEMM, reason="this torch build has no FBGEMM quantized engine")
def test_cpu_kernel_is_integer_gemm():
    """The CPU path is FBGEMM's integer GEMM: it equals an int64 emulation of 7-bit per-row
    activations (each row over its max |x|, scale 1/63, zero point 64) × per-channel int8 weights
    exactly (up to the float32 rescale), and differs from dequantize-then-matmul by far more than that."""
    k = select_int8_kernel("cpu")
    assert k.name in ("onednn", "fbgemm") and k.integer  # 301 x 200 outputs: below ONEDNN_MIN_OUTPUTS, FBGEMM's GEMM
    torch.manual_seed(0)
    lin = torch.nn.Linear(50, 200)
    m = Int8Linear.from_float(lin)
    x = torch.randn(7, 43, 50) * 2 + 0.3  # leading axes are flattened
    y = m(x).reshape(-1, 200).double()
    x2 = x.reshape(-1, 50)
    r = x2.abs().amax(dim=1, keepdim=True)  # (M, 1)
    xq = torch.clamp(torch.round(x2 / r * 63) + 64, 1, 127).to(torch.int64)  # 7 bits: u8 1..127
    acc = (xq - 64) @ m.weight_int8.to(torch.int64).T  # exact integer GEMM
    emulated = acc.double() / 63 * r.double() * m.weight_scale.double()[None, :] + m.bias.double()
    float_path = x2.double() @ m.dequantized_weight().double().T + m.bias.double()
    assert (y - emulated).abs().max() < 1e-5  # float32 rescale rounding only
    assert (y - float_path).abs().max() > 1e-3  # so it is not dequantize-then-matmul


@pytest.mark.parametrize("kernel", ["auto", "int_mm", "dequant"])
def test_int8_linear_within_bound_of_float64(kernel):
    """Each kernel against the float64 product with the dequantized weight; the tolerance is the
    activation rounding bound  max|y - ref| <= Δx/2 · Σ_k |Wq[n, k]|  (Δx: the activation step)."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 96)
    m = Int8Linear.from_float(lin, kernel=kernel)
    x = torch.randn(33, 64)
    ref = x.double() @ m.dequantized_weight().double().T + m.bias.double()
    y = m(x).double()
    rowsum = m.dequantized_weight().double().abs().sum(dim=1)  # (N,)
    if m.kernel.name == "qnnpack":
        scale, _ = torch._choose_qparams_per_tensor(x, False)
        bound = 0.5 * scale * rowsum[None, :] * (1 + 1e-4) + 1e-5
    elif m.kernel.name in ("fbgemm", "onednn"):
        step = x.abs().amax(dim=1).double() / 63  # per-row, 7 bits
        bound = 0.5 * step[:, None] * rowsum[None, :] * (1 + 1e-4) + 1e-5
    elif m.kernel.name == "int_mm":
        step = x.abs().amax(dim=1).double() / 127  # per-row symmetric activations
        bound = 0.5 * step[:, None] * rowsum[None, :] * (1 + 1e-4) + 1e-5
    else:
        bound = torch.full_like(ref, 1e-4)  # float32 GEMM rounding
    assert ((y - ref).abs() <= bound).all()
    assert m.kernel.integer == (m.kernel.name != "dequant")


@pytest.mark.skipif(not HAS_FBGEMM, reason="this torch build has no FBGEMM quantized engine")
def test_int8_linear_rows_do_not_depend_on_the_batch():
    """Per-row activation scales: a row's output is bit for bit the same alone, in a batch with rows 100x
    larger, or with zero padding rows (per-tensor scales moved it by an activation step)."""
    torch.manual_seed(2)
    m = Int8Linear.from_float(torch.nn.Linear(64, 96))
    x = torch.randn(5, 64)
    alone = torch.cat([m(x[i : i + 1]) for i in range(5)])
    mixed = m(torch.cat([100 * torch.randn(3, 64), x, torch.zeros(2, 64)]))
    assert torch.equal(mixed[3:8], alone) and torch.equal(mixed[8:], m.bias.expand(2, 96))


@pytest.mark.skipif(_probe_onednn() is not None, reason=f"no oneDNN INT8 kernel here: {_probe_onednn()}")
def test_onednn_kernel_equals_fbgemm_bit_for_bit_on_both_sides_of_the_switch():
    """The "onednn" kernel runs calls of >= ONEDNN_MIN_OUTPUTS outputs on oneDNN, smaller ones on FBGEMM: a
    row's result is the same bit for bit alone (FBGEMM), inside a large call (oneDNN), and under the forced
    "fbgemm" kernel; and the large call equals the int64 emulation of the 7-bit per-row recipe."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(96, 1024)
    od, fb = Int8Linear.from_float(lin, kernel="onednn"), Int8Linear.from_float(lin, kernel="fbgemm")
    M = ONEDNN_MIN_OUTPUTS // 1024 + 7  # 71 rows x 1024 outputs: oneDNN's side
    x = torch.randn(M, 96) * 3
    big, alone = od(x), torch.cat([od(x[i : i + 1]) for i in range(M)])
    assert od.kernel.name == "onednn" and od._packed.onednn is not None and od._packed.packed is not None
    assert torch.equal(big, alone) and torch.equal(big, fb(x))
    r = x.abs().amax(dim=1, keepdim=True)
    acc = (torch.clamp(torch.round(x / r * 63) + 64, 1, 127).to(torch.int64) - 64) @ od.weight_int8.to(torch.int64).T
    emulated = acc.double() / 63 * r.double() * od.weight_scale.double()[None, :] + od.bias.double()
    assert (big.double() - emulated).abs().max() < 1e-5


@pytest.mark.skipif(_probe_onednn() is not None, reason=f"no oneDNN INT8 kernel here: {_probe_onednn()}")
def test_onednn_kernel_holds_one_copy_of_a_wide_table():
    """N >= 2^16 (an item table as a Linear): every call is oneDNN's, so no FBGEMM copy is packed."""
    q, s = quantize_per_channel(torch.randn(ONEDNN_MIN_OUTPUTS, 8))
    p = prepack(q, s, "onednn")
    assert p.packed is None and p.copies == 1
    x = torch.randn(2, 8)
    ref = packed_linear(x, prepack(q, s, "fbgemm"), None)
    assert torch.equal(packed_linear(x, p, None), ref)


def test_int8_linear_has_no_float_weight():
    m = Int8Linear.from_float(torch.nn.Linear(8, 8, bias=False))
    assert not hasattr(m, "weight")
    with pytest.raises(AttributeError, match="call the module"):
        m.weight  # noqa: B018


def test_unknown_kernel_rejected():
    with pytest.raises(ValueError, match="valid"):
        select_int8_kernel("cpu", "cublas")
    with pytest.raises(ValueError, match="CPU only"):
        select_int8_kernel("meta", "fbgemm")


def test_other_device_falls_back_visibly():
    k = select_int8_kernel("meta")
    assert k.name == "dequant" and not k.integer and "no integer GEMM kernel" in k.reason


def test_int8_embedding_rows():
    emb = torch.nn.Embedding(5, 3, padding_idx=0)
    with torch.no_grad():
        emb.weight.copy_(torch.tensor([[0, 0, 0], [1.27, -0.5, 0.0], [0.2, 0.4, -0.8], [3, 3, 3], [-1, 0, 0.001]], dtype=torch.float32))
    q = Int8Embedding.from_float(emb)
    assert q.weight_int8[1].tolist() == [127, -50, 0] and q.weight_int8[0].tolist() == [0, 0, 0]
    ids = torch.tensor([[1, 2], [0, 4]])
    out = q(ids)
    assert out.shape == (2, 2, 3) and out.dtype == torch.float32
    s = q.weight_scale.double()
    assert ((out.double() - emb.weight.double()[ids]).abs() <= 0.5 * s[ids].unsqueeze(-1) + 1e-7).all()
    assert torch.equal(q.rows(1, 3), out[0])


# ----- models on real data ----------------------------------------------------------------------


def _tiny(tmp_path_factory, **model):
    if not (ML1M / "ratings.dat").exists():
        pytest.skip(f"{ML1M} is absent (shared data is provided beside the repo in CI and dev sessions)")
    from hstu.config import TrainConfig, model_config_from_preset
    from hstu.data.prepare import DataSpec
    from hstu.train.loop import fit

    run = tmp_path_factory.mktemp("quant") / "run"
    cfg = model_config_from_preset("small", max_seq_len=50, **model)
    fit(run, cfg, TrainConfig(epochs=1, seed=0), DataSpec("ml-1m", str(ML1M), max_users=200), progress=False)
    return run


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The small preset (its multi-channel block), 1 epoch on 200 ML-1M users."""
    return _tiny(tmp_path_factory)


@pytest.fixture(scope="session")
def hstu_block_run(tmp_path_factory):
    """The same with the paper's HSTU block (``multi_channel = false``)."""
    return _tiny(tmp_path_factory, multi_channel=False)


@pytest.fixture(scope="session")
def calib(tiny_run):
    from hstu.data.prepare import DataSpec, prepare_data
    from hstu.data.sequences import make_split
    from hstu.model.checkpoint import read_json

    spec = DataSpec(**read_json(tiny_run / "config.json")["data"])
    log_, _ = prepare_data(spec)
    return calibration_batch(log_, make_split(log_, spec.protocol), 50, num_users=64, seed=0)


def test_calibration_says_when_it_has_fewer_users_than_asked(tiny_run, caplog):
    """--calib-users above the users with a validation target calibrated on fewer without a word."""
    from hstu.data.prepare import DataSpec, prepare_data
    from hstu.data.sequences import make_split
    from hstu.model.checkpoint import read_json

    spec = DataSpec(**read_json(tiny_run / "config.json")["data"])
    log_, _ = prepare_data(spec)
    split = make_split(log_, spec.protocol)
    have = int((split.targets("valid") >= 0).sum())
    with caplog.at_level("WARNING", logger="hstu.quant.calibrate"):
        b = calibration_batch(log_, split, 50, num_users=have + 1, seed=0)
    assert b.ids.shape[0] == have and f"{have + 1} users asked, the data has {have}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hstu.quant.calibrate"):
        calibration_batch(log_, split, 50, num_users=have, seed=0)
    assert "users asked" not in caplog.text


def _float(run):
    return load_run(run, "cpu")[0]


def _users(model, b):
    with torch.inference_mode():
        return model.last_rows(model.encode(b.ids, b.timestamps, b.lengths, actions=b.actions, categories=b.categories), b.lengths)


@pytest.mark.parametrize(
    "precision,min_cos",
    [
        # INT8: weights ±s/2 per channel and 7-bit per-tensor activations in every block Linear; the
        # L2-normalised user vectors keep a cosine >= 0.995 to float (measured ~0.9999 on this run).
        ("int8", 0.995),
        # BF16: 8 significant bits in every activation and weight; measured ~0.9995.
        ("bf16", 0.99),
    ],
)
def test_quantized_model_close_to_float_on_real_data(tiny_run, calib, precision, min_cos):
    fm = _float(tiny_run)
    qm = apply_precision(copy.deepcopy(fm), precision)
    uf, uq = _users(fm, calib), _users(qm, calib)
    assert uq.dtype == torch.float32  # similarity stays in float32 for every scheme
    cos = torch.nn.functional.cosine_similarity(uf.double(), uq.double(), dim=-1)
    assert cos.min() >= min_cos
    # candidate scores e·u / T: by Cauchy-Schwarz |Δscore| <= (||Δu|| + ||Δe||) / T, where the item
    # rows e are unit vectors stored in fp16 (INT8 scheme) or bf16: ||Δe|| <= 2^-10 resp. 2^-7.
    cand = calib.ids[:, :20]
    with torch.inference_mode():
        sf, sq = fm.score_items(uf, cand), qm.score_items(uq, cand)
    de = 2.0**-10 if precision == "int8" else 2.0**-7
    bound = ((uf - uq).norm(dim=-1, keepdim=True) + de) / fm.cfg.temperature  # (B, 1)
    assert ((sf - sq).abs() <= bound).all()


def test_layer_report_and_keep_float(tiny_run, calib):
    fm = _float(tiny_run)
    qm = apply_precision(copy.deepcopy(fm), "int8", keep_float="layers.1.o")
    rep = layer_report(fm, qm, calib)
    by = {r["name"]: r for r in rep["linears"]}
    assert list(by) == ["layers.0.uvqk", "layers.0.o", "layers.1.uvqk", "layers.1.o"]
    assert by["layers.1.o"]["kind"] == "float32" and by["layers.1.o"]["max_abs_err"] == 0.0
    for name in ("layers.0.uvqk", "layers.0.o", "layers.1.uvqk"):
        r = by[name]
        # W_o of the multi-channel block: one 7-bit activation step over three channels' range (measured ~6 %)
        assert r["kind"] == "int8" and 0 < r["max_abs_err"] < (0.05 if name.endswith("uvqk") else 0.1) * r["max_abs_ref"]
        # the small preset's three channels (semantic, position, time): W_uvqk d -> U (3 x 50), V, Q, K; W_o 3 x 50 -> d
        assert r["shape"] == ([300, 50] if name.endswith("uvqk") else [50, 150])
    assert rep["users"] == 64 and len(rep["blocks"]) == 2 and rep["user_vector"]["min_cosine"] > 0.99
    assert "layers.0.uvqk" in format_report(rep)
    with pytest.raises(ValueError, match="unknown layer 'layers.7'.*valid: layers.0.uvqk"):
        apply_precision(copy.deepcopy(fm), "int8", keep_float=["layers.7"])


def test_int8_embeddings_option(tiny_run, calib):
    fm = _float(tiny_run)
    qm = apply_precision(copy.deepcopy(fm), "int8", embeddings="int8")
    assert isinstance(qm.item_emb, Int8Embedding)
    cos = torch.nn.functional.cosine_similarity(_users(fm, calib).double(), _users(qm, calib).double(), dim=-1)
    assert cos.min() > 0.99
    iv = qm.item_vectors()
    assert iv.shape == (fm.cfg.num_items + 1, fm.cfg.embedding_dim) and iv.dtype == torch.float32


def test_generate_runs_quantized(tiny_run, calib):
    from hstu.generate import generate
    from hstu.generate.decode import exclusion_mask

    fm = _float(tiny_run)
    b = calib
    B = 8
    ids, ts, lens = b.ids[:B], b.timestamps[:B], b.lengths[:B]
    rt = ts[torch.arange(B), lens]
    for precision in ("int8", "bf16"):
        qm = apply_precision(copy.deepcopy(fm), precision)
        res = generate(qm, ids, ts, lens, 3, request_time=rt, exclude=exclusion_mask(fm.cfg.num_items, B, ids, lens))
        assert res.items.shape == (B, 3) and (res.items > 0).all()
        assert res.scores.dtype == torch.float32


# ----- checkpoints ------------------------------------------------------------------------------


def test_checkpoint_round_trip_and_sizes(tiny_run, calib, tmp_path):
    fm = _float(tiny_run)
    qm = apply_precision(copy.deepcopy(fm), "int8")
    out = tmp_path / "q8"
    meta = save_quantized_run(qm, tiny_run, out, calibration={"note": "test"})
    assert not (out / "model.safetensors").exists()  # the float loader cannot pick it up by mistake
    saved = json.loads((out / "quant.json").read_text())
    assert saved["scheme"] == "int8" and saved["embeddings"] == "fp16" and saved["versions"]["torch"] == torch.__version__
    # the small preset's multi-channel block: U three channels wide (3 x 50), V, Q, K 50 each
    assert saved["layers"]["layers.0.uvqk"]["granularity"] == "per_output_channel" and saved["layers"]["layers.0.uvqk"]["shape"] == [
        300,
        50,
    ]
    lm, cfg, ids = load_quantized_run(out, "cpu", scheme="int8")
    assert cfg["quant"]["scheme"] == "int8" and ids["item_raw_ids"]
    assert isinstance(lm.layers[0].uvqk, Int8Linear)
    assert torch.equal(lm.layers[0].uvqk.weight_int8, qm.layers[0].uvqk.weight_int8)
    assert torch.equal(_users(lm, calib), _users(qm, calib))  # bit-identical after the round trip
    # dense part: int8 weights + float32 scales and biases + fp16 bias tables vs float32
    fb, qb = tensor_bytes(fm.state_dict()), tensor_bytes(quantized_state(qm))
    assert qb["dense"] <= 0.3 * fb["dense"]
    assert meta["bytes"]["file"] < 0.6 * meta["bytes"]["float_file"]
    assert load_run(out, "cpu")[0].quant_meta["scheme"] == "int8"


def test_an_interrupted_save_leaves_nothing_and_overwrite_replaces_whole(tiny_run, tmp_path, monkeypatch):
    """hstu quantize wrote its files straight into --out: an interrupt between them left a partial run
    (config.json and idmap.json, no weights) that later commands took for a run."""
    from hstu.quant import checkpoint as qc

    qm = apply_precision(copy.deepcopy(_float(tiny_run)), "int8")
    out = tmp_path / "q8"

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(qc, "save_tensors", interrupted)
        with pytest.raises(KeyboardInterrupt):
            save_quantized_run(qm, tiny_run, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither --out nor its hidden staging directory
    save_quantized_run(qm, tiny_run, out)
    (out / "stale.txt").write_text("from before")
    with monkeypatch.context() as m:
        m.setattr(qc, "save_tensors", interrupted)
        with pytest.raises(KeyboardInterrupt):
            save_quantized_run(qm, tiny_run, out, overwrite=True)
    assert (out / "stale.txt").exists() and (out / "model.quant.safetensors").exists()  # the old run kept whole
    save_quantized_run(qm, tiny_run, out, overwrite=True)
    assert not (out / "stale.txt").exists() and load_run(out, "cpu")[0].quant_meta["scheme"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q8"]


def test_wrong_scheme_refused(tiny_run, tmp_path):
    fm = _float(tiny_run)
    q8, qb = tmp_path / "q8", tmp_path / "qbf16"
    save_quantized_run(apply_precision(copy.deepcopy(fm), "int8"), tiny_run, q8)
    save_quantized_run(apply_precision(copy.deepcopy(fm), "bf16"), tiny_run, qb)
    with pytest.raises(QuantCheckpointError, match="quantized with scheme 'int8' but 'bf16' was requested"):
        load_quantized_run(q8, scheme="bf16")
    with pytest.raises(QuantCheckpointError, match="quantized with scheme 'bf16' but 'int8' was requested"):
        load_run(qb, precision="int8")
    with pytest.raises(QuantCheckpointError, match="needs the float run"):
        load_run(q8, precision="fp32")
    with pytest.raises(FileNotFoundError, match="not a quantized run"):
        load_quantized_run(tiny_run)
    assert load_quantized_run(qb, scheme="bf16")[0].pos_emb.weight.dtype == torch.bfloat16
    # quant.json edited to claim another scheme: the weights' own metadata disagrees
    meta = json.loads((q8 / "quant.json").read_text())
    meta["scheme"] = "bf16"
    (q8 / "quant.json").write_text(json.dumps(meta))
    with pytest.raises(QuantCheckpointError, match="written for scheme 'int8'"):
        load_quantized_run(q8)
    with pytest.raises(FileExistsError, match="not empty"):
        save_quantized_run(apply_precision(copy.deepcopy(fm), "int8"), tiny_run, q8)


def test_corrupt_run_files_name_the_file(tiny_run, tmp_path):
    """Truncated weights and broken JSON give a ValueError naming the file (a fresh user's report:
    raw SafetensorError / JSONDecodeError tracebacks before)."""
    import shutil

    fm = _float(tiny_run)
    q8 = tmp_path / "q8"
    save_quantized_run(apply_precision(copy.deepcopy(fm), "int8"), tiny_run, q8)
    w = q8 / "model.quant.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(QuantCheckpointError, match="model.quant.safetensors: not a readable safetensors file"):
        load_quantized_run(q8)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_run, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_run(broken)
    (broken / "config.json").write_text("{\n  'model': 1")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_run(broken)
    q2 = tmp_path / "q2"  # a trial's truncated quant.json: every command said only "Expecting property name ... (char 700)"
    save_quantized_run(apply_precision(copy.deepcopy(fm), "int8"), tiny_run, q2)
    meta = q2 / "quant.json"
    meta.write_bytes(meta.read_bytes()[:50])
    with pytest.raises(ValueError, match=r"quant.json: not valid JSON \("):
        load_run(q2)
    meta.unlink()  # without quant.json the run reads as float: its missing weights now say why
    with pytest.raises(FileNotFoundError, match=r"model.safetensors: weights not found \(model.quant.safetensors is there but not quant"):
        load_run(q2)


def test_float_run_converted_on_load(tiny_run):
    m, cfg, _ = load_run(tiny_run, "cpu", "int8")
    assert isinstance(m.layers[1].o, Int8Linear) and "quant" not in cfg
    with pytest.raises(ValueError, match="valid"):
        load_run(tiny_run, "cpu", "int4")


def test_cli_quantize(tiny_run, tmp_path, capsys):
    from hstu.cli import main

    out = tmp_path / "cli8"
    rc = main(
        ["quantize", "--run", str(tiny_run), "--scheme", "int8", "--out", str(out), "--keep-float", "layers.1", "--calib-users", "16"]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "layers.0.uvqk" in text and "kept float: layers.1.uvqk, layers.1.o" in text
    saved = json.loads((out / "quant.json").read_text())
    assert saved["quantized"] == ["layers.0.uvqk", "layers.0.o"] and saved["calibration"]["users"] == 16
    rc = main(["quantize", "--run", str(tiny_run), "--scheme", "int8", "--report-only", "--keep-float", "layers.9"])
    assert rc == 2 and "unknown layer 'layers.9'" in capsys.readouterr().err
    rc = main(["quantize", "--run", str(out), "--scheme", "int8", "--out", str(tmp_path / "again")])
    assert rc == 2 and "already quantized" in capsys.readouterr().err
    rc = main(["quantize", "--run", str(tiny_run), "--scheme", "bf16", "--kernel", "fbgemm", "--out", str(tmp_path / "b16")])
    assert rc == 2 and "--kernel apply to --scheme int8 only, not bf16" in capsys.readouterr().err  # was silently ignored
    assert main(["quantize", "--run", str(tiny_run), "--scheme", "fp16", "--no-calibrate", "--out", str(tmp_path / "f16")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]  # said "0 INT8 layers, kept float: ..." for a 16-bit scheme
    kept = json.loads((tmp_path / "f16" / "quant.json").read_text())["keep_float"]
    assert "INT8" not in line and ("the model fp16" + (f" but {', '.join(kept)} (float32)" if kept else "")) in line, line
    # a taken --out is refused before the run's data is read (it loaded the whole data set first);
    # the data directory is pointed at nothing, so reaching the data would fail differently
    (tmp_path / "afile").write_text("x")
    for taken, why in (
        (out, "directory exists and is not empty"),
        (tiny_run, "is the source run itself"),
        (tiny_run / "q8", "is inside the source run"),
        (out / "nested", f"is inside the run {out.resolve()}"),  # another (quantized) run: was accepted
        (tmp_path / "afile" / "sub", "is a file, not a directory"),
    ):
        rc = main(["quantize", "--run", str(tiny_run), "--scheme", "int8", "--out", str(taken), "--data-dir", str(tmp_path / "none")])
        assert rc == 2 and why in capsys.readouterr().err
    assert not (tiny_run / "q8").exists()
    other = tmp_path / "other"  # calibration data whose items are not the run's: refused as eval refuses it (was silent)
    other.mkdir()
    src = Path(json.loads((tiny_run / "config.json").read_text())["data"]["data_dir"])
    (other / "movies.dat").write_bytes((src / "movies.dat").read_bytes())
    (other / "ratings.dat").write_bytes(b"".join((src / "ratings.dat").read_bytes().splitlines(keepends=True)[:3000]))
    rc = main(["quantize", "--run", str(tiny_run), "--scheme", "int8", "--report-only", "--data-dir", str(other)])
    assert rc == 2 and "--data-dir: the data's" in (err := capsys.readouterr().err) and "item ids are not the run's" in err


# ----- --precision on the inference paths ------------------------------------------------------


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_engine_runs_quantized_like_model_generate(hstu_block_run, calib, precision):
    """The serving Engine calls a quantized projection's own GEMM (no float weight exists) and
    scores in float32: its greedy next-3 equal hstu.generate.generate on the same model. On the HSTU
    block: INT8's per-call activation scales move the multi-channel block's scores on this 1-epoch
    model by up to ~0.1 (its W_o input spans a wider range), which flips near-tied greedy picks
    (on the trained HSTU-large with it, INT8 moved test HR@10 / NDCG@10 by +.002 / -.0004)."""
    from hstu.generate import generate
    from hstu.generate.decode import exclusion_mask
    from hstu.generate.engine import Engine

    qm = apply_precision(_float(hstu_block_run), precision)
    b, B = calib, 8
    ids, ts, lens = b.ids[:B], b.timestamps[:B], b.lengths[:B]
    rt = ts[torch.arange(B), lens]
    excl = exclusion_mask(qm.cfg.num_items, B, ids, lens)  # history items excluded (ML-1M)
    ref = generate(qm, ids, ts, lens, 3, request_time=rt, exclude=excl.clone())
    W = int(lens.max())
    eng = Engine(qm, buckets=(W,), max_batch=B, k_max=3, graphs="eager")
    got = eng.generate(ids[:, :W], ts[:, :W], lens, 3, request_time=rt, exclude=excl.clone())
    assert got.scores.dtype == torch.float32
    assert torch.equal(got.items, ref.items)
    # INT8: activation scales are per GEMM call, and the engine's calls hold other rows (padded
    # bucket, decode steps batched differently), so scores move by a few activation steps.
    torch.testing.assert_close(got.scores, ref.scores, atol=0.05 if precision == "int8" else 0.02, rtol=0)


def test_cli_precision_on_eval_and_generate(tiny_run, tmp_path, capsys):
    from hstu.cli import main

    assert main(["eval", "--run", str(tiny_run), "--json"]) == 0
    f32 = json.loads(capsys.readouterr().out)
    assert main(["eval", "--run", str(tiny_run), "--json", "--precision", "int8"]) == 0
    i8 = json.loads(capsys.readouterr().out)
    assert f32["users"] == i8["users"] and abs(f32["HR@10"] - i8["HR@10"]) <= 0.03  # 200 users: a few ranks move
    assert (f32["precision"], i8["precision"], i8["split"]) == ("fp32", "int8", "test")  # --json names what it evaluated
    user = 1  # ML-1M user ids start at 1; the run holds the first 200 users
    assert main(["generate", "--run", str(tiny_run), "--user", str(user), "-k", "3", "--precision", "bf16", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["items"]) == 3
    q8 = tmp_path / "q8"
    save_quantized_run(apply_precision(_float(tiny_run), "int8"), tiny_run, q8)
    assert main(["eval", "--run", str(q8), "--json"]) == 0  # as saved
    assert json.loads(capsys.readouterr().out)["users"] == f32["users"]
    for run, flag, shown in ((tiny_run, [], "fp32"), (tiny_run, ["--precision", "bf16"], "bf16"), (q8, [], "int8")):
        assert main(["eval", "--run", str(run), *flag]) == 0  # the text line names the precision evaluated
        assert capsys.readouterr().out.startswith(f"test (clean, {shown}, {f32['users']} users, "), (run, flag)
    threads = torch.get_num_threads()
    try:  # --threads as train / generate / serve take it
        assert main(["eval", "--run", str(q8), "--threads", "1", "--json"]) == 0 and torch.get_num_threads() == 1
        assert json.loads(capsys.readouterr().out)["users"] == f32["users"]
    finally:
        torch.set_num_threads(threads)
    assert main(["generate", "--run", str(q8), "--user", str(user), "--precision", "bf16"]) == 2
    assert "quantized with scheme 'int8' but 'bf16' was requested" in capsys.readouterr().err


def test_serve_app_with_int8_recommender(tiny_run):
    """create_app over Recommender.from_run(..., precision="int8") answers like the recommender
    (a real uvicorn server, tests/serving.LiveServer, ready once every bucket is warm)."""
    pytest.importorskip("fastapi")
    from serving import LiveServer, post

    from hstu.config import ServeConfig
    from hstu.generate.recommend import History, Recommender
    from hstu.serve.app import ServePolicy, create_app

    rec = Recommender.from_run(tiny_run, "cpu", precision="int8")
    assert isinstance(rec.model.layers[0].uvqk, Int8Linear)
    ref = Recommender.from_run(tiny_run, "cpu", precision="int8")
    raw = [int(x) for x in json.loads((tiny_run / "idmap.json").read_text())["item_raw_ids"][1:16]]
    hist = [{"item_id": it, "timestamp": 978_300_000 + 60 * i} for i, it in enumerate(raw)]
    app = create_app(ServeConfig(buckets=[20, 50]), rec, policy=ServePolicy(cold_start="reject"))
    with LiveServer(app) as server:
        r = post(server.url, "/v1/generate", {"history": hist, "k": 3})
    assert r.status_code == 200, r.text
    want = ref.recommend([ref.prepare(History(raw, [e["timestamp"] for e in hist]))], 3)[0]
    assert [i["item_id"] for i in r.json()["items"]] == [i["item_id"] for i in want]


def test_quantize_cli_offers_every_kernel():
    """`hstu quantize --kernel` lists its choices without importing torch: they must be KERNELS."""
    from hstu.cli import build_parser
    from hstu.quant.int8_kernels import KERNELS

    sub = next(a for a in build_parser()._subparsers._group_actions if a.choices and "quantize" in a.choices)
    kernel = next(a for a in sub.choices["quantize"]._actions if a.dest == "kernel")
    assert tuple(kernel.choices) == KERNELS


@pytest.mark.parametrize("embeddings", ["fp32", "fp16"])
def test_a_hashed_tables_shards_are_stored_as_the_recorded_embeddings(embeddings):
    """A trial's finding: --embeddings fp32 on a bf16 hashed run recorded "fp32" in quant.json and left the shards bf16."""
    from hstu.config import ModelConfig
    from hstu.model import build_hstu
    from hstu.quant.int8 import quantize_model_int8

    cfg = ModelConfig(num_items=40, max_seq_len=8, embedding_dim=8, d_qk=8, d_v=8, num_blocks=1, num_heads=1)
    cfg.item_table, cfg.item_table_shards, cfg.item_table_dtype = "hashed", 2, "bf16"
    torch.manual_seed(0)
    m = build_hstu(cfg).eval()
    before = [s.detach().float().clone() for s in m.item_emb.shards]
    q = quantize_model_int8(m, embeddings=embeddings)
    want = {"fp32": torch.float32, "fp16": torch.float16}[embeddings]
    assert q.quant_meta["embeddings"] == embeddings and all(s.dtype == want for s in q.item_emb.shards)
    if embeddings == "fp32":  # bf16 -> fp32 is exact
        assert all(torch.equal(a, s) for a, s in zip(before, q.item_emb.shards))
