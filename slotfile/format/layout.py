"""Which memory blocks make up a body: trial parsing from the bytes alone.

A body is a concatenation of KV and REC blocks with no separators, and which blocks, in
which order, with which per-cell ext and whether the KV blocks carry V, is a property of the
model (``llama_model::create_memory``), not of the file.  Without the model we parse every
candidate and accept only a parse that ends exactly where the body must end: at EOF, at an
appendix magic, or at the end of a checkpoint blob (slot-format.md §13.1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from construct import ConstructError

from slotfile.format import versions
from slotfile.format.grammar import (
    SCKP_MAGIC,
    SDFT_MAGIC,
    FormatError,
    SlotGrammar,
    ViewStream,
)
from slotfile.format.layout_cache import SHAPES, Shape, remember, same_bytes, shape_of, shifted
from slotfile.format.magics import MemoryKind as MemoryKind  # defined there: the loader reads it
from slotfile.format.rec_scan import rec_candidates
from slotfile.problems import ProblemCode

KV, REC = MemoryKind.KV, MemoryKind.REC
Kinds = tuple[MemoryKind, ...]  # the block kinds of a body, in order


class Confidence(StrEnum):
    """How a body's layout was decided."""

    MODEL = "model"  # the model's layout (layout.detect(fixed=...))
    UNIQUE = "unique"  # the only layout that fits the bytes
    AMBIGUOUS = "ambiguous"  # several fit; the likeliest was taken
    TRAILING = "trailing"  # none ends where the body must; the fullest parse, bytes left over
    NONE = "none"  # nothing parses


@dataclass(frozen=True, slots=True)
class BlockSpec:
    kind: MemoryKind
    has_v: bool = True
    n_rec: int = 0
    has_p: bool = False

    def describe(self) -> str:
        if self.kind == KV:
            return "KV" if self.has_v else "KV(K-only)"
        return f"REC({self.n_rec}{'+P' if self.has_p else ''})"


@dataclass(frozen=True, slots=True)
class Layout:
    blocks: tuple[BlockSpec, ...]
    ext: int = 0
    extra: tuple[int, int] = (0, 0)  # trial of an unknown version: u32 words before v_trans / after n_layer
    legacy: bool = False  # KV blocks without n_stream (grammar.kv_block_legacy)
    rot: bool = False  # KV streams carry n_rot_k, n_rot_v (state version 4, session version 11)

    @property
    def kinds(self) -> Kinds:
        return tuple(b.kind for b in self.blocks)

    @property
    def _key(self) -> tuple[str, ...]:
        # two K-only KV blocks are an MLA cache and its lightning indexer (llama_kv_cache_dsa),
        # not an iSWA pair: an SWA cache always has V
        if self.kinds == (KV, KV) and not any(b.has_v for b in self.blocks):
            return ("KV-K", "KV-K")
        return self.kinds

    @property
    def memory_class(self) -> str:
        return MEMORY_CLASS.get(self._key, "+".join(self.kinds) or "none")

    def roles(self) -> list[str]:
        """A name for each block: kv, kv-base, kv-swa, rec, kv-index ..."""
        names = ROLES.get(self._key)
        if names:
            return list(names)
        return [f"{b.kind.lower()}{i}" for i, b in enumerate(self.blocks)]

    def describe(self) -> str:
        if not self.blocks:
            return "empty body"
        ext = f", cell ext {self.ext} B" if self.ext else ""
        if self.extra != (0, 0):
            ext += f", {self.extra[0]}+{self.extra[1]} unknown words per stream"
        if self.legacy:
            ext += ", without n_stream (llama.cpp before mid-2025)"
        return " + ".join(b.describe() for b in self.blocks) + ext


MEMORY_CLASS = {
    (): "none",
    (KV,): "kv-cache",
    (KV, KV): "iswa",
    ("KV-K", "KV-K"): "dsa",
    (REC,): "recurrent",
    (KV, REC): "hybrid",
    (KV, KV, REC): "hybrid-iswa",
    (KV, REC, KV): "hybrid-idx",
    (KV, KV, KV): "dsa-iswa",
}

ROLES = {
    (): (),
    (KV,): ("kv",),
    (KV, KV): ("kv-base", "kv-swa"),
    ("KV-K", "KV-K"): ("kv-mla", "kv-index"),
    (REC,): ("rec",),
    (KV, REC): ("kv", "rec"),
    (KV, KV, REC): ("kv-base", "kv-swa", "rec"),
    (KV, REC, KV): ("kv", "rec", "kv-index"),
    (KV, KV, KV): ("kv-mla", "kv-index", "kv-swa"),
}

# Ordered by likelihood (slot-format.md §13.1 step 4).
SEQUENCES: tuple[Kinds, ...] = (
    (KV,),
    (KV, REC),
    (KV, KV),
    (KV, KV, REC),
    (KV, REC, KV),
    (REC,),
    (KV, KV, KV),
)
LEGACY_SEQUENCES: tuple[Kinds, ...] = ((KV,), (KV, KV))
# The block sequences an arch name allows (llama_model::create_memory), for GGSN files, which
# name their arch; the usual one first.  Only families whose choice is fixed by the arch, or by
# one hparam listed here, are named: gemma3 has a single KV cache when its GGUF has no
# attention.sliding_window, lfm2 becomes hybrid-iSWA when it has one.
ARCH_SEQUENCES: dict[str, tuple[Kinds, ...]] = {
    **{a: ((KV,),) for a in ("llama", "qwen2", "qwen3", "qwen2vl", "qwen3vl", "deepseek2")},
    **{a: ((KV, KV),) for a in ("gemma2", "cohere2")},
    "gemma3": ((KV, KV), (KV,)),
    **{a: ((REC,),) for a in ("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7")},
    **{
        a: ((KV, REC),)
        for a in (
            "jamba",
            "falcon-h1",
            "lfm2moe",
            "granitehybrid",
            "nemotron_h",
            "qwen3next",
            "qwen35",
            "qwen35moe",
            "plamo2",
        )
    },
    "lfm2": ((KV, REC), (KV, KV, REC)),
}

EXT_SIZES = versions.CELL_EXT_SIZES  # (0, 12, 8): every version's cell ext sizes
# How far past a complete-but-short parse a truncated candidate must reach to win.  Zero: a
# killed save (the common damage) must never read as "a shorter layout plus trailing bytes";
# garbage after a body rarely gets a candidate to a short read (the caps stop it first).
TRAILING_MARGIN = 0
OTHER_SIZE_TRIES = 16  # layouts of other sizes a body of a new size is parsed in before the search

# PARTIAL_ONLY keeps (llama_memory_*::state_write with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY):
PARTIAL_OF: dict[str, Kinds] = {
    "kv-cache": (KV,),
    "iswa": (KV,),  # the SWA half only
    "dsa": (KV, KV),  # llama_kv_cache_dsa ignores the flag
    "recurrent": (REC,),
    "hybrid": (REC,),
    "hybrid-iswa": (KV, REC),  # SWA KV + REC
    "hybrid-idx": (REC,),
    "dsa-iswa": (KV,),
    "none": (),
}


@dataclass(slots=True)
class Failure:
    """The deepest point a candidate reached before failing: the most telling error."""

    offset: int
    message: str
    code: ProblemCode
    loc: str
    layout: str


@dataclass(slots=True)
class Detection:
    layout: Layout | None
    blocks: list[Any]
    end: int
    confidence: Confidence
    alternatives: list[Layout] = field(default_factory=list)
    failure: Failure | None = None


class _Deepest:
    """Search state: the deepest failure so far, and a memo of block parses by offset."""

    def __init__(self) -> None:
        self.best: Failure | None = None
        self.cut: Failure | None = None  # the deepest short read: where a truncated file ends
        self.memo: dict[tuple[Any, ...], Any] = {}

    def note(self, exc: Exception, stream: ViewStream, layout: Callable[[], str]) -> None:
        f = failure_of(exc, stream, layout())
        if self.best is None or f.offset > self.best.offset:
            self.best = f
        if f.code == ProblemCode.TRUNCATED and (self.cut is None or f.offset > self.cut.offset):
            self.cut = f


def failure_of(exc: Exception, stream: ViewStream, layout: str = "") -> Failure:
    """Turn a grammar exception into (offset, message, code, location)."""
    loc = ".".join(stream.loc)
    if isinstance(exc, FormatError):
        return Failure(exc.offset, exc.message, exc.code, exc.loc or loc, layout)
    if stream.short is not None:
        off, want, have = stream.short
        return Failure(off, f"needs {want} bytes, {have} remain", ProblemCode.TRUNCATED, loc, layout)
    return Failure(stream.tell(), str(exc).split("\n")[0], ProblemCode.INVALID, loc, layout)


def _parse_kv(
    view: Any,
    off: int,
    end: int,
    ext: int,
    whole: bool,
    has_v: bool,
    deep: _Deepest,
    label: Callable[[], str],
    extra: tuple[int, int] = (0, 0),
    legacy: bool = False,
    rot: bool = False,
) -> Any | None:
    key = ("KV", off, end, ext, has_v, extra, legacy, rot)
    if key in deep.memo:
        return deep.memo[key]
    s = ViewStream(view, off, end)
    try:
        blk = SlotGrammar.of(whole, ext, legacy, rot, extra).parse_kv(s, has_v)
    except (ConstructError, ValueError, OverflowError) as e:
        deep.note(e, s, label)
        blk = None
    deep.memo[key] = blk
    return blk


def _parse_rec(
    view: Any, off: int, end: int, whole: bool, n_rec: int, has_p: bool, deep: _Deepest, label: Callable[[], str]
) -> Any | None:
    key = ("REC", off, end, n_rec, has_p)
    if key in deep.memo:
        return deep.memo[key]
    s = ViewStream(view, off, end)
    try:
        blk = SlotGrammar.of(whole).parse_rec(s, n_rec, has_p)
    except (ConstructError, ValueError, OverflowError) as e:
        deep.note(e, s, label)
        blk = None
    deep.memo[key] = blk
    return blk


@dataclass(frozen=True, slots=True)
class _Walk:
    """What stays fixed while :func:`_walk` descends through the blocks of one candidate."""

    view: Any
    end: int
    ext: int
    whole: bool
    deep: _Deepest
    extra: tuple[int, int] = (0, 0)
    legacy: bool = False
    rot: bool = False


def _walk(
    w: _Walk,
    off: int,
    kinds: tuple[str, ...],
    has_v: tuple[bool, ...],
    specs: tuple[BlockSpec, ...] = (),
    parsed: tuple[Any, ...] = (),
) -> Iterator[tuple[tuple[BlockSpec, ...], tuple[Any, ...], int]]:
    """Every complete parse of ``kinds`` starting at ``off``: (specs, blocks, end offset)."""
    if not kinds:
        yield specs, parsed, off
        return

    # the failure label is only built when a parse fails (most calls are memo hits)
    def label() -> str:
        return Layout((*specs, BlockSpec(MemoryKind(kinds[0]))), w.ext, legacy=w.legacy).describe()

    if kinds[0] == KV:
        blk = _parse_kv(w.view, off, w.end, w.ext, w.whole, has_v[0], w.deep, label, w.extra, w.legacy, w.rot)
        if blk is not None:
            yield from _walk(w, blk.end, kinds[1:], has_v[1:], (*specs, BlockSpec(KV, has_v[0])), (*parsed, blk))
        return
    # a REC block is never legacy (no REC block existed in that layout): the blocks after it neither
    after_rec = replace(w, legacy=False)
    tried_p = 0
    for n_rec, has_p in rec_candidates(w.view, off, w.end, w.whole):
        if has_p:
            tried_p += 1
            if tried_p > 64:
                break
        blk = _parse_rec(w.view, off, w.end, w.whole, n_rec, has_p, w.deep, label)
        if blk is not None:
            spec = BlockSpec(REC, True, n_rec, has_p)
            yield from _walk(after_rec, blk.end, kinds[1:], has_v[1:], (*specs, spec), (*parsed, blk))
            if not has_p:
                return  # the fullest plain split that parses wins; P rows only when none does


@functools.lru_cache(maxsize=64)
def _has_v_options(kinds: tuple[str, ...]) -> tuple[tuple[bool, ...], ...]:
    n = len(kinds)
    opts = [tuple(True for _ in kinds), tuple(False for _ in kinds)]
    if kinds.count(KV) >= 2:  # an indexer or MLA part next to a cache with V
        opts.append(tuple(k != KV or i < n - 1 for i, k in enumerate(kinds)))
        opts.append(tuple(k == KV and i == n - 1 for i, k in enumerate(kinds)))
    if KV not in kinds:
        opts = opts[:1]
    seen: list[tuple[bool, ...]] = []
    for o in opts:
        if o not in seen:
            seen.append(o)
    return tuple(seen)


def appendix_at(view: Any, off: int, end: int) -> bool:
    """An SCKP/SDFT magic starts at ``off`` (or the file ends inside one: a cut appendix)."""
    head = bytes(view[off : min(off + 4, end)])
    return bool(head) and any(m.startswith(head) for m in (SCKP_MAGIC, SDFT_MAGIC))


_Plan = tuple[tuple[str, ...], tuple[bool, ...], int, tuple[int, int], bool]  # kinds, has_v, ext, extra, legacy
_Parse = tuple[Layout, tuple[Any, ...], int]  # layout, parsed blocks, end offset


def detect(
    view: Any,
    start: int,
    end: int,
    *,
    whole: bool = False,
    exact: bool = False,
    sequences: Iterable[tuple[str, ...]] = SEQUENCES,
    ext_sizes: Iterable[int] = EXT_SIZES,
    fixed: Layout | None = None,
    extras: Iterable[tuple[int, int]] = ((0, 0),),
    legacy: bool = False,
    rot: bool = False,
) -> Detection:
    """Find the layout of the body in ``view[start:end]``.

    ``exact``: the body must end exactly at ``end`` (a blob).  Otherwise it may also end at an
    SCKP/SDFT magic; as a last resort the fullest parse is taken and the rest is trailing bytes.
    ``fixed``: the layout is known (from the model); parse only that.
    ``legacy``: also try KV blocks without ``n_stream`` (files of state version 2 / session 9,
    which llama.cpp wrote both ways), after every current layout.
    ``rot``: every KV stream carries the rotation words (state version 4, session version 11);
    a property of the file's version, so it applies to ``fixed`` too.
    """
    if start == end or (not exact and appendix_at(view, start, end)):
        return Detection(Layout(()), [], start, Confidence.UNIQUE)
    sequences, ext_sizes, extras = tuple(sequences), tuple(ext_sizes), tuple(extras)
    if fixed is not None:
        return _detect(view, start, end, whole, exact, sequences, ext_sizes, fixed, extras, legacy, rot)
    # Files of one server share a few shapes: the search below, repeated for each, was 85 % of
    # a directory listing.  A shape's detection is cached and re-checked against every file's
    # own bytes (layout_cache); anything that does not match exactly takes the full search.
    key = (end - start, whole, exact, sequences, ext_sizes, extras, legacy, rot)
    hits = SHAPES.get(key, [])
    det = _from_cache(view, start, end, whole, exact, rot, hits)
    if det is not None:
        return det
    tried = _Deepest()
    # not for legacy bodies (version 2 / session 9): with and without n_stream both can fit,
    # which only the full search tells (an ambiguous reading), so no other size's layout is taken
    det = None if legacy else _other_size(view, start, end, whole, exact, rot, key, tried)
    if det is None:  # the blocks the tries parsed are not parsed again (their failures are, in order)
        seed = {k: v for k, v in tried.memo.items() if v is not None}
        det = _detect(view, start, end, whole, exact, sequences, ext_sizes, None, extras, legacy, rot, seed)
    if det.confidence == Confidence.UNIQUE and det.layout is not None and not _weak(tuple(det.blocks)):
        remember(key, hits, det.layout, det.blocks, det.end, det.failure, view, start)
    return det


def _other_size(
    view: Any, start: int, end: int, whole: bool, exact: bool, rot: bool, key: tuple[Any, ...], deep: _Deepest
) -> Detection | None:
    """A body of a new size in a layout a cached shape of another size had (a server's files
    differ in their cell counts, not in their layout): that layout parsed in full through the
    grammar, accepted when it ends where the body must and is no weak reading (as the search
    accepts it).  The search's deepest failure of the other candidates is not known here: it
    is only ever read when no layout fits, and then this path declined.  None: the search."""
    tried: list[Layout] = []
    for k, shapes in reversed(list(SHAPES.items())):  # the latest sizes first (a copy: verify --jobs threads)
        if k[1:] != key[1:]:
            continue
        for hit in reversed(shapes):
            if hit.layout in tried or len(tried) >= OTHER_SIZE_TRIES:
                continue
            tried.append(hit.layout)
            det = _parse_as(view, start, end, whole, exact, rot, hit.layout, deep)
            if det is not None:
                return det
    return None


def _parse_as(
    view: Any, start: int, end: int, whole: bool, exact: bool, rot: bool, lay: Layout, deep: _Deepest
) -> Detection | None:
    """``lay``'s full parse of the body, when it ends well and is no weak reading; else None."""
    w = _Walk(view, end, lay.ext, whole, deep, lay.extra, lay.legacy, rot)
    for specs, blocks, e in _walk(w, start, lay.kinds, tuple(b.has_v for b in lay.blocks)):
        if specs == lay.blocks and (e == end or (not exact and appendix_at(view, e, end))) and not _weak(blocks):
            return Detection(lay, list(blocks), e, Confidence.UNIQUE)
    return None


def _from_cache(
    view: Any, start: int, end: int, whole: bool, exact: bool, rot: bool, hits: list[Shape]
) -> Detection | None:
    """A cached shape's detection of this body, or None (the full search)."""
    for hit in hits:  # a file whose structure bytes are those of a cached shape
        blocks = same_bytes(view, start, hit)
        if blocks is not None:
            return Detection(hit.layout, blocks, start + hit.end, Confidence.UNIQUE, [], shifted(hit.failure, start))
    for hit in hits:
        det = _reparse(view, start, end, whole, exact, rot, hit)
        if det is not None:
            return det
    return None


def _reparse(view: Any, start: int, end: int, whole: bool, exact: bool, rot: bool, hit: Shape) -> Detection | None:
    """The cached layout parsed in full from this file's bytes (every block through the
    grammar, as the search parses it), accepted only when it ends where the cached one ended
    and its blocks have the same shape; None sends the file to the full search."""
    lay = hit.layout
    w = _Walk(view, end, lay.ext, whole, _Deepest(), lay.extra, lay.legacy, rot)
    for specs, blocks, e in _walk(w, start, lay.kinds, tuple(b.has_v for b in lay.blocks)):
        if specs != lay.blocks or e - start != hit.end:
            continue
        if not (e == end or (not exact and appendix_at(view, e, end))):
            continue
        if shape_of(blocks, start) != hit.shape:
            return None
        return Detection(lay, list(blocks), e, Confidence.UNIQUE, [], shifted(hit.failure, start))
    return None


def _detect(
    view: Any,
    start: int,
    end: int,
    whole: bool,
    exact: bool,
    sequences: tuple[tuple[str, ...], ...],
    ext_sizes: tuple[int, ...],
    fixed: Layout | None,
    extras: tuple[tuple[int, int], ...],
    legacy: bool,
    rot: bool,
    seed: dict[tuple[Any, ...], Any] | None = None,
) -> Detection:
    """The full search: every candidate layout parsed (see :func:`detect`); ``seed``: blocks
    already parsed, by their memo key (a parse is a function of its key and the bytes)."""
    deep = _Deepest()
    deep.memo.update(seed or {})
    accepted: list[_Parse] = []
    partial: list[_Parse] = []
    for kinds, hv, ext, x, old in _plans(fixed, sequences, ext_sizes, extras, legacy):
        if (ext or x != (0, 0)) and KV not in kinds:
            continue
        w = _Walk(view, end, ext, whole, deep, x, old, rot)
        for specs, blocks, e in _walk(w, start, kinds, hv):
            lay = Layout(specs, ext, x, old, rot)
            if fixed is not None and not _same_rec(fixed, lay):
                continue
            ends_well = e == end or (not exact and appendix_at(view, e, end))
            (accepted if ends_well else partial).append((lay, blocks, e))
    if accepted:
        return _choose(accepted, deep, start, fixed is not None)
    return _fallback(partial, deep, start, end, exact)


def _plans(
    fixed: Layout | None,
    sequences: Iterable[tuple[str, ...]],
    ext_sizes: Iterable[int],
    extras: Iterable[tuple[int, int]],
    legacy: bool,
) -> list[_Plan]:
    """The candidates to walk, in order of preference: the fixed layout alone, else every
    sequence with every ext size, V choice and trial shape (and the legacy ones last)."""
    if fixed is not None:
        return [(fixed.kinds, tuple(b.has_v for b in fixed.blocks), fixed.ext, fixed.extra, fixed.legacy)]
    ext_sizes = tuple(ext_sizes)
    sequences = tuple(sequences)
    plans: list[_Plan] = [
        (k, hv, ext, x, False) for x in extras for k in sequences for ext in ext_sizes for hv in _has_v_options(k)
    ]
    if legacy:  # no cell ext and no REC block existed then: [KV] and the iSWA pair
        plans += [(k, hv, 0, (0, 0), True) for k in LEGACY_SEQUENCES for hv in _has_v_options(k)]
    return plans


def _choose(accepted: list[_Parse], deep: _Deepest, start: int, modelled: bool) -> Detection:
    """The detection among the parses that end well: strong readings first; one that only fits
    with R rows standing in for S rows, where a deeper parse ran out of bytes, is a cut file."""
    accepted = _distinct(accepted)
    strong = [a for a in accepted if not _weak(a[1])]
    cut = deep.cut is not None and deep.cut.offset >= accepted[0][2]
    if strong:
        accepted = strong + [a for a in accepted if a not in strong]
    elif cut:  # only a reading with R rows standing in for S rows fits: the file was cut
        return Detection(None, [], start, Confidence.NONE, [a[0] for a in accepted], deep.cut)
    lay, blocks, e = accepted[0]
    conf = Confidence.MODEL if modelled else (Confidence.UNIQUE if len(accepted) == 1 else Confidence.AMBIGUOUS)
    return Detection(lay, list(blocks), e, conf, [a[0] for a in accepted[1:]], deep.best)


def _fallback(partial: list[_Parse], deep: _Deepest, start: int, end: int, exact: bool) -> Detection:
    """No parse ends well: the fullest one with trailing bytes (not in a blob), unless a deeper
    candidate shows the body was cut; else no layout, with the deepest failure."""
    if partial and not exact:
        partial.sort(key=lambda a: -a[2])  # the fullest parse; the rest is trailing bytes
        lay, blocks, e = partial[0]
        # A candidate that parsed well past this end before running out of bytes explains the
        # file better: the body was cut, and a shorter layout only fits by accident.
        if deep.cut is not None and deep.cut.offset >= e + TRAILING_MARGIN:
            deep.best = deep.cut
        else:
            return Detection(lay, list(blocks), e, Confidence.TRAILING, [a[0] for a in partial[1:4]], deep.best)
    if partial and deep.best is not None and exact:
        lay, _, e = max(partial, key=lambda a: a[2])
        if e > deep.best.offset:
            deep.best = Failure(
                e,
                f"body ends at {e}, {end - e} bytes before the end of the blob",
                ProblemCode.TRAILING_BYTES,
                "",
                lay.describe(),
            )
    return Detection(None, [], start, Confidence.NONE, [], deep.best)


def _same_rec(fixed: Layout, got: Layout) -> bool:
    for a, b in zip(fixed.blocks, got.blocks, strict=False):
        if a.kind == REC and a.n_rec and (a.n_rec, a.has_p) != (b.n_rec, b.has_p):
            return False
    return True


def _distinct(found: list[tuple[Layout, tuple[Any, ...], int]]) -> list[tuple[Layout, tuple[Any, ...], int]]:
    """Drop readings that split the bytes identically (e.g. an empty KV block reads the same
    with or without V, with any ext): they are not a real ambiguity."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for lay, blocks, e in found:
        key = (lay.kinds, tuple(b.end for b in blocks), tuple((b.n_rec, b.has_p) for b in lay.blocks))
        if key not in seen:
            seen.add(key)
            out.append((lay, blocks, e))
    return out


def _weak(blocks: tuple[Any, ...]) -> bool:
    """A REC reading whose S rows look exactly like its R rows.  No recurrent model has
    n_embd_r == n_embd_s (conv state vs SSM/WKV state), but a file cut right after its R
    entries reads this way, with the second half of R taken for S."""
    for b in blocks:
        if (
            "s_trans" in b
            and b.r
            and b.s
            and "r" not in b.r[0]
            and (b.r[0].type, b.r[0].row_size) == (b.s[0].type, b.s[0].row_size)
        ):
            return True
    return False
