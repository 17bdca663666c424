"""Evaluation slices: hand-worked macro-F1 and bootstrap cases, per-user collection equal to the
standard evaluation, cold-start truncation equal to a direct encode of the truncated history."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from hstu.config import ModelConfig
from hstu.data.sequences import EventLog, make_split
from hstu.model.hstu import build_hstu
from hstu.train.baselines import make_baseline, training_counts
from hstu.train.evaluate import evaluate_ranks
from hstu.train.metrics import long_tail_coverage, shannon_entropy
from hstu.train.slices import (
    BaselineScorer,
    ModelScorer,
    bootstrap_weights,
    ci_entropy_jackknife,
    ci_mean,
    collect,
    macro_f1,
    ndcgs,
    paired_comparison,
    slice_report,
    tail_flags,
)


def test_macro_f1_hand_case():
    y = np.array([1, 1, 1, 2, 2, 3])
    p = np.array([1, 1, 2, 2, 3, 3])
    # class 1: TP 2, pred 2, true 3 -> 4/5; class 2: TP 1, pred 2, true 2 -> 1/2; class 3: TP 1, pred 2, true 1 -> 2/3
    assert macro_f1(y, p) == pytest.approx((4 / 5 + 1 / 2 + 2 / 3) / 3)
    # a class only predicted (never true) counts with F1 0; weights duplicate rows
    assert macro_f1(np.array([1, 1]), np.array([1, 2])) == pytest.approx((2 / 3 + 0) / 2)
    w = np.array([2, 0, 1, 1, 1, 1])
    assert macro_f1(y, p, w) == pytest.approx(macro_f1(np.array([1, 1, 1, 2, 2, 3]), np.array([1, 1, 2, 2, 3, 3])[[0, 0, 2, 3, 4, 5]]))


def test_bootstrap_mean_ci_equals_explicit_resampling():
    rng = np.random.default_rng(3)
    v = rng.random(50)
    W = bootstrap_weights(50, 400, seed=11)
    assert W.shape == (400, 50) and (W.sum(axis=1) == 50).all()
    got = ci_mean(v, W)
    # second method: materialise every resample and take its mean
    means = np.array([np.repeat(v, w).mean() for w in W])
    assert got["value"] == pytest.approx(v.mean())
    assert got["ci"] == pytest.approx(list(np.percentile(means, [2.5, 97.5])))
    assert got["ci"][0] < v.mean() < got["ci"][1]
    const = ci_mean(np.full(20, 0.3), bootstrap_weights(20, 100))
    assert const["ci"] == pytest.approx([0.3, 0.3])


def test_paired_comparison():
    W = bootstrap_weights(40, 300, seed=1)
    a = np.r_[np.ones(30), np.zeros(10)]
    same = paired_comparison(a, a, W)
    assert same["difference"]["ci"] == [0.0, 0.0] and not same["win_beyond_ci"] and not same["loss_beyond_ci"]
    assert same["ratio"]["value"] == 1.0 and not same["win"]
    better = paired_comparison(np.ones(40), a, W)
    assert better["win_beyond_ci"] and better["ratio"]["value"] == pytest.approx(40 / 30)
    worse = paired_comparison(a, np.ones(40), W)
    assert worse["loss_beyond_ci"] and not worse["win"]
    assert paired_comparison(a, np.zeros(40), W)["ratio"] == {"value": None, "ci": [None, None]}


def test_entropy_jackknife_and_tail_match_metrics():
    items = np.array([[1, 2, 3], [1, 1, 4], [5, 2, 2]])
    got = ci_entropy_jackknife(items)
    assert got["value"] == pytest.approx(shannon_entropy(items))
    loo = np.array([shannon_entropy(np.delete(items, u, axis=0)) for u in range(3)])
    assert got["jackknife_bias"] == pytest.approx(2 * (loo.mean() - shannon_entropy(items)))
    assert got["ci"][0] < got["value"] < got["ci"][1]
    pop = np.array([0, 100, 50, 10, 5, 1, 1, 1, 1, 1, 1])
    assert tail_flags(items, pop).mean() == pytest.approx(long_tail_coverage(items, pop))


@pytest.fixture
def small_log() -> EventLog:
    rng = np.random.default_rng(0)
    rows = []
    for u in range(12):
        n = int(rng.integers(4, 12))
        for j in range(n):
            rows.append(
                (u, int(rng.integers(1, 25)), 1000 + 60 * j + u, ["view", "cart", "buy"][int(rng.integers(0, 3))], int(rng.integers(1, 4)))
            )
    df = pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp", "action", "category"])
    return EventLog.from_frame(df, name="small", exclude_history_default=False)


@pytest.fixture
def model(small_log):
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_items=small_log.num_items,
        max_seq_len=16,
        embedding_dim=16,
        num_blocks=1,
        num_heads=1,
        d_qk=8,
        d_v=8,
        num_actions=small_log.num_actions,
        num_categories=small_log.num_categories,
        dropout=0.0,
    )
    return build_hstu(cfg).eval()


@pytest.mark.parametrize("exclude", [False, True])
def test_collect_ranks_equal_standard_evaluation(small_log, model, exclude):
    split = make_split(small_log, "clean")
    res = collect(ModelScorer(model), small_log, split, "test", exclude=exclude, k=3, batch_size=5)
    users, ranks = evaluate_ranks(model, small_log, split, "test", exclude=exclude)
    assert dict(zip(res.users.tolist(), res.ranks.tolist())) == dict(zip(users.tolist(), ranks.tolist()))
    assert res.generated.shape == (len(res.users), 3)
    if exclude:  # generation never returns a history item when history is excluded
        t = split.test_target
        for u, row in zip(res.users, res.generated):
            assert not set(row.tolist()) & set(small_log.items[small_log.offsets[u] : t[u]].tolist())


def test_cold_start_truncation_equals_direct_encode(small_log, model):
    split = make_split(small_log, "clean")
    res = collect(ModelScorer(model), small_log, split, "test", max_history=2, generate=False)
    t = split.test_target
    for u, rank in zip(res.users, res.ranks):
        s, e = max(small_log.offsets[u], t[u] - 2), t[u]
        ids = torch.from_numpy(small_log.items[s:e]).view(1, -1)
        ts = torch.from_numpy(np.r_[small_log.timestamps[s:e], small_log.timestamps[e]]).view(1, -1)
        acts = torch.from_numpy(small_log.actions[s:e]).view(1, -1)
        cats = torch.from_numpy(small_log.categories[s:e]).view(1, -1)
        pad = lambda x: torch.nn.functional.pad(x, (0, 1))  # noqa: E731  (query-time slot)
        with torch.no_grad():
            seq = model.encode(pad(ids), ts, torch.tensor([e - s]), actions=pad(acts), categories=pad(cats))
            scores = model.score_all(seq[0, e - s - 1].view(1, -1))[0]
        target = small_log.items[e]
        assert rank == int((scores >= scores[target]).sum())


def test_slice_report_on_a_baseline(small_log):
    split = make_split(small_log, "clean")
    b = make_baseline("repeat-recent", small_log, split)
    scorer = BaselineScorer(b)
    res = collect(scorer, small_log, split, "test", exclude=False, k=4)
    cold = {n: collect(scorer, small_log, split, "test", exclude=False, max_history=n, generate=False) for n in (1, 2)}
    pop = training_counts(small_log, split)
    rep = slice_report(res, small_log, popularity=pop, cold=cold, resamples=200)
    U = len(res.users)
    assert rep["users"] == U
    assert rep["next_item"]["HR@10"]["value"] == pytest.approx(np.mean(res.ranks <= 10))
    assert rep["next_item"]["NDCG@10"]["value"] == pytest.approx(np.mean(ndcgs(res.ranks, 10)))
    buy = np.array([small_log.action_names[a - 1] == "buy" for a in res.target_actions])
    assert rep["purchase"]["users"] == int(buy.sum())
    assert rep["purchase"]["HR@10"]["value"] == pytest.approx(np.mean(res.ranks[buy] <= 10))
    # next action = the user's last action
    t = split.test_target
    last = small_log.actions[t[res.users] - 1]
    assert rep["next_action"]["accuracy"]["value"] == pytest.approx(np.mean(last == small_log.actions[t[res.users]]))
    assert rep["next_action"]["macro_f1"]["value"] == pytest.approx(macro_f1(small_log.actions[t[res.users]], last))
    # repeat slice: repeat-recent ranks every history item first, so its top-10 is history while
    # the history has >= 10 distinct items
    rep_t = np.array([small_log.items[t[u]] in set(small_log.items[small_log.offsets[u] : t[u]].tolist()) for u in res.users])
    assert rep["repeat"]["share_of_targets"] == pytest.approx(rep_t.mean())
    n_hist = np.array([len(set(small_log.items[small_log.offsets[u] : t[u]].tolist())) for u in res.users])
    assert rep["repeat"]["history_share_of_top10"]["value"] == pytest.approx(np.mean(np.minimum(n_hist, 10) / 10))
    if rep_t.any():
        assert rep["repeat"]["repeat_targets"]["HR@10"]["value"] == pytest.approx(np.mean(res.ranks[rep_t] <= 10))
    cold_mean = np.mean([(cold[1].ranks <= 10).mean(), (cold[2].ranks <= 10).mean()])
    assert rep["cold_start"]["HR@10"]["value"] == pytest.approx(cold_mean)
    assert rep["diversity"]["entropy_nats"]["value"] == pytest.approx(shannon_entropy(res.generated))
    assert rep["diversity"]["long_tail_coverage"]["value"] == pytest.approx(long_tail_coverage(res.generated, pop))
    lo, hi = rep["next_item"]["HR@10"]["ci"]
    assert lo <= rep["next_item"]["HR@10"]["value"] <= hi
    # pooled entropy: delete-one-user jackknife, recomputed here by brute force
    g = res.generated
    loo = np.array([shannon_entropy(np.delete(g, u, axis=0)) for u in range(U)])
    se = np.sqrt((U - 1) / U * ((loo - loo.mean()) ** 2).sum())
    theta = shannon_entropy(g)
    assert rep["diversity"]["entropy_nats"]["ci"] == pytest.approx([theta - 1.959964 * se, theta + 1.959964 * se], rel=1e-6)
