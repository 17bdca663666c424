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
from hstu.train.metrics import UNREACHABLE_RANK, target_ranks


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
    # a target inside the excluded history can never be hit: a miss at every K (it was rank 6 of 5 items, a hit at K >= 6)
    assert ranks_of(pop, tiny_log, split, "test", exclude=True) == [UNREACHABLE_RANK] * 2
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


def test_action_markov_next_actions_by_hand():
    """Training transitions (last action, gap bucket floor(ln gap / 0.301)) -> next: user 1 view→buy at 100 s
    (bucket 15) twice, buy→buy at 0 s (bucket 0) twice, buy→view at 4900 s (28) once; user 2 view→view at 10 s
    (7) twice. The majority training action is view (6 of 10)."""
    rows = [(1, 10 + i, a, t) for i, (a, t) in enumerate(zip("vbbvbbvv", (0, 100, 100, 5000, 5100, 5100, 9000, 9100)))]
    rows += [(2, 20 + i, "v", 10 * i) for i in range(5)] + [(3, 30, "v", 0), (3, 31, "c", 1), (3, 32, "v", 2)]
    df = pd.DataFrame(rows, columns=["user_id", "item_id", "action", "timestamp"])
    df["action"] = df["action"].map({"v": "view", "b": "buy", "c": "cart"})
    log_ = EventLog.from_frame(df, name="tiny", exclude_history_default=False)
    split = make_split(log_, "clean")
    b = make_baseline("action-markov", log_, split)
    act = {name: i + 1 for i, name in enumerate(log_.action_names)}
    assert b.name == "action-markov" and b.majority_action == act["view"]
    users, ends = np.array([0, 0, 1, 2, 0]), np.array([6, 7, 12, 15, 2])
    # u1 valid: last buy 3900 s before (bucket 27, unseen) -> buy's row: buy 2, view 1; u1 test: view 100 s before
    # (15) -> buy; u2: view 10 s before (7) -> view; u3: cart never seen in training -> majority; u1 at event 2:
    # buy in the same second (0) -> buy
    want = [act[a] for a in ("buy", "buy", "view", "view", "buy")]
    assert b.next_actions(users, ends).tolist() == want
    assert MostPopular(log_, split).next_actions(users, ends).tolist() == [act["view"]] * 5


def test_action_markov_on_taobao_equals_pandas(taobao_csv):
    """On the Taobao head: the baseline's test-target actions equal a pandas groupby over the training
    transitions (argmax per (last action, floor(ln max(gap, 1) / 0.301)), lower id on ties, then the last
    action's row, then the majority)."""
    from hstu.data.ecommerce import load_taobao

    log_ = load_taobao(taobao_csv)
    split = make_split(log_, "clean")
    b = make_baseline("action-markov", log_, split)
    rows = []
    for u in range(log_.num_users):
        lo, hi = log_.offsets[u], split.train_end[u]
        a, t = log_.actions[lo:hi], log_.timestamps[lo:hi]
        rows += [(int(a[i - 1]), min(128, math.floor(math.log(max(int(t[i] - t[i - 1]), 1)) / 0.301)), int(a[i])) for i in range(1, len(a))]
    tr = pd.DataFrame(rows, columns=["last", "gap", "next"])
    by_ctx = tr.groupby(["last", "gap"])["next"].agg(lambda s: s.value_counts().sort_index().idxmax())
    by_last = tr.groupby("last")["next"].agg(lambda s: s.value_counts().sort_index().idxmax())
    majority = int(pd.Series(np.concatenate([log_.actions[log_.offsets[u] : split.train_end[u]] for u in range(log_.num_users)])).mode()[0])
    t_ = split.test_target
    users = np.nonzero(t_ >= 0)[0]
    want = []
    for u in users:
        e = t_[u]
        last, gap = int(log_.actions[e - 1]), int(log_.timestamps[e] - log_.timestamps[e - 1])
        key = (last, min(128, math.floor(math.log(max(gap, 1)) / 0.301)))
        want.append(int(by_ctx[key]) if key in by_ctx.index else int(by_last.get(last, majority)))
    got = b.next_actions(users, t_[users])
    assert got.tolist() == want
    assert (got != majority).sum() > 0  # it does answer something else than the majority somewhere
