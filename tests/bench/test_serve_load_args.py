"""benchmarks/serve_load.py refuses, before starting anything, the settings under which no request
could succeed or no step could run (found by a fresh-user trial: each ran and exited 0 with 0 QPS)."""

from __future__ import annotations

import json

import pytest
from conftest import REPO


@pytest.fixture
def serve_load(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import serve_load

    return serve_load


@pytest.fixture
def run(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model": {"max_output_len": 7}}))
    return str(tmp_path)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["-k", "0"], "-k: items per request must be in 1..7"),
        (["-k", "8"], "-k: items per request must be in 1..7"),  # the run's max_output_len
        (["--history", "0"], "--history: must be >= 1"),
        (["--step-s", "0"], "--step-s: seconds must be > 0"),
        (["--recovery-s", "-1"], "--recovery-s: seconds must be > 0"),
        (["--beam-share", "1.5"], "--beam-share: a fraction in [0, 1]"),
        (["--resolution", "1"], "--resolution: a ratio in [0, 1)"),
        (["--steps", "abc"], "--steps: expected comma-separated"),
    ],
)
def test_bad_settings_exit_2_naming_the_flag(serve_load, run, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        serve_load.parse_args(["--run", run, *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_good_settings_keep_their_values_and_defaults_fill_the_rest(serve_load, run):
    a = serve_load.parse_args(["--run", run, "--quick", "-k", "7", "--step-s", "0.5"])
    assert (a.k, a.step_s, a.overload_s, a.recovery_s) == (7, 0.5, 6.0, 3.0)


def test_a_url_where_no_server_answers_is_one_line(serve_load):
    from hstu.bench.load import ServerStartError, start_server

    args = serve_load.parse_args(["--url", "http://127.0.0.1:9"])  # the discard port: nothing listens
    with pytest.raises(ServerStartError, match=r"--url http://127.0.0.1:9: no server answers there"):
        start_server(args)
