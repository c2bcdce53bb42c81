"""The one walker of what follows the body: the SCKP and SDFT appendices and the blob prefix.

Everything is read through the grammars of :mod:`slotfile.format.grammar` over a
:class:`~slotfile.format.grammar.ViewStream`, so every length is checked against the bytes that
remain before anything is touched, and blobs come back as zero-copy views.  The walker only
reports framing: offsets, lengths, counts, what is complete, and where a walk stopped and
why.  What a stop *means* is the caller's business: the reader reports a problem, a repair
decides what to keep, the llama.cpp worker does what the server would do
(:func:`server_read`).

Layouts (see README, "Format reference"): SCKP from PR #26004 (``save_slot_checkpoints`` /
``load_slot_checkpoints``), SDFT from the article in ``shared/reference``; the blob prefix is
``llama_context::state_seq_get_data``'s ``io_magic`` + ``seq_id``.

Cheap to import (the worker imports it before llama.cpp): the grammar module and
construct, nothing that parses bodies.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from construct import ConstructError, Struct

from slotfile.format import grammar as g
from slotfile.format.layout import Failure, failure_of

BLOB_NAMES = ("data_tgt", "data_dft", "data_spec")


# ---------------------------------------------------------------------------------------
# frames
# ---------------------------------------------------------------------------------------


class BlobSpan:
    """Where a ``u64 length`` + bytes blob lies (llama_io_write_i::write_buffer after the
    length written by llama_state_seq_save_file's checkpoint / draft appendix); the
    subclasses say ``offset`` (of the u64 length) and ``length``."""

    __slots__ = ()
    offset: int
    length: int

    @property
    def data_offset(self) -> int:
        return self.offset + 8

    @property
    def end(self) -> int:
        return self.offset + 8 + self.length


@dataclass(frozen=True, slots=True)
class BlobFrame(BlobSpan):
    """A ``u64 length`` + bytes blob; ``data`` is a view of the source, never a copy."""

    offset: int  # of the u64 length
    length: int
    data: g.Run


@dataclass(frozen=True, slots=True)
class EntryFrame:
    """One checkpoint: n_tokens, pos_min, pos_max and its three blobs."""

    index: int
    offset: int
    end: int
    n_tokens: int
    pos_min: int
    pos_max: int
    tgt: BlobFrame
    dft: BlobFrame
    spec: BlobFrame


@dataclass(frozen=True, slots=True)
class Stop:
    """Where an entry walk ended, and why.

    ``why``: ``count`` (the count asked for was read), ``cap`` (MAX_CHECKPOINTS entries),
    ``eof``, ``sdft`` (an SDFT magic, or the start of one cut short, at ``offset``) or
    ``damaged`` (entry ``index`` does not fit: ``failure`` says where and why).
    For ``damaged``: ``blob`` names the blob that does not fit ('' for the entry head),
    ``declared`` is its declared length when the length field itself is whole (``left`` bytes
    followed it), and ``cut_n_tokens`` the entry's n_tokens when its first 8 bytes are there.
    """

    offset: int
    why: str
    index: int
    failure: Failure | None = None
    blob: str = ""
    declared: int | None = None
    left: int | None = None
    cut_n_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class SckpHead:
    offset: int
    magic: bytes
    version: int
    count: int

    @property
    def magic_ok(self) -> bool:
        return self.magic == g.SCKP_MAGIC

    @property
    def end(self) -> int:
        return self.offset + 12


@dataclass(frozen=True, slots=True)
class SdftHead:
    offset: int
    version: int

    @property
    def end(self) -> int:
        return self.offset + 8


@dataclass(frozen=True, slots=True)
class SdftFrame:
    offset: int
    version: int
    dft: BlobFrame
    spec: BlobFrame

    @property
    def end(self) -> int:
        return self.spec.end


# ---------------------------------------------------------------------------------------
# magics
# ---------------------------------------------------------------------------------------


def _end(view: Any, end: int | None) -> int:
    return len(view) if end is None else end


def magic_at(view: Any, off: int, end: int | None = None) -> bytes | None:
    """``SCKP_MAGIC`` or ``SDFT_MAGIC`` when a whole one starts at ``off``."""
    head = bytes(view[off : min(off + 4, _end(view, end))])
    return head if head in (g.SCKP_MAGIC, g.SDFT_MAGIC) else None


def cut_magics(view: Any, off: int, end: int | None = None) -> tuple[bytes, ...]:
    """The magics the 1-3 bytes left at ``off`` are the start of (a file cut inside one)."""
    head = bytes(view[off : min(off + 4, _end(view, end))])
    if not 0 < len(head) < 4:
        return ()
    return tuple(m for m in (g.SCKP_MAGIC, g.SDFT_MAGIC) if m.startswith(head))


def starts_with(view: Any, off: int, magic: bytes, end: int | None = None) -> bool:
    """A whole ``magic`` at ``off``, or the file ends inside one."""
    head = bytes(view[off : min(off + 4, _end(view, end))])
    return head == magic or (0 < len(head) < 4 and magic.startswith(head))


# ---------------------------------------------------------------------------------------
# SCKP
# ---------------------------------------------------------------------------------------


def sckp_head(view: Any, off: int, end: int | None = None, *, any_magic: bool = False) -> SckpHead | Failure:
    """The 12-byte SCKP header at ``off`` (``any_magic``: whatever its first 4 bytes say)."""
    s = g.ViewStream(view, off, _end(view, end))
    try:
        h = (g.SckpHeaderAnyMagic if any_magic else g.SckpHeader).parse_stream(s)
    except ConstructError as e:
        return failure_of(e, s)
    return SckpHead(off, bytes(h.magic), int(h.version), int(h.count))


def _blob(c: Any) -> BlobFrame:
    return BlobFrame(int(c.offset), int(c.length), c.data)


def _entry_stop(view: Any, p: int, end: int, index: int, e: ConstructError, s: g.ViewStream) -> Stop:
    f = failure_of(e, s)
    blob = f.loc.rsplit(".", 1)[-1] if f.loc.rsplit(".", 1)[-1] in BLOB_NAMES else ""
    declared = left = None
    if blob and isinstance(e, g.FormatError):  # the length field is whole; its bytes are not
        declared = int(g.BlobLength.parse(bytes(view[f.offset - 8 : f.offset])))
        left = end - f.offset
    cut = int(g.NTokens.parse(bytes(view[p : p + 8]))) if end - p >= 8 else None
    return Stop(p, "damaged", index, f, blob, declared, left, cut)


def entries(
    view: Any, start: int, end: int | None = None, *, count: int | None = None, stop_at_sdft: bool = False
) -> Iterator[EntryFrame | Stop]:
    """Checkpoint entries from ``start``; the last item is always a :class:`Stop`.

    ``count``: read exactly that many (the server's way).  ``None``: read until EOF, an SDFT
    magic (``stop_at_sdft``), damage or MAX_CHECKPOINTS entries, whatever the header says.
    """
    end = _end(view, end)
    limit = g.MAX_CHECKPOINTS if count is None else count
    p, i = start, 0
    while True:
        if i >= limit:
            yield Stop(p, "count" if count is not None else "cap", i)
            return
        if count is None and p >= end:
            yield Stop(p, "eof", i)
            return
        if stop_at_sdft and starts_with(view, p, g.SDFT_MAGIC, end):
            yield Stop(p, "sdft", i)
            return
        fast = entry_fast(view, p, end, i)
        if fast is not None:
            yield fast
            p, i = fast.end, i + 1
            continue
        s = g.ViewStream(view, p, end)
        s.loc = [f"checkpoint[{i}]"]
        try:
            c = g.CheckpointEntry.parse_stream(s)
        except ConstructError as e:
            yield _entry_stop(view, p, end, i, e, s)
            return
        yield EntryFrame(
            i, p, int(c.end), int(c.n_tokens), int(c.pos_min), int(c.pos_max), _blob(c.tgt), _blob(c.dft), _blob(c.spec)
        )
        p, i = int(c.end), i + 1


_CKPT_HEAD = g.fixed_reader(g.CheckpointHead)  # n_tokens, pos_min, pos_max: the grammar's own fields
_BLOB_LENGTH = g.fixed_reader(g.BlobLength)


def entry_fast(view: Any, p: int, end: int, index: int) -> EntryFrame | None:
    """What ``CheckpointEntry`` reads at ``p`` when the entry is whole (its head and three
    blobs within ``end``), read with struct: a directory of checkpointed files reads thousands
    of them.  None for anything else: the grammar reads it, and says what is wrong."""
    if p + _CKPT_HEAD.size > end:
        return None
    n_tokens, pos_min, pos_max = _CKPT_HEAD.unpack_from(view, p)
    mv = view if isinstance(view, memoryview) else memoryview(view).cast("B")  # as ViewStream holds it
    at, blobs = p + _CKPT_HEAD.size, []
    for _ in range(3):  # data_tgt, data_dft, data_spec
        if at + _BLOB_LENGTH.size > end:
            return None
        (n,) = _BLOB_LENGTH.unpack_from(view, at)
        data = at + _BLOB_LENGTH.size
        if n > end - data:
            return None
        blobs.append(BlobFrame(at, n, g.Run(data, n, mv[data : data + n])))
        at = data + n
    return EntryFrame(index, p, at, n_tokens, pos_min, pos_max, *blobs)


# ---------------------------------------------------------------------------------------
# SDFT
# ---------------------------------------------------------------------------------------


def sdft_head(view: Any, off: int, end: int | None = None) -> SdftHead | Failure:
    s = g.ViewStream(view, off, _end(view, end))
    try:
        h = g.SdftHeader.parse_stream(s)
    except ConstructError as e:
        return failure_of(e, s)
    return SdftHead(off, int(h.version))


def sdft_body(view: Any, head: SdftHead, end: int | None = None) -> SdftFrame | Failure:
    """data_dft and data_spec after a version-1 header."""
    s = g.ViewStream(view, head.end, _end(view, end))
    try:
        b = g.SdftBody.parse_stream(s)
    except ConstructError as e:
        return failure_of(e, s)
    return SdftFrame(head.offset, head.version, _blob(b.dft), _blob(b.spec))


def first_blob(view: Any, off: int, end: int | None = None) -> BlobFrame | Stop:
    """One ``u64 length`` + bytes blob at ``off`` (the SDFT's data_dft, read alone)."""
    end = _end(view, end)
    s = g.ViewStream(view, off, end)
    s.loc = ["data_dft"]
    try:
        return _blob(g.Blob.parse_stream(s))
    except ConstructError as e:
        f = failure_of(e, s)
        if isinstance(e, g.FormatError):
            return Stop(
                off,
                "damaged",
                0,
                f,
                "data_dft",
                int(g.BlobLength.parse(bytes(view[f.offset - 8 : f.offset]))),
                end - f.offset,
            )
        return Stop(off, "damaged", 0, f, "data_dft")


# ---------------------------------------------------------------------------------------
# the blob prefix
# ---------------------------------------------------------------------------------------


# io_magic, seq_id: the grammar's named fields (its Ensure left out) at struct's speed
_SEQ_PREFIX = g.fixed_reader(Struct(*(f for f in g.SeqBlobPrefix.subcons if getattr(f, "name", None))))


def seq_id_fast(view: Any, start: int, end: int) -> int | None:
    """``SeqBlobPrefix``'s seq_id read with struct when its one check (the magic) passes; None
    otherwise (the grammar says why)."""
    if end - start < _SEQ_PREFIX.size:
        return None
    magic, seq_id = _SEQ_PREFIX.unpack_from(view, start)
    return int(seq_id) if magic == g.IO_MAGIC else None


def blob_seq_id(view: Any, start: int, end: int) -> int | Failure:
    """The ``io_magic`` + ``seq_id`` prefix of a ``state_seq_get_data`` blob in ``start..end``:
    the seq_id, or why the prefix is not there."""
    fast = seq_id_fast(view, start, end)
    if fast is not None:
        return fast
    s = g.ViewStream(view, start, end)
    try:
        return int(g.SeqBlobPrefix.parse_stream(s).seq_id)
    except ConstructError as e:
        return failure_of(e, s)


# ---------------------------------------------------------------------------------------
# the server's reading (the llama.cpp worker's test-load)
# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class ServerRead:
    """What a patched server restores after the body.

    ``checkpoints``: ``(data_tgt, data_dft)`` views per checkpoint, ``[]`` when the appendix is
    there but dropped, ``None`` when there is none.  ``draft``: the SDFT data_dft view (may be
    empty), ``None`` without a usable SDFT.  The notes say why something is dropped.
    """

    checkpoints: list[tuple[Any, Any]] | None = None
    sckp_note: str = ""
    draft: Any = None
    sdft_note: str = ""

    def astuple(self) -> tuple[list[tuple[Any, Any]] | None, str, Any, str]:
        return self.checkpoints, self.sckp_note, self.draft, self.sdft_note


def _server_sckp(view: Any, off: int, end: int) -> tuple[list[tuple[Any, Any]] | None, str, int]:
    """load_slot_checkpoints: any damage drops the whole appendix.  Returns (checkpoints,
    note, where the SDFT may start; -1 when the walk gave up)."""
    h = sckp_head(view, off, end)
    if isinstance(h, Failure):
        return [], "SCKP header truncated: the server ignores the appendix", -1
    if h.version != g.SCKP_VERSION:
        return [], f"SCKP version {h.version}: the server ignores the appendix", -1
    if h.count > g.MAX_CHECKPOINTS:
        return [], f"SCKP count {h.count} over {g.MAX_CHECKPOINTS}: the server drops the appendix", -1
    items: list[tuple[Any, Any]] = []
    for it in entries(view, h.end, end, count=h.count):
        if isinstance(it, Stop):
            if it.why == "count":
                return items, "", it.offset
            if it.declared is not None:
                return (
                    [],
                    (
                        f"checkpoint {it.index} of {h.count}: {it.blob} length {it.declared} exceeds the "
                        f"{it.left} bytes left: the server drops the whole appendix"
                    ),
                    -1,
                )
            return [], f"checkpoint {it.index} of {h.count} truncated: the server drops the whole appendix", -1
        if not it.tgt.length:
            return [], f"checkpoint {it.index} has an empty data_tgt: the server drops the whole appendix", -1
        items.append((it.tgt.data.view, it.dft.data.view))
    raise AssertionError("an entry walk always ends with a Stop")


def _server_sdft(view: Any, off: int, end: int) -> tuple[Any, str]:
    h = sdft_head(view, off, end)
    if isinstance(h, Failure):
        return None, "SDFT header truncated: the draft state is dropped"
    if h.version != g.SDFT_VERSION:
        return None, f"SDFT version {h.version}: the draft state is dropped"
    b = first_blob(view, h.end, end)
    if isinstance(b, Stop):
        if b.declared is not None:
            return None, (
                f"SDFT data_dft length {b.declared} exceeds the {b.left} bytes left: the draft state is dropped"
            )
        return None, "SDFT header truncated: the draft state is dropped"
    return b.data.view, ""


def server_read(view: Any, off: int = 0) -> ServerRead:
    """The SCKP and SDFT appendices from ``off`` the way the (patched) server reads them:
    checkpoints exactly ``count`` of them, all or none; then an SDFT right after them (or
    right after the body), whose data_dft is read alone."""
    end = len(view)
    out = ServerRead()
    if magic_at(view, off, end) == g.SCKP_MAGIC:
        out.checkpoints, out.sckp_note, off = _server_sckp(view, off, end)
        if off < 0:
            return out
    if magic_at(view, off, end) == g.SDFT_MAGIC:
        out.draft, out.sdft_note = _server_sdft(view, off, end)
    return out
