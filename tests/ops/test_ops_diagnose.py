"""hstu diagnose: knowledge-base schema, matching on fixture logs (plog/slog, tracebacks, dmesg),
evidence file:line, ranking, CANN-aware causes, unknown errors listed and not guessed."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from hstu.ops import diagnose as dg
from hstu.ops.cli import main

LOGS = Path(__file__).parent / "fixtures" / "ops" / "logs"
PLOG = LOGS / "ascend" / "log" / "debug" / "plog" / "plog-171423_20240510143301123.log"
RUN_PLOG = LOGS / "ascend" / "log" / "run" / "plog" / "plog-9911_20240511080000000.log"
KB = dg.load_knowledge_base()

REQUIRED = [  # the failures the issue asks the knowledge base to cover
    "acl-model-load-failed",
    "acl-device-not-available",
    "npu-out-of-memory",
    "cann-ez-family",
    "cann-ee-family",
    "cann-ei-family",
    "hccl-timeout",
    "tensors-on-different-devices",
    "tensor-size-mismatch",
    "cuda-out-of-memory",
    "cuda-illegal-memory-access",
    "cuda-device-side-assert",
    "nccl-error",
    "segfault-after-mmap",
    "undefined-symbol",
]


def ids(report):
    return [f.entry.id for f in report.findings]


def finding(report, entry_id):
    return next(f for f in report.findings if f.entry.id == entry_id)


def test_knowledge_base_schema():
    got = {e.id for e in KB.entries}
    assert set(REQUIRED) <= got
    for e in KB.entries:
        assert e.causes, e.id
        for c in e.causes:
            assert c.why.strip() and c.verify.strip() and c.fix.strip(), (e.id, c)
        assert e.source.strip(), e.id
        assert e.patterns, e.id
    assert KB.reset_markers and KB.unknown_markers
    assert KB.families["I"]["module"].startswith("HCCL") and KB.families["Z"]["module"]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d["entries"][0]["causes"][0].pop("verify"), r"causes\[0\]: field 'verify'"),
        (lambda d: d["entries"][0]["causes"][0].update(fix=""), r"field 'fix' must be a non-empty"),
        (
            lambda d: d["entries"][1].update(patterns=["(unclosed"]),
            r"entries\[1\] \(acl-device-not-available\).*invalid regex",
        ),
        (lambda d: d["entries"][2].update(severity="meh"), "severity must be one of"),
        (lambda d: d["entries"][3].update(id=d["entries"][0]["id"]), "duplicate id"),
        (lambda d: d["entries"][0].update(colour="red"), r"unknown key\(s\) \['colour'\]"),
        (lambda d: d["entries"][0]["causes"][0].update(cann="~8.0"), "bad CANN spec"),
        (lambda d: d["entries"][0].update(causes=[]), "needs at least one cause"),
        (
            lambda d: d["entries"][0]["causes"][1].update(code="EZ[9"),
            r"entries\[0\] \(acl-model-load-failed\)\.causes\[1\]\.code: invalid regex",
        ),
        (lambda d: d.update(reset_codes=["507010"]), "reset_codes must be a list of integers"),
    ],
)
def test_knowledge_base_validation_names_entry_and_field(tmp_path, mutate, match):
    data = yaml.safe_load((Path(dg.__file__).parent / "knowledge_base.yaml").read_text())
    mutate(data)
    f = tmp_path / "kb.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=match):
        dg.load_knowledge_base(f)


def test_plog_ranked_by_first_appearance_with_evidence():
    r = dg.diagnose([str(PLOG)], KB)
    assert ids(r) == [
        "npu-out-of-memory",
        "hccl-timeout",
        "npu-aicore-exception",
        "npu-task-timeout",
        "npu-device-fault",
    ]
    oom = finding(r, "npu-out-of-memory")
    # lines 4 (error code=207001), 5 (Alloc device memory failed), 6 (runtime result = 207001)
    assert [(e.path, e.line) for e in oom.evidence] == [(str(PLOG), 4), (str(PLOG), 5), (str(PLOG), 6)]
    assert oom.count == 3
    hccl = finding(r, "hccl-timeout")
    assert [e.line for e in hccl.evidence] == [7, 8, 9]
    assert "hccn_tool" in hccl.causes[2].verify
    # the EZ9999 line is explained by the specific AI-Core entry, so the EZ family does not report it
    assert "cann-ez-family" not in ids(r)
    unknown_lines = sorted(u.evidence[0].line for u in r.unknown)
    assert unknown_lines == [10, 12, 15]  # E19999 (GE internal), Stream Synchronize failed, EL0007
    notes = {u.evidence[0].line: u.note for u in r.unknown}
    assert notes[10] == "CANN code E19999: module GE (graph engine), internal error (9000-9999)"
    assert notes[15] == "CANN code EL0007: module Driver, user error (0000-8999)"
    assert notes[12] is None


def test_model_load_and_device_not_available():
    r = dg.diagnose([str(RUN_PLOG)], KB)
    assert ids(r) == ["acl-model-load-failed", "acl-device-not-available"]
    ml = finding(r, "acl-model-load-failed")
    assert [e.line for e in ml.evidence] == [2, 3]  # ACL_ERROR_RT_MODEL_LOAD_FAILED, ErrorNo: 545001
    dev = finding(r, "acl-device-not-available")
    assert [e.line for e in dev.evidence] == [4, 5]  # name, and runtime result = 207004
    assert r.unknown == []


def test_cann_version_selects_causes():
    old = finding(dg.diagnose([str(RUN_PLOG)], KB, cann_version="8.0.RC3"), "acl-model-load-failed")
    new = finding(dg.diagnose([str(RUN_PLOG)], KB, cann_version="8.5.0"), "acl-model-load-failed")
    every = finding(dg.diagnose([str(RUN_PLOG)], KB), "acl-model-load-failed")
    assert any("Ascend-cann-kernels-" in c.fix for c in old.causes) and not any("-ops_" in c.fix for c in old.causes)
    assert any("-ops_" in c.fix for c in new.causes) and not any("Ascend-cann-kernels-" in c.fix for c in new.causes)
    assert len(every.causes) == len(old.causes) + 1
    text = dg.render_text(dg.diagnose([str(RUN_PLOG)], KB))
    assert "[CANN <8.5.0]" in text and "[CANN >=8.5.0]" in text


def test_cann_family_letter_is_version_aware():
    assert dg.decode_cann_code("EP1001", KB, "8.3.RC1") == "CANN code EP1001: module Dump, user error (0000-8999)"
    assert "only defined from CANN 8.3.RC1" in dg.decode_cann_code("EP1001", KB, "8.0.RC3")
    assert "not in the error-code reference" in dg.decode_cann_code("EQ1001", KB)
    assert dg.cann_spec_matches(">=8.0.RC1,<8.5.0", "8.0.0") and not dg.cann_spec_matches(">=8.0.RC1,<8.5.0", "8.5.0")


@pytest.mark.parametrize(
    "name,entry,line,groups",
    [
        (
            "traceback_undefined_symbol.txt",
            "undefined-symbol",
            6,
            {
                "symbol": "_ZN3c1010Dispatcher17runRecordFunctionERN2at14RecordFunctionESt17reference_wrapperIKNS_14FunctionSchemaEENS_11DispatchKeyE"
            },
        ),
        ("traceback_same_device.txt", "tensors-on-different-devices", 8, {"dev_a": "npu:0", "dev_b": "cpu"}),
        ("traceback_size_mismatch.txt", "tensor-size-mismatch", 4, {"a": "200", "b": "256", "dim": "1"}),
    ],
)
def test_tracebacks(name, entry, line, groups):
    r = dg.diagnose([str(LOGS / name)], KB)
    assert ids(r) == [entry]
    f = r.findings[0]
    assert f.evidence[0].line == line
    assert f.evidence[0].context is not None and f.evidence[0].context.startswith('File "')
    for k, v in groups.items():
        assert f.groups[k] == v
    assert r.unknown == []


def test_placeholders_filled_from_the_match():
    r = dg.diagnose([str(LOGS / "traceback_undefined_symbol.txt")], KB)
    verifies = [r.findings[0].filled(c.verify) for c in r.findings[0].causes]
    assert "ldd /opt/venv/lib/python3.10/site-packages/torch_npu/lib/libtorch_npu.so" in verifies[1]
    assert verifies[2].startswith("echo '_ZN3c1010Dispatcher")
    r = dg.diagnose([str(LOGS / "traceback_autoload.txt")], KB)
    assert ids(r) == ["cann-env-not-loaded", "autoload-backend-failed"]
    auto = finding(r, "autoload-backend-failed")
    assert auto.filled(auto.causes[0].verify) == 'TORCH_DEVICE_BACKEND_AUTOLOAD=0 python -c "import torch, torch_npu"'


def test_cuda_and_nccl_log():
    r = dg.diagnose([str(LOGS / "cuda_errors.log")], KB)
    assert ids(r) == ["cuda-device-side-assert", "cuda-illegal-memory-access", "cuda-out-of-memory", "nccl-error"]
    assert [e.line for e in finding(r, "cuda-device-side-assert").evidence] == [2, 6]
    assert [e.line for e in finding(r, "nccl-error").evidence] == [11, 12]


def test_dmesg():
    r = dg.diagnose([str(LOGS / "dmesg.txt")], KB)
    assert ids(r) == [
        "segfault-after-mmap",
        "host-oom-killer",
        "nvidia-xid-fallen-off-bus",
        "nvidia-xid-ecc",
        "npu-device-fault",
    ]
    assert finding(r, "segfault-after-mmap").groups["proc"] == "python3"
    assert finding(r, "host-oom-killer").groups == {"pid": "204811", "proc": "python"}
    assert finding(r, "nvidia-xid-ecc").groups["xid"] == "94"
    assert "vm.max_map_count" in " ".join(c.verify for c in finding(r, "segfault-after-mmap").causes)
    # an unknown kernel message is listed as unknown, the USB line (no error marker) is ignored
    assert [u.evidence[0].line for u in r.unknown] == [8]


def test_unknown_errors_are_listed_not_guessed():
    r = dg.diagnose([str(LOGS / "unknown_only.log")], KB)
    assert r.findings == []
    assert [(u.evidence[0].line, u.count) for u in r.unknown] == [(2, 1), (3, 1), (4, 2)]  # ValueError x2 grouped
    text = dg.render_text(r)
    assert "unknown (3 distinct error line(s)" in text and "not guessed" in text
    assert "likely causes" not in text


def test_directory_walk_gz_and_binary_skip(tmp_path):
    d = tmp_path / "ascend" / "log"
    shutil.copytree(LOGS / "ascend" / "log", d)
    with gzip.open(d / "old-plog.log.gz", "wt") as fh:
        fh.write("RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.96 GiB total capacity)\n")
    (d / "core.bin.log").write_bytes(b"\x00\x01[ERROR] binary\n")
    files = dg.expand_paths([str(tmp_path)])
    assert str(d / "core.bin.log") not in files
    assert str(d / "old-plog.log.gz") in files
    r = dg.diagnose([str(tmp_path)], KB)
    oom = finding(r, "npu-out-of-memory")
    # os.walk lists a directory's own files before its subdirectories: the .gz line comes first
    assert (oom.evidence[0].path, oom.evidence[0].line) == (str(d / "old-plog.log.gz"), 1)
    assert oom.count == 4
    with pytest.raises(FileNotFoundError, match="nope"):
        dg.diagnose([str(tmp_path / "nope")], KB)


def test_codes_need_a_code_word_nearby():
    lines = [("x", 1, "2024-05-10-14:33:21.207001 processed 207001 records"), ("x", 2, "step done, error code: 207001")]
    r = dg.diagnose_lines(lines, KB)
    assert [e.line for e in finding(r, "npu-out-of-memory").evidence] == [2]


def test_cli_text_json_and_exit_codes(capsys):
    assert main(["diagnose", str(LOGS / "dmesg.txt"), "--json", "--cann-version", "8.0.RC3"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["findings"][0]["id"] == "segfault-after-mmap" and doc["findings"][0]["rank"] == 1
    assert doc["findings"][0]["evidence"][0] == {
        "path": str(LOGS / "dmesg.txt"),
        "line": 1,
        "text": (LOGS / "dmesg.txt").read_text().splitlines()[0],
    }
    assert doc["unknown"][0]["evidence"][0]["line"] == 8
    assert main(["diagnose", str(LOGS / "traceback_same_device.txt"), "--cann-version", "8.0.RC3"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"1\. \[error\] tensors on different devices", out)
    assert f"{LOGS / 'traceback_same_device.txt'}:8:" in out and "verify:" in out and "fix:" in out
    clean = LOGS.parent / "smi" / "npu_smi_usages_910b.txt"
    assert main(["diagnose", str(clean), "--cann-version", "8.0.RC3"]) == 0
    assert main(["diagnose", "/definitely/not/here"]) == 2


def test_a_bad_cann_version_is_refused_before_any_log_is_read(capsys):
    """`diagnose --cann-version banana plog.log` printed "CANN banana" and diagnosed (exit 1): the version was
    checked only where a matched cause depends on it."""
    from hstu.cli import main as hstu_main

    assert hstu_main(["diagnose", str(LOGS / "dmesg.txt"), "--cann-version", "banana"]) == 2
    err = capsys.readouterr().err
    assert "--cann-version: not an Ascend version (expected like 8.0.RC3 or 24.1.0): 'banana'" in err
    with pytest.raises(ValueError, match="--cann-version"):
        dg.diagnose_lines(iter(()), KB, cann_version="8")


def test_counts_and_numbers_are_not_return_codes(tmp_path, capsys):
    """A trial: `result: 507046 users evaluated` read as a stream timeout and `error_count=507015` as an AI Core
    exception (exit 1): a bare number after any of "result", "error"... was a return code."""
    log = tmp_path / "codes.log"
    log.write_text("result: 507046 users evaluated\nerror_count=507015\n")
    assert main(["diagnose", str(log), "--cann-version", "8.0.RC3"]) == 0
    assert "no known errors and nothing that looks like an error" in capsys.readouterr().out
    normal = [
        "INFO batch job: processed 507010 rows in 3.2s",
        "ret=507015",  # a plain "ret" names a return code only on a line about the runtime, driver or HCCL
        "status: 207001",
        "error code: 507015 users",
        "query result = 545001 (cached)",
    ]
    r = dg.diagnose_lines([("x", i, t) for i, t in enumerate(normal, 1)], KB)
    assert r.findings == [] and r.unknown == []


@pytest.mark.parametrize(
    "line,entry",
    [
        ("error code 507015", "npu-aicore-exception"),
        ("aclrtSynchronizeStream: ret=507015", "npu-aicore-exception"),
        ("halMemAlloc failed: drvRetCode=207001", "npu-out-of-memory"),
        ("LoadModelFromFile: ErrorNo: 545001(Load model error.)", "acl-model-load-failed"),
        ("rtStreamSynchronize status=507046 in stream 3", "npu-task-timeout"),
        ("[ERROR] RUNTIME(1,x):2024 [s.cc:1] sync failed, result is 507046", "npu-task-timeout"),
        ("EE9999: Inner Error!", "cann-ee-family"),
    ],
)
def test_return_codes_in_their_real_forms_still_match(line, entry):
    assert ids(dg.diagnose_lines([("x", 1, line)], KB)) == [entry]


@pytest.mark.parametrize(
    "code,first",
    [("EZ9999", "EZ9xxx is an internal operator error"), ("EZ1001", "an operator (aclnn API) rejected its inputs")],
)
def test_family_causes_fit_the_code(code, first, capsys):
    """A trial: for EZ9999 the first cause listed said it applies to codes below EZ9000."""
    r = dg.diagnose_lines([("x", 1, f"[ERROR] OP(1,x):2024 [op.cc:1] {code}: op failed")], KB)
    (f,) = r.findings
    assert f.entry.id == "cann-ez-family" and [c.why[: len(first)] for c in f.causes] == [first]
    both = dg.diagnose_lines([("x", 1, "EE1001: bad arg"), ("x", 2, "EE9999: inner")], KB).findings[0]
    assert len(both.causes) == 2  # both codes seen: both causes fit


def _brute_force(text):
    """What diagnose matched before the prefilter: every pattern of every entry, then the unknown markers."""
    for fallback in (False, True):
        hits = [(e.id, e.search(text).group(0)) for e in KB.entries if e.fallback == fallback and e.search(text)]
        if hits:
            return hits, False
    return [], any(p.search(text) for p in KB.unknown_markers)


def test_prefilter_matches_what_every_pattern_would():
    lines = [t for f in sorted(LOGS.rglob("*")) if f.is_file() for t in f.read_text(errors="replace").splitlines()]
    lines += ["EZ9999 x", "ez9999", "Ünïcode FATAL error", "ERR00100 PTA call", "KeyError: 'x'", "x" * 300]
    matcher = dg._Matcher(KB)
    assert len(matcher.always) <= 2  # nearly every pattern has strings to look for first
    for text in lines:
        hits, marked = matcher.match(text)
        assert ([(e.id, m.group(0)) for e, m in hits], marked) == _brute_force(text), text


@pytest.mark.parametrize(
    "pattern,needs",
    [
        (r"(?i)\bload model\b.*\bfail", {"load model"}),
        (r"NCCL error|ncclSystemError", {"nccl error", "ncclsystemerror"}),
        (r"a(?:bc)?d", None),  # only short or optional text
        (r"(?:foo)+bar", {"foo"}),  # at least one foo; "bar" is no longer
        (r"x(?=yz)y", {"xy"}),  # zero-width parts keep the text either side adjacent
    ],
)
def test_needs_of_a_pattern(pattern, needs):
    import re as _re

    got = dg._needs(dg._sre_parse.parse(pattern, _re.compile(pattern).flags))
    assert (set(got) if got is not None else None) == needs


def test_most_patterns_are_skipped_on_ordinary_lines():
    """A trial: 22.7 s for a 300k-line log, every pattern of every entry searched on every line."""
    matcher = dg._Matcher(KB)
    n = len(matcher.pats)
    assert n > 80
    for text in ["2024-05-10 INFO hstu.train step 12 loss 0.4 throughput 5121 samples/s", "DEBUG GET /recommend 200 12ms"]:
        assert list(matcher._candidates(text)) == matcher.always  # searched with at most 2 of them
    assert len(list(matcher._candidates("Traceback: NPU out of memory"))) < 5
    assert ids(dg.diagnose_lines([("x", 1, "DEBUG ok")] * 1000 + [("x", 2, "error code 507015")], KB)) == ["npu-aicore-exception"]
