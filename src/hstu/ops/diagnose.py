"""``hstu diagnose PATH...``: match Ascend plog/slog, Python tracebacks and dmesg text against the shipped knowledge
base (``knowledge_base.yaml``) and report likely causes, in order, with the command that verifies each and the fix,
plus the evidence lines (file:line).

Ranking: findings are ordered by where their first evidence appears (inputs in the order given, lines in file order),
because the first error in a log is usually the cause and later ones its consequences; generic code-family matches
(``fallback``) come after specific entries. Lines that look like errors but match nothing are listed as unknown,
grouped by their text with numbers masked; CANN error codes among them are decoded (module, user vs internal range),
never guessed at. A pattern is searched only on lines holding a string all its matches contain (:class:`_Matcher`).

Inputs: files (``.gz`` read transparently), directories (walked recursively; text files whose names look like logs),
or ``-`` for stdin. Input is untrusted text: undecodable bytes are replaced.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hstu.ops._common import ascend_release, ascend_version_key, load_document

try:  # the regex parser, to find the strings a pattern's matches contain (_needs)
    from re import _parser as _sre_parse  # Python >= 3.11
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

log = logging.getLogger(__name__)

SEVERITIES = ("fatal", "error", "warning")
BACKENDS = ("npu", "cuda", "any", "host")
MAX_EVIDENCE = 5
LOG_NAME_RE = re.compile(r"(?i)(\.(log|txt|out|err|gz)$|plog|slog|dmesg|syslog|messages|kern|device-\d|trace)")

_ENTRY_KEYS = {"id", "title", "backend", "severity", "patterns", "codes", "causes", "source", "fallback"}
_CAUSE_KEYS = {"why", "verify", "fix", "cann", "code"}


@dataclass(frozen=True)
class Cause:
    why: str
    verify: str
    fix: str
    cann: str | None = None  # e.g. ">=8.5.0" or ">=8.0.RC1,<8.5.0"; None: every release
    code: re.Pattern | None = None  # the matched {code} this cause fits (fullmatch), e.g. EZ9xxx; None: any


@dataclass(frozen=True)
class Entry:
    id: str
    title: str
    backend: str
    severity: str
    patterns: tuple[re.Pattern, ...]
    causes: tuple[Cause, ...]
    source: str
    fallback: bool = False

    def search(self, line: str) -> re.Match | None:
        return next((m for pat in self.patterns if (m := pat.search(line))), None)


@dataclass(frozen=True)
class KnowledgeBase:
    entries: tuple[Entry, ...]
    families: dict[str, dict[str, str]]
    unknown_markers: tuple[re.Pattern, ...]
    reset_markers: tuple[re.Pattern, ...]
    path: str


# A return code (`codes`, `reset_codes`; the rule is told in knowledge_base.yaml's header): after a word naming one, or a
# plainer word on a line about the Ascend runtime, driver or HCCL; not before a noun ("507046 users") nor in a timestamp.
_CODE_WORD = r"(?:(?<![A-Za-z])|(?<=[a-z])(?=[A-Z]))(?i:err(?:or)?[ _]?(?:code|no|num)|errno|(?:ret|return|status)[ _]?code)"
_DEVICE_LINE = (
    r"^(?=.*(?:\bacl[a-z]*[A-Z]|\b(?:rt|hal|drv)[A-Z]|\b(?:RUNTIME|ASCENDCL|DRV|HCCL|GE|TSCH|PTA|AICPU)\("
    r"|(?i:\b(?:runtime|driver|device|npu|hccl|aicore|ascend)\b)))"
)
_PLAIN_WORD = r"\b(?i:ret|result|return(?:ed)?|status|code|error)"
_NOT_A_NOUN = r"(?!\s+(?!(?:in|at|on|of|from|for|to|when|while|during|after|by|with|and|or|but)\b)[a-z])"


def _code_pattern(codes: list[int]) -> str:
    alt = "|".join(str(int(c)) for c in codes)
    return rf"(?:{_CODE_WORD}|{_DEVICE_LINE}.*?{_PLAIN_WORD})\b\s*(?:[=:]\s*|is\s+)?(?<![\d.])(?:{alt})(?!\d|\.\d){_NOT_A_NOUN}"


def _code_list(codes: Any, where: str) -> list[re.Pattern]:
    """The pattern of a ``codes`` list (none for an empty one); ValueError naming ``where`` unless integers."""
    if not isinstance(codes, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in codes):
        raise ValueError(f"{where} must be a list of integers")
    return [_compile(_code_pattern(codes), where)] if codes else []


def _compile(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{where}: invalid regex {pattern!r}: {exc}") from exc


def cann_spec_matches(spec: str, version: str) -> bool:
    """Whether CANN ``version`` satisfies ``spec`` (comma-separated ``>=``, ``>``, ``<=``, ``<``, ``==``); ValueError
    on a malformed spec or version."""
    v = ascend_version_key(ascend_release(version))
    for part in spec.split(","):
        part = part.strip()
        m = re.match(r"^(>=|<=|==|>|<)\s*(\S+)$", part)
        if not m:
            raise ValueError(f"bad CANN spec {spec!r}: expected e.g. '>=8.5.0' or '>=8.0.RC1,<8.5.0'")
        op, ref = m.group(1), ascend_version_key(m.group(2))
        ok = {">=": v >= ref, "<=": v <= ref, "==": v == ref, ">": v > ref, "<": v < ref}[op]
        if not ok:
            return False
    return True


def validate_knowledge_base(data: Any, where: str) -> KnowledgeBase:
    """Check the parsed YAML and compile it; raise ValueError naming the entry and field."""
    if not isinstance(data, dict) or data.get("schema_version") != 1:
        raise ValueError(f"{where}: expected a mapping with schema_version: 1")
    families = data.get("families") or {}
    if not isinstance(families, dict):
        raise ValueError(f"{where}: families must be a mapping of module letter -> {{module: ...}}")
    for letter, fam in families.items():
        if not isinstance(fam, dict) or not isinstance(fam.get("module"), str):
            raise ValueError(f"{where}: families.{letter}: needs a 'module' string")
        if "since" in fam:
            ascend_version_key(str(fam["since"]))
    entries: list[Entry] = []
    seen: set[str] = set()
    for i, raw in enumerate(data.get("entries") or []):
        ref = f"{where}: entries[{i}]" + (f" ({raw.get('id')})" if isinstance(raw, dict) and raw.get("id") else "")
        if not isinstance(raw, dict):
            raise ValueError(f"{ref}: must be a mapping")
        if unknown := set(raw) - _ENTRY_KEYS:
            raise ValueError(f"{ref}: unknown key(s) {sorted(unknown)}; valid: {sorted(_ENTRY_KEYS)}")
        for key in ("id", "title", "backend", "severity", "source"):
            if not isinstance(raw.get(key), str) or not raw[key].strip():
                raise ValueError(f"{ref}: field {key!r} must be a non-empty string")
        if raw["id"] in seen:
            raise ValueError(f"{ref}: duplicate id {raw['id']!r}")
        seen.add(raw["id"])
        for key, valid in (("backend", BACKENDS), ("severity", SEVERITIES)):
            if raw[key] not in valid:
                raise ValueError(f"{ref}: {key} must be one of {valid}, got {raw[key]!r}")
        pats = [_compile(p, f"{ref}.patterns") for p in raw.get("patterns") or []] + _code_list(raw.get("codes") or [], f"{ref}: codes")
        if not pats:
            raise ValueError(f"{ref}: needs at least one pattern or code")
        causes = []
        for j, c in enumerate(raw.get("causes") or []):
            cref = f"{ref}.causes[{j}]"
            if not isinstance(c, dict):
                raise ValueError(f"{cref}: must be a mapping")
            if bad := set(c) - _CAUSE_KEYS:
                raise ValueError(f"{cref}: unknown key(s) {sorted(bad)}; valid: {sorted(_CAUSE_KEYS)}")
            for key in ("why", "verify", "fix"):
                if not isinstance(c.get(key), str) or not c[key].strip():
                    raise ValueError(f"{cref}: field {key!r} must be a non-empty string")
            if c.get("cann") is not None:
                cann_spec_matches(str(c["cann"]), "8.0.0")  # raises on a malformed spec
            code = _compile(str(c["code"]), f"{cref}.code") if c.get("code") is not None else None
            causes.append(Cause(c["why"], c["verify"], c["fix"], str(c["cann"]) if c.get("cann") else None, code))
        if not causes:
            raise ValueError(f"{ref}: needs at least one cause")
        fallback = bool(raw.get("fallback", False))
        entries.append(Entry(raw["id"], raw["title"], raw["backend"], raw["severity"], tuple(pats), tuple(causes), raw["source"], fallback))
    if not entries:
        raise ValueError(f"{where}: no entries")
    markers = tuple(_compile(p, f"{where}: unknown_markers") for p in data.get("unknown_markers") or [])
    resets = [_compile(p, f"{where}: reset_markers") for p in data.get("reset_markers") or []]
    resets += _code_list(data.get("reset_codes") or [], f"{where}: reset_codes")
    return KnowledgeBase(tuple(entries), {str(k): v for k, v in families.items()}, markers, tuple(resets), where)


def load_knowledge_base(path: str | Path | None = None) -> KnowledgeBase:
    """Load and validate the knowledge base (the packaged one when ``path`` is None)."""
    data, where = load_document(path, "knowledge_base.yaml", yaml.safe_load, "YAML", yaml.YAMLError)
    return validate_knowledge_base(data, where)


# ------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Evidence:
    path: str
    line: int  # 1-based
    text: str
    context: str | None = None  # innermost traceback frame, when the line ends a Python traceback

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _is_text(path: Path) -> bool:
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as fh:
            return b"\0" not in fh.read(8192)
    except OSError:
        return False


def expand_paths(paths: Iterable[str]) -> list[str]:
    """Files to read for ``paths``: files as given, directories walked (sorted) for log-like text files;
    FileNotFoundError naming a path that does not exist."""
    out: list[str] = []
    for p in paths:
        path = Path(p).expanduser()
        if p == "-" or path.is_file():
            out.append(p if p == "-" else str(path))
        elif path.is_dir():
            for root, dirs, files in os.walk(path):
                dirs.sort()
                for name in sorted(files):
                    f = Path(root) / name
                    if LOG_NAME_RE.search(name) and _is_text(f):
                        out.append(str(f))
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return out


def iter_lines(files: Iterable[str]) -> Iterator[tuple[str, int, str]]:
    """Yield (path, 1-based line number, text without newline) for each file ("-" = stdin)."""
    for f in files:
        if f == "-":
            for i, line in enumerate(sys.stdin, 1):
                yield "<stdin>", i, line.rstrip("\r\n")
            continue
        opener = gzip.open if f.endswith(".gz") else open
        try:
            with opener(f, "rt", encoding="utf-8", errors="replace") as fh:  # type: ignore[operator]
                for i, line in enumerate(fh, 1):
                    yield f, i, line.rstrip("\r\n")
        except OSError as exc:
            log.warning("cannot read %s: %s", f, exc)


# ------------------------------------------------------------------------------------------ matching


@dataclass
class Finding:
    entry: Entry
    causes: list[Cause]
    evidence: list[Evidence] = field(default_factory=list)
    count: int = 0
    first_seen: int = 0
    groups: dict[str, str] = field(default_factory=dict)
    codes: set[str] = field(default_factory=set)  # every {code} matched

    def filled(self, text: str) -> str:
        """Fill {name} from the first match's named groups and <log> with the first evidence file."""
        text = re.sub(r"\{(\w+)\}", lambda m: self.groups.get(m.group(1)) or m.group(0), text)
        if self.evidence:
            text = text.replace("<log>", self.evidence[0].path)
        return text


@dataclass
class Unknown:
    key: str
    evidence: list[Evidence] = field(default_factory=list)
    count: int = 0
    first_seen: int = 0
    note: str | None = None


@dataclass
class Report:
    findings: list[Finding]
    unknown: list[Unknown]
    files: list[str]
    lines: int
    cann_version: str | None


_PLOG_HEAD = re.compile(r"^\[(?:ERROR|WARNING|INFO|DEBUG|EVENT)\]\s+(\w+)\(\d+,[^)]*\):\S+\s+\[[^\]]*\]\d*\s*")
_DMESG_HEAD = re.compile(r"^\[\s*\d+\.\d+\]\s*")
_NUM = re.compile(r"0x[0-9a-fA-F]+|\d+")
_CANN_CODE = re.compile(r"\bE([0-9A-Z])([0-9]{4})\b")
_TB_START = re.compile(r"^\s*Traceback \(most recent call last\):")
_TB_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def _unknown_key(text: str) -> str:
    t = _PLOG_HEAD.sub(lambda m: m.group(1) + ": ", text)
    t = _DMESG_HEAD.sub("", t)
    return _NUM.sub("#", t.strip())[:200]


def decode_cann_code(code: str, kb: KnowledgeBase, cann_version: str | None = None) -> str | None:
    """Describe a CANN error code from its format alone: module and user/internal range."""
    if not (m := _CANN_CODE.fullmatch(code)):
        return None
    letter, num = m.group(1), int(m.group(2))
    fam = kb.families.get(letter)
    kind = "internal error (9000-9999)" if num >= 9000 else "user error (0000-8999)"
    if fam is None:
        return f"CANN code {code}: module letter {letter!r} is not in the error-code reference; {kind}"
    since = fam.get("since")
    if since and cann_version:
        try:
            if ascend_version_key(ascend_release(cann_version)) < ascend_version_key(str(since)):
                return f"CANN code {code}: letter {letter!r} ({fam['module']}) is only defined from CANN {since}; you run {cann_version}"
        except ValueError:
            pass
    return f"CANN code {code}: module {fam['module']}, {kind}"


def _needs(items: Any) -> frozenset[str] | None:
    """Lowercase strings one of which is in every text the parsed regex ``items`` matches; None: none known."""
    cands, run = [], ""
    for op, av in items:
        name = str(op)
        if name == "LITERAL" and av < 128:
            run += chr(av).lower()
            continue
        if name in ("AT", "ASSERT", "ASSERT_NOT"):  # zero-width: the text either side of it is adjacent
            continue
        cands.append(frozenset([run]) if run else None)
        run = ""
        if name == "SUBPATTERN":
            cands.append(_needs(av[-1]))
        elif name == "BRANCH":
            alts = [_needs(a) for a in av[1]]
            cands.append(None if None in alts else frozenset().union(*alts))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and av[0] >= 1:
            cands.append(_needs(av[2]))
    cands.append(frozenset([run]) if run else None)
    best = max((c for c in cands if c), key=lambda c: (min(map(len, c)), -len(c)), default=None)
    return best if best and min(map(len, best)) >= 2 else None


class _Matcher:
    """The knowledge base's patterns (entries', then unknown markers), each run on a line only if the line holds one of
    the strings every match of it contains (:func:`_needs`); most log lines hold none, so most patterns are skipped."""

    def __init__(self, kb: KnowledgeBase) -> None:
        self.pats = [(e, p, int(e.fallback)) for e in kb.entries for p in e.patterns] + [(None, p, 2) for p in kb.unknown_markers]
        self.always, self.by_need = [], {}  # pattern numbers: searched on every line; by a string they need
        for i, (_, p, _) in enumerate(self.pats):
            try:
                need = _needs(_sre_parse.parse(p.pattern, p.flags))
            except Exception:  # noqa: BLE001 - a parser change only costs speed: search with it on every line
                need = None
            for s in need or ():
                self.by_need.setdefault(s, []).append(i)
            if need is None:
                self.always.append(i)

    def _candidates(self, text: str) -> Iterable[int]:
        if not text.isascii():  # str.lower() and regex case folding differ outside ASCII
            return range(len(self.pats))
        low = text.lower()
        found = [i for s, ii in self.by_need.items() if s in low for i in ii]
        return sorted({*self.always, *found}) if found else self.always

    def match(self, text: str) -> tuple[list[tuple[Entry, re.Match]], bool]:
        """(specific entries matching ``text``, else fallback ones, with their first match; whether a marker matches)."""
        cands = self._candidates(text)
        for kind in (0, 1):
            hits: list[tuple[Entry, re.Match]] = []
            for i in cands:
                e, p, k = self.pats[i]
                if k == kind and (not hits or hits[-1][0] is not e) and (m := p.search(text)):
                    hits.append((e, m))  # type: ignore[arg-type]
            if hits:
                return hits, False
        return [], any(self.pats[i][2] == 2 and self.pats[i][1].search(text) for i in cands)


def diagnose_lines(lines: Iterable[tuple[str, int, str]], kb: KnowledgeBase | None = None, cann_version: str | None = None) -> Report:
    """Match ``(path, line_no, text)`` triples against the knowledge base; see the module docstring. ValueError for a
    ``cann_version`` that is not an Ascend version (said before any log is read, not only when a cause depends on it)."""
    if cann_version is not None:
        try:
            ascend_version_key(ascend_release(cann_version))
        except ValueError as exc:
            raise ValueError(f"--cann-version: {exc}") from None
    kb = kb or load_knowledge_base()
    findings: dict[str, Finding] = {}
    unknown: dict[str, Unknown] = {}
    files: dict[str, None] = {}
    matcher = _Matcher(kb)
    tb_frame: dict[str, str | None] = {}  # path -> innermost frame of an open traceback
    n = 0
    for n, (path, lineno, text) in enumerate(lines, 1):
        files.setdefault(path)
        if _TB_START.match(text):
            tb_frame[path] = ""
            continue
        fm = _TB_FRAME.match(text)
        if fm and path in tb_frame:
            tb_frame[path] = f'File "{fm.group(1)}", line {fm.group(2)}, in {fm.group(3)}'
            continue
        if len(text) < 6:
            continue
        context = None
        if tb_frame.get(path) is not None and text and not text[0].isspace():
            context = tb_frame.pop(path) or None  # the exception line closes the traceback
        hits, marked = matcher.match(text)
        for e, m in hits:
            f = findings.get(e.id)
            if f is None:
                causes = [c for c in e.causes if c.cann is None or cann_version is None or cann_spec_matches(c.cann, cann_version)]
                f = findings[e.id] = Finding(e, causes, first_seen=n)
            if not f.groups:
                f.groups = {k: v for k, v in m.groupdict().items() if v}
            if code := m.groupdict().get("code"):
                f.codes.add(code)
            f.count += 1
            if len(f.evidence) < MAX_EVIDENCE:
                f.evidence.append(Evidence(path, lineno, text[:400], context))
        if marked:
            key = _unknown_key(text)
            u = unknown.get(key)
            if u is None:
                code = _CANN_CODE.search(text)
                u = unknown[key] = Unknown(key, first_seen=n, note=decode_cann_code(code.group(0), kb, cann_version) if code else None)
            u.count += 1
            if len(u.evidence) < 2:
                u.evidence.append(Evidence(path, lineno, text[:400], context))
    for f in findings.values():  # the causes that fit a matched {code} (a cause's `code`), all if none does
        f.causes = [c for c in f.causes if c.code is None or not f.codes or any(map(c.code.fullmatch, f.codes))] or f.causes
    ranked = sorted(findings.values(), key=lambda f: (f.entry.fallback, f.first_seen))
    return Report(ranked, sorted(unknown.values(), key=lambda u: u.first_seen), list(files), n, cann_version)


def diagnose(paths: Iterable[str], kb: KnowledgeBase | None = None, cann_version: str | None = None) -> Report:
    """Diagnose files/directories (see :func:`expand_paths`). Raises FileNotFoundError for a bad path."""
    files = expand_paths(paths)
    report = diagnose_lines(iter_lines(files), kb, cann_version)
    report.files = list(dict.fromkeys(report.files + [f for f in files if f != "-"]))  # files read but empty too
    return report


# ------------------------------------------------------------------------------------------ output

MAX_UNKNOWN_TEXT = 20


def render_text(report: Report) -> str:
    cann = f"CANN {report.cann_version}" if report.cann_version else "CANN version unknown (all causes shown)"
    out = [f"read {report.lines} lines from {len(report.files)} file(s); {cann}"]
    if not report.findings and not report.unknown:
        out.append("no known errors and nothing that looks like an error")
    for rank, f in enumerate(report.findings, 1):
        e = f.entry
        tag = " (code family)" if e.fallback else ""
        out += ["", f"{rank}. [{e.severity}] {e.title}{tag}  ({e.id}, {e.backend}; {f.count} line(s))"]
        for ev in f.evidence:
            out += [f"   {ev.where()}: {ev.text.strip()}"] + ([f"      at {ev.context}"] if ev.context else [])
        if f.count > len(f.evidence):
            out.append(f"   ... {f.count - len(f.evidence)} more line(s)")
        out.append("   likely causes, most likely first:")
        for i, c in enumerate(f.causes, 1):
            cond = f" [CANN {c.cann}]" if c.cann and report.cann_version is None else ""
            out += [f"   {i}) {f.filled(c.why)}{cond}", f"      verify: {f.filled(c.verify)}", f"      fix:    {f.filled(c.fix)}"]
        out.append(f"   source: {e.source}")
    if report.unknown:
        out += ["", f"unknown ({len(report.unknown)} distinct error line(s) the knowledge base does not cover; not guessed):"]
        for u in report.unknown[:MAX_UNKNOWN_TEXT]:
            ev = u.evidence[0]
            out.append(f"   {ev.where()}: {ev.text.strip()}" + (f"  (x{u.count})" if u.count > 1 else ""))
            if u.note:
                out.append(f"      {u.note}")
        if len(report.unknown) > MAX_UNKNOWN_TEXT:
            out.append(f"   ... {len(report.unknown) - MAX_UNKNOWN_TEXT} more (see --json)")
    return "\n".join(out)


def render_json(report: Report) -> str:
    def _ev(ev: Evidence) -> dict[str, Any]:
        return {"path": ev.path, "line": ev.line, "text": ev.text} | ({"context": ev.context} if ev.context else {})

    def finding(i: int, f: Finding) -> dict[str, Any]:
        e, fill = f.entry, f.filled
        causes = [{"why": fill(c.why), "verify": fill(c.verify), "fix": fill(c.fix), "cann": c.cann} for c in f.causes]
        about = {"rank": i, "id": e.id, "title": e.title, "severity": e.severity, "backend": e.backend, "fallback": e.fallback}
        return about | {"count": f.count, "evidence": [_ev(x) for x in f.evidence], "causes": causes, "source": e.source}

    unknown = [
        {"text": u.evidence[0].text, "count": u.count, "evidence": [_ev(x) for x in u.evidence], "note": u.note} for u in report.unknown
    ]
    findings = [finding(i, f) for i, f in enumerate(report.findings, 1)]
    doc = {"files": report.files, "lines": report.lines, "cann_version": report.cann_version, "findings": findings, "unknown": unknown}
    return json.dumps(doc, indent=2)
