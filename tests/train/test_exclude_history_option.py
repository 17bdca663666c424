"""The candidate policy as a data option (issue 21, item 5): ``exclude_history`` on train / eval /
generate, stored in config.json's data table, used by validation, printed beside every metric.

The hand case: a model whose item rows are all the same vector scores every item equally, so with
ties broken against the target (train/metrics.py) a target ranks last among the candidates: rank =
I with history items kept, I - h (h = distinct history items, none of them the target) with them
excluded.
"""

from __future__ import annotations

import json
import logging
import math

import pandas as pd
import pytest
import torch
from conftest import TINY_MODEL, tiny_csv_flags

from hstu.cli import _run_data, main
from hstu.config import ModelConfig
from hstu.data.prepare import DataSpec, with_options
from hstu.data.sequences import EventLog, make_split
from hstu.model.hstu import build_hstu
from hstu.runs import load_run
from hstu.train.evaluate import evaluate

I = 12
SEQS = {1: [1, 2, 3, 4], 2: [5, 6, 7, 8, 9], 3: [10, 11, 12, 1, 2, 3], 4: [4, 5, 6, 7, 8, 9, 10]}  # no repeats within a user


def hand_log() -> EventLog:
    rows = [(u, i, 100 + j) for u, items in SEQS.items() for j, i in enumerate(items)]
    return EventLog.from_frame(pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp"]), name="hand")


def flat_model():
    model = build_hstu(ModelConfig(num_items=I, **TINY_MODEL))
    with torch.no_grad():
        model.item_emb.weight[1:] = torch.linspace(-1, 1, TINY_MODEL["embedding_dim"])  # every item the same row
    return model.eval()


def hand_metrics(ranks: list[int]) -> dict:
    n = len(ranks)
    return {
        "HR@10": sum(r <= 10 for r in ranks) / n,
        "NDCG@10": sum(1 / math.log2(r + 1) for r in ranks if r <= 10) / n,
        "MRR": sum(1 / r for r in ranks) / n,
    }


def test_flat_model_scores_every_item_equally():
    log_, model = hand_log(), flat_model()
    b = torch.tensor([[1, 2, 3, 0]])
    seq = model.encode(b, torch.tensor([[100, 101, 102, 0]]), torch.tensor([3]))
    s = model.history_scores(model.last_rows(seq, torch.tensor([3])), b, None, torch.tensor([3]))
    assert torch.isinf(s[0, 0]) and (s[0, 1:] == s[0, 1]).all()  # the hand case's premise
    assert log_.num_items == I


@pytest.mark.parametrize("which,hist", [("test", [3, 4, 5, 6]), ("valid", [2, 3, 4, 5])])
def test_metrics_with_exclusion_on_and_off_by_hand(which, hist):
    log_, model = hand_log(), flat_model()
    split = make_split(log_, "clean")
    on, off = evaluate(model, log_, split, which, exclude=True), evaluate(model, log_, split, which, exclude=False)
    for got, ranks in ((on, [I - h for h in hist]), (off, [I] * 4)):
        for k, v in hand_metrics(ranks).items():
            assert got[k] == pytest.approx(v, abs=1e-12), (k, ranks)
    assert on["HR@10"] == 1.0 and off["HR@10"] == 0.0
    # the data option sets the default every evaluation uses
    log_.exclude_history_default = False
    assert evaluate(model, log_, split, which) == off
    assert evaluate(model, with_options(log_, DataSpec("hand", exclude_history=True)), split, which) == on
    assert with_options(log_, DataSpec("hand")) is log_  # None: the data set's own default, no copy


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny CSV run (CSV's default policy is off) trained with --exclude-history, and its log lines."""
    d = tmp_path_factory.mktemp("excl")
    flags = tiny_csv_flags(d)
    handler, logger = _Lines(), logging.getLogger("hstu.train.loop")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        assert main(["train", *flags, "--epochs", "2", "--exclude-history", "--out", str(d / "run"), "--quiet"]) == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return d, flags, handler.lines


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def test_train_stores_the_policy_and_validates_with_it(run):
    d, _, lines = run
    cfg = json.loads((d / "run" / "config.json").read_text())
    assert cfg["data"]["exclude_history"] is True
    assert json.loads((d / "run" / "idmap.json").read_text())["exclude_history_default"] is True
    metrics = json.loads((d / "run" / "metrics.json").read_text())
    assert metrics["exclude_history"] is True
    epochs = [x for x in lines if x.startswith("epoch ")]
    assert len(epochs) == 2 and all("exclude_history=on" in x for x in epochs)
    model, cfg, _ = load_run(d / "run")
    log_, split, _ = _run_data(cfg)
    assert log_.exclude_history_default is True  # the run's option, not CSV's default (off)
    on, off = (evaluate(model, log_, split, "test", exclude=e) for e in (True, False))
    assert on != off
    assert {k: metrics["test"][k] for k in on} == pytest.approx(on)


def test_eval_flag_overrides_the_runs_policy(run, capsys):
    d, _, _ = run
    model, cfg, _ = load_run(d / "run")
    log_, split, _ = _run_data(cfg)
    for flag, excl in (([], True), (["--no-exclude-history"], False), (["--exclude-history"], True)):
        assert main(["eval", "--run", str(d / "run"), "--json", *flag]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out.pop("exclude_history") is excl
        assert [out.pop(k) for k in ("split", "protocol", "precision")] == ["test", "clean", "fp32"]  # what was evaluated
        assert out == pytest.approx(evaluate(model, log_, split, "test", exclude=excl))
    assert main(["eval", "--run", str(d / "run"), "--no-exclude-history"]) == 0
    assert "exclude_history=off): HR@1 " in capsys.readouterr().out


def test_generate_follows_the_runs_policy_and_the_flag(run, capsys):
    d, _, _ = run
    hist = [{"item_id": i, "timestamp": 1000 + j} for j, i in enumerate(range(1, 8))]
    (d / "h.json").write_text(json.dumps(hist))
    got = {}
    for flag in ([], ["--no-exclude-history"]):
        assert main(["generate", "--run", str(d / "run"), "--history", str(d / "h.json"), "-k", "10", "--json", *flag]) == 0
        got[bool(flag)] = [it["item_id"] for it in json.loads(capsys.readouterr().out)["items"]]
    assert not set(got[False]) & set(range(1, 8))  # the run's policy: history items never generated
    assert set(got[True]) & set(range(1, 8))  # kept as candidates: the 20-item catalogue's top 10 holds some


def test_resume_with_another_policy_is_refused(run, capsys):
    d, flags, _ = run
    data_flags = flags[: flags.index("--config")]  # a resumed run keeps its model
    assert main(["train", *data_flags, "--epochs", "3", "--no-exclude-history", "--out", str(d / "run"), "--resume", "--quiet"]) == 2
    assert "--resume: --no-exclude-history here but the run was trained with --exclude-history (" in capsys.readouterr().err


def test_serve_default_and_the_request_field(run):
    from serving import post, serve

    from hstu.cli import build_parser
    from hstu.generate.recommend import Recommender
    from hstu.serve.cli import _settings

    d, _, _ = run
    for flag, want in (([], None), (["--no-exclude-history"], False), (["--exclude-history"], True)):
        assert _settings(build_parser().parse_args(["serve", "--run", str(d / "run"), *flag]))[1].exclude_history is want
    rec = Recommender.from_run(d / "run")
    hist = [{"item_id": i, "timestamp": 1000 + j} for j, i in enumerate(range(1, 8))]
    body = {"history": hist, "k": 10}
    got = {}
    for server_policy in (None, False):
        with serve(rec, buckets=(8,), max_batch=4, exclude_history=server_policy) as s:
            for field in (None, True):
                r = post(s.url, "/v1/generate", body if field is None else {**body, "exclude_history": field})
                assert r.status_code == 200, r.text
                got[server_policy, field] = {x["item_id"] for x in r.json()["items"]}
    assert not got[None, None] & set(range(1, 8))  # the run's policy (on)
    assert got[False, None] & set(range(1, 8))  # the server's --no-exclude-history
    assert not got[False, True] & set(range(1, 8))  # the request's own field wins


def test_resume_asking_for_the_data_sets_default_is_the_same_run(tmp_path, capsys):
    """A run trained without the flag keeps the data set's default (config.json None; a CSV's is off):
    resuming it with that default spelled out (--no-exclude-history) continues it; the other value
    (--exclude-history) is still refused."""
    flags = tiny_csv_flags(tmp_path)
    data_flags, out = flags[: flags.index("--config")], str(tmp_path / "run")
    assert main(["train", *flags, "--epochs", "1", "--out", out, "--quiet"]) == 0
    assert main(["train", *data_flags, "--epochs", "2", "--exclude-history", "--out", out, "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--resume: --exclude-history here but the run was trained with neither flag (the data set's default) (" in err
    assert main(["train", *data_flags, "--epochs", "2", "--no-exclude-history", "--out", out, "--resume", "--quiet"]) == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"]["exclude_history"] is None and len(json.loads((tmp_path / "run" / "history.json").read_text())) == 2
