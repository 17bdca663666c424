"""Kernel registry and per-backend kernels against the PyTorch reference (float64 oracle).

The Triton kernel is checked with Triton's CPU interpreter (TRITON_INTERPRET=1, in a child
process because the flag is read when the kernel is defined) where triton is installed, and on
a GPU by the cuda-marked test. The NPU set runs here on the CPU (plain torch ops)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hstu.config import ModelConfig
from hstu.generate import exclusion_mask, generate
from hstu.generate.engine import Engine
from hstu.model import build_hstu
from hstu.model.attention import hstu_attention_reference
from hstu.model.bias import RelativeBias, time_buckets
from hstu.model.kernels import NPU, available_kernels, get_kernels, register_kernels
from hstu.model.kernels import npu as npu_k
from hstu.model.kernels import reference as ref


def rand_qkv(B=2, H=2, T=7, S=7, dq=5, dv=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, T, dq, generator=g, dtype=dtype),
        torch.randn(B, H, S, dq, generator=g, dtype=dtype),
        torch.randn(B, H, S, dv, generator=g, dtype=dtype),
    )


def test_reference_attention_equals_model_attention_with_bias():
    """Square causal case: bias formed inside == RelativeBias + hstu_attention_reference."""
    B, W, N = 2, 9, 30
    q, k, v = rand_qkv(B=B, T=W, S=W)
    rb = RelativeBias(width=N, num_buckets=20).double()
    g = torch.Generator().manual_seed(1)
    ts = torch.sort(torch.randint(0, 10**6, (B, W + 1), generator=g), dim=1).values
    tb_model = time_buckets(ts[:, : W + 1], 20)[:, :W, :W]  # (B, W, W) over the first W rows, t[i+1] from W + 1 columns
    want = hstu_attention_reference(q, k, v, rb(tb_model), n=N)
    tb = ref.time_buckets(ts[:, 1:], ts[:, :W], num_buckets=20, log_base=0.301)
    pos = torch.arange(W)
    got = ref.attention(q, k, v, q_pos=pos, k_pos=pos, k_valid=None, tb=tb, pos_w=rb.pos_w, ts_w=rb.ts_w, n=N)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_attention_splits_over_key_segments_and_masks_stale_rows():
    """No softmax: A·V over keys [0, 4) + [4, 9) equals the whole; masked keys holding large
    stale values (another request's cache rows) contribute exactly 0."""
    q, k, v = rand_qkv(T=1, S=9)
    N = 20
    pw = torch.randn(2 * N - 1, dtype=torch.float64)
    qp = torch.tensor([[6], [6]])
    kp = torch.arange(9).expand(2, 9)
    whole = ref.attention(q, k, v, q_pos=qp, k_pos=kp, k_valid=None, tb=None, pos_w=pw, ts_w=None, n=N)
    a = ref.attention(q, k[:, :, :4], v[:, :, :4], q_pos=qp, k_pos=kp[:, :4], k_valid=None, tb=None, pos_w=pw, ts_w=None, n=N)
    b = ref.attention(q, k[:, :, 4:], v[:, :, 4:], q_pos=qp, k_pos=kp[:, 4:], k_valid=None, tb=None, pos_w=pw, ts_w=None, n=N)
    torch.testing.assert_close(a + b, whole, rtol=1e-12, atol=1e-12)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 7:] = 1e6  # positions 7, 8 > query position 6: masked
    v2[:, :, 7:] = 1e6
    k2[:, :, 3], v2[:, :, 3] = -1e6, 1e6  # row 3 marked invalid (padding)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[:, 3] = False
    without3 = whole - ref.attention(
        q, k[:, :, 3:4], v[:, :, 3:4], q_pos=qp, k_pos=kp[:, 3:4], k_valid=None, tb=None, pos_w=pw, ts_w=None, n=N
    )
    got = ref.attention(q, k2, v2, q_pos=qp, k_pos=kp, k_valid=valid, tb=None, pos_w=pw, ts_w=None, n=N)
    torch.testing.assert_close(got, without3, rtol=1e-12, atol=1e-12)


def test_npu_time_buckets_exact_without_float64():
    nb, base = 128, 0.301
    thr = npu_k.bucket_thresholds(nb, base)
    deltas = {0, 1, 2, 3}
    for t in thr[:70]:  # every bucket boundary of realistic deltas (up to ~2^30 s), each side
        deltas |= {t - 1, t, t + 1}
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(0, 2**40, (2000,), generator=g).tolist()
    d = torch.tensor(sorted(x for x in deltas | set(rnd) if 0 <= x < 2**53), dtype=torch.int64)
    t_q = torch.full((1, 1), 2**53, dtype=torch.int64)
    t_k = (2**53 - d).view(1, -1)
    want = ref.time_buckets(t_q, t_k, num_buckets=nb, log_base=base)
    got = npu_k.time_buckets(t_q, t_k, num_buckets=nb, log_base=base)
    assert torch.equal(got, want)
    # clamping at a small bucket count
    small = dict(num_buckets=10, log_base=base)
    assert torch.equal(npu_k.time_buckets(t_q, t_k, **small), ref.time_buckets(t_q, t_k, **small))


def test_registry_errors_and_listing():
    assert {"reference", "triton"} <= set(available_kernels("cpu")) and "triton" in available_kernels("cuda")
    assert "npu" in available_kernels("npu") and "npu" not in available_kernels("cpu")
    with pytest.raises(ValueError, match="kernels = 'npu': no such kernel set for backend 'cpu'; valid: \\['auto', .*'reference'"):
        get_kernels("cpu", "npu")
    with pytest.raises(ValueError, match="unknown backend"):
        get_kernels("tpu")
    with pytest.raises(ValueError, match="already registered"):
        register_kernels("cpu", get_kernels("cpu", "reference"))
    assert get_kernels("npu").name == "npu"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        assert get_kernels("cuda").name == "reference"  # auto: triton cannot run without a GPU
        for backend in ("cpu", "cuda"):
            with pytest.raises(RuntimeError, match=f"cannot run on {backend}"):
                get_kernels(backend, "triton")


def test_engine_with_npu_kernel_set_on_cpu_matches_reference():
    """The whole NPU set (float32 buckets) inside the engine, run on the CPU."""
    if "npu-on-cpu" not in available_kernels("cpu"):
        register_kernels("cpu", dataclasses.replace(NPU, name="npu-on-cpu"))
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_items=200, max_seq_len=30, max_output_len=4, embedding_dim=16, num_blocks=2, num_heads=2, d_qk=8, d_v=8, dropout=0.0
    )
    m = build_hstu(cfg).eval()
    eng = Engine(m, buckets=(10, 30), max_batch=4, k_max=4, kernels="npu-on-cpu")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 201, (3, 30), generator=g)
    ts = torch.sort(torch.randint(10**8, 10**8 + 10**7, (3, 30), generator=g), dim=1).values
    L = torch.tensor([3, 10, 30])
    got = eng.generate(ids, ts, L, 4)
    want = generate(m, ids, ts, L, 4, request_time=ts[torch.arange(3), L - 1], exclude=exclusion_mask(200, 3, None, None))
    assert torch.equal(got.items, want.items)
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-4)


TRITON_CHECK = textwrap.dedent("""
    import torch
    from hstu.model.kernels import reference as ref, triton_hstu as tk, get_kernels
    assert get_kernels("cuda", "triton").name == "triton"
    dev = "{dev}"
    g = torch.Generator().manual_seed(0)
    for (B, H, T, S, dq, dv, valid) in [(2, 2, 5, 5, 8, 6, False), (1, 1, 1, 40, 50, 50, True), (2, 1, 3, 17, 16, 16, True)]:
        q, k, v = (torch.randn(B, H, n, d, generator=g).to(dev) for n, d in ((T, dq), (S, dq), (S, dv)))
        N = 64
        pw, tw = torch.randn(2 * N - 1, generator=g).to(dev), torch.randn(129, generator=g).to(dev)
        qp = (torch.arange(T) + S - T).expand(B, T).to(dev)
        kp = torch.arange(S).expand(B, S).to(dev)
        kv = (torch.arange(S).view(1, S) < torch.tensor([[S - 1]] * B)).to(dev) if valid else None
        tb = torch.randint(0, 129, (B, T, S), generator=g).to(dev)
        want = ref.attention(q.double(), k.double(), v.double(), q_pos=qp, k_pos=kp, k_valid=kv, tb=tb, pos_w=pw.double(),
                             ts_w=tw.double(), n=N)
        got = tk.attention(q, k, v, q_pos=qp, k_pos=kp, k_valid=kv, tb=tb, pos_w=pw, ts_w=tw, n=N)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    print("TRITON_OK")
""")


def test_triton_kernel_on_cpu_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (optional: pip install triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", TRITON_CHECK.format(dev="cpu")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "TRITON_OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.cuda
def test_triton_kernel_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the Triton kernel stays unverified on GPUs (VERIFIED_ON)")
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-c", TRITON_CHECK.format(dev="cuda")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "TRITON_OK" in r.stdout, r.stderr[-3000:]


def test_model_forward_runs_the_kernel_set_it_is_given():
    """HSTUModel.kernels is the attention backend of the training forward too (the one
    HSTULayer.forward): a set whose attention is counted runs on every layer, and gives the
    reference's rows and gradients (the NPU set: ops with NPU kernels, exact on CPU)."""
    torch.manual_seed(3)
    cfg = ModelConfig(
        num_items=30, max_seq_len=12, max_output_len=2, embedding_dim=8, num_blocks=2, num_heads=2, d_qk=4, d_v=4, dropout=0.0
    )
    m = build_hstu(cfg)
    ids = torch.randint(1, 31, (3, 12))
    ts = torch.sort(torch.randint(0, 10**6, (3, 12)), dim=1).values
    L = torch.tensor([12, 5, 1])
    calls = []

    def counted(*a, **kw):
        calls.append(a[0].shape)
        return NPU.attention(*a, **kw)

    def run(kset):
        m.zero_grad()
        m.kernels = kset
        out = m.encode(ids, ts, L)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

    want, g_want = run(get_kernels("cpu", "reference"))
    got, g_got = run(dataclasses.replace(NPU, attention=counted))
    assert len(calls) == cfg.num_blocks and calls[0] == (3, 2, 12, 4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
