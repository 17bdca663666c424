"""Backend selection on a CPU-only machine."""

from __future__ import annotations

import pytest
import torch

from hstu import backend
from hstu.backend import BackendUnavailableError


def test_cpu_and_auto():
    b = backend.select("cpu")
    assert b.device == torch.device("cpu")
    mem = b.memory_info()
    assert 0 < mem.free_bytes <= mem.total_bytes
    b.synchronize()
    b.empty_cache()
    if not torch.cuda.is_available():
        assert backend.select("auto").name in ("cpu", "npu")


def test_unknown_device_lists_valid_names():
    with pytest.raises(ValueError, match="valid: auto, cpu, cuda, npu"):
        backend.select("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_missing_cuda_names_the_cause():
    with pytest.raises(BackendUnavailableError, match="cuda"):
        backend.select("cuda")


def test_npu_probe_never_raises():
    from hstu.backend.npu import NPUBackend

    why = NPUBackend.unavailable_reason()
    assert why is None or "torch_npu" in why
    if why is not None:
        with pytest.raises(BackendUnavailableError, match="torch_npu"):
            backend.select("npu")
