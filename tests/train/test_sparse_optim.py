"""Row-wise AdaGrad on the item table (hstu.train.sparse_optim): one step against a float64 hand
computation, untouched rows bit-identical, state of R x 4 bytes, the mixed optimizer's checkpoint
round trip, the plan's accounting and a bf16 hashed table trained and resumed by fit."""

from __future__ import annotations

import pytest
import torch

from hstu.config import ModelConfig, TrainConfig, model_config_from_preset
from hstu.model.embedding import ShardedEmbedding
from hstu.model.embedding_plan import grad_bytes, state_bytes
from hstu.train.sparse_optim import RowwiseAdagrad, TableAndDenseOptimizer


def _hand_step(w0: torch.Tensor, ids: torch.Tensor, upstream: torch.Tensor, lr: float, eps: float, s0: torch.Tensor):
    """float64 row-wise AdaGrad of w0 (R, d) for the loss sum(upstream * w0[ids]), written out per row."""
    w, s = w0.double().clone(), s0.double().clone()
    for r in sorted(set(ids.tolist())):
        g = upstream[ids == r].double().sum(0)  # duplicates summed
        s[r] += (g * g).mean()
        w[r] -= lr * g / (s[r].sqrt() + eps)
    return w, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_step_equals_float64_hand_computation(dtype):
    torch.manual_seed(0)
    R, d, lr, eps = 10, 4, 0.1, 1e-8
    table = torch.nn.Parameter((torch.randn(R, d) * 0.1).to(dtype))
    w0 = table.detach().clone()
    opt = RowwiseAdagrad([table], lr=lr, eps=eps)
    ids = torch.tensor([3, 7, 3, 1])
    upstream = torch.randint(-8, 9, (ids.numel(), d)) / 8.0  # exact in bf16, and so are the duplicate sums
    for step in range(2):  # the second step reads the accumulated state
        before = table.detach().clone()
        s_before = opt.state[table]["sum"].clone() if step else torch.zeros(R)
        opt.zero_grad()
        (torch.nn.functional.embedding(ids, table, sparse=True).float() * upstream).sum().backward()
        assert table.grad.is_sparse
        opt.step()
        want_w, want_s = _hand_step(before, ids, upstream, lr, eps, s_before)
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(table.detach().double(), want_w.to(dtype).double(), atol=tol, rtol=0)
        torch.testing.assert_close(opt.state[table]["sum"].double(), want_s, atol=1e-7, rtol=1e-6)
    untouched = torch.tensor([r for r in range(R) if r not in (1, 3, 7)])
    assert torch.equal(table.detach()[untouched], w0[untouched])  # bit-identical
    assert opt.state[table]["sum"].dtype == torch.float32
    assert opt.state[table]["sum"].numel() * 4 == state_bytes("rowwise_adagrad", R, d) == R * 4
    assert state_bytes("adamw", R, d) == R * d * 8 and state_bytes("adamw", R, d, 2) == R * d * 4
    assert grad_bytes("rowwise_adagrad", R, d, 2) == 0


def test_sharded_table_sparse_lookup_updates_only_looked_up_rows():
    emb = ShardedEmbedding(50, 8, num_shards=3, dtype="bf16", num_overflow_rows=1, check_memory=False, sparse=True)
    before = [p.detach().clone() for p in emb.shards]
    dense = torch.nn.Linear(8, 1)
    opt = TableAndDenseOptimizer(list(dense.parameters()), list(emb.shards), TrainConfig(), 0.1)
    ids = torch.tensor([[5, 9, 0], [9, 17, 0]])
    dense(emb(ids)).sum().backward()
    assert all(p.grad is None or p.grad.is_sparse for p in emb.shards)
    opt.step()
    changed = sum(int((p.detach() != b).any(1).sum()) for p, b in zip(emb.shards, before, strict=True))
    assert changed == 3  # rows of 5, 9, 17 (the padding row 0 has a zero gradient)
    sums = [opt.state[p]["sum"] for p in emb.shards if p in opt.state]
    assert sum(int((s > 0).sum()) for s in sums) == 3
    assert sum(s.numel() for s in sums) <= sum(p.shape[0] for p in emb.shards)


def test_state_dict_round_trip_keeps_float32_sums():
    torch.manual_seed(1)
    table = torch.nn.Parameter(torch.randn(6, 4).to(torch.bfloat16))
    lin = torch.nn.Linear(4, 1)
    opt = TableAndDenseOptimizer(list(lin.parameters()), [table], TrainConfig(), 0.1)
    lin(torch.nn.functional.embedding(torch.tensor([1, 2]), table, sparse=True).float()).sum().backward()
    opt.step()
    sd = opt.state_dict()
    opt2 = TableAndDenseOptimizer(list(lin.parameters()), [table], TrainConfig(), 0.1)
    opt2.load_state_dict(sd)
    assert opt2.state[table]["sum"].dtype == torch.float32
    assert torch.equal(opt2.state[table]["sum"], opt.state[table]["sum"])


def test_table_optimizer_is_validated():
    with pytest.raises(ValueError, match="table_optimizer"):
        TrainConfig(table_optimizer="sgd").validate()


def test_plan_counts_the_table_optimizer():
    from hstu.model.embedding_plan import plan_memory

    V, d = 120_000_001, 32
    rows = [30_000_001] * 3 + [29_999_999]
    kw = dict(dtype="bf16", num_shards=4, num_overflow_rows=1, device_is_host=True, host_mem="23GiB", shard_rows=rows)
    alone = plan_memory(V, d, **kw)
    adamw = plan_memory(V, d, optimizer="adamw", **kw)
    rowwise = plan_memory(V, d, optimizer="rowwise_adagrad", **kw)
    T = V + 1
    assert alone.table_bytes == T * d * 2 and alone.fits  # 7.2 GB of bf16 rows
    assert rowwise.optimizer_bytes == T * 4 and rowwise.fits
    assert rowwise.device_bytes == alone.device_bytes + T * 4
    assert adamw.optimizer_bytes == T * d * (4 + 2 + 2) and not adamw.fits  # bf16 moments + dense grad + foreach sqrt: 31 GB


def test_bf16_hashed_table_trains_and_resumes_with_rowwise_adagrad(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import TINY_MODEL, tiny_csv

    from hstu.data.prepare import DataSpec
    from hstu.runs import read_history
    from hstu.train import loop

    spec = DataSpec("csv", str(tiny_csv(tmp_path)), options={"columns": "user=u,item=i,time=t"})
    mcfg = ModelConfig(**TINY_MODEL, item_table="hashed", item_table_shards=2, item_table_dtype="bf16")

    def fit(epochs, **kw):
        tcfg = TrainConfig(epochs=epochs, batch_size=8, num_negatives=4, table_optimizer="rowwise_adagrad")
        return loop.fit(tmp_path / "run", mcfg, tcfg, spec, progress=False, **kw)

    fit(1)
    m = fit(2, resume=True)  # the float32 accumulators come back from last.safetensors
    hist = read_history(tmp_path / "run")
    assert len(hist) == 2 and all(0 < e["loss"] < float("inf") for e in hist)
    assert all(abs(v) < float("inf") for k, v in m["test"].items() if k != "users")


def test_table_optimizer_flags_train_as_the_config_fields_and_the_recipe_states_them(tmp_path, capsys):
    """hstu train --table-optimizer rowwise_adagrad --table-learning-rate 0.05 trains the same
    weights as fit with those [train] fields (same seed), other weights than AdamW's; config.json,
    metrics.json's recipe and the log's recipe line state them; refusals name the flag."""
    import json
    import logging
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import TINY_MODEL, tiny_csv_flags

    from hstu.cli import main
    from hstu.data.prepare import DataSpec
    from hstu.model.checkpoint import read_safetensors
    from hstu.train import loop

    flags = tiny_csv_flags(tmp_path, train={"epochs": 1})
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda rec: lines.append(rec.getMessage())
    logger = logging.getLogger("hstu.train.loop")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        table = ["--table-optimizer", "rowwise_adagrad", "--table-learning-rate", "0.05"]
        assert main(["train", *flags, *table, "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    train = json.loads((tmp_path / "cli" / "config.json").read_text())["train"]
    assert (train["table_optimizer"], train["table_learning_rate"]) == ("rowwise_adagrad", 0.05)
    rec = json.loads((tmp_path / "cli" / "metrics.json").read_text())["recipe"]
    assert (rec["table_optimizer"], rec["table_learning_rate"]) == ("rowwise_adagrad", 0.05)
    assert any(x.startswith("recipe: ") and ", item table rowwise_adagrad (lr 0.05), lr x 0.5 after 3 epochs" in x for x in lines), lines

    spec = DataSpec("csv", flags[flags.index("--data-dir") + 1], options={"columns": "user=u,item=i,time=t"})
    common = dict(epochs=1, batch_size=8, num_negatives=4, early_stopping_patience=99)
    for name, kw in (("api", {"table_optimizer": "rowwise_adagrad", "table_learning_rate": 0.05}), ("adamw", {})):
        mcfg = model_config_from_preset("small", num_items=0, **TINY_MODEL)  # as `hstu train`: the preset under the [model] table
        loop.fit(tmp_path / name, mcfg, TrainConfig(**common, **kw), spec, progress=False)
    w = {n: read_safetensors(tmp_path / n / "model.safetensors")["item_emb.weight"] for n in ("cli", "api", "adamw")}
    assert torch.equal(w["cli"], w["api"]) and not torch.equal(w["cli"], w["adamw"])

    capsys.readouterr()
    for extra, err in (
        (["--table-optimizer", "sgd"], "--table-optimizer sgd: FBGEMM's, only with --distributed; in one process: adamw, rowwise_adagrad"),
        (["--table-learning-rate", "0.1"], "--table-learning-rate 0.1 needs --table-optimizer rowwise_adagrad"),
        (["--distributed", "--table-optimizer", "adamw"], "--table-optimizer adamw: not an FBGEMM optimizer (--distributed)"),
    ):
        assert main(["train", *flags, *extra, "--out", str(tmp_path / "bad"), "--quiet"]) == 2
        assert err in capsys.readouterr().err
    (tmp_path / "f").mkdir()  # a trial: the config file's rate without rowwise_adagrad was recorded and ignored
    bad = tiny_csv_flags(tmp_path / "f", train={"epochs": 1, "table_learning_rate": 0.5})
    assert main(["train", *bad, "--out", str(tmp_path / "bad"), "--quiet"]) == 2 and not (tmp_path / "bad").exists()
    assert "[train] table_learning_rate = 0.5 needs table_optimizer = 'rowwise_adagrad'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"table_learning_rate = 0.5 needs table_optimizer = 'rowwise_adagrad'"):
        loop.fit(tmp_path / "bad", mcfg, TrainConfig(**common, table_learning_rate=0.5), spec, progress=False)
    data = flags[: flags.index("--config")]
    resume = ["train", *data, "--epochs", "2", "--out", str(tmp_path / "cli"), "--resume", "--quiet"]
    assert main([*resume, "--table-optimizer", "adamw"]) == 2
    assert "--table-optimizer is 'adamw' here but 'rowwise_adagrad' in the run" in capsys.readouterr().err
    assert main([*resume, "--table-learning-rate", "0.2"]) == 2
    assert "--table-learning-rate is 0.2 here but 0.05 in the run" in capsys.readouterr().err
    assert main([*resume, "--table-learning-rate", "0.05"]) == 0  # the run's own rate: resumed
    assert len(json.loads((tmp_path / "cli" / "history.json").read_text())) == 2
    legacy = tmp_path / "legacy"  # recorded before the refusal (adamw beside a rate it ignored): resumes as it was
    assert main(["train", *flags, "--out", str(legacy), "--quiet"]) == 0
    cfg = json.loads((legacy / "config.json").read_text())
    cfg["train"]["table_learning_rate"] = 0.1
    (legacy / "config.json").write_text(json.dumps(cfg))
    assert main(["train", *data, "--epochs", "2", "--out", str(legacy), "--resume", "--quiet"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("shards", [1, 3])
def test_fp16_rows_step_equals_float64_hand_computation(shards):
    """fp16 rows looked up twice in a step (inputs and targets, as training does): the gradient reaches
    each shard as a float32 sparse tensor (no Half sparse sum), and the rows after two steps equal a
    float64 row-wise AdaGrad rounded once to fp16 per step; gradients of 1e-6 (subnormal in fp16) keep
    their precision. Rows not looked up are bit-identical."""
    torch.manual_seed(2)
    V, d, lr, eps = 40, 4, 0.1, 1e-8
    emb = ShardedEmbedding(V, d, num_shards=shards, dtype="fp16", num_overflow_rows=1, check_memory=False, sparse=True, init_std=0.1)
    opt = TableAndDenseOptimizer([torch.nn.Parameter(torch.zeros(1))], list(emb.shards), TrainConfig(), lr, eps=eps)
    ids_a, ids_b = torch.tensor([3, 7, 3, 11]), torch.tensor([7, 19, 11])
    up_a, up_b = torch.randn(4, d).double() * 1e-6, torch.randn(3, d).double() * 1e-6
    T = V + 1
    w0 = emb._lookup_global(torch.arange(T)).detach().double()  # (T, d) global rows, exact fp16 values
    w, s = w0.clone(), torch.zeros(T, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        ((emb(ids_a).double() * up_a).sum() + (emb(ids_b).double() * up_b).sum()).backward()
        assert all(p.grad is None or (p.grad.is_sparse and p.grad.dtype == torch.float32) for p in emb.shards)
        opt.step()
        ids, up = torch.cat([ids_a, ids_b]), torch.cat([up_a, up_b])
        want, s = _hand_step(w, ids, up, lr, eps, s)
        w = want.to(torch.float16).double()  # the stored rows: rounded once per step
        got = emb._lookup_global(torch.arange(T)).detach().double()
        # one fp16 rounding of the float64 result (half a unit in the last place, 2^-11 relative) apart at most
        torch.testing.assert_close(got, w, atol=0, rtol=2.0**-10)
    untouched = torch.tensor([r for r in range(T) if r not in (3, 7, 11, 19)])
    assert torch.equal(got[untouched], w0[untouched])  # bit-identical
    assert all(p.dtype == torch.float16 for p in emb.shards)
    sums = torch.cat([opt.state[p]["sum"] for p in emb.shards if p in opt.state])
    assert sums.dtype == torch.float32 and int((sums > 0).sum()) == 4


def test_fp16_table_is_refused_under_adamw_and_accepted_under_rowwise_adagrad():
    from hstu.train.sparse_optim import check_table_trainable

    mcfg = ModelConfig(num_items=10, item_table="hashed", item_table_dtype="fp16")
    with pytest.raises(ValueError, match=r"item_table_dtype = 'fp16' cannot be trained \(AdamW.*table_optimizer = 'rowwise_adagrad'"):
        check_table_trainable(mcfg, TrainConfig())
    check_table_trainable(mcfg, TrainConfig(table_optimizer="rowwise_adagrad"))


def test_fp16_hashed_table_trains_and_resumes_with_rowwise_adagrad(tmp_path):
    """A tiny hashed fp16 run through fit: the loss falls over epochs, the run resumes, the rows stay fp16."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import TINY_MODEL, tiny_csv

    from hstu.data.prepare import DataSpec
    from hstu.model.checkpoint import read_safetensors
    from hstu.runs import read_history
    from hstu.train import loop

    spec = DataSpec("csv", str(tiny_csv(tmp_path)), options={"columns": "user=u,item=i,time=t"})
    mcfg = ModelConfig(**TINY_MODEL, item_table="hashed", item_table_shards=2, item_table_dtype="fp16")

    def fit(epochs, **kw):
        tcfg = TrainConfig(epochs=epochs, batch_size=8, num_negatives=4, table_optimizer="rowwise_adagrad", early_stopping_patience=99)
        return loop.fit(tmp_path / "run", mcfg, tcfg, spec, progress=False, **kw)

    fit(2)
    m = fit(4, resume=True)
    hist = read_history(tmp_path / "run")
    losses = [e["loss"] for e in hist]
    assert len(losses) == 4 and all(0 < x < float("inf") for x in losses)
    assert losses[-1] < losses[0], losses
    assert all(abs(v) < float("inf") for k, v in m["test"].items() if k != "users")
    w = read_safetensors(tmp_path / "run" / "model.safetensors")
    assert {w[f"item_emb.shards.{s}"].dtype for s in range(2)} == {torch.float16}


_ADAMW_STEP = """
import sys, torch
from pathlib import Path
from hstu.model.embedding_plan import plan_memory
torch.set_num_threads(1)
R, d = int(sys.argv[1]), int(sys.argv[2])
p = torch.nn.Parameter(torch.empty(R, d).normal_())  # the table, every page written
w = torch.nn.Parameter(torch.zeros(8, d)); w.grad = torch.ones(8, d); torch.optim.AdamW([w], foreach=True).step()  # lazy inits
opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
# VmHWM reset to the current RSS (clear_refs 5), not ru_maxrss: execve keeps the forking parent's
# maximum, so under a large pytest process ru_maxrss never grew (measured 0 in a full run)
Path("/proc/self/clear_refs").write_text("5")
hwm = lambda l: int(l.split()[1]) * 1024  # kB
peak = lambda: next(hwm(l) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
before = peak()
p.grad = torch.empty_like(p).normal_()  # the dense gradient a backward leaves
opt.step()
plan = plan_memory(R - 1, d, num_shards=1, num_overflow_rows=1, optimizer="adamw", device_is_host=True)
print(peak() - before, plan.optimizer_bytes)
"""


def test_plan_covers_the_peak_of_an_adamw_step():
    """The plan's AdamW bytes (moments + dense gradient + the foreach step's sqrt temporary) cover the
    measured growth of peak RSS over one first AdamW step on a 2M x 32 float32 table (gradient
    included) up to 1 MiB, and overestimate it by at most 1.3x. In a fresh process: VmHWM (reset) is the step.s
    peak; each 256 MB block is its own mmap, returned to the OS when freed."""
    import subprocess
    import sys

    R, d = 2_000_000, 32
    out = subprocess.run([sys.executable, "-c", _ADAMW_STEP, str(R), str(d)], capture_output=True, text=True, check=True, timeout=300)
    grown, planned = map(int, out.stdout.split())
    assert planned == R * d * 4 * 4  # grad + 2 moments + sqrt of exp_avg_sq
    # + 1 MiB: the step's allocations besides the table-sized ones (step counters, bias corrections; measured
    # 0 and 64 KiB after the warm-up step on a small table, 5.8 MB without it). Without the sqrt temporary the
    # plan would be 768 MB, 256 MB short
    assert grown <= planned + 2**20 and planned <= 1.3 * grown, (grown, planned)
