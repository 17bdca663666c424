"""hstu doctor --conformance: op recording, replay against the CPU reference, the report and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hstu.config import ModelConfig
from hstu.model import build_hstu
from hstu.ops.conformance import Conformance, OpRecorder, relative_error, replay


def _tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(num_items=40, embedding_dim=8, num_blocks=2, num_heads=1, max_seq_len=50, dropout=0.0)
    return build_hstu(cfg).eval()


def test_relative_error_by_hand():
    want = torch.tensor([1.0, -4.0, 2.0])
    assert relative_error(torch.tensor([1.0, -4.0, 2.2]), want) == pytest.approx(0.2 / 4.0)
    assert relative_error(torch.tensor([1.0, float("nan"), 2.0]), want) == float("inf")
    assert relative_error(torch.tensor([1.0, 2.0]), want) == float("inf")  # shape mismatch
    assert relative_error(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])) == 0.0
    assert relative_error(torch.tensor([1, 0, 3, 4]), torch.tensor([1, 2, 3, 4])) == pytest.approx(0.25)


def test_recorder_keeps_forward_and_backward_ops_with_inputs_before_the_call():
    x = torch.ones(3, requires_grad=True)
    rec = OpRecorder(calls_per_op=5)
    with rec:
        y = torch.nn.functional.silu(x * 2.0)
        y.sum().backward()
        z = torch.zeros(2)
        z.add_(1.0)
    assert "aten.silu.default" in rec.calls and "aten.silu_backward.default" in rec.calls
    call = rec.calls["aten.add_.Tensor"][0]
    assert torch.equal(call.args[0], torch.zeros(2)) and torch.equal(call.out, torch.ones(2))  # input cloned before the in-place op


def test_cpu_self_check_passes_and_covers_the_model():
    c = Conformance(_tiny(), torch.device("cpu"), buckets=(20, 50), reps=2)
    report = c.run()
    assert report["status"] == "pass", report["ops_failed"]
    names = {r["op"] for r in report["ops"]}
    for op in ("aten.silu.default", "aten.silu_backward.default", "aten.native_layer_norm.default", "aten.embedding.default"):
        assert op in names
    assert all(r["calls_in_model"] >= r["calls_checked"] for r in report["ops"])
    assert report["end_to_end"]["next5_same_items_ratio"] == 1.0
    assert report["graphs"]["status"] == "skipped"


def test_a_device_that_gets_one_op_wrong_is_caught():
    """A replay that perturbs every silu output by 1 % stands in for a device kernel with an error."""

    def faulty(func, args, kwargs):
        out = func(*args, **kwargs)
        return out * 1.01 if str(func).startswith("aten.silu.") else out

    c = Conformance(_tiny(), torch.device("cpu"), buckets=(20, 50), reps=2)
    rows = {r["op"]: r for r in replay(c.record(), torch.device("cpu"), faulty)}
    assert rows["aten.silu.default"]["status"] == "fail"
    assert rows["aten.silu.default"]["max_rel_error"] == pytest.approx(0.01, rel=1e-3)
    assert rows["aten.mm.default"]["status"] == "pass"
    report = c.run(faulty)
    assert report["status"] == "fail" and "aten.silu.default" in report["ops_failed"]


def test_an_op_the_device_cannot_run_is_an_error_row():
    def broken(func, args, kwargs):
        if str(func) == "aten.gather.default":
            raise RuntimeError("kernel not implemented")
        return func(*args, **kwargs)

    c = Conformance(_tiny(), torch.device("cpu"), buckets=(20, 50))
    rows = {r["op"]: r for r in replay(c.record(), torch.device("cpu"), broken)}
    assert rows["aten.gather.default"]["status"] == "error" and "not implemented" in rows["aten.gather.default"]["error"]


def test_cli_without_an_npu_says_so_exits_2_and_writes_nothing(tmp_path):
    pytest.importorskip("numpy")
    try:
        import torch_npu  # noqa: F401

        pytest.skip("torch_npu is installed here")
    except ImportError:
        pass
    report = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "hstu", "doctor", "--conformance", "--report", str(report)], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert "no npu device here" in p.stderr and "torch_npu" in p.stderr
    assert not report.exists()


def test_cli_cpu_self_check_writes_the_report(tmp_path):
    report = tmp_path / "conf.json"
    p = subprocess.run(
        [sys.executable, "-m", "hstu", "doctor", "--conformance", "--device", "cpu", "--reps", "2", "--report", str(report)],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(report.read_text())
    assert d["status"] == "pass" and d["device"]["device"] == "cpu" and len(d["ops"]) > 40
    assert "PASS" in p.stdout and str(report) in p.stdout
