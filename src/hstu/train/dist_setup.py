"""Distributed training setup: the process group, this rank's device, the options and their arguments.

Backends: gloo on CPU, nccl on CUDA, hccl on Ascend NPU (PyTorch docs, torch.distributed
"Backends"; torch_npu for hccl), each platform's ``Backend.dist_backend`` (:mod:`hstu.backend`).
TorchRec's kernels exist for CPU and CUDA only (``Backend.torchrec_kernels``), so on other devices
the table lives on the CPU with its own gloo group and its rows are moved to the device. The
trainer itself is :mod:`hstu.train.distributed`; its flags are ``hstu train``'s
(:mod:`hstu.train.cli`, argument group "distributed").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hstu import backend
from hstu.config import TrainConfig
from hstu.model.torchrec_tables import (
    SHARDING_TYPES,
)

log = logging.getLogger(__name__)

# torch.distributed backend per device type (PyTorch docs, "Backends"): Backend.dist_backend (old name kept)
DIST_BACKENDS = {name: cls.dist_backend for name, cls in backend.BACKENDS.items()}
# device types FBGEMM / TorchRec have embedding kernels for (Backend.torchrec_kernels); elsewhere the table stays on the CPU
TORCHREC_DEVICE_TYPES = tuple(name for name, cls in backend.BACKENDS.items() if cls.torchrec_kernels)
# table optimizer name -> FBGEMM EmbOptimType member
TABLE_OPTIMIZERS = {
    "sgd": "EXACT_SGD",
    "adagrad": "EXACT_ADAGRAD",
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adam": "ADAM",
    "partial_rowwise_adam": "PARTIAL_ROWWISE_ADAM",
}
CPU_TABLE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")  # FBGEMM's CPU kernels (fbgemm-gpu 1.8.0)
# Default table learning rates. Measured on ML-1M, first 1000 users, small preset with
# max_seq_len 50, 5 epochs, seed 1, 2 ranks, negatives_chunk 16 (torchrun --nproc-per-node 2 -m
# hstu.train --config C --max-users 1000 --table-learning-rate LR): valid NDCG@10 of
# rowwise_adagrad 0.076 / 0.073 / 0.065 at lr 0.03 / 0.1 / 0.3 (with per-sequence negatives:
# 0.060 / 0.074 / 0.077 / 0.071 at 0.01 / 0.05 / 0.1 / 0.2), sgd 0.072 at lr 1.0; the
# single-process recipe (AdamW lr 1e-3 on the table too) reaches 0.024 there. Differences
# under ~0.01 are within the noise of 1000 users.
TABLE_DEFAULT_LR = {"sgd": 1.0, "adagrad": 0.1, "rowwise_adagrad": 0.1}


@dataclass
class DistConfig:
    """Settings of the distributed recipe (the rest comes from ModelConfig and TrainConfig).

    sharding: TorchRec layout of the item table: "row_wise", "column_wise" (R equal
        column blocks) or "table_wise" (whole table on rank 0).
    table_optimizer: fused FBGEMM optimizer of the item table (see the module docstring).
    table_learning_rate: its learning rate; None = TABLE_DEFAULT_LR[table_optimizer] (the adam
        types: TrainConfig.learning_rate).
    table_eps: epsilon of the adagrad / adam table optimizers.
    timeout_s: collective timeout (a rank that dies makes the others fail after this long).
    """

    sharding: str = "row_wise"
    table_optimizer: str = "rowwise_adagrad"
    table_learning_rate: float | None = None
    table_eps: float = 1e-8
    timeout_s: float = 1800.0

    def validate(self) -> None:
        if self.sharding not in SHARDING_TYPES:
            raise ValueError(f"DistConfig.sharding: unknown {self.sharding!r}; valid: {', '.join(SHARDING_TYPES)}")
        if self.table_optimizer not in TABLE_OPTIMIZERS:
            raise ValueError(f"DistConfig.table_optimizer: unknown {self.table_optimizer!r}; valid: {', '.join(TABLE_OPTIMIZERS)}")
        if self.table_learning_rate is not None and not self.table_learning_rate > 0:
            raise ValueError(f"DistConfig.table_learning_rate must be > 0, got {self.table_learning_rate}")
        if not self.timeout_s > 0:
            raise ValueError(f"DistConfig.timeout_s must be > 0, got {self.timeout_s}")

    def learning_rate(self, tcfg: TrainConfig) -> float:
        if self.table_learning_rate is not None:
            return self.table_learning_rate
        return TABLE_DEFAULT_LR.get(self.table_optimizer, tcfg.learning_rate)


# ---------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------


@dataclass
class DistContext:
    """This process's place in the job.

    dense_pg: the default group (DDP, table gathers, metrics); table_pg: a second group used only
    by TorchRec's all-to-alls, so that they never interleave with DDP's asynchronous all-reduces
    on one connection. table_device: where the table's shards live.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: backend.Backend
    dist_backend: str
    table_device: torch.device
    dense_pg: Any
    table_pg: Any
    owns_group: bool

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer (set by torchrun)") from None


def init_distributed(device: str = "cpu", *, timeout_s: float = 1800.0) -> DistContext:
    """Join (or create) the process group and pick this rank's device.

    Reads torchrun's RANK, WORLD_SIZE, LOCAL_RANK; without them (a plain ``python -m``) it
    starts a world of one (an in-memory HashStore, no port). If ``torch.distributed`` is already initialised (e.g.
    by a test's spawn), that group is used and not destroyed by :func:`shutdown`.

    Args:
        device: "auto" | "cpu" | "cuda" | "npu"; rank r uses index LOCAL_RANK of that kind.
    Raises:
        ValueError: malformed torchrun variables, unknown device.
        BackendUnavailableError: the device is not usable.
    """
    local_rank = _env_int("LOCAL_RANK", 0)
    dev = backend.select_local(device, local_rank)
    dev.set_current()  # nccl / hccl bind to the current device
    dist_backend = dev.dist_backend
    owns = not dist.is_initialized()
    if owns:
        world = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        store = None
        if "MASTER_ADDR" not in os.environ:
            if world > 1:
                raise ValueError("WORLD_SIZE > 1 but MASTER_ADDR is not set: start the job with torchrun")
            store = dist.HashStore()  # a world of one needs no rendezvous port (a free port can be taken before it is bound)
        dist.init_process_group(dist_backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), store=store)
    else:
        dist_backend = str(dist.get_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    host = backend.select("cpu")
    table_device = dev.device if dev.torchrec_kernels else host.device
    # a group of its own for TorchRec's all-to-alls (the host's, gloo, when the table stays on the CPU)
    table_pg = dist.new_group(backend=dist_backend if dev.torchrec_kernels else host.dist_backend, timeout=timedelta(seconds=timeout_s))
    log.info("rank %d/%d on %s (%s); item table on %s", rank, world, dev.device, dist_backend, table_device)
    return DistContext(rank, world, local_rank, dev, dist_backend, table_device, dist.group.WORLD, table_pg, owns)


def shutdown(ctx: DistContext) -> None:
    """Destroy the table's group, and the default group if :func:`init_distributed` created it."""
    if not dist.is_initialized():
        return
    if ctx.owns_group:
        dist.destroy_process_group()  # all groups
    else:
        dist.destroy_process_group(ctx.table_pg)
