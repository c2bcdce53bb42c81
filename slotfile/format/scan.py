"""Full data scan: is every K/V/R/S value finite?

Works in place on the mmap in bounded chunks, on several threads (numpy releases the GIL in
its loops), and drops each chunk's pages after use (``MADV_DONTNEED``), so peak RSS follows
the chunk size times the number of threads, not the file size.

The test per value is an exponent-bits check: a float is inf or NaN exactly when its exponent
field is all ones, so ``max(v & EXP) == EXP`` over the chunk's elements viewed as unsigned
integers (f16 ``0x7C00``, bf16 ``0x7F80``, f32 ``0x7F800000``) decides a whole chunk in two
vectorised passes (``bitwise_and`` into a per-thread scratch buffer, then ``max``); only a
chunk that fails is searched for its first bad element.  Quantized rows are checked through
their f16 block scales (``d``, and ``m`` for *_1 types), read as a strided view.

Work is handed out as (run, start, end) tuples from one shared iterator, so a thread slowed
by other load on the machine simply takes fewer chunks.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from slotfile.format.records import LayerRun, SlotFile
from slotfile.format.types import TYPES, TypeId

# Bytes per task.  Large enough that per-task Python overhead, the page faults of a fresh
# range and the TLB shootdown of each MADV_DONTNEED are amortised; small enough that a
# thread's scratch buffer stays near its core's L2 (1 MiB here) and RSS stays small.
CHUNK = 2 << 20

# float element types: (unsigned lane dtype, exponent mask, element size)
_FLOATS: dict[int, tuple[np.dtype, int, int]] = {
    TypeId.F16: (np.dtype("<u2"), 0x7C00, 2),
    TypeId.BF16: (np.dtype("<u2"), 0x7F80, 2),
    TypeId.F32: (np.dtype("<u4"), 0x7F800000, 4),
}
# quantized block types whose first half (d) - and for *_1 also the second (m) - is an f16;
# mxfp4's scale is an E8M0 byte, which has no inf/NaN to find
_SCALES: dict[int, int] = {
    TypeId.Q4_0: 1,
    TypeId.Q4_1: 2,
    TypeId.Q5_0: 1,
    TypeId.Q5_1: 2,
    TypeId.Q8_0: 1,
    TypeId.Q8_1: 2,
    TypeId.IQ4_NL: 1,
    TypeId.MXFP4: 0,
}
_F16_EXP = 0x7C00


@dataclass(frozen=True, slots=True)
class NonFinite:
    run: LayerRun
    section: str
    offset: int  # file offset of the first bad value (or block scale)

    def message(self) -> str:
        return (
            f"{self.run.part} layer {self.run.index}: non-finite value at offset {self.offset} ({self.run.type_name})"
        )


def _step(type_id: int) -> int:
    """Chunk length for a run of this type: whole elements or whole blocks."""
    if type_id in _FLOATS:
        return CHUNK  # a multiple of every element size
    t = TYPES.get(type_id)
    if t is not None:
        return max(t.type_size, CHUNK // t.type_size * t.type_size)
    return CHUNK


class _Scratch(threading.local):
    """One reusable buffer per thread: no allocation (and no fresh-page faults) per chunk."""

    def __init__(self) -> None:
        self.buf = np.empty(CHUNK // 8 + 8, np.uint64)

    def lanes(self, dtype: np.dtype, n: int) -> np.ndarray:
        need = (n * dtype.itemsize + 7) // 8
        if need > self.buf.size:
            self.buf = np.empty(need, np.uint64)
        return self.buf.view(dtype)[:n]


def _check_float(buf: memoryview, start: int, end: int, type_id: int, scratch: _Scratch) -> int | None:
    """First file offset in [start, end) holding inf/NaN, or None."""
    dtype, mask, el = _FLOATS[type_id]
    n = (end - start) // el
    if n == 0:
        return None
    tmp = scratch.lanes(dtype, n)
    if start % el:  # elements not aligned in memory: copy the chunk once to aligned scratch
        tmp.view(np.uint8)[:] = np.frombuffer(buf, np.uint8, n * el, start)
        v = tmp
    else:
        v = np.frombuffer(buf, dtype, n, start)
    np.bitwise_and(v, dtype.type(mask), out=tmp)
    if int(tmp.max()) != mask:
        return None
    v = np.frombuffer(buf, dtype, n, start)  # tmp was overwritten; search the source
    hit = np.flatnonzero((v & dtype.type(mask)) == mask)
    return start + int(hit[0]) * el


def _check_scales(buf: memoryview, start: int, end: int, type_id: int, scratch: _Scratch) -> int | None:
    t = TYPES[type_id]
    n = (end - start) // t.type_size
    if n == 0:
        return None
    u2 = np.dtype("<u2")
    tmp = scratch.lanes(u2, n)
    for k in range(_SCALES[type_id]):
        d = np.ndarray((n,), dtype=u2, buffer=buf, offset=start + 2 * k, strides=(t.type_size,))
        np.bitwise_and(d, np.uint16(_F16_EXP), out=tmp)
        if int(tmp.max()) == _F16_EXP:
            hit = np.flatnonzero(tmp == _F16_EXP)
            return start + int(hit[0]) * t.type_size + 2 * k
    return None


def _worker(
    buf: memoryview,
    mm: Any,
    tasks: Iterator[tuple[int, int, int, int]],
    found: dict[int, int],
    lock: threading.Lock,
    errors: list[BaseException],
) -> None:
    scratch = _Scratch()
    page = mmap.PAGESIZE
    try:
        for key, tid, start, end in tasks:  # a shared iterator: each item goes to one thread
            bad = None
            if tid in _FLOATS:
                bad = _check_float(buf, start, end, tid, scratch)
            elif tid in _SCALES:
                bad = _check_scales(buf, start, end, tid, scratch)
            if mm is not None:  # give the pages back: RSS follows the chunk, not the file
                a = start // page * page
                try:
                    mm.madvise(mmap.MADV_DONTNEED, a, end - a)
                except (OSError, ValueError):
                    pass
            if bad is not None:
                with lock:
                    if key not in found or bad < found[key]:
                        found[key] = bad
    except BaseException as e:  # re-raised by scan() in the calling thread
        errors.append(e)


class _SharedIter:
    """A thread-safe iterator over a list (next() under a lock)."""

    def __init__(self, items: list[Any]) -> None:
        self._it = iter(items)
        self._lock = threading.Lock()

    def __iter__(self) -> _SharedIter:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return next(self._it)


def scan(sf: SlotFile, jobs: int = 2) -> tuple[list[NonFinite], int, list[str]]:
    """(non-finite findings (first per run), bytes scanned, types that cannot be checked)."""
    buf = memoryview(sf.buffer).cast("B") if not isinstance(sf.buffer, memoryview) else sf.buffer
    mm = sf.buffer if isinstance(sf.buffer, mmap.mmap) and hasattr(sf.buffer, "madvise") else None
    runs = list(sf.value_runs())
    tasks: list[tuple[int, int, int, int]] = []
    scanned = 0
    unchecked: set[str] = set()
    for key, (_, r) in enumerate(runs):
        a, e = r.data.offset, r.data.offset + r.data.length
        scanned += e - a
        if r.type_id not in _FLOATS and r.type_id not in _SCALES:
            unchecked.add(r.type_name)
            continue  # nothing to read
        step = _step(r.type_id)
        tasks += [(key, r.type_id, s, min(s + step, e)) for s in range(a, e, step)]
    found: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    shared = _SharedIter(tasks)
    n_threads = max(1, min(jobs, len(tasks)))
    threads = [
        threading.Thread(target=_worker, args=(buf, mm, shared, found, lock, errors), daemon=True)
        for _ in range(n_threads - 1)
    ]
    for t in threads:
        t.start()
    _worker(buf, mm, shared, found, lock, errors)  # the calling thread works too
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    out = [NonFinite(runs[k][1], runs[k][0], off) for k, off in found.items()]
    return sorted(out, key=lambda f: f.offset), scanned, sorted(unchecked)
