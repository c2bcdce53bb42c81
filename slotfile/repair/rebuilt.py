"""Appendices around a state that llama.cpp rebuilt (truncate-recover of a damaged body, re-save
with --recompute): checkpoint and SDFT framing built through the grammar, blobs copied from
the worker's blob file or carried over verbatim from the input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotfile.format import grammar as g
from slotfile.repair.report import Report
from slotfile.repair.tail import SckpEntry, Tail
from slotfile.safewrite import Plan


@dataclass(slots=True)
class Rebuilt:
    """The worker's output: its blob file and what it says about the checkpoints and draft."""

    plan: Plan
    report: Report
    src: str  # the input
    blobs: str  # the worker's blob file
    data: dict[str, Any]

    def head(self, c: dict[str, Any]) -> int:
        """Checkpoint head and data_tgt; returns the bytes written."""
        self.plan.literal(g.checkpoint_head(c["n_tokens"], c["pos_min"], c["pos_max"]))
        t_off, t_len = c["tgt"]
        self.plan.literal(g.blob_length(t_len))
        self.plan.copy(self.blobs, t_off, t_len)
        return 16 + 8 + t_len

    def worker_blob(self, where: list[int], prefix: bytes = b"") -> int:
        """A blob of the worker's blob file, after ``prefix`` (framing written with its length)."""
        off, n = where
        self.plan.literal(prefix + g.blob_length(n))
        self.plan.copy(self.blobs, off, n)
        return n

    def carried(self, offset: int, length: int) -> int:
        """A blob of the input (u64 length and data) copied verbatim."""
        self.plan.copy(self.src, offset, 8 + length)
        return length

    def empty(self) -> None:
        self.plan.literal(g.blob_length(0))


def _orig(tail: Tail) -> dict[int, SckpEntry]:
    return {e.n_tokens: e for e in (tail.sckp.good if tail.sckp else [])}


def plan_rebuilt_checkpoints(rb: Rebuilt, tail: Tail) -> None:
    """truncate-recover: rebuilt target blobs; draft / spec blobs carried over from valid
    originals at the same n_tokens, else the worker's draft blob, else none."""
    cps = rb.data["checkpoints"]
    orig = _orig(tail)
    if cps:
        rb.plan.literal(g.sckp_header(len(cps)))
    for i, c in enumerate(cps):
        size = rb.head(c) + 16
        o = orig.get(c["n_tokens"])
        how = f"PARTIAL_ONLY state after {c['n_tokens']} tokens"
        if o is not None and o.dft.ok and o.dft.length:
            size += rb.carried(o.dft.offset, o.dft.length)
            how += "; data_dft carried over from the damaged file"
        elif c.get("dft"):
            size += rb.worker_blob(c["dft"])
            how += "; data_dft rebuilt with the draft model"
        else:
            rb.empty()
            if o is not None and o.dft.length:
                how += "; damaged data_dft dropped"
        if o is not None and o.spec.length:
            size += rb.carried(o.spec.offset, o.spec.length)
            how += "; data_spec carried over"
        else:
            rb.empty()
        rb.report.rebuild(f"sckp.checkpoint[{i}]", size, how, n_tokens=c["n_tokens"])


def plan_rebuilt_sdft(rb: Rebuilt, tail: Tail) -> None:
    """truncate-recover: an SDFT found intact is kept verbatim, else the worker's draft state."""
    if tail.sdft is not None:
        rb.plan.copy(rb.src, tail.sdft.offset, tail.sdft.end - tail.sdft.offset)
        rb.report.keep("sdft", tail.sdft.offset, tail.sdft.end - tail.sdft.offset, found_by="scan")
    elif rb.data.get("draft"):
        n = rb.worker_blob(rb.data["draft"], prefix=g.sdft_header())
        rb.empty()
        rb.report.rebuild("sdft", 24 + n, "draft state rebuilt by prefilling the draft model")


def plan_recomputed_tail(rb: Rebuilt, tail: Tail) -> None:
    """re-save --recompute: checkpoints and draft state after a recompute under another
    flash-attention setting (an original data_dft no longer fits and is not carried over)."""
    cps = rb.data["checkpoints"]
    orig = _orig(tail)
    if cps or (tail.sckp is not None and tail.sckp.header_ok and not tail.sckp.entries):
        rb.plan.literal(g.sckp_header(len(cps)))
    for i, c in enumerate(cps):
        o = orig.get(c["n_tokens"])
        size = rb.head(c) + 16
        how = f"recomputed PARTIAL_ONLY state after {c['n_tokens']} tokens"
        if c.get("dft"):
            size += rb.worker_blob(c["dft"])
            how += "; data_dft recomputed with the draft model"
        else:
            rb.empty()
            if o is not None and o.dft.length:
                rb.report.drop(
                    f"sckp.checkpoint[{i}].data_dft",
                    o.dft.offset,
                    8 + o.dft.length,
                    "its V layout no longer matches (give --draft-model to recompute it)",
                )
        if o is not None and o.spec.length:
            size += rb.carried(o.spec.offset, o.spec.length)
            how += "; data_spec carried over"
        else:
            rb.empty()
        rb.report.rebuild(f"sckp.checkpoint[{i}]", size, how, n_tokens=c["n_tokens"])
    _plan_recomputed_sdft(rb, tail)


def _plan_recomputed_sdft(rb: Rebuilt, tail: Tail) -> None:
    if tail.sdft is None:
        return
    s = tail.sdft
    assert s.dft is not None and s.spec is not None
    if rb.data.get("draft"):
        n = rb.worker_blob(rb.data["draft"], prefix=g.sdft_header())
        rb.carried(s.spec.offset, s.spec.length)
        rb.report.rebuild("sdft", 24 + n + s.spec.length, "draft state recomputed with the draft model")
    elif s.spec.length:
        rb.plan.literal(g.sdft_header() + g.blob_length(0))
        rb.carried(s.spec.offset, s.spec.length)
        if s.dft.length:
            rb.report.drop(
                "sdft.data_dft",
                s.dft.offset,
                8 + s.dft.length,
                "its V layout no longer matches (give --draft-model to recompute it)",
            )
        rb.report.keep("sdft.data_spec", s.spec.offset, 8 + s.spec.length)
    else:
        rb.report.drop(
            "sdft", s.offset, s.end - s.offset, "its V layout no longer matches (give --draft-model to recompute it)"
        )
