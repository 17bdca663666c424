"""Non-neural baselines under the same full-ranking protocol as the models.

- ``MostPopular``: every user gets the items ranked by their number of training events.
- ``RepeatAware`` (a "repeat consumption" baseline; Anderson et al., WWW 2014, and the
  re-consumption analysis of Ren et al., "Repeat-Net", AAAI 2019): the user's own history items
  first — ordered by recency (``mode="recent"``: the most recently seen first) or frequency
  (``mode="frequent"``: the most often seen first, ties by recency) — then every other item by
  popularity. With history items excluded from the candidates it reduces to MostPopular.
- ``ActionMarkov``: a next-action baseline that sees what the model's next-action head sees about
  the next event, the last action and the time from it to the query (the target's time): a
  first-order Markov chain on actions conditioned on the log-bucketed gap (the buckets of HSTU's
  time bias, :func:`hstu.model.bias.log_bucket_`), i.e. the most frequent next action after that
  context in training. Its item scores are MostPopular's.

Scores follow the models' conventions so :func:`hstu.train.metrics.target_ranks` applies: (B, I+1)
float64, column 0 (padding) = -inf, higher is better; equal scores rank against the target.
Popularity counts the training events of every user (``split.train_end``), the data every model
is trained on. Next-action predictions (for the next-action slice): MostPopular predicts the most
frequent training action, RepeatAware the user's last action.

Symbols: B users in a batch, I items (dense ids 1..I), E events.
"""

from __future__ import annotations

import numpy as np
import torch

from hstu.data.sequences import EventLog, Split

BASELINES = ("most-popular", "repeat-recent", "repeat-frequent", "action-markov")


def training_counts(log_: EventLog, split: Split) -> np.ndarray:
    """(I+1,) int64 number of training events per dense item (events offsets[u]:train_end[u])."""
    counts = np.zeros(log_.num_items + 1, np.int64)
    for u in range(log_.num_users):
        np.add.at(counts, log_.items[log_.offsets[u] : split.train_end[u]], 1)
    return counts


def training_action_counts(log_: EventLog, split: Split) -> np.ndarray:
    """(A+1,) int64 number of training events per action id."""
    counts = np.zeros(log_.num_actions + 1, np.int64)
    for u in range(log_.num_users):
        np.add.at(counts, log_.actions[log_.offsets[u] : split.train_end[u]], 1)
    return counts


class MostPopular:
    """Most-popular items by training events. ``scores`` ignores the history."""

    name = "most-popular"

    def __init__(self, log_: EventLog, split: Split) -> None:
        self.log = log_
        self.popularity = training_counts(log_, split).astype(np.float64)  # (I+1,)
        acts = training_action_counts(log_, split)
        self.majority_action = int(np.argmax(acts[1:]) + 1) if log_.num_actions else 0

    def scores(self, users: np.ndarray, ends: np.ndarray, max_history: int | None = None) -> torch.Tensor:
        """(B,) EventLog rows and (B,) exclusive event ends -> (B, I+1) float64 scores."""
        s = torch.from_numpy(np.repeat(self.popularity[None, :], len(users), axis=0))
        s[:, 0] = float("-inf")
        return s

    def next_actions(self, users: np.ndarray, ends: np.ndarray, max_history: int | None = None) -> np.ndarray | None:
        """(B,) predicted next action ids (the majority training action), or None without actions."""
        return np.full(len(users), self.majority_action, np.int64) if self.log.num_actions else None


class RepeatAware(MostPopular):
    """The user's history items first (by recency or frequency), then the rest by popularity."""

    def __init__(self, log_: EventLog, split: Split, mode: str = "recent") -> None:
        if mode not in ("recent", "frequent"):
            raise ValueError(f"RepeatAware mode must be 'recent' or 'frequent', got {mode!r}")
        super().__init__(log_, split)
        self.mode = mode
        self.name = f"repeat-{mode}"

    def _history(self, u: int, end: int, max_history: int | None) -> np.ndarray:
        start = self.log.offsets[u] if max_history is None else max(self.log.offsets[u], end - max_history)
        return self.log.items[start:end]

    def scores(self, users: np.ndarray, ends: np.ndarray, max_history: int | None = None) -> torch.Tensor:
        """(B,) rows, (B,) exclusive ends -> (B, I+1) float64. History items score above every
        popularity score: base + recency (position of the last occurrence, 1..L) for "recent";
        base + count · (L + 1) + recency for "frequent"."""
        s = super().scores(users, ends).numpy()
        base = self.popularity.max() + 1.0
        for b, (u, e) in enumerate(zip(users, ends)):
            h = self._history(int(u), int(e), max_history)
            L = len(h)
            if L == 0:
                continue
            items, first_rev, counts = np.unique(h[::-1], return_index=True, return_counts=True)
            recency = L - first_rev  # last occurrence's 1-based position: most recent = L
            key = recency if self.mode == "recent" else counts * (L + 1) + recency
            s[b, items] = base + key
        return torch.from_numpy(s)

    def next_actions(self, users: np.ndarray, ends: np.ndarray, max_history: int | None = None) -> np.ndarray | None:
        """(B,) the user's last action (majority action for an empty history)."""
        if not self.log.num_actions:
            return None
        out = np.full(len(users), self.majority_action, np.int64)
        for b, (u, e) in enumerate(zip(users, ends)):
            if e > self.log.offsets[u]:
                out[b] = self.log.actions[e - 1]
        return out


class ActionMarkov(MostPopular):
    """Next action = argmax over training transitions of count(next action | last action a, gap
    bucket g), g = :func:`~hstu.model.bias.log_bucket_` of (query time - last event's time) with the
    model's defaults (128 buckets, log base 0.301); a context never seen in training falls back to
    argmax count(next | a), then to the majority action. Ties go to the lower action id."""

    name = "action-markov"

    def __init__(self, log_: EventLog, split: Split, num_buckets: int = 128, log_base: float = 0.301) -> None:
        super().__init__(log_, split)
        self.num_buckets, self.log_base = num_buckets, log_base
        A = log_.num_actions
        self.counts = np.zeros((A + 1, num_buckets + 1, A + 1), np.int64)  # (last action, gap bucket, next action)
        for u in range(log_.num_users):
            lo, hi = log_.offsets[u], split.train_end[u]
            if hi - lo >= 2:
                a, t = log_.actions[lo:hi], log_.timestamps[lo:hi]
                np.add.at(self.counts, (a[:-1], self._bucket(t[1:] - t[:-1]), a[1:]), 1)

    def _bucket(self, gap: np.ndarray) -> np.ndarray:
        from hstu.model.bias import log_bucket_

        return log_bucket_(torch.as_tensor(np.asarray(gap, np.int64)).clone(), self.num_buckets, self.log_base).numpy()

    def next_actions(self, users: np.ndarray, ends: np.ndarray, max_history: int | None = None) -> np.ndarray | None:
        """(B,) rows, (B,) exclusive ends (the target's index: its time is the query time) -> (B,) action ids."""
        if not self.log.num_actions:
            return None
        ends = np.asarray(ends, np.int64)
        out = np.full(len(users), self.majority_action, np.int64)
        has = ends > self.log.offsets[np.asarray(users, np.int64)]  # an empty history keeps the majority action
        prev = ends[has] - 1
        last = self.log.actions[prev].astype(np.int64)
        gap = self._bucket(self.log.timestamps[ends[has]] - self.log.timestamps[prev])
        picks = np.full(len(prev), self.majority_action, np.int64)
        for j, (a, g) in enumerate(zip(last, gap)):
            for c in (self.counts[a, g], self.counts[a].sum(axis=0)):
                if c[1:].sum() > 0:
                    picks[j] = int(np.argmax(c[1:]) + 1)
                    break
        out[has] = picks
        return out


def make_baseline(name: str, log_: EventLog, split: Split) -> MostPopular:
    """ "most-popular" | "repeat-recent" | "repeat-frequent" | "action-markov" -> a fitted baseline."""
    if name == "most-popular":
        return MostPopular(log_, split)
    if name == "action-markov":
        return ActionMarkov(log_, split)
    if name in ("repeat-recent", "repeat-frequent"):
        return RepeatAware(log_, split, name.split("-", 1)[1])
    raise ValueError(f"unknown baseline {name!r}; valid: {list(BASELINES)}")


def evaluate_baseline(
    baseline: MostPopular, log_: EventLog, split: Split, which: str, *, exclude: bool | None = None, batch_size: int = 256, ks=None
) -> dict[str, float]:
    """Mean HR@K, NDCG@K, MRR of a baseline on ``which`` ("valid" | "test"), the same protocol
    as :func:`hstu.train.evaluate.evaluate` (full ranking, pessimistic ties, history exclusion
    per ``exclude`` or the data set's default)."""
    from hstu.train.evaluate import exclude_history
    from hstu.train.metrics import DEFAULT_KS, ranking_metrics, target_ranks

    targets = split.targets(which)
    users = np.nonzero(targets >= 0)[0]
    exclude = log_.exclude_history_default if exclude is None else exclude
    ranks = []
    for s in range(0, len(users), batch_size):
        ub = users[s : s + batch_size]
        sc = baseline.scores(ub, targets[ub])
        if exclude:
            exclude_history(sc, log_, ub, targets[ub])
        ranks.append(target_ranks(sc, torch.from_numpy(log_.items[targets[ub]])).numpy())
    out = ranking_metrics(np.concatenate(ranks), ks or DEFAULT_KS)
    out["users"] = int(len(users))
    return out
