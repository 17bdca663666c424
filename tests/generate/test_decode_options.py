"""The one decoding-options type (hstu.config.DecodeOptions): its ranges, the [generate] table
built on it, the HTTP schema mapping onto it, and the Recommender's default engine buckets."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from hstu.config import BEAM_WIDTH_MAX, SEED_MAX, TEMPERATURE_MAX, TOP_K_MAX, DecodeOptions, GenerateConfig, load_config_file
from hstu.generate.recommend import default_buckets
from hstu.serve.runner import DecodeOptions as RunnerDecodeOptions
from hstu.serve.schemas import Decoding


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"strategy": "sample"}, "strategy"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": TOP_K_MAX + 1}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": BEAM_WIDTH_MAX + 1}, "beam_width"),
        ({"seed": -1}, "seed"),
        ({"seed": SEED_MAX + 1}, "seed"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": TEMPERATURE_MAX * 1.01}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": 2.5}, "top_k"),
    ],
)
def test_out_of_range_options_name_the_field(kw, field) -> None:
    with pytest.raises(ValueError, match=f"DecodeOptions.{field} must"):
        DecodeOptions(**kw)


def test_range_edges_are_accepted_as_in_the_http_schema() -> None:
    edges = dict(strategy="topk", top_k=TOP_K_MAX, temperature=TEMPERATURE_MAX, beam_width=BEAM_WIDTH_MAX, seed=SEED_MAX)
    assert Decoding(**edges).options() == DecodeOptions(**edges)
    low = dict(strategy="beam", top_k=1, temperature=5e-324, beam_width=1, seed=0)
    assert Decoding(**low).options() == DecodeOptions(**low)
    assert Decoding().options() == DecodeOptions() == DecodeOptions("greedy", 50, 1.0, 4, 0)
    # the schema refuses what the dataclass refuses
    for bad in (dict(top_k=TOP_K_MAX + 1), dict(beam_width=BEAM_WIDTH_MAX + 1), dict(temperature=0.0), dict(seed=-1)):
        with pytest.raises(ValidationError):
            Decoding(**bad)
        with pytest.raises(ValueError):
            DecodeOptions(**bad)
    assert RunnerDecodeOptions is DecodeOptions  # the server's jobs carry the same type


def test_generate_table_is_the_options_plus_k_and_exclude_history(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[generate]\nk = 7\nstrategy = "beam"\nbeam_width = 3\nexclude_history = false\n')
    g = load_config_file(p)["generate"]
    assert isinstance(g, GenerateConfig) and (g.k, g.beam_width, g.exclude_history) == (7, 3, False)
    assert g.options() == DecodeOptions("beam", 50, 1.0, 3, 0) and type(g.options()) is DecodeOptions
    p.write_text("[generate]\nk = 0\n")
    with pytest.raises(ValueError, match=r"\[generate\]: GenerateConfig.k must be an integer >= 1, got 0"):
        load_config_file(p)
    p.write_text("[generate]\ntop_k = 0\n")
    with pytest.raises(ValueError, match=r"\[generate\]: GenerateConfig.top_k must be an integer in 1..100000, got 0"):
        load_config_file(p)


@pytest.mark.parametrize(
    "max_seq_len, want",
    [(50, (20, 50)), (200, (20, 50, 100, 200)), (300, (20, 50, 100, 200, 300)), (20, (20,)), (8, (8,)), (101, (20, 50, 100, 101))],
)
def test_default_buckets_end_at_max_seq_len(max_seq_len, want) -> None:
    assert default_buckets(max_seq_len) == want


def test_recommend_takes_options_or_their_fields_not_both(rec) -> None:
    from hstu.generate.recommend import History

    prep = rec.prepare(History([1, 2858, 260], [978300000, 978300100, 978300200]))
    a = rec.recommend([prep], 3, decoding=DecodeOptions("beam", beam_width=2))
    assert a == rec.recommend([prep], 3, strategy="beam", beam_width=2)
    with pytest.raises(ValueError, match="not both"):
        rec.recommend([prep], 3, decoding=DecodeOptions(), strategy="greedy")
    with pytest.raises(ValueError, match="DecodeOptions.beam_width must"):
        rec.recommend([prep], 3, strategy="beam", beam_width=0)
