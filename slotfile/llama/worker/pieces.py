"""How a recompute cuts its prompt into ``llama_decode`` calls, which both sides share: the worker's
``deep`` decodes the calls, and the parent (:func:`slotfile.verify.shape.micro_batches`) derives the
micro-batches a schedule computes from them.  Standard library only."""

from __future__ import annotations

import itertools
from typing import Any


def stepwise_ranges(spec: Any, n: int) -> list[tuple[int, int]]:
    """A request's ``stepwise`` ranges ``[[a, b], ...]`` clipped to ``0..n``, empty ones dropped,
    overlapping ones merged, in order."""
    rs = sorted((max(0, int(a)), min(n, int(b))) for a, b in spec or [])
    out: list[tuple[int, int]] = []
    for a, b in rs:
        if a >= b:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def segments(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    bounds = sorted({c for c in cuts if 0 < c < n} | {0, n})
    return list(itertools.pairwise(bounds))


def prompt_pieces(n: int, cuts: list[int], replies: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """The pieces ``(a, b, one_per_call)`` a recompute of ``n`` tokens decodes in order: cut at ``cuts``
    and at the ends of ``replies`` (from :func:`stepwise_ranges`), a piece inside a reply one token per
    call (as the server generated it), any other in calls of the context's ``n_batch``."""
    bounds = [*cuts, *(p for r in replies for p in r)]
    return [(a, b, any(ra <= a and b <= rb for ra, rb in replies)) for a, b in segments(n, bounds)]
