"""Ranking metrics on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hstu.train.metrics import UNREACHABLE_RANK, auc, long_tail_coverage, ranking_metrics, shannon_entropy, target_ranks


def test_ranks_with_ties_are_pessimistic():
    scores = torch.tensor([[float("-inf"), 0.9, 0.5, 0.5, 0.1], [float("-inf"), 0.2, 0.2, 0.2, 0.2]])
    # row 0: target 2 (0.5) ties with item 3 and trails item 1 -> rank 3
    # row 1: all tied -> the target is ranked last among the 4 scorable items
    assert target_ranks(scores, torch.tensor([2, 1])).tolist() == [3, 4]
    assert target_ranks(scores, torch.tensor([1, 4])).tolist() == [1, 4]


def test_an_excluded_target_is_a_miss_at_every_k():
    """A trial's finding: a target excluded from the ranking (a repeated history item under exclude_history, -inf)
    was ranked behind every item, so HR@50 was 1.0 on a 20-item catalogue whose every target was excluded."""
    inf = float("-inf")
    scores = torch.tensor([[inf, 0.9, inf, 0.5], [inf, 0.2, 0.7, inf]])  # row 0 excludes item 2, row 1 item 3
    ranks = target_ranks(scores, torch.tensor([2, 2]))
    assert ranks.tolist() == [UNREACHABLE_RANK, 1]
    m = ranking_metrics(ranks.numpy(), ks=(1, 50, 200))
    assert m["HR@1"] == m["HR@50"] == m["HR@200"] == 0.5 and m["NDCG@200"] == 0.5
    assert m["MRR"] == pytest.approx(0.5, abs=1e-15)


def test_ranking_metrics_hand_values():
    ranks = np.array([1, 3, 12, 60])
    m = ranking_metrics(ranks, ks=(1, 10, 50))
    assert m["HR@1"] == 0.25
    assert m["HR@10"] == 0.5
    assert m["HR@50"] == 0.75
    assert m["NDCG@10"] == pytest.approx((1 / math.log2(2) + 1 / math.log2(4)) / 4)
    assert m["NDCG@50"] == pytest.approx((1 + 0.5 + 1 / math.log2(13)) / 4)
    assert m["MRR"] == pytest.approx((1 + 1 / 3 + 1 / 12 + 1 / 60) / 4)


def test_ranking_metrics_empty_raises():
    with pytest.raises(ValueError):
        ranking_metrics(np.array([]))


def test_auc_hand_values():
    assert auc(np.array([0.5]), np.array([[0.1, 0.9, 0.5, 0.2]])) == pytest.approx((2 + 0.5) / 4)
    assert auc(np.array([1.0, 0.0]), np.array([[0.0], [1.0]])) == pytest.approx(0.5)


def test_entropy_and_long_tail():
    assert shannon_entropy([1, 1, 2, 2]) == pytest.approx(math.log(2))
    assert shannon_entropy([7, 7, 7]) == pytest.approx(0.0)
    pop = np.array([0, 100, 50, 10, 5, 1, 1, 1, 1, 1, 1])  # 10 items: head (20 %) = items 1, 2
    assert long_tail_coverage([1, 2, 3, 4], pop) == pytest.approx(0.5)
