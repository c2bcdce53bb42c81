"""strip-draft: remove the SDFT appendix and every checkpoint's draft and speculative blobs;
the target state stays byte-identical."""

from __future__ import annotations

from slotfile.format import grammar as g
from slotfile.format.records import Checkpoint, SlotFile
from slotfile.repair.common import Planned, Refused, RepairOptions, Retry, body_ok, header_tokens_ok, start
from slotfile.repair.report import Report
from slotfile.safewrite import Plan


def strip_draft(
    sf: SlotFile,
    opts: RepairOptions,
    workdir: str,
    *,
    dry_run: bool = False,
    temps: list[str] | None = None,
    sink: list[Report] | None = None,
    retry: Retry | None = None,
) -> Planned:
    out = start("strip-draft", sf, dry_run, temps, sink)
    report = out.report
    header_tokens_ok(sf)
    if not body_ok(sf):
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
            _strip_checkpoint(plan, report, sf.path, ck)
    if sf.draft is not None:
        report.drop("sdft", sf.draft.offset, sf.draft.end - sf.draft.offset, "draft appendix removed")
    out.plan = plan
    out.identity = plan.is_identity(sf.path, sf.size)
    return out


def _strip_checkpoint(plan: Plan, report: Report, src: str, ck: Checkpoint) -> None:
    """Head and data_tgt verbatim; data_dft and data_spec emptied (u64 length 0 each)."""
    sec = f"sckp.checkpoint[{ck.index}]"
    if not ck.dft.length and not ck.spec.length:
        plan.copy(src, ck.offset, ck.end - ck.offset)
        report.keep(sec, ck.offset, ck.end - ck.offset, n_tokens=ck.n_tokens)
        return
    plan.copy(src, ck.offset, ck.tgt.data_offset + ck.tgt.length - ck.offset)
    plan.literal(g.blob_length(0) + g.blob_length(0))
    report.keep(sec, ck.offset, ck.tgt.data_offset + ck.tgt.length - ck.offset + 16, n_tokens=ck.n_tokens)
    if ck.dft.length:
        report.drop(f"{sec}.data_dft", ck.dft.offset, 8 + ck.dft.length, "draft state (length set to 0)")
        report.change(sec, "len_dft", ck.dft.length, 0)
    if ck.spec.length:
        report.drop(f"{sec}.data_spec", ck.spec.offset, 8 + ck.spec.length, "speculative state (length set to 0)")
        report.change(sec, "len_spec", ck.spec.length, 0)
