"""The appendices as a repair keeps them (truncate-recover and re-save): every intact
checkpoint and SDFT copied verbatim, framing rewritten through the grammar where a count,
magic or dropped blob changes, and every byte from the body's end to EOF accounted for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slotfile.format import grammar as g
from slotfile.repair.report import Report
from slotfile.repair.tail import BlobRef, SckpEntry, SckpWalk, Tail
from slotfile.safewrite import Plan

BlobWriter = Callable[[Plan, BlobRef, str], None]


@dataclass(slots=True)
class _Tailor:
    plan: Plan
    report: Report
    src: str
    view: memoryview
    write_blob: BlobWriter
    verbatim: bool  # no blob_writer: blobs are copied as they are

    @property
    def end(self) -> int:
        return len(self.view)


def plan_tail(
    plan: Plan,
    report: Report,
    src: str,
    view: memoryview,
    tail: Tail,
    start: int,
    blob_writer: BlobWriter | None = None,
) -> list[int]:
    """Add the kept appendices to ``plan`` and account for every byte from ``start`` to EOF.

    ``blob_writer(plan, ref, section)`` writes a kept blob's u64 length and data (default: a
    verbatim copy); re-save with a flash-attention flip passes a transposing writer.
    Returns the input index of each checkpoint kept, in output order.
    """

    def copy_blob(p: Plan, ref: BlobRef, section: str) -> None:
        p.copy(src, ref.offset, 8 + ref.length)

    t = _Tailor(plan, report, src, view, blob_writer or copy_blob, blob_writer is None)
    kept_map: list[int] = []
    accounted = start
    if tail.sckp is not None:
        accounted = _plan_sckp(t, tail, tail.sckp, accounted, kept_map)
    accounted = _plan_sdft(t, tail, accounted)
    if accounted < t.end:
        report.drop("trailing", accounted, t.end - accounted, "bytes after the last complete section")
    return kept_map


def _plan_sckp(t: _Tailor, tail: Tail, w: SckpWalk, accounted: int, kept_map: list[int]) -> int:
    if w.offset > accounted:
        t.report.drop("body", accounted, w.offset - accounted, "damaged body bytes before the checkpoints")
    if not w.header_ok:  # the walk did not get past the header: all up to a found SDFT goes
        nxt = tail.sdft.offset if tail.sdft is not None else t.end
        t.report.drop("sckp", w.offset, nxt - w.offset, w.stop_reason or "damaged SCKP header")
        return nxt
    _plan_sckp_header(t, w)
    for e in w.entries:
        if _plan_entry(t, e, len(kept_map)):
            kept_map.append(e.index)
    if not w.stop_reason:
        return w.stop
    nxt = tail.sdft.offset if tail.sdft is not None and tail.sdft.offset >= w.stop else t.end
    t.report.drop(
        f"sckp.checkpoint[{len(w.entries)}]" if w.header_ok else "sckp",
        w.stop,
        nxt - w.stop,
        f"damaged tail: {w.stop_reason}",
        n_tokens=w.cut_n_tokens,
    )
    return nxt


def _plan_sckp_header(t: _Tailor, w: SckpWalk) -> None:
    good = w.good
    identical = (
        w.magic_ok
        and w.count == len(w.entries)
        and len(good) == len(w.entries)
        and all(e.dft.ok for e in good)
        and t.verbatim
    )
    if not (good or (w.count == 0 and not w.entries and not w.stop_reason)):
        t.report.drop("sckp.header", w.offset, 12, "no complete checkpoint left: the appendix goes")
        return
    if identical:
        t.plan.copy(t.src, w.offset, 12)
    else:
        t.plan.literal(g.sckp_header(len(good)))
        if w.count != len(good):
            t.report.change("sckp", "count", w.count, len(good))
        if not w.magic_ok:
            t.report.change("sckp", "magic", bytes(t.view[w.offset : w.offset + 4]).hex(), g.SCKP_MAGIC.decode())
    t.report.keep("sckp.header", w.offset, 12, count=len(good))


def _plan_entry(t: _Tailor, e: SckpEntry, k: int) -> bool:
    """One checkpoint, kept (as output checkpoint ``k``) or dropped; True when kept."""
    sec = f"sckp.checkpoint[{e.index}]"
    if not e.ok:
        t.report.drop(sec, e.offset, e.end - e.offset, e.reason, n_tokens=e.n_tokens)
        return False
    if t.verbatim and e.dft.ok:
        t.plan.copy(t.src, e.offset, e.end - e.offset)
    else:
        t.plan.copy(t.src, e.offset, 16)
        t.write_blob(t.plan, e.tgt, f"{sec}.data_tgt")
        if e.dft.ok and e.dft.length:
            t.write_blob(t.plan, e.dft, f"{sec}.data_dft")
        else:
            t.plan.literal(g.blob_length(0))
        t.plan.copy(t.src, e.spec.offset, 8 + e.spec.length)
    if not e.dft.ok:
        t.report.drop(f"{sec}.data_dft", e.dft.offset, 8 + e.dft.length, f"{e.dft.reason} (length set to 0)")
        t.report.change(sec, "len_dft", e.dft.length, 0)
    t.report.keep(sec, e.offset, e.end - e.offset - (0 if e.dft.ok else e.dft.length), n_tokens=e.n_tokens)
    if e.index != k:
        t.report.change(sec, "index", e.index, k)
    return True


def _plan_sdft(t: _Tailor, tail: Tail, accounted: int) -> int:
    if tail.sdft is not None:
        s = tail.sdft
        if s.offset > accounted:
            t.report.drop("trailing", accounted, s.offset - accounted, "unexplained bytes")
        if t.verbatim:
            t.plan.copy(t.src, s.offset, s.end - s.offset)
        else:
            assert s.dft is not None and s.spec is not None
            t.plan.copy(t.src, s.offset, 8)
            if s.dft.length:
                t.write_blob(t.plan, s.dft, "sdft.data_dft")
            else:
                t.plan.copy(t.src, s.dft.offset, 8)
            t.plan.copy(t.src, s.spec.offset, 8 + s.spec.length)
        t.report.keep("sdft", s.offset, s.end - s.offset, **({"found_by": "scan"} if s.scanned else {}))
        return s.end
    if tail.damaged_sdft is not None:
        d = tail.damaged_sdft
        if d.offset > accounted:
            t.report.drop("trailing", accounted, d.offset - accounted, "unexplained bytes")
        t.report.drop("sdft", d.offset, t.end - d.offset, f"damaged draft appendix: {d.reason}")
        return t.end
    return accounted
