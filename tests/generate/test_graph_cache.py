"""The on-disk graph cache (hstu.backend.graph_cache): engines whose graphs come from the cache give
the eager engine's items (scores within float tolerance) for several batch sizes and strategies;
a second engine loads every graph instead of building it; a stale or mismatched entry (other
weights, another torch version, a truncated file, a corrupt manifest) is never used: rebuilt with a
warning, or refused (build=False) and compiled in memory; a failed build or load falls back to
torch.compile, then eager, with a warning.

Most tests build with :class:`ExportedProgram`, a second compiler for the same cache: the
``torch.export`` program of the runner's :class:`StaticInputs` module saved as a .pt2 and run by
PyTorch (seconds a graph; it checks the cache logic and the static-inputs form, which is what
AOTInductor compiles). One test builds real AOTInductor packages (marked slow: about a minute a
graph on 2 cores)."""

from __future__ import annotations

import logging
import shutil
import warnings

import pytest
import torch
from test_graphs import E, inputs, tiny_model

from hstu.backend import graph_cache as gc
from hstu.backend.graph_cache import GraphCache, StaticInputs
from hstu.generate.engine import Engine


class ExportedProgram:
    """torch.export (non-strict) of the static-inputs module, saved / loaded with torch.export."""

    name = "exported-program"

    def __init__(self) -> None:
        self.built = 0

    def build(self, module: StaticInputs, path) -> None:
        with torch.inference_mode(False), torch.no_grad():
            torch.export.save(torch.export.export(module, tuple(module.roots), strict=False), str(path))
        self.built += 1

    def load(self, path, module):
        return torch.export.load(str(path)).module()


KW = dict(buckets=(E,), max_batch=2, k_max=3, batch_sizes=(1, 2))


def cached_engine(model, directory, compiler, **kw) -> Engine:
    cache = GraphCache(directory, model, "cpu", compiler=compiler, **kw)
    return Engine(model, graphs="compile", compile_backend="aot_eager", graph_cache=cache, **KW)


def same(eng: Engine, ref: Engine, B: int, strategy: str) -> None:
    ids, ts, L, feats, ic = inputs(B, seed=B)
    kw = dict(strategy=strategy, beam_width=2, seed=3, item_category=ic, **feats)
    a, b = eng.generate(ids, ts, L, 3, **kw), ref.generate(ids, ts, L, 3, **kw)
    assert torch.equal(a.items, b.items), (strategy, B)
    torch.testing.assert_close(a.scores, b.scores, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One cache built for the tiny model (greedy at batch sizes 1 and 2), and its compiler."""
    d = tmp_path_factory.mktemp("graphs")
    comp = ExportedProgram()
    eng = cached_engine(tiny_model(), d, comp)
    for B in (1, 2):
        same(eng, Engine(tiny_model(), graphs="eager", **KW), B, "greedy")
    rep = eng.graph_report()
    assert rep and all(r["mode"] == "built" and r["bytes"] > 0 for r in rep), rep
    return d, comp.built


def test_cached_graphs_match_eager_and_load_without_building(built, tmp_path):
    d, n_built = _copy(built, tmp_path), built[1]  # a copy: this test adds entries
    assert n_built == 6  # setup, prefill, step x batch sizes 1, 2
    comp = ExportedProgram()
    eng, ref = cached_engine(tiny_model(), d, comp), Engine(tiny_model(), graphs="eager", **KW)
    for B, s in ((1, "greedy"), (2, "greedy"), (2, "topk"), (1, "topk")):
        same(eng, ref, B, s)
    assert comp.built == 0 and {r["mode"] for r in eng.graph_report()} == {"loaded"}
    same(eng, ref, 2, "beam")  # a new shape (step of 2 beams): built now, into the same cache
    assert comp.built == 2 and {r["mode"] for r in eng.graph_report()} == {"loaded", "built"}


def _copy(built, tmp_path):
    d = tmp_path / "graphs"
    shutil.copytree(built[0], d)
    return d


def test_other_weights_rebuild_with_a_warning(built, tmp_path, caplog):
    d = _copy(built, tmp_path)
    other = tiny_model()
    with torch.no_grad():
        other.item_emb.weight.mul_(1.5)
    comp = ExportedProgram()
    eng = cached_engine(other, d, comp)
    with caplog.at_level(logging.WARNING):
        same(eng, Engine(other, graphs="eager", **KW), 1, "greedy")  # the other model's items, not the cached one's
    assert "stale: built for weights_sha256" in caplog.text and comp.built == 3
    assert {r["mode"] for r in eng.graph_report()} == {"built"}


def test_other_torch_version_refused_without_build(built, tmp_path, monkeypatch, caplog):
    d = _copy(built, tmp_path)
    monkeypatch.setattr(gc, "torch_version", lambda: "9.9.9")
    comp = ExportedProgram()
    eng = cached_engine(tiny_model(), d, comp, build=False)
    with caplog.at_level(logging.WARNING):
        same(eng, Engine(tiny_model(), graphs="eager", **KW), 2, "greedy")
    assert "stale: built for torch" in caplog.text and "9.9.9" in caplog.text and comp.built == 0
    rep = eng.graph_report()
    assert {r["mode"] for r in rep} == {"fallback"} and all("GraphCacheError" in r["error"] for r in rep)


def test_truncated_file_rebuilt(built, tmp_path, caplog):
    d = _copy(built, tmp_path)
    victim = sorted(d.glob("prefill_E20_1_*.pt2"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    comp = ExportedProgram()
    eng = cached_engine(tiny_model(), d, comp)
    with caplog.at_level(logging.WARNING):
        same(eng, Engine(tiny_model(), graphs="eager", **KW), 1, "greedy")
    assert f"{victim} is truncated or corrupt (100 bytes" in caplog.text and comp.built == 1
    modes = {r["key"][0]: r["mode"] for r in eng.graph_report()}
    assert modes == {"setup": "loaded", "prefill": "built", "step": "loaded"}


def test_corrupt_manifest_is_rebuilt_and_a_failed_build_falls_back(tmp_path, caplog):
    """An unreadable manifest is replaced (with a warning) by the first graph built, with the graph files and
    layouts the old one listed removed (they stayed on disk, unlisted): the graphs are
    built, and the next engine loads them (before, every engine compiled in memory, never repairing
    it). A build that fails falls back to torch.compile, then eager, and leaves no file."""
    d = tmp_path / "graphs"
    d.mkdir()
    (d / gc.MANIFEST).write_text("{not json")
    (d / "prefill_E99_1_0123456789ab.pt2").write_bytes(b"an old graph")  # nothing vouches for it any more
    (d / gc.LAYOUT).write_text('{"layouts": [{"buckets": [99], "max_batch": 1}]}')

    class Broken(ExportedProgram):
        def build(self, module, path):
            raise RuntimeError("no compiler here")

    runs = ((d, ExportedProgram(), "built"), (d, ExportedProgram(), "loaded"), (tmp_path / "g2", Broken(), "fallback"))
    for directory, comp, mode in runs:
        eng = cached_engine(tiny_model(), directory, comp)
        with caplog.at_level(logging.WARNING):
            same(eng, Engine(tiny_model(), graphs="eager", **KW), 1, "greedy")
        rep = eng.graph_report()
        assert {r["mode"] for r in rep} == {mode}, rep
    assert "not a graph-cache manifest" in caplog.text and "no compiler here" in caplog.text
    assert "started a new cache with this graph, removing 1 other graph files and layout.json" in caplog.text
    # readable again, one entry per graph; the old files went (they stayed, unlisted, and layout.json named a
    # layout whose graphs no manifest listed)
    assert len(GraphCache(d, tiny_model(), "cpu").entries()) == len(rep) == len(list(d.glob("*.pt2")))
    assert not (d / "prefill_E99_1_0123456789ab.pt2").exists() and GraphCache.layouts(tmp_path) == []
    assert not list((tmp_path / "g2").glob("*.pt2"))  # a failed build leaves no file behind


@pytest.mark.slow
def test_aotinductor_packages_match_eager(tmp_path):
    """Real AOTInductor packages (setup, prefill, step at batch size 1): built by one engine, loaded
    by a second (no compiler run), both giving the eager engine's items for greedy and top-k."""
    kw = dict(buckets=(E,), max_batch=1, k_max=3, batch_sizes=(1,))
    ref = Engine(tiny_model(), graphs="eager", **kw)
    modes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            m = tiny_model()
            eng = Engine(m, graphs="compile", graph_cache=GraphCache(tmp_path, m, "cpu"), **kw)
            for s in ("greedy", "topk"):
                ids, ts, L, feats, ic = inputs(1, seed=7)
                a = eng.generate(ids, ts, L, 3, strategy=s, seed=1, item_category=ic, **feats)
                b = ref.generate(ids, ts, L, 3, strategy=s, seed=1, item_category=ic, **feats)
                assert torch.equal(a.items, b.items), s
                torch.testing.assert_close(a.scores, b.scores, rtol=1e-5, atol=1e-5)
            modes.append({r["mode"] for r in eng.graph_report()})
    assert modes == [{"built"}, {"loaded"}]
    assert not [w for w in caught if "LeafSpec" in str(w.message)]  # torch's own deprecation, once per graph before
    with torch.no_grad():  # the packages hold no weights: they read the model's own parameters
        m.item_emb.weight.mul_(-1.0)
        m.layers[0].uvqk.weight.mul_(0.5)
    eng.refresh()
    ids, ts, L, feats, ic = inputs(1, seed=7)
    a, b = (e.generate(ids, ts, L, 3, item_category=ic, **feats) for e in (eng, Engine(m, graphs="eager", **kw)))
    assert torch.equal(a.items, b.items) and not torch.equal(a.items, ref.generate(ids, ts, L, 3, item_category=ic, **feats).items)
    torch.testing.assert_close(a.scores, b.scores, rtol=1e-5, atol=1e-5)


def test_export_graphs_then_generate_compiled_from_the_cache(tmp_path, monkeypatch, capsys):
    """`hstu export --run RUN --graphs` builds RUN/graphs through a server's warm-up (one line per
    graph: built, seconds, bytes); `hstu generate --graphs compiled` builds the export's engine layout
    (RUN/graphs/layout.json), loads its graphs (nothing new built) and prints the eager command's items."""
    import json

    from conftest import tiny_csv_flags

    from hstu.cli import main

    monkeypatch.setattr(gc, "AOTInductor", ExportedProgram)
    run = tmp_path / "run"
    assert main(["train", *tiny_csv_flags(tmp_path, train={"epochs": 1}), "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--graphs", "--max-batch", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7 and all(" built in " in ln and " MB" in ln for ln in lines[:6]), lines  # 3 kinds x batch 1, 2
    entries = json.loads((run / "graphs" / gc.MANIFEST).read_text())["entries"]
    assert len(entries) == 6 and all((run / "graphs" / e["file"]).stat().st_size == e["bytes"] for e in entries.values())
    hist = tmp_path / "h.json"
    hist.write_text(json.dumps([{"item_id": i, "timestamp": 1000 + j} for j, i in enumerate((3, 7, 11, 2, 5))]))
    out = {}
    for g in ("eager", "compiled"):
        assert main(["generate", "--run", str(run), "--history", str(hist), "-k", "3", "--graphs", g, "--json"]) == 0
        printed = capsys.readouterr()
        out[g] = json.loads(printed.out)
        assert "built and stored" not in printed.err and gc.LAYOUT not in printed.err
    assert [i["item_id"] for i in out["compiled"]["items"]] == [i["item_id"] for i in out["eager"]["items"]]
    for a, b in zip(out["compiled"]["items"], out["eager"]["items"]):
        assert a["score"] == pytest.approx(b["score"], abs=1e-5)
    assert json.loads((run / "graphs" / gc.MANIFEST).read_text())["entries"] == entries  # loaded, none rebuilt or added
    assert GraphCache.layouts(run) == [{"buckets": [8], "max_batch": 2}]  # the tiny model's one bucket (max_seq_len 8)
    from hstu.generate.recommend import Recommender

    rec = Recommender.from_run(run)  # under "auto", an engine of another layout than the export's takes no cache
    assert rec.build_engine((8,), max_batch=2, graphs="auto").graph_cache is not None
    assert rec.build_engine((8,), max_batch=4, graphs="auto").graph_cache is None
    assert rec.build_engine((8,), max_batch=4, graphs="compiled").graph_cache is not None  # builds into it
    (run / "graphs" / gc.LAYOUT).write_text("{")  # unreadable: the one-shot engine's own layout, built into the cache
    assert main(["generate", "--run", str(run), "--history", str(hist), "-k", "3", "--graphs", "compiled", "--json"]) == 0
    printed = capsys.readouterr()
    assert [i["item_id"] for i in json.loads(printed.out)["items"]] == [i["item_id"] for i in out["eager"]["items"]]
    assert len(json.loads((run / "graphs" / gc.MANIFEST).read_text())["entries"]) == 9
    assert f"graph cache {run / 'graphs'}: 3 graphs built and stored now" in printed.err  # said, on stderr (stdout stays JSON)
    assert f"warning: {run / 'graphs' / gc.LAYOUT} is missing or unreadable: this call compiles" in printed.err  # and why
    assert GraphCache.layouts(run) == [{"buckets": [8], "max_batch": 1}]  # the unreadable file replaced by the layout built


def test_a_compiled_engine_records_the_layout_it_builds(built, tmp_path):
    """A fresh-user finding: a `--graphs compiled` server with another max batch than the export's built its graphs into
    the cache, but layout.json kept the export's layout alone, so a later `--graphs auto` server of that layout ran eager.
    Each stored graph now records its engine's layout; "auto" then loads them."""
    shutil.copytree(built[0], tmp_path / gc.DIRNAME)
    GraphCache.add_layout(tmp_path, [E], 2)
    GraphCache.add_layout(tmp_path, [E], 2)  # recorded once
    m = tiny_model()
    assert GraphCache.beside(tmp_path, m, "cpu", holding=True, layout=((E,), 4), compiler=ExportedProgram()) is None
    cache = GraphCache.beside(tmp_path, m, "cpu", layout=((E,), 4), compiler=ExportedProgram())
    eng = Engine(m, graphs="compile", compile_backend="aot_eager", graph_cache=cache, **{**KW, "max_batch": 4, "batch_sizes": (1, 4)})
    ids, ts, L, feats, ic = inputs(1, seed=3)
    eng.generate(ids, ts, L, 3, item_category=ic, **feats)
    assert {r["mode"] for r in eng.graph_report()} == {"built"}
    assert GraphCache.layouts(tmp_path) == [{"buckets": [E], "max_batch": 2}, {"buckets": [E], "max_batch": 4}]
    assert GraphCache.beside(tmp_path, m, "cpu", holding=True, layout=((E,), 4), compiler=ExportedProgram()) is not None
    (tmp_path / gc.DIRNAME / gc.LAYOUT).write_text('{"buckets": [20], "max_batch": 2}')  # a file from before
    assert GraphCache.layouts(tmp_path) == [{"buckets": [E], "max_batch": 2}]


def test_auto_on_the_cpu_loads_what_the_cache_holds_and_runs_the_rest_eager(built, caplog):
    """graphs="auto" with a cache (what a server does by default when the run has one): the cached
    graphs load, a shape the cache lacks (beam search's 2-beam step) runs eager with a warning;
    nothing is built or compiled."""
    d, _ = built
    comp, m = ExportedProgram(), tiny_model()
    eng = Engine(m, graphs="auto", graph_cache=GraphCache(d, m, "cpu", compiler=comp), **KW)
    ref = Engine(tiny_model(), graphs="eager", **KW)
    with caplog.at_level(logging.WARNING):
        for B, s in ((2, "greedy"), (1, "topk"), (2, "beam")):
            same(eng, ref, B, s)
    modes = {tuple(r["key"]): r["mode"] for r in eng.graph_report()}
    beam = {("step", 1, 2), ("setup", 1, False, 2)}  # the beam group's step and setup (one user, 2 beams)
    assert {modes.pop(k) for k in beam} == {"fallback"} and "running it eager" in caplog.text and comp.built == 0
    assert set(modes.values()) == {"loaded"} and len(modes) == 6  # setup, prefill, step at batch 1 and 2
    runs = [r["runs"] for r in eng.graph_report()]
    assert sorted(runs) == ["eager"] * 2 + ["loaded"] * 6  # what a server's /readyz counts (BatchRunner.graph_counts)
    assert Engine(m, graphs="auto", **KW).graphs == "eager"  # without a cache, as before


def test_int8_graphs_beside_the_float_ones_match_eager(built, tmp_path):
    """An INT8 model's graphs (hstu quantize / --precision int8) export with the packed GEMMs as one opaque op
    (hstu::int8_linear, keyed by the Linear's weights) and give the eager INT8 engine's items; they live in the
    same cache as the float model's graphs under other names, so neither replaces the other."""
    from hstu.quant import apply_precision

    d = _copy(built, tmp_path)
    comp = ExportedProgram()
    q = apply_precision(tiny_model(), "int8")
    eng, ref = cached_engine(q, d, comp), Engine(apply_precision(tiny_model(), "int8"), graphs="eager", **KW)
    for B, s in ((1, "greedy"), (2, "topk")):
        same(eng, ref, B, s)
    rep = eng.graph_report()
    assert {r["mode"] for r in rep} == {"built"} and comp.built == 6, rep
    prog = torch.export.load(str(sorted(d.glob("prefill_E20_1_*.pt2"))[-1]))
    assert "hstu.int8_linear" in str(prog.graph) or any(
        "hstu.int8_linear" in str(torch.export.load(str(p)).graph) for p in d.glob("prefill_E20_1_*.pt2")
    )
    f = cached_engine(tiny_model(), d, ExportedProgram())
    same(f, Engine(tiny_model(), graphs="eager", **KW), 2, "greedy")
    assert {r["mode"] for r in f.graph_report()} == {"loaded"}  # the float graphs, untouched by the INT8 build
    assert {"fp32", "int8"} <= GraphCache.precisions(tmp_path)


def test_an_int8_graph_refuses_weights_this_process_lacks():
    from hstu.quant.int8 import int8_linear

    with pytest.raises(RuntimeError, match="INT8 Linear 4x8:fbgemm:00 is not loaded in this process"):
        int8_linear(torch.zeros(2, 8), "4x8:fbgemm:00")


def test_auto_skips_a_cache_without_graphs_at_the_models_precision(built, tmp_path):
    """A fresh-user finding: a server at --precision int8 on a run whose cache holds float graphs only warned once per
    graph (60 lines) that it ran eager; under graphs "auto" such a cache is not used at all (the log's hint names the
    export command), while "compiled" still gets it to build into."""
    from hstu.quant import apply_precision

    shutil.copytree(built[0], tmp_path / gc.DIRNAME)
    q, f = apply_precision(tiny_model(), "int8"), tiny_model()
    assert GraphCache.beside(tmp_path, q, "cpu", holding=True, compiler=ExportedProgram()) is None
    assert GraphCache.beside(tmp_path, q, "cpu", compiler=ExportedProgram()) is not None
    assert GraphCache.beside(tmp_path, f, "cpu", holding=True, compiler=ExportedProgram()) is not None


def test_auto_skips_a_cache_built_for_another_layout(built, tmp_path):
    """A fresh-user finding: `hstu serve` with default buckets on a run exported with `--buckets 20 --max-batch 2`
    logged "the model runs eager", then warned once per graph (60 lines) that the cache lacked it and said
    "graphs from the run's graph cache (...): 60 eager" in /readyz. No graph of another layout can load (names cover the pools'
    shapes), so under graphs "auto" such a cache is not used; "compiled" still gets it, to build into."""
    shutil.copytree(built[0], tmp_path / gc.DIRNAME)
    GraphCache.add_layout(tmp_path, [E], 2)
    m = tiny_model()
    assert GraphCache.beside(tmp_path, m, "cpu", holding=True, layout=((E,), 2), compiler=ExportedProgram()) is not None
    for other in (((E,), 4), ((4, E), 2)):
        assert GraphCache.beside(tmp_path, m, "cpu", holding=True, layout=other, compiler=ExportedProgram()) is None
        assert GraphCache.beside(tmp_path, m, "cpu", layout=other, compiler=ExportedProgram()) is not None


def test_auto_skips_a_stale_cache_with_one_warning(built, tmp_path, monkeypatch, caplog):
    """A fresh-user finding: a server on a run whose cache was exported by an older hstu (another code_sha256) warned
    once per graph, 60 lines in each model process, that it ran that graph eager. Under graphs "auto" a cache none of
    whose entries was built for this process (code, torch, weights) is not used: one warning naming the field and the
    export command; a cache with one current entry is still used, and "compiled" still gets a stale one to rebuild."""
    shutil.copytree(built[0], tmp_path / gc.DIRNAME)
    m, other = tiny_model(), tiny_model()
    with torch.no_grad():
        other.item_emb.weight.mul_(1.5)
    with caplog.at_level(logging.WARNING):
        assert GraphCache.beside(tmp_path, m, "cpu", holding=True, compiler=ExportedProgram()) is not None
    assert not caplog.records
    cases = ((m, "torch_version", "9.9.9", "torch"), (m, "code_sha256", "0" * 64, "code_sha256"), (other, None, None, "weights_sha256"))
    for model, patch, now, field in cases:
        with monkeypatch.context() as mp:
            if patch:
                mp.setattr(gc, patch, lambda now=now: now)
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                assert GraphCache.beside(tmp_path, model, "cpu", holding=True, compiler=ExportedProgram()) is None
                assert GraphCache.beside(tmp_path, model, "cpu", compiler=ExportedProgram()) is not None  # "compiled": rebuilds
            assert len(caplog.records) == 1 and f"is stale: built for {field} " in caplog.text, caplog.text
            assert now is None or f", this is {now[:16]}: running eager" in caplog.text
            assert f"`hstu export --run {tmp_path} --graphs` rebuilds it" in caplog.text
