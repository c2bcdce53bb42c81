"""The plausible splits of a REC block, read from its bytes alone.

A ``llama_memory_recurrent::state_write`` block does not say how many of its layer entries are
R (conv) rows and how many S (SSM/WKV) rows: :func:`rec_candidates` proposes splits for
``slotfile.format.layout`` to try, most complete first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from slotfile.format.grammar import (
    COUNT,
    LAYER_HEAD,
    MAX_LAYERS,
    MAX_STREAMS,
    REC_CELL_HEAD,
    read_fixed,
    row_ok,
    type_ok,
)


def _entry_counts(view: Any, off: int, end: int, whole: bool) -> tuple[int, int, list[tuple[int, int]]]:
    """Scan a REC block greedily: (cell_count, n_layer, [(type, row_size), ...]).  The heads
    are read with the grammar's fixed readers: the entry count is what the block grammar
    (rec_block) needs to be told, so it cannot parse the block to find it."""
    got = read_fixed(COUNT, view, off, end)
    cells = int(got[0]) if got is not None else None
    # the same cap as the grammar: one cell per sequence (no Python loop over a bogus count)
    if cells is None or cells > (MAX_STREAMS if whole else 1):
        return cells or 0, 0, []
    p = off + COUNT.size
    for _ in range(cells):
        head = read_fixed(REC_CELL_HEAD, view, p, end)
        if head is None:
            return cells, 0, []
        p += REC_CELL_HEAD.size + (4 * head[1] if whole else 0)  # whole: n_seq_id seq ids follow
    p += COUNT.size  # s_trans
    got = read_fixed(COUNT, view, p, end)
    n_layer = int(got[0]) if got is not None else None
    if n_layer is None or n_layer > MAX_LAYERS:
        return cells, 0, []
    p += COUNT.size
    entries: list[tuple[int, int]] = []
    while p + LAYER_HEAD.size <= end and len(entries) < 2 * n_layer:
        t, row = LAYER_HEAD.unpack_from(view, p)
        if not (type_ok(t) and row_ok(t, row)) or p + LAYER_HEAD.size + cells * row > end:
            break
        entries.append((t, row))
        p += LAYER_HEAD.size + cells * row
    return cells, n_layer, entries


def rec_candidates(view: Any, off: int, end: int, whole: bool) -> Iterator[tuple[int, bool]]:
    """Plausible (n_rec, has_p) for the REC block at ``off``, most complete first."""
    _, n_layer, entries = _entry_counts(view, off, end, whole)
    if not n_layer:
        yield 1, False  # not even a header: parse one entry to record where it fails
        return
    if len(entries) // 2 < n_layer:
        # one more than the entries present: fails, but records where a cut file runs out
        yield len(entries) // 2 + 1, False
    for k in range(min(len(entries) // 2, n_layer), 0, -1):
        r, s = entries[:k], entries[k : 2 * k]
        if len(set(r)) == 1 and len(set(s)) == 1:
            yield k, False
    for k in range(min(n_layer, MAX_LAYERS), 0, -1):  # PLE conv rows after each R
        yield k, True
