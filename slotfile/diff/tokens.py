"""The stored prompts of two files: equal, or the first index where they diverge, how many tokens
they share, and (with a model) the text around the divergence on each side."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from slotfile.diff.report import TokenDiff
from slotfile.format.records import SlotFile

if TYPE_CHECKING:
    from slotfile.model.bridge import ModelInfo

CONTEXT_BEFORE = 8  # tokens shown before the first difference
CONTEXT_AFTER = 8  # and from it on


def _ids(sf: SlotFile) -> np.ndarray:
    # packed payloads: positions covered by a media chunk hold -1 (server_tokens::serialize)
    return sf.tokens.tokens if sf.tokens is not None else np.empty(0, np.int32)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two id arrays (vectorised, in chunks)."""
    n = min(a.size, b.size)
    step = 1 << 20
    for s in range(0, n, step):
        e = min(n, s + step)
        ne = np.flatnonzero(a[s:e] != b[s:e])
        if ne.size:
            return s + int(ne[0])
    return n


def compare_tokens(a: SlotFile, b: SlotFile, model: ModelInfo | None = None) -> TokenDiff:
    ta, tb = _ids(a), _ids(b)
    shared = common_prefix(ta, tb)
    media_a = a.tokens.media if a.tokens is not None else []
    media_b = b.tokens.media if b.tokens is not None else []
    td = TokenDiff(int(ta.size), int(tb.size), shared, None, media_same=media_a == media_b)
    if shared == ta.size == tb.size:
        return td
    td.first_diff = shared
    td.token_a = int(ta[shared]) if shared < ta.size else None
    td.token_b = int(tb[shared]) if shared < tb.size else None
    start = max(0, shared - CONTEXT_BEFORE)
    td.context_start = start
    td.shared_ids = [int(t) for t in ta[start:shared]]
    td.ids_a = [int(t) for t in ta[shared : shared + CONTEXT_AFTER]]
    td.ids_b = [int(t) for t in tb[shared : shared + CONTEXT_AFTER]]
    if model is not None:
        td.shared_text = model.detokenize(td.shared_ids)
        td.text_a = model.detokenize(td.ids_a)
        td.text_b = model.detokenize(td.ids_b)
    return td
