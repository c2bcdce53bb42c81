"""What ``slotfile verify`` prints: the listing (a terminal), one line per file (a pipe), the
quiet lines, the summary line, the JSON document and the JUnit XML."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.cli.common import out_console
from slotfile.cli.jsonout import ITEM_INDENT, Later, LazyList, encode
from slotfile.cli.listing import Row, pipe_line, pipe_text, print_rows, screen_width, summary
from slotfile.cli.terminal import count, escape_text, human_size, problem_line
from slotfile.diagnosis import CAUSE_SHORT, Cause
from slotfile.problems import Severity
from slotfile.verify.options import VerifyOptions, required_levels
from slotfile.verify.records import LEVELS, SCHEMA, FileReport, SkipKind, Status, Verdict

if TYPE_CHECKING:
    from rich.console import Console  # imported by out_console() when a listing is printed

STRUCTURE_ONLY = "(structure only; add --model to test-load)"


@dataclass(slots=True)
class Digest:
    """What the summary needs of one file's report, and its text as written (a JSON row, a
    pipe line, a quiet line or ""): made where the file was read, so that a streamed run keeps
    no report (slotfile.verify.engine.Verifier.stream)."""

    verdict: Verdict
    cause: Cause | None
    unmet: bool
    unchecked: bool
    error: str | None
    text: str


def digest(r: FileReport, mode: str, base: Path | None) -> Digest:
    """``r`` summed up, with its text for ``mode``: "json", "pipe" or "quiet"."""
    if mode == "json":
        d = r.to_dict()  # the facts below as it has them (each a walk over the levels)
        unmet, unchecked = bool(d["unmet_requirements"]), bool(d["unchecked"])
        text = encode(d, ITEM_INDENT)  # a plain str: pickled back cheaply
        return Digest(d["verdict"], d["cause"], unmet, unchecked and not unmet, d["error"], text)
    if mode == "pipe":
        text = pipe_text(*_pipe_parts(r, base))
    else:
        text = _quiet_line(r) or ""
    return Digest(r.verdict, r.cause, bool(r.unmet), bool(r.unchecked and not r.unmet), r.error, text)


@dataclass
class Counts:
    """The files of a run by verdict, their causes (in the order first met), and those with a
    required level unmet or a part not checkable here: what the summary line, the JSON summary
    and the exit code are made of."""

    files: int = 0
    verdicts: dict[Verdict, int] = field(default_factory=lambda: dict.fromkeys(Verdict, 0))
    causes: dict[str, int] = field(default_factory=dict)
    unmet: int = 0
    unchecked: int = 0

    def add(self, d: Digest | FileReport) -> None:
        self.files += 1
        self.verdicts[d.verdict] += 1
        if d.cause is not None:
            c = CAUSE_SHORT.get(d.cause, str(d.cause))
            self.causes[c] = self.causes.get(c, 0) + 1
        self.unmet += bool(d.unmet)
        self.unchecked += bool(d.unchecked if isinstance(d, Digest) else d.unchecked and not d.unmet)

    @classmethod
    def of(cls, reports: Iterable[FileReport]) -> Counts:
        c = cls()
        for r in reports:
            c.add(r)
        return c


def document(
    reports: list[FileReport] | LazyList,
    errors: list[str],
    opts: VerifyOptions,
    loaders: list[dict[str, Any]],
    elapsed: float | Callable[[], float],
    rc: int | Callable[[], int],
    tally: dict[str, int] | Callable[[], dict[str, int]] | None = None,
    busy: list[str] | None = None,
    counts: Counts | None = None,
) -> dict[str, Any]:
    """The ``slotfile.verify/1`` document.  Streamed (``reports`` a :class:`LazyList` of rows
    encoded as they were read, ``counts`` filled as they are written): what follows the rows
    is made when it is written (``elapsed``, ``rc``, ``tally`` callables)."""
    c = counts if counts is not None else Counts.of(reports)
    files = reports if isinstance(reports, LazyList) else LazyList(lambda: (r.to_dict() for r in reports))

    def summary() -> dict[str, Any]:
        seconds = elapsed() if callable(elapsed) else elapsed
        out: dict[Any, Any] = {"files": c.files, **c.verdicts}
        return {**out, "unmet_requirements": c.unmet, "seconds": round(seconds, 3)}

    def tallied() -> dict[str, int]:
        if callable(tally):
            return tally()
        if tally is not None:
            return tally
        v = c.verdicts
        return {"handled": v[Verdict.PASS] + v[Verdict.FAIL], "skipped": 0, "failed": v[Verdict.ERROR] + len(errors)}

    later = isinstance(reports, LazyList)
    return {
        "schema": SCHEMA,
        "loader": loaders[0] if loaders else None,
        "loaders": loaders,
        "model": opts.model,
        "draft_model": opts.draft_model,
        "deep": opts.deep,
        "tolerances": _tolerances(),
        "files": files,  # made as written
        "errors": errors,
        "require": list(required_levels(opts.require)),
        "summary": Later(summary) if later else summary(),
        "tally": Later(tallied) if later else tallied(),
        "still_being_written": busy if busy is not None else [],  # filled as a walk goes
        "exit_code": Later(rc) if callable(rc) else rc,
    }


_VERDICT_STYLE = {Verdict.PASS: "bold green", Verdict.FAIL: "bold red", Verdict.ERROR: "bold magenta"}
_STATUS_MARK = {Status.PASS: "ok", Status.FAIL: "FAIL", Status.SKIPPED: "-"}


def _tolerances() -> dict[str, Any]:
    """The deep judge's tolerances (slotfile.verify.judge), imported when the document is written:
    after a directory run's workers were forked, never in them."""
    from slotfile.verify.judge import DEEP_JUDGMENT

    return DEEP_JUDGMENT


def _warnings(r: FileReport) -> list[str]:
    return [problem_line(name, p) for name in LEVELS for p in r.levels[name].problems if p.severity == Severity.WARNING]


def _verdict_word(r: FileReport) -> str:
    """pass | pass, N warnings | damaged | wrong model | not a slot file | unsupported | unreadable."""
    if r.error:
        return "unreadable"
    cause = r.cause
    if cause is not None:
        return CAUSE_SHORT.get(cause, "fail")
    if r.unmet:
        return "not checked"
    n = len(_warnings(r))
    return f"pass, {n} warning{'s' if n > 1 else ''}" if n else "pass"


def _levels(r: FileReport) -> str:
    if r.error:
        return "-"
    return " ".join(f"{name[0].upper()}:{_STATUS_MARK[r.levels[name].status]}" for name in LEVELS)


def display_name(path: str, base: Path | None) -> str:
    """The path relative to the one directory argument (what a person pointed at), else as given."""
    if base is not None:
        try:
            return str(Path(path).relative_to(base))
        except ValueError:
            pass
    return path


def _details(r: FileReport) -> list[tuple[str, str]]:
    """(style, text) lines under a file's row: its first error (or warning), the levels that
    could not be checked here, and the next step (style "command": a command line, never
    wrapped).  A file that is not a slot file says what to pass in its problem already."""
    lines: list[tuple[str, str]] = []
    if r.first_problem and not r.error and not (r.unmet and r.cause is None):
        lines.append(("red", r.first_problem))
    elif not r.error and not r.unmet and _warnings(r):
        lines.append(("yellow", f"warning: {_warnings(r)[0]}"))
    lines += _not_checked_here(r)
    for m in r.unmet:
        why = _short_reason(r, m["level"]) if r.levels[m["level"]].status == Status.SKIPPED else m["reason"]
        lines.append(("red", f"required {m['level']} not checked here: {why}"))
        hint = m["hint"]
        lines.append(("cyan", f"to check {m['level']}: " + (f"pass {hint}" if hint.startswith("--") else hint)))
    step = r.next_step
    if step is not None and r.cause != Cause.NOT_SLOT_FILE:
        lines.append(("cyan", f"next step: {step.text}" + (":" if step.command else "")))
        if step.command:
            lines.append(("command", step.command))
    return lines


def _not_checked_here(r: FileReport) -> list[tuple[str, str]]:
    """The levels that could not be checked here (and were not required: those say so as
    failures), in two lines at most at 80 columns: why, and what to pass.  The full reason
    (the loader, the llama.cpp line that writes the version) is in the JSON's ``unchecked``."""
    unmet = {u["level"] for u in r.unmet}
    names = [n for n, lv in r.levels.items() if lv.skip_kind == SkipKind.CANNOT_CHECK and n not in unmet]
    if "load" in unmet and names == ["deep"] and _short_reason(r, "deep") == _ANOTHER:
        return []  # said with the load level
    if "load" in names:  # another state or session version; deep is skipped with it
        from slotfile.verify.engine import unmet_requirements

        hint = next(m["hint"] for m in unmet_requirements(r, ("load",)) if m["level"] == "load")
        return [("yellow", f"not checked here: {', '.join(names)}: {_ANOTHER}; pass {hint}")]
    lines = [("yellow", f"not checked here: {n}: {r.levels[n].reason}") for n in names]
    return lines if "deep" in unmet else lines + _unchecked_parts(r.levels["deep"].unchecked_parts)


def _unchecked_parts(parts: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A level's parts that could not be checked, one line per reason: how many blobs, the
    first one's section, why, and what to pass when an option would make them checkable."""
    by_reason: dict[str, list[dict[str, Any]]] = {}
    for u in parts:
        by_reason.setdefault(u["reason"], []).append(u)
    lines = []
    for reason, us in by_reason.items():
        what = us[0]["section"] if len(us) == 1 else f"{count(len(us), 'blob')} ({us[0]['section']}, ...)"
        hint = us[0]["hint"]
        to_pass = f"; pass {hint}" if hint.startswith("--") else ""
        lines.append(("yellow", f"not checked here: deep: {what}: {reason}{to_pass}"))
    return lines


_ANOTHER = "needs another llama.cpp"


def _short_reason(r: FileReport, level: str) -> str:
    """Why a level was skipped, short: a load (and the deep check after it) that the loader
    here cannot run is said as "needs another llama.cpp"; the full reason is in the JSON."""
    load = r.levels["load"]
    if level in ("load", "deep") and load.skip_kind == SkipKind.CANNOT_CHECK:
        return _ANOTHER
    return r.levels[level].reason or "skipped"


def render(
    reports: list[FileReport],
    loaders: list[dict[str, Any]],
    elapsed: float,
    structure_only: bool = False,
    quiet: bool = False,
    base: Path | None = None,
    console: Console | None = None,
    tally: str | None = None,
) -> None:
    """The text report on stdout (``console``: the invocation's, by default a fresh one)."""
    out = console if console is not None else out_console()
    width = None if quiet else screen_width(out)
    if quiet:  # the failing files, one line each, then the summary (unreadable ones are on stderr already)
        for r in reports:
            line = _quiet_line(r)
            if line is not None:
                out.print(line, soft_wrap=True)
    elif width is not None:
        _listing(out, reports, base, width)
    else:  # a pipe or a file: one line per file, nothing wrapped
        for r in reports:
            _pipe_line(r, base)
    line = summary_line(Counts.of(reports), loaders, elapsed, structure_only)
    summary(out, line + (f"; {tally}" if tally else ""), width)


def _quiet_line(r: FileReport) -> str | None:
    """A failing file's line under --quiet (escaped); None for any other file."""
    return escape_text(f"{r.path}: {r.verdict}: {r.first_problem}") if r.verdict == Verdict.FAIL else None


def summary_line(c: Counts, loaders: list[dict[str, Any]], elapsed: float, structure_only: bool) -> str:
    v = c.verdicts
    line = f"{count(c.files, 'file')}: {v[Verdict.PASS]} pass, {v[Verdict.FAIL]} fail"
    if c.causes:
        line += " (" + ", ".join(f"{n} {cause}" for cause, n in c.causes.items()) + ")"
    if v[Verdict.ERROR]:
        line += f", {v[Verdict.ERROR]} unreadable"
    if c.unmet:
        line += f", {c.unmet} with a required level not checked (--require)"
    if c.unchecked:
        line += f", {c.unchecked} not fully checkable here"
    if structure_only:
        line += f" {STRUCTURE_ONLY}"
    line += f" in {elapsed:.1f} s"
    for i, ld in enumerate(loaders):
        n_files = count(int(ld.get("files") or 0), "file")
        line += "; loader" if i == 0 else f"; for {n_files} the library of the llama-server on PATH:"
        line += (
            f" llama-cpp-python {ld.get('llama_cpp_python')} with {ld.get('library')} "
            f"(state version {ld.get('state_seq_version')}, session version {ld.get('session_version')})"
        )
    return line


def _listing(out: Console, reports: list[FileReport], base: Path | None, width: int) -> None:
    """One row per file (verdict, levels, size, tokens, then the path), and under a row that
    has something to say its first problem and next step (:func:`listing.print_rows`)."""
    rows = [
        Row(
            (
                _verdict_word(r),
                _levels(r),
                human_size(r.size) if r.size is not None else "-",
                str(r.n_tokens) if r.n_tokens is not None else "-",
                display_name(r.path, base),
            ),
            _VERDICT_STYLE[r.verdict] if r.verdict != Verdict.PASS or not _warnings(r) else "bold yellow",
            tuple(_details(r)),
        )
        for r in reports
    ]
    print_rows(out, ("verdict", "levels", "size", "tokens", "file"), rows, width, right=("size", "tokens"))


def _pipe_line(r: FileReport, base: Path | None) -> None:
    """``PATH: VERDICT [levels] first problem; next step: ...`` on one line (grep, awk)."""
    pipe_line(*_pipe_parts(r, base))


def _pipe_parts(r: FileReport, base: Path | None) -> tuple[str, str]:
    details = "; ".join(text for _, text in _details(r)).replace(":; ", ": ")
    return display_name(r.path, base), f"{_verdict_word(r)} [{_levels(r)}]" + (f" {details}" if details else "")


def _x(s: Any) -> str:
    """Text safe for XML 1.0 (control characters escaped)."""
    return escape_text(str(s))


def write_junit(path: Path, reports: list[FileReport], errors: list[str], opts: VerifyOptions, elapsed: float) -> None:
    """JUnit XML: one testcase per file (and one per missing path)."""
    import xml.etree.ElementTree as ET  # only for --junit

    failures = sum(1 for r in reports if r.verdict == Verdict.FAIL)
    errs = sum(1 for r in reports if r.verdict == Verdict.ERROR) + len(errors)
    total = len(reports) + len(errors)
    root = ET.Element(
        "testsuites",
        name="slotfile verify",
        tests=str(total),
        failures=str(failures),
        errors=str(errs),
        time=f"{elapsed:.3f}",
    )
    suite = ET.SubElement(
        root,
        "testsuite",
        name="slotfile.verify",
        tests=str(total),
        failures=str(failures),
        errors=str(errs),
        skipped="0",
        time=f"{elapsed:.3f}",
        timestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S"),
        hostname=_x(platform.node()),
    )
    props = ET.SubElement(suite, "properties")
    for k, v in (("model", opts.model), ("draft_model", opts.draft_model), ("deep", opts.deep)):
        ET.SubElement(props, "property", name=k, value=_x(v if v is not None else ""))
    for r in reports:
        _junit_case(ET, suite, r)
    for e in errors:
        tc = ET.SubElement(suite, "testcase", classname="slotfile.verify", name=_x(e.split(":")[0]), time="0")
        ET.SubElement(tc, "error", message=_x(e), type="missing").text = _x(e)
    ET.indent(root)
    data = ET.tostring(root, encoding="unicode", xml_declaration=False)
    path.write_text('<?xml version="1.0" encoding="UTF-8"?>\n' + data + "\n", encoding="utf-8")


def _junit_case(ET: Any, suite: Any, r: FileReport) -> None:
    """One file's testcase: every level's status and problems, the cause and the next step."""
    tc = ET.SubElement(suite, "testcase", classname="slotfile.verify", name=_x(r.path), time=f"{r.seconds:.3f}")
    lines = []
    for name in LEVELS:
        lv = r.levels[name]
        lines.append(f"{name}: {lv.status}" + (f" ({lv.reason})" if lv.reason else ""))
        for m in (m for m in r.unmet if m["level"] == name):
            lines.append(f"  required (--require) but not checked; to check it: {m['hint']}")
        for p in lv.problems:
            off = f" at offset {p.offset}" if p.offset is not None else ""
            lines.append(f"  {p.severity}: {p.section}{off}: {p.message}")
    step = r.next_step
    if r.cause is not None:
        lines.append(f"cause: {r.cause}")
    if step is not None:
        lines.append(f"next step: {step.text}" + (f": {step.command}" if step.command else ""))
    body = "\n".join(_x(ln) for ln in lines)
    if r.verdict == Verdict.ERROR:
        el = ET.SubElement(tc, "error", message=_x(r.error), type="unreadable")
        el.text = _x(r.error)
    elif r.verdict == Verdict.FAIL:
        lvl = next((n for n in LEVELS if r.levels[n].status == Status.FAIL), "require")
        el = ET.SubElement(tc, "failure", message=_x(r.first_problem), type=lvl)
        el.text = body
    ET.SubElement(tc, "system-out").text = body
