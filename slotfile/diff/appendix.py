"""The appendices of two files: checkpoints (SCKP) matched by what they cover, their blobs
compared the way the body is, and the draft state (SDFT).

A checkpoint is known by ``(n_tokens, pos_min, pos_max)``: the server keeps a list of them in
creation order (``server_prompt::checkpoints``), so the same checkpoint may sit at another index
in the other file, and one file may hold checkpoints the other dropped (the cap of
``--ctx-checkpoints``, or a save taken earlier).
"""

from __future__ import annotations

import numpy as np

from slotfile.diff.rawbytes import Context, bytes_equal
from slotfile.diff.report import BlobDiff, CheckpointDiff, Status
from slotfile.diff.tensors import compare_bodies
from slotfile.format.records import BlobInfo, Checkpoint, SlotFile


def _blob_bytes(ctx: Context, name: str, a: BlobInfo | None, b: BlobInfo | None) -> BlobDiff:
    """A blob compared as bytes (data_spec: ``i32 pos`` + f32 hidden state for EAGLE3, or empty)."""
    la = a.length if a is not None else None
    lb = b.length if b is not None else None
    bd = BlobDiff(name, Status.IDENTICAL, la, lb)
    if a is None or b is None:
        bd.status = Status.ONLY_A if b is None else Status.ONLY_B
        return bd
    va, vb = a.data.view, b.data.view
    if len(va) == len(vb) and bytes_equal(memoryview(va), memoryview(vb)):
        return bd
    bd.status = Status.DIFFERENT
    n = min(len(va), len(vb))
    ua, ub = np.frombuffer(va, np.uint8, n), np.frombuffer(vb, np.uint8, n)
    ne = np.flatnonzero(ua != ub)
    k = int(ne[0]) if ne.size else n
    bd.first_offset_a, bd.first_offset_b = a.data_offset + k, b.data_offset + k
    return bd


def _seq_blob(ctx: Context, container: str, a: BlobInfo, b: BlobInfo, limit: int | None) -> BlobDiff | None:
    """A sequence-state blob (io_magic, seq_id, body): its body's layers into ``ctx``; the blob
    itself compared as bytes when one side does not parse (or is empty on one side only)."""
    if not a.length and not b.length:
        return None
    if not a.length or not b.length:
        return BlobDiff(container, Status.ONLY_A if a.length else Status.ONLY_B, a.length, b.length)
    pa = a.body is not None and a.body.layout is not None
    pb = b.body is not None and b.body.layout is not None
    if pa and pb:
        compare_bodies(ctx, container, a.body, b.body, limit)
        return None
    bd = _blob_bytes(ctx, container, a, b)
    return bd


def _key(c: Checkpoint) -> tuple[int, int, int]:
    return (c.n_tokens, c.pos_min, c.pos_max)


def compare_checkpoints(ctx: Context, a: SlotFile, b: SlotFile, limit: int | None) -> list[CheckpointDiff]:
    out: list[CheckpointDiff] = []
    by_b: dict[tuple[int, int, int], list[Checkpoint]] = {}
    for c in b.checkpoints:
        by_b.setdefault(_key(c), []).append(c)
    used: set[int] = set()
    for ca in a.checkpoints:
        cands = [c for c in by_b.get(_key(ca), []) if c.index not in used]
        if not cands:
            out.append(CheckpointDiff(*_key(ca), Status.ONLY_A, index_a=ca.index))
            continue
        cb = cands[0]
        used.add(cb.index)
        cd = CheckpointDiff(*_key(ca), Status.IDENTICAL, index_a=ca.index, index_b=cb.index)
        name = f"sckp.checkpoint[{ca.index}]" if ca.index == cb.index else f"sckp.checkpoint[{ca.index}|{cb.index}]"
        before_runs, before_cells = len(ctx.runs), len(ctx.cells)
        for ba, bb in ((ca.tgt, cb.tgt), (ca.dft, cb.dft)):
            bd = _seq_blob(ctx, f"{name}.{ba.name}", ba, bb, limit)
            if bd is not None:
                cd.blobs.append(bd)
        cd.blobs.append(_blob_bytes(ctx, "data_spec", ca.spec, cb.spec))
        changed = any(r.status != Status.IDENTICAL for r in ctx.runs[before_runs:])
        changed |= any(not c.same for c in ctx.cells[before_cells:])
        changed |= any(bd.status != Status.IDENTICAL for bd in cd.blobs)
        if changed:
            cd.status = Status.DIFFERENT
        out.append(cd)
    for cb in b.checkpoints:
        if cb.index not in used:
            out.append(CheckpointDiff(*_key(cb), Status.ONLY_B, index_b=cb.index))
    return out


def compare_draft(ctx: Context, a: SlotFile, b: SlotFile, limit: int | None) -> tuple[BlobDiff | None, BlobDiff | None]:
    """The SDFT draft state: (presence, data_spec bytes); the draft body's layers into ``ctx``."""
    da, db = a.draft, b.draft
    if da is None and db is None:
        return None, None
    if da is None or db is None:
        return BlobDiff("sdft", Status.ONLY_A if db is None else Status.ONLY_B), None
    presence = BlobDiff("sdft", Status.IDENTICAL)
    if da.dft is None or db.dft is None:  # a damaged appendix: the reader kept no blob
        if (da.dft is None) != (db.dft is None):
            presence.status = Status.DIFFERENT
        return presence, None
    before_runs, before_cells = len(ctx.runs), len(ctx.cells)
    bd = _seq_blob(ctx, "sdft.data_dft", da.dft, db.dft, limit)
    if bd is not None and bd.status != Status.IDENTICAL:
        presence.status = Status.DIFFERENT
    if any(r.status != Status.IDENTICAL for r in ctx.runs[before_runs:]) or any(
        not c.same for c in ctx.cells[before_cells:]
    ):
        presence.status = Status.DIFFERENT
    spec = _blob_bytes(ctx, "data_spec", da.spec, db.spec) if da.spec is not None or db.spec is not None else None
    return presence, spec
