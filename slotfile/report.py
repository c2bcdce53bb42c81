"""The JSON form of a parsed file (``slotfile dump --json``), and one-line summaries.

Every field is ``{"offset": o, "value": v}`` where it sits at a byte offset of its own; bulk
runs are ``{"offset", "length", ...}``.  The schema is documented in the README and versioned
by the ``schema`` key.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slotfile.diagnosis import facts_of, file_cause, next_step
from slotfile.format import versions
from slotfile.format.layout import MemoryKind
from slotfile.format.records import (
    Appendix,
    BlobInfo,
    Body,
    Checkpoint,
    LayerRun,
    MemoryBlock,
    SlotFile,
    TokenForm,
)
from slotfile.format.types import type_name

SCHEMA = "slotfile.dump/1"


def _f(offset: int, value: Any) -> dict[str, Any]:
    return {"offset": int(offset), "value": value}


def _run(r: LayerRun) -> dict[str, Any]:
    d: dict[str, Any] = {
        "layer": r.index,
        "offset": r.offset,
        "type": type_name(r.type_id),
        "type_id": r.type_id,
        "row_size": r.row_size,
        "elements": r.elements,
        "data_offset": r.data.offset,
        "data_size": r.data.length,
    }
    if r.transposed:
        d["transposed"] = True
        d["n_embd"] = r.n_embd
    return d


def _cells(ct: Any, ext: int) -> dict[str, Any] | None:
    if ct is None:
        return None
    pos = ct.cells["pos"]
    return {
        "offset": ct.offset,
        "size": ct.size,
        "count": int(pos.size),
        "ext": ext,
        "pos_min": int(pos.min()) if pos.size else None,
        "pos_max": int(pos.max()) if pos.size else None,
        "seq_ids": sorted({int(x) for x in np.unique(ct.seq_ids)}) if ct.seq_ids.size else [],
    }


def block_json(b: MemoryBlock, ext: int) -> dict[str, Any]:
    d: dict[str, Any] = {"role": b.role, "kind": b.kind, "offset": b.offset, "size": b.size}
    if b.kind == MemoryKind.KV:
        c = b.raw
        d["has_v"] = b.has_v
        d["n_stream"] = _f(c.offset, b.n_stream)
        streams = []
        for st, sc in zip(b.streams, c.streams, strict=False):
            sd: dict[str, Any] = {"index": st.index, "offset": st.offset, "cell_count": _f(st.offset, st.cell_count)}
            if sc.data is not None:
                sd["cells"] = _cells(st.cells, ext)
                sd["v_trans"] = _f(sc.data.v_trans_offset, st.v_trans)
                sd["n_layer"] = _f(sc.data.v_trans_offset + 4, st.n_layer)
                if st.rot_offset is not None:  # state version 4 / session 11
                    sd["n_rot_k"] = _f(st.rot_offset, st.n_rot_k)
                    sd["n_rot_v"] = _f(st.rot_offset + 4, st.n_rot_v)
                sd["k"] = [_run(r) for r in st.k]
                sd["v"] = [_run(r) for r in st.v]
            streams.append(sd)
        d["streams"] = streams
    else:
        c = b.raw
        d["cell_count"] = _f(c.offset, b.cell_count)
        d["cells"] = _cells(b.cells, 0)
        d["s_trans"] = _f(c.s_trans_offset, int(c.s_trans))
        d["n_layer"] = _f(c.s_trans_offset + 4, b.n_layer)
        d["r"] = [_run(r) for r in b.r]
        d["p"] = [_run(r) for r in b.p]
        d["s"] = [_run(r) for r in b.s]
    return d


def body_json(body: Body | None) -> dict[str, Any] | None:
    if body is None:
        return None
    ext = body.layout.ext if body.layout else 0
    return {
        "offset": body.offset,
        "size": body.size,
        "layout": body.layout.describe() if body.layout else None,
        "memory_class": body.memory_class,
        "cell_ext": ext,
        "confidence": body.confidence,
        "alternatives": [a.describe() for a in body.alternatives],
        "blocks": [block_json(b, ext) for b in body.blocks],
    }


def blob_json(b: BlobInfo | None) -> dict[str, Any] | None:
    if b is None:
        return None
    return {
        "offset": b.offset,
        "length": b.length,
        "data_offset": b.data_offset,
        "seq_id": b.seq_id,
        "body": body_json(b.body),
    }


def checkpoint_json(c: Checkpoint) -> dict[str, Any]:
    return {
        "index": c.index,
        "offset": c.offset,
        "size": c.end - c.offset,
        "n_tokens": _f(c.offset, c.n_tokens),
        "pos_min": _f(c.offset + 8, c.pos_min),
        "pos_max": _f(c.offset + 12, c.pos_max),
        "data_tgt": blob_json(c.tgt),
        "data_dft": blob_json(c.dft),
        "data_spec": blob_json(c.spec),
    }


def appendix_json(a: Appendix | None, sf: SlotFile) -> dict[str, Any] | None:
    if a is None:
        return None
    d: dict[str, Any] = {
        "offset": a.offset,
        "size": a.end - a.offset,
        "magic": _f(a.offset, a.name),
        "version": _f(a.offset + 4, a.version),
        "complete": a.complete,
    }
    if a.name == "SCKP":
        d["count"] = _f(a.offset + 8, a.count)
        d["checkpoints"] = [checkpoint_json(c) for c in sf.checkpoints]
    else:
        d["data_dft"] = blob_json(a.dft)
        d["data_spec"] = blob_json(a.spec)
    return d


def tokens_json(sf: SlotFile, with_ids: bool) -> dict[str, Any] | None:
    t = sf.tokens
    if t is None:
        return None
    d: dict[str, Any] = {"offset": t.offset, "size": t.size, "form": t.form, "n_tokens": int(t.tokens.size)}
    if t.form == TokenForm.PACKED and t.raw is not None:
        c = t.raw
        d["marker"] = _f(c.offset, int(c.marker))
        d["state_version"] = _f(c.offset + 4, int(c.version))
        d["n_tokens"] = _f(c.offset + 8, int(c.n_tokens))
        ids_off = c.offset + 12
        d["n_media"] = _f(ids_off + 4 * int(c.n_tokens), int(c.n_media))
        d["media"] = t.media
        d["padding"] = {"offset": c.padding_offset, "length": t.padding}
    else:
        ids_off = t.offset
    d["ids"] = {"offset": ids_off, "count": int(t.tokens.size)}
    if with_ids:
        d["ids"]["values"] = [int(x) for x in t.tokens]
    return d


def to_json(
    sf: SlotFile, *, with_tokens: bool = False, text: str | None = None, model_path: str | None = None
) -> dict[str, Any]:
    """The ``slotfile.dump/1`` document.  Beyond ``verdict`` (ok | ok with warnings | damaged:
    does the file have errors), ``cause`` says why it fails (damaged, mismatch, not-a-slot-file,
    unsupported; null without errors), ``next_step`` / ``repair_command`` what to do about it,
    and each problem its ``class`` (slotfile.problems.cause_of).  ``model_path``: the --model, for the
    repair command."""
    cause = file_cause(sf.problems)
    step = next_step(cause, sf.problems, facts_of(sf, model_path))
    vinfo = versions.version_info(sf.format, sf.version)
    d: dict[str, Any] = {
        "schema": SCHEMA,
        "file": sf.path,
        "size": sf.size,
        "format": sf.format,
        "version": sf.version,
        "version_note": vinfo.writer if vinfo else None,
        "header": None,
        "tokens": tokens_json(sf, with_tokens),
        "arch": None,
        "body": body_json(sf.body),
        "sckp": appendix_json(sf.sckp, sf),
        "sdft": appendix_json(sf.draft, sf),
        "trailing": {"offset": sf.trailing[0], "size": sf.trailing[1]} if sf.trailing else None,
        "sections": [{"name": s.name, "offset": s.offset, "size": s.size, "note": s.note} for s in sf.sections],
        "problems": [p.to_dict(with_class=True) for p in sf.problems],
        "verdict": sf.verdict,
        "cause": cause,
        "next_step": step.text if step else None,
        "repair_command": step.command if step else None,
    }
    if sf.version is not None:
        d["header"] = {
            "magic": _f(0, sf.format),
            "version": _f(4, sf.version),
            "n_token_count": _f(8, sf.n_token_count),
        }
    if sf.arch is not None:
        d["arch"] = _f(12 + 4 * (sf.n_token_count or 0), sf.arch)
    if text is not None:
        d["text"] = text
    return d


def flash_attn_of(sf: SlotFile) -> str:
    """Flash attention as the file implies it: on when V is not transposed (v_trans == 0)."""
    vals = set()
    if sf.body:
        for b in sf.body.blocks:
            for s in b.active_streams():
                # a K-only (MLA) cache writes v_trans too, and the loader checks it
                if s.v_trans is not None:
                    vals.add(s.v_trans)
    if not vals:
        return "unknown"
    if vals == {0}:
        return "on"
    if vals == {1}:
        return "off"
    return "mixed"
