"""load_weights reads tensors over STREAM_TENSOR_BYTES one at a time (a large catalogue's table
shards): the loaded model equals the saved one whichever tensors stream, a missing or unexpected
key is still named, and the repeat head's load hook (old checkpoints without its scale) still works
when the table streams before it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from hstu.config import ModelConfig
from hstu.model import build_hstu
from hstu.model import checkpoint as ck


def model(seed: int, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(num_items=500, max_seq_len=20, embedding_dim=16, num_blocks=1, num_heads=1, d_qk=8, d_v=8, repeat_window=4, **kw)
    return build_hstu(cfg)


@pytest.mark.parametrize("table", [{}, dict(item_table="hashed", item_table_shards=3)], ids=["dense", "hashed"])
@pytest.mark.parametrize("limit", [0, 1000, 1 << 40], ids=["all-stream", "tables-stream", "none-stream"])
def test_streamed_load_equals_the_saved_model(tmp_path, monkeypatch, table, limit):
    monkeypatch.setattr(ck, "STREAM_TENSOR_BYTES", limit)
    a, b = model(1, **table), model(2, **table)
    with torch.no_grad():
        a.repeat.scale.fill_(3.5)
    ck.save_weights(tmp_path / "w.safetensors", a)
    ck.load_weights(tmp_path / "w.safetensors", b)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_missing_and_unexpected_keys_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "STREAM_TENSOR_BYTES", 1000)
    a = model(1)
    ck.save_weights(tmp_path / "w.safetensors", a)
    state = load_file(str(tmp_path / "w.safetensors"))
    weight = next(k for k in state if k.startswith("item_emb"))
    save_file({k: v for k, v in state.items() if k != weight}, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="missing.*item_emb"):
        ck.load_weights(tmp_path / "missing.safetensors", model(2))
    save_file({**state, "extra.weight": torch.zeros(600, 16)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="unexpected.*extra.weight"):
        ck.load_weights(tmp_path / "extra.safetensors", model(2))


def test_an_old_checkpoint_without_the_repeat_scale_loads_scale_one(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "STREAM_TENSOR_BYTES", 1000)
    a = model(1)
    ck.save_weights(tmp_path / "w.safetensors", a)
    state = load_file(str(tmp_path / "w.safetensors"))
    save_file({k: v for k, v in state.items() if not k.endswith("repeat.scale")}, str(tmp_path / "old.safetensors"))
    b = model(2)
    with torch.no_grad():
        b.repeat.scale.fill_(7.0)
    ck.load_weights(tmp_path / "old.safetensors", b)
    assert float(b.repeat.scale) == 1.0 and torch.equal(b.item_emb.weight, a.item_emb.weight)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_weights_get_the_modes_of_the_other_run_files(tmp_path, umask):
    """safetensors creates its files 0600; the weights are written with the mode every other run
    file gets from the umask (a write_json file beside them), so a shared run stays readable."""
    import os
    import stat

    old = os.umask(umask)
    try:
        ck.save_weights(tmp_path / "w.safetensors", model(1))
        ck.write_json(tmp_path / "m.json", {"a": 1})
    finally:
        os.umask(old)
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert mode == {"w.safetensors": 0o666 & ~umask, "m.json": 0o666 & ~umask}
