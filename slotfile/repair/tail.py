"""Tail analysis: what follows the body (or a damaged body), entry by entry, validated.

"Tail" in :mod:`slotfile.repair` always means this appendix part of a slot file: the SCKP
checkpoints and the SDFT draft state after the body, and whatever trailing bytes follow them.
(It is not the worker's ``tail``, the last tokens decoded one per call for the deep check.)

The framing comes from :mod:`slotfile.format.appendix`; this module adds what a repair needs on
top: every blob checked the way the reader checks it, SCKP entries walked whatever the count
says, a damaged magic tolerated when the entries behind it validate, and an intact SDFT
found again by a scan after damage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from construct import ConstructError

from slotfile.format import appendix as ap
from slotfile.format import grammar as g
from slotfile.format.layout import Failure
from slotfile.format.read_appendix import parse_seq_blob
from slotfile.format.read_checks import check_block
from slotfile.format.records import BlobInfo, CheckpointFields, FileFormat, SlotFile
from slotfile.problems import ProblemCode, Severity
from slotfile.repair.common import Retry, view_of

MAX_SCAN_CANDIDATES = 4096


@dataclass(slots=True)
class BlobRef(ap.BlobSpan):
    offset: int  # of the u64 length
    length: int
    ok: bool = True
    reason: str = ""
    info: BlobInfo | None = None


@dataclass(slots=True)
class SckpEntry(CheckpointFields[BlobRef]):
    """A checkpoint as repair's own walk found it, and whether it can be kept."""

    ok: bool = True
    reason: str = ""


@dataclass(slots=True)
class SckpWalk:
    offset: int
    header_ok: bool = False
    magic_ok: bool = True
    version: int | None = None
    count: int | None = None
    entries: list[SckpEntry] = field(default_factory=list)
    stop: int = 0
    stop_reason: str = ""  # empty: stopped at EOF or at an SDFT magic
    at_sdft: bool = False
    cut_n_tokens: int | None = None  # n_tokens of the entry the walk broke off in, if readable

    @property
    def good(self) -> list[SckpEntry]:
        return [e for e in self.entries if e.ok]

    def known_n_tokens(self, n_max: int) -> list[int]:
        vals = [e.n_tokens for e in self.entries]
        if self.cut_n_tokens is not None:
            vals.append(self.cut_n_tokens)
        return sorted({v for v in vals if 0 < v <= n_max})


@dataclass(slots=True)
class SdftFound:
    offset: int
    end: int
    ok: bool
    reason: str = ""
    dft: BlobRef | None = None
    spec: BlobRef | None = None
    scanned: bool = False


@dataclass(slots=True)
class Tail:
    """What follows the body: SCKP walk, SDFT, and the regions that go."""

    sckp: SckpWalk | None = None
    sdft: SdftFound | None = None
    damaged_sdft: SdftFound | None = None


# ---------------------------------------------------------------------------------------
# blobs


def check_blob(sf: SlotFile, view: memoryview, ref: BlobRef, section: str, partial: tuple[str, ...] | None) -> None:
    """Validate a seq blob the way the reader does (same code), recording ok / reason."""
    scratch = SlotFile(path=sf.path, size=len(view), format=FileFormat.GGSQ, version=sf.version, buffer=sf.buffer)
    info = BlobInfo(section.rsplit(".", 1)[-1], ref.offset, ref.length, g.Run(ref.data_offset, ref.length, b""))
    try:
        parse_seq_blob(scratch, view, info, section, partial)
        if info.body is not None:
            for blk in info.body.blocks:
                check_block(scratch, blk, f"{section}.{blk.role}")
    except (ConstructError, ValueError, OverflowError, IndexError, AttributeError) as e:
        scratch.problem(Severity.ERROR, ProblemCode.INTERNAL, section, ref.offset, f"{type(e).__name__}: {e}")
    errs = scratch.errors
    ref.info = info
    if errs:
        ref.ok, ref.reason = False, errs[0].message


def _ref(b: ap.BlobFrame) -> BlobRef:
    return BlobRef(b.offset, b.length)


# ---------------------------------------------------------------------------------------
# SCKP


def walk_sckp(
    sf: SlotFile,
    view: memoryview,
    off: int,
    *,
    tgt_partial: tuple[str, ...] | None,
    n_tokens: int,
    require_magic: bool = True,
) -> SckpWalk:
    """Walk an SCKP appendix entry by entry, ignoring its count; validate every blob."""
    end = len(view)
    w = SckpWalk(off, stop=off)
    h = ap.sckp_head(view, off, end, any_magic=True)
    if isinstance(h, Failure):
        w.stop_reason = f"SCKP header cut after {end - off} of 12 bytes"
        return w
    w.magic_ok = h.magic_ok
    if require_magic and not w.magic_ok:
        w.stop_reason = "no SCKP magic"
        return w
    w.version, w.count = h.version, h.count
    if w.version != g.SCKP_VERSION:
        w.stop_reason = f"SCKP version {w.version} (only 1 is known)"
        return w
    w.header_ok = True
    w.stop = _walk_entries(sf, view, w, h.end, tgt_partial)
    return w


def _walk_entries(sf: SlotFile, view: memoryview, w: SckpWalk, start: int, tgt_partial: tuple[str, ...] | None) -> int:
    """Add the entries from ``start`` to ``w``; returns where the walk stopped."""
    for it in ap.entries(view, start, len(view), stop_at_sdft=True):
        if isinstance(it, ap.Stop):
            w.at_sdft = it.why == "sdft"
            if it.failure is not None:
                f = it.failure
                w.stop_reason = f"checkpoint {it.index}: {f.message}" + (f" ({f.loc})" if f.loc else "")
                w.cut_n_tokens = it.cut_n_tokens
            return it.offset
        e = _entry(sf, view, it, tgt_partial)
        if not e.ok and w.count is not None and it.index >= w.count:
            return it.offset  # past the declared count an invalid entry is no checkpoint: trailing bytes
        w.entries.append(e)
    raise AssertionError("an entry walk always ends with a Stop")


def _entry(sf: SlotFile, view: memoryview, it: ap.EntryFrame, tgt_partial: tuple[str, ...] | None) -> SckpEntry:
    """One checkpoint, its blobs checked: an invalid data_tgt or head makes it go, an invalid
    data_dft only that blob."""
    sec = f"sckp.checkpoint[{it.index}]"
    e = SckpEntry(
        it.index, it.offset, it.end, it.n_tokens, it.pos_min, it.pos_max, _ref(it.tgt), _ref(it.dft), _ref(it.spec)
    )
    if e.tgt.length == 0:
        e.ok, e.reason = False, "data_tgt is empty (the server drops the whole appendix)"
    else:
        check_blob(sf, view, e.tgt, f"{sec}.data_tgt", tgt_partial)
        if not e.tgt.ok:
            e.ok, e.reason = False, f"data_tgt: {e.tgt.reason}"
    if e.ok and (e.pos_min > e.pos_max or e.pos_min < 0):
        e.ok, e.reason = False, f"position range {e.pos_min}..{e.pos_max}"
    if e.ok and e.n_tokens < 0:
        e.ok, e.reason = False, f"n_tokens {e.n_tokens}"
    if e.ok and e.dft.length:
        check_blob(sf, view, e.dft, f"{sec}.data_dft", None)
    return e


# ---------------------------------------------------------------------------------------
# SDFT


def parse_sdft_at(sf: SlotFile, view: memoryview, off: int) -> SdftFound:
    end = len(view)
    h = ap.sdft_head(view, off, end)
    if isinstance(h, Failure):
        return SdftFound(off, end, False, f"SDFT header: {h.message}")
    if h.version != g.SDFT_VERSION:
        return SdftFound(off, end, False, f"SDFT version {h.version} (only 1 is known)")
    b = ap.sdft_body(view, h, end)
    if isinstance(b, Failure):
        return SdftFound(off, end, False, f"{b.message}" + (f" ({b.loc})" if b.loc else ""))
    found = SdftFound(off, b.end, True, "", _ref(b.dft), _ref(b.spec))
    if found.dft is not None and found.dft.length:
        check_blob(sf, view, found.dft, "sdft.data_dft", None)
        if not found.dft.ok:
            found.ok, found.reason = False, f"data_dft: {found.dft.reason}"
    return found


# ---------------------------------------------------------------------------------------
# scans after damage


def _find(sf: SlotFile, needle: bytes, start: int, end: int) -> int:
    buf = sf.buffer
    finder = getattr(buf, "find", None)
    if finder is not None:
        return int(finder(needle, start, end))
    hay = bytes(view_of(sf)[start:end])
    return hay.find(needle) + start if needle in hay else -1


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
# the whole tail


def _sckp_of(
    sf: SlotFile, view: memoryview, start: int, tgt_partial: tuple[str, ...] | None, scan: bool
) -> SckpWalk | None:
    end = len(view)
    n = sf.n_tokens
    if scan:
        return scan_sckp(sf, view, start, n)
    if ap.starts_with(view, start, g.SCKP_MAGIC, end):
        return walk_sckp(sf, view, start, tgt_partial=tgt_partial, n_tokens=n)
    if end - start >= 12 and ap.magic_at(view, start, end) != g.SDFT_MAGIC:
        # an overwritten SCKP magic over intact entries: accept it if the entries validate
        w = walk_sckp(sf, view, start, tgt_partial=tgt_partial, n_tokens=n, require_magic=False)
        if w.good:
            return w
    return None


def analyse_tail(
    sf: SlotFile, view: memoryview, start: int, *, tgt_partial: tuple[str, ...] | None, scan: bool = False
) -> Tail:
    """Everything from ``start`` (the end of the body, or the start of a damaged body when
    ``scan``) to EOF."""
    end = len(view)
    t = Tail(sckp=_sckp_of(sf, view, start, tgt_partial, scan))
    p = t.sckp.stop if t.sckp is not None else start
    if p < end:
        advanced = t.sckp is None or t.sckp.stop > t.sckp.offset
        if advanced and ap.starts_with(view, p, g.SDFT_MAGIC, end) and not (scan and t.sckp is None):
            found = parse_sdft_at(sf, view, p)
            if found.ok:
                t.sdft = found
            else:
                t.damaged_sdft = found
        else:  # damage before any SDFT: one may still sit intact at the end of the file
            t.sdft = scan_sdft(sf, view, p if scan and t.sckp is None else p + 1)
    return t


def apply_exclusions(tail: Tail, retry: Retry) -> None:
    """Entries and blobs that failed an earlier attempt's test-load go as if damaged."""
    if tail.sckp is not None:
        for e in tail.sckp.entries:
            if e.index in retry.exclude_ckpt and e.ok:
                e.ok, e.reason = False, f"data_tgt fails its test-load: {retry.exclude_ckpt[e.index]}"
            if e.index in retry.exclude_dft and e.dft.ok:
                e.dft.ok, e.dft.reason = False, f"fails its test-load in the draft model: {retry.exclude_dft[e.index]}"
    if retry.exclude_sdft and tail.sdft is not None:
        why = f"data_dft fails its test-load in the draft model: {retry.exclude_sdft}"
        tail.damaged_sdft = SdftFound(tail.sdft.offset, tail.sdft.end, False, why)
        tail.sdft = None
