"""``slotfile diff A B``: where two slot files differ, in file order; exit codes like ``cmp``.

Plain text on stdout (no rich: a diff of two identical 1 GiB files should cost about what ``cmp``
does), or ``--json`` (schema ``slotfile.diff/1``, documented in the README).  Exit 0 identical (or
identical but for state version 4's rotation words), 1 different, 8 a file cannot be read
(or the model cannot), 2 usage.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotfile.cli.terminal import escape_text
from slotfile.diff.report import CellsDiff, DiffReport, RunDiff, Status, TokenDiff, Verdict
from slotfile.exitcodes import OPERATIONAL

MAX_RUN_LINES = 40  # differing layers listed one per line; the rest counted
MAX_PROBLEMS = 3  # reader errors listed per file


def _v(x: Any) -> str:
    return "-" if x is None else str(x)


def _pct(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.3g}%"


def _g(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x:.3g}"


def _side(name: str, s: Any) -> str:
    what = f"{s.format} {s.version}" if s.format and s.version is not None else (s.format or "?")
    size = f", {s.size:,} bytes" if s.size is not None else ""
    return f"{name}: {escape_text(s.path)} ({what}{size})"


def _run_line(r: RunDiff) -> str:
    head = f"  {r.where} {r.part} layer {r.layer}" + (
        f" (model layer {r.model_layer})" if r.model_layer is not None and r.model_layer != r.layer else ""
    )
    types = r.type_a if r.type_a == r.type_b else f"{_v(r.type_a)} / {_v(r.type_b)}"
    if r.status == Status.ONLY_A:
        return f"{head} ({r.type_a}): only in A"
    if r.status == Status.ONLY_B:
        return f"{head} ({r.type_b}): only in B"
    if r.status in (Status.INCOMPARABLE, Status.NOT_COMPARED):
        return f"{head} ({types}): {r.status}: {r.reason}"
    st = r.stats or {}
    first = f"first cell {r.first_cell}" + (f" (position {r.first_pos})" if r.first_pos is not None else "")
    if r.first_offset_a is not None:
        first += f" at byte {r.first_offset_a} of A, {r.first_offset_b} of B"
    worst = f"worst cell {st.get('worst_cell')}" + (
        f" (position {st['worst_pos']})" if st.get("worst_pos") is not None else ""
    )
    head_word = "head angle" if st.get("head") else "row angle"
    parts = [
        f"relative difference {_pct(st.get('rel'))}",
        f"{head_word} {_g(st.get('angle'))} deg",
        f"|ln norm ratio| {_g(st.get('lnorm'))}",
        f"max |difference| {_g(st.get('max_abs'))}",
    ]
    bad = [
        f"non-finite in {s} cell {st[k]}"
        for s, k in (("A", "nonfinite_a_cell"), ("B", "nonfinite_b_cell"))
        if st.get(k) is not None
    ]
    by_value = " (compared by value: another byte layout)" if r.by_value else ""
    return (
        f"{head} ({types}): {r.differing_cells} of {r.cells} cells differ{by_value}; {first}; "
        f"{worst}: {', '.join(parts + bad)}"
    )


def _cells_line(c: CellsDiff) -> str:
    span = f" (positions {c.pos_first}..{c.pos_last})" if c.pos_first is not None else ""
    meta = "; cell metadata (seq ids) differs" if not c.meta_same else ""
    note = f"; {c.note}" if c.note else ""
    if c.compared == c.cells_a == c.cells_b:
        return f"  {c.where}: {c.cells_a} cells in both{span}{meta}{note}"
    return f"  {c.where}: {c.cells_a} cells in A, {c.cells_b} in B; {c.compared} compared{span}{meta}{note}"


def _header_lines(rep: DiffReport) -> list[str]:
    lines = [_side("A", rep.a), _side("B", rep.b)]
    for name, side in (("A", rep.a), ("B", rep.b)):
        errs = [p for p in side.problems if p.get("severity") == "error"]
        for p in errs[:MAX_PROBLEMS]:
            lines.append(
                f"  {name} problem: {escape_text(str(p['section']))} at offset {p['offset']}: "
                f"{escape_text(str(p['message']))}"
            )
        if len(errs) > MAX_PROBLEMS:
            lines.append(f"  {name}: {len(errs) - MAX_PROBLEMS} more problems (slotfile inspect {name} lists them)")
    differing = [f for f in rep.fields if not f.same]
    if rep.fields:
        lines.append(f"headers and settings: {len(rep.fields) - len(differing)} of {len(rep.fields)} equal")
        for f in differing:
            tag = "  (rotation words)" if f.rotation else ""
            lines.append(f"  {f.section} {f.name}: {_v(f.a)} | {_v(f.b)}{tag}")
    return lines


def _token_lines(t: TokenDiff | None) -> list[str]:
    if t is None:
        return []
    if t.same:
        return [f"tokens: equal ({t.n_a} tokens)"]
    if t.first_diff is None:
        return [f"tokens: equal ids ({t.n_a}); the media chunks differ"]
    at = (
        f"B ends there, A goes on with {t.token_a}"
        if t.token_b is None
        else f"A ends there, B goes on with {t.token_b}"
        if t.token_a is None
        else f"A {t.token_a}, B {t.token_b}"
    )
    lines = [f"tokens: differ from index {t.first_diff} ({t.shared} shared; A holds {t.n_a}, B {t.n_b}): {at}"]
    if t.text_a is not None:
        lines.append(f"  shared before it: {escape_text(t.shared_text or '', 120)}")
        lines.append(f"  A from there: {escape_text(t.text_a, 120)}")
        lines.append(f"  B from there: {escape_text(t.text_b or '', 120)}")
    else:
        lines.append(f"  ids from index {t.context_start}: {t.shared_ids} then A {t.ids_a}, B {t.ids_b}")
    return lines


def _layer_lines(rep: DiffReport) -> list[str]:
    lines = []
    if rep.cells:
        lines.append("cells:")
        lines += [_cells_line(c) for c in rep.cells]
    if rep.runs:
        by_container = Counter(r.container for r in rep.runs)
        same = Counter(r.container for r in rep.runs if r.status == Status.IDENTICAL)
        lines.append("layers: " + "; ".join(f"{c}: {same[c]} of {n} identical" for c, n in by_container.items()))
        bad = [r for r in rep.runs if r.status != Status.IDENTICAL]
        lines += [_run_line(r) for r in bad[:MAX_RUN_LINES]]
        if len(bad) > MAX_RUN_LINES:
            lines.append(f"  ... and {len(bad) - MAX_RUN_LINES} more (--json lists every layer)")
    return lines


def _appendix_lines(rep: DiffReport) -> list[str]:
    lines = []
    if rep.checkpoints:
        n_a = sum(1 for c in rep.checkpoints if c.index_a is not None)
        n_b = sum(1 for c in rep.checkpoints if c.index_b is not None)
        n_same = sum(1 for c in rep.checkpoints if c.status == Status.IDENTICAL)
        lines.append(f"checkpoints: {n_a} in A, {n_b} in B, {n_same} identical")
        for c in rep.checkpoints:
            if c.status == Status.IDENTICAL:
                continue
            what = {Status.ONLY_A: "only in A", Status.ONLY_B: "only in B"}.get(c.status, "differs (layers above)")
            blobs = [f"{b.name} {b.status}" for b in c.blobs if b.status != Status.IDENTICAL]
            lines.append(
                f"  checkpoint of {c.n_tokens} tokens (positions {c.pos_min}..{c.pos_max}): {what}"
                + (f"; {', '.join(blobs)}" if blobs else "")
            )
    if rep.draft is not None:
        d = rep.draft
        what = {Status.ONLY_A: "only in A", Status.ONLY_B: "only in B", Status.IDENTICAL: "identical"}.get(
            d.status, "differs (layers above)"
        )
        if rep.draft_spec is not None and rep.draft_spec.status != Status.IDENTICAL:
            what += f"; data_spec {rep.draft_spec.status}"
        lines.append(f"draft state (SDFT): {what}")
    for o in rep.other:
        lines.append(
            f"other bytes differ: from byte {o.offset_a} of A ({o.section_a}), {o.offset_b} of B ({o.section_b})"
        )
    return lines


def render(rep: DiffReport) -> str:
    """The text report, in file order, ending with the result line."""
    lines = _header_lines(rep) + _token_lines(rep.tokens)
    for name, side in (("A", rep.a), ("B", rep.b)):
        if side.unreadable:
            lines.append(f"cannot read {name}: {escape_text(side.unreadable)}")
    lines += _layer_lines(rep) + _appendix_lines(rep)
    lines.append(_result(rep))
    return "\n".join(lines) + "\n"


def _result(rep: DiffReport) -> str:
    v = rep.verdict
    if v == Verdict.UNREADABLE:
        return "result: cannot compare (" + "; ".join(escape_text(u) for u in rep.unreadable) + ")"
    if v == Verdict.IDENTICAL:
        return "result: identical"
    if v == Verdict.ROTATION_ONLY:
        return f"result: identical but for the rotation words (state version {rep.a.version} / {rep.b.version})"
    if v == Verdict.VERSION_ONLY:
        return f"result: identical but for the version word ({rep.a.version} / {rep.b.version})"
    diffs = rep.differences()
    shown = ", ".join(diffs[:6]) + (f", ... ({len(diffs)} in all)" if len(diffs) > 6 else "")
    layout = next((f for f in rep.fields if f.section == "body" and f.name == "layout" and not f.same), None)
    if layout is not None:
        return (
            f"result: different: the memory layouts differ (A: {_v(layout.a)}, B: {_v(layout.b)}), so these are "
            f"states of different models or settings; {shown}"
        )
    return f"result: different: {shown}"


@dataclass(frozen=True, slots=True)
class DiffArgs:
    """What ``slotfile diff`` was given."""

    file_a: Path
    file_b: Path
    model: Path | None = None
    json_out: bool = False


def run_diff(args: DiffArgs) -> int:
    from slotfile.cli.common import fail, load_model_or_report
    from slotfile.diff import diff_files

    info, ok = load_model_or_report(args.model, "diff")
    if not ok:
        return OPERATIONAL
    rep = diff_files(args.file_a, args.file_b, info)
    if args.json_out:
        sys.stdout.write(json.dumps(rep.to_dict(), indent=1, allow_nan=False) + "\n")
    else:
        sys.stdout.write(render(rep))
    for u in rep.unreadable:
        fail(u, "diff")
    sys.stdout.flush()
    return rep.exit_code
