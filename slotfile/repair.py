"""Repairs: truncate-recover, strip-draft and re-save, planned as byte ranges of the input.

Every operation looks at the parsed input (:func:`slotfile.reader.open_slot_file`), decides
what to keep, drop, rewrite or rebuild, and returns an :class:`Outcome`: a
:class:`slotfile.safewrite.Plan` (byte ranges of the input or of files a llama.cpp worker
wrote, plus a few literal bytes) and a :class:`Report` saying exactly what happens to every
section.  :func:`execute` then writes the plan through :func:`slotfile.safewrite.commit`,
with a structural re-read and (given a model) a real test-load of the temp file as its
check.

Nothing here reads a whole section into memory except small headers; the transposition of V
for a flash-attention flip streams layer by layer (:class:`Transposed` pieces).
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from construct import ConstructError

from . import grammar as g
from .exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from .ggml_types import BY_NAME, KV_CACHE_TYPES, TRANSPOSABLE, TYPES, type_name
from .layout import PARTIAL_OF, failure_of
from .reader import BlobInfo, Body, SlotFile, open_slot_file
from .safewrite import (
    CheckFailed,
    Literal,
    Plan,
    Range,
    Target,
    WriteRefused,
    commit,
    create_temp,
    describe_plan,
    unlink_quiet,
    write_plan,
)

SCHEMA = "slotfile.repair/1"
MAX_SCAN_CANDIDATES = 4096


class Refused(Exception):
    """The repair cannot be done (exit 4), with a one-line reason."""


class Operational(Exception):
    """The job could not be done for an outside reason (exit 8): worker, model, I/O."""


# ======================================================================================
# the report
# ======================================================================================


@dataclass(slots=True)
class Report:
    command: str
    input: str
    output: str | None = None
    in_place: bool = False
    backup: str | None = None
    dry_run: bool = False
    status: str = "repaired"  # repaired, nothing-to-do, refused, check-failed, error, dry-run
    exit_code: int = OK
    reason: str | None = None
    input_size: int = 0
    output_size: int | None = None
    kept: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)
    rebuilt: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    test_load: dict[str, Any] | None = None
    plan: list[dict[str, Any]] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def keep(self, section: str, offset: int, nbytes: int, **extra: Any) -> None:
        self.kept.append({"section": section, "offset": offset, "bytes": nbytes, **extra})

    def drop(self, section: str, offset: int, nbytes: int, reason: str, **extra: Any) -> None:
        self.dropped.append({"section": section, "offset": offset, "bytes": nbytes, "reason": reason, **extra})

    def change(self, section: str, what: str, old: Any, new: Any, **extra: Any) -> None:
        self.changed.append({"section": section, "field": what, "from": old, "to": new, **extra})

    def rebuild(self, section: str, nbytes: int | None, how: str, **extra: Any) -> None:
        self.rebuilt.append({"section": section, "bytes": nbytes, "how": how, **extra})

    @property
    def bytes_saved(self) -> int | None:
        return None if self.output_size is None else self.input_size - self.output_size

    def to_json(self) -> dict[str, Any]:
        d = {
            "schema": SCHEMA,
            "command": self.command,
            "input": self.input,
            "output": self.output,
            "in_place": self.in_place,
            "backup": self.backup,
            "dry_run": self.dry_run,
            "status": self.status,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "input_size": self.input_size,
            "output_size": self.output_size,
            "bytes_saved": self.bytes_saved,
            "kept": self.kept,
            "dropped": self.dropped,
            "changed": self.changed,
            "rebuilt": self.rebuilt,
            "notes": self.notes,
            "test_load": self.test_load,
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
        }
        if self.plan is not None:
            d["plan"] = self.plan
        return d

    def lines(self) -> list[str]:
        """The human-readable report."""
        out: list[str] = []
        dest = self.output or "-"
        head = {
            "repaired": f"{self.command}: {self.input} -> {dest}",
            "nothing-to-do": f"{self.command}: {self.input}: nothing to do",
            "dry-run": f"{self.command}: {self.input}: dry run, nothing written",
            "refused": f"{self.command}: {self.input}: cannot repair",
            "check-failed": f"{self.command}: {self.input}: repaired output failed its check; nothing written",
            "error": f"{self.command}: {self.input}: error",
        }[self.status]
        out.append(head)
        if self.reason:
            out.append(f"  reason: {self.reason}")
        for item in self.kept:
            out.append(f"  kept     {_item_line(item)}")
        for item in self.changed:
            out.append(f"  changed  {item['section']}: {item['field']} {item['from']} -> {item['to']}")
        for item in self.rebuilt:
            out.append(f"  rebuilt  {_item_line(item, 'how')}")
        for item in self.dropped:
            out.append(f"  dropped  {_item_line(item, 'reason')}")
        for note in self.notes:
            out.append(f"  note: {note}")
        if self.output_size is not None:
            saved = self.input_size - self.output_size
            out.append(f"  size: {self.input_size} -> {self.output_size} bytes"
                       + (f" ({saved} bytes saved)" if saved > 0 else (f" ({-saved} bytes more)" if saved < 0 else "")))
        if self.test_load is not None:
            t = self.test_load
            state = {True: "ok", False: "FAILED", None: "skipped"}[t.get("ok")]
            extra = ""
            if t.get("checkpoints"):
                extra += f", {sum(1 for ok, _ in t['checkpoints'] if ok)}/{len(t['checkpoints'])} checkpoints"
            if t.get("draft"):
                extra += f", draft state {'ok' if t['draft'][0] else 'refused'}"
            out.append(f"  test-load: {state}: {t.get('message', '')}{extra}")
        if self.backup and self.status == "repaired":
            out.append(f"  backup: {self.backup}")
        if self.plan:
            out.append(f"  plan ({len(self.plan)} pieces, {self.output_size} bytes):")
            for piece in self.plan[:40]:
                if "from" in piece:
                    out.append(f"    @{piece['out_offset']}: copy {piece['length']} bytes of {piece['from']} "
                               f"from offset {piece['offset']}")
                else:
                    out.append(f"    @{piece['out_offset']}: write {piece['length']} bytes ({piece['literal']})")
            if len(self.plan) > 40:
                out.append(f"    ... {len(self.plan) - 40} more")
        if self.timings:
            out.append("  time: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items()))
        return out


def _item_line(item: dict[str, Any], tail: str | None = None) -> str:
    parts = [item["section"]]
    if item.get("offset") is not None:
        parts.append(f"at {item['offset']}")
    if item.get("bytes") is not None:
        parts.append(f"{item['bytes']} bytes")
    for key in ("tokens", "n_tokens", "count", "layout"):
        if item.get(key) is not None:
            parts.append(f"{key.replace('_', ' ')} {item[key]}")
    line = ", ".join(parts)
    if tail and item.get(tail):
        line += f": {item[tail]}"
    return line


# ======================================================================================
# plan pieces beyond safewrite's ranges and literals
# ======================================================================================


@dataclass(frozen=True, slots=True)
class Transposed:
    """A ``rows x cols`` matrix of ``itemsize``-byte elements at ``offset`` of ``path``,
    written transposed (``cols x rows``), in bounded chunks at write time."""

    path: str
    offset: int
    rows: int
    cols: int
    itemsize: int

    @property
    def length(self) -> int:
        return self.rows * self.cols * self.itemsize


def _write_with_transposed(plan: Plan, fd: int) -> int:
    """write_plan, extended with :class:`Transposed` pieces."""
    n = 0
    run: list[Any] = []

    def flush() -> None:
        nonlocal n, run
        if run:
            n += write_plan(Plan(run), fd)
            run = []

    for piece in plan.pieces:
        if isinstance(piece, Transposed):
            flush()
            n += _write_transposed(piece, fd)
        else:
            run.append(piece)
    flush()
    return n


def _write_transposed(t: Transposed, fd: int) -> int:
    import mmap

    dt = {2: "<u2", 4: "<u4", 1: "u1", 8: "<u8"}[t.itemsize]
    with open(t.path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            arr = np.frombuffer(mm, dtype=dt, count=t.rows * t.cols, offset=t.offset).reshape(t.rows, t.cols)
            step = max(1, (8 << 20) // max(1, t.rows * t.itemsize))
            done = 0
            for i in range(0, t.cols, step):
                chunk = np.ascontiguousarray(arr[:, i : i + step].T).tobytes()
                view = memoryview(chunk)
                while view:
                    k = os.write(fd, view)
                    view = view[k:]
                done += len(chunk)
            del arr
            return done
        finally:
            mm.close()


class TPlan(Plan):
    """A Plan that may hold :class:`Transposed` pieces (``size`` counts them)."""

    def transposed(self, path: str, offset: int, rows: int, cols: int, itemsize: int) -> None:
        if rows and cols:
            self.pieces.append(Transposed(os.fspath(path), offset, rows, cols, itemsize))  # type: ignore[arg-type]


def _commit_plan(plan: Plan, target: Target, check: Callable[[str], tuple[bool, str]] | None) -> Any:
    if any(isinstance(p, Transposed) for p in plan.pieces):
        return commit(plan, target, check, writer=_write_with_transposed)
    return commit(plan, target, check)


# ======================================================================================
# reading the input for salvage
# ======================================================================================


def _view(sf: SlotFile) -> memoryview:
    buf = sf.buffer
    return buf if isinstance(buf, memoryview) else memoryview(buf).cast("B") if len(buf) else memoryview(b"")


def _find(sf: SlotFile, needle: bytes, start: int, end: int) -> int:
    buf = sf.buffer
    finder = getattr(buf, "find", None)
    if finder is not None:
        return int(finder(needle, start, end))
    return bytes(_view(sf)[start:end]).find(needle) + start if needle in bytes(_view(sf)[start:end]) else -1


@dataclass(slots=True)
class BlobRef:
    offset: int  # of the u64 length
    length: int
    ok: bool = True
    reason: str = ""
    info: BlobInfo | None = None

    @property
    def data_offset(self) -> int:
        return self.offset + 8

    @property
    def end(self) -> int:
        return self.offset + 8 + self.length


def _check_blob(sf: SlotFile, view: memoryview, ref: BlobRef, section: str, partial: tuple[str, ...] | None) -> None:
    """Validate a seq blob the way the reader does (same code), recording ok / reason."""
    from . import reader as r

    scratch = SlotFile(path=sf.path, size=len(view), format="GGSQ", buffer=sf.buffer)
    info = BlobInfo(section.rsplit(".", 1)[-1], ref.offset, ref.length, g.Run(ref.data_offset, ref.length, b""))
    try:
        r._parse_seq_blob(scratch, view, info, section, partial)
        if info.body is not None:
            for blk in info.body.blocks:
                r._check_block(scratch, blk, f"{section}.{blk.role}")
    except (ConstructError, ValueError, OverflowError, IndexError, AttributeError) as e:
        scratch.problem("error", "internal", section, ref.offset, f"{type(e).__name__}: {e}")
    errs = scratch.errors
    ref.info = info
    if errs:
        ref.ok, ref.reason = False, errs[0].message


@dataclass(slots=True)
class Entry:
    index: int
    offset: int
    end: int
    n_tokens: int
    pos_min: int
    pos_max: int
    tgt: BlobRef
    dft: BlobRef
    spec: BlobRef
    ok: bool = True
    reason: str = ""

    @property
    def head_end(self) -> int:
        """End of n_tokens, pos_min, pos_max."""
        return self.offset + 16


@dataclass(slots=True)
class SckpWalk:
    offset: int
    header_ok: bool = False
    magic_ok: bool = True
    version: int | None = None
    count: int | None = None
    entries: list[Entry] = field(default_factory=list)
    stop: int = 0
    stop_reason: str = ""  # empty: stopped at EOF or at an SDFT magic
    at_sdft: bool = False
    cut_n_tokens: int | None = None  # n_tokens of the entry the walk broke off in, if readable

    @property
    def good(self) -> list[Entry]:
        return [e for e in self.entries if e.ok]

    def known_n_tokens(self, n_max: int) -> list[int]:
        vals = [e.n_tokens for e in self.entries]
        if self.cut_n_tokens is not None:
            vals.append(self.cut_n_tokens)
        return sorted({v for v in vals if 0 < v <= n_max})


def walk_sckp(sf: SlotFile, view: memoryview, off: int, *, tgt_partial: tuple[str, ...] | None,
              n_tokens: int, require_magic: bool = True) -> SckpWalk:
    """Walk an SCKP appendix entry by entry, ignoring its count; validate every blob."""
    end = len(view)
    w = SckpWalk(off, stop=off)
    if end - off < 12:
        w.stop_reason = f"SCKP header cut after {end - off} of 12 bytes"
        return w
    magic = bytes(view[off : off + 4])
    w.magic_ok = magic == g.SCKP_MAGIC
    if require_magic and not w.magic_ok:
        w.stop_reason = "no SCKP magic"
        return w
    w.version, w.count = struct.unpack_from("<II", view, off + 4)
    if w.version != 1:
        w.stop_reason = f"SCKP version {w.version} (only 1 is known)"
        return w
    w.header_ok = True
    p = off + 12
    dft_partial = None
    while len(w.entries) < g.MAX_CHECKPOINTS:
        if p >= end:
            break
        head = bytes(view[p : p + 4])
        if head == g.SDFT_MAGIC or (len(head) < 4 and g.SDFT_MAGIC.startswith(head)):
            w.at_sdft = True
            break
        s = g.ViewStream(view, p, end)
        s.loc = [f"checkpoint[{len(w.entries)}]"]
        try:
            c = g.CheckpointEntry.parse_stream(s)
        except ConstructError as e:
            f = failure_of(e, s)
            w.stop_reason = f"checkpoint {len(w.entries)}: {f.message}" + (f" ({f.loc})" if f.loc else "")
            if end - p >= 8:
                w.cut_n_tokens = struct.unpack_from("<q", view, p)[0]
            break
        i = len(w.entries)
        sec = f"sckp.checkpoint[{i}]"
        e = Entry(i, p, c.end, c.n_tokens, c.pos_min, c.pos_max,
                  BlobRef(c.tgt.offset, c.tgt.length), BlobRef(c.dft.offset, c.dft.length),
                  BlobRef(c.spec.offset, c.spec.length))
        if e.tgt.length == 0:
            e.ok, e.reason = False, "data_tgt is empty (the server drops the whole appendix)"
        else:
            _check_blob(sf, view, e.tgt, f"{sec}.data_tgt", tgt_partial)
            if not e.tgt.ok:
                e.ok, e.reason = False, f"data_tgt: {e.tgt.reason}"
        if e.ok and (e.pos_min > e.pos_max or e.pos_min < 0):
            e.ok, e.reason = False, f"position range {e.pos_min}..{e.pos_max}"
        if e.ok and e.n_tokens < 0:
            e.ok, e.reason = False, f"n_tokens {e.n_tokens}"
        if e.ok and e.dft.length:
            _check_blob(sf, view, e.dft, f"{sec}.data_dft", dft_partial)
        if not e.ok and w.count is not None and i >= w.count:
            break  # past the declared count an invalid entry is no checkpoint: trailing bytes
        w.entries.append(e)
        p = c.end
    w.stop = p
    return w


@dataclass(slots=True)
class SdftFound:
    offset: int
    end: int
    ok: bool
    reason: str = ""
    dft: BlobRef | None = None
    spec: BlobRef | None = None
    scanned: bool = False


def parse_sdft_at(sf: SlotFile, view: memoryview, off: int) -> SdftFound:
    end = len(view)
    s = g.ViewStream(view, off, end)
    try:
        h = g.SdftHeader.parse_stream(s)
    except ConstructError as e:
        return SdftFound(off, end, False, f"SDFT header: {failure_of(e, s).message}")
    if h.version != 1:
        return SdftFound(off, end, False, f"SDFT version {h.version} (only 1 is known)")
    try:
        b = g.SdftBody.parse_stream(s)
    except ConstructError as e:
        f = failure_of(e, s)
        return SdftFound(off, end, False, f"{f.message}" + (f" ({f.loc})" if f.loc else ""))
    found = SdftFound(off, b.end, True, "", BlobRef(b.dft.offset, b.dft.length), BlobRef(b.spec.offset, b.spec.length))
    if found.dft is not None and found.dft.length:
        _check_blob(sf, view, found.dft, "sdft.data_dft", None)
        if not found.dft.ok:
            found.ok, found.reason = False, f"data_dft: {found.dft.reason}"
    return found


def scan_sdft(sf: SlotFile, view: memoryview, start: int) -> SdftFound | None:
    """A complete, valid SDFT appendix that ends at EOF, somewhere after ``start``."""
    end = len(view)
    p = start
    for _ in range(MAX_SCAN_CANDIDATES):
        p = _find(sf, g.SDFT_MAGIC, p, end)
        if p < 0:
            return None
        found = parse_sdft_at(sf, view, p)
        if found.ok and found.end == end:
            found.scanned = True
            return found
        p += 1
    return None


def scan_sckp(sf: SlotFile, view: memoryview, start: int, n_tokens: int) -> SckpWalk | None:
    """The first SCKP appendix after ``start`` with at least one valid checkpoint."""
    end = len(view)
    p = start
    for _ in range(MAX_SCAN_CANDIDATES):
        p = _find(sf, g.SCKP_MAGIC, p, end)
        if p < 0:
            return None
        w = walk_sckp(sf, view, p, tgt_partial=None, n_tokens=n_tokens)
        if w.good:
            return w
        p += 1
    return None


# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Tail:
    """What follows the body: SCKP walk, SDFT, and the regions that go."""

    sckp: SckpWalk | None = None
    sdft: SdftFound | None = None
    damaged_sdft: SdftFound | None = None


def analyse_tail(sf: SlotFile, view: memoryview, start: int, *, tgt_partial: tuple[str, ...] | None,
                 scan: bool = False) -> Tail:
    """Everything from ``start`` (the end of the body, or the start of a damaged body when
    ``scan``) to EOF."""
    end = len(view)
    t = Tail()
    n = sf.n_tokens
    p = start
    if scan:
        w = scan_sckp(sf, view, start, n)
        if w is not None:
            t.sckp = w
            p = w.stop
    elif end - start >= 4 and bytes(view[start : start + 4]) == g.SCKP_MAGIC or (
            0 < end - start < 4 and g.SCKP_MAGIC.startswith(bytes(view[start:end]))):
        t.sckp = walk_sckp(sf, view, start, tgt_partial=tgt_partial, n_tokens=n)
        p = t.sckp.stop
    elif end - start >= 12 and bytes(view[start : start + 4]) != g.SDFT_MAGIC:
        # an overwritten SCKP magic over intact entries: accept it if the entries validate
        w = walk_sckp(sf, view, start, tgt_partial=tgt_partial, n_tokens=n, require_magic=False)
        if w.good:
            t.sckp = w
            p = w.stop
    if p < end:
        advanced = t.sckp is None or t.sckp.stop > t.sckp.offset
        at_sdft = bytes(view[p : p + 4]) == g.SDFT_MAGIC or (end - p < 4 and g.SDFT_MAGIC.startswith(bytes(view[p:end])))
        if advanced and at_sdft and not (scan and t.sckp is None):
            found = parse_sdft_at(sf, view, p)
            if found.ok:
                t.sdft = found
            else:
                t.damaged_sdft = found
        else:  # damage before any SDFT: one may still sit intact at the end of the file
            t.sdft = scan_sdft(sf, view, p if scan and t.sckp is None else p + 1)
    return t


# ---------------------------------------------------------------------------------------
# what a damaged body still shows about the settings it was saved with


def probe_body(view: memoryview, start: int, end: int) -> dict[str, Any]:
    """Read the first KV stream header of a (possibly cut) body: n_stream, seq_id, cell ext,
    v_trans, K and V types.  Keys are missing where the bytes do not show them."""
    out: dict[str, Any] = {}

    def u32(p: int) -> int | None:
        return struct.unpack_from("<I", view, p)[0] if p + 4 <= end else None

    n_stream = u32(start)
    if n_stream is None or not 1 <= n_stream <= g.MAX_STREAMS:
        return out
    p = start + 4
    for si in range(n_stream):
        cc = u32(p)
        if cc is None:
            out["n_stream"] = n_stream
            return out
        p += 4
        if cc == 0:
            continue
        for ext in (0, 12, 8):
            stride = 12 + ext
            meta_end = p + cc * stride
            if meta_end + 8 > end:
                # the cut is inside the cell table: check the cells that are there
                avail = (end - p) // stride
                if avail and all(struct.unpack_from("<I", view, p + k * stride + 4)[0] == 1 for k in range(min(avail, 64))):
                    out.setdefault("n_stream", n_stream)
                    out.setdefault("seq_id", si if n_stream > 1 else struct.unpack_from("<i", view, p + stride - 4)[0])
                continue
            if not all(struct.unpack_from("<I", view, p + k * stride + 4)[0] == 1 for k in range(min(cc, 64))):
                continue
            v_trans, n_layer = struct.unpack_from("<II", view, meta_end)
            if v_trans not in (0, 1) or not 0 < n_layer <= g.MAX_LAYERS:
                continue
            out["n_stream"] = n_stream
            out["seq_id"] = si if n_stream > 1 else struct.unpack_from("<i", view, p + stride - 4)[0]
            out["ext"] = ext
            out["v_trans"] = v_trans
            q = meta_end + 8
            if q + 12 <= end:
                tk, row = struct.unpack_from("<iQ", view, q)
                if _kv_type_ok(tk):
                    out["type_k"] = tk
                    out["n_layer"] = n_layer
                    out["k_row"] = row
                    for _ in range(n_layer):
                        if q + 12 > end:
                            break
                        t_i, row_i = struct.unpack_from("<iQ", view, q)
                        if t_i != tk:
                            break
                        q += 12 + cc * row_i
                    else:
                        if q + 12 <= end:
                            tv = struct.unpack_from("<i", view, q)[0]
                            if _kv_type_ok(tv):
                                out["type_v"] = tv
            return out
        out.setdefault("n_stream", n_stream)
        return out
    out["n_stream"] = n_stream
    return out


def _kv_type_ok(type_id: int) -> bool:
    """A type llama.cpp accepts for a K/V cache (--cache-type-k/v)."""
    t = TYPES.get(type_id)
    return t is not None and t.name in KV_CACHE_TYPES


def _kv_settings_of(body: Body | None) -> dict[str, Any]:
    """v_trans / K / V types / n_stream of the first KV stream with cells of a parsed body."""
    out: dict[str, Any] = {}
    if body is None:
        return out
    for blk in body.blocks:
        if blk.kind != "KV":
            continue
        out.setdefault("n_stream", blk.n_stream)
        for st in blk.active_streams():
            if st.k and _kv_type_ok(st.k[0].type_id):
                out.setdefault("type_k", st.k[0].type_id)
            if blk.has_v and st.v and _kv_type_ok(st.v[0].type_id):
                out.setdefault("type_v", st.v[0].type_id)
                out.setdefault("v_trans", st.v_trans)
            if blk.n_stream > 1:
                out.setdefault("seq_id", st.index)
            elif st.cells is not None and st.cells.seq_ids.size:
                out.setdefault("seq_id", int(st.cells.seq_ids[0]))
    return out


# ======================================================================================
# options and outcome
# ======================================================================================


@dataclass(slots=True)
class Options:
    model: str | None = None
    draft_model: str | None = None
    flash_attn: bool | None = None  # truncate-recover: fills an unknown setting; re-save: the new one
    type_k: str | None = None
    type_v: str | None = None
    checkpoint_at: list[int] | None = None
    tokens: str | None = None  # re-save: "packed" or "plain"
    recompute: bool = False  # re-save: prefill instead of transposing V
    timeout: float = 600.0
    n_gpu_layers: int = 0
    # set between attempts when the output failed its test-load (truncate-recover)
    force_rebuild: str | None = None  # why the kept body is rebuilt anyway
    exclude_ckpt: dict[int, str] = field(default_factory=dict)  # input checkpoint index -> why
    exclude_dft: dict[int, str] = field(default_factory=dict)
    exclude_sdft: str | None = None


@dataclass(slots=True)
class Outcome:
    report: Report
    plan: Plan | None = None
    identity: bool = False  # the plan reproduces the input byte for byte
    temps: list[str] = field(default_factory=list)
    test_draft: bool = False
    ckpt_map: list[int] | None = None  # input checkpoint index of each output checkpoint
    rebuilt_body: bool = False


def _header_tokens_ok(sf: SlotFile, report: Report) -> None:
    """Refuse files whose header or token payload is not readable (nothing can be saved)."""
    if sf.format == "GGSN":
        raise Refused("a whole-context session file (GGSN): the repair commands handle slot files (GGSQ)")
    if sf.format != "GGSQ":
        raise Refused("not a slot file (no GGSQ magic)")
    bad = [p for p in sf.errors if p.section in ("header", "tokens") or p.section.startswith("tokens")]
    if bad or sf.tokens is None or (sf.tokens.form == "packed" and sf.tokens.raw is None):
        why = bad[0].line() if bad else "the token payload cannot be read"
        raise Refused(f"{why}: without the tokens nothing that would load can be saved")


def _body_ok(sf: SlotFile) -> bool:
    return (sf.body is not None and sf.body.layout is not None
            and not any(p.section == "body" or p.section.startswith("body.") for p in sf.errors))


def _tgt_partial(sf: SlotFile) -> tuple[str, ...] | None:
    return PARTIAL_OF.get(sf.body.memory_class) if sf.body is not None and sf.body.layout is not None else None


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _sckp_header(count: int) -> bytes:
    return g.SCKP_MAGIC + struct.pack("<II", 1, count)


def _words(sf: SlotFile) -> list[int]:
    n = sf.n_token_count or 0
    return [int(x) for x in np.frombuffer(_view(sf), dtype="<i4", count=n, offset=12)]


def _tokens(sf: SlotFile) -> list[int]:
    assert sf.tokens is not None
    return [int(x) for x in sf.tokens.tokens]


# ---------------------------------------------------------------------------------------
# appendices as they are kept (shared by truncate-recover and re-save)


def _plan_tail(plan: Plan, report: Report, sf: SlotFile, view: memoryview, tail: Tail, start: int,
               blob_writer: Callable[[Plan, BlobRef, str], None] | None = None) -> list[int]:
    """Add the kept appendices to ``plan`` and account for every byte from ``start`` to EOF.

    ``blob_writer(plan, ref, section)`` writes a kept blob's u64 length and data (default: a
    verbatim copy); re-save with a flash-attention flip passes a transposing writer.
    """
    src = sf.path
    end = len(view)
    accounted = start

    def copy_blob(p: Plan, ref: BlobRef, section: str) -> None:
        p.copy(src, ref.offset, 8 + ref.length)

    write_blob = blob_writer or copy_blob
    kept_map: list[int] = []
    w = tail.sckp
    if w is not None:
        if w.offset > accounted:
            report.drop("body", accounted, w.offset - accounted, "damaged body bytes before the checkpoints")
        good = w.good
        if not w.header_ok:  # the walk did not get past the header: all up to a found SDFT goes
            nxt = tail.sdft.offset if tail.sdft is not None else end
            report.drop("sckp", w.offset, nxt - w.offset, w.stop_reason or "damaged SCKP header")
            accounted = nxt
        else:
            identical = (w.magic_ok and w.count == len(w.entries) and len(good) == len(w.entries)
                         and all(e.dft.ok for e in good) and blob_writer is None)
            if good or (w.count == 0 and not w.entries and not w.stop_reason):
                if identical:
                    plan.copy(src, w.offset, 12)
                else:
                    plan.literal(_sckp_header(len(good)))
                    if w.count != len(good):
                        report.change("sckp", "count", w.count, len(good))
                    if not w.magic_ok:
                        report.change("sckp", "magic", bytes(view[w.offset : w.offset + 4]).hex(), g.SCKP_MAGIC.decode())
                report.keep("sckp.header", w.offset, 12, count=len(good))
            else:
                report.drop("sckp.header", w.offset, 12, "no complete checkpoint left: the appendix goes")
            k = 0
            for e in w.entries:
                sec = f"sckp.checkpoint[{e.index}]"
                if not e.ok:
                    report.drop(sec, e.offset, e.end - e.offset, e.reason, n_tokens=e.n_tokens)
                    continue
                if blob_writer is None and e.dft.ok:
                    plan.copy(src, e.offset, e.end - e.offset)
                else:
                    plan.copy(src, e.offset, 16)
                    write_blob(plan, e.tgt, f"{sec}.data_tgt")
                    if e.dft.ok and e.dft.length:
                        write_blob(plan, e.dft, f"{sec}.data_dft")
                    else:
                        plan.literal(_u64(0))
                    plan.copy(src, e.spec.offset, 8 + e.spec.length)
                if not e.dft.ok:
                    report.drop(f"{sec}.data_dft", e.dft.offset, 8 + e.dft.length, f"{e.dft.reason} (length set to 0)")
                    report.change(sec, "len_dft", e.dft.length, 0)
                report.keep(sec, e.offset, e.end - e.offset - (0 if e.dft.ok else e.dft.length), n_tokens=e.n_tokens)
                if e.index != k:
                    report.change(sec, "index", e.index, k)
                kept_map.append(e.index)
                k += 1
            accounted = w.stop
            if w.stop_reason:
                nxt = tail.sdft.offset if tail.sdft is not None and tail.sdft.offset >= w.stop else end
                report.drop(f"sckp.checkpoint[{len(w.entries)}]" if w.header_ok else "sckp", w.stop, nxt - w.stop,
                            f"damaged tail: {w.stop_reason}", n_tokens=w.cut_n_tokens)
                accounted = nxt
    if tail.sdft is not None:
        s = tail.sdft
        if s.offset > accounted:
            report.drop("trailing", accounted, s.offset - accounted, "unexplained bytes")
        if blob_writer is None:
            plan.copy(src, s.offset, s.end - s.offset)
        else:
            plan.copy(src, s.offset, 8)
            assert s.dft is not None and s.spec is not None
            if s.dft.length:
                write_blob(plan, s.dft, "sdft.data_dft")
            else:
                plan.copy(src, s.dft.offset, 8)
            plan.copy(src, s.spec.offset, 8 + s.spec.length)
        report.keep("sdft", s.offset, s.end - s.offset, **({"found_by": "scan"} if s.scanned else {}))
        accounted = s.end
    elif tail.damaged_sdft is not None:
        d = tail.damaged_sdft
        if d.offset > accounted:
            report.drop("trailing", accounted, d.offset - accounted, "unexplained bytes")
        report.drop("sdft", d.offset, end - d.offset, f"damaged draft appendix: {d.reason}")
        accounted = end
    if accounted < end:
        report.drop("trailing", accounted, end - accounted, "bytes after the last complete section")
    return kept_map


def _apply_exclusions(tail: Tail, opts: Options) -> None:
    """Entries and blobs that failed an earlier attempt's test-load go as if damaged."""
    if tail.sckp is not None:
        for e in tail.sckp.entries:
            if e.index in opts.exclude_ckpt and e.ok:
                e.ok, e.reason = False, f"data_tgt fails its test-load: {opts.exclude_ckpt[e.index]}"
            if e.index in opts.exclude_dft and e.dft.ok:
                e.dft.ok, e.dft.reason = False, f"fails its test-load in the draft model: {opts.exclude_dft[e.index]}"
    if opts.exclude_sdft and tail.sdft is not None:
        tail.damaged_sdft = SdftFound(tail.sdft.offset, tail.sdft.end, False,
                                      f"data_dft fails its test-load in the draft model: {opts.exclude_sdft}")
        tail.sdft = None


# ======================================================================================
# truncate-recover
# ======================================================================================


def truncate_recover(sf: SlotFile, opts: Options, workdir: str, *, dry_run: bool = False,
                     temps: list[str] | None = None, sink: list[Report] | None = None) -> Outcome:
    report = Report("truncate-recover", sf.path, input_size=sf.size, dry_run=dry_run)
    if sink is not None:
        sink.append(report)
    out = Outcome(report, temps=temps if temps is not None else [])
    _header_tokens_ok(sf, report)
    view = _view(sf)
    n = sf.n_tokens
    words_end = 12 + 4 * (sf.n_token_count or 0)
    if _body_ok(sf) and not opts.force_rebuild:
        assert sf.body is not None
        return _keep_body(sf, sf.body, view, report, out, opts)
    # the body is cut or damaged
    assert sf.body is not None
    body_err = next((p for p in sf.errors if p.section == "body" or p.section.startswith("body.")), None)
    what = body_err.line() if body_err else (f"the body parses but {opts.force_rebuild}" if opts.force_rebuild
                                             else "the body cannot be read")
    if opts.model is None:
        raise Refused(f"{what}; nothing that would load can be saved without the model "
                      f"(give --model to rebuild the state from the {n} stored tokens)")
    if sf.tokens is not None and sf.tokens.media:
        raise Refused(f"{what}; the tokens include {len(sf.tokens.media)} media chunk(s), which cannot be "
                      "prefilled without the multimodal projector")
    if n == 0:
        raise Refused(f"{what}; the payload holds no tokens to rebuild from")
    tail = analyse_tail(sf, view, sf.body.offset, tgt_partial=None, scan=True)
    _apply_exclusions(tail, opts)
    settings, sources = _settings_for_rebuild(sf, view, tail, opts, report.notes)
    if not dry_run and not opts.force_rebuild:
        # Where does llama.cpp's own loader end this body?  Bytes after a body are ignored by
        # it; a body the reader cannot delimit (zeros after it read like a cut hybrid body)
        # may load whole.  If it does and the prefix parses clean, keep it as it is.
        sub = _body_by_loader(sf, view, settings, opts, report)
        if sub is not None:
            return _keep_body(sf, sub, view, report, out, opts)
    w = tail.sckp
    if opts.checkpoint_at:
        at: list[int] | None = sorted({a for a in opts.checkpoint_at if 0 < a <= n})
        at_src = "--checkpoint-at"
    elif w is not None and w.known_n_tokens(n):
        at = w.known_n_tokens(n)
        at_src = "the damaged file's checkpoints"
    else:
        at = None  # the worker decides from the model
        at_src = "default"
    report.keep("header+tokens", 0, words_end, tokens=n)
    report.drop("body", sf.body.offset, (w.offset if w is not None else (tail.sdft.offset if tail.sdft else sf.size))
                - sf.body.offset, what)
    if dry_run:
        report.rebuild("body", None, f"would prefill {n} tokens through llama.cpp with {_describe_settings(settings)} "
                       f"and save with llama_state_seq_save_file",
                       tokens=n)
        report.rebuild("sckp", None, "would take checkpoints at n_tokens "
                       + (", ".join(map(str, at)) if at else "chosen from the model (recurrent/hybrid/SWA need them)")
                       + f" ({at_src})")
        _account_found(report, tail, sf)
        if not opts.force_rebuild:
            report.notes.append("a real run first test-loads the input: if llama.cpp restores its body whole, "
                                "that body is kept instead of being rebuilt")
        out.plan = None
        return out
    base, fd = create_temp(workdir, Path(sf.path).name, ".rebuild")
    os.close(fd)
    blobs, fd = create_temp(workdir, Path(sf.path).name, ".blobs")
    os.close(fd)
    out.temps += [base, blobs]
    from .rebuild import run_worker

    t0 = time.monotonic()
    res = run_worker({"op": "prefill", "model": opts.model, "draft_model": opts.draft_model,
                      "settings": settings, "draft_settings": None, "tokens": _tokens(sf), "words": _words(sf),
                      "checkpoints_at": at, "out": base, "blobs": blobs}, timeout=opts.timeout)
    report.timings["rebuild"] = time.monotonic() - t0
    if not res.ok:
        if res.crashed:
            raise Operational(f"rebuilding the state failed: {res.message}")
        raise Refused(f"{what}; rebuilding it failed: {res.message}")
    data = res.data
    used = data["settings"]
    base_size = int(data["file_size"])
    _same_geometry(sf, view, base, opts)
    with open(base, "rb") as f:
        new_version = struct.unpack("<III", f.read(12))[1]
    if new_version != sf.version:
        report.notes.append(f"the rebuilt file has state version {new_version} (the input had {sf.version}): "
                            f"only a llama.cpp that loads version {new_version} takes it")
    plan = Plan()
    plan.copy(base, 0, base_size)
    report.rebuild("body", base_size - words_end,
                   f"prefilled {n} tokens through llama.cpp ({_describe_settings(used)}; settings from "
                   f"{', '.join(sources) or 'defaults'}) and saved with llama_state_seq_save_file",
                   tokens=n, offset=words_end)
    if at is None and data["model"]["needs_checkpoints"]:
        report.notes.append("no checkpoint positions were known: took one near the end "
                            "(the model's memory cannot be rolled back without checkpoints)")
    # checkpoints: rebuilt target blobs; draft / spec blobs carried over from valid originals
    orig = {e.n_tokens: e for e in (w.good if w is not None else [])}
    cps = data["checkpoints"]
    if cps:
        plan.literal(_sckp_header(len(cps)))
        for i, c in enumerate(cps):
            plan.literal(struct.pack("<qii", c["n_tokens"], c["pos_min"], c["pos_max"]))
            t_off, t_len = c["tgt"]
            plan.literal(_u64(t_len))
            plan.copy(blobs, t_off, t_len)
            size = 16 + 8 + t_len + 16
            o = orig.get(c["n_tokens"])
            how = f"PARTIAL_ONLY state after {c['n_tokens']} tokens"
            if o is not None and o.dft.ok and o.dft.length:
                plan.copy(sf.path, o.dft.offset, 8 + o.dft.length)
                size += o.dft.length
                how += "; data_dft carried over from the damaged file"
            elif c.get("dft"):
                d_off, d_len = c["dft"]
                plan.literal(_u64(d_len))
                plan.copy(blobs, d_off, d_len)
                size += d_len
                how += "; data_dft rebuilt with the draft model"
            else:
                plan.literal(_u64(0))
                if o is not None and o.dft.length:
                    how += "; damaged data_dft dropped"
            if o is not None and o.spec.length:
                plan.copy(sf.path, o.spec.offset, 8 + o.spec.length)
                size += o.spec.length
                how += "; data_spec carried over"
            else:
                plan.literal(_u64(0))
            report.rebuild(f"sckp.checkpoint[{i}]", size, how, n_tokens=c["n_tokens"])
    if w is not None:
        for e in w.entries:
            report.drop(f"sckp.checkpoint[{e.index}]", e.offset, e.end - e.offset,
                        "replaced by a rebuilt checkpoint" if e.ok else e.reason, n_tokens=e.n_tokens)
    if tail.sdft is not None:
        plan.copy(sf.path, tail.sdft.offset, tail.sdft.end - tail.sdft.offset)
        report.keep("sdft", tail.sdft.offset, tail.sdft.end - tail.sdft.offset, found_by="scan")
    elif data.get("draft"):
        d_off, d_len = data["draft"]
        plan.literal(g.SDFT_MAGIC + struct.pack("<I", 1) + _u64(d_len))
        plan.copy(blobs, d_off, d_len)
        plan.literal(_u64(0))
        report.rebuild("sdft", 24 + d_len, "draft state rebuilt by prefilling the draft model")
    if tail.damaged_sdft is not None:
        report.drop("sdft", tail.damaged_sdft.offset, sf.size - tail.damaged_sdft.offset, tail.damaged_sdft.reason)
    out.plan = plan
    out.test_draft = bool(opts.draft_model)
    out.rebuilt_body = True
    return out


def _same_geometry(sf: SlotFile, view: memoryview, rebuilt: str, opts: Options) -> None:
    """Refuse a rebuild whose state does not have the damaged file's shape: the model given
    is not the one that wrote the file (a rebuild would silently swap the model's state in)."""
    assert sf.body is not None
    new = open_slot_file(rebuilt)
    try:
        if new.body is None or new.body.layout is None:
            raise Refused("the rebuilt state does not parse (a llama.cpp build this reader does not know?)")
        got = probe_body(_view(new), new.body.offset, new.body.end)
        if opts.force_rebuild and sf.body.layout is not None:
            old_sizes = [b.size for b in sf.body.blocks]
            new_sizes = [b.size for b in new.body.blocks]
            if sf.body.layout.kinds != new.body.layout.kinds or old_sizes != new_sizes:
                raise Refused(f"the model does not match the file: the rebuilt state is "
                              f"{new.body.layout.describe()} of {new_sizes} bytes, the file's "
                              f"{sf.body.layout.describe()} of {old_sizes} bytes (is this the model that wrote it?)")
            return
        want = probe_body(view, sf.body.offset, len(view))
        if new.body.blocks and new.body.blocks[0].kind == "KV" and len(new.body.blocks[0].streams) != want.get(
                "n_stream", len(new.body.blocks[0].streams)):
            raise Refused("the rebuilt state has another stream count than the file")
        for key in ("n_layer", "k_row", "ext"):
            if key in want and key in got and want[key] != got[key]:
                raise Refused(f"the model does not match the file: {key.replace('_', ' ')} {got[key]} in the "
                              f"rebuilt state, {want[key]} in the file (is this the model that wrote it?)")
    finally:
        _close(new)


def _keep_body(sf: SlotFile, body: Body, view: memoryview, report: Report, out: Outcome, opts: Options) -> Outcome:
    """Keep header, tokens and ``body`` verbatim; salvage what follows it."""
    plan = Plan()
    plan.copy(sf.path, 0, body.end)
    report.keep("header+tokens", 0, body.offset, tokens=sf.n_tokens)
    report.keep("body", body.offset, body.size, layout=body.layout.describe() if body.layout else None)
    partial = PARTIAL_OF.get(body.memory_class) if body.layout is not None else None
    tail = analyse_tail(sf, view, body.end, tgt_partial=partial)
    _apply_exclusions(tail, opts)
    out.ckpt_map = _plan_tail(plan, report, sf, view, tail, body.end)
    out.plan = plan
    out.identity = plan.is_identity(sf.path, sf.size)
    out.test_draft = bool(opts.draft_model)
    return out


def _body_by_loader(sf: SlotFile, view: memoryview, settings: dict[str, Any], opts: Options,
                    report: Report) -> Body | None:
    """Test-load the input itself; when llama.cpp restores it and the bytes up to where it
    stopped parse clean, that is the body."""
    if settings.get("flash_attn") is None or settings.get("type_k") is None or settings.get("type_v") is None:
        return None
    from .loader import LoaderError, LoadSettings, test_load
    from .reader import parse_buffer

    n_seq = int(settings.get("n_seq_max") or 1)
    unified = bool(settings.get("kv_unified"))
    per = max(256, -(-(sf.n_tokens + 1) // 256) * 256)
    ls = LoadSettings(per if unified or n_seq == 1 else per * n_seq, n_seq, unified or n_seq == 1,
                      bool(settings["flash_attn"]), _tid(settings["type_k"]), _tid(settings["type_v"]),
                      opts.n_gpu_layers, int(settings.get("seq_id") or 0))
    t0 = time.monotonic()
    try:
        res = test_load(sf.path, opts.model, None, ls, timeout=opts.timeout)  # type: ignore[arg-type]
    except LoaderError as e:
        raise Operational(str(e)) from None
    finally:
        report.timings["probe-load"] = time.monotonic() - t0
    end = int(res.body_bytes or 0)
    if not res.ok or not sf.body or end <= sf.body.offset or end >= sf.size:
        return None
    sub = parse_buffer(view[:end], sf.path)
    if not _body_ok(sub) or sub.body is None or sub.body.end != end or sub.errors:
        return None
    report.notes.append(f"llama.cpp restores the body and stops at offset {end}: the {sf.size - end} bytes "
                        "after it are not part of it (the reader alone could not tell)")
    return sub.body


def _tid(v: Any) -> int:
    if isinstance(v, int):
        return v
    t = BY_NAME.get(str(v))
    if t is None:
        raise Refused(f"unknown cache type {v!r}")
    return t.id


def _account_found(report: Report, tail: Tail, sf: SlotFile) -> None:
    w = tail.sckp
    if w is not None:
        for e in w.entries:
            report.drop(f"sckp.checkpoint[{e.index}]", e.offset, e.end - e.offset,
                        "would be replaced by a rebuilt checkpoint" if e.ok else e.reason, n_tokens=e.n_tokens)
    if tail.sdft is not None:
        report.keep("sdft", tail.sdft.offset, tail.sdft.end - tail.sdft.offset, found_by="scan")


def _settings_for_rebuild(sf: SlotFile, view: memoryview, tail: Tail, opts: Options,
                          notes: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The settings the damaged file was saved with, from whatever still shows them."""
    assert sf.body is not None
    s: dict[str, Any] = {"n_ctx": None, "n_seq_max": None, "kv_unified": None, "flash_attn": None,
                         "type_k": None, "type_v": None, "n_gpu_layers": opts.n_gpu_layers, "seq_id": None}
    sources: list[str] = []
    found: dict[str, Any] = {}

    def take(d: dict[str, Any], name: str) -> None:
        got = False
        for k, v in d.items():
            if k not in found and v is not None:
                found[k] = v
                got = True
        if got:
            sources.append(name)

    take(probe_body(view, sf.body.offset, len(view)), "the body's first bytes")
    if tail.sckp is not None:
        for e in tail.sckp.good:
            take(_kv_settings_of(e.tgt.info.body if e.tgt.info else None), f"checkpoint at {e.n_tokens} tokens")
            if e.tgt.info is not None and e.tgt.info.seq_id is not None:
                found.setdefault("seq_id_blob", e.tgt.info.seq_id)
    if tail.sdft is not None and tail.sdft.dft is not None and tail.sdft.dft.info is not None:
        d = _kv_settings_of(tail.sdft.dft.info.body)
        if "v_trans" in d and "v_trans" not in found:
            found["v_trans"] = d["v_trans"]
            sources.append("the draft state's V layout")
    if "v_trans" in found:
        s["flash_attn"] = found["v_trans"] == 0
    for k in ("type_k", "type_v"):
        if k in found:
            s[k] = type_name(found[k])
    n_stream = found.get("n_stream")
    seq_id = found.get("seq_id", found.get("seq_id_blob"))
    if n_stream and n_stream > 1:
        s["n_seq_max"], s["kv_unified"] = n_stream, False
    elif seq_id:
        s["n_seq_max"], s["kv_unified"] = int(seq_id) + 1, True  # one stream shared by several slots
    else:
        s["n_seq_max"], s["kv_unified"] = 1, False
    s["seq_id"] = int(seq_id or 0)
    if opts.flash_attn is not None:
        if s["flash_attn"] is not None and s["flash_attn"] != opts.flash_attn:
            sources.append("--flash-attn (overriding the file)")
        s["flash_attn"] = opts.flash_attn
    for k, v in (("type_k", opts.type_k), ("type_v", opts.type_v)):
        if v is not None:
            s[k] = v
    if s["type_v"] is None and s["type_k"] is not None:
        s["type_v"] = s["type_k"]
        notes.append(f"the file was cut before its V cache: assumed V type = K type ({s['type_k']}); "
                     "give --cache-type-v if the server used another")
    if s["flash_attn"] is None and s["type_v"] is not None and BY_NAME.get(str(s["type_v"])) is not None \
            and BY_NAME[str(s["type_v"])].id not in TRANSPOSABLE:
        s["flash_attn"] = True  # a quantized V cache exists only with flash attention
        notes.append(f"flash attention on: a {s['type_v']} V cache exists only with flash attention")
    return s, sources


def _describe_settings(s: dict[str, Any]) -> str:
    fa = {True: "on", False: "off", None: "unknown"}[s.get("flash_attn")]
    parts = [f"flash attention {fa}", f"K {s.get('type_k') or 'unknown'}", f"V {s.get('type_v') or 'unknown'}",
             f"n_seq_max {s.get('n_seq_max')}" + (" unified" if s.get("kv_unified") else ""), f"seq {s.get('seq_id')}"]
    return ", ".join(parts)


# ======================================================================================
# strip-draft
# ======================================================================================


def strip_draft(sf: SlotFile, opts: Options, workdir: str, *, dry_run: bool = False,
                temps: list[str] | None = None, sink: list[Report] | None = None) -> Outcome:
    report = Report("strip-draft", sf.path, input_size=sf.size, dry_run=dry_run)
    if sink is not None:
        sink.append(report)
    out = Outcome(report, temps=temps if temps is not None else [])
    _header_tokens_ok(sf, report)
    if not _body_ok(sf):
        raise Refused("the body is cut or damaged; run truncate-recover first")
    if sf.errors:
        raise Refused(f"{sf.errors[0].line()}; run truncate-recover first")
    assert sf.body is not None
    plan = Plan()
    plan.copy(sf.path, 0, sf.body.end)
    report.keep("header+tokens", 0, sf.body.offset, tokens=sf.n_tokens)
    report.keep("body", sf.body.offset, sf.body.size, layout=sf.body.layout.describe() if sf.body.layout else None)
    if sf.sckp is not None:
        plan.copy(sf.path, sf.sckp.offset, 12)
        report.keep("sckp.header", sf.sckp.offset, 12, count=sf.sckp.count)
        for ck in sf.checkpoints:
            sec = f"sckp.checkpoint[{ck.index}]"
            if not ck.dft.length and not ck.spec.length:
                plan.copy(sf.path, ck.offset, ck.end - ck.offset)
                report.keep(sec, ck.offset, ck.end - ck.offset, n_tokens=ck.n_tokens)
                continue
            plan.copy(sf.path, ck.offset, ck.tgt.data_offset + ck.tgt.length - ck.offset)
            plan.literal(_u64(0) + _u64(0))
            report.keep(sec, ck.offset, ck.tgt.data_offset + ck.tgt.length - ck.offset + 16, n_tokens=ck.n_tokens)
            if ck.dft.length:
                report.drop(f"{sec}.data_dft", ck.dft.offset, 8 + ck.dft.length, "draft state (length set to 0)")
                report.change(sec, "len_dft", ck.dft.length, 0)
            if ck.spec.length:
                report.drop(f"{sec}.data_spec", ck.spec.offset, 8 + ck.spec.length, "speculative state (length set to 0)")
                report.change(sec, "len_spec", ck.spec.length, 0)
    if sf.draft is not None:
        report.drop("sdft", sf.draft.offset, sf.draft.end - sf.draft.offset, "draft appendix removed")
    out.plan = plan
    out.identity = plan.is_identity(sf.path, sf.size)
    return out


# ======================================================================================
# re-save
# ======================================================================================


def _file_flash_attn(sf: SlotFile) -> bool | None:
    vt = _kv_settings_of(sf.body).get("v_trans")
    return None if vt is None else vt == 0


def _new_words(sf: SlotFile, form: str | None) -> tuple[list[int], str]:
    assert sf.tokens is not None
    words = _words(sf)
    cur = sf.tokens.form if sf.tokens.form != "empty" else "plain"
    if form is None or form == cur:
        return words, cur
    toks = _tokens(sf)
    if form == "plain":
        if sf.tokens.media:
            raise Refused(f"the payload holds {len(sf.tokens.media)} media chunk(s): a plain token list cannot carry them")
        return toks, "plain"
    return [g.PACKED_MARKER, g.SERVER_TOKENS_VERSION, len(toks), *toks, 0], "packed"


def _transposing_writer(sf: SlotFile, to_v_trans: int, report: Report) -> Callable[[Plan, BlobRef, str], None]:
    def write(plan: Plan, ref: BlobRef, section: str) -> None:
        info = ref.info
        plan.copy(sf.path, ref.offset, 16)  # u64 length + io_magic + seq_id
        if info is None or info.body is None:
            raise Refused(f"{section}: blob not parsed, cannot flip its V layout")
        n = _transpose_body(plan, sf, info.body, ref.data_offset + 8, ref.end, to_v_trans, section)
        if n:
            report.change(section, "v_trans", 1 - to_v_trans, to_v_trans, v_layers=n)
    return write


def _transpose_body(plan: Plan, sf: SlotFile, body: Body, start: int, end: int, to_v_trans: int, section: str) -> int:
    """Copy ``start..end`` with every KV stream's V rewritten for ``to_v_trans``; returns the
    number of V layers flipped."""
    assert isinstance(plan, TPlan)
    pos = start
    flipped = 0
    for blk in body.blocks:
        if blk.kind != "KV" or not blk.has_v:
            continue
        for st, sc in zip(blk.streams, blk.raw.streams):
            if not st.cell_count or sc.data is None or st.v_trans == to_v_trans:
                continue
            cells = st.cell_count
            vt = int(sc.data.v_trans_offset)
            plan.copy(sf.path, pos, vt - pos)
            plan.literal(struct.pack("<I", to_v_trans))
            pos = vt + 4
            for run in st.v:
                t = TYPES.get(run.type_id)
                if t is None or run.type_id not in TRANSPOSABLE:
                    raise Refused(f"{section}: V of type {type_name(run.type_id)} cannot be stored transposed "
                                  "(flash attention off needs an f32/f16/bf16 V cache)")
                el = t.type_size
                plan.copy(sf.path, pos, run.offset - pos)
                if to_v_trans == 0:  # element-major [n_embd x cells] -> rows [cells x n_embd]
                    n_embd = int(run.n_embd or 0)
                    plan.literal(struct.pack("<iQ", run.type_id, n_embd * el))
                    plan.transposed(sf.path, run.data.offset, n_embd, cells, el)  # type: ignore[attr-defined]
                else:
                    n_embd = run.row_size // el
                    plan.literal(struct.pack("<iII", run.type_id, el, n_embd))
                    plan.transposed(sf.path, run.data.offset, cells, n_embd, el)  # type: ignore[attr-defined]
                pos = run.data.offset + run.data.length
                flipped += 1
    plan.copy(sf.path, pos, end - pos)
    return flipped


def resave(sf: SlotFile, opts: Options, workdir: str, *, dry_run: bool = False,
           temps: list[str] | None = None, sink: list[Report] | None = None) -> Outcome:
    report = Report("re-save", sf.path, input_size=sf.size, dry_run=dry_run)
    if sink is not None:
        sink.append(report)
    out = Outcome(report, temps=temps if temps is not None else [])
    _header_tokens_ok(sf, report)
    if opts.model is None:
        raise Refused("re-save needs --model")
    if not _body_ok(sf):
        raise Refused("the body is cut or damaged; run truncate-recover --model first")
    assert sf.body is not None
    from .loader import settings_for

    view = _view(sf)
    settings = _settings_dict(settings_for(sf, n_gpu_layers=opts.n_gpu_layers))
    file_fa = _file_flash_attn(sf)
    new_fa = file_fa if opts.flash_attn is None else opts.flash_attn
    flip = file_fa is not None and new_fa != file_fa
    new_words, form = _new_words(sf, opts.tokens)
    tail = analyse_tail(sf, view, sf.body.end, tgt_partial=_tgt_partial(sf))
    n = sf.n_tokens
    old_form = sf.tokens.form if sf.tokens is not None else "empty"
    if new_words != _words(sf):
        report.change("tokens", "form", old_form, form, words_before=sf.n_token_count, words_after=len(new_words))
    if file_fa is None and opts.flash_attn is not None:
        report.notes.append("the state holds no V cache: flash attention does not change its bytes")
        settings["flash_attn"] = opts.flash_attn
    method = "load+save"
    if flip:
        method = "prefill" if opts.recompute else "transpose"
    words_end = 12 + 4 * len(new_words)
    if dry_run:
        how = {"load+save": "would load the body with llama_state_seq_load_file and write it again with "
                            "llama_state_seq_save_file",
               "transpose": f"would rewrite V as {'rows (flash attention on)' if new_fa else 'transposed (flash attention off)'} "
                            "byte for byte, then load and save it through llama.cpp",
               "prefill": f"would prefill {n} tokens with flash attention {'on' if new_fa else 'off'}"}[method]
        report.rebuild("body", sf.body.size, how, tokens=n)
        _plan_tail(Plan(), report, sf, view, tail, sf.body.end)
        return out
    from .rebuild import run_worker

    plan: Plan = TPlan()
    t0 = time.monotonic()
    base, fd = create_temp(workdir, Path(sf.path).name, ".resave")
    os.close(fd)
    out.temps.append(base)
    new_settings = dict(settings)
    new_settings["flash_attn"] = new_fa if new_fa is not None else settings.get("flash_attn")
    if method == "prefill":
        blobs, fd = create_temp(workdir, Path(sf.path).name, ".blobs")
        os.close(fd)
        out.temps.append(blobs)
        at = [e.n_tokens for e in (tail.sckp.good if tail.sckp else [])]
        res = run_worker({"op": "prefill", "model": opts.model, "draft_model": opts.draft_model,
                          "settings": new_settings, "tokens": _tokens(sf), "words": new_words,
                          "checkpoints_at": at, "out": base, "blobs": blobs}, timeout=opts.timeout)
        report.timings["llama.cpp"] = time.monotonic() - t0
        _worker_ok(res, "recomputing the state")
        size = int(res.data["file_size"])
        plan.copy(base, 0, size)
        report.rebuild("body", size - words_end,
                       f"recomputed: prefilled {n} tokens with flash attention {'on' if new_fa else 'off'} (a context "
                       "with the other setting cannot take the old state directly); values may differ slightly "
                       "from the original's", tokens=n, offset=words_end)
        _plan_rebuilt_tail(plan, report, sf, tail, res.data, blobs, words_end)
    else:
        src = sf.path
        if method == "transpose":
            # header + tokens + body with V flipped, loaded and saved through llama.cpp
            tplan = TPlan()
            tplan.literal(struct.pack("<III", g.GGSQ_MAGIC, sf.version or 0, len(new_words)))
            tplan.literal(np.asarray(new_words, dtype="<i4").tobytes())
            flipped = _transpose_body(tplan, sf, sf.body, sf.body.offset, sf.body.end, 0 if new_fa else 1, "body")
            flat, fd = create_temp(workdir, Path(sf.path).name, ".flip")
            out.temps.append(flat)
            try:
                _write_with_transposed(tplan, fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            src = flat
            report.notes.append(f"flash attention {'off -> on' if new_fa else 'on -> off'}: {flipped} V layer(s) "
                                "rewritten byte for byte (the same values in the other layout; no recompute)")
        res = run_worker({"op": "resave", "model": opts.model, "settings": new_settings if method == "transpose" else settings,
                          "in": src, "capacity": max(sf.n_token_count or 0, len(new_words)) + 16,
                          "words": new_words, "out": base, "n_tokens": n}, timeout=opts.timeout)
        report.timings["llama.cpp"] = time.monotonic() - t0
        _worker_ok(res, "loading and saving the state")
        size = int(res.data["file_size"])
        plan.copy(base, 0, size)
        how = ("loaded with llama_state_seq_load_file and written again with llama_state_seq_save_file"
               if method == "load+save" else
               f"V layout flipped for flash attention {'on' if new_fa else 'off'}, then loaded and saved through llama.cpp")
        report.rebuild("body", size - words_end, how, tokens=n, offset=words_end)
        if new_words == _words(sf):
            report.keep("tokens", 12, 4 * len(new_words), tokens=n)
        writer = _transposing_writer(sf, 0 if new_fa else 1, report) if method == "transpose" else None
        out.ckpt_map = _plan_tail(plan, report, sf, view, tail, sf.body.end, blob_writer=writer)
    out.plan = plan
    out.test_draft = bool(opts.draft_model)
    return out


def _plan_rebuilt_tail(plan: Plan, report: Report, sf: SlotFile, tail: Tail, data: dict[str, Any], blobs: str,
                       words_end: int) -> None:
    """Checkpoints and draft state after a recompute under another flash-attention setting."""
    cps = data["checkpoints"]
    orig = {e.n_tokens: e for e in (tail.sckp.good if tail.sckp else [])}
    if cps or (tail.sckp is not None and tail.sckp.header_ok and not tail.sckp.entries):
        plan.literal(_sckp_header(len(cps)))
    for i, c in enumerate(cps):
        o = orig.get(c["n_tokens"])
        plan.literal(struct.pack("<qii", c["n_tokens"], c["pos_min"], c["pos_max"]))
        t_off, t_len = c["tgt"]
        plan.literal(_u64(t_len))
        plan.copy(blobs, t_off, t_len)
        size = 40 + t_len
        how = f"recomputed PARTIAL_ONLY state after {c['n_tokens']} tokens"
        if c.get("dft"):
            d_off, d_len = c["dft"]
            plan.literal(_u64(d_len))
            plan.copy(blobs, d_off, d_len)
            size += d_len
            how += "; data_dft recomputed with the draft model"
        else:
            plan.literal(_u64(0))
            if o is not None and o.dft.length:
                report.drop(f"sckp.checkpoint[{i}].data_dft", o.dft.offset, 8 + o.dft.length,
                            "its V layout no longer matches (give --draft-model to recompute it)")
        if o is not None and o.spec.length:
            plan.copy(sf.path, o.spec.offset, 8 + o.spec.length)
            size += o.spec.length
            how += "; data_spec carried over"
        else:
            plan.literal(_u64(0))
        report.rebuild(f"sckp.checkpoint[{i}]", size, how, n_tokens=c["n_tokens"])
    if tail.sdft is not None:
        s = tail.sdft
        assert s.dft is not None and s.spec is not None
        if data.get("draft"):
            d_off, d_len = data["draft"]
            plan.literal(g.SDFT_MAGIC + struct.pack("<I", 1) + _u64(d_len))
            plan.copy(blobs, d_off, d_len)
            plan.copy(sf.path, s.spec.offset, 8 + s.spec.length)
            report.rebuild("sdft", 24 + d_len + s.spec.length, "draft state recomputed with the draft model")
        elif s.spec.length:
            plan.literal(g.SDFT_MAGIC + struct.pack("<I", 1) + _u64(0))
            plan.copy(sf.path, s.spec.offset, 8 + s.spec.length)
            if s.dft.length:
                report.drop("sdft.data_dft", s.dft.offset, 8 + s.dft.length,
                            "its V layout no longer matches (give --draft-model to recompute it)")
            report.keep("sdft.data_spec", s.spec.offset, 8 + s.spec.length)
        else:
            report.drop("sdft", s.offset, s.end - s.offset,
                        "its V layout no longer matches (give --draft-model to recompute it)")


def _worker_ok(res: Any, what: str) -> None:
    if res.ok:
        return
    if res.crashed:
        raise Operational(f"{what} failed: {res.message}")
    raise Refused(f"{what} failed: {res.message}")


def _settings_dict(s: Any) -> dict[str, Any]:
    from .rebuild import settings_dict

    d = settings_dict(s) or {}
    for k in ("type_k", "type_v"):
        v = d.get(k)
        if isinstance(v, str) and v in BY_NAME:
            d[k] = v
    return d


# ======================================================================================
# executing an outcome
# ======================================================================================


def make_check(opts: Options, test_draft: bool, report: Report) -> Callable[[str], tuple[bool, str]]:
    """The check every written file passes: a clean re-read and, with a model, a test-load."""

    def check(path: str) -> tuple[bool, str]:
        t0 = time.monotonic()
        sf = open_slot_file(path)
        try:
            errs = sf.errors
            if errs:
                return False, f"the output still reads with errors: {errs[0].line()}"
            if opts.model is None:
                return True, ""
            from .loader import settings_for

            from .loader import LoaderError, LoaderPool

            try:
                tiny = os.path.getsize(opts.model) < 64 << 20  # ggml's spinning threads only cost there
                with LoaderPool(opts.model, opts.draft_model if test_draft else None,
                                n_gpu_layers=opts.n_gpu_layers, threads=1 if tiny else None) as pool:
                    have = pool.state_seq_version
                    if have is not None and sf.version is not None and sf.version != have:
                        report.test_load = {"ok": None, "message": f"skipped: the file has state version "
                                            f"{sf.version}, the installed llama.cpp loads version {have} only"}
                        report.notes.append(report.test_load["message"])
                        return True, ""
                    res = pool.load(path, settings_for(sf, n_gpu_layers=opts.n_gpu_layers), timeout=opts.timeout,
                                    sf=sf)
            except LoaderError as e:
                raise Operational(str(e)) from None
        finally:
            _close(sf)
        report.timings["test-load"] = time.monotonic() - t0
        report.test_load = {"ok": bool(res.ok), "message": res.message, "body_bytes": res.body_bytes,
                            "checkpoints": [list(c) for c in res.checkpoints],
                            "draft": list(res.draft) if res.draft is not None else None,
                            "checkpoint_drafts": [list(c) for c in res.checkpoint_drafts],
                            "crashed": bool(res.crashed)}
        if not res.ok:
            return False, f"test-load through llama.cpp failed: {res.message}"
        bad = [f"checkpoint {i}: {m}" for i, (ok, m) in enumerate(res.checkpoints) if not ok]
        bad += [f"checkpoint {i} data_dft: {m}" for i, (ok, m) in enumerate(res.checkpoint_drafts) if not ok]
        if res.draft is not None and not res.draft[0]:
            bad.append(f"SDFT data_dft: {res.draft[1]}")
        if bad:
            report.test_load["ok"] = False
            return False, "test-load through llama.cpp failed: " + "; ".join(bad)
        return True, ""

    return check


def _close(sf: SlotFile) -> None:
    buf = sf.buffer
    sf.buffer = None
    close = getattr(buf, "close", None)
    if close is not None:
        try:
            close()
        except BufferError:  # numpy views still alive: the mapping goes with them
            pass


OPERATIONS = {"truncate-recover": truncate_recover, "strip-draft": strip_draft, "re-save": resave}


def _plan_equals(plan: Plan, path: str, size: int) -> bool:
    """Whether ``plan`` would write exactly the bytes of ``path`` (compared chunk-wise; ranges
    of ``path`` at their own offset are equal by construction)."""
    if plan.size != size:
        return False
    if plan.is_identity(path, size):
        return True
    pos = 0
    with open(path, "rb") as f:
        for piece in plan.pieces:
            if isinstance(piece, Range) and piece.path == path and piece.offset == pos:
                pos += piece.length
                continue
            if isinstance(piece, Transposed):
                return False  # a flip always changes bytes
            left, at = piece.length, pos
            while left:
                k = min(left, 1 << 22)
                f.seek(at)
                mine = f.read(k)
                theirs = piece.data[at - pos : at - pos + k] if isinstance(piece, Literal) else _read(piece, at - pos, k)
                if mine != theirs:
                    return False
                at += k
                left -= k
            pos += piece.length
    return True


def _read(piece: Range, off: int, n: int) -> bytes:
    with open(piece.path, "rb") as f:
        f.seek(piece.offset + off)
        return f.read(n)


def _retry(command: str, outcome: Outcome, opts: Options, report: Report) -> str | None:
    """After a failed test-load: what to change for another attempt (None: give up)."""
    tl = report.test_load
    if command != "truncate-recover" or tl is None:
        return None
    if not tl.get("ok") and not tl.get("body_bytes"):
        if outcome.rebuilt_body or opts.force_rebuild:
            return None
        opts.force_rebuild = f"llama.cpp refuses it ({tl.get('message')})"
        return "the kept body failed its test-load: rebuilt it from the tokens"
    if outcome.ckpt_map is None:
        return None
    what = []
    for k, (ok, msg) in enumerate(tl.get("checkpoints") or []):
        if not ok and k < len(outcome.ckpt_map):
            opts.exclude_ckpt[outcome.ckpt_map[k]] = msg
            what.append(f"checkpoint {outcome.ckpt_map[k]}")
    for k, (ok, msg) in enumerate(tl.get("checkpoint_drafts") or []):
        if not ok and k < len(outcome.ckpt_map):
            opts.exclude_dft[outcome.ckpt_map[k]] = msg
            what.append(f"checkpoint {outcome.ckpt_map[k]} data_dft")
    d = tl.get("draft")
    if d is not None and not d[0]:
        opts.exclude_sdft = d[1]
        what.append("the SDFT draft state")
    if not what:
        return None
    return "dropped what failed its test-load: " + ", ".join(what)


def run(command: str, input_path: str, target: Target | None, opts: Options, *, dry_run: bool = False) -> Report:
    """Plan and (unless ``dry_run``) write one repair; never raises for an expected failure."""
    t0 = time.monotonic()
    report = Report(command, input_path, dry_run=dry_run)
    if target is not None:
        report.output, report.in_place, report.backup = target.output, target.in_place, target.backup
    outcome: Outcome | None = None
    retries: list[str] = []
    temps: list[str] = []  # every scratch file any attempt made: removed at the end
    try:
        for m in (opts.model, opts.draft_model):
            if m is not None and not os.path.isfile(m):
                raise Operational(f"model {m} not found")
        workdir = target.directory if target is not None else (os.path.dirname(os.path.abspath(input_path)) or ".")
        for attempt in range(4):
            try:
                sf = open_slot_file(input_path)
            except OSError as e:
                raise Operational(f"{input_path}: {e.strerror or e}") from None
            report.input_size = sf.size
            sink: list[Report] = []
            try:
                outcome = OPERATIONS[command](sf, opts, workdir, dry_run=dry_run, temps=temps, sink=sink)
            except Refused:
                if sink:  # what the operation found before it had to give up
                    r = sink[-1]
                    r.output, r.in_place, r.backup = report.output, report.in_place, report.backup
                    r.timings = report.timings | r.timings
                    r.notes = report.notes + r.notes
                    report = r
                raise
            r = outcome.report
            r.output, r.in_place, r.backup = report.output, report.in_place, report.backup
            r.timings = {k: report.timings.get(k, 0.0) + r.timings.get(k, 0.0) for k in {*report.timings, *r.timings}}
            r.notes = [f"first attempt: {x}" if i == 0 and len(retries) == 1 else x for i, x in enumerate(retries)] + r.notes
            report = r
            plan = outcome.plan
            if dry_run:
                report.status = "dry-run"
                report.output_size = plan.size if plan is not None else None
                report.plan = describe_plan(plan) if plan is not None and not any(
                    isinstance(p, Transposed) for p in plan.pieces) else None
                if outcome.identity:
                    report.notes.append("nothing to do: the output would be a byte-identical copy")
                return report
            assert plan is not None and target is not None
            report.output_size = plan.size
            identity = outcome.identity or _plan_equals(plan, sf.path, sf.size)
            if identity:
                report.status = "nothing-to-do"
                if target.in_place:
                    report.notes.append("the file is left as it is (no backup needed)")
                    report.backup = None
                    return report
                report.notes.append("the output is a byte-identical copy of the input")
            check = make_check(opts, outcome.test_draft, report)
            _close(sf)
            try:
                done = _commit_plan(plan, target, check)
                for path in done.cleaned:
                    report.notes.append(f"removed {path}, a temporary file left by an earlier run that was killed")
            except CheckFailed as e:
                why = _retry(command, outcome, opts, report) if attempt < 3 else None
                if why is None:
                    raise
                retries.append(f"{e} -> {why}")
                while temps:
                    unlink_quiet(temps.pop())
                continue
            if report.status != "nothing-to-do":
                report.status = "repaired"
            return report
        raise AssertionError("unreachable")
    except Refused as e:
        report.status, report.exit_code, report.reason = "refused", PROBLEMS, str(e)
        if retries and not any(n.startswith("first attempt") for n in report.notes):
            report.notes.append(f"first attempt: {retries[0]}")
        return report
    except CheckFailed as e:
        report.status, report.exit_code, report.reason = "check-failed", PROBLEMS, str(e)
        return report
    except WriteRefused as e:
        report.status, report.exit_code, report.reason = "error", USAGE, str(e)
        return report
    except Operational as e:
        report.status, report.exit_code, report.reason = "error", OPERATIONAL, str(e)
        return report
    except OSError as e:
        report.status, report.exit_code, report.reason = "error", OPERATIONAL, f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")
        return report
    finally:
        for t in temps:
            unlink_quiet(t)
        report.timings["total"] = time.monotonic() - t0
