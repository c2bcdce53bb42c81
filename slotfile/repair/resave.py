"""re-save: load the body through llama.cpp and write it again (optionally with the V layout
flipped for the other flash-attention setting, or recomputed), keeping the checkpoints and
the draft state."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slotfile.format import grammar as g
from slotfile.format.records import Body, MemoryKind, SlotFile, TokenForm
from slotfile.format.types import TRANSPOSABLE, TYPES, type_name
from slotfile.repair.common import (
    Planned,
    Refused,
    RepairOptions,
    Retry,
    body_ok,
    header_tokens_ok,
    operation,
    prefill_request,
    tgt_partial,
    tokens_of,
    view_of,
    words_of,
    worker_ok,
)
from slotfile.repair.kept import BlobWriter, plan_tail
from slotfile.repair.plan import TPlan, write_with_transposed
from slotfile.repair.rebuilt import Rebuilt, plan_recomputed_tail
from slotfile.repair.report import Report
from slotfile.repair.settings import file_flash_attn, tid, worker_settings
from slotfile.repair.tail import BlobRef, Tail, analyse_tail
from slotfile.safewrite import Plan, create_temp


def _new_words(sf: SlotFile, form: str | None) -> tuple[list[int], str]:
    assert sf.tokens is not None
    words = words_of(sf)
    cur = sf.tokens.form if sf.tokens.form != TokenForm.EMPTY else TokenForm.PLAIN
    if form is None or form == cur:
        return words, cur
    toks = tokens_of(sf)
    if form == TokenForm.PLAIN:
        if sf.tokens.media:
            raise Refused(
                f"the payload holds {len(sf.tokens.media)} media chunk(s): a plain token list cannot carry them"
            )
        return toks, "plain"
    return [g.PACKED_MARKER, g.SERVER_TOKENS_VERSION, len(toks), *toks, 0], "packed"


def _transposing_writer(sf: SlotFile, to_v_trans: int, report: Report) -> BlobWriter:
    def write(plan: Plan, ref: BlobRef, section: str) -> None:
        info = ref.info
        plan.copy(sf.path, ref.offset, 16)  # u64 length + io_magic + seq_id
        if info is None or info.body is None:
            raise Refused(f"{section}: blob not parsed, cannot flip its V layout")
        n = transpose_body(plan, sf, info.body, ref.data_offset + 8, ref.end, to_v_trans, section)
        if n:
            report.change(section, "v_trans", 1 - to_v_trans, to_v_trans, v_layers=n)

    return write


def transpose_body(plan: Plan, sf: SlotFile, body: Body, start: int, end: int, to_v_trans: int, section: str) -> int:
    """Copy ``start..end`` with every KV stream's V rewritten for ``to_v_trans``; returns the
    number of V layers flipped."""
    assert isinstance(plan, TPlan)
    pos = start
    flipped = 0
    for blk in body.blocks:
        if blk.kind != MemoryKind.KV or not blk.has_v:
            continue
        for st, sc in zip(blk.streams, blk.raw.streams, strict=False):
            if not st.cell_count or sc.data is None or st.v_trans == to_v_trans:
                continue
            vt = int(sc.data.v_trans_offset)
            plan.copy(sf.path, pos, vt - pos)
            plan.literal(g.v_trans_word(to_v_trans))
            pos = vt + 4
            for run in st.v:
                pos = _transpose_run(plan, sf.path, run, pos, st.cell_count, to_v_trans, section)
                flipped += 1
    plan.copy(sf.path, pos, end - pos)
    return flipped


def _transpose_run(plan: TPlan, src: str, run: Any, pos: int, cells: int, to_v_trans: int, section: str) -> int:
    """One V layer in the other layout (llama_kv_cache::state_write_data writes V as rows of
    ``cells`` with flash attention on, element-major with it off); returns where it ended."""
    t = TYPES.get(run.type_id)
    if t is None or run.type_id not in TRANSPOSABLE:
        raise Refused(
            f"{section}: V of type {type_name(run.type_id)} cannot be stored transposed "
            "(flash attention off needs an f32/f16/bf16 V cache)"
        )
    el = t.type_size
    plan.copy(src, pos, run.offset - pos)
    if to_v_trans == 0:  # element-major [n_embd x cells] -> rows [cells x n_embd]
        n_embd = int(run.n_embd or 0)
        plan.literal(g.kv_layer_head(run.type_id, n_embd * el))
        plan.transposed(src, run.data.offset, n_embd, cells, el)
    else:
        n_embd = run.row_size // el
        plan.literal(g.kv_layer_t_head(run.type_id, el, n_embd))
        plan.transposed(src, run.data.offset, cells, n_embd, el)
    return run.data.offset + run.data.length


@operation("re-save")
def resave(sf: SlotFile, opts: RepairOptions, workdir: str, out: Planned, retry: Retry) -> Planned:
    dry_run = out.report.dry_run
    header_tokens_ok(sf)
    if opts.model is None:
        raise Refused("re-save needs --model")
    if not body_ok(sf):
        raise Refused("the body is cut or damaged; run truncate-recover --model first")
    job = _Job.of(sf, opts, out)
    if dry_run:
        return job.dry()
    from slotfile.llama.requests import run_worker

    base, fd = create_temp(workdir, Path(sf.path).name, ".resave")
    os.close(fd)
    out.temps.append(base)
    t0 = time.monotonic()
    if job.method == "prefill":
        job.prefill(run_worker, base, workdir, t0)
    else:
        job.load_save(run_worker, base, workdir, t0)
    out.test_draft = bool(opts.draft_model)
    return out


class _Job:
    """One re-save: what changes (token form, flash attention) and how (load+save,
    transpose, prefill)."""

    def __init__(
        self,
        sf: SlotFile,
        opts: RepairOptions,
        out: Planned,
        settings: dict[str, Any],
        new_fa: bool | None,
        method: str,
        new_words: list[int],
        tail: Tail,
    ) -> None:
        self.sf, self.opts, self.out, self.report = sf, opts, out, out.report
        self.settings, self.new_fa, self.method, self.new_words, self.tail = settings, new_fa, method, new_words, tail
        self.words_end = 12 + 4 * len(new_words)

    @classmethod
    def of(cls, sf: SlotFile, opts: RepairOptions, out: Planned) -> _Job:
        assert sf.body is not None
        from slotfile.llama.loader import settings_for

        settings = worker_settings(settings_for(sf, n_gpu_layers=opts.n_gpu_layers))
        file_fa = file_flash_attn(sf)
        new_fa = file_fa if opts.flash_attn is None else opts.flash_attn
        flip = file_fa is not None and new_fa != file_fa
        new_words, form = _new_words(sf, opts.tokens)
        tail = analyse_tail(sf, view_of(sf), sf.body.end, tgt_partial=tgt_partial(sf))
        old_form = sf.tokens.form if sf.tokens is not None else TokenForm.EMPTY
        if new_words != words_of(sf):
            out.report.change(
                "tokens", "form", old_form, form, words_before=sf.n_token_count, words_after=len(new_words)
            )
        if file_fa is None and opts.flash_attn is not None:
            out.report.notes.append("the state holds no V cache: flash attention does not change its bytes")
            settings["flash_attn"] = opts.flash_attn
        method = ("prefill" if opts.recompute else "transpose") if flip else "load+save"
        new_types = {k: v for k, v in (("type_k", opts.type_k), ("type_v", opts.type_v)) if v is not None}
        if any(tid(v) != tid(settings[k]) for k, v in new_types.items()):
            method = "prefill"  # other cache types: only a recompute gives their values
            settings.update(new_types)
        return cls(sf, opts, out, settings, new_fa, method, new_words, tail)

    @property
    def new_settings(self) -> dict[str, Any]:
        s = dict(self.settings)
        s["flash_attn"] = self.new_fa if self.new_fa is not None else self.settings.get("flash_attn")
        return s

    def _fa(self) -> str:
        return "on" if self.new_fa else "off"

    def _types(self) -> str:
        """The cache types a recompute writes, when the options change them."""
        if self.opts.type_k is None and self.opts.type_v is None:
            return ""
        return f", K {type_name(tid(self.settings['type_k']))}, V {type_name(tid(self.settings['type_v']))}"

    def dry(self) -> Planned:
        sf = self.sf
        assert sf.body is not None
        layout = "rows (flash attention on)" if self.new_fa else "transposed (flash attention off)"
        how = {
            "load+save": "would load the body with llama_state_seq_load_file and write it again with "
            "llama_state_seq_save_file",
            "transpose": f"would rewrite V as {layout} byte for byte, then load and save it through llama.cpp",
            "prefill": f"would prefill {sf.n_tokens} tokens with flash attention {self._fa()}{self._types()}",
        }[self.method]
        self.report.rebuild("body", sf.body.size, how, tokens=sf.n_tokens)
        plan_tail(Plan(), self.report, sf.path, view_of(sf), self.tail, sf.body.end)
        return self.out

    def prefill(self, run_worker: Callable[..., Any], base: str, workdir: str, t0: float) -> None:
        sf, opts = self.sf, self.opts
        blobs, fd = create_temp(workdir, Path(sf.path).name, ".blobs")
        os.close(fd)
        self.out.temps.append(blobs)
        at = [e.n_tokens for e in (self.tail.sckp.good if self.tail.sckp else [])]
        request = prefill_request(sf, opts, self.new_settings, self.new_words, at, base, blobs)
        res = run_worker(request, timeout=opts.timeout)
        self.report.timings["llama.cpp"] = time.monotonic() - t0
        worker_ok(res, "recomputing the state")
        size = int(res.data["file_size"])
        plan = TPlan()
        plan.copy(base, 0, size)
        self.report.rebuild(
            "body",
            size - self.words_end,
            f"recomputed: prefilled {sf.n_tokens} tokens with flash attention {self._fa()}{self._types()} (a context "
            "with the other setting cannot take the old state directly); values may differ slightly "
            "from the original's",
            tokens=sf.n_tokens,
            offset=self.words_end,
        )
        plan_recomputed_tail(Rebuilt(plan, self.report, sf.path, blobs, res.data), self.tail)
        self.out.plan = plan

    def _flipped_input(self, workdir: str) -> str:
        """Header + tokens + body with V flipped, written to a temp file for the worker."""
        sf = self.sf
        assert sf.body is not None
        tplan = TPlan()
        tplan.literal(g.file_header(g.GGSQ_MAGIC, sf.version or 0, len(self.new_words)))
        tplan.literal(g.plain_tokens(self.new_words))
        flipped = transpose_body(tplan, sf, sf.body, sf.body.offset, sf.body.end, 0 if self.new_fa else 1, "body")
        flat, fd = create_temp(workdir, Path(sf.path).name, ".flip")
        self.out.temps.append(flat)
        try:
            write_with_transposed(tplan, fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.report.notes.append(
            f"flash attention {'off -> on' if self.new_fa else 'on -> off'}: {flipped} V layer(s) "
            "rewritten byte for byte (the same values in the other layout; no recompute)"
        )
        return flat

    def load_save(self, run_worker: Callable[..., Any], base: str, workdir: str, t0: float) -> None:
        sf, opts = self.sf, self.opts
        assert sf.body is not None
        transpose = self.method == "transpose"
        src = self._flipped_input(workdir) if transpose else sf.path
        res = run_worker(
            {
                "op": "resave",
                "model": opts.model,
                "settings": self.new_settings if transpose else self.settings,
                "in": src,
                "capacity": max(sf.n_token_count or 0, len(self.new_words)) + 16,
                "words": self.new_words,
                "out": base,
                "n_tokens": sf.n_tokens,
                "llama_lib": opts.llama_lib,
                "state_version": sf.version,
            },
            timeout=opts.timeout,
        )
        self.report.timings["llama.cpp"] = time.monotonic() - t0
        worker_ok(res, "loading and saving the state")
        size = int(res.data["file_size"])
        plan = TPlan()
        plan.copy(base, 0, size)
        how = (
            "loaded with llama_state_seq_load_file and written again with llama_state_seq_save_file"
            if not transpose
            else f"V layout flipped for flash attention {self._fa()}, then loaded and saved through llama.cpp"
        )
        self.report.rebuild("body", size - self.words_end, how, tokens=sf.n_tokens, offset=self.words_end)
        if self.new_words == words_of(sf):
            self.report.keep("tokens", 12, 4 * len(self.new_words), tokens=sf.n_tokens)
        writer = _transposing_writer(sf, 0 if self.new_fa else 1, self.report) if transpose else None
        self.out.ckpt_map = plan_tail(
            plan, self.report, sf.path, view_of(sf), self.tail, sf.body.end, blob_writer=writer
        )
        self.out.plan = plan
