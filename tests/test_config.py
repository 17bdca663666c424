from __future__ import annotations

import pytest

from hstu.config import PRESETS, load_config_file, model_config_from_preset


def test_presets_match_paper_sizes():
    s, l = model_config_from_preset("small"), model_config_from_preset("large")
    assert (s.num_blocks, s.num_heads, s.embedding_dim, s.d_qk, s.d_v) == (2, 1, 50, 50, 50)
    assert (l.num_blocks, l.num_heads, l.embedding_dim, l.d_qk, l.d_v) == (8, 2, 50, 25, 25)
    assert s.width == s.max_seq_len + s.max_output_len
    assert "prod" in PRESETS


def test_presets_use_multi_channel_attention_for_hstu_only():
    # issue 20: the HSTU presets' block is FuXi-alpha's multi-channel one (FuXi-beta's, without the semantic channel,
    # failed Part A's large floor on a second seed); SASRec takes the preset's sizes without it
    small, large = model_config_from_preset("small"), model_config_from_preset("large")
    assert small.multi_channel and small.query_key_map and large.multi_channel and large.query_key_map
    assert not model_config_from_preset("prod").multi_channel and model_config_from_preset("prod").query_key_map
    sas = model_config_from_preset("large", architecture="sasrec")
    assert (sas.architecture, sas.multi_channel, sas.query_key_map, sas.num_blocks, sas.num_heads) == ("sasrec", False, True, 8, 2)
    sas.validate()  # query_key_map = false is an HSTU block option: SASRec has none
    assert not model_config_from_preset("small", multi_channel=False).multi_channel
    # without the channels, the paper's HSTU block
    hstu = model_config_from_preset("large", multi_channel=False)
    assert (hstu.multi_channel, hstu.query_key_map) == (False, True)
    nobias = model_config_from_preset("large", use_time_bias=False, use_position_bias=False)
    assert (nobias.multi_channel, nobias.query_key_map) == (False, True)
    beta_large = model_config_from_preset("large", query_key_map=False)
    assert beta_large.multi_channel and not beta_large.query_key_map and beta_large.num_blocks == 8
    assert not model_config_from_preset("large", multi_channel=False, query_key_map=False).query_key_map  # set: kept
    # the other block choices over the preset: FuXi-beta's (no query-key map: the channels stay, without the semantic
    # one), no relative bias at all (the HSTU block)
    beta = model_config_from_preset("small", query_key_map=False)
    assert beta.multi_channel and not beta.query_key_map
    assert model_config_from_preset("small", use_time_bias=False).multi_channel
    assert not model_config_from_preset("small", use_time_bias=False, use_position_bias=False).multi_channel
    with pytest.raises(ValueError, match="multi_channel = true: HSTU block options; architecture 'sasrec'"):
        model_config_from_preset("small", architecture="sasrec", multi_channel=True)


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
    with pytest.raises(ValueError, match=r"preset small: ModelConfig.dropout must be in \[0, 1\), got 1.5"):
        model_config_from_preset("small", dropout=1.5, num_items=10)
    with pytest.raises(ValueError, match=r"attention_norm must be one of \('fixed', 'causal'\), got 'rowwise'"):
        model_config_from_preset("small", attention_norm="rowwise", num_items=10)


@pytest.mark.parametrize(
    "table,body,message",
    [
        ("model", "embedding_dim = -4", "[model]: ModelConfig.embedding_dim must be > 0, got -4"),
        ("model", 'num_heads = "x"', "[model]: num_heads must be int, got 'x'"),
        ("model", "use_time_bias = 1", "[model]: use_time_bias must be bool, got 1"),
        ("train", "learning_rate = -1", "[train]: TrainConfig.learning_rate must be a finite number > 0, got -1"),
        ("train", "weight_decay = nan", "[train]: TrainConfig.weight_decay must be a finite number >= 0, got nan"),
        ("model", "num_time_buckets = -5", "[model]: ModelConfig.num_time_buckets must be > 0, got -5"),
        ("model", "time_bucket_log_base = 0.0", "[model]: ModelConfig.time_bucket_log_base must be a finite number > 0, got 0.0"),
        ("model", "max_seq_len = 100000000", "[model]: ModelConfig.max_seq_len + max_output_len must be <= 65536, got 100000010"),
        ("model", "num_actions = -1", "[model]: ModelConfig.num_actions must be >= 0, got -1"),
        ("train", "beta2 = 1.0", "[train]: TrainConfig.beta2 must be in [0, 1), got 1.0"),
        ("serve", "buckets = [20, 10]", "[serve]: ServeConfig.buckets must be distinct, ascending"),
        ("serve", 'buckets = ["a"]', "[serve]: buckets must be list[int], got ['a']"),
        ("serve", "prefix_cache_mb = -1", "[serve]: ServeConfig.prefix_cache_mb must be finite and >= 0, got -1"),
        ("serve", "max_wait_ms = inf", "[serve]: ServeConfig.max_wait_ms must be finite and >= 0, got inf"),
        (  # a trial: the top-level value won without a word
            "data",
            'dataset = "csv"\ncolumns = "user=0,item=1,time=4"\noptions = {columns = "user=0,item=2,time=4"}',
            "[data]: columns is given twice, 'user=0,item=1,time=4' and options.columns = 'user=0,item=2,time=4'",
        ),
    ],
)
def test_config_file_errors_name_the_file_table_and_field(tmp_path, table, body, message):
    """A bad value in a config file is refused when the file is read (before any data loads),
    naming the file, the table and the field; a wrong type is not left to fail deep inside."""
    f = tmp_path / "c.toml"
    f.write_text(f"[{table}]\n{body}\n")
    with pytest.raises(ValueError) as e:
        load_config_file(f)
    assert str(e.value).startswith(f"{f} {message}"), str(e.value)


@pytest.mark.parametrize(
    "name,text,message",
    [
        ("c.toml", "model = 5\n", "[model]: must be a table of fields, got 5"),
        ("c.json", '{"model": 5}', "[model]: must be a table of fields, got 5"),
        ("c.json", "null", ": expected tables such as [model] and [train], got NoneType"),
    ],
)
def test_config_file_that_is_not_tables(tmp_path, name, text, message):
    """A table given as a value ('model = 5', JSON null) said "'int' object is not iterable"."""
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config_file(f)
    assert str(e.value) == f"{f}{message if message.startswith(':') else ' ' + message}", str(e.value)


def test_a_runs_config_json_is_a_config_file(tmp_path):
    """A trial: `hstu train --config RUN/config.json` was refused (unknown table 'hstu_version', then [data]
    feature_maps), though the run wrote it. Its records are left out, its settings read: the same run again."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_csv_flags

    from hstu.cli import main
    from hstu.config import load_config_tables

    flags = tiny_csv_flags(tmp_path, train={"epochs": 1})
    assert main(["train", *flags, "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert main(["train", "--config", str(tmp_path / "a" / "config.json"), "--out", str(tmp_path / "b"), "--quiet"]) == 0
    a, b = (json.loads((tmp_path / r / "metrics.json").read_text()) for r in "ab")
    assert a["test"] == b["test"] and a["recipe"] == b["recipe"]
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())  # a distributed run's records: left out with its tables'
    cfg |= {"distributed": {"table_optimizer": "adam"}, "recipe_changes": [{"from_epoch": 2}]}
    cfg["data"]["feature_maps"] = [{"name": "x"}]
    (tmp_path / "d.json").write_text(json.dumps(cfg))
    tables = load_config_tables(tmp_path / "d.json")
    assert set(tables) == {"model", "train", "data"} and "feature_maps" not in tables["data"]
    assert "table_optimizer" not in tables["train"] and tables["train"]["epochs"] == 1
