"""Relative attention bias of HSTU: position term by j - i plus log-bucketed time term.

Zhai et al. 2024, §3 (rab^{p,t}). Symbols: B batch, W padded width (<= N), N the model's
fixed width.

rab[b, i, j] = pos_w[N - 1 + j - i] + ts_w[bucket(t[b, i + 1] - t[b, j])]
bucket(dt) = clamp(floor(ln(max(|dt|, 1)) / log_base), 0, num_buckets)

t is the timestamps row extended by repeating its last column, so row i compares the time of
the *next* event (for the last live row: the query / request time) with each earlier event.
"""

from __future__ import annotations

import torch
from torch import nn


def log_bucket_(delta: torch.Tensor, num_buckets: int, log_base: float) -> torch.Tensor:
    """clamp(floor(ln(max(|dt|, 1)) / log_base), 0, num_buckets) of an int64 ``delta`` that the
    caller owns (modified in place; float64 keeps the floor exact up to 2^53 s). In place after
    each dtype change: 3 allocations instead of 8 (measured 1.1x at the engine's CPU chunk
    shapes, 1.25x at (4, 200, 200), one thread). Returns int64 of delta's shape."""
    delta.abs_().clamp_(min=1)
    return delta.to(torch.float64).log_().div_(log_base).floor_().to(torch.int64).clamp_(0, num_buckets)


def time_buckets(timestamps: torch.Tensor, num_buckets: int = 128, log_base: float = 0.301) -> torch.Tensor:
    """Bucket index of |t[i+1] - t[j]| for every (i, j).

    Args:
        timestamps: (B, W) int64 Unix seconds; position ``length`` holds the query time,
            padding after it is ignored by the caller (masked rows).
        num_buckets: largest bucket index (inclusive).
        log_base: divisor of the natural log (0.301 in the reference).
    Returns:
        (B, W, W) int64 bucket indices in [0, num_buckets].
    """
    nxt = torch.cat([timestamps[:, 1:], timestamps[:, -1:]], dim=1)  # (B, W): t[i+1]
    return log_bucket_(nxt.unsqueeze(2) - timestamps.unsqueeze(1), num_buckets, log_base)  # (B, W, W)


def time_buckets_row(t_query: torch.Tensor, t_keys: torch.Tensor, num_buckets: int = 128, log_base: float = 0.301) -> torch.Tensor:
    """Bucket indices of one query row against keys: (B,) and (B, W) -> (B, W) int64."""
    return log_bucket_(t_query.unsqueeze(1) - t_keys, num_buckets, log_base)


class RelativeBias(nn.Module):
    """Per-layer learned position and time bias tables.

    Args:
        width: N, the model's fixed width (position table has 2N - 1 entries).
        num_buckets: time buckets 0..num_buckets (table has num_buckets + 1 entries).
    """

    def __init__(self, *, width: int, num_buckets: int, use_position: bool = True, use_time: bool = True) -> None:
        super().__init__()
        self.width = width
        self.use_position = use_position
        self.use_time = use_time
        self.pos_w = nn.Parameter(torch.empty(2 * width - 1).normal_(0, 0.02))
        self.ts_w = nn.Parameter(torch.empty(num_buckets + 1).normal_(0, 0.02))

    def forward(self, buckets: torch.Tensor) -> torch.Tensor:
        """buckets: (B, W, W) int64 from :func:`time_buckets` -> rab (B, W, W) float."""
        B, W, _ = buckets.shape
        rab = torch.zeros(B, W, W, dtype=self.pos_w.dtype, device=buckets.device)
        if self.use_position:
            rel = torch.arange(W, device=buckets.device)
            rel = rel.view(1, W) - rel.view(W, 1) + self.width - 1  # (W, W): N - 1 + j - i
            rab = rab + self.pos_w[rel].unsqueeze(0)  # (B, W, W)
        if self.use_time:
            rab = rab + self.ts_w[buckets]  # (B, W, W)
        return rab

    def row(self, i: torch.Tensor, buckets_row: torch.Tensor) -> torch.Tensor:
        """rab for one query row per batch element.

        Args:
            i: (B,) int64 query positions.
            buckets_row: (B, W) int64 time buckets of that row against keys 0..W-1.
        Returns:
            (B, W) float bias.
        """
        B, W = buckets_row.shape
        out = torch.zeros(B, W, dtype=self.pos_w.dtype, device=buckets_row.device)
        if self.use_position:
            j = torch.arange(W, device=buckets_row.device).view(1, W)
            out = out + self.pos_w[(j - i.view(B, 1) + self.width - 1).clamp(0, 2 * self.width - 2)]
        if self.use_time:
            out = out + self.ts_w[buckets_row]
        return out
