"""A CPU process never imports triton: its compiled extension prints nanobind reference-leak lines at
every exit (seen at each `hstu serve` stop). The Triton kernels load only where they run."""

from __future__ import annotations

import os
import subprocess
import sys

from hstu.model.kernels import triton_hstu

CODE = """
import sys
import torch
from hstu.config import ModelConfig
from hstu.generate.engine import Engine
from hstu.model import build_hstu
m = build_hstu(ModelConfig(num_items=30, max_seq_len=12, max_output_len=2, embedding_dim=8, num_blocks=1, num_heads=1)).eval()
eng = Engine(m, buckets=(12,), max_batch=2, k_max=2, graphs="auto")
ids = torch.randint(1, 31, (2, 12))
ts = torch.sort(torch.randint(10**8, 10**8 + 10**6, (2, 12)), dim=1).values
out = eng.generate(ids, ts, torch.tensor([5, 12]), 2)
assert out.items.shape == (2, 2), out.items.shape
print("triton" in sys.modules)
"""


def test_a_cpu_model_does_not_import_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    assert "leaked" not in out.stderr


def test_the_kernel_still_says_why_it_cannot_run_on_the_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    why = triton_hstu.available("cpu")
    assert why is not None and ("TRITON_INTERPRET=1" in why or "not installed" in why)


def test_the_http_process_model_does_not_import_triton(run_dir):
    """``Recommender.mapping_only`` (what the HTTP process of ``hstu serve`` loads): the model built on the
    meta device without its random initialisers, which on meta import torch._dynamo and through it triton."""
    code = (
        "import sys\n"
        "from hstu.generate.recommend import Recommender\n"
        f"rec = Recommender.mapping_only({str(run_dir)!r})\n"
        "assert rec.model.item_emb.weight.is_meta and rec.model.cfg.num_items > 0\n"
        "print('torch._dynamo' in sys.modules, 'triton' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    assert "leaked" not in out.stderr
