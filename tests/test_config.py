from __future__ import annotations

import pytest

from hstu.config import PRESETS, load_config_file, model_config_from_preset


def test_presets_match_paper_sizes():
    s, l = model_config_from_preset("small"), model_config_from_preset("large")
    assert (s.num_blocks, s.num_heads, s.embedding_dim, s.d_qk, s.d_v) == (2, 1, 50, 50, 50)
    assert (l.num_blocks, l.num_heads, l.embedding_dim, l.d_qk, l.d_v) == (8, 2, 50, 25, 25)
    assert s.width == s.max_seq_len + s.max_output_len
    assert "prod" in PRESETS


def test_unknown_fields_and_tables_rejected(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[model]\nnum_blocks = 3\nnum_blokcs = 4\n")
    with pytest.raises(ValueError, match="num_blokcs"):
        load_config_file(p)
    p.write_text("[modle]\nnum_blocks = 3\n")
    with pytest.raises(ValueError, match="modle"):
        load_config_file(p)
    p.write_text("[model]\nnum_blocks = 3\n[train]\nepochs = 2\n")
    cfg = load_config_file(p)
    assert cfg["model"].num_blocks == 3 and cfg["train"].epochs == 2


def test_invalid_values_name_the_field():
    cfg = model_config_from_preset("small", dropout=1.5, num_items=10)
    with pytest.raises(ValueError, match="dropout"):
        cfg.validate()
    with pytest.raises(ValueError, match=r"attention_norm must be one of \('fixed', 'causal'\), got 'rowwise'"):
        model_config_from_preset("small", attention_norm="rowwise", num_items=10).validate()
