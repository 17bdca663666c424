"""Multi-action training on a small real Taobao slice: the next-action head's loss falls, and a
trained run generates (item, action, category) triples."""

from __future__ import annotations

import csv
import math

import numpy as np
import torch

from hstu.config import ModelConfig, TrainConfig
from hstu.data import make_split, train_batch
from hstu.data.ecommerce import load_taobao
from hstu.data.prepare import DataSpec, model_config_for, subset_users
from hstu.model.hstu import build_hstu
from hstu.train.loop import fit
from hstu.train.losses import next_action_loss, sampled_softmax_loss


def test_action_head_loss_falls_on_real_taobao_slice(taobao_csv):
    log_ = subset_users(load_taobao(taobao_csv), 40)
    split = make_split(log_, "clean")
    torch.manual_seed(0)
    cfg = model_config_for(
        log_, ModelConfig(max_seq_len=30, embedding_dim=16, num_blocks=1, num_heads=1, d_qk=16, d_v=16, dropout=0.0), use_features=True
    )
    assert cfg.num_actions == 4 and cfg.num_categories == log_.num_categories
    model = build_hstu(cfg)
    b = train_batch(log_, split, np.arange(log_.num_users), cfg.max_seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(25):
        out = model.encode(b.ids, b.timestamps, b.lengths, actions=b.actions, categories=b.categories)
        la = next_action_loss(out, b.actions, b.lengths, model.action_head)
        li, _ = sampled_softmax_loss(
            out, b.ids, b.lengths, model.item_emb, num_negatives=32, temperature=0.05, generator=gen, num_items=cfg.num_items
        )
        losses.append(la.item())
        opt.zero_grad()
        (li + 0.5 * la).backward()
        opt.step()
    # targets of the supervised positions: the action of event i + 1
    mask = torch.arange(b.ids.shape[1] - 1).view(1, -1) < (b.lengths.view(-1, 1) - 1)
    p = np.bincount(b.actions[:, 1:][mask].numpy(), minlength=5)[1:] / int(mask.sum())
    marginal = float(-(p[p > 0] * np.log(p[p > 0])).sum())  # loss of the best context-free predictor (~0.5 nats: 90 % pv)
    assert abs(losses[0] - math.log(5)) < 0.5  # near-uniform over 4 actions + padding class at init
    assert losses[-1] < 0.6 * losses[0]
    assert losses[-1] < marginal + 0.25
    assert min(losses[-5:]) < losses[0] and losses[-1] < losses[4]


def test_trained_run_generates_items_with_action_and_category(taobao_csv, tmp_path):
    from hstu.generate.recommend import History, Recommender

    cfg = ModelConfig(max_seq_len=30, embedding_dim=16, num_blocks=1, num_heads=1, d_qk=16, d_v=16)
    fit(
        tmp_path,
        cfg,
        TrainConfig(epochs=1, batch_size=16, num_negatives=16),
        DataSpec("taobao", str(taobao_csv), max_users=30),
        progress=False,
    )
    raw_category = {}
    with open(taobao_csv, newline="") as fh:
        for row in csv.reader(fh):
            raw_category[int(row[1])] = int(row[2])
    rec = Recommender.from_run(tmp_path)
    assert rec.exclude_history_default is False
    hist = History([2268318, 2333346, 2576651], [1511544070, 1511561733, 1511572885], ["pv", "pv", "cart"])
    prep = rec.prepare(hist)
    # the history's categories as the CSV gives them (dense category -> raw id through the run's id map)
    assert [rec.category_raw[c] for c in prep.categories] == [raw_category[i] for i in hist.items]
    assert prep.actions.tolist() == [rec.action_names.index(a) + 1 for a in hist.actions] and not prep.warnings
    odd = rec.prepare(History(hist.items, hist.timestamps, ["pv", "purchase", None]))  # an action the run does not know
    assert odd.actions.tolist() == [rec.action_names.index("pv") + 1, 0, 0]
    assert odd.warnings == ["unknown action(s) ['purchase'] (this run's: ['pv', 'cart', 'fav', 'buy']); those events count as no action"]
    items = rec.recommend([prep], 5)[0]
    assert len(items) == 5
    for it in items:
        assert it["action"] in ("pv", "cart", "fav", "buy")
        assert it["category"] == raw_category[it["item_id"]]
