"""The llama.cpp worker: the one process that calls llama.cpp (started by slotfile.llama.loader).

    python -m slotfile.llama.worker --model M.gguf [--draft-model D.gguf] [--n-gpu-layers N] [--threads N]

It loads the model(s) once, says hello, then answers one JSON request per line on stdin with
one JSON line on its private protocol pipe (the original stdout; fd 1 is pointed at stderr so
that nothing llama.cpp prints can corrupt the protocol); ``deep`` with ``early`` sends one
``{"interim": ...}`` line before its reply.  llama.cpp's log (warnings and
errors) is written to fd 2 as it happens, so it survives an abort: the parent reads it back
from the file it gave the worker as stderr.  The parent ends the worker with SIGKILL: freeing
the model and contexts costs time and leaves nothing behind that the kernel would not reclaim.

It imports llama-cpp-python's ctypes bindings alone
(:func:`slotfile.llama.worker.runtime.import_bindings`, not the package's ``Llama`` class),
:mod:`slotfile.llama.worker.settings`, :mod:`slotfile.format.magics` and the standard library
(the appendix reader only for a file with an appendix, numpy only for ``deep``): an abort or a
segfault inside llama.cpp kills this process and nothing else, and its start-up overlaps the
parent's own imports.  The hello's ``startup`` gives the time each start-up phase ended.

Which llama.cpp: llama-cpp-python opens ``$LLAMA_CPP_LIB_PATH/libllama.so`` when the parent sets
that variable (``--llama-lib``), else its own build.  A library that does not load is one
``library_error`` line to the parent.  The hello reports the library's path and the state and
session versions it writes, read from the headers of two tiny files it saves
(:func:`detect_versions`, a few ms), never the Python package's constants.

The code is in three modules: :mod:`~slotfile.llama.worker.runtime` (bindings, protocol, log,
model, contexts, versions), :mod:`~slotfile.llama.worker.calls` (the llama.cpp state calls) and
this one (the requests and ``main``).

Requests (``op``); every context comes from :func:`~slotfile.llama.worker.runtime.context_params`:

* ``load``: ``llama_state_seq_load_file`` the way the server restores a slot (a sizing pass
  with ``tokens_out = NULL``, then the real pass), then every SCKP ``data_tgt`` with
  ``llama_state_seq_set_data_ext(PARTIAL_ONLY)`` and, with a draft model, the SDFT
  ``data_dft`` (and each checkpoint's ``data_dft``) into a draft context.  GGSN files go
  through ``llama_state_load_file``.
* ``deep``: restore the file and decode a probe token (logits A); then prefill the given
  tokens in a cleared context with the same settings and the server's batch sizes (and the
  requested ``cuts``: the server's checkpoint breaks or reused prefix), save the
  recomputed state as a GGSQ file for the parent to compare, and decode the same probe
  (logits B); then the last ``n_stepwise`` tokens again one per call, the noise floor (logits C).
* ``prefill``: decode the stored tokens into a fresh context with the file's settings (what a
  damaged file no longer shows is completed from the model or refused), taking PARTIAL_ONLY
  checkpoint blobs at the requested n_tokens on the way (and draft blobs with a draft model),
  then write header + tokens + body with ``llama_state_seq_save_file``.
* ``deep_blobs``: the deep check of the appendices: prefill the stored tokens in a fresh context
  with the file's settings and the server's batch sizes, stopping at each checkpoint's n_tokens
  to take the PARTIAL_ONLY blob there (and, with a draft model, the draft context's blob and at
  the end its whole state), written to a scratch file for the parent to compare.
* ``resave``: load a file with ``llama_state_seq_load_file`` and write it again with
  ``llama_state_seq_save_file`` (optionally with another token payload).
* ``quit``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import struct
import sys
import time
import traceback
from typing import Any

from slotfile.llama.worker import runtime as rt
from slotfile.llama.worker.calls import (
    decode,
    decode_one_thread,
    get_blob,
    load_seq_file,
    pos_range,
    save_seq_file,
    set_blob,
)
from slotfile.llama.worker.pieces import prompt_pieces, segments, stepwise_ranges
from slotfile.llama.worker.runtime import (
    BATCH,
    DEEP_N_BATCH,
    DEEP_N_UBATCH,
    F16_NAME,
    ContextError,
    Failed,
    Model,
    complete_settings,
    default_checkpoint_positions,
    detect_versions,
    library_path,
    logged_errors,
    mark,
    package_version,
    recent,
    request_context,
    request_settings,
    send,
    startup,
)

__all__ = ["Worker", "default_checkpoint_positions", "main"]


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.model = Model(args.model, args.n_gpu_layers, args.threads)
        self.draft = Model(args.draft_model, args.n_gpu_layers, args.threads) if args.draft_model else None
        startup["model"] = time.monotonic()
        self.versions = detect_versions(self.model)
        startup["versions"] = time.monotonic()

    def hello(self) -> dict[str, Any]:
        return {
            "ok": True,
            "pid": os.getpid(),
            "llama_cpp_python": package_version(),
            # what the library itself writes (detect_versions), not the Python package's constants
            "state_seq_version": self.versions.get("state_seq_version"),
            "session_version": self.versions.get("session_version"),
            "version_error": self.versions.get("error"),
            "detect_seconds": self.versions.get("seconds"),
            "python_state_seq_version": int(rt.L.LLAMA_STATE_SEQ_VERSION),
            "python_session_version": int(rt.L.LLAMA_SESSION_VERSION),
            "library": library_path(),
            "n_vocab": self.model.n_vocab,
            "n_ctx_train": self.model.n_ctx_train,
            "draft_n_vocab": self.draft.n_vocab if self.draft else None,
            "model": self.model.info(),
            "startup": dict(startup),
        }

    def _state_version(self) -> int:
        """The state version this library writes (the header of a recomputed state must say it)."""
        v = self.versions.get("state_seq_version")
        return int(v) if v is not None else int(rt.L.LLAMA_STATE_SEQ_VERSION)

    # ---------------------------------------------------------------- load

    def _restore(self, ctx: Any, path: str, seq: int, fmt: str) -> tuple[int, str, int]:
        """(body end offset or 0, message, number of token words)."""
        if fmt == "GGSN":
            with open(path, "rb") as f:
                head = f.read(12)
            n_words = struct.unpack_from("<I", head, 8)[0] if len(head) >= 12 else 0
            cap = max(1, n_words)
            toks = (rt.L.llama_token * cap)()
            n_out = ctypes.c_size_t(0)
            ok = bool(rt.L.llama_state_load_file(ctx, path.encode(), toks, cap, ctypes.byref(n_out)))
            if not ok:
                return 0, "llama_state_load_file failed", n_words
            return os.path.getsize(path), "", n_words
        # the server's two passes: first the token count only, then tokens and state
        ret, n_words = load_seq_file(ctx, path, seq, None)
        if ret == 0:
            return 0, "llama_state_seq_load_file refused the header (sizing pass)", 0
        ret, _ = load_seq_file(ctx, path, seq, n_words)
        if ret == 0:
            return 0, "llama_state_seq_load_file returned 0", n_words
        return ret, "", n_words

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        path, s = req["path"], request_settings(req["settings"])
        seq = s.seq_id
        fmt = req.get("format", "GGSQ")
        out: dict[str, Any] = {
            "ok": False,
            "message": "",
            "body_bytes": 0,
            "checkpoints": [],
            "checkpoint_drafts": [],
            "draft": None,
            "notes": [],
        }
        try:
            ctx = self.model.context(s)
        except ContextError as e:
            out["message"] = str(e)
            return out
        ret, msg, _ = self._restore(ctx, path, seq, fmt)
        if ret == 0:
            out["message"] = msg
            return out
        out.update(ok=True, body_bytes=ret, message=f"restored; the state ends at offset {ret}")
        if fmt != "GGSQ":
            return out
        with open(path, "rb") as f:  # only what follows the body, mapped, never read whole
            size = os.fstat(f.fileno()).st_size
            if size <= ret:  # no appendix: the reader (numpy, construct) stays unimported
                return out
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = memoryview(mm)[ret:]
        # imported here, not at start-up: the worker must reach the model load cheaply
        from slotfile.format.appendix import server_read

        ckpts, sckp_note, sdft_dft, sdft_note = server_read(data, 0).astuple()  # blobs: views of the map
        for note in (sckp_note, sdft_note):
            if note:
                out["notes"].append(note)
        flags = int(rt.L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        for tgt, _dft in ckpts or []:
            out["checkpoints"].append(list(set_blob(ctx, tgt, seq, flags)))
        if self.draft is not None and req.get("draft_settings") is not None:
            ds_raw = req["draft_settings"]
            ds = request_settings(ds_raw)
            try:
                dctx = self.draft.context(ds)
            except ContextError as e:
                if sdft_dft is not None:
                    out["draft"] = [False, str(e)]
                return out
            dseq = int(ds_raw.get("seq_id", seq))
            for _tgt, dft in ckpts or []:
                if dft:
                    out["checkpoint_drafts"].append(list(set_blob(dctx, dft, dseq, flags)))
                else:
                    out["checkpoint_drafts"].append([True, "no data_dft"])
            if sdft_dft is not None:
                out["draft"] = list(set_blob(dctx, sdft_dft, dseq, 0)) if sdft_dft else [True, "empty data_dft"]
        return out

    # ---------------------------------------------------------------- deep

    def _logits(self, ctx: Any) -> Any:
        import numpy as np

        p = rt.L.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(p, shape=(self.model.n_vocab,)).astype(np.float32, copy=True)

    def deep(self, req: dict[str, Any]) -> dict[str, Any]:
        """Restore the file and decode the probe (logits A); recompute the tokens in the same
        context, cleared, with the server's batch sizes (``n_batch``/``n_ubatch``, default
        2048/512 as common/common.h), write that state to ``out`` and decode the probe (logits
        B); ``cuts``: positions where the prefill starts a new llama_decode call (the server's
        checkpoint breaks, a reused prefix); ``stepwise``: ranges ``[a, b)`` of positions decoded one
        token per call (replies the server generated).  With ``n_stepwise`` > 0 and ``out_floor``: drop
        the last ``n_stepwise`` cells, decode those tokens again one per llama_decode call (the
        path the server's generated tokens take), write that state to ``out_floor`` and decode
        the probe (logits C): the parent's noise floor, at the cost of ``n_stepwise``
        single-token decodes.  With ``early``, a line ``{"interim": "recomputed"}`` says that
        ``out`` is written before those decodes start (the reply still follows)."""
        rt.import_beside("numpy")  # for the logits, while the file is restored and the probe decoded
        path, s, tokens = req["path"], request_settings(req["settings"]), [int(t) for t in req["tokens"]]
        probe = int(req["probe"])
        n_batch = int(req.get("n_batch") or DEEP_N_BATCH)
        n_ubatch = int(req.get("n_ubatch") or DEEP_N_UBATCH)
        n = len(tokens)
        n_stepwise = min(int(req.get("n_stepwise") or 0), n // 2) if req.get("out_floor") else 0
        replies = stepwise_ranges(req.get("stepwise"), n)  # generated replies: one token per call
        asked = [int(c) for c in req.get("cuts") or []]
        seq = s.seq_id
        out: dict[str, Any] = {"ok": False, "message": ""}
        try:
            # swa_full: a --swa-full server's cache never reuses a cell, and the cells of a
            # sliding-window cache that does are summed in another order past n_swa + n_ubatch
            ctx = self.model.context(s, n_batch, n_ubatch, bool(req.get("swa_full")))
        except ContextError as e:
            out["message"] = str(e)
            return out
        ret, msg, _ = self._restore(ctx, path, seq, "GGSQ")
        if ret == 0:
            out["message"] = msg
            return out
        mem = rt.L.llama_get_memory(ctx)
        pos_next = int(rt.L.llama_memory_seq_pos_max(mem, seq)) + 1
        out["restored_pos_max"] = pos_next - 1
        try:
            decode_one_thread(ctx, [probe], pos_next, seq, True)
            after_restore = self._logits(ctx)
            # recompute from the tokens in the same context, cleared
            rt.L.llama_memory_clear(mem, True)
            # the server's checkpoint breaks and reused prefix: each piece in its own calls; a
            # reply the server generated (reused as the prefix of the next turn's prompt), one
            # token per call, on the context's threads as a server's -t
            for a, b, one in prompt_pieces(n, asked, replies):
                decode(ctx, tokens[a:b], a, seq, False, 1 if one else n_batch)
            self._write_state(ctx, seq, req["out"])
            decode_one_thread(ctx, [probe], n, seq, True)
            recomputed = self._logits(ctx)
            floor = None
            # a recurrent state cannot drop its last cells (llama_memory_seq_rm says no): no floor
            if n_stepwise > 0 and not (self.model.recurrent or self.model.hybrid):
                if req.get("early"):  # the parent compares ``out`` while the stepwise tokens decode
                    send({"interim": "recomputed", "id": req.get("id")})
                if not rt.L.llama_memory_seq_rm(mem, seq, n - n_stepwise, -1):
                    raise Failed(f"llama_memory_seq_rm refused to drop positions {n - n_stepwise}..{n - 1}")
                decode_one_thread(ctx, tokens[n - n_stepwise :], n - n_stepwise, seq)
                self._write_state(ctx, seq, req["out_floor"])
                decode_one_thread(ctx, [probe], n, seq, True)
                floor = self._logits(ctx)
        except Failed as e:
            out["message"] = str(e)
            return out
        finally:
            rt.L.llama_memory_clear(mem, True)
        lg = _compare_logits(after_restore, recomputed, floor)
        n_stepwise = n_stepwise if floor is not None else 0
        out.update(ok=True, message="recomputed", logits=lg, n_batch=n_batch, n_ubatch=n_ubatch, n_stepwise=n_stepwise)
        out["cuts"] = [b for _a, b in segments(n, asked)][:-1]
        out["stepwise"] = [list(r) for r in replies]  # what was replayed one token per call
        out["swa_full"] = bool(req.get("swa_full"))
        return out

    def _write_state(self, ctx: Any, seq: int, path: str) -> None:
        """The sequence's state as a GGSQ file with no tokens: header + body."""
        blob = get_blob(ctx, seq, 0)
        from slotfile.format.grammar import GGSQ_MAGIC, file_header  # lazily: start-up stays cheap

        with open(path, "wb") as f:
            f.write(file_header(GGSQ_MAGIC, self._state_version(), 0))
            f.write(blob[8:])

    # ---------------------------------------------------------------- prefill

    def prefill(self, req: dict[str, Any]) -> dict[str, Any]:
        """Decode the stored tokens into a fresh context (and the draft's), taking checkpoint
        blobs on the way, then save the state with ``llama_state_seq_save_file``."""
        tokens: list[int] = [int(t) for t in req["tokens"]]
        words: list[int] = [int(w) for w in req["words"]]
        n = len(tokens)
        model = self.model
        bad = [t for t in tokens if not 0 <= t < model.n_vocab]
        if bad:
            raise Failed(
                f"token {bad[0]} is outside the model's vocabulary of {model.n_vocab} "
                "(a different model, or media positions that cannot be prefilled)"
            )
        s = complete_settings(model, req.get("settings") or {}, n)
        seq = s["seq_id"]
        at = req.get("checkpoints_at")
        if at is None:
            at = default_checkpoint_positions(n) if model.needs_checkpoints else []
        at = sorted({int(a) for a in at if 0 < int(a) <= n})
        n_batch = int(req.get("n_batch") or BATCH)
        ctx = request_context(model, s, n_batch)
        dctx = ds = None
        if self.draft is not None:
            ds = dict(s)
            ds.update({k: v for k, v in (req.get("draft_settings") or {}).items() if v is not None})
            ds.setdefault("type_k", F16_NAME)
            ds = complete_settings(self.draft, ds, n)
            dctx = request_context(self.draft, ds, n_batch)
        with open(req["blobs"], "wb") as bf:
            cps, draft = _prefill_into(bf, ctx, dctx, tokens, at, seq, n_batch)
        written = save_seq_file(ctx, req["out"], seq, words)
        if written == 0:
            raise Failed("llama_state_seq_save_file wrote nothing: " + logged_errors())
        size = os.path.getsize(req["out"])
        if written != size:
            raise Failed(f"llama_state_seq_save_file reported {written} bytes, the file has {size}")
        return {
            "ok": True,
            "message": f"prefilled {n} tokens",
            "model": model.info(),
            "settings": s,
            "draft_settings": ds,
            "file_size": size,
            "checkpoints": cps,
            "draft": draft,
            "n_batch": n_batch,
        }

    # ---------------------------------------------------------------- resave

    def resave(self, req: dict[str, Any]) -> dict[str, Any]:
        model = self.model
        s = complete_settings(model, dict(req["settings"]), int(req.get("n_tokens") or 0))
        ctx = request_context(model, s, int(req.get("n_batch") or BATCH))
        seq = s["seq_id"]
        ret, n_words = load_seq_file(ctx, req["in"], seq, int(req["capacity"]))
        if ret == 0:
            raise Failed(f"llama_state_seq_load_file refused the file: {logged_errors(4) or 'no reason logged'}")
        pmin, pmax = pos_range(ctx, seq)
        words = [int(w) for w in req["words"]]
        written = save_seq_file(ctx, req["out"], seq, words)
        if written == 0:
            raise Failed("llama_state_seq_save_file wrote nothing: " + logged_errors())
        return {
            "ok": True,
            "message": f"loaded {ret} bytes and saved {written}",
            "load_ret": ret,
            "n_words_loaded": n_words,
            "file_size": os.path.getsize(req["out"]),
            "settings": s,
            "pos_range": [pmin, pmax],
            "model": model.info(),
        }

    # ---------------------------------------------------------------- deep_blobs

    def deep_blobs(self, req: dict[str, Any]) -> dict[str, Any]:
        """Recompute what the SCKP and SDFT appendices hold: prefill ``tokens`` in a fresh context
        with the file's settings and the deep check's batch sizes (``n_batch``/``n_ubatch``),
        stopping at each n_tokens of ``at``, where the server stopped its prompt to call
        ``server_context::create_checkpoint`` (tools/server/server-context.cpp:2290), and taking
        the blob there as it does: ``llama_state_seq_get_data_ext(ctx, seq, PARTIAL_ONLY)``.  With
        a draft model and ``draft_settings``, the same tokens in a draft context: its PARTIAL_ONLY
        blob at each checkpoint (``data_dft``) and its whole state at the end (SDFT's ``data_dft``).
        Without a draft, decoding stops at the last checkpoint.  With ``n_stepwise`` and
        ``floor_at`` / ``draft_floor_at`` (n_tokens of ``at``; the token count: SDFT's whole draft
        state), instead: the noise floor of those blobs (:func:`_floor_blobs`).  The blobs go to
        ``out``, back to back; the reply gives each one's [offset, length]."""
        s = request_settings(req["settings"])
        tokens = [int(t) for t in req["tokens"]]
        n, n_step = len(tokens), int(req.get("n_stepwise") or 0)
        at = sorted({int(a) for a in req["at"] if 0 < int(a) <= n})
        take = sorted(set(at) & {int(a) for a in req.get("floor_at") or []})
        dtake = sorted((set(at) | {n}) & {int(a) for a in req.get("draft_floor_at") or []})
        n_batch, n_ubatch = int(req.get("n_batch") or DEEP_N_BATCH), int(req.get("n_ubatch") or DEEP_N_UBATCH)
        ctx = self.model.context(s, n_batch, n_ubatch)  # a ContextError is the reply
        dctx, dseq = None, s.seq_id
        if self.draft is not None and req.get("draft_settings") is not None and (dtake or not take):
            ds = request_settings(req["draft_settings"])
            dctx, dseq = self.draft.context(ds, n_batch, n_ubatch), ds.seq_id
        upto = n if dctx is not None else max(at, default=0)  # the draft's whole state needs all
        out: dict[str, Any] = {"ok": True, "checkpoints": [], "draft": None, "floors": [], "draft_floors": []}
        try:
            with open(req["out"], "wb") as bf:
                if take or dtake:
                    if take:
                        out["floors"] = _floor_blobs(bf, ctx, tokens, at, take, s.seq_id, n_batch, n_step)
                    if dtake and dctx is not None:
                        out["draft_floors"] = _floor_blobs(bf, dctx, tokens, at, dtake, dseq, n_batch, n_step, n)
                else:
                    out["checkpoints"], out["draft"] = _prefill_into(
                        bf, ctx, dctx, tokens[:upto], at, s.seq_id, n_batch, dseq
                    )
        finally:
            for c in (ctx, dctx):
                if c is not None:
                    rt.L.llama_memory_clear(rt.L.llama_get_memory(c), True)
        out["message"] = f"prefilled {max(take + dtake) if take or dtake else upto} tokens"
        return out

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        fn = {
            "load": self.load,
            "deep": self.deep,
            "deep_blobs": self.deep_blobs,
            "prefill": self.prefill,
            "resave": self.resave,
        }.get(str(op))
        if fn is None:
            return {"ok": False, "message": f"unknown op {op!r}"}
        t0 = time.monotonic()
        del recent[:]
        try:
            res = fn(req)
        except Failed as e:
            res = {"ok": False, "message": str(e)}
        res["seconds"] = time.monotonic() - t0
        return res


def _prefill_into(
    bf: Any, ctx: Any, dctx: Any, tokens: list[int], at: list[int], seq: int, n_batch: int, dseq: int | None = None
) -> tuple[list[dict[str, Any]], list[int] | None]:
    """Decode ``tokens`` segment by segment, writing the PARTIAL_ONLY blobs at each checkpoint
    position in ``at`` (and the draft's, with a draft context; its sequence ``dseq``, default
    ``seq``), then the draft's whole state, to ``bf``: (the checkpoints' offsets and positions,
    the draft state's [offset, length])."""
    dseq = seq if dseq is None else dseq
    flags = rt.L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    cps: list[dict[str, Any]] = []
    for a, b in segments(len(tokens), at):
        decode(ctx, tokens[a:b], a, seq, True, n_batch)
        if dctx is not None:
            decode(dctx, tokens[a:b], a, dseq, True, n_batch)
        if b in at:
            pmin, pmax = pos_range(ctx, seq)
            item: dict[str, Any] = {"n_tokens": b, "pos_min": pmin, "pos_max": pmax}
            tgt = get_blob(ctx, seq, flags)
            item["tgt"] = [bf.tell(), len(tgt)]
            bf.write(tgt)
            if dctx is not None:
                dft = get_blob(dctx, dseq, flags)
                item["dft"] = [bf.tell(), len(dft)]
                bf.write(dft)
            cps.append(item)
    draft = None
    if dctx is not None:
        full = get_blob(dctx, dseq, 0)
        draft = [bf.tell(), len(full)]
        bf.write(full)
    bf.flush()
    os.fsync(bf.fileno())
    return cps, draft


def _floor_blobs(
    bf: Any,
    ctx: Any,
    tokens: list[int],
    at: list[int],
    take: list[int],
    seq: int,
    n_batch: int,
    n_stepwise: int,
    full: int = -1,
) -> list[dict[str, Any]]:
    """The noise floor of the checkpoint blobs at ``take``, as the deep check's body floor: the
    prefill of :func:`_prefill_into` (segments cut at ``at``) but with the last ``k`` tokens
    before each checkpoint in ``take`` (at most ``n_stepwise``, its segment, half its n_tokens)
    decoded one per llama_decode call, the path the server's generated tokens take (a
    checkpoint's window can hold an earlier turn's generated rows); the PARTIAL_ONLY blob there
    to ``bf`` (at ``full``: the whole state, SDFT's draft).  Never rolled back, so recurrent
    memory gets a floor too.  Returns per blob its n_tokens, ``k``, ``full`` and [offset, length]."""
    out: list[dict[str, Any]] = []
    for a, b in segments(max(take), at):
        k = min(n_stepwise, b - a, b // 2) if b in take else 0
        decode(ctx, tokens[a : b - k], a, seq, True, n_batch)
        if k:
            decode_one_thread(ctx, tokens[b - k : b], b - k, seq)
            blob = get_blob(ctx, seq, 0 if b == full else rt.L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
            out.append({"n_tokens": b, "k": k, "full": b == full, "blob": [bf.tell(), len(blob)]})
            bf.write(blob)
    bf.flush()
    return out


def _compare_logits(after_restore: Any, recomputed: Any, floor: Any | None) -> dict[str, Any]:
    """How far the restored state's next-token logits are from the recomputed ones (and, with a
    noise floor, how far the floor's are): the numbers the parent judges the deep check by."""
    import numpy as np  # only for deep: the worker's start-up stays without numpy

    d = after_restore.astype(np.float64) - recomputed.astype(np.float64)
    norm = float(np.linalg.norm(recomputed.astype(np.float64)))
    top_r = np.argsort(-after_restore)[:5].tolist()
    top_c = np.argsort(-recomputed)[:5].tolist()
    lg: dict[str, Any] = {
        "max_abs": float(np.max(np.abs(d))) if d.size else 0.0,
        "mean_abs": float(np.mean(np.abs(d))) if d.size else 0.0,
        "rel": float(np.linalg.norm(d) / norm) if norm > 0 else float(np.linalg.norm(d)),
        "scale": float(np.std(recomputed)) if recomputed.size else 0.0,
        "top5_restored": top_r,
        "top5_recomputed": top_c,
        "all_finite": bool(np.all(np.isfinite(after_restore))),
    }
    if floor is not None:
        fd = floor.astype(np.float64) - recomputed.astype(np.float64)
        lg["floor_rel"] = float(np.linalg.norm(fd) / norm) if norm > 0 else float(np.linalg.norm(fd))
    return lg


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m slotfile.llama.worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model")
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="0: SLOTFILE_THREADS, else by model size")
    args = ap.parse_args()
    rt.open_protocol()
    failure = rt.bind_library()
    if failure is not None:
        send({"ok": False, "library_error": True, "message": failure})
        return 1
    try:
        worker = Worker(args)
    except Exception as e:  # reported to the parent as an operational error
        send({"ok": False, "message": str(e)})
        return 1
    send(worker.hello())
    for line in sys.stdin:
        if not line.strip():
            continue
        req: Any = None
        try:
            req = json.loads(line)
            op = req.get("op")
            mark(f"{op} {req.get('id', '')}")
            if op == "quit":
                break
            res = worker.handle(req)
        except Exception as e:  # a Python-side failure is reported, not fatal
            res = {"ok": False, "message": f"worker error: {type(e).__name__}: {e}", "trace": traceback.format_exc()}
        res["id"] = req.get("id") if isinstance(req, dict) else None
        send(res)
    return 0
