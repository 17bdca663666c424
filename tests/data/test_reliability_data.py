"""Issue 22, data faults found by a break-it campaign: millisecond times sorted after flooring
(4), a UTF-8 movies.dat read as latin-1 (5), too little data for the protocol (6)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import ML1M, need

from hstu.cli import main
from hstu.config import TrainConfig, model_config_from_preset
from hstu.data.ecommerce import load_csv, load_retailrocket
from hstu.data.movielens import load_movielens
from hstu.data.prepare import DataSpec
from hstu.train.loop import fit

T_MS = 1_700_000_000_000  # 2023-11-14T22:13:20Z
# (item, exact time in ms) in file order: newest first, two events at the same ms (file order kept)
EVENTS = [(30, T_MS + 2), (20, T_MS + 1), (15, T_MS + 1), (10, T_MS)]
EXPECT = [i for i, _ in sorted(EVENTS, key=lambda e: e[1])]  # sorted() is stable: ties in file order
assert EXPECT == [10, 20, 15, 30]


def _iso(ms: int) -> str:
    s, rest = divmod(ms, 1000)
    return pd.Timestamp(s, unit="s", tz="UTC").strftime("%Y-%m-%dT%H:%M:%S") + f".{rest:03d}Z"


def _order(log_) -> list[int]:
    return log_.item_raw_ids[log_.items].tolist()


@pytest.mark.parametrize(
    "kind",
    ["csv_ms_auto", "csv_ms_unit", "csv_us", "csv_iso", "csv_slow_ms", "csv_slow_iso", "parquet_ms", "parquet_datetime", "parquet_iso"],
)
def test_subsecond_times_keep_their_order(tmp_path, kind):
    """Fault 4: times were floored to seconds before sorting, so events within one second came
    out in file order ([30, 20, 15, 10]) instead of time order."""
    ms = [t for _, t in EVENTS]
    t = {
        "csv_us": [x * 1000 for x in ms],
        "csv_iso": [_iso(x) for x in ms],
        "csv_slow_iso": [_iso(x) for x in ms],
        "parquet_iso": [_iso(x) for x in ms],
        "parquet_datetime": pd.to_datetime(ms, unit="ms", utc=True),
    }.get(kind, ms)
    df = pd.DataFrame({"u": [7] * len(EVENTS), "i": [i for i, _ in EVENTS], "t": t})
    cols = "user=u,item=i,time=t" + {"csv_ms_unit": ",time_unit=ms", "csv_us": ",time_unit=us"}.get(kind, "")
    skip = kind.startswith("csv_slow")
    if kind.startswith("parquet"):
        path = tmp_path / "log.parquet"
        df.to_parquet(path)
    else:
        path = tmp_path / "log.csv"
        text = df.to_csv(index=False)
        if skip:  # a row with an extra field sends the file to the line-by-line parser
            text += "7,99,1,extra\n"
        path.write_text(text)
    log_ = load_csv(path, columns=cols, skip_bad_rows=skip)
    assert _order(log_) == EXPECT
    assert log_.timestamps.tolist() == [T_MS // 1000] * len(EVENTS)  # then floored to the model's seconds


def test_retailrocket_ms_keep_their_order(tmp_path):
    rows = "".join(f"{t},5,view,{i},\n" for i, t in EVENTS)
    (tmp_path / "events.csv").write_text("timestamp,visitorid,event,itemid,transactionid\n" + rows)
    log_ = load_retailrocket(tmp_path / "events.csv")
    assert _order(log_) == EXPECT and log_.timestamps.tolist() == [T_MS // 1000] * len(EVENTS)


TITLE = "Misérables, Les (1995)"


def _ml_dir(tmp_path, encoding: str, users: int = 1, events: int = 3):
    d = tmp_path / f"ml-{encoding}"
    d.mkdir()
    movies = [
        (73, TITLE, "Drama|Musical"),
        (1, "Toy Story (1995)", "Animation"),
        (2, "Jumanji (1995)", "Adventure"),
        (3, "Heat (1995)", "Action"),
        (4, "Casino (1995)", "Drama"),
    ]
    (d / "movies.dat").write_bytes("".join(f"{m}::{t}::{g}\n" for m, t, g in movies).encode(encoding))
    ids = [m for m, _, _ in movies]
    (d / "ratings.dat").write_text(
        "".join(f"{u}::{ids[(u + j) % len(ids)]}::4::{978300000 + j}\n" for u in range(1, users + 1) for j in range(events))
    )
    return d


@pytest.mark.parametrize("encoding", ["utf-8", "iso-8859-1"])
def test_movies_dat_encoding_is_detected_per_file(tmp_path, encoding):
    """Fault 5: a UTF-8 movies.dat was decoded as latin-1 ('MisÃ©rables')."""
    log_ = load_movielens(_ml_dir(tmp_path, encoding))
    assert log_.titles[73] == TITLE
    assert log_.facts["encodings"] == {"ratings.dat": "utf-8", "movies.dat": encoding}  # ASCII ratings.dat is UTF-8


def test_original_ml1m_movies_dat_still_reads_as_latin1():
    log_ = load_movielens(need(ML1M / "movies.dat").parent)
    assert log_.titles[73] == TITLE and log_.facts["encodings"]["movies.dat"] == "iso-8859-1"


def _tiny_model():
    return model_config_from_preset("small", max_seq_len=8, embedding_dim=8, d_qk=8, d_v=8, num_blocks=1, num_heads=1)


def test_the_run_records_the_encoding_and_keeps_the_title(tmp_path):
    d = _ml_dir(tmp_path, "utf-8", users=6, events=5)
    fit(tmp_path / "run", _tiny_model(), TrainConfig(epochs=1, batch_size=4, num_negatives=2), DataSpec("ml-1m", str(d)), progress=False)
    ids = json.loads((tmp_path / "run" / "idmap.json").read_text(encoding="utf-8"))
    assert ids["titles"]["73"] == TITLE
    assert ids["data_facts"]["encodings"] == {"ratings.dat": "utf-8", "movies.dat": "utf-8"}
    assert ids["data_facts"]["events"] == 30 and ids["data_facts"]["users"] == 6


def _short_log(tmp_path, counts: list[int]):
    rows = [f"{u},{(u + j) % 5 + 1},{1000 + j}" for u, n in enumerate(counts, start=1) for j in range(n)]
    p = tmp_path / "short.csv"
    p.write_text("u,i,t\n" + "\n".join(rows) + "\n")
    return p


TOO_SHORT = [
    # (per-user event counts, protocol, the one line expected)
    (
        [1] * 25 + [2] * 15,
        "clean",
        (
            "too little data for --protocol clean in csv: of 40 users, 25 have 1 event, 15 have 2 events, "
            "0 have >= 3 events; a user needs >= 3 (a training, a validation and a test event) to be "
            "evaluated, and no user does"
        ),
    ),
    (
        [1] * 25 + [2] * 15,
        "paper",
        (
            "too little data for --protocol paper in csv: 0 training positions (of 40 users, 25 have 1 "
            "event, 15 have 2 events, 0 have >= 3 events; a training position needs a user with >= 3 events)"
        ),
    ),
    (
        [1] * 38 + [3] * 2,
        "clean",
        (
            "too little data for --protocol clean in csv: 0 training positions (of 40 users, 38 have 1 "
            "event, 2 have 3 events, 0 have >= 4 events; a training position needs a user with 2 events "
            "(too few to evaluate: all trained on) or >= 4 events)"
        ),
    ),
]


@pytest.mark.parametrize("counts,protocol,message", TOO_SHORT)
def test_too_little_data_is_one_line_and_writes_nothing(tmp_path, capsys, counts, protocol, message):
    """Fault 6: clean training failed late ('ranking_metrics: no ranks') leaving config.json and
    idmap.json in --out; paper 'trained' on 0 positions with loss 0.0 and said nothing."""
    path, out = _short_log(tmp_path, counts), tmp_path / "out"
    rc = main(
        [
            "train",
            "--dataset",
            "csv",
            "--data-dir",
            str(path),
            "--columns",
            "user=u,item=i,time=t",
            "--protocol",
            protocol,
            "--epochs",
            "1",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == f"hstu train: error: {message}"
    assert not out.exists()
    spec = DataSpec("csv", str(path), protocol, options={"columns": "user=u,item=i,time=t"})
    with pytest.raises(ValueError) as exc:
        fit(tmp_path / "api", _tiny_model(), TrainConfig(epochs=1), spec, progress=False)
    assert str(exc.value) == message and not (tmp_path / "api").exists()


def test_enough_data_for_paper_but_not_clean_trains_under_paper(tmp_path):
    """Two events per user suffice for the paper protocol's train + test only with a third one:
    users with 3 events train one position each."""
    path = _short_log(tmp_path, [3] * 6)
    spec = DataSpec("csv", str(path), "paper", options={"columns": "user=u,item=i,time=t"})
    m = fit(tmp_path / "run", _tiny_model(), TrainConfig(epochs=1, batch_size=4, num_negatives=2), spec, progress=False)
    hist = json.loads((tmp_path / "run" / "history.json").read_text())
    assert hist[0]["positions"] == 6 and m["test"]["users"] == 6


def test_max_seq_len_one_is_named_not_the_data(tmp_path, capsys):
    """[model] max_seq_len = 1 gave "too little data ... 0 training positions" while every user had
    enough events (a fresh-user finding): the error names max_seq_len, and nothing is written."""
    path, out = _short_log(tmp_path, [6] * 40), tmp_path / "out"
    (tmp_path / "m.toml").write_text("[model]\nmax_seq_len = 1\n")
    flags = ["--dataset", "csv", "--data-dir", str(path), "--columns", "user=u,item=i,time=t", "--epochs", "1"]
    assert main(["train", *flags, "--config", str(tmp_path / "m.toml"), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "hstu train: error: [model] max_seq_len = 1 leaves no training position: a window needs >= 2 events"
    assert not out.exists()
