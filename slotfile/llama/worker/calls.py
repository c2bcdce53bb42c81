"""The llama.cpp state calls the worker makes (set/get a sequence blob, load/save a sequence
file, decode), each wrapped so that a refusal becomes :class:`Failed` with llama.cpp's reason."""

from __future__ import annotations

import ctypes
import itertools
import time
from typing import Any

from slotfile.llama.worker import runtime as rt
from slotfile.llama.worker.runtime import BATCH, Failed, recent

# ---------------------------------------------------------------------------------------
# llama.cpp state calls
# ---------------------------------------------------------------------------------------


def set_blob(ctx: Any, blob: bytes, seq: int, flags: int) -> tuple[bool, str]:
    buf = (ctypes.c_uint8 * max(1, len(blob))).from_buffer_copy(blob or b"\0")
    del recent[:]
    n = int(rt.L.llama_state_seq_set_data_ext(ctx, buf, len(blob), seq, flags))
    if n == len(blob):
        return True, f"consumed all {n} bytes"
    if n == 0:
        why = "; ".join(dict.fromkeys(x for x in recent if x))
        return False, "llama_state_seq_set_data_ext rejected the blob" + (f": {why}" if why else "")
    return False, (
        f"consumed {n} of {len(blob)} bytes: the server's common_prompt_checkpoint::load_* "
        "would GGML_ABORT on this blob"
    )


def get_blob(ctx: Any, seq: int, flags: int) -> bytes:
    size = int(rt.L.llama_state_seq_get_size_ext(ctx, seq, flags))
    buf = (ctypes.c_uint8 * max(size, 1))()
    n = int(rt.L.llama_state_seq_get_data_ext(ctx, buf, size, seq, flags))
    if n != size:
        raise Failed(f"llama_state_seq_get_data_ext wrote {n} of {size} bytes")
    return bytes(buf)[:size]


def load_seq_file(ctx: Any, path: str, seq: int, capacity: int | None) -> tuple[int, int]:
    """llama_state_seq_load_file: (its return, tokens read); ``capacity`` None: a sizing
    pass with tokens_out = NULL, as the server makes before the real one."""
    n_out = ctypes.c_size_t(0)
    if capacity is None:
        ret = int(rt.L.llama_state_seq_load_file(ctx, path.encode(), seq, None, 0, ctypes.byref(n_out)))
        return ret, int(n_out.value)
    toks = (rt.L.llama_token * max(capacity, 1))()
    ret = int(rt.L.llama_state_seq_load_file(ctx, path.encode(), seq, toks, max(capacity, 1), ctypes.byref(n_out)))
    return ret, int(n_out.value)


def save_seq_file(ctx: Any, path: str, seq: int, words: list[int]) -> int:
    arr = (rt.L.llama_token * max(len(words), 1))(*words)
    return int(rt.L.llama_state_seq_save_file(ctx, path.encode(), seq, arr, len(words)))


def decode(ctx: Any, tokens: list[int], pos0: int, seq: int, outputs: bool, batch: int = 0) -> None:
    """Decode ``tokens`` at positions from ``pos0`` in calls of up to ``batch`` tokens;
    ``outputs``: logits for the last token of each call."""
    step = max(1, min(batch or BATCH, int(rt.L.llama_n_batch(ctx))))
    for start in range(0, len(tokens), step):
        part = tokens[start : start + step]
        b = rt.L.llama_batch_init(len(part), 0, 1)
        try:
            b.n_tokens = len(part)
            for i, t in enumerate(part):
                b.token[i] = t
                b.pos[i] = pos0 + start + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = outputs and i == len(part) - 1
            rc = int(rt.L.llama_decode(ctx, b))
        finally:
            rt.L.llama_batch_free(b)
        if rc != 0:
            raise Failed(f"llama_decode returned {rc} at token {pos0 + start}")


def decode_one_thread(ctx: Any, tokens: list[int], pos0: int, seq: int, outputs: bool = False) -> None:
    """Decode ``tokens`` one per llama_decode call on a single thread (the deep check's probe
    token).  A one-token graph is too small to share reliably: see :func:`decode_stepwise`."""
    n_threads, n_batch_threads = int(rt.L.llama_n_threads(ctx)), int(rt.L.llama_n_threads_batch(ctx))
    rt.L.llama_set_n_threads(ctx, 1, 1)
    try:
        decode(ctx, tokens, pos0, seq, outputs, 1)
    finally:
        rt.L.llama_set_n_threads(ctx, n_threads, n_batch_threads)


STEPWISE_SLOWER = 2.0  # a multi-thread one-token decode this much slower than one thread's: one thread from then on


def decode_stepwise(ctx: Any, tokens: list[int], pos0: int, seq: int, outputs: bool = False) -> None:
    """Decode ``tokens`` one per llama_decode call (the path the server's generated tokens
    take: the deep check's noise floor), on the thread count that is quicker here now.

    With two threads each of a one-token graph's few hundred ops ends at a barrier.  On idle
    cores that still saves a third (Gemma 3 270M, 32 decodes: 0.67 s on two threads, 1.01 s on
    one); on a busy machine every barrier waits for the other thread to be scheduled (55.7 s
    on two threads, 2.7 s on one).  So it is measured: a warm-up token and one timed token on
    one thread, one on all; the quicker count goes on, and a decode on all threads that takes
    over :data:`STEPWISE_SLOWER` times the one-thread time puts the rest on one thread.  The
    thread count does not change the values: each output row is computed by one thread
    whatever the count (tests/test_loader.py holds the states byte-identical)."""
    n_threads, n_batch_threads = int(rt.L.llama_n_threads(ctx)), int(rt.L.llama_n_threads_batch(ctx))
    one = 0.0  # seconds of a timed one-thread decode
    many = n_threads > 1 and len(tokens) > 3
    try:
        for i, tok in enumerate(tokens):
            use_many = many and i >= 2
            rt.L.llama_set_n_threads(ctx, *((n_threads, n_batch_threads) if use_many else (1, 1)))
            t = time.perf_counter()
            decode(ctx, [tok], pos0 + i, seq, outputs, 1)
            took = time.perf_counter() - t
            if i == 1:
                one = took
            elif use_many and took > (STEPWISE_SLOWER if i > 2 else 1.0) * one:
                many = False  # slower than one thread (at the trial: at all; later: by 2x)
    finally:
        rt.L.llama_set_n_threads(ctx, n_threads, n_batch_threads)


def pos_range(ctx: Any, seq: int) -> tuple[int, int]:
    mem = rt.L.llama_get_memory(ctx)
    return int(rt.L.llama_memory_seq_pos_min(mem, seq)), int(rt.L.llama_memory_seq_pos_max(mem, seq))


def segments(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    bounds = sorted({c for c in cuts if 0 < c < n} | {0, n})
    return list(itertools.pairwise(bounds))
