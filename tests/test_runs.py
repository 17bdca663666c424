"""hstu.runs: the run directory's files round-trip, malformed files name file and field, the last
checkpoint restores model / optimizer / RNG exactly, loading at a precision, and the old import
paths still resolve to the one implementation."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hstu import runs
from hstu.config import ModelConfig, TrainConfig
from hstu.data.prepare import DataSpec, prepare_data
from hstu.model.hstu import build_hstu

SRC = Path(__file__).resolve().parents[1] / "src" / "hstu"
COLUMNS = {"columns": "user=u,item=i,time=t"}
# three users' events (user, item, time): under the clean protocol the last event of each user is
# the test target, the one before it the validation target, the rest is training data
EVENTS = [
    (1, 10, 1),
    (1, 20, 2),
    (1, 30, 3),
    (1, 40, 4),
    (2, 20, 1),
    (2, 20, 2),
    (2, 50, 3),
    (2, 10, 4),
    (2, 30, 5),
    (3, 40, 1),
    (3, 10, 2),
    (3, 30, 3),
]
TRAIN_COUNTS = {10: 1, 20: 3, 30: 0, 40: 1, 50: 1}  # by hand: u1 10 20 | u2 20 20 50 | u3 40


@pytest.fixture
def events_csv(tmp_path) -> Path:
    path = tmp_path / "events.csv"
    path.write_text("u,i,t\n" + "".join(f"{u},{i},{t}\n" for u, i, t in EVENTS), encoding="utf-8")
    return path


def _tiny_cfg(num_items: int = 5) -> ModelConfig:
    return ModelConfig(
        num_items=num_items,
        max_seq_len=8,
        max_output_len=2,
        embedding_dim=8,
        num_blocks=1,
        num_heads=1,
        d_qk=8,
        d_v=8,
        num_time_buckets=8,
        dropout=0.0,
    )


def _float_run(run: Path, events_csv: Path) -> torch.nn.Module:
    """A float run directory written with runs' own writers: config, id map, best weights."""
    log_, split = prepare_data(DataSpec("csv", str(events_csv), options=COLUMNS))
    cfg = _tiny_cfg(log_.num_items)
    run.mkdir(parents=True, exist_ok=True)
    runs.write_config(run, runs.config_json(cfg, TrainConfig(), DataSpec("csv", str(events_csv), options=COLUMNS)))
    runs.write_idmap(run, log_, split)
    torch.manual_seed(0)
    model = build_hstu(cfg)
    runs.save_best_weights(run, model)
    return model


def test_config_and_idmap_round_trip(tmp_path, events_csv):
    spec = DataSpec("csv", str(events_csv), "clean", None, False, COLUMNS)
    log_, split = prepare_data(spec)
    cfg = runs.config_json(_tiny_cfg(log_.num_items), TrainConfig(epochs=3), spec, distributed={"world_size": 2})
    runs.write_config(tmp_path, cfg)
    runs.write_idmap(tmp_path, log_, split)
    back = runs.read_config(tmp_path)
    assert back == json.loads(json.dumps(cfg))
    assert back["train"]["epochs"] == 3 and back["data"]["options"] == COLUMNS and back["distributed"] == {"world_size": 2}
    assert DataSpec(**back["data"]) == spec
    ids = runs.read_idmap(tmp_path)
    raw = ids["item_raw_ids"]
    assert raw[0] == 0 and sorted(raw[1:]) == sorted(TRAIN_COUNTS)
    assert {r: ids["item_train_counts"][d] for d, r in enumerate(raw) if d} == TRAIN_COUNTS
    assert ids["item_train_counts"][0] == 0
    assert ids["last_timestamp"] == 5 and ids["data_facts"]["events"] == len(EVENTS) and ids["data_facts"]["users"] == 3
    assert "item_train_counts" not in runs.make_idmap(log_)  # without a split: no training counts
    assert runs.read_run(tmp_path) == (back, ids)  # consistent: num_items = len(item_raw_ids) - 1


def test_malformed_files_name_file_and_field(tmp_path, events_csv):
    _float_run(tmp_path, events_csv)
    ids = runs.read_idmap(tmp_path)
    bad = {**ids, "item_raw_ids": [1] + ids["item_raw_ids"][1:]}
    (tmp_path / runs.IDMAP).write_text(json.dumps(bad), encoding="utf-8")
    with pytest.raises(ValueError, match=r"idmap\.json: item_raw_ids must be a list of integer ids starting with 0"):
        runs.read_idmap(tmp_path)
    more = {k: ids[k] + [v] for k, v in (("item_raw_ids", 99), ("item_category", 0), ("item_train_counts", 0))}
    (tmp_path / runs.IDMAP).write_text(json.dumps({**ids, **more}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"idmap\.json: item_raw_ids holds 6 items but .*config\.json model\.num_items is 5"):
        runs.read_run(tmp_path)
    cfg = runs.read_config(tmp_path)
    (tmp_path / runs.CONFIG).write_text(json.dumps({**cfg, "data": {**cfg["data"], "max_users": "300"}}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"config\.json data: max_users must be int \| None, got '300'"):
        runs.read_config(tmp_path)
    (tmp_path / runs.HISTORY).write_text(json.dumps([{"epoch": 1}, {"epoch": 3}]), encoding="utf-8")
    with pytest.raises(ValueError, match=r"history\.json \[1\]: epoch must be 2"):
        runs.read_history(tmp_path)
    with pytest.raises(FileNotFoundError, match="run directory not found"):
        runs.read_run(tmp_path / "nowhere")


def test_resume_checks_name_the_run_file(tmp_path, events_csv):
    log_, split = prepare_data(DataSpec("csv", str(events_csv), options=COLUMNS))
    runs.check_resume_items(tmp_path, log_)  # no idmap.json yet: nothing to compare
    runs.write_idmap(tmp_path, log_, split)
    runs.check_resume_items(tmp_path, log_)
    other = type(log_)(**{**log_.__dict__, "item_raw_ids": log_.item_raw_ids[:-1]})
    with pytest.raises(ValueError, match=r"item ids are not the run's 5 .*idmap\.json"):
        runs.check_resume_items(tmp_path, other)
    path = tmp_path / runs.CONFIG
    runs.check_resume_data(path, {"protocol": "clean", "max_users": None}, {"protocol": "clean", "data_dir": "/moved"})
    with pytest.raises(
        ValueError, match=r"--protocol \(\[data\] protocol\) is 'paper' here but 'clean' in the run .*config\.json data\.protocol"
    ):
        runs.check_resume_data(path, {"protocol": "clean"}, {"protocol": "paper"})
    with pytest.raises(ValueError, match=r"--columns \(\[data\] options\) is .* data\.options"):
        runs.check_resume_data(path, {"options": COLUMNS}, {"options": {}})


def test_remove_run_files_keeps_config_and_idmap(tmp_path):
    for name in (*runs.RUN_FILES, runs.CONFIG, runs.IDMAP, "notes.txt"):
        (tmp_path / name).write_text("x")
    runs.remove_run_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([runs.CONFIG, runs.IDMAP, "notes.txt"])
    assert not runs.has_train_state(tmp_path)


def _trained_step(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    gen = torch.Generator().manual_seed(seed + 1)
    torch.randint(0, 10, (3,), generator=gen)
    return model, opt, gen


def test_train_state_round_trip_and_repair(tmp_path):
    model, opt, gen = _trained_step(0)
    info = {"epoch": 2, "best": 0.25, "best_epoch": 1, "bad_epochs": 1, "train_seconds": 3.5}
    history = [{"epoch": 1, "loss": 2.0}, {"epoch": 2, "loss": 1.5}]
    rng = torch.get_rng_state()
    runs.save_train_state(tmp_path, model, opt, gen, info, history)
    assert runs.has_train_state(tmp_path)
    assert runs.read_history(tmp_path) == history
    fresh, fresh_opt, fresh_gen = _trained_step(7)
    torch.manual_seed(123)
    got = runs.load_train_state(tmp_path, fresh, fresh_opt, fresh_gen)
    assert {k: got[k] for k in info} == info and got["history"] == history
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    for p, q in zip(opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values()):
        assert all(torch.equal(torch.as_tensor(p[k]), torch.as_tensor(q[k])) for k in p)
    assert torch.equal(fresh_gen.get_state(), gen.get_state()) and torch.equal(torch.get_rng_state(), rng)
    # a kill after the commit left last.json / history.json behind: repaired from the manifest
    (tmp_path / runs.LAST_JSON).write_text("{", encoding="utf-8")
    (tmp_path / runs.HISTORY).write_text(json.dumps(history[:1]), encoding="utf-8")
    runs.repair_run_files(tmp_path, got)
    assert runs.read_history(tmp_path) == history
    assert json.loads((tmp_path / runs.LAST_JSON).read_text())["epoch"] == 2


def test_train_state_errors_name_file_and_field(tmp_path):
    model, opt, gen = _trained_step(0)
    with pytest.raises(FileNotFoundError, match=r"last\.safetensors: not found"):
        runs.load_train_state(tmp_path, model, opt, gen)
    runs.save_train_state(
        tmp_path, model, opt, gen, {"epoch": 1, "best": 0.1, "best_epoch": 1, "bad_epochs": 0, "train_seconds": 1.0}, [{"epoch": 1}]
    )
    last = tmp_path / runs.LAST_WEIGHTS
    tensors = {"rng.torch": torch.get_rng_state(), "rng.negatives": gen.get_state()}
    bad = {"epoch": "1", "best": 0.1, "best_epoch": 1, "bad_epochs": 0, "train_seconds": 1.0, "param_groups": [{}]}
    save_file(tensors, str(last), metadata={runs.MANIFEST_KEY: json.dumps(bad)})
    with pytest.raises(ValueError, match=r"last\.safetensors \(metadata hstu_train_state\): epoch must be an integer >= 0, got '1'"):
        runs.load_train_state(tmp_path, model, opt, gen)
    last.write_bytes(last.read_bytes()[:50])
    with pytest.raises(ValueError, match=r"last\.safetensors: not a readable safetensors file"):
        runs.load_train_state(tmp_path, model, opt, gen)


def test_load_at_a_precision(tmp_path, events_csv):
    from hstu.quant import apply_precision

    model = _float_run(tmp_path / "run", events_csv)
    m, cfg, ids = runs.load_float_run(tmp_path / "run")
    assert not m.training and cfg["model"]["num_items"] == len(ids["item_raw_ids"]) - 1 == 5
    for k, v in model.state_dict().items():
        assert torch.equal(v, m.state_dict()[k]), k
    assert not runs.is_quantized(tmp_path / "run")
    same, _, _ = runs.load_run(tmp_path / "run")  # a float run, precision None: as saved
    assert same.pos_emb.weight.dtype == torch.float32 and torch.equal(same.pos_emb.weight, model.pos_emb.weight)
    low, cfg16, _ = runs.load_run(tmp_path / "run", precision="bf16")  # converted in memory
    assert low.pos_emb.weight.dtype == torch.bfloat16 and "quant" not in cfg16
    with pytest.raises(ValueError, match=r"--precision: unknown value 'int4'; valid: \['fp32', 'bf16', 'fp16', 'int8'\]"):
        runs.load_run(tmp_path / "run", precision="int4")
    out = tmp_path / "run-bf16"
    runs.save_quantized_run(apply_precision(m, "bf16"), tmp_path / "run", out)
    assert runs.is_quantized(out) and (out / runs.QUANT_WEIGHTS).exists() and not (out / runs.WEIGHTS).exists()
    q, qcfg, qids = runs.load_run(out)
    assert qcfg["quant"]["scheme"] == "bf16" and qids == ids and q.pos_emb.weight.dtype == torch.bfloat16
    assert torch.equal(q.pos_emb.weight, model.pos_emb.weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match="needs the float run"):
        runs.load_run(out, precision="fp32")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors: weights not found"):
        runs.load_float_run(out)  # a quantized run is never read as a float one


def test_old_import_paths_resolve_to_the_one_implementation():
    import hstu.config
    import hstu.data.prepare as prepare
    import hstu.model.checkpoint
    import hstu.quant
    import hstu.quant.checkpoint
    import hstu.train.checkpoint
    import hstu.train.loop as loop

    assert hstu.config.DataSpec is prepare.DataSpec and hstu.config.RUN_FILES is runs.RUN_FILES
    assert loop.DataSpec is prepare.DataSpec and loop.prepare_data is prepare.prepare_data
    assert loop.subset_users is prepare.subset_users and loop.model_config_for is prepare.model_config_for
    assert loop.idmap is runs.make_idmap and loop.remove_run_files is runs.remove_run_files
    assert loop.check_resume_data is runs.check_resume_data and loop.load_run is runs.load_float_run
    assert hstu.train.checkpoint.save_train_state is runs.save_train_state
    assert hstu.model.checkpoint.load_run is runs.load_float_run
    assert hstu.quant.load_for_inference is runs.load_run and hstu.quant.checkpoint.load_for_inference is runs.load_run
    with pytest.raises(AttributeError):
        hstu.config.NoSuchName  # noqa: B018


def _hstu_imports(path: Path) -> set[str]:
    """Top-level hstu subpackages / modules a source file imports (module level and in functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hstu."):
            names.add(node.module.split(".")[1])
    return names


def test_import_order():
    """DESIGN.md's order with runs between quant and generate: runs imports nothing above quant,
    data preparation nothing above data."""
    assert _hstu_imports(SRC / "runs.py") <= {"config", "backend", "data", "model", "quant"}
    assert _hstu_imports(SRC / "data" / "prepare.py") <= {"config", "data"}
