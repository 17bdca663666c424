"""[model] item_table = "dense" | "hashed": config fields, the one builder, and a hashed table that is
the same model as a dense one holding its rows (no data needed; the run paths are in
tests/test_item_table_paths.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hstu.config import ModelConfig, load_config_file, model_config_from_dict, to_dict
from hstu.model.embedding import ShardedEmbedding
from hstu.model.hstu import build_hstu

HASHED = dict(item_table="hashed", item_table_shards=4, item_table_placement="device,host,device,device")


def cfg(**kw) -> ModelConfig:
    base = dict(num_items=60, max_seq_len=12, max_output_len=3, embedding_dim=16, d_qk=8, d_v=8, num_heads=2, dropout=0.0)
    return ModelConfig(**{**base, **kw})


def batch(seed: int = 3, I: int = 60):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, I + 1, (3, 12), generator=g)
    ts = torch.cumsum(torch.randint(1, 5000, (3, 12), generator=g), 1)
    L = torch.tensor([12, 7, 3])
    ids[1, 7:] = 0
    ids[2, 3:] = 0
    return ids, ts, L


def dense_twin(model):
    """A dense-table model whose weight is ``model``'s hashed rows 0..I and whose other weights are
    ``model``'s (the second method the hashed table is checked against)."""
    c = ModelConfig(**{**to_dict(model.cfg), **{k: v for k, v in to_dict(ModelConfig()).items() if k.startswith("item_table")}})
    twin = build_hstu(c)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("item_emb.")}
    state["item_emb.weight"] = model.item_emb.rows(0, c.num_items + 1).detach().clone()
    twin.load_state_dict(state)
    return twin


# ----- config -----


def test_toml_fields_round_trip_and_old_configs_load_dense(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        '[model]\nitem_table = "hashed"\nitem_table_shards = 4\nitem_table_placement = "device,host,device,device"\n'
        'item_table_dtype = "bf16"\nitem_table_cache_bytes = 4096\n'
    )
    m = load_config_file(p)["model"]
    assert (m.item_table, m.item_table_shards, m.item_table_dtype, m.item_table_cache_bytes) == ("hashed", 4, "bf16", 4096)
    assert m.table_placements() == ["device", "host", "device", "device"]
    assert model_config_from_dict(json.loads(json.dumps(to_dict(m)))) == m  # config.json round trip
    old = {k: v for k, v in to_dict(cfg()).items() if not k.startswith("item_table")}  # a run written before the fields
    assert model_config_from_dict(old).item_table == "dense"
    assert ModelConfig(item_table="hashed", item_table_shards=3).table_placements() == ["device"] * 3


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(item_table="sparse"), "ModelConfig.item_table must be one of"),
        (dict(item_table="hashed", item_table_shards=0), "ModelConfig.item_table_shards must be >= 1"),
        (dict(item_table="hashed", item_table_placement="gpu"), "ModelConfig.item_table_placement"),
        (dict(item_table="hashed", item_table_shards=4, item_table_placement="device,host"), "comma list of item_table_shards=4"),
        (dict(item_table="hashed", item_table_dtype="int8"), "ModelConfig.item_table_dtype must be one of"),
        (dict(item_table="hashed", item_table_cache_bytes=-1), "ModelConfig.item_table_cache_bytes must be >= 0"),
        (dict(item_table_shards=4), "ModelConfig.item_table_shards applies to item_table = 'hashed' only"),
    ],
)
def test_validation_names_the_field(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        cfg(**fields).validate()
    p = tmp_path / "c.json"  # and through a config file: the file and table are named too
    p.write_text(json.dumps({"model": fields}))
    with pytest.raises(ValueError, match=rf"{p.name} \[model\]"):
        load_config_file(p)


# ----- the builder -----


@pytest.mark.parametrize("arch", ["hstu", "sasrec"])
def test_builder_makes_the_configured_table(arch):
    m = build_hstu(cfg(architecture=arch, item_table_dtype="fp16", **HASHED))
    emb = m.item_emb
    assert isinstance(emb, ShardedEmbedding)
    assert (emb.num_embeddings, emb.embedding_dim, emb.num_shards) == (61, 16, 4)
    assert emb.placements == ["device", "host", "device", "device"]
    assert all(p.dtype == torch.float16 for p in emb.shards)
    assert isinstance(build_hstu(cfg(architecture=arch)).item_emb, nn.Embedding)
    with torch.device("meta"):  # Recommender.mapping_only: shapes only, no storage
        meta = build_hstu(cfg(**HASHED))
    assert meta.item_emb.weight.is_meta and tuple(meta.item_emb.weight.shape) == (61, 16)


def test_builder_checks_the_memory_plan_before_allocating():
    from hstu.model.embedding import MemoryPlanError

    with pytest.raises(MemoryPlanError, match="does not fit"):
        build_hstu(ModelConfig(num_items=2**40, item_table="hashed", item_table_shards=2))


def test_shard_count_does_not_change_the_model():
    torch.manual_seed(7)
    one = build_hstu(cfg(item_table="hashed")).eval()
    torch.manual_seed(7)
    four = build_hstu(cfg(**HASHED)).eval()
    assert torch.equal(one.item_emb.rows(0, 61), four.item_emb.rows(0, 61))
    ids, ts, L = batch()
    with torch.no_grad():
        a, b = one.encode(ids, ts, L), four.encode(ids, ts, L)
    assert torch.equal(a, b)
    u = one.last_rows(a, L)
    assert torch.equal(one.history_scores(u, ids, None, L), four.history_scores(u, ids, None, L))


def test_hashed_equals_a_dense_model_holding_its_rows_in_training_and_scoring():
    """Forward, all-item and candidate scores, and one AdamW step (gradients scattered into the
    shards) match a dense nn.Embedding model whose weight is the hashed table's rows."""
    from hstu.train.losses import sampled_softmax_loss

    torch.manual_seed(11)
    h = build_hstu(cfg(**HASHED))
    d = dense_twin(h)
    ids, ts, L = batch()
    with torch.no_grad():
        eh, ed = h.eval().encode(ids, ts, L), d.eval().encode(ids, ts, L)
        assert torch.allclose(eh, ed, atol=1e-6)
        u = h.last_rows(eh, L)
        assert torch.allclose(h.history_scores(u, ids, None, L), d.history_scores(u, ids, None, L), atol=1e-4)
        cand = torch.randint(1, 61, (3, 5))
        assert torch.allclose(h.score_items(u, cand), d.score_items(u, cand), atol=1e-5)
    for m in (h, d):
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        seq = m.encode(ids, ts, L)
        gen = torch.Generator().manual_seed(5)  # the same negatives for both
        loss, _ = sampled_softmax_loss(seq, ids, L, m.item_emb, num_negatives=8, temperature=0.05, chunk=4, generator=gen, num_items=60)
        loss.backward()
        opt.step()
        m.loss = float(loss.detach())
    assert h.loss == pytest.approx(d.loss, rel=1e-5)
    assert torch.allclose(h.item_emb.rows(0, 61), d.item_emb.weight, atol=1e-6)
    assert not torch.equal(h.item_emb.rows(0, 61), dense_twin(build_hstu(cfg(**HASHED))).item_emb.weight)


def test_saved_weights_load_back_exactly(tmp_path):
    from hstu.runs import load_best_weights, save_best_weights

    torch.manual_seed(1)
    a = build_hstu(cfg(**HASHED)).eval()
    save_best_weights(tmp_path, a)
    torch.manual_seed(2)
    b = build_hstu(cfg(**HASHED)).eval()
    ids, ts, L = batch()
    assert not torch.equal(a.item_emb.rows(0, 61), b.item_emb.rows(0, 61))
    load_best_weights(tmp_path, b)
    with torch.no_grad():
        assert torch.equal(a.encode(ids, ts, L), b.encode(ids, ts, L))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# ----- quantizing a hashed table -----


def test_quantizing_a_hashed_table_stores_its_shards_in_the_scheme_dtype():
    from hstu.quant import apply_precision

    torch.manual_seed(4)
    h = build_hstu(cfg(**HASHED))
    rows = h.item_emb.rows(0, 61).detach().clone()
    with pytest.raises(ValueError, match="'int8' \\(row-wise\\) is for a dense item table"):
        apply_precision(h, "int8", embeddings="int8")
    assert all(p.dtype == torch.float32 for p in h.item_emb.shards)  # refused before any change
    apply_precision(h, "int8")  # default item-table storage: fp16
    assert [p.dtype for p in h.item_emb.shards] == [torch.float16] * 4 and h.item_emb.placements[1] == "host"
    assert torch.equal(h.item_emb.rows(0, 61), rows.half().float())
    torch.manual_seed(4)
    b = apply_precision(build_hstu(cfg(**HASHED)), "bf16")
    assert [p.dtype for p in b.item_emb.shards] == [torch.bfloat16] * 4
    assert b.item_vectors().dtype == torch.float32
