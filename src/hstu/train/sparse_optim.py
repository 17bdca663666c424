"""Row-wise sparse optimizer for the item table of the single-process recipe.

``[train] table_optimizer = "rowwise_adagrad"`` trains the item table with row-wise AdaGrad on the
rows a batch looks up (the lookup's sparse gradient, ``F.embedding(sparse=True)``) and the rest of
the model with the recipe's AdamW. Row-wise AdaGrad (Duchi et al. 2011, AdaGrad, with one
accumulator per row as in DLRM / FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, the distributed recipe's table
optimizer, :mod:`hstu.train.dist_setup`), for each row r with gradient g_r (d,) in a step::

    s_r <- s_r + mean_j(g_rj ** 2)                 (float32 state, one value per row: R x 4 bytes)
    w_r <- w_r - lr * g_r / (sqrt(s_r) + eps)      (computed in float32, stored in the row dtype)

Rows not looked up are not read or written (bit-identical after the step), unlike AdamW, whose two
float32 moments per element (R x d x 8 bytes) and dense update over the whole table do not fit a
120M-row table in host memory (the plan's accounting: :func:`hstu.model.embedding_plan.state_bytes`).
Duplicate ids in a batch are summed first (the gradient is coalesced).
fp16 and bf16 rows: the hashed table's sparse lookups give float32 gradients whatever the row dtype
(:class:`hstu.model.embedding_rows.SparseRows`; ``F.embedding(sparse=True)`` on fp16 rows has no CPU
kernel to sum two lookups' gradients, "cadd_sparse" not implemented for 'Half' in PyTorch 2.13), the
update is computed in float32 and rounded once to the row dtype. AdamW on fp16 rows stays refused
(:func:`check_table_trainable`). Weight decay does not apply to the table.
"""

from __future__ import annotations

import torch

from hstu.config import ModelConfig, TrainConfig

# Default learning rate of the row-wise table optimizer: the distributed recipe's, measured there
# (hstu.train.dist_setup.TABLE_DEFAULT_LR["rowwise_adagrad"]).
ROWWISE_DEFAULT_LR = 0.1


def table_learning_rate(tcfg: TrainConfig) -> float:
    """The item table's learning rate in the single-process recipe: ``tcfg.learning_rate`` under
    ``table_optimizer`` "adamw" (the table is one of AdamW's parameters), else
    ``tcfg.table_learning_rate`` or, when that is 0, :data:`ROWWISE_DEFAULT_LR`."""
    if tcfg.table_optimizer != "rowwise_adagrad":
        return tcfg.learning_rate
    return tcfg.table_learning_rate or ROWWISE_DEFAULT_LR


def check_table_trainable(mcfg: ModelConfig, tcfg: TrainConfig) -> None:
    """ValueError for an item table that the recipe cannot train: fp16 rows of a hashed table under
    ``[train] table_optimizer`` "adamw" (the second moment of small gradients underflows to 0 in fp16 and
    eps = 1e-8 is below fp16's smallest subnormal, 6e-8, so updates divide by zero: the loss is nan after
    the first steps). bf16 has float32's range and trains; fp16 rows train under "rowwise_adagrad"
    (float32 gradient and accumulator, the update rounded once to fp16)."""
    if mcfg.item_table == "hashed" and mcfg.item_table_dtype == "fp16" and tcfg.table_optimizer != "rowwise_adagrad":
        raise ValueError(
            "[model] item_table_dtype = 'fp16' cannot be trained (AdamW's second moment underflows in fp16: the loss "
            "becomes nan); train with 'fp32' or 'bf16' and store fp16 rows for serving with `hstu quantize --scheme fp16`, "
            "or train the fp16 rows with [train] table_optimizer = 'rowwise_adagrad'"
        )


class RowwiseAdagrad(torch.optim.Optimizer):
    """Row-wise AdaGrad over 2-d parameters (R, d) with sparse (COO, from ``F.embedding(sparse=True)``)
    or dense gradients; see the module docstring for the update.

    Args:
        params: (R, d) tensors of any floating dtype (fp32, fp16, bf16), any device.
        lr: learning rate (> 0).
        eps: added to sqrt(s_r) (> 0).
    State per parameter: ``sum`` (R,) float32 accumulator on the parameter's device, ``step`` ().
    Raises ValueError for a parameter that is not 2-d or a bad lr / eps.
    """

    def __init__(self, params, lr: float = ROWWISE_DEFAULT_LR, eps: float = 1e-8) -> None:
        if not lr > 0:
            raise ValueError(f"RowwiseAdagrad: lr must be > 0, got {lr}")
        if not eps > 0:
            raise ValueError(f"RowwiseAdagrad: eps must be > 0, got {eps}")
        super().__init__(params, {"lr": float(lr), "eps": float(eps), "rowwise": True})
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"RowwiseAdagrad: parameters must be (R, d) tables, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _rowwise_update(p, p.grad, _row_state(self, p), group["lr"], group["eps"])
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As Optimizer.load_state_dict, but the accumulators stay float32 (the base class casts
        floating state to the parameter's dtype, which would round them to bf16 / fp16)."""
        super().load_state_dict(state_dict)
        _restore_sums(self, state_dict)


def _row_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """``opt.state[p]`` with its (R,) float32 ``sum`` and () ``step``, created as zeros on first use."""
    st = opt.state[p]
    if "sum" not in st:
        st["sum"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
        st["step"] = torch.zeros((), dtype=torch.float32)
    return st


def _rowwise_update(p: torch.Tensor, grad: torch.Tensor, st: dict, lr: float, eps: float) -> None:
    """One row-wise AdaGrad step of ``p`` (R, d) in place, only on the rows ``grad`` touches."""
    if grad.is_sparse:
        g = grad.coalesce()
        idx, vals = g.indices()[0], g.values().to(torch.float32)  # (n,), (n, d): unique rows
    else:
        idx = grad.ne(0).any(1).nonzero().squeeze(1)  # a zero-gradient row's step is zero anyway
        vals = grad.index_select(0, idx).to(torch.float32)
    if idx.numel() == 0:
        return
    s = st["sum"].index_select(0, idx).add_(vals.square().mean(1))  # (n,)
    st["sum"].index_copy_(0, idx, s)
    rows = p.data.index_select(0, idx).to(torch.float32)
    rows.addcdiv_(vals, s.sqrt().add_(eps).unsqueeze(1), value=-lr)
    p.data.index_copy_(0, idx, rows.to(p.dtype))
    st["step"] += 1


def _restore_sums(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """Re-set each row-wise group's ``sum`` from ``state_dict`` in float32 after a base-class load."""
    saved = state_dict["state"]
    pid = 0
    for group in opt.param_groups:
        for p in group["params"]:
            if group.get("rowwise") and pid in saved and "sum" in saved[pid]:
                opt.state[p]["sum"] = torch.as_tensor(saved[pid]["sum"]).to(device=p.device, dtype=torch.float32)
            pid += 1


class TableAndDenseOptimizer(torch.optim.AdamW):
    """The recipe's AdamW over the dense parameters plus :class:`RowwiseAdagrad` groups over the
    item table, as one optimizer (one ``step`` / ``zero_grad`` / ``state_dict``, so checkpoints and
    resume, :mod:`hstu.runs`, are unchanged). Groups flagged ``rowwise`` take the row-wise step."""

    def __init__(self, dense, table, tcfg: TrainConfig, table_lr: float, eps: float = 1e-8) -> None:
        super().__init__(dense, lr=tcfg.learning_rate, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
        for p in table:
            if p.dim() != 2:
                raise ValueError(f"table parameters must be (R, d), got shape {tuple(p.shape)}")
        self.add_param_group({"params": list(table), "lr": float(table_lr), "eps": float(eps), "rowwise": True, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        rowwise = [g for g in self.param_groups if g.get("rowwise")]
        self.param_groups[:] = [g for g in self.param_groups if not g.get("rowwise")]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups.extend(rowwise)
        for group in rowwise:
            for p in group["params"]:
                if p.grad is not None:
                    _rowwise_update(p, p.grad, _row_state(self, p), group["lr"], group["eps"])
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        _restore_sums(self, state_dict)
