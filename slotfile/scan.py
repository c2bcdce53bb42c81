"""Full data scan: is every K/V/R/S value finite?

Works in place on the mmap in bounded chunks, on several threads (numpy releases the GIL in
its loops), and drops each chunk's pages after use (``MADV_DONTNEED``), so peak RSS follows
the chunk size, not the file size.  The test per value is an exponent-bits check done on
64-bit words: with the exponent field masked, adding one unit below it carries into the sign
position exactly when the exponent is all ones (inf or NaN), and lanes never carry into each
other (f16: ``(w & 0x7C00..) + 0x0400..`` sets bit 15 of a lane iff that lane is inf/NaN).
Quantized rows are checked through their f16 block scales (``d``, and ``m`` for *_1 types).
"""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .ggml_types import TYPES
from .reader import LayerRun, SlotFile

CHUNK = 1 << 20  # bytes per task: large enough to amortise, small enough for the caches

# per element type: (lane bits, exponent mask, carry unit, sign bits) replicated over 64 bits
_LANES = {
    1: (0x7C007C007C007C00, 0x0400040004000400, 0x8000800080008000),  # f16
    30: (0x7F807F807F807F80, 0x0080008000800080, 0x8000800080008000),  # bf16
    0: (0x7F8000007F800000, 0x0080000000800000, 0x8000000080000000),  # f32
}
_ELEM = {0: 4, 1: 2, 30: 2}
# quantized block types whose first half (d) - and for *_1 also the second (m) - is an f16
_SCALES = {2: 1, 3: 2, 6: 1, 7: 2, 8: 1, 9: 2, 20: 1, 39: 0}


@dataclass(frozen=True, slots=True)
class NonFinite:
    run: LayerRun
    section: str
    offset: int  # file offset of the first bad value (or block scale)

    def message(self) -> str:
        return (f"{self.run.part} layer {self.run.index}: non-finite value at offset {self.offset} "
                f"({self.run.type_name})")


@dataclass(frozen=True, slots=True)
class _Task:
    run: LayerRun
    section: str
    start: int  # file offsets of this chunk
    end: int


def _runs(sf: SlotFile) -> Iterable[tuple[str, LayerRun]]:
    bodies = [("body", sf.body)]
    bodies += [(f"sckp.checkpoint[{c.index}].{b.name}", b.body) for c in sf.checkpoints for b in (c.tgt, c.dft)]
    if sf.draft and sf.draft.dft:
        bodies.append(("sdft.data_dft", sf.draft.dft.body))
    for name, body in bodies:
        if body is None:
            continue
        for blk in body.blocks:
            for r in blk.runs():
                if r.data.length:
                    yield f"{name}.{blk.role}", r


def _tasks(sf: SlotFile) -> list[_Task]:
    out = []
    for sec, r in _runs(sf):
        step = CHUNK
        t = TYPES.get(r.type_id)
        if r.type_id not in _LANES and t is not None:
            step = max(t.type_size, CHUNK // t.type_size * t.type_size)  # whole blocks per chunk
        elif r.type_id in _LANES:
            step = CHUNK  # a multiple of every element size
        for a in range(r.data.offset, r.data.offset + r.data.length, step):
            out.append(_Task(r, sec, a, min(a + step, r.data.offset + r.data.length)))
    return out


def _check_float(buf: memoryview, start: int, end: int, type_id: int) -> int | None:
    """First file offset in [start, end) holding inf/NaN, or None."""
    mask, unit, sign = _LANES[type_id]
    el = _ELEM[type_id]
    head_end = min(end, (start + 7) // 8 * 8)
    if (head_end - start) % el:  # lanes would straddle words: check element by element
        head_end = end
    body_end = head_end + (end - head_end) // 8 * 8
    if body_end > head_end:
        w = np.frombuffer(buf, dtype="<u8", count=(body_end - head_end) // 8, offset=head_end)
        tmp = np.bitwise_and(w, np.uint64(mask))
        np.add(tmp, np.uint64(unit), out=tmp)
        if int(np.bitwise_or.reduce(tmp)) & sign:
            return _first_bad(buf, head_end, body_end, type_id)
    for a, b in ((start, head_end), (body_end, end)):
        if b > a:
            bad = _first_bad(buf, a, b, type_id)
            if bad is not None:
                return bad
    return None


def _first_bad(buf: memoryview, start: int, end: int, type_id: int) -> int | None:
    el = _ELEM[type_id]
    n = (end - start) // el
    if type_id == 0:
        v = np.frombuffer(buf, dtype="<u4", count=n, offset=start)
        hit = np.flatnonzero((v & 0x7F800000) == 0x7F800000)
    else:
        v = np.frombuffer(buf, dtype="<u2", count=n, offset=start)
        m = 0x7C00 if type_id == 1 else 0x7F80
        hit = np.flatnonzero((v & m) == m)
    return start + int(hit[0]) * el if hit.size else None


def _check_scales(buf: memoryview, start: int, end: int, type_id: int) -> int | None:
    t = TYPES[type_id]
    n = (end - start) // t.type_size
    for k in range(_SCALES[type_id]):
        d = np.ndarray((n,), dtype="<u2", buffer=buf, offset=start + 2 * k, strides=(t.type_size,))
        hit = np.flatnonzero((d & 0x7C00) == 0x7C00)
        if hit.size:
            return start + int(hit[0]) * t.type_size + 2 * k
    return None


def _run_task(buf: memoryview, mm: mmap.mmap | None, task: _Task) -> NonFinite | None:
    tid = task.run.type_id
    bad = None
    if tid in _LANES:
        bad = _check_float(buf, task.start, task.end, tid)
    elif tid in _SCALES:
        bad = _check_scales(buf, task.start, task.end, tid)
    if mm is not None:  # give the pages back: RSS follows the chunk, not the file
        a = task.start // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, a, task.end - a)
        except (OSError, ValueError, AttributeError):
            pass
    return NonFinite(task.run, task.section, bad) if bad is not None else None


def scan(sf: SlotFile, jobs: int = 2) -> tuple[list[NonFinite], int, list[str]]:
    """(non-finite findings (first per run), bytes scanned, types that cannot be checked)."""
    buf = memoryview(sf.buffer).cast("B") if not isinstance(sf.buffer, memoryview) else sf.buffer
    mm = sf.buffer if isinstance(sf.buffer, mmap.mmap) else None
    tasks = _tasks(sf)
    unchecked = sorted({t.run.type_name for t in tasks if t.run.type_id not in _LANES and t.run.type_id not in _SCALES})
    found: dict[int, NonFinite] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for res in pool.map(lambda t: _run_task(buf, mm, t), tasks, chunksize=8):
            if res is not None:
                key = id(res.run)
                if key not in found or res.offset < found[key].offset:
                    found[key] = res
    scanned = sum(t.end - t.start for t in tasks)
    return sorted(found.values(), key=lambda f: f.offset), scanned, unchecked
