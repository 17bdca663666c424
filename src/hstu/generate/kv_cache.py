"""Preallocated KV cache written in place (torchtune ``KVCache`` habit: static shapes,
position kept in a tensor, no growth by ``torch.cat``).

Symbols: L layers, B batch capacity, H heads, S capacity in positions (history + k), d_qk, d_v.
Storage: per layer k (B, H, S, d_qk) and v (B, H, S, d_v) in the model dtype, plus the
timestamps (B, S) int64 of the cached positions (the time bias of a new row needs them).
"""

from __future__ import annotations

import torch

from hstu.model.hstu import HSTUModel


class KVCache:
    """Per-layer key/value buffers for up to ``batch_size`` sequences of ``capacity`` positions.

    ``views(B)`` returns the first B rows of every buffer (no copy), so one cache serves any
    batch up to its capacity. ``nbytes`` reports the memory held (bytes).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        num_heads: int,
        capacity: int,
        d_qk: int,
        d_v: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, batch_size, num_heads, capacity, d_qk, d_v) <= 0:
            raise ValueError(
                f"KVCache sizes must be > 0: layers={num_layers} batch={batch_size} heads={num_heads} "
                f"capacity={capacity} d_qk={d_qk} d_v={d_v}"
            )
        self.batch_size, self.capacity = batch_size, capacity
        self.k = [torch.zeros(batch_size, num_heads, capacity, d_qk, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(batch_size, num_heads, capacity, d_v, dtype=dtype, device=device) for _ in range(num_layers)]
        self.timestamps = torch.zeros(batch_size, capacity, dtype=torch.int64, device=device)

    @classmethod
    def for_model(cls, model: HSTUModel, batch_size: int, capacity: int) -> "KVCache":
        p = model.pos_emb.weight
        c = model.cfg
        if capacity > c.width:
            raise ValueError(f"KV cache capacity {capacity} exceeds the model width N={c.width} (max_seq_len + max_output_len)")
        return cls(
            num_layers=c.num_blocks,
            batch_size=batch_size,
            num_heads=c.num_heads,
            capacity=capacity,
            d_qk=c.d_qk,
            d_v=c.d_v,
            dtype=p.dtype,
            device=p.device,
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, self.timestamps))

    def views(self, batch: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Per-layer (k, v) views and the timestamps view for the first ``batch`` rows."""
        if batch > self.batch_size:
            raise ValueError(f"batch {batch} exceeds the KV cache batch capacity {self.batch_size}")
        return [(k[:batch], v[:batch]) for k, v in zip(self.k, self.v)], self.timestamps[:batch]

    def reorder(self, batch: int, index: torch.Tensor) -> None:
        """Rows b <- rows index[b] for the first ``batch`` rows (beam search parent selection)."""
        for t in (*self.k, *self.v, self.timestamps):
            t[:batch].copy_(t[:batch].index_select(0, index))
