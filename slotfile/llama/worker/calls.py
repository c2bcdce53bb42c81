"""The llama.cpp state calls the worker makes (set/get a sequence blob, load/save a sequence
file, decode), each wrapped so that a refusal becomes :class:`Failed` with llama.cpp's reason."""

from __future__ import annotations

import ctypes
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
    """Decode ``tokens`` one per llama_decode call on a single thread: the deep check's probe
    token and its stepwise noise floor (the path the server's generated tokens take).

    One thread because a one-token decode's values depend on the thread count: with flash
    attention over 512 or more K/V cells, ``ggml_compute_forward_flash_attn_ext_f16``
    (ggml-cpu/ops.cpp, both pinned trees) splits the cells into one chunk per thread and sums
    the partial softmaxes (``use_split_kv_path``), so two threads round otherwise than one
    (tests/test_loader.py).  A floor that followed the machine's thread count, or its load,
    would move a file's margin from run to run.  The parent judges meanwhile on the other
    core(s) (``early`` in the worker's ``deep``)."""
    n_threads, n_batch_threads = int(rt.L.llama_n_threads(ctx)), int(rt.L.llama_n_threads_batch(ctx))
    rt.L.llama_set_n_threads(ctx, 1, 1)
    try:
        decode(ctx, tokens, pos0, seq, outputs, 1)
    finally:
        rt.L.llama_set_n_threads(ctx, n_threads, n_batch_threads)


def pos_range(ctx: Any, seq: int) -> tuple[int, int]:
    mem = rt.L.llama_get_memory(ctx)
    return int(rt.L.llama_memory_seq_pos_min(mem, seq)), int(rt.L.llama_memory_seq_pos_max(mem, seq))
