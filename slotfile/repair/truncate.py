"""truncate-recover: keep every intact section; with the model, rebuild a cut or damaged body
from the stored tokens."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from slotfile.format import grammar as g
from slotfile.format.layout import PARTIAL_OF
from slotfile.format.reader import has_rot, open_slot_file
from slotfile.format.records import Body, MemoryKind, SlotFile
from slotfile.repair.common import (
    Operational,
    Planned,
    Refused,
    RepairOptions,
    Retry,
    body_ok,
    header_tokens_ok,
    operation,
    prefill_request,
    view_of,
    words_of,
)
from slotfile.repair.kept import plan_tail
from slotfile.repair.rebuilt import Rebuilt, plan_rebuilt_checkpoints, plan_rebuilt_sdft
from slotfile.repair.report import Report
from slotfile.repair.settings import describe_settings, probe_body, settings_for_rebuild, tid
from slotfile.repair.tail import SckpWalk, Tail, analyse_tail, apply_exclusions
from slotfile.safewrite import Plan, create_temp
from slotfile.text import count


@operation("truncate-recover")
def truncate_recover(sf: SlotFile, opts: RepairOptions, workdir: str, out: Planned, retry: Retry) -> Planned:
    dry_run = out.report.dry_run
    header_tokens_ok(sf)
    view = view_of(sf)
    if body_ok(sf) and not retry.force_rebuild:
        assert sf.body is not None
        return _keep_body(sf, sf.body, view, out, opts, retry)
    # the body is cut or damaged
    assert sf.body is not None
    what = _damage(sf, opts, retry)
    tail = analyse_tail(sf, view, sf.body.offset, tgt_partial=None, scan=True)
    apply_exclusions(tail, retry)
    settings, sources = settings_for_rebuild(sf, view, tail, opts, out.report.notes)
    if not dry_run and not retry.force_rebuild:
        # Where does llama.cpp's own loader end this body?  Bytes after a body are ignored by
        # it; a body the reader cannot delimit (zeros after it read like a cut hybrid body)
        # may load whole.  If it does and the prefix parses clean, keep it as it is.
        sub = _body_by_loader(sf, view, settings, opts, out.report)
        if sub is not None:
            return _keep_body(sf, sub, view, out, opts, retry)
    at, at_src = _positions(opts, tail.sckp, sf.n_tokens)
    _account_damage(out.report, sf, tail, what)
    if dry_run:
        return _dry_rebuild(out, sf, tail, settings, at, at_src, retry)
    return _rebuild(out, sf, view, tail, settings, sources, at, opts, retry, workdir, what)


def _damage(sf: SlotFile, opts: RepairOptions, retry: Retry) -> str:
    """What is wrong with the body; refused when it cannot be rebuilt."""
    n = sf.n_tokens
    body_err = next((p for p in sf.errors if p.section == "body" or p.section.startswith("body.")), None)
    what = (
        body_err.line()
        if body_err
        else (f"the body parses but {retry.force_rebuild}" if retry.force_rebuild else "the body cannot be read")
    )
    if opts.model is None:
        raise Refused(
            f"{what}; nothing that would load can be saved without the model "
            f"(give --model to rebuild the state from the {n} stored tokens)"
        )
    if sf.tokens is not None and sf.tokens.media:
        raise Refused(
            f"{what}; the tokens include {count(len(sf.tokens.media), 'media chunk')}, which cannot be "
            "prefilled without the multimodal projector"
        )
    if n == 0:
        raise Refused(f"{what}; the payload holds no tokens to rebuild from")
    return what


def _positions(opts: RepairOptions, w: SckpWalk | None, n: int) -> tuple[list[int] | None, str]:
    """Where to take checkpoints in the rebuild, and who said so (None: the worker decides)."""
    if opts.checkpoint_at:
        return sorted({a for a in opts.checkpoint_at if 0 < a <= n}), "--checkpoint-at"
    if w is not None and w.known_n_tokens(n):
        return w.known_n_tokens(n), "the damaged file's checkpoints"
    return None, "default"


def _account_damage(report: Report, sf: SlotFile, tail: Tail, what: str) -> None:
    assert sf.body is not None
    w = tail.sckp
    report.keep("header+tokens", 0, 12 + 4 * (sf.n_token_count or 0), tokens=sf.n_tokens)
    report.drop(
        "body",
        sf.body.offset,
        (w.offset if w is not None else (tail.sdft.offset if tail.sdft else sf.size)) - sf.body.offset,
        what,
    )


def _dry_rebuild(
    out: Planned, sf: SlotFile, tail: Tail, settings: dict[str, Any], at: list[int] | None, at_src: str, retry: Retry
) -> Planned:
    report, n = out.report, sf.n_tokens
    report.rebuild(
        "body",
        None,
        f"would prefill {n} tokens through llama.cpp with {describe_settings(settings)} "
        f"and save with llama_state_seq_save_file",
        tokens=n,
    )
    report.rebuild(
        "sckp",
        None,
        "would take checkpoints at n_tokens "
        + (", ".join(map(str, at)) if at else "chosen from the model (recurrent/hybrid/SWA need them)")
        + f" ({at_src})",
    )
    _drop_old_checkpoints(report, tail, "would be replaced by a rebuilt checkpoint")
    if tail.sdft is not None:
        report.keep("sdft", tail.sdft.offset, tail.sdft.end - tail.sdft.offset, found_by="scan")
    if not retry.force_rebuild:
        report.notes.append(
            "a real run first test-loads the input: if llama.cpp restores its body whole, "
            "that body is kept instead of being rebuilt"
        )
    out.plan = None
    return out


def _run_prefill(
    out: Planned,
    sf: SlotFile,
    settings: dict[str, Any],
    at: list[int] | None,
    opts: RepairOptions,
    workdir: str,
    what: str,
) -> tuple[dict[str, Any], str, str]:
    """The worker prefills the tokens and saves: (its answer, the saved file, the blob file)."""
    base, fd = create_temp(workdir, Path(sf.path).name, ".rebuild")
    os.close(fd)
    blobs, fd = create_temp(workdir, Path(sf.path).name, ".blobs")
    os.close(fd)
    out.temps += [base, blobs]
    from slotfile.llama.requests import run_worker

    t0 = time.monotonic()
    # no draft_settings: the worker derives the draft context from the target's settings
    res = run_worker(prefill_request(sf, opts, settings, words_of(sf), at, base, blobs), timeout=opts.timeout)
    out.report.timings["rebuild"] = time.monotonic() - t0
    if not res.ok:
        if res.crashed:
            raise Operational(f"rebuilding the state failed: {res.message}")
        raise Refused(f"{what}; rebuilding it failed: {res.message}")
    return res.data, base, blobs


def _rebuild(
    out: Planned,
    sf: SlotFile,
    view: memoryview,
    tail: Tail,
    settings: dict[str, Any],
    sources: list[str],
    at: list[int] | None,
    opts: RepairOptions,
    retry: Retry,
    workdir: str,
    what: str,
) -> Planned:
    report, n = out.report, sf.n_tokens
    words_end = 12 + 4 * (sf.n_token_count or 0)
    data, base, blobs = _run_prefill(out, sf, settings, at, opts, workdir, what)
    base_size = int(data["file_size"])
    _same_geometry(sf, view, base, retry)
    new_version = _version_of(base)
    if new_version != sf.version:
        report.notes.append(
            f"the rebuilt file has state version {new_version} (the input had {sf.version}): "
            f"only a llama.cpp that loads version {new_version} takes it"
        )
    plan = Plan()
    plan.copy(base, 0, base_size)
    report.rebuild(
        "body",
        base_size - words_end,
        f"prefilled {n} tokens through llama.cpp ({describe_settings(data['settings'])}; settings from "
        f"{', '.join(sources) or 'defaults'}) and saved with llama_state_seq_save_file",
        tokens=n,
        offset=words_end,
    )
    if at is None and data["model"]["needs_checkpoints"]:
        report.notes.append(
            "no checkpoint positions were known: took one near the end "
            "(the model's memory cannot be rolled back without checkpoints)"
        )
    rb = Rebuilt(plan, report, sf.path, blobs, data)
    plan_rebuilt_checkpoints(rb, tail)
    _drop_old_checkpoints(report, tail, "replaced by a rebuilt checkpoint")
    plan_rebuilt_sdft(rb, tail)
    if tail.damaged_sdft is not None:
        report.drop("sdft", tail.damaged_sdft.offset, sf.size - tail.damaged_sdft.offset, tail.damaged_sdft.reason)
    out.plan = plan
    out.test_draft = bool(opts.draft_model)
    out.rebuilt_body = True
    return out


def _drop_old_checkpoints(report: Report, tail: Tail, why_ok: str) -> None:
    """Report the input's checkpoints as dropped: a rebuild writes its own."""
    if tail.sckp is not None:
        for e in tail.sckp.entries:
            why = why_ok if e.ok else e.reason
            report.drop(f"sckp.checkpoint[{e.index}]", e.offset, e.end - e.offset, why, n_tokens=e.n_tokens)


def _version_of(path: str) -> int:
    with open(path, "rb") as f:
        return int(g.FileHeader.parse(f.read(12)).version)


def _same_geometry(sf: SlotFile, view: memoryview, rebuilt: str, retry: Retry) -> None:
    """Refuse a rebuild whose state does not have the damaged file's shape: the model given
    is not the one that wrote the file (a rebuild would silently swap the model's state in)."""
    assert sf.body is not None
    new = open_slot_file(rebuilt)
    try:
        if new.body is None or new.body.layout is None:
            raise Refused("the rebuilt state does not parse (a llama.cpp build this reader does not know?)")
        if retry.force_rebuild and sf.body.layout is not None:
            _same_blocks(sf.body, new.body)
            return
        got = probe_body(view_of(new), new.body.offset, new.body.end, rot=has_rot(new))
        want = probe_body(view, sf.body.offset, len(view), rot=has_rot(sf))
        if (
            new.body.blocks
            and new.body.blocks[0].kind == MemoryKind.KV
            and len(new.body.blocks[0].streams) != want.get("n_stream", len(new.body.blocks[0].streams))
        ):
            raise Refused("the rebuilt state has another stream count than the file")
        for key in ("n_layer", "k_row", "ext"):
            if key in want and key in got and want[key] != got[key]:
                raise Refused(
                    f"the model does not match the file: {key.replace('_', ' ')} {got[key]} in the "
                    f"rebuilt state, {want[key]} in the file (is this the model that wrote it?)"
                )
    finally:
        new.close()


def _same_blocks(old: Body, new: Body) -> None:
    assert old.layout is not None and new.layout is not None
    old_sizes = [b.size for b in old.blocks]
    new_sizes = [b.size for b in new.blocks]
    if old.layout.kinds != new.layout.kinds or old_sizes != new_sizes:
        raise Refused(
            f"the model does not match the file: the rebuilt state is "
            f"{new.layout.describe()} of {new_sizes} bytes, the file's "
            f"{old.layout.describe()} of {old_sizes} bytes (is this the model that wrote it?)"
        )


def _keep_body(sf: SlotFile, body: Body, view: memoryview, out: Planned, opts: RepairOptions, retry: Retry) -> Planned:
    """Keep header, tokens and ``body`` verbatim; salvage what follows it."""
    report = out.report
    plan = Plan()
    plan.copy(sf.path, 0, body.end)
    report.keep("header+tokens", 0, body.offset, tokens=sf.n_tokens)
    report.keep("body", body.offset, body.size, layout=body.layout.describe() if body.layout else None)
    partial = PARTIAL_OF.get(body.memory_class) if body.layout is not None else None
    tail = analyse_tail(sf, view, body.end, tgt_partial=partial)
    apply_exclusions(tail, retry)
    out.ckpt_map = plan_tail(plan, report, sf.path, view, tail, body.end)
    out.plan = plan
    out.identity = plan.is_identity(sf.path, sf.size)
    out.test_draft = bool(opts.draft_model)
    return out


def _body_by_loader(
    sf: SlotFile, view: memoryview, settings: dict[str, Any], opts: RepairOptions, report: Report
) -> Body | None:
    """Test-load the input itself; when llama.cpp restores it and the bytes up to where it
    stopped parse clean, that is the body."""
    if settings.get("flash_attn") is None or settings.get("type_k") is None or settings.get("type_v") is None:
        return None
    from slotfile.format.reader import parse_buffer
    from slotfile.llama.loader import LoaderError, LoadSettings, test_load

    n_seq = int(settings.get("n_seq_max") or 1)
    unified = bool(settings.get("kv_unified"))
    per = max(256, -(-(sf.n_tokens + 1) // 256) * 256)
    ls = LoadSettings(
        per if unified or n_seq == 1 else per * n_seq,
        n_seq,
        unified or n_seq == 1,
        bool(settings["flash_attn"]),
        tid(settings["type_k"]),
        tid(settings["type_v"]),
        opts.n_gpu_layers,
        int(settings.get("seq_id") or 0),
    )
    assert opts.model is not None
    t0 = time.monotonic()
    try:
        res = test_load(sf.path, opts.model, None, ls, timeout=opts.timeout, llama_lib=opts.llama_lib)
    except LoaderError as e:
        raise Operational(str(e)) from None
    finally:
        report.timings["probe-load"] = time.monotonic() - t0
    end = int(res.body_bytes or 0)
    if not res.ok or not sf.body or end <= sf.body.offset or end >= sf.size:
        return None
    sub = parse_buffer(view[:end], sf.path)
    if not body_ok(sub) or sub.body is None or sub.body.end != end or sub.errors:
        return None
    report.notes.append(
        f"llama.cpp restores the body and stops at offset {end}: the {sf.size - end} bytes "
        "after it are not part of it (the reader alone could not tell)"
    )
    return sub.body
