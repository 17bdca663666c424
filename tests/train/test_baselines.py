"""Most-popular and repeat-aware baselines: hand-worked ranks on a tiny log, and an independent
pure-Python count on the real Taobao head."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

from hstu.data.sequences import EventLog, make_split
from hstu.train.baselines import MostPopular, RepeatAware, evaluate_baseline, make_baseline, training_counts
from hstu.train.metrics import target_ranks


@pytest.fixture
def tiny_log() -> EventLog:
    # user 1: 10 11 10 12 | valid 13 | test 10     user 2: 11 12 11 | valid 14 | test 11
    # user 3: 12 13 (too short for the clean split: trained on, not evaluated)
    rows = [
        (1, 10, "view"),
        (1, 11, "view"),
        (1, 10, "cart"),
        (1, 12, "view"),
        (1, 13, "view"),
        (1, 10, "buy"),
        (2, 11, "view"),
        (2, 12, "view"),
        (2, 11, "cart"),
        (2, 14, "view"),
        (2, 11, "buy"),
        (3, 12, "view"),
        (3, 13, "view"),
    ]
    df = pd.DataFrame(rows, columns=["user_id", "item_id", "action"])
    df["timestamp"] = np.arange(len(df)) * 10
    return EventLog.from_frame(df, name="tiny", exclude_history_default=False)


def ranks_of(b, log_, split, which, exclude=False, max_history=None):
    from hstu.train.evaluate import exclude_history

    t = split.targets(which)
    users = np.nonzero(t >= 0)[0]
    s = b.scores(users, t[users], max_history)
    if exclude:
        exclude_history(s, log_, users, t[users])
    return target_ranks(s, torch.from_numpy(log_.items[t[users]])).tolist()


def test_training_counts_by_hand(tiny_log):
    split = make_split(tiny_log, "clean")
    # dense ids follow raw ids: 10->1, 11->2, 12->3, 13->4, 14->5
    assert tiny_log.item_raw_ids.tolist() == [0, 10, 11, 12, 13, 14]
    assert training_counts(tiny_log, split).tolist() == [0, 2, 3, 3, 1, 0]


def test_most_popular_ranks(tiny_log):
    split = make_split(tiny_log, "clean")
    b = MostPopular(tiny_log, split)
    # test: user 1 target id 1 (count 2) trails ids 2, 3 (count 3) -> 3; user 2 target id 2 ties id 3 -> 2 (pessimistic)
    assert ranks_of(b, tiny_log, split, "test") == [3, 2]
    m = evaluate_baseline(b, tiny_log, split, "test")
    assert m["HR@1"] == 0.0 and m["HR@10"] == 1.0 and m["users"] == 2
    assert m["NDCG@10"] == pytest.approx((1 / math.log2(4) + 1 / math.log2(3)) / 2)
    assert b.next_actions(np.array([0, 1]), np.array([5, 10])).tolist() == [1, 1]  # "view" is the majority


def test_repeat_aware_ranks(tiny_log):
    split = make_split(tiny_log, "clean")
    recent, frequent = RepeatAware(tiny_log, split, "recent"), RepeatAware(tiny_log, split, "frequent")
    # user 1 test history 10 11 10 12 13: by recency 13 12 10 11 -> target 10 at 3; by frequency 10 first
    # user 2 test history 11 12 11 14: by recency 14 11 12 -> 2; by frequency 11 first
    assert ranks_of(recent, tiny_log, split, "test") == [3, 2]
    assert ranks_of(frequent, tiny_log, split, "test") == [1, 1]
    # valid: user 1 history 10 11 10 12, target 13 (not in history): 3 history items, then
    # the rest by popularity: 13 (count 1) before 14 (count 0) -> rank 4
    assert ranks_of(recent, tiny_log, split, "valid")[0] == 4
    # truncated to the last 2 events (12 13): then popularity 11 (3) > 10 (2) -> target 10 at 4
    assert ranks_of(recent, tiny_log, split, "test", max_history=2)[0] == 4
    assert recent.next_actions(np.array([0]), np.array([5])).tolist() == [1]  # user 1's event before the test: view
    assert recent.name == "repeat-recent" and make_baseline("repeat-frequent", tiny_log, split).mode == "frequent"


def test_history_exclusion_reduces_repeat_aware_to_popularity(tiny_log):
    split = make_split(tiny_log, "clean")
    for name in ("repeat-recent", "repeat-frequent"):
        b = make_baseline(name, tiny_log, split)
        pop = make_baseline("most-popular", tiny_log, split)
        assert ranks_of(b, tiny_log, split, "valid", exclude=True) == ranks_of(pop, tiny_log, split, "valid", exclude=True)
    # a target inside the excluded history can never be hit: rank beyond every candidate
    assert ranks_of(pop, tiny_log, split, "test", exclude=True) == [6, 6]
    with pytest.raises(ValueError, match="unknown baseline"):
        make_baseline("random", tiny_log, split)
    with pytest.raises(ValueError, match="mode"):
        RepeatAware(tiny_log, split, "oldest")


def test_repeat_recent_on_taobao_equals_pure_python(taobao_csv):
    from hstu.data.ecommerce import load_taobao

    log_ = load_taobao(taobao_csv)
    split = make_split(log_, "clean")
    got = evaluate_baseline(make_baseline("repeat-recent", log_, split), log_, split, "test", ks=(10,))
    pop = Counter()
    for u in range(log_.num_users):
        pop.update(log_.items[log_.offsets[u] : split.train_end[u]].tolist())
    counts = np.zeros(log_.num_items + 1, np.int64)
    for i, c in pop.items():
        counts[i] = c
    hits = 0
    t = split.test_target
    for u in np.nonzero(t >= 0)[0]:
        hist = log_.items[log_.offsets[u] : t[u]].tolist()
        order = list(dict.fromkeys(reversed(hist)))  # distinct, most recent first
        target = int(log_.items[t[u]])
        if target in order:
            rank = order.index(target) + 1
        else:  # after the history: popularity, ties counted against the target
            c = counts[target]
            rank = len(order) + int((counts[1:] >= c).sum()) - sum(counts[i] >= c for i in order)
        hits += rank <= 10
    assert got["HR@10"] == pytest.approx(hits / got["users"])
    assert got["users"] == 814
