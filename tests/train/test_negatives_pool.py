"""Per-position negatives from a batch pool (hstu.train.losses.draw_pool / pool_softmax_loss, TrainConfig.negatives_pool)
and the recipe a run states (metrics.json ``recipe``, the log's recipe line, the hstu train flags).

The loss is checked against a float64 loop over positions written here from the definition: position p
predicts ids[b, t+1] from row (b, t); its candidates are the target and the M items pool_ids[cols[p]], a
negative equal to the target dropped; loss = mean over p of logsumexp(logits / tau) - pos / tau, logits
being cosines of the L2-normalised rows.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_csv_flags

from hstu.config import TrainConfig
from hstu.train import losses as L
from hstu.train.recipe import recipe, recipe_text

TAU = 0.05


def _batch(B=3, W=7, d=5, I=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.Embedding(I + 1, d).double()
    with torch.no_grad():
        emb.weight.copy_(torch.randn(I + 1, d, generator=g, dtype=torch.float64))
    out = torch.nn.functional.normalize(torch.randn(B, W, d, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    lengths = torch.tensor([W, 4, 1][:B])  # a sequence without supervised positions too
    ids = torch.randint(1, I + 1, (B, W), generator=g) * (torch.arange(W) < lengths.view(B, 1))
    return emb, out, ids, lengths


def _loop_loss(out, ids, lengths, emb, pool_ids, cols) -> torch.Tensor:
    """The definition, one position at a time (float64)."""
    terms, p = [], 0
    for b in range(out.shape[0]):
        for t in range(int(lengths[b]) - 1):
            q = out[b, t]  # the encoder rows come L2-normalised (HSTUModel.encode)
            tgt = int(ids[b, t + 1])
            e = emb.weight[tgt]
            logits = [torch.dot(q, e / e.norm()) / TAU]
            for c in cols[p].tolist():
                n = int(pool_ids[c])
                if n != tgt:
                    en = emb.weight[n]
                    logits.append(torch.dot(q, en / en.norm()) / TAU)
            z = torch.stack(logits)
            terms.append(torch.logsumexp(z, 0) - z[0])
            p += 1
    assert p == cols.shape[0]
    return torch.stack(terms).mean()


@pytest.mark.parametrize("pool", [5, 13, 40])
def test_pool_loss_and_gradients_equal_a_float64_loop(pool) -> None:
    """sampled_softmax_loss(pool=K) = the per-position loop on the same draw (K < I, K = I, K > I: clipped to I),
    and so are the gradients of the encoder rows and of the item table."""
    emb, out, ids, lengths = _batch()
    M, I = 6, 13
    loss, n = L.sampled_softmax_loss(
        out, ids, lengths, emb, num_negatives=M, temperature=TAU, num_items=I, pool=pool, generator=torch.Generator().manual_seed(7)
    )
    assert n == 6 + 3
    pool_ids, cols = L.draw_pool(n, pool=pool, num_negatives=M, num_items=I, generator=torch.Generator().manual_seed(7))
    assert pool_ids.shape == (min(pool, I),) and cols.shape == (n, M)
    loss.backward()
    got = (out.grad.clone(), emb.weight.grad.clone())
    out.grad, emb.weight.grad = None, None
    want = _loop_loss(out, ids, lengths, emb, pool_ids, cols)
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[0], out.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], emb.weight.grad, rtol=1e-10, atol=1e-12)
    assert got[0].abs().sum() > 0 and got[1][pool_ids].abs().sum() > 0  # gradients reach the rows and the pool's items


def test_draw_pool_ids_are_distinct_and_negatives_uniform() -> None:
    """The pool holds min(K, I) distinct ids in 1..I; over many batches each item is a negative equally often
    (the reference's marginal, uniform over 1..I): every count within 5 standard deviations of the mean."""
    I, K, M, P = 10, 4, 8, 50
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(I + 1)
    for _ in range(400):
        ids, cols = L.draw_pool(P, pool=K, num_negatives=M, num_items=I, generator=g)
        assert len(set(ids.tolist())) == K and int(ids.min()) >= 1 and int(ids.max()) <= I
        assert int(cols.min()) >= 0 and int(cols.max()) < K
        counts += torch.bincount(ids[cols].flatten(), minlength=I + 1).double()
    n = 400 * P * M
    assert counts[0] == 0
    sd = math.sqrt(n * (1 / I) * (1 - 1 / I))
    assert (counts[1:] - n / I).abs().max() < 5 * sd * math.sqrt(K)  # draws within a batch share its pool: variance x <= K
    whole = L.draw_pool(3, pool=I, num_negatives=2, num_items=I, generator=g)[0]
    assert sorted(whole.tolist()) == list(range(1, I + 1))  # K = I: the pool is every item
    with pytest.raises(ValueError, match="pool must be >= 1"):
        L.draw_pool(3, pool=0, num_negatives=2, num_items=I)


def test_pool_masks_negatives_equal_to_the_target() -> None:
    """One item: every negative is the target and is masked, so only the positive remains (loss 0, finite)."""
    emb, out, _, _ = _batch(B=1, W=4, I=1)
    ids, lengths = torch.tensor([[1, 1, 1, 1]]), torch.tensor([4])
    loss, n = L.sampled_softmax_loss(out, ids, lengths, emb, num_negatives=5, temperature=TAU, num_items=1, pool=8)
    assert n == 3 and float(loss.detach()) == pytest.approx(0.0, abs=1e-12)


def test_pool_draws_are_seeded_and_errors_are_clear() -> None:
    emb, out, ids, lengths = _batch()
    kw = dict(num_negatives=6, temperature=TAU, num_items=13, pool=7)

    def f(seed):
        return float(L.sampled_softmax_loss(out, ids, lengths, emb, generator=torch.Generator().manual_seed(seed), **kw)[0].detach())

    assert f(3) == f(3) and f(3) != f(4)
    with pytest.raises(ValueError, match="pre-drawn negatives"):
        L.sampled_softmax_loss(out, ids, lengths, emb, neg=torch.ones(3, 6, 6, dtype=torch.long), **kw)
    model = torch.nn.Module()
    model.repeat = object()
    with pytest.raises(ValueError, match="negatives_pool is not supported with a repeat head"):
        L.training_loss(model, out, ids, lengths, None, TrainConfig(negatives_pool=7))
    model.repeat = None
    with pytest.raises(ValueError, match="not supported by the distributed trainer"):
        L.training_loss(model, out, ids, lengths, None, TrainConfig(negatives_pool=7), neg=torch.ones(3, 6, 6, dtype=torch.long), chunk=1)
    with pytest.raises(ValueError, match="negatives_pool must be >= 0"):
        TrainConfig(negatives_pool=-1).validate()


def test_training_loss_uses_the_pool_of_the_config() -> None:
    emb, out, ids, lengths = _batch()
    model = torch.nn.Module()
    model.item_emb, model.repeat, model.action_head = emb, None, None
    model.cfg = type("Cfg", (), {"num_items": 13, "temperature": TAU})()
    got, n = L.training_loss(
        model, out, ids, lengths, None, TrainConfig(num_negatives=6, negatives_pool=7), generator=torch.Generator().manual_seed(2)
    )
    pool_ids, cols = L.draw_pool(n, pool=7, num_negatives=6, num_items=13, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(got.detach(), _loop_loss(out, ids, lengths, emb, pool_ids, cols).detach(), rtol=1e-12, atol=1e-12)


def test_recipe_is_stated() -> None:
    assert recipe(TrainConfig(negatives_pool=0, negatives_chunk=16, length_pool=50, packing="off")) == {
        "negatives": "chunked",
        "num_negatives": 128,
        "negatives_chunk": 16,
        "negatives_pool": 0,
        "batching": "length-bucketed",
        "length_pool": 50,
        "loss_divisor": "batch",
        "packing": "off",
        "table_optimizer": "adamw",
        "table_learning_rate": TrainConfig().learning_rate,  # AdamW trains the table with the rest
        "lr_decay": {"patience": 3, "factor": 0.5, "scope": "all parameters"},
        "lr_warmup_steps": 0,
        "in_batch_negatives": 0,
    }
    r = recipe(TrainConfig(negatives_pool=512, length_pool=1))
    assert (r["negatives"], r["negatives_pool"], r["batching"]) == ("pool", 512, "random")
    assert recipe(TrainConfig(negatives_pool=512), num_items=40)["negatives_pool"] == 40  # draw_pool's min(pool, I)
    assert "from 40 distinct items" in recipe_text(TrainConfig(negatives_pool=512), num_items=40)
    assert recipe(TrainConfig(negatives_pool=0, negatives_chunk=1))["negatives"] == "per-position"
    assert recipe_text(TrainConfig(negatives_pool=0, negatives_chunk=4, num_negatives=9, length_pool=3)) == (
        "negatives chunked (9 shared by runs of 4 positions), batching length-bucketed (pools of 3 batches), loss divisor batch, "
        "item table adamw (lr 0.001), lr x 0.5 after 3 epochs without a better valid NDCG@10"
    )
    assert recipe_text(TrainConfig(lr_decay_patience=0)).endswith(", constant lr")


def test_hstu_train_flags_set_the_recipe_and_metrics_json_records_it(tmp_path) -> None:
    """--negatives-pool / --length-pool / --threads / --loss-divisor reach config.json's train table;
    metrics.json and the log state the recipe."""
    flags = tiny_csv_flags(tmp_path, train={"epochs": 1}) + [
        "--negatives-pool",
        "12",
        "--length-pool",
        "1",
        "--threads",
        "1",
        "--loss-divisor",
        "epoch",
    ]
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "hstu", "train", *flags, "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    train = json.loads((out / "config.json").read_text())["train"]
    assert (train["negatives_pool"], train["length_pool"], train["num_threads"], train["loss_divisor"]) == (12, 1, 1, "epoch")
    rec = json.loads((out / "metrics.json").read_text())["recipe"]
    assert rec == {
        "negatives": "pool",
        "num_negatives": 4,
        "negatives_chunk": None,  # unused by the pool scheme
        "negatives_pool": 12,
        "batching": "random",
        "length_pool": 1,
        "loss_divisor": "epoch",
        "packing": "pack",  # the default "auto", resolved: this run can pack
        "table_optimizer": "adamw",
        "table_learning_rate": train["learning_rate"],
        "lr_decay": {"patience": 3, "factor": 0.5, "scope": "all parameters"},
        "lr_warmup_steps": 0,
        "in_batch_negatives": 0,
    }
    line = "recipe: negatives pool (4 per position from 12 distinct items per batch), batching random, packed rows, loss divisor epoch"
    assert line in r.stderr
    assert np.isfinite(json.loads((out / "metrics.json").read_text())["test"]["HR@10"])


def test_loss_weights_give_every_position_of_the_epoch_the_same_weight() -> None:
    """ "epoch": batch b's mean loss is scaled by P_b / mean P (P_b = sum of its lengths - 1), so the summed
    position losses share one divisor; "batch" leaves the means as they are. By hand: P = 6 and 2, mean 4."""
    from hstu.train.loop import loss_weights

    lengths = np.array([4, 3, 2, 2, 1])  # positions 3, 2, 1, 1, 0
    batches = [np.array([0, 1, 2]), np.array([3, 4, 2])]  # P_b = 6, 2
    assert loss_weights(batches, lengths, "batch") == [1.0, 1.0]
    assert loss_weights(batches, lengths, "epoch") == [1.5, 0.5]
    with pytest.raises(ValueError, match="loss_divisor must be 'batch' or 'epoch'"):
        TrainConfig(loss_divisor="sum").validate()
