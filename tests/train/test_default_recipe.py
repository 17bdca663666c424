"""The default training recipe (issue 20 A): per-position negatives, random batches, packing "auto".

"auto" resolves once per run (:func:`hstu.train.losses.resolve_packing`) to "pack" only where the trainer,
the attention kernel set (KernelSet.segments) and the model all can train packed rows, and the resolved
value is what config.json, metrics.json ``recipe`` and the log state. A run saved before the defaults
changed (config.json without the new fields) resumes with its own recipe, not today's defaults.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from conftest import tiny_csv_flags

from hstu.config import LEGACY_TRAIN_DEFAULTS, ModelConfig, TrainConfig, train_config_from_dict
from hstu.model import kernels as K
from hstu.train.losses import resolve_packing


def _train(flags: list[str], out, *extra: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "hstu", "train", *flags, "--threads", "1", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return r


def test_the_defaults_are_the_packed_per_position_recipe() -> None:
    t = TrainConfig()
    assert (t.negatives_chunk, t.length_pool, t.packing) == (1, 1, "auto")
    t.validate()
    with pytest.raises(ValueError, match=r"\[train\] packing\) must be 'auto', 'off' or 'pack'"):
        TrainConfig(packing="on").validate()


def test_auto_packs_only_where_trainer_kernels_and_model_can(monkeypatch) -> None:
    auto, hstu = TrainConfig(), ModelConfig(num_items=9)
    assert K.get_kernels("cpu", "auto").segments  # the CPU's set is the reference, which takes segment masks
    assert resolve_packing(auto, hstu, "cpu", packs=True) == "pack"
    assert resolve_packing(auto, hstu, "cpu", packs=False) == "off"  # e.g. the distributed strategy
    from hstu.train.loop import LocalStrategy

    dist = pytest.importorskip("hstu.train.distributed", reason="the [dist] extra (TorchRec) is not installed")
    assert (LocalStrategy.packs, dist.DistributedStrategy.packs) == (True, False)  # its step pads its rows (shard_batch)
    assert resolve_packing(auto, ModelConfig(num_items=9, architecture="sasrec"), "cpu", packs=True) == "off"
    assert resolve_packing(auto, ModelConfig(num_items=9, repeat_window=4), "cpu", packs=True) == "off"
    for given in ("off", "pack"):  # an explicit value is kept (refused later where it cannot run)
        assert resolve_packing(TrainConfig(packing=given), ModelConfig(num_items=9, architecture="sasrec"), "cpu", packs=False) == given
    # a kernel set without segment masks (as the fused Triton / NPU sets: K.TRITON.segments is False)
    monkeypatch.setitem(K._KERNELS["cpu"], "reference", dataclasses.replace(K.REFERENCE, segments=False))
    assert not K.TRITON.segments and not K.NPU.segments
    assert resolve_packing(auto, ModelConfig(num_items=9, attention="reference"), "cpu", packs=True) == "off"


def test_saved_train_tables_without_the_new_fields_read_as_the_former_defaults() -> None:
    old = train_config_from_dict({"epochs": 3}, saved=True)
    assert {k: getattr(old, k) for k in LEGACY_TRAIN_DEFAULTS} == {
        "negatives_chunk": 16,
        "length_pool": 50,
        "packing": "off",
        "lr_decay_patience": 0,
    }
    kept = train_config_from_dict({"negatives_chunk": 4, "packing": "pack"}, saved=True)  # what a run saved, it keeps
    assert (kept.negatives_chunk, kept.length_pool, kept.packing) == (4, 50, "pack")
    assert train_config_from_dict({"epochs": 3}).packing == "auto"  # a [train] table: today's defaults


def test_an_interrupted_resume_changes_no_record_and_epochs_given_are_kept(tmp_path) -> None:
    """Found by a trial: a resume (--epochs 6 --seed 5) interrupted before its first commit had already written
    config.json (epochs 6, seed 5, recipe_changes); then `--resume --epochs 3` of the 3-epoch run said "nothing to
    train" and trained epochs 4-6 at seed 5 (the run's saved epochs were used). Simulated here: config.json of a
    4-epoch request over 3 committed epochs; --epochs 3 must train nothing; and a resume's config.json is written only
    once it commits an epoch."""
    flags = tiny_csv_flags(tmp_path, train={"epochs": 3})
    out = tmp_path / "run"
    _train(flags, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["train"]["epochs"] = 4  # as an interrupted `--resume --epochs 4` left it before this fix
    (out / "config.json").write_text(json.dumps(cfg))
    weights = (out / "model.safetensors").read_bytes()
    r = _train(["--resume", "--epochs", "3"], out)
    assert "nothing to train" in r.stderr and "epoch 4/" not in r.stderr
    assert (out / "model.safetensors").read_bytes() == weights and json.loads((out / "metrics.json").read_text())["epochs"] == 3


def test_hstu_train_records_the_resolved_recipe_and_an_old_run_resumes_with_its_own(tmp_path) -> None:
    flags = tiny_csv_flags(tmp_path, train={"epochs": 1})
    out = tmp_path / "run"
    r = _train(flags, out)
    cfg = json.loads((out / "config.json").read_text())
    rec = json.loads((out / "metrics.json").read_text())["recipe"]
    assert (cfg["train"]["negatives_chunk"], cfg["train"]["length_pool"], cfg["train"]["packing"]) == (1, 1, "pack")
    assert (rec["negatives"], rec["batching"], rec["packing"]) == ("per-position", "random", "pack")
    assert "[train] packing = 'auto' resolved to 'pack'" in r.stderr
    assert "recipe: negatives per-position (4 per position), batching random, packed rows" in r.stderr
    # the same run as one saved before issue 20 (no negatives_chunk / length_pool / packing in config.json)
    for name in LEGACY_TRAIN_DEFAULTS:
        del cfg["train"][name]
    (out / "config.json").write_text(json.dumps(cfg))
    r = _train(["--resume", "--epochs", "2"], out)
    train = json.loads((out / "config.json").read_text())["train"]
    rec = json.loads((out / "metrics.json").read_text())["recipe"]
    assert (train["negatives_chunk"], train["length_pool"], train["packing"], train["epochs"]) == (16, 50, "off", 2)
    assert (rec["negatives"], rec["negatives_chunk"], rec["length_pool"], rec["packing"]) == ("chunked", 16, 50, "off")
    assert "recipe: negatives chunked (4 shared by runs of 16 positions), batching length-bucketed (pools of 50 batches)," in r.stderr


def test_a_resume_records_its_recipe_changes_and_a_finished_run_keeps_its_own(tmp_path) -> None:
    """A trial's finding: `--resume --num-negatives 16 --seed 5` of a finished run trained nothing yet rewrote
    config.json's train table and metrics.json's recipe (weights trained with 4 negatives at seed 42 said 16 and 5),
    and a resume that trained on with another seed kept no trace of the first epochs' one."""
    flags = tiny_csv_flags(tmp_path, train={"epochs": 2})
    out = tmp_path / "run"
    _train(flags, out)
    cfg, metrics = (json.loads((out / f).read_text()) for f in ("config.json", "metrics.json"))
    weights = (out / "model.safetensors").read_bytes()
    r = _train([*flags, "--resume", "--epochs", "2", "--num-negatives", "16", "--seed", "5"], out)
    assert "nothing to train" in r.stderr and (out / "model.safetensors").read_bytes() == weights
    assert "the run keeps its recorded recipe (num_negatives, seed not used)" in r.stderr
    assert json.loads((out / "config.json").read_text())["train"] == cfg["train"]
    assert json.loads((out / "metrics.json").read_text())["recipe"] == metrics["recipe"]
    r = _train([*flags, "--resume", "--epochs", "3", "--seed", "5"], out)
    change = [{"from_epoch": 3, "changed": {"seed": [42, 5]}}]
    assert "--resume: from epoch 3 the recipe changes: seed 42 -> 5" in r.stderr
    cfg3 = json.loads((out / "config.json").read_text())
    assert cfg3["recipe_changes"] == change and cfg3["train"]["seed"] == 5
    assert json.loads((out / "metrics.json").read_text())["recipe_changes"] == change
    _train([*flags, "--resume", "--epochs", "3", "--seed", "5"], out)  # finished again: its record stays as it is
    assert json.loads((out / "config.json").read_text()) == cfg3
