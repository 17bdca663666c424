"""Repeat-aware scoring: an additive bias for candidates the user interacted with recently.

In e-commerce logs a large share of next events revisit an item of the history (view -> cart ->
buy of one item; 31 % of the last events in the Taobao slice). The cosine score of an HSTU user
vector against learned item embeddings reaches such items only through embeddings that rare
items barely train. This module adds the explicit "repeat" path of repeat-explore recommenders
(RepeatNet, Ren et al., AAAI 2019), in its simplest additive form:

    score(u, i) = (cos(u, e_i) + 1[i in the last R events] * (T[bucket(dist_i), a_i] + w · u + b)) / tau

dist_i: events since the most recent occurrence of i (0 = the last event), bucketed as
floor(log2(dist + 1)); a_i: the action type of that occurrence (0 when the data has none); T a
learned (buckets, actions + 1) table; w · u + b a learned repeat propensity of the user state
(RepeatNet's repeat/explore switch, here a logit added to every history candidate). The bias is
in cosine units (divided by the temperature like the similarity), so the optimiser moves it at
the scale of the scores. After training, one scale factor s of the whole bias is chosen on the
validation split (score = cos/tau + s * bias): training positions are memorised by the cosine
part (the "explore" side overfits a small log), which a bias fitted on training positions alone
under-weights against new users' revisits. Items outside the window get no bias. The window R is
``ModelConfig.repeat_window`` (0 = off).

Training (:func:`hstu.train.losses.repeat_aware_loss`) scores, at every position, the target,
the uniform negatives and the items of the position's own window as further negatives, so the
bias learns both when a revisit happens and when it does not.

Symbols: B batch, W width, P supervised positions, C candidates, R window, I items, d width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def recency_bucket(dist: torch.Tensor) -> torch.Tensor:
    """floor(log2(dist + 1)) for int64 dist >= 0 (0, 1, 1, 2, 2, 2, 2, 3, ...), exact in integers."""
    d = dist + 1
    out = torch.zeros_like(d)
    for s in (32, 16, 8, 4, 2, 1):  # integer log2 by binary search, no float rounding
        big = d >= (1 << s)
        out = out + big.to(out.dtype) * s
        d = torch.where(big, d >> s, d)
    return out


def windows(x: torch.Tensor, R: int) -> torch.Tensor:
    """(B, W) -> (B, W, R): at position t the values at t-R+1 .. t (oldest first), 0 before the start."""
    return F.pad(x, (R - 1, 0)).unfold(1, R, 1)


class RepeatBias(nn.Module):
    """The additive repeat bias (see the module docstring).

    Args:
        window: R >= 1, events of the history that count as "recent".
        num_actions: action types of the data (0: none); the table has num_actions + 1 columns.
        dim: d, the width of the user vectors.
        temperature: the model's similarity temperature (the bias is divided by it).
    """

    def __init__(self, window: int, num_actions: int, dim: int, temperature: float = 1.0) -> None:
        super().__init__()
        self.inv_tau = 1.0 / float(temperature)
        # Post-training scale of the whole bias, chosen on the validation split (hstu.train.loop.
        # calibrate_repeat_scale); 1 while training. Saved with the weights.
        self.register_buffer("scale", torch.ones(()))
        if window < 1:
            raise ValueError(f"repeat window must be >= 1, got {window}")
        self.window = int(window)
        nb = int(math.floor(math.log2(self.window))) + 1  # buckets of dist 0 .. R-1
        self.table = nn.Parameter(torch.zeros(nb, num_actions + 1))
        self.propensity = nn.Linear(dim, 1)
        nn.init.zeros_(self.propensity.weight)
        nn.init.zeros_(self.propensity.bias)

    @torch.no_grad()
    def init_from_prior(self, p_repeat: float, num_items: int) -> None:
        """Start the propensity bias at the prior log-odds of a window item against any other:
        log((p / R) / ((1 - p) / (I - R))), in cosine units (x temperature), where p is the
        share of training targets found in the window (:func:`hstu.train.loop.repeat_share`).
        Like initialising a classifier's output bias to the class prior (it only sets where
        training starts)."""
        p = min(max(float(p_repeat), 1e-4), 1 - 1e-4)
        R, I = self.window, max(int(num_items), self.window + 1)
        self.propensity.bias.fill_(math.log((p / R) / ((1 - p) / (I - R))) / self.inv_tau)

    def _values(self, user: torch.Tensor, dist: torch.Tensor, acts: torch.Tensor) -> torch.Tensor:
        """user (…, d), dist / acts (…, C) int64 -> (…, C) bias (no window check)."""
        return (self.table[recency_bucket(dist), acts] + self.propensity(user).to(self.table.dtype)) * (self.inv_tau * self.scale)

    def candidates(self, user: torch.Tensor, cand: torch.Tensor, win_items: torch.Tensor, win_acts: torch.Tensor | None) -> torch.Tensor:
        """Bias of given candidates.

        Args:
            user: (P, d) user vectors; cand: (P, C) int64 candidate ids.
            win_items: (P, R) int64 the R most recent items, oldest first (0 = none);
            win_acts: (P, R) int64 their action types, or None.
        Returns:
            (P, C) float: 0 for candidates outside the window.
        """
        P, R = win_items.shape
        eq = (cand.unsqueeze(-1) == win_items.unsqueeze(1)) & (win_items.unsqueeze(1) > 0)  # (P, C, R)
        slot = torch.arange(1, R + 1, device=cand.device, dtype=torch.int16)
        last = (eq.to(torch.int16) * slot).amax(dim=-1).to(torch.int64) - 1  # (P, C) most recent slot, -1 = not in the window
        hit = last >= 0
        last = last.clamp(min=0)
        acts = win_acts.gather(1, last) if win_acts is not None else torch.zeros_like(last)  # (P, C)
        return torch.where(hit, self._values(user, R - 1 - last, acts), torch.zeros((), dtype=self.table.dtype, device=cand.device))

    def history_windows(
        self, ids: torch.Tensor, actions: torch.Tensor | None, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, W) histories, (B,) lengths -> the last R items (B, R) and actions (B, R) or None,
        oldest first, 0 where the history is shorter than R."""
        R = self.window
        pos = lengths.view(-1, 1) - R + torch.arange(R, device=ids.device).view(1, R)  # (B, R)
        ok = pos >= 0
        p = pos.clamp(min=0)
        items = torch.where(ok, ids.gather(1, p), torch.zeros((), dtype=ids.dtype, device=ids.device))
        acts = None if actions is None else torch.where(ok, actions.gather(1, p), torch.zeros((), dtype=actions.dtype, device=ids.device))
        return items, acts

    def full(self, win_items: torch.Tensor, win_acts: torch.Tensor | None, num_items: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bias over the whole catalogue from the history windows.

        Returns (static (B, I+1) table part, in_window (B, I+1) bool); the bias for a user vector
        u is ``static + in_window * (w · u + b)`` (:meth:`add_to`), so generation can keep the
        static part while u changes step by step.
        """
        B, R = win_items.shape
        static = torch.zeros(B, num_items + 1, dtype=self.table.dtype, device=win_items.device)
        inwin = torch.zeros(B, num_items + 1, dtype=torch.bool, device=win_items.device)
        acts = win_acts if win_acts is not None else torch.zeros_like(win_items)
        for j in range(R):  # oldest first: a more recent occurrence overwrites an older one
            col = win_items[:, j : j + 1]  # (B, 1)
            val = self.table[recency_bucket(torch.full_like(col, R - 1 - j)), acts[:, j : j + 1]] * (self.inv_tau * self.scale)  # (B, 1)
            live = col > 0
            static.scatter_(1, col, torch.where(live, val, static.gather(1, col)))
            inwin.scatter_(1, col, live | inwin.gather(1, col))
        inwin[:, 0] = False
        static[:, 0] = 0.0
        return static, inwin

    def add_to(self, scores: torch.Tensor, user: torch.Tensor, static: torch.Tensor, inwin: torch.Tensor) -> torch.Tensor:
        """scores (B, I+1) += static + in_window * (w · u + b), in place; returns scores."""
        scores.add_(static.to(scores.dtype))
        return scores.add_(inwin.to(scores.dtype) * (self.propensity(user).to(scores.dtype) * (self.inv_tau * self.scale)))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.setdefault(prefix + "scale", torch.ones(()))  # checkpoints from before the calibration existed
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


__all__ = ["RepeatBias", "recency_bucket", "windows"]
