"""migrate: convert a slot file between state versions 2, 3 and 4 (a session file between 9, 10 and 11).

Version 4 (llama.cpp of 2026-10-05 on) differs from version 3 by two u32 words, ``n_rot_k`` and
``n_rot_v``, after ``n_layer`` in the data section of every KV stream that has cells: in the body,
in every checkpoint's ``data_tgt`` / ``data_dft`` blob and in the SDFT draft blob (their version is
the file's); recurrent blocks have none (slot-format.md §12.1).  Versions 2, 3 and 4 rotate quantized
K/V with the same width rule; versions 2 and 3 only do not record it.  So:

* to 4 inserts the widths a version-4 llama.cpp computes for the model and the stream's own
  cache types (:func:`slotfile.model.expect.rotation_widths`); without ``--model`` only when no KV cache
  is quantized (then both are 0);
* from 4 removes them, and refuses when they differ from what a version-2/3 llama.cpp computes for
  the model, since that build would silently read the rows in another rotation.

Version 2 differs from 3 in the M-RoPE cell ext (8 bytes without the cell's token, 12 with it), in
having no PLE and no hybrid-idx / DSA-iSWA caches (:mod:`slotfile.repair.migrate_versions`).  A
conversion 2 <-> 4 does both steps on the same input, so v2 -> v4 -> v2 gives the v2 file back byte
for byte.

``LLAMA_ATTN_ROT_DISABLE`` turns the rotation off in llama.cpp; a version-4 file written with it
set stores 0 where a quantized cache would be rotated, and a version-2/3 file cannot say it was.
slotfile reads the variable the way llama.cpp does: run ``migrate`` with it set exactly when the
llama.cpp that wrote (to 4) or will load (from 4) the file runs with it set.

The output is the input's bytes, copied range by range, with the version word, the rotation
words, the cell tables whose ext changes size and the u64 length of every blob that holds a
changed state rebuilt by the grammar.
"""

from __future__ import annotations

from slotfile.format import grammar as g
from slotfile.format.records import Body, CacheExpect, FileFormat, KVStream, MemoryKind, ModelExpect, SlotFile
from slotfile.format.versions import first_with_rotation
from slotfile.model.compare import rotation_message, stream_types
from slotfile.model.expect import attn_rot_disabled, is_quantized, rotation_widths
from slotfile.repair.common import Operational, Planned, Refused, RepairOptions, Retry, operation
from slotfile.repair.migrate_versions import (
    STATES,
    Edit,
    ext_edits,
    file_version,
    legacy_refusal,
    state_of,
    to_state,
    v2_refusal,
)
from slotfile.repair.report import Report
from slotfile.safewrite import Plan

# memory classes holding a DeepSeek/GLM lightning indexer, whose K is rotated even in f16
INDEXER_CLASSES = ("dsa", "dsa-iswa", "dsv4")
ROT_STATE = first_with_rotation("GGSQ")  # the first state version with the rotation words (4)

__all__ = ["Edit", "migrate", "target_version"]


def target_version(fmt: FileFormat, to: int | None) -> int:
    """``--to`` as the header version of ``fmt``: a state version (2, 3 or 4); a session file takes
    2/3/4 as 9/10/11 or 9/10/11 itself."""
    return file_version(fmt, to_state(fmt, to))


@operation("migrate")
def migrate(sf: SlotFile, opts: RepairOptions, workdir: str, out: Planned, retry: Retry) -> Planned:
    report = out.report
    if sf.format not in (FileFormat.GGSQ, FileFormat.GGSN):
        raise Refused("not a slot (GGSQ) or session (GGSN) file")
    src = state_of(sf.format, sf.version)
    if src not in STATES:
        known = ", ".join(str(file_version(sf.format, v)) for v in STATES)
        raise Refused(f"{sf.format} version {sf.version}: migrate converts between versions {known} only")
    dst = to_state(sf.format, opts.to_version)
    to = file_version(sf.format, dst)
    bad = sf.errors
    if bad:
        raise Refused(f"{bad[0].line()}; migrate converts readable files only (run truncate-recover first)")
    if to == sf.version:
        plan = Plan()
        plan.copy(sf.path, 0, sf.size)
        report.keep("file", 0, sf.size)
        report.notes.append(f"the file is already {sf.format} version {to}")
        out.plan, out.identity = plan, True
        return out
    checked = _with_model(sf, opts)
    try:
        _model_refusal(checked)
        legacy_refusal(checked)
        if dst == 2:
            v2_refusal(checked)
        mrope = checked.expect is not None and checked.expect.cell_ext == 12
        edits = ext_edits(checked, src, dst, report, mrope_known=mrope)
        if (src == ROT_STATE) != (dst == ROT_STATE):
            edits += _edits(checked, dst == ROT_STATE, report, dst)
        edits += _blob_lengths(checked, edits, report)
    finally:
        if checked is not sf:
            checked.close()
    out.plan = _plan(sf, edits, to, report)
    out.test_draft = bool(opts.draft_model)
    out.model_check = True
    report.notes.append(_exactness(sf, src, dst))
    if opts.model is None:
        report.notes.append(
            "not test-loaded: that needs --model (through --llama-lib DIR, or a library of the target version "
            "found beside llama-server on PATH, in SLOTFILE_LLAMA_V<N> or in slotfile's build cache)"
        )
    return out


# ---------------------------------------------------------------------------------------
# the model side: which widths each KV stream must carry


def _with_model(sf: SlotFile, opts: RepairOptions) -> SlotFile:
    """The input read against --model / --draft-model (their expectations decide the widths);
    a file that does not match the model is refused."""
    if opts.model is None and opts.draft_model is None:
        return sf
    from slotfile.format.reader import open_slot_file
    from slotfile.model.bridge import ModelError, load_model_info
    from slotfile.model.expect import expect_from_model

    try:
        exp = expect_from_model(load_model_info(opts.model)) if opts.model else None
        dexp = expect_from_model(load_model_info(opts.draft_model)) if opts.draft_model else None
    except ModelError as e:
        raise Operational(str(e)) from None
    read = open_slot_file(sf.path, expect=exp, draft_expect=dexp)
    for x in (exp, dexp):
        if x is not None and not x.modelled:
            read.close()
            raise Refused(
                f"the rotation widths of {x.arch} ({x.memory_class}) are not modelled: "
                f"{'; '.join(x.notes) or 'unknown layout'}"
            )
    return read


def _model_refusal(sf: SlotFile) -> None:
    """Refuse a file the model check fails, except on its rotation words (judged by _edits,
    which says what a disagreement there means for the conversion)."""
    rot = {st.rot_offset + d for _, st in _streams(sf) if st.rot_offset is not None for d in (0, 4)}
    bad = [p for p in sf.model_problems if p.severity == "error" and p.offset not in rot]
    if bad:
        raise Refused(f"{bad[0].line()}: the file does not match the model given")


def _streams(sf: SlotFile) -> list[tuple[str, KVStream]]:
    bodies = [sf.body] + [b.body for ck in sf.checkpoints for b in (ck.tgt, ck.dft)]
    if sf.draft is not None and sf.draft.dft is not None:
        bodies.append(sf.draft.dft.body)
    return [(blk.role, st) for b in bodies if b is not None for blk in b.blocks for st in blk.active_streams()]


def _blocks_of(exp: ModelExpect | None, partial: bool) -> list[CacheExpect] | None:
    if exp is None:
        return None
    return [b for b in (exp.partial_blocks if partial else exp.blocks) if isinstance(b, CacheExpect)]


def _stream_widths(
    body: Body, caches: list[CacheExpect] | None, section: str, model_opt: str
) -> list[tuple[str, KVStream, tuple[int, int]]]:
    """(section, stream, the widths llama.cpp computes) for every KV stream with cells."""
    kv = [b for b in body.blocks if b.kind == MemoryKind.KV]
    if caches is not None and len(caches) != len(kv):
        raise Refused(f"{section}: {len(kv)} KV block(s), the model has {len(caches)} (is this its model?)")
    out = []
    for j, blk in enumerate(kv):
        for st in blk.active_streams():
            sec = f"{section}.{blk.role}.stream[{st.index}]"
            types = stream_types(st)
            if types is None:
                raise Refused(f"{sec}: a cache type this build does not know: the rotation width cannot be computed")
            if caches is not None:
                out.append((sec, st, rotation_widths(caches[j], types[0], types[1])))
                continue
            quantized = [t for t in types if t is not None and is_quantized(t)]
            if quantized or body.memory_class in INDEXER_CLASSES:
                why = "a quantized KV cache" if quantized else "a lightning-indexer cache (always rotated)"
                raise Refused(f"{sec}: {why}: its rotation width depends on the model's head size; give {model_opt}")
            out.append((sec, st, (0, 0)))
    return out


def _all_streams(sf: SlotFile) -> list[tuple[str, KVStream, tuple[int, int]]]:
    exp, dexp = sf.expect, sf.draft_expect
    assert sf.body is not None
    found = _stream_widths(sf.body, _blocks_of(exp, False), "body", "--model")
    for ck in sf.checkpoints:
        for blob, e, opt in ((ck.tgt, exp, "--model"), (ck.dft, dexp, "--draft-model")):
            if blob.length and blob.body is not None:
                found += _stream_widths(blob.body, _blocks_of(e, True), f"sckp.checkpoint[{ck.index}].{blob.name}", opt)
    if sf.draft is not None and sf.draft.dft is not None and sf.draft.dft.body is not None:
        found += _stream_widths(sf.draft.dft.body, _blocks_of(dexp, False), "sdft.data_dft", "--draft-model")
    return found


# ---------------------------------------------------------------------------------------
# the edits


def _rot_at(st: KVStream) -> int:
    """Where a stream's rotation words sit, or would sit: right after n_layer."""
    if st.rot_offset is not None:
        return st.rot_offset
    assert st.cells is not None
    return st.cells.offset + st.cells.size + 8  # v_trans, n_layer follow the cell table


def _edits(sf: SlotFile, upgrade: bool, report: Report, dst: int) -> list[Edit]:
    """The rotation words: inserted (to 4) or removed (from 4, refused where they disagree
    with what the older llama.cpp computes)."""
    edits: list[Edit] = []
    for sec, st, want in _all_streams(sf):
        at = _rot_at(st)
        if upgrade:
            edits.append(Edit(at, 0, g.rot_words(*want)))
            report.change(sec, "n_rot_k, n_rot_v", None, list(want), offset=at)
            continue
        got = (int(st.n_rot_k or 0), int(st.n_rot_v or 0))
        for i in range(2):
            if got[i] != want[i]:
                raise Refused(f"{sec} at offset {at + 4 * i}: {_downgrade_refusal(i, got[i], want[i], st, dst)}")
        edits.append(Edit(at, 8, b""))
        report.change(sec, "n_rot_k, n_rot_v", list(got), None, offset=at)
    return edits


def _downgrade_refusal(i: int, got: int, want: int, st: KVStream, dst: int) -> str:
    types = stream_types(st) or (None, None)
    what = "K" if i == 0 else "V"
    if got == 0 and want:
        return (
            f"the stored {what} rotation is 0 where this model and cache type give {want}: the writer ran "
            "with LLAMA_ATTN_ROT_DISABLE set, so the rows are not rotated, and a version-{dst} file cannot say "
            f"so; a version-{dst} llama.cpp run without that variable would load it silently with wrong "
            "attention. If the llama.cpp that will load it runs with LLAMA_ATTN_ROT_DISABLE=1, run "
            "migrate with that variable set too"
        )
    return rotation_message(i, got, want, types[i]) + f"; a version-{dst} llama.cpp would read these rows wrongly"


def _blob_lengths(sf: SlotFile, edits: list[Edit], report: Report) -> list[Edit]:
    """The u64 length of every blob whose content grows or shrinks."""
    blobs = [b for ck in sf.checkpoints for b in (ck.tgt, ck.dft)]
    if sf.draft is not None and sf.draft.dft is not None:
        blobs.append(sf.draft.dft)
    out = []
    for b in blobs:
        start, end = b.data_offset, b.data_offset + b.length
        delta = sum(e.delta for e in edits if start <= e.offset < end)
        if delta:
            out.append(Edit(b.offset, 8, g.blob_length(b.length + delta)))
            sec = next((f"sckp.checkpoint[{ck.index}]" for ck in sf.checkpoints if b in (ck.tgt, ck.dft)), "sdft")
            report.change(sec, f"len_{b.name.removeprefix('data_')}", b.length, b.length + delta)
    return out


def _plan(sf: SlotFile, edits: list[Edit], to: int, report: Report) -> Plan:
    magic = g.GGSN_MAGIC if sf.format == FileFormat.GGSN else g.GGSQ_MAGIC
    edits = sorted([Edit(0, 12, g.file_header(magic, to, sf.n_token_count or 0)), *edits], key=lambda e: e.offset)
    report.change("header", "version", sf.version, to)
    plan = Plan()
    pos = 0
    for e in edits:
        if e.offset < pos:
            raise AssertionError(f"overlapping edits at {e.offset}")
        if e.offset > pos:
            plan.copy(sf.path, pos, e.offset - pos)
        if e.insert:
            plan.literal(e.insert)
        pos = e.offset + e.drop
    if pos < sf.size:
        plan.copy(sf.path, pos, sf.size - pos)
    report.keep("everything else", 12, sf.size - 12 - sum(e.drop for e in edits[1:]), how="copied verbatim")
    return plan


def _exactness(sf: SlotFile, src: int, dst: int) -> str:
    quantized = any(is_quantized(r.type_id) for _, r in sf.value_runs() if r.part in ("K", "V"))
    if (src == ROT_STATE) == (dst == ROT_STATE):  # 2 <-> 3: the ext only, checked cell by cell
        return "exact: the states are copied byte for byte; only the version and cell ext words differ"
    if not quantized:
        return "exact: no KV cache is quantized, so nothing is rotated in either version"
    env = " (LLAMA_ATTN_ROT_DISABLE is set here: widths of 0)" if attn_rot_disabled() else ""
    if dst == ROT_STATE:
        return (
            f"quantized KV cache: exact unless the version-{src} writer ran with a different LLAMA_ATTN_ROT_DISABLE "
            f"setting than this migrate{env} (a version-{src} file does not record it); `slotfile verify --deep` "
            "on the output tells"
        )
    return f"quantized KV cache: the stored rotation widths are the ones a version-{dst} llama.cpp uses{env}"
