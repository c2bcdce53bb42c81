"""Consistency checks across sections, after everything readable was read: positions,
rotation widths, streams, tokens against cells, checkpoint order.  They add problems and never
stop the reading."""

from __future__ import annotations

import numpy as np

from slotfile.format.layout import (
    MemoryKind,
)
from slotfile.format.records import (
    Body,
    FileFormat,
    KVStream,
    MemoryBlock,
    SlotFile,
    TokenForm,
)
from slotfile.format.types import TYPES
from slotfile.problems import ProblemCode, Severity


def check_semantics(sf: SlotFile) -> None:
    body = sf.body
    if body is None or body.layout is None:
        return
    if not body.blocks:
        sf.problem(
            Severity.WARNING,
            ProblemCode.EMPTY_BODY,
            "body",
            body.offset,
            "no memory state: a model without memory, or a file cut right after the tokens",
        )
    elif sf.tokens is not None and _empty_slot(sf, body):
        # llama-server answers such a save with n_saved 0 and success.  A current server with a
        # unified cache (-kvu; the default with -np auto) clears every idle slot when another slot
        # starts a task (--cache-idle-slots, on by default: server_context::process_single_task,
        # TAG_IDLE_SLOT_CLEAR), so an idle slot saved after that holds nothing.
        sf.problem(
            Severity.WARNING,
            ProblemCode.EMPTY_SLOT,
            "tokens",
            sf.tokens.offset,
            "the slot holds no tokens and no cells: restoring it restores nothing (a server with a unified "
            "cache clears idle slots when another slot starts a task, unless started with --no-cache-idle-slots)",
        )
    for blk in body.blocks:
        check_block(sf, blk, f"body.{blk.role}")
    for ck in sf.checkpoints:
        for b in (ck.tgt, ck.dft):
            if b.body is not None:
                for blk in b.body.blocks:
                    check_block(sf, blk, f"sckp.checkpoint[{ck.index}].{b.name}.{blk.role}")
    if sf.draft and sf.draft.dft and sf.draft.dft.body:
        for blk in sf.draft.dft.body.blocks:
            check_block(sf, blk, f"sdft.data_dft.{blk.role}")
    _check_tokens_vs_cells(sf)
    _check_checkpoints(sf)


def _empty_slot(sf: SlotFile, body: Body) -> bool:
    """A slot save (GGSQ) whose token payload holds no tokens, with no cells and no checkpoints."""
    return (
        sf.format == FileFormat.GGSQ
        and sf.n_tokens == 0
        and not sf.checkpoints
        and not any(b.n_cells() for b in body.blocks)
    )


def check_block(sf: SlotFile, blk: MemoryBlock, sec: str) -> None:
    if blk.kind == MemoryKind.KV:
        active = blk.active_streams()
        if len(active) > 1 and sf.format == FileFormat.GGSQ:
            sf.problem(
                Severity.ERROR,
                ProblemCode.INVALID,
                sec,
                blk.offset,
                f"{len(active)} non-empty streams in a single-sequence save (at most 1)",
            )
        for st in active:
            _check_rotation(sf, st, f"{sec}.stream[{st.index}]")
            ct = st.cells
            if ct is None:
                continue
            _check_positions(sf, ct.cells["pos"], ct.offset, ct.cells.dtype.itemsize, f"{sec}.stream[{st.index}]")
            if sf.format != FileFormat.GGSQ or not _mixed(ct.seq_ids):
                continue
            seq = np.unique(ct.seq_ids)
            if seq.size > 1:
                sf.problem(
                    Severity.WARNING,
                    ProblemCode.INVALID,
                    f"{sec}.stream[{st.index}]",
                    ct.offset,
                    f"cells carry {seq.size} different seq ids in a single-sequence save",
                )
    elif blk.cells is not None and blk.cell_count:
        _check_positions(sf, blk.cells.cells["pos"], blk.cells.offset, blk.cells.cells.dtype.itemsize, sec)
    for run in blk.runs():
        if run.type_id not in TYPES:
            sf.problem(
                Severity.WARNING,
                ProblemCode.UNKNOWN_TYPE,
                sec,
                run.offset,
                f"{run.part} layer {run.index}: ggml type id {run.type_id} is not known to this "
                "build (newer llama.cpp or a fork)",
            )


def _mixed(ids: np.ndarray) -> bool:
    """More than one seq id (np.unique sorts; this does not)."""
    ids = np.asarray(ids).ravel()
    return bool(ids.size > 1 and (ids != ids[0]).any())


MAX_ROT = 1 << 16  # far above any head size: a Hadamard matrix of this width would be 16 GiB of f32


def _check_rotation(sf: SlotFile, st: KVStream, sec: str) -> None:
    """n_rot_k / n_rot_v of a version-4 stream: 0 (not rotated) or a power of two from 64 (the
    llama_kv_cache constructor starts at 64 and doubles); anything else is damage, and a
    llama.cpp would refuse the load ("incompatible key/value rotation")."""
    if st.rot_offset is None:
        return
    for i, (name, value) in enumerate((("n_rot_k", st.n_rot_k), ("n_rot_v", st.n_rot_v))):
        v = int(value or 0)
        if v and not (64 <= v <= MAX_ROT and v & (v - 1) == 0):
            sf.problem(
                Severity.ERROR,
                ProblemCode.BAD_ROTATION,
                sec,
                st.rot_offset + 4 * i,
                f"{name} {v} is not a rotation width (0, or a power of two from 64); "
                f"llama.cpp would refuse the load (incompatible {'key' if i == 0 else 'value'} rotation)",
            )


def _check_positions(sf: SlotFile, pos: np.ndarray, off: int, stride: int, sec: str) -> None:
    if not pos.size:
        return
    neg = np.flatnonzero(pos < 0)
    if neg.size:
        i = int(neg[0])
        sf.problem(
            Severity.ERROR,
            ProblemCode.BAD_POSITION,
            sec,
            off + i * stride,
            f"cell {i} has negative position {int(pos[i])}",
        )
    # Cells are written in cell-index order (state_write_meta walks the cell ranges), not in
    # position order: after an SWA ring wraps or freed cells are reused, positions go back.
    # That is normal, so their order is not checked.


def _check_tokens_vs_cells(sf: SlotFile) -> None:
    if (
        sf.tokens is None
        or sf.body is None
        or not sf.body.blocks
        or (sf.tokens.form == TokenForm.PACKED and sf.tokens.raw is None)
    ):
        return
    t = sf.n_tokens
    first = sf.body.blocks[0]
    pos = first.positions()
    if first.kind == MemoryKind.KV and first.role in ("kv", "kv-base") and not (sf.tokens.media):
        n = first.n_cells()
        if n != t:
            sf.problem(
                Severity.WARNING,
                ProblemCode.TOKEN_MISMATCH,
                f"body.{first.role}",
                first.offset,
                f"token payload holds {t} tokens but the cache holds {n} cells",
            )
    if pos.size and int(pos.max()) + 1 > t and not sf.tokens.media:
        sf.problem(
            Severity.WARNING,
            ProblemCode.TOKEN_MISMATCH,
            "body",
            sf.body.offset,
            f"highest cell position {int(pos.max())} is beyond the {t} stored tokens",
        )


def _check_checkpoints(sf: SlotFile) -> None:
    t = sf.n_tokens
    prev = -1
    for ck in sf.checkpoints:
        sec = f"sckp.checkpoint[{ck.index}]"
        if ck.pos_min > ck.pos_max or ck.pos_min < 0:
            sf.problem(
                Severity.ERROR,
                ProblemCode.BAD_POSITION,
                sec,
                ck.offset + 8,
                f"position range {ck.pos_min}..{ck.pos_max}",
            )
        if ck.n_tokens < 0 or (t and ck.n_tokens > t):
            sf.problem(
                Severity.WARNING,
                ProblemCode.TOKEN_MISMATCH,
                sec,
                ck.offset,
                f"n_tokens {ck.n_tokens} is beyond the {t} stored tokens",
            )
        if ck.n_tokens < prev:
            sf.problem(
                Severity.WARNING,
                ProblemCode.CHECKPOINT_ORDER,
                sec,
                ck.offset,
                f"n_tokens {ck.n_tokens} after {prev} (checkpoints are written oldest first)",
            )
        prev = ck.n_tokens
