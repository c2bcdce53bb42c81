"""What ``slotfile verify`` prints: the listing (a terminal), one line per file (a pipe), the
quiet lines, the summary line, the JSON document and the JUnit XML."""

from __future__ import annotations

import os
import platform
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from slotfile.cli.common import out_console
from slotfile.cli.terminal import escape_text, human_size, problem_line
from slotfile.diagnosis import CAUSE_SHORT, Cause
from slotfile.problems import Severity
from slotfile.verify import DEEP_JUDGMENT, LEVELS, SCHEMA, FileReport, VerifyOptions
from slotfile.verify.options import required_levels
from slotfile.verify.records import Status, Verdict

STRUCTURE_ONLY = "(structure only; add --model to test-load)"


def document(
    reports: list[FileReport],
    errors: list[str],
    opts: VerifyOptions,
    loaders: list[dict[str, Any]],
    elapsed: float,
    rc: int,
    tally: dict[str, int] | None = None,
    busy: list[str] | None = None,
) -> dict[str, Any]:
    counts = {v: sum(1 for r in reports if r.verdict == v) for v in Verdict}
    return {
        "schema": SCHEMA,
        "loader": loaders[0] if loaders else None,
        "loaders": loaders,
        "model": opts.model,
        "draft_model": opts.draft_model,
        "deep": opts.deep,
        "tolerances": DEEP_JUDGMENT,
        "files": [r.to_dict() for r in reports],
        "errors": errors,
        "require": list(required_levels(opts.require)),
        "summary": {
            "files": len(reports),
            **counts,
            "unmet_requirements": sum(1 for r in reports if r.unmet),
            "seconds": round(elapsed, 3),
        },
        "tally": tally
        if tally is not None
        else {
            "handled": counts[Verdict.PASS] + counts[Verdict.FAIL],
            "skipped": 0,
            "failed": counts[Verdict.ERROR] + len(errors),
        },
        "still_being_written": busy or [],
        "exit_code": rc,
    }


_VERDICT_STYLE = {Verdict.PASS: "bold green", Verdict.FAIL: "bold red", Verdict.ERROR: "bold magenta"}
_STATUS_MARK = {Status.PASS: "ok", Status.FAIL: "FAIL", Status.SKIPPED: "-"}
DETAIL_INDENT = "    "


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
    if r.first_problem and not r.error:
        lines.append(("red", r.first_problem))
    elif not r.error and _warnings(r):
        lines.append(("yellow", f"warning: {_warnings(r)[0]}"))
    unmet = {u["level"] for u in r.unmet}
    for u in r.unchecked:
        if u.split(":")[0] not in unmet:
            lines.append(("yellow", f"not checked here: {u}"))
    for m in r.unmet:  # the first one's reason is the first problem above
        if m is not r.unmet[0] or not (r.first_problem or "").startswith(f"{m['level']}: required"):
            lines.append(("red", f"required {m['level']} not checked: {m['reason']}"))
        lines.append(
            (
                "cyan",
                f"to check {m['level']}: pass {m['hint']}"
                if m["hint"].startswith("--")
                else f"to check {m['level']}: {m['hint']}",
            )
        )
    step = r.next_step
    if step is not None and r.cause != Cause.NOT_SLOT_FILE:
        lines.append(("cyan", f"next step: {step.text}" + (":" if step.command else "")))
        if step.command:
            lines.append(("command", step.command))
    return lines


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
    if quiet:  # the failing files, one line each, then the summary (unreadable ones are on stderr already)
        for r in reports:
            if r.verdict == Verdict.FAIL:
                out.print(escape_text(f"{r.path}: {r.verdict}: {r.first_problem}"), soft_wrap=True)
    elif out.is_terminal or os.environ.get("COLUMNS"):
        cols = os.environ.get("COLUMNS", "")
        _listing(out, reports, base, int(cols) if cols.isdigit() else out.width)
    else:  # a pipe or a file: one line per file, nothing wrapped
        for r in reports:
            _pipe_line(r, base)
    line = summary_line(reports, loaders, elapsed, structure_only)
    out.print(line + (f"; {tally}" if tally else ""), soft_wrap=True)


def summary_line(reports: list[FileReport], loaders: list[dict[str, Any]], elapsed: float, structure_only: bool) -> str:
    counts = {v: sum(1 for r in reports if r.verdict == v) for v in Verdict}
    line = f"{len(reports)} file(s): {counts[Verdict.PASS]} pass, {counts[Verdict.FAIL]} fail"
    causes = [CAUSE_SHORT.get(c, str(c)) for c in (r.cause for r in reports) if c is not None]
    if causes:
        line += " (" + ", ".join(f"{causes.count(c)} {c}" for c in dict.fromkeys(causes)) + ")"
    if counts[Verdict.ERROR]:
        line += f", {counts[Verdict.ERROR]} unreadable"
    unmet = sum(1 for r in reports if r.unmet)
    if unmet:
        line += f", {unmet} with a required level not checked (--require)"
    unchecked = sum(1 for r in reports if r.unchecked and not r.unmet)
    if unchecked:
        line += f", {unchecked} not fully checkable here"
    if structure_only:
        line += f" {STRUCTURE_ONLY}"
    line += f" in {elapsed:.1f} s"
    for i, ld in enumerate(loaders):
        line += "; loader" if i == 0 else f"; for {ld.get('files')} file(s) the library of the llama-server on PATH:"
        line += (
            f" llama-cpp-python {ld.get('llama_cpp_python')} with {ld.get('library')} "
            f"(state version {ld.get('state_seq_version')}, session version {ld.get('session_version')})"
        )
    return line


def _listing(out: Console, reports: list[FileReport], base: Path | None, width: int) -> None:
    """One row per file (verdict, levels, size, tokens, then the path, which is never folded),
    and under a row that has something to say its first problem and next step, wrapped to the
    terminal at word boundaries."""
    rows = [
        (
            _verdict_word(r),
            _levels(r),
            human_size(r.size) if r.size is not None else "-",
            str(r.n_tokens) if r.n_tokens is not None else "-",
            escape_text(display_name(r.path, base)),
        )
        for r in reports
    ]
    heads = ("verdict", "levels", "size", "tokens", "file")
    w = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads[:4])]
    fmt = f"{{:<{w[0]}}}  {{:<{w[1]}}}  {{:>{w[2]}}}  {{:>{w[3]}}}  {{}}"
    out.print(Text(fmt.format(*heads), style="bold"), soft_wrap=True)
    for r, row in zip(reports, rows, strict=True):
        line = Text(fmt.format(*row))
        line.stylize(
            _VERDICT_STYLE[r.verdict] if r.verdict != Verdict.PASS or not _warnings(r) else "bold yellow",
            0,
            len(row[0]),
        )
        if len(line) >= width:  # the path would wrap mid-word at the edge: it goes on its own line
            line = line[: len(line) - len(row[4])]
            line.rstrip()
            line.append("\n" + DETAIL_INDENT + row[4])
        out.print(line, soft_wrap=True)
        for style, text in _details(r):
            if style == "command":  # whole, to copy and paste
                out.print(Text(DETAIL_INDENT + "  " + escape_text(text), style="bold"), soft_wrap=True)
                continue
            wrapped = textwrap.wrap(
                escape_text(text),
                width=max(40, width - 1),
                initial_indent=DETAIL_INDENT,
                subsequent_indent=DETAIL_INDENT + "  ",
                break_long_words=False,
                break_on_hyphens=False,
            )
            for piece in wrapped:
                out.print(Text(piece, style=style), soft_wrap=True)


def _pipe_line(r: FileReport, base: Path | None) -> None:
    """``PATH: VERDICT [levels] first problem; next step: ...`` on one line (grep, awk)."""
    parts = [f"{display_name(r.path, base)}: {_verdict_word(r)} [{_levels(r)}]"]
    details = [text for _, text in _details(r)]
    if details:
        parts.append(" " + "; ".join(details).replace(":; ", ": "))
    sys.stdout.write(escape_text("".join(parts)) + "\n")


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
