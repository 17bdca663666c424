"""The Recommender's Python API at its edge (conftest's tiny run): shared by threads, each thread gets
the single-threaded answer; bad timestamps, k, decoding and unprepared histories are refused with one
error naming the argument, with the messages of ``hstu generate --history`` where it checks the same."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from hstu.config import DecodeOptions, GenerateConfig
from hstu.generate.recommend import History, HistoryError, Recommender

THREADS, CALLS = 6, 8


def _histories(ratings, n: int) -> list[History]:
    """The first 12 events of ``n`` users of the tiny run (one History each, original ids)."""
    out = []
    for _, g in list(ratings.groupby("user"))[:n]:
        out.append(History(items=[int(i) for i in g.item.iloc[:12]], timestamps=[int(t) for t in g.ts.iloc[:12]]))
    return out


def test_threads_sharing_one_recommender_get_the_single_threaded_items(run_dir, ratings, ref) -> None:
    hs = _histories(ratings, THREADS)
    # expected: an independent instance, one call at a time
    want = [[d["item_id"] for d in ref.recommend([ref.prepare(h)], k=5)[0]] for h in hs]
    want_beam = [[d["item_id"] for d in ref.recommend([ref.prepare(h)], k=3, strategy="beam", beam_width=3)[0]] for h in hs]
    assert len({tuple(w) for w in want}) > 1  # the users' answers differ: a crossed result is seen

    rec = Recommender.from_run(run_dir)  # fresh: its default engine is built by the threads' first calls
    preps = [rec.prepare(h) for h in hs]
    start, got, errors = threading.Barrier(THREADS), {}, []

    def work(t: int) -> None:
        try:
            start.wait()
            for c in range(CALLS):
                if c % 2:
                    items = rec.recommend([preps[t]], k=3, strategy="beam", beam_width=3)[0]
                    got[t, c] = ([d["item_id"] for d in items], want_beam[t])
                else:
                    got[t, c] = ([d["item_id"] for d in rec.recommend([preps[t]], k=5)[0]], want[t])
        except Exception as exc:  # noqa: BLE001 - reported below, with the thread
            errors.append((t, repr(exc)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    assert len(got) == THREADS * CALLS
    wrong = {key: pair for key, pair in got.items() if pair[0] != pair[1]}
    assert not wrong, f"{len(wrong)} of {len(got)} calls differ from the single-threaded items, e.g. {list(wrong.items())[:2]}"


R = "must be Unix seconds in 0..9223372036 (up to 2262-04-11)"
MS = "; milliseconds? divide by 1000"


@pytest.mark.parametrize(
    "timestamps, request_time, message",
    [
        ([1.9], None, "history[0].timestamp must be an integer, got 1.9"),
        ([True], None, "history[0].timestamp must be an integer, got True"),
        (["978300760"], None, "history[0].timestamp must be an integer, got '978300760'"),
        ([-1], None, f"history[0].timestamp {R}, got -1"),
        ([2**63], None, f"history[0].timestamp {R}, got 9223372036854775808"),
        # milliseconds were read as seconds (year 55,900): generated with nonsense time buckets, no word said
        (
            [978300760, 978300761000],
            None,
            f"history[1].timestamp {R}{MS}, got 978300761000",
        ),
        (
            [978300760],
            1700000000000,
            f"history.request_time {R}{MS}, got 1700000000000",
        ),
        ([978300760, 1.5], None, "history[1].timestamp must be an integer, got 1.5"),
        (np.array([5.0]), None, "history[0].timestamp must be an integer, got"),
        ([978300760], 1.5, "history.request_time must be an integer, got 1.5"),
        ([978300760], True, "history.request_time must be an integer, got True"),
        ([978300760], -3, f"history.request_time {R}, got -3"),
    ],
)
def test_prepare_refuses_what_the_cli_history_file_refuses(rec, ratings, timestamps, request_time, message) -> None:
    item = int(ratings.item.iloc[0])
    h = History(items=[item] * len(timestamps), timestamps=timestamps, request_time=request_time)
    with pytest.raises(HistoryError) as exc:
        rec.prepare(h)
    assert str(exc.value).startswith(message), str(exc.value)


def test_prepare_timestamp_messages_equal_the_cli_files(rec, ratings, tmp_path, capsys) -> None:
    from hstu.cli import main

    item = int(ratings.item.iloc[0])
    for t in (1.7, -1):
        (tmp_path / "h.json").write_text(json.dumps([{"item_id": item, "timestamp": t}]))
        assert main(["generate", "--run", str(rec.run_dir), "--history", str(tmp_path / "h.json")]) == 2
        cli = capsys.readouterr().err
        with pytest.raises(HistoryError) as exc:
            rec.prepare(History(items=[item], timestamps=[t]))
        tail = str(exc.value).removeprefix("history[0]")  # the CLI's "FILE: event [0]" here
        assert f"event [0]{tail}" in cli, (cli, str(exc.value))


def test_prepare_takes_integer_arrays_and_numpy_ints(rec, ratings) -> None:
    g = ratings[ratings.user == ratings.user.iloc[0]].iloc[:6]
    items, ts = [int(i) for i in g.item], [int(t) for t in g.ts]
    a = rec.prepare(History(items=items, timestamps=ts, request_time=ts[-1] + 10))
    for other in (np.asarray(ts, dtype=np.int64), [np.int64(t) for t in ts], np.asarray(ts, dtype=np.uint32)):
        b = rec.prepare(History(items=items, timestamps=other, request_time=np.int64(ts[-1] + 10)))
        assert b.timestamps.dtype == np.int64 and b.timestamps.tolist() == sorted(ts) and b.request_time == ts[-1] + 10
        assert b.ids.tolist() == a.ids.tolist()


@pytest.mark.parametrize(
    "k, error, message",
    [
        (True, ValueError, "k: must be an integer, got True"),
        (2.0, ValueError, "k: must be an integer, got 2.0"),
        ("3", ValueError, "k: must be an integer, got '3'"),
        (0, ValueError, "k: must be in 1..10 (the model's max_output_len), got 0"),
        (11, ValueError, "k: must be in 1..10 (the model's max_output_len), got 11"),
    ],
)
def test_recommend_refuses_a_k_that_is_no_integer_in_range(rec, ratings, k, error, message) -> None:
    assert rec.model.cfg.max_output_len == 10  # the tiny run's: the messages' range
    prep = rec.prepare(_histories(ratings, 1)[0])
    with pytest.raises(error) as exc:
        rec.recommend([prep], k=k)
    assert str(exc.value) == message


def test_recommend_takes_a_numpy_integer_k(rec, ref, ratings) -> None:
    h = _histories(ratings, 1)[0]
    got = rec.recommend([rec.prepare(h)], k=np.int64(3))[0]
    assert [d["item_id"] for d in got] == [d["item_id"] for d in ref.recommend([ref.prepare(h)], k=3)[0]]


@pytest.mark.parametrize("decoding", ["beam", {"strategy": "beam", "beam_width": 3}, ("beam", 3)])
def test_recommend_refuses_a_decoding_that_is_no_decode_options(rec, ratings, decoding) -> None:
    prep = rec.prepare(_histories(ratings, 1)[0])
    with pytest.raises(TypeError) as exc:
        rec.recommend([prep], k=3, decoding=decoding)
    assert str(exc.value).startswith("decoding must be a DecodeOptions"), str(exc.value)
    assert repr(decoding) in str(exc.value)


def test_recommend_decoding_of_a_generate_config_and_unknown_fields(rec, ref, ratings) -> None:
    h = _histories(ratings, 1)[0]
    want = [d["item_id"] for d in ref.recommend([ref.prepare(h)], k=3, decoding=DecodeOptions("beam", beam_width=3))[0]]
    got = rec.recommend([rec.prepare(h)], k=3, decoding=GenerateConfig("beam", beam_width=3, k=7))[0]  # its k is not a decoding field
    assert [d["item_id"] for d in got] == want
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['stratgy'\]; decoding fields: \['strategy',"):
        rec.recommend([rec.prepare(h)], k=3, stratgy="beam")
    d = DecodeOptions("beam", beam_width=3)
    d.beam_width = True  # set after construction: checked again
    with pytest.raises(ValueError, match=r"DecodeOptions.beam_width must be an integer in 1..16, got True"):
        rec.recommend([rec.prepare(h)], k=3, decoding=d)


def test_recommend_of_a_history_not_prepared_says_to_prepare_it(rec, ratings) -> None:
    h = _histories(ratings, 1)[0]
    with pytest.raises(TypeError, match=r"^preps\[1\] is a History; call rec\.prepare\(history\) first"):
        rec.recommend([rec.prepare(h), h], k=3)
    with pytest.raises(TypeError, match=r"^preps must be a list of prepared histories \(Recommender\.prepare\), got Prepared"):
        rec.recommend(rec.prepare(h), k=3)
    with pytest.raises(TypeError, match=r"^preps\[0\] must be a Prepared history \(from Recommender\.prepare\), got dict"):
        rec.rank([{"ids": [1]}], k=3)


def test_prepare_refuses_a_non_history_and_unknown_policies(rec, ratings):
    """``prepare({"items": ...})`` failed with "object of type 'builtin_function_or_method' has no len()";
    ``unknown="bogus"`` / ``order="bogus"`` were accepted silently (a second trial)."""
    h = _histories(ratings, 1)[0]
    with pytest.raises(TypeError, match=r"prepare takes a History .*got dict"):
        rec.prepare({"items": [1], "timestamps": [1]})
    with pytest.raises(ValueError, match=r"unknown must be 'drop' or 'reject' and order 'sort' or 'reject', got 'bogus' and 'sort'"):
        rec.prepare(h, unknown="bogus")
    with pytest.raises(ValueError, match=r"got 'drop' and 'bogus'"):
        rec.prepare(h, order="bogus")


@pytest.mark.parametrize("option", ["exclude_history", "allow_untrained"])
def test_yes_no_options_take_booleans_only(rec, ratings, option) -> None:
    """A trial's finding: exclude_history="no" (or "false") was truthy and excluded the history; allow_untrained="no"
    let untrained items through. A bool (NumPy's too) or None only, else a TypeError naming the option."""
    g = ratings[ratings.user == ratings.user.iloc[0]]
    p = rec.prepare(History(items=g.item.tolist(), timestamps=g.ts.tolist()))
    for bad in ("no", "false", 0, 1.0):
        with pytest.raises(TypeError, match=rf"{option} must be True, False or None, got {bad!r}"):
            rec.recommend([p], 3, **{option: bad})
    assert rec.recommend([p], 3, **{option: np.bool_(False)}) == rec.recommend([p], 3, **{option: False})
