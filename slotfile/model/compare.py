"""A parsed body against the model's expectation: every disagreement, with where it is.

:func:`compare` takes a :class:`~slotfile.format.records.Body` (the reader's) and a
:class:`~slotfile.format.records.ModelExpect` (:mod:`slotfile.model.expect`'s) and names each block, layer
count, row size, V presence, recurrent type and cell-ext difference, with the section and the
byte offset of the field that disagrees.  Which problems a file gets from this, and with which
severity, is :func:`slotfile.model.check.check_against_model`'s decision.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from slotfile.format.layout import MemoryKind
from slotfile.format.records import (
    BlockExpect,
    Body,
    CacheExpect,
    KVStream,
    LayerRun,
    MemoryBlock,
    ModelExpect,
    RecExpect,
)
from slotfile.format.types import TYPES, TypeId, type_name
from slotfile.model.expect import attn_rot_disabled, describe_blocks, rotation_widths

__all__ = ["Mismatch", "compare", "not_modelled_message"]


class Mismatch(NamedTuple):
    section: str
    offset: int
    message: str


def not_modelled_message(exp: ModelExpect) -> str:
    why = "; ".join(exp.notes) or "layout not modelled"
    return f"not checked against the model ({exp.arch}, {exp.memory_class}): {why}"


def _row(type_id: int, n: int) -> str:
    t = TYPES[type_id]
    return f"{t.row_size(n)} B ({t.name} x {n})"


def _check_rows(
    sec: str, part: str, runs: list[LayerRun], layers: tuple[int, ...], n_embd: tuple[int, ...], what: str
) -> list[Mismatch]:
    out: list[Mismatch] = []
    for j, (run, il, ne) in enumerate(zip(runs, layers, n_embd, strict=False)):
        t = TYPES.get(run.type_id)
        if t is None:
            continue  # an unknown type id: the reader already warns; its size cannot be checked
        if run.transposed:
            el = run.row_size // run.n_embd if run.n_embd else t.type_size
            if run.n_embd != ne:
                out.append(
                    Mismatch(
                        sec,
                        run.offset + 8,
                        f"{part} layer {j} (model layer {il}): transposed "
                        f"n_embd_v_gqa {run.n_embd}; the model needs {ne} ({what})",
                    )
                )
            elif el != t.type_size:
                out.append(
                    Mismatch(
                        sec,
                        run.offset + 4,
                        f"{part} layer {j} (model layer {il}): element size {el} B for {t.name} (needs {t.type_size})",
                    )
                )
            continue
        if ne % t.blck_size:
            out.append(
                Mismatch(
                    sec,
                    run.offset,
                    f"{part} layer {j} (model layer {il}): row size {run.row_size} B of "
                    f"{t.name}, but the model's {what} {ne} is not a whole number of {t.name} blocks "
                    f"({t.blck_size}): llama.cpp cannot cache this model in {t.name}",
                )
            )
            continue
        want = t.row_size(ne)
        if run.row_size != want:
            out.append(
                Mismatch(
                    sec,
                    run.offset,
                    f"{part} layer {j} (model layer {il}): row size {run.row_size} B; "
                    f"the model needs {_row(run.type_id, ne)} = ggml_row_size({t.name}, {what})",
                )
            )
    return out


def _compare_kv_stream(sec: str, st: KVStream, exp: CacheExpect, raw: Any) -> list[Mismatch]:
    out: list[Mismatch] = []
    n_layer_off = int(raw.data.v_trans_offset) + 4 if raw is not None and raw.data is not None else st.offset
    if st.n_layer != len(exp.layers):
        out.append(
            Mismatch(
                sec,
                n_layer_off,
                f"n_layer {st.n_layer}; the model's {exp.role} cache has {_layers(len(exp.layers))} {list(exp.layers)}",
            )
        )
    out += _check_rows(sec, "K", st.k, exp.layers, exp.n_embd_k, "n_embd_k_gqa")
    if not exp.has_v and st.v:
        out.append(
            Mismatch(
                sec,
                st.v[0].offset,
                f"{len(st.v)} V entries, but the model's {exp.role} cache has no V (MLA / K-only cache)",
            )
        )
    elif exp.has_v and exp.layers and not st.v:
        out.append(Mismatch(sec, n_layer_off, f"no V section; the model's {exp.role} cache has V for every layer"))
    elif exp.has_v:
        out += _check_rows(sec, "V", st.v, exp.layers, exp.n_embd_v, "n_embd_v_gqa")
    return out + _compare_rotation(sec, st, exp)


def stream_types(st: KVStream) -> tuple[int, int | None] | None:
    """The K and V cache types of a stream (one type per cache); None when unknown ids."""
    if not st.k:
        return None
    tk, tv = st.k[0].type_id, (st.v[0].type_id if st.v else None)
    if tk not in TYPES or (tv is not None and tv not in TYPES):
        return None
    return tk, tv


def rotation_message(i: int, got: int, want: int, type_id: int | None) -> str:
    """Why stored rotation word ``i`` (0: K, 1: V) of ``got`` disagrees with the ``want`` a
    llama.cpp of state version 4 computes (llama_kv_cache::state_read_data refuses it)."""
    what, part = ("key", "K") if i == 0 else ("value", "V")
    cache = f"a {type_name(type_id)} {part} cache" if type_id is not None else f"no {part} cache"
    msg = (
        f"incompatible {what} rotation (stored {got}, this model and {cache} give {want}): "
        f'llama.cpp would refuse the load ("incompatible {what} rotation")'
    )
    if got == 0 and want:
        msg += (
            "; a writer run with LLAMA_ATTN_ROT_DISABLE=1 stores 0, and such a file loads only into a "
            "llama.cpp run with that variable too (set it for slotfile to check against that)"
        )
    elif want == 0 and got and attn_rot_disabled():
        msg += "; LLAMA_ATTN_ROT_DISABLE is set here, which turns the rotation off"
    return msg


def _compare_rotation(sec: str, st: KVStream, exp: CacheExpect) -> list[Mismatch]:
    """n_rot_k / n_rot_v of a version-4 stream against what the model and the stream's own cache
    types give (the types are the file's: they may be any --cache-type-k/v)."""
    types = stream_types(st)
    if st.rot_offset is None or types is None:
        return []
    want = rotation_widths(exp, types[0], types[1])
    got = (int(st.n_rot_k or 0), int(st.n_rot_v or 0))
    return [
        Mismatch(sec, st.rot_offset + 4 * i, rotation_message(i, got[i], want[i], types[i]))
        for i in range(2)
        if got[i] != want[i]
    ]


def _compare_kv(sec: str, blk: MemoryBlock, exp: CacheExpect) -> list[Mismatch]:
    out: list[Mismatch] = []
    raws = list(blk.raw.streams) if blk.raw is not None else [None] * len(blk.streams)
    for st, raw in zip(blk.streams, raws, strict=True):
        if st.cell_count:  # an empty stream writes only its cell_count word
            out += _compare_kv_stream(f"{sec}.stream[{st.index}]", st, exp, raw)
    return out


def _compare_rec(sec: str, blk: MemoryBlock, exp: RecExpect) -> list[Mismatch]:
    out: list[Mismatch] = []
    n_layer_off = int(blk.raw.s_trans_offset) + 4 if blk.raw is not None else blk.offset
    if blk.n_layer != exp.n_layer_field:
        out.append(
            Mismatch(
                sec,
                n_layer_off,
                f"n_layer word {blk.n_layer}; the model has {_layers(exp.n_layer_field)} "
                "(hparams.n_layer(), layers without recurrent state included)",
            )
        )
    for part, runs in (("R", blk.r), ("S", blk.s)):
        if len(runs) != len(exp.layers):
            out.append(
                Mismatch(
                    sec,
                    runs[0].offset if runs else n_layer_off,
                    f"{len(runs)} {part} entries; the "
                    f"model has recurrent state in {_layers(len(exp.layers))} {list(exp.layers)}",
                )
            )
    if bool(blk.p) != exp.has_p:
        out.append(
            Mismatch(
                sec,
                blk.offset,
                "PLE conv (P) rows after each R entry" if blk.p else "no PLE conv (P) rows, but the model has them",
            )
        )
    out += _check_rows(sec, "R", blk.r, exp.layers, (exp.n_embd_r,) * len(exp.layers), "n_embd_r")
    out += _check_rows(sec, "S", blk.s, exp.layers, (exp.n_embd_s,) * len(exp.layers), "n_embd_s")
    for part, runs in (("R", blk.r), ("S", blk.s)):
        bad = [r for r in runs if r.type_id != TypeId.F32]
        if bad:  # create_memory passes GGML_TYPE_F32; the loader demands the same type
            out.append(
                Mismatch(
                    sec,
                    bad[0].offset,
                    f"{part} layer {bad[0].index}: type {type_name(bad[0].type_id)}; "
                    "llama.cpp always keeps recurrent state in f32",
                )
            )
    return out


def _pair(got: list[MemoryBlock], want: tuple[BlockExpect, ...]) -> list[tuple[MemoryBlock, BlockExpect]]:
    """Found blocks with the expected block they stand for: in order when the kinds agree,
    else each found block with the next expected block of its kind (so a REC is still
    checked against the model's REC when a KV is missing or extra)."""
    if tuple(b.kind for b in got) == tuple(b.kind for b in want):
        return list(zip(got, want, strict=True))
    out: list[tuple[MemoryBlock, BlockExpect]] = []
    i = 0
    for blk in got:
        j = next((j for j in range(i, len(want)) if want[j].kind == blk.kind), None)
        if j is None:
            continue
        out.append((blk, want[j]))
        i = j + 1
    return out


def _layers(n: int) -> str:
    return f"{n} layer{'' if n == 1 else 's'}"


def _has_cells(blk: MemoryBlock) -> bool:
    return blk.kind == MemoryKind.KV and any(s.cell_count for s in blk.streams)


def compare(exp: ModelExpect, body: Body, *, partial: bool = False, prefix: str = "body") -> list[Mismatch]:
    """Every disagreement between the model's expectation and a parsed body, as
    ``(section, offset, message)``.  ``partial``: the body is a PARTIAL_ONLY blob (a checkpoint's
    data_tgt / data_dft).  An arch whose layout is not modelled gives one "not checked" entry."""
    if not exp.modelled:
        return [Mismatch(prefix, body.offset, not_modelled_message(exp))]
    want = exp.partial_blocks if partial else exp.blocks
    if body.layout is None:
        return [
            Mismatch(
                prefix, body.offset, f"the body does not parse; the model ({exp.arch}) needs {describe_blocks(want)}"
            )
        ]
    out: list[Mismatch] = []
    got = body.blocks
    if tuple(b.kind for b in got) != tuple(b.kind for b in want):
        found = body.layout.describe() if got else "an empty body"
        what = f"{exp.memory_class}{', PARTIAL_ONLY' if partial else ''}"
        out.append(
            Mismatch(
                prefix,
                body.offset,
                f"blocks are {found}; the model ({exp.arch}, {what}) writes {describe_blocks(want)}",
            )
        )
    for blk, eb in _pair(got, want):
        sec = f"{prefix}.{blk.role}"
        if isinstance(eb, CacheExpect):
            out += _compare_kv(sec, blk, eb)
        else:
            out += _compare_rec(sec, blk, eb)
    # the version-2 llama.cpp (2026-08) wrote the M-RoPE cell ext without its tok: 8 bytes (x, y)
    v2_form = exp.cell_ext == 12 and body.layout.ext == 8
    if any(_has_cells(b) for b in got) and body.layout.ext != exp.cell_ext and not v2_form:
        kv = next(b for b in got if _has_cells(b))
        out.append(
            Mismatch(
                f"{prefix}.{kv.role}",
                kv.offset,
                f"cell ext {body.layout.ext} B per cell; the model needs "
                f"{exp.cell_ext} B (llama_kv_cache::has_cell_ext: M-RoPE/IMRoPE or PLE)",
            )
        )
    return out
