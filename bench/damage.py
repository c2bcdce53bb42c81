"""A seeded generator of damaged slot files for the detection-power benchmark (issue 25 item 4).

Every kind of damage lands in the bytes a recompute is supposed to judge: the K/V/R/S rows of
the body (found with slotfile's own parser, :func:`slotfile.format.reader.open_slot_file`),
the stored token ids, or the rows inside an SCKP checkpoint's ``data_tgt`` blob.  A
:class:`Case` is a list of byte edits plus where they landed (block, part, layer, type, V
layout) and the seed it came from; :func:`write_damaged` applies it to a *copy* (the source
is only ever opened read-only).

Kinds (``size``: bytes for spans, the factor for ``row-scale``, ``-`` otherwise):

* ``flip-sign`` / ``flip-exponent`` / ``flip-mantissa``: one bit of one element (f16/f32/bf16)
  or of one block's f16 scale ``d`` (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl); ``flip-quant``: one bit of
  one q8_0/q4_0 quant.  Each records ``delta``: how far the flip moved the block's or the
  element's dequantized values (max abs), for comparison with the layer's noise.
* ``zero-span`` / ``random-span`` of 16 B, 512 B, 4 KiB, 64 KiB: at a random offset of the body's
  row data taken as one byte space (the run headers between layers are skipped, never touched).
* ``row-scale`` x2 / x1.1: every element of one cell's row in one layer (quantized: every
  block scale of the row).
* ``cell-swap``: the rows of two cells of one layer exchanged; ``kv-swap``: one layer's K and V
  rows exchanged (same byte length); ``layer-swap``: two layers' K (and V) rows exchanged.
* ``token``: one stored token id replaced by another id the file holds.
* ``ckpt-span`` (random bytes) / ``ckpt-zero-span`` of 16 B, 512 B, 4 KiB, ``ckpt-flip-sign`` /
  ``ckpt-flip-exponent`` / ``ckpt-flip-quant``, ``ckpt-cell-swap``, ``ckpt-kv-swap``,
  ``ckpt-layer-swap``: the same damage inside the rows of the checkpoints' ``data_tgt`` blobs
  (a swap stays inside one blob), which ``verify --deep`` judges against their recompute.
"""

from __future__ import annotations

import dataclasses
import shutil
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slotfile.format.reader import open_slot_file
from slotfile.format.records import Body, LayerRun, MemoryKind, SlotFile
from slotfile.format.types import TYPES, TypeId, type_name

SPAN_SIZES = (16, 512, 4096, 65536)
KINDS: dict[str, tuple[str, ...]] = {
    "flip-sign": ("-",),
    "flip-exponent": ("-",),
    "flip-mantissa": ("-",),
    "flip-quant": ("-",),
    "zero-span": tuple(str(s) for s in SPAN_SIZES),
    "random-span": tuple(str(s) for s in SPAN_SIZES),
    "row-scale": ("x2", "x1.1"),
    "cell-swap": ("-",),
    "kv-swap": ("-",),
    "layer-swap": ("-",),
    "token": ("-",),
    "ckpt-span": ("16", "512", "4096"),
    "ckpt-zero-span": ("16", "512", "4096"),
    "ckpt-flip-sign": ("-",),
    "ckpt-flip-exponent": ("-",),
    "ckpt-flip-quant": ("-",),
    "ckpt-cell-swap": ("-",),
    "ckpt-kv-swap": ("-",),
    "ckpt-layer-swap": ("-",),
}
# bit positions per float type: (sign, exponent bits, mantissa bits) of IEEE half/single/bfloat16
FLOAT_BITS: dict[int, tuple[int, range, range]] = {
    TypeId.F16: (15, range(10, 15), range(0, 10)),
    TypeId.F32: (31, range(23, 31), range(0, 23)),
    TypeId.BF16: (15, range(7, 15), range(0, 7)),
}
# quantized types whose blocks start with an f16 scale d (ggml-common.h block_q8_0, block_q4_0, ...)
SCALED_QUANTS = (TypeId.Q8_0, TypeId.Q4_0, TypeId.Q4_1, TypeId.Q5_0, TypeId.Q5_1, TypeId.IQ4_NL)
PLAIN_QUANTS = (TypeId.Q8_0, TypeId.Q4_0)  # every byte after d is quants


@dataclass(frozen=True)
class Target:
    """One layer's rows of one tensor: where they lie in the file and what they hold."""

    region: str  # "body" or "sckp[i]"
    block: str
    stream: int | None
    part: str
    layer: int
    type_id: int
    row_size: int
    n_cells: int
    transposed: bool
    offset: int
    length: int

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    def describe(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["type"] = self.type_name
        return d


@dataclass
class Case:
    """One damaged copy: its edits (file offset, new bytes) and where they landed."""

    kind: str
    size: str
    source: str
    seed: int
    index: int
    edits: list[tuple[int, bytes]] = field(default_factory=list)
    where: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{Path(self.source).stem}.{self.kind}-{self.size}.{self.index}"

    def ranges(self) -> list[tuple[int, int]]:
        """The (offset, length) of every edit."""
        return [(o, len(b)) for o, b in self.edits]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "size": self.size,
            "file": self.source,
            "seed": self.seed,
            "index": self.index,
            "bytes_changed": sum(len(b) for _o, b in self.edits),
            "first_offset": min((o for o, _b in self.edits), default=None),
            **self.where,
        }


def _targets_of(body: Body | None, region: str) -> Iterator[Target]:
    if body is None:
        return
    for blk in body.blocks:
        if blk.kind == MemoryKind.KV:
            for st in blk.streams:
                for run in (*st.k, *st.v):
                    yield _target(region, blk.role, st.index, run)
        else:
            for run in blk.runs():
                yield _target(region, blk.role, None, run)


def _target(region: str, block: str, stream: int | None, r: LayerRun) -> Target:
    return Target(
        region,
        block,
        stream,
        r.part,
        r.index,
        r.type_id,
        r.row_size,
        r.n_cells,
        r.transposed,
        r.data.offset,
        r.data.length,
    )


def body_targets(sf: SlotFile) -> list[Target]:
    """Every non-empty K/V/R/S run of the body."""
    return [t for t in _targets_of(sf.body, "body") if t.length > 0 and t.n_cells > 0]


def checkpoint_targets(sf: SlotFile) -> list[Target]:
    """Every non-empty run inside the checkpoints' ``data_tgt`` blobs (absolute file offsets)."""
    out: list[Target] = []
    for ck in sf.checkpoints:
        out += [t for t in _targets_of(ck.tgt.body, f"sckp[{ck.index}]") if t.length > 0 and t.n_cells > 0]
    return out


def allowed_ranges(sf: SlotFile) -> list[tuple[int, int]]:
    """Every byte range a case may touch: the row data of the body and the checkpoints, and the token ids."""
    rngs = [(t.offset, t.length) for t in (*body_targets(sf), *checkpoint_targets(sf))]
    if sf.tokens is not None:
        rngs.append((sf.tokens.ids_offset, 4 * int(sf.tokens.tokens.size)))
    return rngs


def case_rng(seed: int, source: str, kind: str, size: str, index: int) -> np.random.Generator:
    """The generator of one case: a function of the seed, the file's name and folder (v3-native/x.bin and
    v4-native/x.bin get different damage), the kind, size and index only."""
    p = Path(source)
    return np.random.default_rng([seed, zlib.crc32(f"{p.parent.name}/{p.name}|{kind}|{size}|{index}".encode())])


def _pick_weighted(rng: np.random.Generator, targets: list[Target]) -> Target:
    """A target chosen with probability proportional to its byte length (a uniform byte of the data)."""
    w = np.array([t.length for t in targets], dtype=np.float64)
    return targets[int(rng.choice(len(targets), p=w / w.sum()))]


def _dequant(type_id: int, raw: bytes) -> np.ndarray:
    """Values of one element (float types) or one block (quantized types) as float64."""
    if type_id == TypeId.BF16:
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if type_id in (TypeId.F16, TypeId.F32):
        return np.frombuffer(raw, "<f2" if type_id == TypeId.F16 else "<f4").astype(np.float64)
    import gguf.quants as gq
    from gguf import GGMLQuantizationType

    return gq.dequantize(np.frombuffer(raw, np.uint8).reshape(1, -1), GGMLQuantizationType(type_id)).astype(np.float64)


def _delta(type_id: int, old: bytes, new: bytes) -> tuple[float, float]:
    """(max |new - old|, max |old|) over the element's or block's dequantized values (inf: not finite)."""
    a, b = _dequant(type_id, old), _dequant(type_id, new)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(b - a)
    dm = float(np.max(d)) if np.all(np.isfinite(d)) else float("inf")
    return dm, float(np.max(np.abs(a)))


def _flip(
    sf: SlotFile, rng: np.random.Generator, kind: str, rows: list[Target]
) -> tuple[list[tuple[int, bytes]], dict[str, Any]] | str:
    """One bit flipped in ``rows``: in an element (float types) or a block's scale d / a quant (quantized)."""
    quant = kind == "flip-quant"
    ok = PLAIN_QUANTS if quant else (*FLOAT_BITS, *SCALED_QUANTS)
    targets = [t for t in rows if t.type_id in ok]
    if not targets:
        return "no " + ("q8_0/q4_0" if quant else "float or scaled quantized") + " rows"
    t = _pick_weighted(rng, targets)
    ts = TYPES[t.type_id].type_size
    unit = t.offset + ts * int(rng.integers(t.length // ts))  # an element, or a block
    if quant:
        byte = unit + 2 + int(rng.integers(ts - 2))
        bit = int(rng.integers(8))
    else:
        sign, exp, man = FLOAT_BITS.get(t.type_id, FLOAT_BITS[TypeId.F16])  # a block's scale d is an f16
        bits = {"flip-sign": [sign], "flip-exponent": list(exp), "flip-mantissa": list(man)}[kind]
        word_bit = int(rng.choice(bits))
        byte, bit = unit + word_bit // 8, word_bit % 8
    old = bytes(sf.buffer[unit : unit + ts])
    new = bytearray(old)
    new[byte - unit] ^= 1 << bit
    delta, magnitude = _delta(t.type_id, old, bytes(new))
    bit_no = (byte - unit - (2 if quant else 0)) * 8 + bit
    return [(byte, bytes([new[byte - unit]]))], {
        **t.describe(),
        "bit": bit_no,
        "delta": delta,
        "magnitude": magnitude,
    }


def _span_pieces(targets: list[Target], start: int, size: int) -> list[tuple[Target, int, int]]:
    """The (target, file offset, length) pieces of ``size`` bytes from ``start`` in the targets' data
    taken as one byte space, in file order."""
    out: list[tuple[Target, int, int]] = []
    pos = 0
    for t in sorted(targets, key=lambda t: t.offset):
        lo, hi = max(start, pos), min(start + size, pos + t.length)
        if lo < hi:
            out.append((t, t.offset + lo - pos, hi - lo))
        pos += t.length
    return out


def _span(
    sf: SlotFile, rng: np.random.Generator, size: int, zero: bool, targets: list[Target]
) -> tuple[list[tuple[int, bytes]], dict[str, Any]] | str:
    """``size`` bytes zeroed or randomised at a uniform offset of the rows ``targets`` (body or checkpoints)."""
    total = sum(t.length for t in targets)
    if total < size:
        where = "checkpoint" if targets and targets[0].region != "body" else "body"
        return f"{where} rows hold {total} B < {size} B"
    start = int(rng.integers(total - size + 1))
    pieces = _span_pieces(targets, start, size)
    fill = bytes(size) if zero else rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    edits, k = [], 0
    for _t, off, n in pieces:
        edits.append((off, fill[k : k + n]))
        k += n
    first = pieces[0][0]
    return edits, {**first.describe(), "runs_touched": len(pieces), "span_start": start}


def _cell_elements(t: Target, cell: int) -> list[tuple[int, int]]:
    """(file offset, bytes) of each element (float) or block (quantized) of one cell's row."""
    ts = TYPES[t.type_id].type_size
    if not t.transposed:
        base = t.offset + cell * t.row_size
        return [(base + i, ts) for i in range(0, t.row_size, ts)]
    n_embd = t.row_size // ts  # transposed V: element e of cell c at (e * n_cells + c)
    return [(t.offset + (e * t.n_cells + cell) * ts, ts) for e in range(n_embd)]


def _row_scale(
    sf: SlotFile, rng: np.random.Generator, factor: float
) -> tuple[list[tuple[int, bytes]], dict[str, Any]] | str:
    """Every value of one cell's row in one layer multiplied by ``factor`` (quantized: each block's d)."""
    targets = [t for t in body_targets(sf) if t.type_id in (*FLOAT_BITS, *SCALED_QUANTS)]
    if not targets:
        return "no float or scaled quantized rows"
    t = _pick_weighted(rng, targets)
    cell = int(rng.integers(t.n_cells))
    edits = []
    for off, n in _cell_elements(t, cell):
        raw = bytes(sf.buffer[off : off + n])
        if t.type_id in FLOAT_BITS and t.type_id != TypeId.BF16:
            dt = "<f2" if t.type_id == TypeId.F16 else "<f4"
            edits.append((off, (np.frombuffer(raw, dt) * factor).astype(dt).tobytes()))
        elif t.type_id == TypeId.BF16:
            v = _dequant(t.type_id, raw) * factor
            edits.append((off, (np.float32(v[0]).view(np.uint32) >> 16).astype("<u2").tobytes()))
        else:  # the block's f16 scale d comes first
            d = np.frombuffer(raw[:2], "<f2") * factor
            edits.append((off, d.astype("<f2").tobytes()))
    return edits, {**t.describe(), "cell": cell, "factor": factor}


def _swap_edits(sf: SlotFile, a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, bytes]]:
    """Edits that exchange the bytes of pieces ``a`` and ``b`` (pairwise, equal lengths)."""
    out = []
    for (oa, n), (ob, _n) in zip(a, b, strict=True):
        out += [(oa, bytes(sf.buffer[ob : ob + n])), (ob, bytes(sf.buffer[oa : oa + n]))]
    return out


def _differs(sf: SlotFile, a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(sf.buffer[oa : oa + n] != sf.buffer[ob : ob + n] for (oa, n), (ob, _) in zip(a, b, strict=True))


def _cell_swap(
    sf: SlotFile, rng: np.random.Generator, rows: list[Target]
) -> tuple[list[tuple[int, bytes]], dict[str, Any]] | str:
    """The rows of two cells of one K/V layer exchanged."""
    targets = [t for t in rows if t.n_cells >= 2 and t.stream is not None]
    if not targets:
        return "no K/V layer with two cells"
    t = _pick_weighted(rng, targets)
    for _ in range(20):
        c1, c2 = (int(c) for c in rng.choice(t.n_cells, 2, replace=False))
        a, b = _cell_elements(t, c1), _cell_elements(t, c2)
        if _differs(sf, a, b):
            return _swap_edits(sf, a, b), {**t.describe(), "cells": [c1, c2]}
    return "every pair tried holds identical rows"


def _kv_swap(
    sf: SlotFile, rng: np.random.Generator, runs: list[Target]
) -> tuple[list[tuple[int, bytes]], dict[str, Any]] | str:
    """One layer's K rows and V rows exchanged (the same byte length)."""
    pairs = [
        (t, v)
        for t in runs
        for v in runs
        if t.part == "K"
        and (v.part, v.region, v.block, v.stream, v.layer, v.length)
        == ("V", t.region, t.block, t.stream, t.layer, t.length)
        and _differs(sf, [(t.offset, t.length)], [(v.offset, v.length)])
    ]
    if not pairs:
        return "no layer whose K and V rows have the same byte length"
    k, v = pairs[int(rng.integers(len(pairs)))]
    return _swap_edits(sf, [(k.offset, k.length)], [(v.offset, v.length)]), {
        **k.describe(),
        "part": "K+V",
        "v_transposed": v.transposed,
    }


def _layer_swap(
    sf: SlotFile, rng: np.random.Generator, rows: list[Target]
) -> tuple[list[tuple[int, bytes]], dict[str, Any]] | str:
    """Two layers of one block (stream) of one region (the body, one blob) exchanged: every part
    whose rows have the same byte length."""
    by_layer: dict[tuple[str, str, int | None, int], dict[str, Target]] = {}
    for t in rows:
        by_layer.setdefault((t.region, t.block, t.stream, t.layer), {})[t.part] = t
    groups: dict[tuple[str, str, int | None], list[int]] = {}
    for reg, blk, st, layer in by_layer:
        groups.setdefault((reg, blk, st), []).append(layer)
    cands = []
    for (reg, blk, st), layers in groups.items():
        for i, la in enumerate(layers):
            for lb in layers[i + 1 :]:
                pa, pb = by_layer[(reg, blk, st, la)], by_layer[(reg, blk, st, lb)]
                parts = [p for p in pa if p in pb and (pa[p].length, pa[p].type_id) == (pb[p].length, pb[p].type_id)]
                a = [(pa[p].offset, pa[p].length) for p in parts]
                b = [(pb[p].offset, pb[p].length) for p in parts]
                if parts and _differs(sf, a, b):
                    cands.append((pa[parts[0]], lb, parts, a, b))
    if not cands:
        return "no two layers of one block with rows of the same size"
    first, lb, parts, a, b = cands[int(rng.integers(len(cands)))]
    return _swap_edits(sf, a, b), {**first.describe(), "part": "+".join(parts), "layers": [first.layer, lb]}


def _token(sf: SlotFile, rng: np.random.Generator) -> tuple[list[tuple[int, bytes]], dict[str, Any]] | str:
    """One stored token id replaced by another id the file holds (so the model's vocabulary has it)."""
    tp = sf.tokens
    if tp is None or not tp.tokens.size:
        return "no stored tokens"
    ids = np.unique(tp.tokens[tp.tokens >= 0])
    if ids.size < 2:
        return "fewer than two distinct token ids"
    i = int(rng.integers(tp.tokens.size))
    old = int(tp.tokens[i])
    new = int(rng.choice(ids[ids != old]))
    n = int(tp.tokens.size)
    return [(tp.ids_offset + 4 * i, np.int32(new).tobytes())], {"position": i, "n_tokens": n, "old": old, "new": new}


Maker = Callable[[SlotFile, np.random.Generator, str], "tuple[list[tuple[int, bytes]], dict[str, Any]] | str"]
MAKERS: dict[str, Maker] = {
    "flip-sign": lambda sf, r, _s: _flip(sf, r, "flip-sign", body_targets(sf)),
    "flip-exponent": lambda sf, r, _s: _flip(sf, r, "flip-exponent", body_targets(sf)),
    "flip-mantissa": lambda sf, r, _s: _flip(sf, r, "flip-mantissa", body_targets(sf)),
    "flip-quant": lambda sf, r, _s: _flip(sf, r, "flip-quant", body_targets(sf)),
    "zero-span": lambda sf, r, s: _span(sf, r, int(s), True, body_targets(sf)),
    "random-span": lambda sf, r, s: _span(sf, r, int(s), False, body_targets(sf)),
    "row-scale": lambda sf, r, s: _row_scale(sf, r, float(s.lstrip("x"))),
    "cell-swap": lambda sf, r, _s: _cell_swap(sf, r, body_targets(sf)),
    "kv-swap": lambda sf, r, _s: _kv_swap(sf, r, body_targets(sf)),
    "layer-swap": lambda sf, r, _s: _layer_swap(sf, r, body_targets(sf)),
    "token": lambda sf, r, _s: _token(sf, r),
    "ckpt-span": lambda sf, r, s: _span(sf, r, int(s), False, checkpoint_targets(sf)),
    "ckpt-zero-span": lambda sf, r, s: _span(sf, r, int(s), True, checkpoint_targets(sf)),
    "ckpt-flip-sign": lambda sf, r, _s: _flip(sf, r, "flip-sign", checkpoint_targets(sf)),
    "ckpt-flip-exponent": lambda sf, r, _s: _flip(sf, r, "flip-exponent", checkpoint_targets(sf)),
    "ckpt-flip-quant": lambda sf, r, _s: _flip(sf, r, "flip-quant", checkpoint_targets(sf)),
    "ckpt-cell-swap": lambda sf, r, _s: _cell_swap(sf, r, checkpoint_targets(sf)),
    "ckpt-kv-swap": lambda sf, r, _s: _kv_swap(sf, r, checkpoint_targets(sf)),
    "ckpt-layer-swap": lambda sf, r, _s: _layer_swap(sf, r, checkpoint_targets(sf)),
}


def generate(
    source: str | Path, seed: int, per_kind: int = 1, kinds: list[str] | None = None
) -> tuple[list[Case], list[dict[str, str]]]:
    """The cases of one file (``per_kind`` of every kind and size), and the kinds that do not apply
    to it with the reason.  Deterministic: a function of ``seed`` and the file's name and bytes."""
    src = str(source)
    sf = open_slot_file(src)
    cases: list[Case] = []
    not_applicable: list[dict[str, str]] = []
    try:
        if sf.body is None or not sf.body.blocks:
            raise ValueError(f"{src}: the body does not parse; nothing to damage")
        for kind in kinds or list(KINDS):
            for size in KINDS[kind]:
                for i in range(per_kind):
                    got = MAKERS[kind](sf, case_rng(seed, src, kind, size, i), size)
                    if isinstance(got, str):
                        not_applicable.append({"kind": kind, "size": size, "why": got})
                        break
                    cases.append(Case(kind, size, src, seed, i, got[0], got[1]))
    finally:
        sf.close()
    return cases, not_applicable


def write_damaged(case: Case, out_dir: Path) -> Path:
    """A copy of the case's source with its edits applied, in ``out_dir``; the source is only read
    (the copy's name is the source's stem plus the case's kind, size and index: never the source's)."""
    dst = out_dir / f"{case.name}.slot"
    shutil.copyfile(case.source, dst)
    with open(dst, "r+b") as f:
        for off, data in case.edits:
            f.seek(off)
            f.write(data)
    return dst
