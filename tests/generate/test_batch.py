"""Batch inference (hstu.generate.batch, ``hstu generate --all-users --out``; issue 23 item 4) on the
tiny 200-user ML-1M run:

- the output equals per-user ``Recommender.recommend`` on histories rebuilt from ratings.dat
  (items exactly, scores to float32 reassociation), for greedy, beam and seeded top-k;
- files hold the same users, ranks, items and titles for any --workers and --chunk-users, and the
  same scores up to one float32 ulp (another process may sum in another order; batch.py's
  docstring); within one process a chunk size changes no bit;
- a job stopped after some chunks resumes: finished chunks are not recomputed (counted), the
  final file equals an uninterrupted one, the parts are removed, no OUT exists before the end;
- Ray Data on a local Ray instance gives the single-process file;
- bad flags: one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from hstu.cli import main
from hstu.config import DecodeOptions
from hstu.generate import batch, batch_parts
from hstu.generate.recommend import History

K = 5
BATCH = ["--batch-users", "16", "--threads", "2"]


def _gen(run_dir: Path, out: Path, *extra: str, k: int = K) -> int:
    return main(["generate", "--run", str(run_dir), "--all-users", "--out", str(out), "-k", str(k), *BATCH, *extra])


def _users_file(path: Path, users) -> Path:
    path.write_text("# users of the test\n" + "\n".join(str(u) for u in users) + "\n")
    return path


def _read(path: Path) -> pd.DataFrame:
    if path.suffix == ".jsonl":
        return pd.read_json(path, lines=True, dtype={"score": "float32", "rank": "int32"})
    return pd.read_parquet(path)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """Equal files: every column exactly, scores to float32 rounding (rtol 1e-6: ~1 ulp at 8..12)."""
    pd.testing.assert_frame_equal(a.drop(columns="score"), b.drop(columns="score"), check_exact=True)
    assert a.score.dtype == b.score.dtype == np.float32
    np.testing.assert_allclose(a.score.to_numpy(), b.score.to_numpy(), rtol=1e-6, atol=0)


def _expected(ref, ratings: pd.DataFrame, users, k: int, d: DecodeOptions) -> dict[int, list[dict]]:
    """Per-user Recommender.recommend (a second instance, batches of one) on each user's full
    history rebuilt from ratings.dat in time order."""
    out = {}
    for u in users:
        g = ratings[ratings.user == u]
        prep = ref.prepare(History(g.item.tolist(), g.ts.tolist()))
        out[u] = ref.recommend([prep], k, decoding=d)[0]
    return out


def _check_against(df: pd.DataFrame, expected: dict[int, list[dict]]) -> None:
    for u, items in expected.items():
        rows = df[df.user_id == u].sort_values("rank")
        assert rows["rank"].tolist() == list(range(1, len(items) + 1))
        assert rows.item_id.tolist() == [it["item_id"] for it in items], u
        np.testing.assert_allclose(rows.score.to_numpy(np.float64), [it["score"] for it in items], rtol=1e-5, atol=1e-5)
        assert rows.title.tolist() == [it.get("title") for it in items]


@pytest.fixture(scope="module")
def full(run_dir, tmp_path_factory) -> Path:
    """Every user, greedy, one process, chunks of 50."""
    out = tmp_path_factory.mktemp("batch") / "recs.parquet"
    assert _gen(run_dir, out, "--chunk-users", "50") == 0
    return out


def test_all_users_equal_per_user_recommend(full, ref, ratings):
    df = _read(full)
    users = np.sort(ratings.user.unique())
    assert list(df.columns) == ["user_id", "rank", "item_id", "score", "title"]
    assert str(df.score.dtype) == "float32" and str(df["rank"].dtype) == "int32"
    assert df.user_id.tolist() == np.repeat(users, K).tolist()  # data-set order, k rows each
    assert not Path(str(full) + ".parts").exists()
    for u, g in df.groupby("user_id"):  # ML-1M excludes the (kept: last max_seq_len = 50) history; no repeats
        assert len(set(g.item_id)) == K and not set(g.item_id) & set(ratings.item[ratings.user == u].tail(50))
    sample = users[[0, 1, 7, 50, 99, 123, 150, 199]]
    _check_against(df, _expected(ref, ratings, sample, K, DecodeOptions("greedy")))


def test_workers_and_chunk_size_do_not_change_the_file(full, run_dir, ratings, tmp_path):
    users = np.sort(ratings.user.unique())[:100]
    out = tmp_path / "w2.parquet"
    assert _gen(run_dir, out, "--users-file", str(_users_file(tmp_path / "u.txt", users)), "--chunk-users", "7", "--workers", "2") == 0
    _same(_read(out), _read(full).iloc[: 100 * K].reset_index(drop=True))


def test_beam_any_chunking_equals_per_user(run_dir, ref, ratings, tmp_path):
    users = np.sort(ratings.user.unique())[::8][::-1]  # 25 users, file order reversed
    f = _users_file(tmp_path / "users.txt", users)
    files = []
    for chunk in ("4", "25"):
        files.append(tmp_path / f"beam{chunk}.jsonl")
        assert _gen(run_dir, files[-1], "--users-file", str(f), "--chunk-users", chunk, "--strategy", "beam", "--beam-width", "3", k=4) == 0
    a, b = _read(files[0]), _read(files[1])
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert a.user_id.drop_duplicates().tolist() == users.tolist()  # --users-file order
    _check_against(a, _expected(ref, ratings, users[:6], 4, DecodeOptions("beam", beam_width=3)))


def test_topk_is_seeded_per_user(run_dir, ref, ratings, tmp_path):
    users = np.sort(ratings.user.unique())[:9]
    f = _users_file(tmp_path / "users.txt", users)
    files = []
    for chunk in ("2", "9"):
        files.append(tmp_path / f"topk{chunk}.parquet")
        args = ["--users-file", str(f), "--chunk-users", chunk, "--strategy", "topk", "--top-k", "20", "--temperature", "1.5"]
        args += ["--seed", "7"]
        assert _gen(run_dir, files[-1], *args) == 0
    a = _read(files[0])
    pd.testing.assert_frame_equal(a, _read(files[1]), check_exact=True)
    _check_against(a, _expected(ref, ratings, users, K, DecodeOptions("topk", top_k=20, temperature=1.5, seed=7)))


def test_parquet_and_jsonl_hold_the_same_rows(full, run_dir, ratings, tmp_path):
    users = np.sort(ratings.user.unique())[:30]
    out = tmp_path / "recs.jsonl"
    assert _gen(run_dir, out, "--users-file", str(_users_file(tmp_path / "u.txt", users))) == 0
    want = _read(full).iloc[: 30 * K].reset_index(drop=True)
    pd.testing.assert_frame_equal(_read(out), want, check_exact=True)  # float32 scores round-trip through JSON


class Stop(Exception):
    pass


def test_a_stopped_job_resumes_without_recomputing(full, run_dir, ratings, tmp_path):
    from hstu.cli import _run_data
    from hstu.model.checkpoint import read_json

    log_ = _run_data(read_json(run_dir / "config.json"))[0]
    users = [int(u) for u in np.sort(ratings.user.unique())[:60]]
    spec = batch.BatchSpec(str(run_dir), K, DecodeOptions("greedy"), batch_users=16)
    out = tmp_path / "recs.parquet"
    seen: list[int] = []

    def stop_after_3(i, n):
        seen.append(i)
        if len(seen) == 3:
            raise Stop

    with pytest.raises(Stop):
        batch.run_batch(spec, out, log_, users, chunk_users=7, on_chunk=stop_after_3)
    parts = out.with_name(out.name + ".parts")
    assert not out.exists() and sorted(p.name for p in parts.glob("chunk-*")) == [f"chunk-{i:06d}.parquet" for i in seen]
    again: list[int] = []
    res = batch.run_batch(spec, out, log_, users, chunk_users=7, on_chunk=lambda i, n: again.append(i))
    assert res["chunks"] == 9 and res["computed"] == 6 and sorted(again) == sorted(set(range(9)) - set(seen))
    assert not parts.exists()
    got, want = _read(out), _read(full).iloc[: 60 * K].reset_index(drop=True)
    # chunks of 7 users here, 50 in ``full``: other batch shapes, so the GEMMs may round the last bit otherwise
    # (11 % of the scores did on one CPU); the items and every other column are exact
    pd.testing.assert_frame_equal(got.drop(columns="score"), want.drop(columns="score"), check_exact=True)
    np.testing.assert_allclose(got.score.to_numpy(), want.score.to_numpy(), rtol=1e-6, atol=1e-6)

    # the same OUT.parts with other flags is another job: refused, naming the field
    def stop(i, n):
        raise Stop

    with pytest.raises(Stop):
        batch.run_batch(spec, tmp_path / "b.parquet", log_, users, chunk_users=7, on_chunk=stop)
    other = batch.BatchSpec(str(run_dir), 3, DecodeOptions("greedy"), batch_users=16)
    with pytest.raises(ValueError, match=r"another job \(.*\bk\b"):
        batch.run_batch(other, tmp_path / "b.parquet", log_, users, chunk_users=7)


def test_a_users_file_with_a_byte_order_mark_is_read(run_dir, tmp_path):
    """A --users-file saved with a byte-order mark named its first line 'not an integer id: '\ufeff1''."""
    from hstu.cli import _run_data
    from hstu.model.checkpoint import read_json

    log_ = _run_data(read_json(run_dir / "config.json"))[0]
    (tmp_path / "u.txt").write_text("1\n3\n2\n", encoding="utf-8-sig")
    assert batch.read_users_file(tmp_path / "u.txt", log_) == [1, 3, 2]


def test_a_job_failing_at_once_leaves_nothing(run_dir, tmp_path, monkeypatch, capsys):
    def boom(self, users, histories):
        raise ValueError("user 1: broken on purpose")

    monkeypatch.setattr(batch.ChunkGenerator, "__call__", boom)
    out = tmp_path / "recs.parquet"
    assert _gen(run_dir, out) == 2
    assert "broken on purpose" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert _gen(run_dir, tmp_path / "new" / "deeper" / "recs.parquet") == 2  # the directories it made go too
    assert "broken on purpose" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_the_output_directory_is_created(run_dir, tmp_path):
    """A missing directory of --out is created, as `hstu quantize` and `hstu export` create theirs (the job
    refused it, 'create it first'); the file equals one written into an existing directory."""
    assert _gen(run_dir, tmp_path / "a.jsonl") == 0
    assert _gen(run_dir, tmp_path / "new" / "deeper" / "a.jsonl") == 0
    assert (tmp_path / "new" / "deeper" / "a.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out", "recs.parquet", "--user", "1"], "without --user"),
        ([], "--all-users needs --out"),
        (["--out", "recs.csv"], "unknown output suffix '.csv'"),
        (["--out", "recs.parquet", "--users-file", "USERS"], "USERS:3: user 999999 is not among"),
        (["--out", "recs.parquet", "--users-file", "TEXT"], "TEXT:2: user id: not an integer id: 'abc'"),
        (["--out", "USERS/recs.parquet"], "not a directory: "),
        (["--out", "/proc/hstu-nope/recs.jsonl"], "--out /proc/hstu-nope/recs.jsonl: cannot create /proc/hstu-nope"),
        (["--out", "recs.parquet", "--ray-address", "auto"], "only with --engine ray"),
    ],
)
def test_bad_batch_flags_exit_2_with_one_line(run_dir, tmp_path, capsys, extra, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "USERS").write_text("1\n2\n999999\n")
    (tmp_path / "TEXT").write_text("1\nabc\n")
    assert main(["generate", "--run", str(run_dir), "--all-users", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "id[0]" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["TEXT", "USERS"]  # nothing written, no directory made


def test_batch_flags_need_all_users(run_dir, capsys):
    assert main(["generate", "--run", str(run_dir), "--user", "1", "--out", "x.parquet", "--workers", "2"]) == 2
    assert "--out, --workers: only with --all-users" in capsys.readouterr().err
    # --threads is not a batch flag: one user's generation takes it too (a fresh-user finding)
    assert main(["generate", "--run", str(run_dir), "--user", "1", "--threads", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["items"] and torch.get_num_threads() == 2
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--run", str(run_dir), "--all-users", "--out", "x.parquet", "--workers", "0"])
    assert exc.value.code == 2


@pytest.mark.filterwarnings("ignore:.*deprecated:DeprecationWarning")  # Ray Data's own DataContext fields
def test_ray_data_job_equals_the_local_file(full, run_dir, ratings, tmp_path):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    users = np.sort(ratings.user.unique())[:40]
    out = tmp_path / "ray.parquet"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        f = _users_file(tmp_path / "u.txt", users)
        assert _gen(run_dir, out, "--users-file", str(f), "--chunk-users", "9", "--engine", "ray", "--workers", "2") == 0
    finally:
        ray.shutdown()
    _same(_read(out), _read(full).iloc[: 40 * K].reset_index(drop=True))


def test_all_users_refuses_compiled_graphs_before_any_work(tmp_path, capsys):
    """--graphs compiled with --all-users was accepted and ignored (the batch job runs eager): refused in one line, as --ann."""
    from hstu.cli import main

    out = tmp_path / "x.jsonl"
    assert main(["generate", "--run", str(tmp_path), "--all-users", "--out", str(out), "--graphs", "compiled"]) == 2
    assert "--graphs compiled: the batch job (--all-users) runs eager" in capsys.readouterr().err and not out.exists()


def test_existing_output_kept_unless_overwrite(run_dir, ratings, tmp_path, capsys):
    """A second `--all-users` into the same --out replaced the finished file without a word (a trial's data loss):
    refused before any work, the file unchanged; --overwrite replaces it."""
    out = tmp_path / "recs.jsonl"
    out.write_text("earlier output\n")
    f = _users_file(tmp_path / "u.txt", np.sort(ratings.user.unique())[:3])
    assert _gen(run_dir, out, "--users-file", str(f)) == 2
    assert "exists (an earlier output?); give --overwrite" in capsys.readouterr().err
    assert out.read_text() == "earlier output\n" and not Path(str(out) + ".parts").exists()
    assert _gen(run_dir, out, "--users-file", str(f), "--overwrite") == 0
    assert len(_read(out)) == 3 * K


def _log(run_dir):
    from hstu.cli import _run_data
    from hstu.model.checkpoint import read_json

    return _run_data(read_json(run_dir / "config.json"))[0]


def _stopped_job(run_dir, out: Path, users, chunk_users: int, stop_at: int):
    """A job stopped (an exception in on_chunk) after ``stop_at`` finished chunks; its log_, spec and parts directory."""
    log_ = _log(run_dir)
    spec = batch.BatchSpec(str(run_dir), K, DecodeOptions("greedy"), batch_users=16)
    seen: list[int] = []

    def stop(i, n):
        seen.append(i)
        if len(seen) == stop_at:
            raise Stop

    with pytest.raises(Stop):
        batch.run_batch(spec, out, log_, users, chunk_users=chunk_users, workers=1, on_chunk=stop)
    return log_, spec, out.with_name(out.name + ".parts")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_cut_off_part_is_computed_again(run_dir, ratings, tmp_path, caplog, fmt):
    """A rerun trusted its parts unchecked: with a part cut off (a crash before the parts were fsynced, a full disk,
    a hand edit) it said '814 users, 4015 rows' and wrote a cut-off JSON line into OUT. Each part is checked (it
    parses and holds its users x k rows; Parquet: its footer); a bad one is named in one warning and computed again."""
    users = [int(u) for u in np.sort(ratings.user.unique())[:12]]
    whole = tmp_path / f"whole.{fmt}"
    assert batch.run_batch(
        batch.BatchSpec(str(run_dir), K, DecodeOptions("greedy"), batch_users=16), whole, _log(run_dir), users, chunk_users=3
    )
    out = tmp_path / f"recs.{fmt}"
    log_, spec, parts = _stopped_job(run_dir, out, users, 3, stop_at=3)
    done = sorted(parts.glob(f"chunk-*.{fmt}"))
    assert len(done) == 3
    cut = {done[0]: done[0].stat().st_size - 10}  # mid-line / mid-footer
    if fmt == "jsonl":  # whole lines, one row short
        cut[done[1]] = len(done[1].read_bytes().rsplit(b"\n", 2)[0]) + 1
    for p, size in cut.items():
        with open(p, "r+b") as f:
            f.truncate(size)
    caplog.clear()
    with caplog.at_level("WARNING", logger="hstu.generate.batch_parts"):
        res = batch.run_batch(spec, out, log_, users, chunk_users=3)
    assert res["users"] == 12 and res["rows"] == 12 * K and res["computed"] == 1 + len(cut)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == len(cut) and all(str(p) in w for p, w in zip(cut, warned)), warned
    why = ["its last line is cut off", f"{K * 3 - 1} rows, its chunk has {K * 3}"] if fmt == "jsonl" else ["not a whole Parquet file"]
    assert all(w in m for w, m in zip(why, warned)), warned
    assert not parts.exists()
    if fmt == "jsonl":  # one process, same chunks: the same bytes
        assert out.read_bytes() == whole.read_bytes()
    else:
        pd.testing.assert_frame_equal(_read(out), _read(whole), check_exact=True)


def test_a_part_cut_before_assembly_is_named_and_no_out_written(run_dir, ratings, tmp_path):
    """The concatenation checks each part as it reads it: one cut after the rerun checked it (here: while the job ran)
    fails the job naming it, OUT is not written, and the part is removed so that the same command computes it again."""
    users = [int(u) for u in np.sort(ratings.user.unique())[:6]]
    out = tmp_path / "recs.jsonl"
    log_, spec, parts = _stopped_job(run_dir, out, users, 2, stop_at=1)
    first = next(parts.glob("chunk-*.jsonl"))

    def cut_first(i, n):
        with open(first, "r+b") as f:
            f.truncate(first.stat().st_size - 3)

    with pytest.raises(ValueError, match=rf"{first}: its last line is cut off; removed: the same command computes"):
        batch.run_batch(spec, out, log_, users, chunk_users=2, on_chunk=cut_first)
    assert not out.exists() and not first.exists() and len(list(parts.glob("chunk-*.jsonl"))) == 2
    res = batch.run_batch(spec, out, log_, users, chunk_users=2)
    assert res["computed"] == 1 and res["rows"] == 6 * K and len(out.read_bytes().splitlines()) == 6 * K


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd through /proc")
def test_parts_and_out_are_written_durably(run_dir, ratings, tmp_path, monkeypatch):
    """Parts were written temp + rename without fsync: after a power cut a part could be renamed into place with its
    data lost. Each file (job.json, every part, OUT) is fsynced before its rename, and its directory after."""
    import os

    events: list[tuple] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def spy_replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    users = [int(u) for u in np.sort(ratings.user.unique())[:4]]
    out = tmp_path / "recs.parquet"
    batch.run_batch(batch.BatchSpec(str(run_dir), K, DecodeOptions("greedy"), batch_users=16), out, _log(run_dir), users, chunk_users=2)
    parts = out.with_name(out.name + ".parts")
    renames = [e for e in events if e[0] == "replace"]
    assert [Path(d).name for _, _, d in renames] == ["job.json", "chunk-000000.parquet", "chunk-000001.parquet", "recs.parquet"]
    for _, src, dst in renames:
        at = events.index(("replace", src, dst))
        assert ("fsync", src) in events[:at], (src, events)  # the data, before the rename
        assert events[at + 1] == ("fsync", str(Path(dst).parent)), (dst, events)  # the rename itself
    assert not parts.exists() and len(_read(out)) == 4 * K


@pytest.mark.parametrize(
    "content, why",
    [
        (b'{"user_id": 1, "rank": 1, "item_id": 2, "score": 0.5}\n', None),
        (b'{"user_id": 1, "rank": 1, "item_id": 2, "score": 0.5}\n{"user_id": 1, "rank": 2, "item_id": 3, "score"\n', "line 2 is not"),
        (
            b'{"user_id": 1, "rank": 1, "item_id": 2, "score": 0.5}\n{"user_id": 1, "rank": 2}\n',
            "line 2 is not a JSON object of the columns",
        ),
        (b"[1, 1, 2, 0.5]\n", "line 1 is not"),
        (b'{"user_id": 1, "rank": 1, "item_id": 2, "score": 0.5}', "its last line is cut off"),
        (b"", "0 rows, its chunk has 1"),
    ],
)
def test_part_problem_of_a_json_lines_part(tmp_path, content, why):
    p = tmp_path / "chunk-000000.jsonl"
    p.write_bytes(content)
    got = batch_parts.part_problem(p, "jsonl", list(batch.BASE_COLUMNS), 1)
    assert got is None if why is None else why in got, got
