"""Ascend NPU kernel set: only ops torch_npu implements, no float64, no softmax kernels.

HSTU attention is SiLU(QKᵀ + rab) / n with no softmax (Zhai et al. 2024, §3, eq. 2), so
``torch_npu.npu_fusion_attention`` and SDPA do not apply (they normalise rows with softmax).
This set is built from aten ops with NPU kernels (matmul, linear, layer_norm, silu, gather /
index, masked_fill, compare; see the torch_npu supported-operator list,
https://www.hiascend.com/document/detail/zh/Pytorch/) and avoids float64, which Ascend AI Core
does not compute: the reference's float64 log bucketing is replaced by an exact integer method.

Exact time buckets without float64: bucket(dt) = floor(ln(dt) / log_base) changes value only
at integer thresholds T[b] = the smallest dt with bucket(dt) >= b. They are found once on the
host with the reference's own float64 formula; on the device a float32 estimate (within ±1 of
the true bucket: float32 ln has error < 1e-5 in bucket units for dt < 2^62) is corrected with
two integer comparisons against T. The result equals the float64 reference for every dt.

Importable without torch_npu (the functions are plain torch and run on any device, which is
how the CPU tests check them against the reference).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from hstu.model.kernels import reference


def _ref_bucket(dt: int, log_base: float) -> int:
    """The reference formula on one integer (float64, as hstu.model.bias.time_buckets)."""
    return int(math.floor(math.log(float(max(abs(dt), 1))) / log_base))


@lru_cache(maxsize=16)
def bucket_thresholds(num_buckets: int, log_base: float) -> tuple[int, ...]:
    """T[b] for b = 0..num_buckets + 1: smallest integer dt >= 1 with reference bucket >= b.

    Entries past int64 range are clamped to 2^63 - 1 (never reached by Unix-second deltas).
    """
    big = 2**63 - 1
    out = []
    for b in range(num_buckets + 2):
        x = math.exp(b * log_base)
        if x >= 2.0**62:
            out.append(big)
            continue
        t = max(1, math.ceil(x) - 2)
        while _ref_bucket(t, log_base) < b:
            t += 1
        while t > 1 and _ref_bucket(t - 1, log_base) >= b:
            t -= 1
        out.append(t)
    return tuple(out)


def time_buckets(t_q: torch.Tensor, t_k: torch.Tensor, *, num_buckets: int, log_base: float) -> torch.Tensor:
    """Same contract and values as :func:`hstu.model.kernels.reference.time_buckets`, float32 only.

    Args:
        t_q: (B, T) int64 seconds; t_k: (B, S) int64 seconds.
    Returns:
        (B, T, S) int64 in [0, num_buckets].
    """
    thr = torch.tensor(bucket_thresholds(num_buckets, log_base), dtype=torch.int64, device=t_q.device)  # (nb + 2,)
    delta = (t_q.unsqueeze(2) - t_k.unsqueeze(1)).abs().clamp(min=1)  # (B, T, S) int64
    est = torch.floor(torch.log(delta.to(torch.float32)) / log_base).to(torch.int64).clamp(0, num_buckets)  # (B, T, S)
    est = est - (delta < thr[est]).to(torch.int64)  # estimate one too high
    est = est + (delta >= thr[(est + 1).clamp(max=num_buckets + 1)]).to(torch.int64)  # estimate one too low
    return est.clamp(0, num_buckets)


# uvqk, ln_mul and the position-aware attention use matmul / linear / layer_norm / silu /
# index / masked_fill only, all with NPU kernels: the reference functions serve as they are.
uvqk = reference.uvqk
ln_mul = reference.ln_mul
attention = reference.attention
