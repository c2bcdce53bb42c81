"""Build files from parsed objects with the same grammars that parsed them.

``serialize(parse(x)) == x`` byte for byte: every parsed section is rebuilt from its
construct Container, and any region the reader could not parse (a damaged tail, trailing
bytes) is carried over verbatim.  Output is a sequence of chunks so a multi-GiB file is
written without being assembled in memory (bulk runs are memoryviews into the source mmap).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any, BinaryIO

from slotfile.format import grammar as g
from slotfile.format.grammar_variant import SlotGrammar
from slotfile.format.records import Body, FileFormat, MemoryKind, SlotFile, TokenForm


def _raw(sf: SlotFile, start: int, end: int) -> memoryview:
    return memoryview(sf.buffer).cast("B")[start:end] if not isinstance(sf.buffer, memoryview) else sf.buffer[start:end]


def body_chunks(body: Body, *, whole: bool = False) -> Iterator[bytes]:
    """The body rebuilt block by block, in the variant it was read as."""
    assert body.layout is not None
    grammar = SlotGrammar.of_layout(body.layout, whole)
    for spec, blk in zip(body.layout.blocks, body.blocks, strict=False):
        out = io.BytesIO()
        if spec.kind == MemoryKind.KV:
            grammar.build_kv(blk.raw, out, spec.has_v)
        else:
            grammar.build_rec(blk.raw, out, spec.n_rec, spec.has_p)
        yield out.getvalue()


def serialize(sf: SlotFile) -> Iterator[bytes | memoryview]:
    """Chunks that make up the file again."""
    if sf.version is None:  # not even a header: nothing was understood
        yield _raw(sf, 0, sf.size)
        return
    yield g.FileHeader.build(
        {
            "magic": g.GGSQ_MAGIC if sf.format == FileFormat.GGSQ else g.GGSN_MAGIC,
            "version": sf.version,
            "n_token_count": sf.n_token_count,
        }
    )
    pos = 12
    tp = sf.tokens
    if tp is not None:
        if tp.form == TokenForm.PACKED and tp.raw is not None:
            yield g.build(g.PackedTokens, tp.raw)
        elif tp.form == TokenForm.PLAIN:
            yield tp.tokens.tobytes()
        else:
            yield _raw(sf, tp.offset, tp.offset + tp.size)
        pos = tp.offset + tp.size
    body = sf.body
    if body is None or body.layout is None:
        yield _raw(sf, pos, sf.size)
        return
    if body.offset > pos:  # the GGSN arch string (and v9 outputs): carried over as read
        yield _raw(sf, pos, body.offset)
    yield from body_chunks(body, whole=sf.format == FileFormat.GGSN)
    pos = body.end
    for app in sorted([a for a in (sf.sckp, sf.draft) if a is not None], key=lambda a: a.offset):
        if not app.complete:
            yield _raw(sf, app.offset, sf.size)
            return
        yield from (_sckp(sf) if app.name == "SCKP" else _sdft(sf))
        pos = app.end
    if pos < sf.size:
        yield _raw(sf, pos, sf.size)


def _blob(b: Any) -> dict[str, Any]:
    return {"length": b.length, "data": b.data}


def _sckp(sf: SlotFile) -> Iterator[bytes]:
    assert sf.sckp is not None
    yield g.build(g.SckpHeader, {"version": sf.sckp.version, "count": sf.sckp.count})
    for c in sf.checkpoints:
        yield g.build(
            g.CheckpointEntry,
            {
                "n_tokens": c.n_tokens,
                "pos_min": c.pos_min,
                "pos_max": c.pos_max,
                "tgt": _blob(c.tgt),
                "dft": _blob(c.dft),
                "spec": _blob(c.spec),
            },
        )


def _sdft(sf: SlotFile) -> Iterator[bytes]:
    assert sf.draft is not None and sf.draft.dft is not None and sf.draft.spec is not None
    yield g.build(g.SdftHeader, {"version": sf.draft.version})
    yield g.build(g.SdftBody, {"dft": _blob(sf.draft.dft), "spec": _blob(sf.draft.spec)})


def to_bytes(sf: SlotFile) -> bytes:
    return b"".join(bytes(c) for c in serialize(sf))


def write(sf: SlotFile, out: BinaryIO) -> int:
    n = 0
    for chunk in serialize(sf):
        out.write(chunk)
        n += len(chunk)
    return n
