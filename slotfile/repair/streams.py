"""Rewrite a slot file for another KV stream count, byte for byte.

``llama_kv_cache::state_write`` writes ``u32 n_stream`` and then, per stream, ``u32
cell_count`` and (when non-zero) the stream's cells and rows.  ``state_read`` demands the
reader's own ``n_stream`` ("n_stream mismatch") but restores a single-sequence save into the
stream of the *destination* sequence (``seq_to_stream[seq_id]``), whatever the stream's index
in the file.  So a file whose KV blocks each hold cells in at most one stream converts to any
stream count by writing the new count, that stream's bytes unchanged, and a zero cell count
for every other stream.  Checkpoint and draft blobs carry the same blocks and are rewritten
the same way (their u64 lengths grow or shrink by 4 bytes per stream per KV block).

A file with cells in two streams of one block (a whole-context save) cannot be converted.
"""

from __future__ import annotations

from slotfile.format import grammar as g
from slotfile.format.records import BlobInfo, Body, MemoryKind, SlotFile
from slotfile.repair.common import Refused, body_ok
from slotfile.safewrite import Plan


def _kv_delta(body: Body, n_new: int) -> int:
    return sum(4 * (n_new - blk.n_stream) for blk in body.blocks if blk.kind == MemoryKind.KV)


def _check(body: Body, where: str) -> None:
    for blk in body.blocks:
        if blk.kind == MemoryKind.KV and len(blk.active_streams()) > 1:
            raise Refused(
                f"{where}: {len(blk.active_streams())} streams hold cells; only a single-sequence save "
                "can move to another stream count"
            )


def rewrite_body(plan: Plan, path: str, body: Body, start: int, end: int, n_new: int) -> None:
    """Copy ``start..end`` (a body) with every KV block rewritten for ``n_new`` streams."""
    pos = start
    for blk in body.blocks:
        if blk.kind != MemoryKind.KV:
            continue
        plan.copy(path, pos, blk.offset - pos)
        plan.literal(g.n_stream_word(n_new))
        act = blk.active_streams()
        at = min(act[0].index, n_new - 1) if act else -1  # keep its index where it fits
        for i in range(n_new):
            if i == at:
                st = act[0]
                nxt = [s.offset for s in blk.streams if s.index == st.index + 1]
                st_end = nxt[0] if nxt else blk.end
                plan.copy(path, st.offset, st_end - st.offset)
            else:
                plan.literal(g.n_stream_word(0))  # an empty stream: cell_count 0
        pos = blk.end
    plan.copy(path, pos, end - pos)


def _blob(plan: Plan, path: str, blob: BlobInfo, n_new: int, where: str) -> None:
    """``u64 len`` + ``u32 magic, i32 seq_id`` + body, with the body rewritten."""
    if not blob.length:
        plan.copy(path, blob.offset, 8)
        return
    body = blob.body
    if body is None or body.layout is None:
        raise Refused(f"{where}: the blob's state does not parse, its streams cannot be rewritten")
    _check(body, where)
    plan.literal(g.blob_length(blob.length + _kv_delta(body, n_new)))
    d = blob.data_offset
    plan.copy(path, d, 8)
    rewrite_body(plan, path, body, d + 8, d + blob.length, n_new)


def plan_streams(sf: SlotFile, n_new: int) -> Plan:
    """The whole file for ``n_new`` streams (header, tokens, body, SCKP, SDFT).  Raises
    :class:`Refused` for a damaged file or one with cells in several streams."""
    if not body_ok(sf) or sf.errors:
        raise Refused("the file is damaged; run truncate-recover first")
    assert sf.body is not None
    if not 1 <= n_new <= 256:
        raise Refused(f"{n_new} streams: llama.cpp allows 1 to 256")
    _check(sf.body, "body")
    plan = Plan()
    plan.copy(sf.path, 0, sf.body.offset)
    rewrite_body(plan, sf.path, sf.body, sf.body.offset, sf.body.end, n_new)
    pos = sf.body.end
    if sf.sckp is not None:
        first = sf.checkpoints[0].offset if sf.checkpoints else sf.sckp.end
        plan.copy(sf.path, sf.sckp.offset, first - sf.sckp.offset)
        for ck in sf.checkpoints:
            plan.copy(sf.path, ck.offset, ck.tgt.offset - ck.offset)  # n_tokens, pos_min, pos_max
            _blob(plan, sf.path, ck.tgt, n_new, f"sckp.checkpoint[{ck.index}].data_tgt")
            _blob(plan, sf.path, ck.dft, n_new, f"sckp.checkpoint[{ck.index}].data_dft")
            plan.copy(sf.path, ck.spec.offset, ck.end - ck.spec.offset)
        pos = sf.sckp.end
    if sf.draft is not None:
        d = sf.draft
        if d.dft is None or d.spec is None:
            raise Refused("sdft: incomplete draft appendix")
        plan.copy(sf.path, pos, d.dft.offset - pos)
        _blob(plan, sf.path, d.dft, n_new, "sdft.data_dft")
        plan.copy(sf.path, d.spec.offset, d.end - d.spec.offset)
        pos = d.end
    plan.copy(sf.path, pos, sf.size - pos)
    return plan
