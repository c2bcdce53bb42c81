"""Compare two slot (or session) files: :func:`diff_files`.

In file order: headers and settings (:mod:`.headers`), the stored tokens (:mod:`.tokens`), per
memory block the cells both files hold and each layer's K/V/R/P/S rows over them
(:mod:`.tensors`), then the appendices (:mod:`.appendix`).  When nothing differs in any of
these, a last byte-level check compares everything they did not cover (cell metadata, the token
payload's padding, entry headers), with the version word, state version 4's rotation words and
the blob length words (which grow by those words) set aside: a file and its ``migrate`` to the
other version then come out "identical but for the rotation words".

Both files are opened read-only through :func:`slotfile.open_slot_file` and never modified.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from slotfile.diff.appendix import compare_checkpoints, compare_draft
from slotfile.diff.headers import blob_rotation_fields, compare_headers, rotation_step
from slotfile.diff.rawbytes import CHUNK_BYTES, Context, Source, bytes_equal
from slotfile.diff.report import DiffReport, FieldDiff, OtherDiff, Side
from slotfile.diff.tensors import compare_bodies
from slotfile.diff.tokens import compare_tokens
from slotfile.format.records import BlockExpect, Body, CacheExpect, FileFormat, MemoryKind, SlotFile

if TYPE_CHECKING:
    from slotfile.model.bridge import ModelInfo


def _open(path: Path) -> tuple[SlotFile | None, Side]:
    from slotfile import open_slot_file

    side = Side(str(path))
    if path.is_dir():
        side.unreadable = "is a directory, not a slot file"
        return None, side
    try:
        sf = open_slot_file(path)
    except OSError as e:
        side.unreadable = f"cannot open: {e.strerror or e}"
        return None, side
    side.size, side.format, side.version, side.verdict = sf.size, str(sf.format), sf.version, sf.verdict
    side.problems = [p.to_dict() for p in sf.problems]
    first = sf.errors[0].line() if sf.errors else "no state could be read"
    if sf.format == FileFormat.UNKNOWN or sf.version is None:
        side.unreadable = first
    elif sf.body is None or sf.body.layout is None:
        side.unreadable = f"its state cannot be read ({first})"
    return sf, side


def diff_files(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    model: ModelInfo | None = None,
) -> DiffReport:
    """Compare two files.  ``model`` (the target model): detokenises the context around a token
    difference, gives each cache's head size for the head angles (without it a whole row is one
    head) and each cache layer's model layer.  Never raises on bad input: an unreadable file is
    a :class:`~slotfile.diff.report.Side` with ``unreadable`` set."""
    t0 = time.perf_counter()
    sa, side_a = _open(Path(path_a))
    sb, side_b = _open(Path(path_b))
    rep = DiffReport(side_a, side_b)
    try:
        if sa is not None and sb is not None and sa.version is not None and sb.version is not None:
            _compare(rep, sa, sb, model)
        if sa is not None and sb is not None:
            _locate_cut(side_a, side_b, sa, sb)
    finally:
        rep.seconds = time.perf_counter() - t0
        for sf in (sa, sb):
            if sf is not None:
                sf.close()
    return rep


def _compare(rep: DiffReport, a: SlotFile, b: SlotFile, model: ModelInfo | None) -> None:
    rep.fields = compare_headers(a, b)
    rep.tokens = compare_tokens(a, b, model)
    if rep.unreadable:
        return
    # cells from the first token where the prompts diverge on hold other tokens: not compared
    limit = rep.tokens.shared if rep.tokens.first_diff is not None else None
    blocks = _model_blocks(model)
    first = next((blk for blk in blocks.values() if isinstance(blk, CacheExpect)), None)
    if first is not None:
        rep.head_k, rep.head_v = max(first.head_k, 0), max(first.head_v, 0)
    ctx = Context(Source.of(a), Source.of(b), model_blocks=blocks)
    try:
        compare_bodies(ctx, "body", a.body, b.body, limit)
        rep.checkpoints = compare_checkpoints(ctx, a, b, limit)
        rep.draft, rep.draft_spec = compare_draft(ctx, a, b, limit)
    finally:
        ctx.close()
    rep.cells, rep.runs, rep.bytes_compared = ctx.cells, ctx.runs, ctx.bytes_compared
    rep.fields += _blob_rotation(a, b, rep)
    if not rep.differences():
        other = other_bytes(a, b, ctx)
        if other is not None:
            rep.other.append(other)


def _model_blocks(model: ModelInfo | None) -> dict[str, BlockExpect]:
    """Block role -> the model's expected block (head sizes, the model layers of its cache
    layers; empty without a model or for an architecture slotfile does not model)."""
    if model is None:
        return {}
    from slotfile.model.expect import expect_from_model

    try:
        exp = expect_from_model(model)
    except (ValueError, KeyError, TypeError):  # metadata slotfile cannot model: cache indices only
        return {}
    return {b.role: b for b in exp.blocks}


def _blob_rotation(a: SlotFile, b: SlotFile, rep: DiffReport) -> list[FieldDiff]:
    """The rotation words of every checkpoint and draft blob both files hold."""
    step = rotation_step(a, b)
    out: list[FieldDiff] = []
    ck_a = {c.index: c for c in a.checkpoints}
    ck_b = {c.index: c for c in b.checkpoints}
    for cd in rep.checkpoints:
        if cd.index_a is None or cd.index_b is None:
            continue
        ca, cb = ck_a[cd.index_a], ck_b[cd.index_b]
        for ba, bb in ((ca.tgt, cb.tgt), (ca.dft, cb.dft)):
            out += blob_rotation_fields(f"sckp.checkpoint[{cd.index_a}].{ba.name}", ba.body, bb.body, step)
    if a.draft is not None and b.draft is not None and a.draft.dft is not None and b.draft.dft is not None:
        out += blob_rotation_fields("sdft.data_dft", a.draft.dft.body, b.draft.dft.body, step)
    return out


def where_in(sf: SlotFile, off: int) -> str | None:
    """What ``sf`` holds at byte ``off``: a layer run's cell, else the section's name."""
    for name, r in sf.value_runs():
        if r.data.offset <= off < r.data.offset + r.data.length:
            rel = off - r.data.offset
            if r.transposed and r.n_cells:
                el = r.row_size // r.n_embd if r.n_embd else 1
                cell = rel // el % r.n_cells
            else:
                cell = rel // r.row_size if r.row_size else 0
            return f"{name} {r.part} layer {r.index}, cell {cell} of {r.n_cells}"
    sec = _section(sf, off)
    return None if sec == "file" else sec


def _prefix_equal(a: Source, b: Source, n: int) -> bool:
    """Whether the first ``n`` bytes of two files are equal (chunked, pages handed back)."""
    step = CHUNK_BYTES
    for off in range(0, n, step):
        k = min(step, n - off)
        same = len(a.view) >= off + k and bytes_equal(a.view[off : off + k], b.view[off : off + k])
        a.release(off, k)
        b.release(off, k)
        if not same:
            return False
    return True


def _locate_cut(side_a: Side, side_b: Side, a: SlotFile, b: SlotFile) -> None:
    """A file that cannot be read and is shorter than the other: where the cut falls in the
    other file's layout (the layer and cell a truncated copy lost), and whether the bytes before
    it are the other file's."""
    for cut, whole, side in ((a, b, side_a), (b, a, side_b)):
        if side.unreadable is None or whole.body is None or whole.body.layout is None or cut.size >= whole.size:
            continue
        if cut.format != whole.format:  # not a slot file, or another kind: no cut of this one
            continue
        where = where_in(whole, cut.size)
        if where is None:
            continue
        n = cut.size
        same = _prefix_equal(Source.of(cut), Source.of(whole), n)
        other = "B" if cut is a else "A"
        side.unreadable += f"; it ends at byte {n}, which in {other} is inside {where}" + (
            f" (every byte before it is {other}'s: a truncated copy)" if same else ""
        )


# ---------------------------------------------------------------------------------------
# the last check: every byte not compared above
# ---------------------------------------------------------------------------------------


def _bodies(sf: SlotFile) -> list[Body]:
    out = [sf.body] if sf.body is not None else []
    for c in sf.checkpoints:
        out += [bl.body for bl in (c.tgt, c.dft) if bl.body is not None]
    if sf.draft is not None and sf.draft.dft is not None and sf.draft.dft.body is not None:
        out.append(sf.draft.dft.body)
    return out


def set_aside(sf: SlotFile) -> list[tuple[int, int]]:
    """Byte ranges the last check skips: the layer runs (compared run by run already), the
    version word, every KV stream's rotation words (state version 4) and every blob's u64
    length (which counts those words)."""
    ranges = [(4, 8)]
    ranges += [(r.data.offset, r.data.offset + r.data.length) for _, r in sf.value_runs()]
    for body in _bodies(sf):
        for blk in body.blocks:
            if blk.kind != MemoryKind.KV:
                continue
            ranges += [(s.rot_offset, s.rot_offset + 8) for s in blk.streams if s.rot_offset is not None]
    blobs = [bl for c in sf.checkpoints for bl in (c.tgt, c.dft, c.spec)]
    if sf.draft is not None:
        blobs += [bl for bl in (sf.draft.dft, sf.draft.spec) if bl is not None]
    ranges += [(bl.offset, bl.offset + 8) for bl in blobs]
    ranges.sort()
    merged: list[tuple[int, int]] = []
    for s, e in ranges:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _rest(view: memoryview, size: int, skip: list[tuple[int, int]]) -> tuple[bytes, list[tuple[int, int]]]:
    """The bytes outside ``skip``, joined, and (offset in the joined bytes, file offset) per piece."""
    pieces: list[bytes] = []
    where: list[tuple[int, int]] = []
    pos = at = 0
    for s, e in [*skip, (size, size)]:
        if s > pos:
            where.append((at, pos))
            pieces.append(bytes(view[pos:s]))
            at += s - pos
        pos = max(pos, e)
    return b"".join(pieces), where


def _file_offset(where: list[tuple[int, int]], k: int) -> int:
    off = 0
    for at, fo in where:
        if at > k:
            break
        off = fo + (k - at)
    return off


def _section(sf: SlotFile, off: int) -> str:
    name = "file"
    for s in sf.sections:  # later sections are the more specific ones (checkpoints after sckp)
        if s.offset <= off < s.offset + s.size:
            name = s.name
    return name


def other_bytes(a: SlotFile, b: SlotFile, ctx: Context) -> OtherDiff | None:
    ra, wa = _rest(ctx.a.view, a.size, set_aside(a))
    rb, wb = _rest(ctx.b.view, b.size, set_aside(b))
    if ra == rb:
        return None
    n = min(len(ra), len(rb))
    ne = np.flatnonzero(np.frombuffer(ra, np.uint8, n) != np.frombuffer(rb, np.uint8, n))
    k = int(ne[0]) if ne.size else n
    oa, ob = _file_offset(wa, k), _file_offset(wb, k)
    return OtherDiff(oa, ob, _section(a, oa), _section(b, ob))
