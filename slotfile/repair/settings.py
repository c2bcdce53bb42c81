"""Settings probing: which context settings (flash attention, K/V types, streams, seq id) a
file was saved with, from whatever its bytes still show, and the dict the worker takes."""

from __future__ import annotations

from typing import Any

import numpy as np

from slotfile.format import grammar as g
from slotfile.format.reader import has_rot
from slotfile.format.records import Body, MemoryKind, SlotFile
from slotfile.format.types import BY_NAME, KV_CACHE_TYPES, TRANSPOSABLE, TYPES, type_name
from slotfile.repair.common import Refused, RepairOptions
from slotfile.repair.tail import Tail


def probe_body(view: memoryview, start: int, end: int, *, rot: bool = False) -> dict[str, Any]:
    """Read the first KV stream header of a (possibly cut) body: n_stream, seq_id, cell ext,
    v_trans, K and V types.  Keys are missing where the bytes do not show them.  ``rot``: the
    stream carries n_rot_k, n_rot_v after n_layer (state version 4).  The fields are read with
    the grammar's heads (:func:`slotfile.format.grammar.read_fixed`), one at a time, because a
    cut body cannot be parsed whole."""
    out: dict[str, Any] = {}
    n_stream = _count(view, start, end)
    if n_stream is None or not 1 <= n_stream <= g.MAX_STREAMS:
        return out
    p = start + g.COUNT.size
    for si in range(n_stream):
        cc = _count(view, p, end)
        if cc is None:
            break
        p += g.COUNT.size
        if cc == 0:
            continue
        _probe_stream(view, p, end, cc, si, n_stream, out, g.RotWords.sizeof() if rot else 0)
        out.setdefault("n_stream", n_stream)
        return out
    out["n_stream"] = n_stream
    return out


def _count(view: memoryview, p: int, end: int) -> int | None:
    got = g.read_fixed(g.COUNT, view, p, end)
    return None if got is None else int(got[0])


def _cells(view: memoryview, p: int, ext: int, n: int) -> Any:
    """The first ``n`` (at most 64) single-sequence KV cells at ``p``, in the grammar's dtype."""
    return np.frombuffer(view, dtype=g.kv_cell_dtype(ext), count=min(n, 64), offset=p)


def _probe_stream(
    view: memoryview, p: int, end: int, cc: int, si: int, n_stream: int, out: dict[str, Any], rot: int = 0
) -> None:
    """The first stream with cells, at ``p`` (its cell table): try each cell ext size."""
    for ext in (0, 12, 8):
        stride = g.kv_cell_dtype(ext).itemsize
        meta_end = p + cc * stride
        seq_id = si if n_stream > 1 else None
        if meta_end + g.KV_STREAM_HEAD.size > end:
            # the cut is inside the cell table: check the cells that are there
            avail = (end - p) // stride
            if avail and bool(np.all(_cells(view, p, ext, avail)["n_seq_id"] == 1)):
                out.setdefault("n_stream", n_stream)
                first = int(_cells(view, p, ext, 1)["seq_id"][0])
                out.setdefault("seq_id", seq_id if seq_id is not None else first)
            continue
        if not bool(np.all(_cells(view, p, ext, cc)["n_seq_id"] == 1)):
            continue
        v_trans, n_layer = g.KV_STREAM_HEAD.unpack_from(view, meta_end)
        if v_trans not in (0, 1) or not 0 < n_layer <= g.MAX_LAYERS:
            continue
        out["n_stream"] = n_stream
        out["seq_id"] = seq_id if seq_id is not None else int(_cells(view, p, ext, 1)["seq_id"][0])
        out["ext"] = ext
        out["v_trans"] = v_trans
        _probe_layers(view, meta_end + g.KV_STREAM_HEAD.size + rot, end, cc, n_layer, out)
        return


def _probe_layers(view: memoryview, q: int, end: int, cc: int, n_layer: int, out: dict[str, Any]) -> None:
    """K type and row size of the first K layer; the V type after the last K layer."""
    head = g.read_fixed(g.LAYER_HEAD, view, q, end)
    if head is None:
        return
    tk, row = head
    if not kv_type_ok(tk):
        return
    out["type_k"] = tk
    out["n_layer"] = n_layer
    out["k_row"] = row
    for _ in range(n_layer):
        head = g.read_fixed(g.LAYER_HEAD, view, q, end)
        if head is None:
            return
        t_i, row_i = head
        if t_i != tk:
            return
        q += g.LAYER_HEAD.size + cc * row_i
    head = g.read_fixed(g.LAYER_HEAD, view, q, end)  # a V layer's type (either V layout starts with it)
    if head is not None and kv_type_ok(head[0]):
        out["type_v"] = head[0]


def kv_type_ok(type_id: int) -> bool:
    """A type llama.cpp accepts for a K/V cache (--cache-type-k/v)."""
    t = TYPES.get(type_id)
    return t is not None and t.name in KV_CACHE_TYPES


def kv_settings_of(body: Body | None) -> dict[str, Any]:
    """v_trans / K / V types / n_stream of the first KV stream with cells of a parsed body."""
    out: dict[str, Any] = {}
    if body is None:
        return out
    for blk in body.blocks:
        if blk.kind != MemoryKind.KV:
            continue
        out.setdefault("n_stream", blk.n_stream)
        for st in blk.active_streams():
            if st.k and kv_type_ok(st.k[0].type_id):
                out.setdefault("type_k", st.k[0].type_id)
            if blk.has_v and st.v and kv_type_ok(st.v[0].type_id):
                out.setdefault("type_v", st.v[0].type_id)
                out.setdefault("v_trans", st.v_trans)
            if blk.n_stream > 1:
                out.setdefault("seq_id", st.index)
            elif st.cells is not None and st.cells.seq_ids.size:
                out.setdefault("seq_id", int(st.cells.seq_ids[0]))
    return out


def file_flash_attn(sf: SlotFile) -> bool | None:
    vt = kv_settings_of(sf.body).get("v_trans")
    return None if vt is None else vt == 0


def tid(v: Any) -> int:
    """A cache type id from an id or a name."""
    if isinstance(v, int):
        return v
    t = BY_NAME.get(str(v))
    if t is None:
        raise Refused(f"unknown cache type {v!r}")
    return t.id


def worker_settings(s: Any) -> dict[str, Any]:
    """LoadSettings as the dict the rebuild worker takes."""
    from slotfile.llama.requests import settings_dict

    d = settings_dict(s) or {}
    for k in ("type_k", "type_v"):
        v = d.get(k)
        if isinstance(v, str) and v in BY_NAME:
            d[k] = v
    return d


def describe_settings(s: dict[str, Any]) -> str:
    fa = {True: "on", False: "off", None: "unknown"}[s.get("flash_attn")]
    parts = [
        f"flash attention {fa}",
        f"K {s.get('type_k') or 'unknown'}",
        f"V {s.get('type_v') or 'unknown'}",
        f"n_seq_max {s.get('n_seq_max')}" + (" unified" if s.get("kv_unified") else ""),
        f"seq {s.get('seq_id')}",
    ]
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------
# the settings of a damaged file, for a rebuild


def _found_settings(sf: SlotFile, view: memoryview, tail: Tail) -> tuple[dict[str, Any], list[str]]:
    """Every setting the damaged body, the checkpoints and the draft state still show, and
    where each came from."""
    assert sf.body is not None
    sources: list[str] = []
    found: dict[str, Any] = {}

    def take(d: dict[str, Any], name: str) -> None:
        new = {k: v for k, v in d.items() if k not in found and v is not None}
        found.update(new)
        if new:
            sources.append(name)

    take(probe_body(view, sf.body.offset, len(view), rot=has_rot(sf)), "the body's first bytes")
    if tail.sckp is not None:
        for e in tail.sckp.good:
            take(kv_settings_of(e.tgt.info.body if e.tgt.info else None), f"checkpoint at {e.n_tokens} tokens")
            if e.tgt.info is not None and e.tgt.info.seq_id is not None:
                found.setdefault("seq_id_blob", e.tgt.info.seq_id)
    if tail.sdft is not None and tail.sdft.dft is not None and tail.sdft.dft.info is not None:
        d = kv_settings_of(tail.sdft.dft.info.body)
        if "v_trans" in d and "v_trans" not in found:
            found["v_trans"] = d["v_trans"]
            sources.append("the draft state's V layout")
    return found, sources


def _streams(s: dict[str, Any], found: dict[str, Any]) -> None:
    n_stream = found.get("n_stream")
    seq_id = found.get("seq_id", found.get("seq_id_blob"))
    if n_stream and n_stream > 1:
        s["n_seq_max"], s["kv_unified"] = n_stream, False
    elif seq_id:
        s["n_seq_max"], s["kv_unified"] = int(seq_id) + 1, True  # one stream shared by several slots
    else:
        s["n_seq_max"], s["kv_unified"] = 1, False
    s["seq_id"] = int(seq_id or 0)


def settings_for_rebuild(
    sf: SlotFile, view: memoryview, tail: Tail, opts: RepairOptions, notes: list[str]
) -> tuple[dict[str, Any], list[str]]:
    """The settings the damaged file was saved with, from whatever still shows them; the
    options fill in (or override) the rest."""
    s: dict[str, Any] = {
        "n_ctx": None,
        "n_seq_max": None,
        "kv_unified": None,
        "flash_attn": None,
        "type_k": None,
        "type_v": None,
        "n_gpu_layers": opts.n_gpu_layers,
        "seq_id": None,
    }
    found, sources = _found_settings(sf, view, tail)
    if "v_trans" in found:
        s["flash_attn"] = found["v_trans"] == 0
    for k in ("type_k", "type_v"):
        if k in found:
            s[k] = type_name(found[k])
    _streams(s, found)
    if opts.flash_attn is not None:
        if s["flash_attn"] is not None and s["flash_attn"] != opts.flash_attn:
            sources.append("--flash-attn (overriding the file)")
        s["flash_attn"] = opts.flash_attn
    for k, v in (("type_k", opts.type_k), ("type_v", opts.type_v)):
        if v is not None:
            s[k] = v
    if s["type_v"] is None and s["type_k"] is not None:
        s["type_v"] = s["type_k"]
        notes.append(
            f"the file was cut before its V cache: assumed V type = K type ({s['type_k']}); "
            "give --cache-type-v if the server used another"
        )
    if (
        s["flash_attn"] is None
        and s["type_v"] is not None
        and BY_NAME.get(str(s["type_v"])) is not None
        and BY_NAME[str(s["type_v"])].id not in TRANSPOSABLE
    ):
        s["flash_attn"] = True  # a quantized V cache exists only with flash attention
        notes.append(f"flash attention on: a {s['type_v']} V cache exists only with flash attention")
    return s, sources
