"""The context settings that mirror the one that saved a file (slot-format.md §10, facts.md):
``n_seq_max`` = the file's ``n_stream`` with a non-unified cache, a unified cache when one stream
served several slots, flash attention on exactly when ``v_trans == 0``, and the same K/V cache
types, all read from the parsed body."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slotfile.format.magics import FileFormat, MemoryKind
from slotfile.format.types import BY_NAME
from slotfile.llama.worker.settings import LoadSettings, pad_ctx

if TYPE_CHECKING:  # the reader (numpy, construct) is imported only where a file is opened, so
    # that a command can start its workers before its own heavy imports (see LoaderPool.start)
    from slotfile.format.reader import Body, MemoryBlock, SlotFile

F16 = BY_NAME["f16"].id


def _first_active_kv(blocks: list[MemoryBlock]) -> Any:
    for b in blocks:
        if b.kind == MemoryKind.KV:
            for st in b.active_streams():
                if st.k or st.v:
                    return b, st
    return None, None


LLAMA_MAX_SEQ = 256  # llama.cpp refuses contexts with more sequences
UNREADABLE_CAP = 1 << 18  # cells to make room for when the body cannot be read
SERVER_SLOTS = 4  # llama-server's default: --parallel auto = 4 slots with a unified KV cache


def _derive(
    blocks: list[MemoryBlock], *, whole: bool, need: int, seq_hint: int | None, n_gpu_layers: int
) -> LoadSettings:
    kv = [b for b in blocks if b.kind == MemoryKind.KV]
    rec = [b for b in blocks if b.kind == MemoryKind.REC]
    n_stream = max((b.n_stream for b in kv), default=1) or 1
    seq_ids: list[int] = []
    for b in kv:
        for st in b.active_streams():
            if st.cells is not None and st.cells.seq_ids.size:
                seq_ids += [int(x) for x in set(st.cells.seq_ids.tolist())]
            need = max(need, st.cell_count)  # cells, never positions: those need no room
    for b in rec:
        if b.cells is not None and b.cell_count and b.cells.seq_ids.size:
            seq_ids += [int(x) for x in set(b.cells.seq_ids.tolist())]
    seq_ids = [s for s in seq_ids if 0 <= s < LLAMA_MAX_SEQ]  # the loader ignores stored ids anyway
    _, st = _first_active_kv(blocks)
    if st is not None:
        flash = st.v_trans == 0
        type_k = st.k[0].type_id if st.k else F16
        type_v = st.v[0].type_id if st.v else type_k
    else:  # recurrent-only, empty or unreadable: nothing in the state depends on these
        flash, type_k, type_v = False, F16, F16
    # the recurrent memory has one cell per sequence (n_seq_max cells): room for the file's
    n_rec_cells = max((b.cell_count for b in rec), default=0)
    if whole:
        seq = 0
        n_seq = max(max(seq_ids, default=0) + 1, n_rec_cells, 1)
    else:
        ok_hint = seq_hint is not None and 0 <= seq_hint < LLAMA_MAX_SEQ
        seq = seq_hint if ok_hint else (min(seq_ids) if seq_ids else 0)  # type: ignore[assignment]
        n_seq = max(1, seq + 1, n_rec_cells)
    if n_stream > 1:
        # non-unified: one stream per slot; a single-sequence save fills only its own stream,
        # and n_seq_max must equal n_stream ("n_stream mismatch" otherwise)
        unified, n_seq = False, n_stream
        act = [s.index for b in kv for s in b.active_streams()]
        if act and not whole:
            seq = act[0]
    else:
        unified = True
        if not kv:  # no n_stream in the file to mirror: llama-server's default slot count
            n_seq = max(n_seq, SERVER_SLOTS)
    need += 1  # room for the probe token of the deep check
    n_ctx = pad_ctx(need) * (n_stream if n_stream > 1 else 1)
    return LoadSettings(
        n_ctx=n_ctx,
        n_seq_max=n_seq,
        kv_unified=unified,
        flash_attn=flash,
        type_k=type_k,
        type_v=type_v,
        n_gpu_layers=n_gpu_layers,
        seq_id=seq,
    )


def _blocks(body: Body | None) -> list[MemoryBlock]:
    return list(body.blocks) if body is not None and body.layout is not None else []


def _saved_seq(sf: SlotFile) -> int | None:
    _, st = _first_active_kv(_blocks(sf.body))
    if st is not None and st.cells is not None and st.cells.seq_ids.size:
        return int(st.cells.seq_ids[0])
    return None


def settings_for(sf: SlotFile, n_gpu_layers: int = 0) -> LoadSettings:
    """The context settings that mirror the one that saved ``sf``.

    * ``n_ctx``: room for every cell of the body and of every checkpoint blob (and one more,
      for the deep check's probe), padded to 256, times ``n_stream`` for a non-unified cache;
    * ``n_seq_max``: the file's ``n_stream`` when it is above 1 (non-unified cache, the saved
      sequence in its own stream); with one stream a unified cache and ``saved seq_id + 1``;
      at least the recurrent cell count (one cell per sequence);
    * ``flash_attn``: on exactly when ``v_trans == 0``; ``type_k``/``type_v``: the K/V type ids;
    * bodies with no KV block (recurrent-only, empty, unreadable) carry no ``n_stream``: the
      llama-server default (4 slots, unified cache), f16, flash attention off (nothing in such
      a state depends on the last three).
    """
    blocks = _blocks(sf.body)
    # Room is sized from what the file proves it holds (cells, each backed by its rows), never
    # from numbers a damaged file can inflate for free (positions, checkpoint n_tokens): a
    # context sized from those could ask for terabytes.  An unreadable body falls back to the
    # token count, capped.
    need = 0 if blocks else min(max(sf.n_tokens, 0), UNREADABLE_CAP)
    s = _derive(
        blocks, whole=sf.format == FileFormat.GGSN, need=need, seq_hint=_saved_seq(sf), n_gpu_layers=n_gpu_layers
    )
    # a checkpoint blob may hold more cells than the body (an older, longer prompt)
    extra = 0
    for ck in sf.checkpoints:
        if ck.tgt.body is not None:
            for b in _blocks(ck.tgt.body):
                for st in b.active_streams() if b.kind == MemoryKind.KV else []:
                    extra = max(extra, st.cell_count + 1)
    if extra > s.n_ctx_seq:
        extra = pad_ctx(extra)
        s = LoadSettings(
            extra * s.n_stream, s.n_seq_max, s.kv_unified, s.flash_attn, s.type_k, s.type_v, s.n_gpu_layers, s.seq_id
        )
    return s


def draft_settings_for(sf: SlotFile, n_gpu_layers: int = 0) -> LoadSettings | None:
    """Settings for the draft context, from the SDFT ``data_dft`` (or a checkpoint's
    ``data_dft``); None when the file holds no draft state."""
    blobs = []
    if sf.draft is not None and sf.draft.dft is not None and sf.draft.dft.length:
        blobs.append(sf.draft.dft)
    blobs += [ck.dft for ck in sf.checkpoints if ck.dft.length]
    if not blobs:
        return None
    for blob in blobs:
        if blob.body is not None and blob.body.layout is not None:
            return _derive(_blocks(blob.body), whole=False, need=0, seq_hint=blob.seq_id, n_gpu_layers=n_gpu_layers)
    t = settings_for(sf, n_gpu_layers)
    return LoadSettings(t.n_ctx, t.n_seq_max, t.kv_unified, t.flash_attn, F16, F16, n_gpu_layers, t.seq_id)
