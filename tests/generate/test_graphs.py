"""Compiled bucket graphs (Engine graphs="compiled" / "compile") against the eager engine, the
oracle: the same items and scores within float tolerance for every bucket, batch size, step kind
(prefill, one-beam and beam steps, prefix-cache extensions) and strategy; a failed compilation
falls back to eager with a warning (engine and server runner); the platform object picks the mode.

Most tests trace with the "aot_eager" backend (TorchDynamo capture + AOT functionalisation, the
graphs Inductor would compile, without C++ code generation: seconds, not minutes, on 2 cores);
the Inductor C++ test is marked slow (~2 min there)."""

from __future__ import annotations

import logging

import pytest
import torch

from hstu.backend import CPUBackend, CUDABackend, NPUBackend
from hstu.backend.base import Backend
from hstu.config import DecodeOptions, ModelConfig
from hstu.generate.engine import Engine
from hstu.model import build_hstu

I = 60  # items
E = 20  # the one bucket


def tiny_model(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_items=I,
        max_seq_len=E,
        max_output_len=3,
        embedding_dim=8,
        num_blocks=2,
        num_heads=2,
        d_qk=4,
        d_v=4,
        dropout=0.0,
        num_actions=3,
        num_categories=4,
        **kw,
    )
    return build_hstu(cfg).eval()


def inputs(B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    L = torch.tensor([5, E, 11, 2][:B])
    ids = torch.randint(1, I + 1, (B, E), generator=g)
    ts = torch.sort(torch.randint(10**8, 10**8 + 10**6, (B, E), generator=g), dim=1).values
    feats = dict(actions=torch.randint(0, 4, (B, E), generator=g), categories=torch.randint(0, 5, (B, E), generator=g))
    return ids, ts, L, feats, torch.randint(0, 5, (I + 1,), generator=g)


def engines(backend: str, **model_kw):
    m = tiny_model(**model_kw)
    kw = dict(buckets=(E,), max_batch=2, k_max=3, batch_sizes=(1, 2), prefix_cache_bytes=1 << 20)
    return Engine(m, graphs="compiled", compile_backend=backend, **kw), Engine(m, graphs="eager", **kw)


CASES = [(B, s) for B in (1, 2) for s in ("greedy", "topk", "beam")]


def check_all_cases(compiled: Engine, eager: Engine, rtol: float) -> None:
    """Every batch size x strategy, first as a prefix-cache miss (prefill), then as a hit (extend)."""
    for B, strategy in CASES:
        ids, ts, L, feats, ic = inputs(B, seed=B)
        for users in (None, [f"{strategy}{i}" for i in range(B)], [f"{strategy}{i}" for i in range(B)]):
            kw = dict(strategy=strategy, beam_width=2, seed=7, item_category=ic, user_ids=users, **feats)
            got, want = compiled.generate(ids, ts, L, 3, **kw), eager.generate(ids, ts, L, 3, **kw)
            assert torch.equal(got.items, want.items), (B, strategy, users)
            torch.testing.assert_close(got.scores, want.scores, rtol=rtol, atol=rtol)
            assert torch.equal(got.prefix_rows, want.prefix_rows)
    report = compiled.graph_report()
    keys = {tuple(g["key"]) for g in report}
    # request setup, prefill and one-beam steps at both batch sizes, the beam step (1 user x 2 beams), extensions
    want = {("setup", 1, True, 2), ("setup", 2, True, 2), ("setup", 1, False, 2), ("prefill", 1), ("prefill", 2)}
    assert want | {("step", 1, 1), ("step", 2, 1), ("step", 1, 2)} <= keys
    assert any(k[0] == "extend" for k in keys)
    assert all(g["mode"] == "compiled" and g["error"] is None for g in report), report


@pytest.mark.parametrize("multi_channel", [False, True], ids=["hstu", "multi_channel"])
def test_compiled_matches_eager_every_batch_size_and_strategy(multi_channel):
    torch._dynamo.reset()
    compiled, eager = engines("aot_eager", multi_channel=multi_channel)
    assert compiled.graphs == "compile" and compiled.batch_sizes == (1, 2)
    check_all_cases(compiled, eager, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own import
def test_inductor_cpp_graphs_match_eager():
    """Inductor's C++ code (what ``hstu serve --graphs compiled`` runs on the CPU): the same items,
    scores within float32 reassociation (fused kernels sum in another order)."""
    torch._dynamo.reset()
    compiled, eager = engines("inductor")
    check_all_cases(compiled, eager, rtol=1e-5)


def test_each_runner_has_its_own_graph_cache():
    """TorchDynamo caches graphs per code object; all runners of a kind share one closure's code,
    so past the recompile limit they would silently run eager. Each runner's own code object
    keeps every shape compiled even with a limit of one graph per code object."""
    torch._dynamo.reset()
    compiled, eager = engines("aot_eager")
    ids, ts, L, feats, ic = inputs(2, seed=3)
    with torch._dynamo.config.patch(recompile_limit=1):
        for B in (1, 2):
            got = compiled.generate(ids[:B], ts[:B], L[:B], 3, **{k: v[:B] for k, v in feats.items()})
            want = eager.generate(ids[:B], ts[:B], L[:B], 3, **{k: v[:B] for k, v in feats.items()})
            assert torch.equal(got.items, want.items)
    names = {f"{g['key'][0]}_{g['key'][1]}": g["mode"] for g in compiled.graph_report()}
    assert names == {f"{kind}_{B}": "compiled" for kind in ("setup", "prefill", "step") for B in (1, 2)}


def failing_backend(gm, example_inputs):
    raise RuntimeError("forced compiler failure (test)")


def test_compile_failure_falls_back_to_eager_with_a_warning(caplog):
    torch._dynamo.reset()
    m = tiny_model()
    kw = dict(buckets=(E,), max_batch=2, k_max=3)
    broken = Engine(m, graphs="compiled", compile_backend=failing_backend, **kw)
    eager = Engine(m, graphs="eager", **kw)
    ids, ts, L, feats, _ = inputs(2, seed=5)
    with caplog.at_level(logging.WARNING, logger="hstu.backend.graphs"):
        got = broken.generate(ids, ts, L, 3, **feats)
    want = eager.generate(ids, ts, L, 3, **feats)
    assert torch.equal(got.items, want.items) and torch.equal(got.scores, want.scores)
    report = broken.graph_report()
    assert {tuple(g["key"]) for g in report} == {("setup", 2, True, 2), ("prefill", 2), ("step", 2, 1)}
    assert all(g["mode"] == "eager (fallback)" and "forced compiler failure" in g["error"] for g in report)
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("prefill_E20_2" in s and "running it eager" in s for s in msgs), msgs
    assert len(msgs) == 3  # one warning per graph
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hstu.backend.graphs"):
        again = broken.generate(ids, ts, L, 3, **feats)  # later calls go straight to eager: no second attempt, no warning
    assert torch.equal(again.items, want.items) and len(broken.graph_report()) == 3 and not caplog.records


def test_server_runner_falls_back_to_eager_when_compilation_fails(rec, ref, monkeypatch, caplog):
    """The serving path: a BatchRunner asked for compiled graphs whose compiler fails warms up and
    answers with eager results, logging a warning per graph."""
    from hstu.serve.runner import BatchRunner

    def broken(self, fn, name, backend="inductor"):
        def compiled():
            raise RuntimeError("forced C++ toolchain failure (test)")

        return compiled

    monkeypatch.setattr(Backend, "compile_graph", broken)
    runner = BatchRunner(rec, [20], 2, graphs="compiled")
    plain = BatchRunner(ref, [20], 2, graphs="eager")
    assert runner.engine.graphs == "compile" and plain.engine.graphs == "eager"
    with caplog.at_level(logging.WARNING, logger="hstu.backend.graphs"):
        runner.warmup(20)
    assert any("running it eager" in r.getMessage() for r in caplog.records)
    jobs = runner.synthetic_jobs(20, 2)
    got, want = runner.run_batch(20, jobs), plain.run_batch(20, jobs)
    assert all(not isinstance(x, Exception) for x in got)
    for a, b in zip(got, want):
        assert repr(a) == repr(b)
    assert runner.engine.graph_report() and all(g["mode"] == "eager (fallback)" for g in runner.engine.graph_report())
    n = len(runner.engine.graph_report())  # /readyz "generation" and the serving log say so
    assert runner.backend_name == f"engine, graphs compile (compiled at warm-up): {n} eager"


def test_platform_decides_the_compiled_mode():
    """ "compiled": the device's graph capture where it has one (CUDA graphs, NPU graphs with
    NPUGraph), else torch.compile; "auto" keeps eager where nothing captures."""
    assert CPUBackend().resolve_graph_mode("compiled") == "compile"
    assert CPUBackend().resolve_graph_mode("auto") == "eager"
    assert CUDABackend().resolve_graph_mode("compiled") == "cuda_graph"
    npu = NPUBackend()
    assert npu.resolve_graph_mode("compiled") == ("npu_graph" if npu.supports_graphs else "compile")
    with pytest.raises(ValueError, match="graphs must be one of"):
        CPUBackend().resolve_graph_mode("compiled-ish")


def test_serve_graphs_flag_and_config_field(tmp_path):
    """`hstu serve --graphs compiled` reaches ServeConfig.graphs (flags over a --config file); a bad
    value in the file is refused naming the field."""
    import argparse

    from hstu.serve.cli import _settings, add_subcommands

    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers())
    (tmp_path / "serve.toml").write_text('[serve]\ngraphs = "eager"\n')
    base = ["serve", "--run", str(tmp_path / "run"), "--config", str(tmp_path / "serve.toml")]
    assert _settings(parser.parse_args(base))[0].graphs == "eager"
    assert _settings(parser.parse_args([*base, "--graphs", "compiled"]))[0].graphs == "compiled"
    (tmp_path / "serve.toml").write_text('[serve]\ngraphs = "turbo"\n')
    with pytest.raises(ValueError, match="ServeConfig.graphs must be auto, eager or compiled, got 'turbo'"):
        _settings(parser.parse_args(base))


def test_compiled_graphs_follow_weights_changed_in_place():
    """A compiled graph reads the model's parameters as inputs, never as baked constants: after the
    weights change in place (a reloaded checkpoint, Engine.refresh()), it gives what eager gives
    with the new weights, not the old results."""
    torch._dynamo.reset()
    compiled, eager = engines("aot_eager")
    ids, ts, L, feats, _ = inputs(2, seed=9)
    before = compiled.generate(ids, ts, L, 3, **feats)
    with torch.no_grad():
        for p in compiled.model.layers.parameters():
            p.mul_(-1.5)  # the same model object under both engines
    compiled.refresh()
    eager.refresh()
    got, want = compiled.generate(ids, ts, L, 3, **feats), eager.generate(ids, ts, L, 3, **feats)
    assert torch.equal(got.items, want.items)
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got.scores, before.scores)  # the new weights did change the answer


def test_compiled_graphs_replay_without_guard_checks(monkeypatch):
    """An engine call replays its compiled graphs under TorchDynamo's skip-guard stance
    (hstu.backend.graphs.replay_stance; a runner's first call, which compiles, leaves it): the same
    items and scores as with the guards checked and as eager, for every batch size, strategy and
    prefix-cache hit; an eager engine, or one with guard_checks set, never skips them."""
    import hstu.generate.engine as engine_mod

    torch._dynamo.reset()
    seen = []
    real = engine_mod.replay_stance
    monkeypatch.setattr(engine_mod, "replay_stance", lambda skip: seen.append(skip) or real(skip))
    compiled, eager = engines("aot_eager")
    assert compiled.guard_checks is False
    check_all_cases(compiled, eager, rtol=1e-6)  # calls compiled, then eager, 3 times per case
    assert seen == [True, False] * (3 * len(CASES))
    checked, eager = engines("aot_eager")  # fresh prefix caches on both sides
    checked.guard_checks = True
    seen.clear()
    check_all_cases(checked, eager, rtol=1e-6)
    assert seen == [False, False] * (3 * len(CASES))


def test_server_compiles_graphs_in_warm_up_only(rec, ref, monkeypatch):
    """A server's engine compiles in warm-up only (BatchRunner sets Engine.compile_new around it): a
    beam request after warm-up needs beam-step graphs the warm-up did not make, and they run eager
    instead of compiling while the request waits (minutes with Inductor on a CPU: it timed out with a
    503 on a server whose /readyz said ready). Its answer is the eager server's."""
    from dataclasses import replace

    from hstu.backend import graphs as graphs_mod
    from hstu.serve.runner import BatchRunner

    def traced(self, fn, name, backend="inductor"):  # aot_eager: the same graphs, seconds instead of minutes
        return graphs_mod.compile_graph(fn, name, "aot_eager")

    monkeypatch.setattr(Backend, "compile_graph", traced)
    torch._dynamo.reset()
    runner = BatchRunner(rec, [20], 2, graphs="compiled")
    plain = BatchRunner(ref, [20], 2, graphs="eager")
    assert runner.engine.compile_new is False  # until warm-up
    runner.warmup(20)
    assert runner.engine.compile_new is False
    warmed = {tuple(g["key"]) for g in runner.engine.graph_report()}
    assert warmed and all(g["mode"] == "compiled" for g in runner.engine.graph_report())
    assert runner.backend_name == f"engine, graphs compile (compiled at warm-up): {len(warmed)} compiled"
    jobs = [replace(j, decoding=DecodeOptions(strategy="beam", beam_width=2)) for j in runner.synthetic_jobs(20, 1)[:1]]
    got, want = runner.run_batch(20, jobs), plain.run_batch(20, jobs)
    assert not isinstance(got[0], Exception) and repr(got) == repr(want)
    assert {tuple(g["key"]) for g in runner.engine.graph_report()} == warmed  # the beam graphs were not compiled
    assert ("step", 1, 2) in runner.engine._buckets[20].runners  # ... but made, eager
