"""Headers and settings of two files, field by field: format and version, token form, memory
class and layout, per KV stream cells, ``v_trans``, layer count, cache types and rotation words,
per REC block cells and types, the appendices' presence.

State version 4 (session 11) differs from 3 (10) only by the two rotation words after ``n_layer``
in every KV stream (``llama_kv_cache::state_write_data``, src/llama-kv-cache.cpp of 2026-10-06;
slot-format.md §12.1): a version word of 3 against 4 and rotation words one file lacks are marked
``rotation`` so that a file and its ``migrate`` come out "identical but for the rotation words".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from slotfile.diff.report import FieldDiff
from slotfile.format.records import Body, KVStream, LayerRun, MemoryBlock, MemoryKind, SlotFile
from slotfile.format.versions import version_info


def types_of(runs: list[LayerRun]) -> str | None:
    """The cache types of a part's layers, compact: ``f16`` or ``q8_0 x30, f16 x2``."""
    if not runs:
        return None
    c = Counter(r.type_name for r in runs)
    if len(c) == 1:
        return next(iter(c))
    return ", ".join(f"{t} x{n}" for t, n in c.items())


def active(block: MemoryBlock) -> list[int]:
    return [s.index for s in block.streams if s.cell_count]


def pair_streams(ba: MemoryBlock, bb: MemoryBlock) -> list[tuple[KVStream | None, KVStream | None]]:
    """The KV streams to compare: the one non-empty stream of each file when each has exactly one
    (a slot saved from another slot of a non-unified cache lands in another stream, and the
    loader puts it into the destination's stream anyway: ``state_read``), else stream by stream."""
    aa, ab = active(ba), active(bb)
    if len(aa) == 1 and len(ab) == 1:
        return [(ba.streams[aa[0]], bb.streams[ab[0]])]
    n = max(len(ba.streams), len(bb.streams))
    return [
        (ba.streams[i] if i < len(ba.streams) else None, bb.streams[i] if i < len(bb.streams) else None)
        for i in range(n)
    ]


def _ext(st: KVStream | None) -> int | None:
    if st is None or st.cells is None:
        return None
    names = st.cells.cells.dtype.names or ()
    return 12 if "tok" in names else 8 if "x" in names else 0


def _stream_fields(sec: str, sa: KVStream | None, sb: KVStream | None, rot_step: bool) -> Iterator[FieldDiff]:
    def get(st: KVStream | None, name: str) -> Any:
        return getattr(st, name) if st is not None else None

    yield FieldDiff(sec, "cells", get(sa, "cell_count"), get(sb, "cell_count"))
    if not (get(sa, "cell_count") or get(sb, "cell_count")):
        return  # an empty stream writes nothing past its cell count
    yield FieldDiff(sec, "v_trans", get(sa, "v_trans"), get(sb, "v_trans"))
    yield FieldDiff(sec, "n_layer", get(sa, "n_layer"), get(sb, "n_layer"))
    yield FieldDiff(sec, "cell ext", _ext(sa), _ext(sb))
    yield FieldDiff(sec, "K types", types_of(sa.k) if sa else None, types_of(sb.k) if sb else None)
    yield FieldDiff(sec, "V types", types_of(sa.v) if sa else None, types_of(sb.v) if sb else None)
    for name in ("n_rot_k", "n_rot_v"):
        va, vb = get(sa, name), get(sb, name)
        # absent on one side only: written by version 4, not by 3 (the file's version says which)
        yield FieldDiff(sec, name, va, vb, rotation=rot_step and (va is None) != (vb is None))


def block_fields(prefix: str, ba: MemoryBlock | None, bb: MemoryBlock | None, rot_step: bool) -> Iterator[FieldDiff]:
    """The settings of one memory block of each file (None: that file has no such block)."""
    one = ba if ba is not None else bb
    role = one.role if one is not None else "?"
    sec = f"{prefix}.{role}"
    yield FieldDiff(sec, "kind", str(ba.kind) if ba else None, str(bb.kind) if bb else None)
    if ba is None or bb is None or ba.kind != bb.kind:
        return
    if ba.kind == MemoryKind.KV:
        yield FieldDiff(sec, "n_stream", ba.n_stream, bb.n_stream)
        yield FieldDiff(sec, "active streams", active(ba), active(bb))
        for sa, sb in pair_streams(ba, bb):
            idx = sa.index if sa is not None else sb.index if sb is not None else 0
            yield from _stream_fields(f"{sec}.stream[{idx}]", sa, sb, rot_step)
    else:
        yield FieldDiff(sec, "cells", ba.cell_count, bb.cell_count)
        yield FieldDiff(sec, "n_layer", ba.n_layer, bb.n_layer)
        yield FieldDiff(sec, "R types", types_of(ba.r), types_of(bb.r))
        yield FieldDiff(sec, "S types", types_of(ba.s), types_of(bb.s))
        if ba.p or bb.p:
            yield FieldDiff(sec, "P types", types_of(ba.p), types_of(bb.p))


def body_fields(prefix: str, a: Body | None, b: Body | None, rot_step: bool) -> Iterator[FieldDiff]:
    """Memory class, layout and every block's settings of two bodies (or blob bodies)."""
    yield FieldDiff(prefix, "memory class", a.memory_class if a else None, b.memory_class if b else None)
    la = a.layout.describe() if a is not None and a.layout is not None else None
    lb = b.layout.describe() if b is not None and b.layout is not None else None
    yield FieldDiff(prefix, "layout", la, lb)
    if a is None or b is None or a.layout is None or b.layout is None:
        return
    n = max(len(a.blocks), len(b.blocks))
    for i in range(n):
        ba = a.blocks[i] if i < len(a.blocks) else None
        bb = b.blocks[i] if i < len(b.blocks) else None
        yield from block_fields(prefix, ba, bb, rot_step)


def blob_rotation_fields(prefix: str, a: Body | None, b: Body | None, rot_step: bool) -> Iterator[FieldDiff]:
    """The rotation words of a checkpoint or draft blob's KV streams (a blob is a
    ``llama_state_seq_get_data_ext`` state: version 4 writes them there too); its other
    settings show in its cells and layers."""
    if a is None or b is None or a.layout is None or b.layout is None:
        return
    for ba, bb in zip(a.blocks, b.blocks, strict=False):
        if ba.kind != MemoryKind.KV or bb.kind != MemoryKind.KV:
            continue
        for sa, sb in pair_streams(ba, bb):
            if sa is None or sb is None or not (sa.cell_count or sb.cell_count):
                continue
            sec = f"{prefix}.{ba.role}.stream[{sa.index}]"
            for name in ("n_rot_k", "n_rot_v"):
                va, vb = getattr(sa, name), getattr(sb, name)
                yield FieldDiff(sec, name, va, vb, rotation=rot_step and (va is None) != (vb is None))


def rotation_step(a: SlotFile, b: SlotFile) -> bool:
    """Whether one file's version has the rotation words and the other's not (GGSQ 3/4, GGSN
    10/11: slotfile.format.versions, the one table of what each version holds)."""
    if a.format != b.format:
        return False
    va, vb = version_info(a.format, a.version), version_info(b.format, b.version)
    return va is not None and vb is not None and va.rotation_words != vb.rotation_words


def compare_headers(a: SlotFile, b: SlotFile) -> list[FieldDiff]:
    """Header and settings fields of the two files, in file order."""
    step = rotation_step(a, b)
    out = [
        FieldDiff("header", "format", str(a.format), str(b.format)),
        FieldDiff("header", "version", a.version, b.version, rotation=step),
    ]
    fa = str(a.tokens.form) if a.tokens is not None else None
    fb = str(b.tokens.form) if b.tokens is not None else None
    out.append(FieldDiff("tokens", "form", fa, fb))
    if a.arch is not None or b.arch is not None:
        out.append(FieldDiff("header", "arch", a.arch, b.arch))
    out += body_fields("body", a.body, b.body, step)
    out.append(
        FieldDiff(
            "sckp",
            "present",
            a.sckp is not None,
            b.sckp is not None,
        )
    )
    if a.sckp is not None and b.sckp is not None:
        out.append(FieldDiff("sckp", "version", a.sckp.version, b.sckp.version))
        out.append(FieldDiff("sckp", "count", a.sckp.count, b.sckp.count))
    out.append(FieldDiff("sdft", "present", a.draft is not None, b.draft is not None))
    if a.draft is not None and b.draft is not None:
        out.append(FieldDiff("sdft", "version", a.draft.version, b.draft.version))
    return out
