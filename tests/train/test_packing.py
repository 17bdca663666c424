"""Packed training rows (TrainConfig.packing "pack", hstu.data.batching.packed_train_batch): several users'
sequences share a row of width max_seq_len, told apart by segment ids (AttentionMeta.segments).

The independent reference is the padded path on the same users: a padded batch of them in the packed
batch's user order draws the same pool negatives in the same order (both walk the supervised positions
row-major), so loss and every gradient must agree to float64 round-off; and each user's output rows in a
packed row must equal that user's rows encoded alone. Data: the first users of ML-1M (real lengths).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_csv_flags

from hstu.config import ModelConfig, TrainConfig
from hstu.data import load_dataset, make_split, train_batch
from hstu.data.batching import pack_rows, packed_train_batch
from hstu.data.prepare import subset_users
from hstu.model import kernels as K
from hstu.model.hstu import build_hstu
from hstu.train.loop import LocalStrategy
from hstu.train.losses import training_loss

MSL = 48  # ML-1M users have >= 18 training events (clean protocol): rows of 48 hold 1-2 of them


@functools.cache
def _slice(data_dir):
    log_ = subset_users(load_dataset("ml-1m", data_dir), 60)
    return log_, make_split(log_, "clean")


@pytest.fixture
def ml1m_slice(ml1m_dir):
    return _slice(ml1m_dir)


def _model(log_, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_items=log_.num_items, max_seq_len=MSL, embedding_dim=8, d_qk=4, d_v=4, num_blocks=2, num_heads=2, dropout=0.0, **kw
    )
    return build_hstu(cfg).double().train()


def _users(log_, split) -> np.ndarray:
    lengths = np.minimum(split.train_end - log_.offsets[:-1], MSL)
    users = np.nonzero(lengths >= 2)[0][:24]
    assert lengths[users].min() < MSL // 2 < lengths[users].max()  # short and long users: packing has work
    return users


def test_pack_rows_is_first_fit_decreasing_and_keeps_every_sequence() -> None:
    lengths = np.array([3, 7, 2, 5, 1, 4])
    rows = pack_rows(lengths, 8)
    # by hand, longest first: 7 -> row 0 (1 left); 5 -> row 1 (3); 4 -> row 2 (4); 3 -> row 1 (0); 2 -> row 2 (2); 1 -> row 0
    assert rows == [[1, 4], [3, 0], [5, 2]]
    assert sorted(i for r in rows for i in r) == list(range(6)) and all(lengths[r].sum() <= 8 for r in rows)
    with pytest.raises(ValueError, match=r"lengths must be in 1\.\.8"):
        pack_rows(np.array([9]), 8)


def test_packed_batch_holds_each_users_events_once(ml1m_slice) -> None:
    log_, split = ml1m_slice
    users = _users(log_, split)
    p = packed_train_batch(log_, split, users, MSL)
    assert p.ids.shape[0] < len(users) and p.ids.shape[1] == MSL and sorted(p.users.tolist()) == sorted(users.tolist())
    pad = train_batch(log_, split, p.users.numpy(), MSL)
    for s in range(len(users)):
        cols = p.segments == s
        L = int(pad.lengths[s])
        assert int(cols.sum()) == L and cols.any(1).sum() == 1  # one row, contiguous by construction
        assert torch.equal(p.ids[cols], pad.ids[s, :L]) and torch.equal(p.timestamps[cols], pad.timestamps[s, :L])
    assert torch.equal(p.lengths, (p.segments >= 0).sum(1)) and int(p.lengths.sum()) == int(pad.lengths.sum())


@pytest.mark.parametrize("norm,multi_channel", [("fixed", False), ("causal", False), ("fixed", True)])
def test_packed_loss_and_gradients_equal_the_padded_batch(ml1m_slice, norm, multi_channel) -> None:
    log_, split = ml1m_slice
    users = _users(log_, split)
    tcfg = TrainConfig(num_negatives=16, negatives_pool=200, packing="pack")
    grads, losses = [], []
    for packed in (True, False):
        model = _model(log_, attention_norm=norm, multi_channel=multi_channel)
        p = packed_train_batch(log_, split, users, MSL)
        b = p if packed else train_batch(log_, split, p.users.numpy(), MSL)  # the same users in the packed order
        out = model.encode(b.ids, b.timestamps, b.lengths, actions=b.actions, categories=b.categories, segments=b.segments)
        gen = torch.Generator().manual_seed(3)
        loss, n = training_loss(model, out, b.ids, b.lengths, b.actions, tcfg, generator=gen, segments=b.segments)
        loss.backward()
        losses.append((loss.item(), n))
        grads.append({k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None})
    (lp, n_p), (lu, n_u) = losses
    assert n_p == n_u == int((train_batch(log_, split, users, MSL).lengths - 1).sum())
    assert lp == pytest.approx(lu, rel=1e-12, abs=1e-12)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-9, atol=1e-12, msg=k)


@pytest.mark.parametrize("time_bias,multi_channel", [(True, False), (False, False), (True, True)])
def test_a_packed_rows_outputs_equal_each_user_alone(ml1m_slice, time_bias, multi_channel) -> None:
    """Each user's rows 0..L-2 (all rows without the time bias): the last row's query time is the next
    user's first event in a packed row (time bias only), a row that predicts nothing and only it attends."""
    log_, split = ml1m_slice
    users = _users(log_, split)[:10]
    model = _model(log_, use_time_bias=time_bias, multi_channel=multi_channel).eval()
    p = packed_train_batch(log_, split, users, MSL)
    with torch.no_grad():
        out = model.encode(p.ids, p.timestamps, p.lengths, segments=p.segments)  # (R, W, d)
        for s, u in enumerate(p.users.numpy()):
            alone = train_batch(log_, split, np.array([u]), MSL)
            ref = model.encode(alone.ids, alone.timestamps, alone.lengths)[0]  # (L, d)
            got = out[p.segments == s]  # (L, d)
            keep = len(ref) if not time_bias else len(ref) - 1
            torch.testing.assert_close(got[:keep], ref[:keep], rtol=1e-10, atol=1e-12)


def test_packing_is_refused_where_it_cannot_run(ml1m_slice) -> None:
    log_, split = ml1m_slice
    model = _model(log_)
    model.kernels = K.KernelSet("no-segments", K.REFERENCE.uvqk, K.REFERENCE.time_buckets, K.REFERENCE.attention, K.REFERENCE.ln_mul)
    p = packed_train_batch(log_, split, _users(log_, split)[:6], MSL)
    with pytest.raises(ValueError, match=r"\[train\] packing"):
        model.encode(p.ids, p.timestamps, p.lengths, segments=p.segments)
    assert not K.TRITON.segments and not K.NPU.segments and K.REFERENCE.segments
    tcfg = TrainConfig(packing="pack")
    for mcfg in (ModelConfig(num_items=9, architecture="sasrec"), ModelConfig(num_items=9, repeat_window=4)):
        with pytest.raises(ValueError, match=r"\[train\] packing"):
            LocalStrategy().check_setup(mcfg, log_, split, tcfg)
    with pytest.raises(ValueError, match=r"\[train\] packing"):
        TrainConfig(packing="jagged").validate()


def test_hstu_train_packing_flag_is_stated_in_the_recipe(tmp_path) -> None:
    flags = tiny_csv_flags(tmp_path, train={"epochs": 1}) + ["--packing", "pack", "--length-pool", "1", "--threads", "1"]
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "hstu", "train", *flags, "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["train"]["packing"] == "pack"
    assert json.loads((out / "metrics.json").read_text())["recipe"]["packing"] == "pack"
    assert "batching random, packed rows, loss divisor batch" in r.stderr


def test_a_step_of_auto_is_the_packed_step_where_it_can_pack(ml1m_slice) -> None:
    """LocalStrategy.step on a TrainConfig left at "auto" (callers of train_one_epoch outside fit): the
    packed step, to the bit, on the CPU's reference kernels; the padded one where the model cannot pack."""
    log_, split = ml1m_slice
    users, st = _users(log_, split), LocalStrategy()
    st.start("cpu", TrainConfig())

    def loss(model, packing: str) -> float:
        tcfg = TrainConfig(num_negatives=8, packing=packing)
        return st.step(model, log_, split, users, tcfg, torch.Generator().manual_seed(5))[0].detach().item()

    model = _model(log_)
    assert loss(model, "auto") == loss(model, "pack") != loss(model, "off")  # chunk 1: the draws follow the layout
    sasrec = _model(log_, architecture="sasrec")
    assert loss(sasrec, "auto") == loss(sasrec, "off")
