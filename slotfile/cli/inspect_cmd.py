"""``slotfile inspect``: what a person needs to see at a glance."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slotfile.cli.common import exit_code, load_model_or_report, open_or_report, out_console
from slotfile.cli.terminal import escape_text, human_size
from slotfile.diagnosis import CAUSE_WORDS, Cause, facts_of, file_cause, next_step
from slotfile.exitcodes import OPERATIONAL
from slotfile.format import versions
from slotfile.format.records import FileFormat, MemoryBlock, MemoryKind, SlotFile, TokenForm
from slotfile.model.bridge import ModelInfo
from slotfile.problems import Severity
from slotfile.report import flash_attn_of

PREVIEW_CHARS = 160


@dataclass(frozen=True, slots=True)
class InspectArgs:
    """``slotfile inspect``'s command line."""

    files: tuple[Path, ...]
    model: Path | None = None
    layers: bool = False


def run_inspect(args: InspectArgs) -> int:
    model, ok = load_model_or_report(args.model)
    if not ok:
        return OPERATIONAL
    con = out_console()
    results: list[SlotFile | None] = []
    for i, path in enumerate(args.files):
        sf = open_or_report(path, model)
        results.append(sf)
        if sf is None:
            continue
        if i:
            con.print()
        render(sf, model, args.layers, args.model, console=con)
    return exit_code(results)


def _kv(table: Table, key: str, value: str | Text) -> None:
    table.add_row(Text(key, style="bold"), value if isinstance(value, Text) else Text(value))


def render(
    sf: SlotFile, model: ModelInfo | None, layers: bool, model_path: Path | None = None, console: Console | None = None
) -> None:
    """One file's screen, printed on ``console`` (default: a fresh one on stdout)."""
    con = console if console is not None else out_console()
    con.print(Text(escape_text(sf.path), style="bold underline"))
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(no_wrap=True)
    summary.add_column()
    vinfo = versions.version_info(sf.format, sf.version)
    kind = {FileFormat.GGSQ: "slot file (GGSQ)", FileFormat.GGSN: "session file (GGSN)"}.get(
        sf.format, "not a slot file"
    )
    _kv(summary, "format", f"{kind}, version {sf.version}" if sf.version is not None else kind)
    if vinfo is not None:
        _kv(summary, "written by", vinfo.writer)
    _kv(summary, "size", f"{sf.size} bytes ({human_size(sf.size)})")
    if sf.arch is not None:
        _kv(summary, "architecture", escape_text(sf.arch))
    _tokens(summary, sf, model)
    _memory(summary, sf)
    _appendices(summary, sf)
    con.print(summary)
    _sections(con, sf)
    if sf.body is not None and sf.body.blocks:
        _blocks(con, sf, layers)
    if sf.checkpoints:
        _checkpoints(con, sf)
    _verdict(con, sf, model_path)


def _tokens(t: Table, sf: SlotFile, model: ModelInfo | None) -> None:
    tp = sf.tokens
    if tp is None:
        return
    form = {
        TokenForm.PACKED: "packed server_tokens v1",
        TokenForm.PLAIN: "plain token ids",
        TokenForm.EMPTY: "none",
    }[tp.form]
    media = f", {len(tp.media)} media chunks" if tp.media else ""
    _kv(t, "tokens", f"{tp.tokens.size} ({form}, {tp.n_words} words{media})")
    if model is not None and tp.tokens.size:
        text = model.detokenize(tp.tokens)
        _kv(t, "text", Text(escape_text(text, PREVIEW_CHARS), style="italic"))


def _memory(t: Table, sf: SlotFile) -> None:
    body = sf.body
    if body is None:
        return
    if body.layout is None:
        _kv(t, "memory", Text("unreadable (see problems)", style="red"))
        return
    conf = {
        "unique": "detected from the bytes",
        "ambiguous": "ambiguous, best guess",
        "trailing": "best guess, trailing bytes follow",
        "model": "from the model",
    }.get(body.confidence, body.confidence)
    _kv(t, "memory", f"{body.memory_class}: {body.layout.describe()} ({conf})")
    _kv(t, "body", f"{body.size} bytes at offset {body.offset}")
    for b in body.blocks:
        _kv(t, f"  {b.role}", _block_line(b))
    _kv(t, "flash attention", flash_attn_of(sf) + " (from v_trans)")
    rot = rotation_words(body)
    if rot:
        _kv(t, "rotation", rot)
    if sf.n_tokens:
        _kv(t, "bytes per token", f"{body.size / sf.n_tokens:.0f}")


def _rot_words(k: int, v: int) -> str:
    """n_rot_k / n_rot_v of a version-4 stream in words."""
    if not k and not v:
        return "no rotation"
    parts = [f"K rotated, width {k}" if k else "K not rotated", f"V rotated, width {v}" if v else "V not rotated"]
    return "; ".join(parts)


def rotation_words(body: object) -> str:
    """The rotation words of every KV block with cells (state version 4 / session 11), in words;
    one phrase when all agree, else per block (and stream)."""
    found: list[tuple[str, str]] = []
    for b in getattr(body, "blocks", []):
        for st in b.active_streams() if b.kind == MemoryKind.KV else []:
            if st.rot_offset is not None:
                name = b.role if len(b.active_streams()) == 1 else f"{b.role} stream {st.index}"
                found.append((name, _rot_words(int(st.n_rot_k or 0), int(st.n_rot_v or 0))))
    if not found:
        return ""
    if len({w for _, w in found}) == 1:
        return found[0][1]
    return ", ".join(f"{name}: {w}" for name, w in found)


def _block_line(b: MemoryBlock) -> str:
    pos = b.positions()
    prange = f", positions {int(pos.min())}..{int(pos.max())}" if pos.size else ""
    if b.kind == MemoryKind.KV:
        active = b.active_streams()
        first = active[0] if active else None
        n_layer = first.n_layer if first else 0
        types = ""
        if first:
            kt = sorted({r.type_name for r in first.k})
            vt = sorted({r.type_name for r in first.v})
            types = f", K {'/'.join(kt)}" + (f", V {'/'.join(vt)}" if vt else ", no V")
        where = ", ".join(f"stream {s.index}: {s.cell_count} cells" for s in active) or "no cells"
        return f"{b.n_stream} stream(s); {where}{prange}; {n_layer} layers{types}"
    rt = sorted({r.type_name for r in b.r})
    return (
        f"{b.cell_count} cell(s){prange}; n_layer {b.n_layer}, {len(b.r)} recurrent layers"
        f" (R {'/'.join(rt)}, {len(b.p)} P rows)"
    )


def _appendices(t: Table, sf: SlotFile) -> None:
    if sf.sckp is not None:
        state = "" if sf.sckp.complete else ", DAMAGED"
        _kv(t, "checkpoints", f"SCKP v{sf.sckp.version}: {len(sf.checkpoints)} of {sf.sckp.count}{state}")
    if sf.draft is not None:
        d = sf.draft
        if d.dft is not None:
            lay = d.dft.body.layout.describe() if d.dft.body and d.dft.body.layout else "unreadable"
            spec = d.spec.length if d.spec else 0
            _kv(t, "draft state", f"SDFT v{d.version}: draft {d.dft.length} bytes ({lay}), speculative {spec} bytes")
        else:
            _kv(t, "draft state", f"SDFT v{d.version}: DAMAGED")


def _sections(con: Console, sf: SlotFile) -> None:
    table = Table(title="sections", title_justify="left", show_lines=False)
    for col, just in (("section", "left"), ("offset", "right"), ("size", "right"), ("content", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for s in sf.sections:
        table.add_row(Text(s.name), str(s.offset), str(s.size), Text(escape_text(s.note)))
    con.print(table)


def _blocks(con: Console, sf: SlotFile, layers: bool) -> None:
    table = Table(title="memory layers", title_justify="left")
    for col, just in (
        ("block", "left"),
        ("part", "left"),
        ("layers", "right"),
        ("type", "left"),
        ("row bytes", "right"),
        ("cells", "right"),
        ("offset", "right"),
        ("bytes", "right"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for b in sf.body.blocks:  # type: ignore[union-attr]
        name = b.role
        runs = b.runs()
        if layers:
            groups = [[r] for r in runs]
        else:  # consecutive layers of one part with the same type and row size fold into one line
            groups = [list(g) for _, g in groupby(runs, key=lambda r: (r.part, r.type_id, r.row_size))]
        for grp in groups:
            r0 = grp[0]
            idx = f"{r0.index}" if len(grp) == 1 else f"{r0.index}-{grp[-1].index}"
            part = r0.part + (" (transposed)" if r0.transposed else "")
            table.add_row(
                name,
                part,
                idx,
                r0.type_name,
                str(r0.row_size),
                str(r0.n_cells),
                str(r0.offset),
                str(sum(r.data.length for r in grp)),
            )
    con.print(table)


def _checkpoints(con: Console, sf: SlotFile) -> None:
    table = Table(title="context checkpoints (SCKP)", title_justify="left")
    for col, just in (
        ("#", "right"),
        ("n_tokens", "right"),
        ("positions", "left"),
        ("target", "right"),
        ("draft", "right"),
        ("spec", "right"),
        ("target holds", "left"),
        ("offset", "right"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for c in sf.checkpoints:
        lay = _blob_line(c.tgt.body)
        table.add_row(
            str(c.index),
            str(c.n_tokens),
            f"{c.pos_min}..{c.pos_max}",
            str(c.tgt.length),
            str(c.dft.length),
            str(c.spec.length),
            lay,
            str(c.offset),
        )
    con.print(table)


def _blob_line(body: object) -> str:
    """What a checkpoint blob holds: its layout, cells and positions."""
    if body is None or body.layout is None:  # type: ignore[attr-defined]
        return "unreadable"
    parts = []
    for b in body.blocks:  # type: ignore[attr-defined]
        pos = b.positions()
        span = f" {int(pos.min())}..{int(pos.max())}" if pos.size else ""
        parts.append(f"{b.kind} {b.n_cells()} cells{span}")
    return ", ".join(parts) or "empty"


def _verdict(con: Console, sf: SlotFile, model_path: Path | None = None) -> None:
    """The verdict names the cause (damaged, does not match this model, not a slot file), then
    every problem, then the next step for a file that fails."""
    style = {"ok": "bold green", "ok with warnings": "bold yellow"}.get(sf.verdict, "bold red")
    cause = file_cause(sf.problems)
    line = Text("verdict: ", style="bold")
    line.append(CAUSE_WORDS.get(cause, sf.verdict) if cause is not None else sf.verdict, style=style)
    n = len(sf.problems)
    if n:
        line.append(f" ({n} problem{'s' if n > 1 else ''})")
    con.print(line)
    for p in sf.problems:
        mark = "error" if p.severity == Severity.ERROR else "warning"
        # one problem, one line, never wrapped: people grep for these
        con.print(
            Text(f"  {mark}: {escape_text(p.line())}", style="red" if mark == "error" else "yellow"), soft_wrap=True
        )
    step = next_step(cause, sf.problems, facts_of(sf, str(model_path) if model_path else None))
    if step is not None and cause != Cause.NOT_SLOT_FILE:  # a wrong input says what to pass in its problem
        con.print(
            Text(escape_text(f"next step: {step.text}" + (f": {step.command}" if step.command else "")), style="cyan"),
            soft_wrap=True,
        )
