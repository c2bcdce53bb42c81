"""Which llama.cpp library the workers load (--llama-lib, SLOTFILE_LLAMA_LIB, the llama-server on
PATH), the state version detected from the library itself, and unusable libraries.

Real llama.cpp only: llama-cpp-python 0.3.36's own library (state version 3) and the v4 library
that scripts/build-llama-v4.sh builds from the pinned llama.cpp source (fixture ``llama_v4_lib``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from slotfile.format.reader import open_slot_file
from slotfile.llama.loader import Library, LoaderError, LoaderPool, library_dir, resolve_library, server_library
from slotfile.llama.requests import run_worker

from .conftest import MODELS, ROOT, SLOTS, slotfile_cli

pytestmark = pytest.mark.llama

MODEL = MODELS / "llama.gguf"
BASE = SLOTS / "llama_f16_fa.slot"  # f16 K/V, flash attention on, 2 checkpoints
NO_LIB_ENV = {"SLOTFILE_LLAMA_LIB": None, "LLAMA_CPP_LIB_PATH": None}


def _prefill(lib: Path | None, out: Path, **extra: object) -> object:
    """A slot file written by llama_state_seq_save_file of ``lib`` after decoding BASE's tokens."""
    sf = open_slot_file(BASE)
    toks = [int(t) for t in sf.tokens.tokens]
    req = {
        "op": "prefill",
        "model": str(MODEL),
        "settings": {"flash_attn": True, "type_k": "f16", "type_v": "f16"},
        "tokens": toks,
        "words": toks,
        "checkpoints_at": [],
        "out": str(out),
        "blobs": str(out) + ".blobs",
        "llama_lib": str(lib) if lib else None,
        **extra,
    }
    return run_worker(req, timeout=300)


@pytest.fixture(scope="module")
def v4_slot(llama_v4_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v4") / "v4.slot"
    r = _prefill(llama_v4_lib, out)
    assert r.ok, r.message  # type: ignore[attr-defined]
    return out


def _header(path: Path) -> tuple[int, int]:
    magic, version = struct.unpack("<II", path.read_bytes()[:8])
    return magic, version


# ----------------------------------------------------------------------------- version detection


def test_the_installed_library_is_detected_as_version_3(monkeypatch):
    monkeypatch.delenv("SLOTFILE_LLAMA_LIB", raising=False)
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    with LoaderPool(str(MODEL)) as pool:
        info = pool.info
        assert (pool.state_seq_version, pool.session_version) == (3, 10)
        assert info["library"].endswith("llama_cpp/lib/libllama.so") and info["library_source"] == "installed"
        assert info["detect_seconds"] < 5
        assert pool.describe()["library"] == info["library"]


def test_the_built_library_is_detected_as_version_4(llama_v4_lib):
    with LoaderPool(str(MODEL), llama_lib=str(llama_v4_lib)) as pool:
        info = pool.info
        # detected from the files the library writes: the Python package still says 3
        assert (pool.state_seq_version, pool.session_version) == (4, 11)
        assert info["python_state_seq_version"] == 3
        assert info["library"] == str(llama_v4_lib / "libllama.so")
        assert (info["library_dir"], info["library_source"]) == (str(llama_v4_lib.resolve()), "--llama-lib")


def test_the_library_file_itself_names_its_folder(llama_v4_lib):
    assert library_dir(llama_v4_lib / "libllama.so") == str(llama_v4_lib.resolve())


def test_the_environment_variable_chooses_the_library(llama_v4_lib, monkeypatch):
    monkeypatch.setenv("SLOTFILE_LLAMA_LIB", str(llama_v4_lib))
    assert resolve_library(None) == Library(str(llama_v4_lib.resolve()), "SLOTFILE_LLAMA_LIB")
    assert resolve_library(llama_v4_lib).source == "--llama-lib"  # the option wins
    with LoaderPool(str(MODEL)) as pool:
        assert pool.state_seq_version == 4 and pool.info["library_source"] == "SLOTFILE_LLAMA_LIB"


# ----------------------------------------------------------------------------- a v4 file end to end


def test_a_v4_file_loads_through_the_v4_library_only(v4_slot, llama_v4_lib, monkeypatch):
    monkeypatch.delenv("SLOTFILE_LLAMA_LIB", raising=False)
    assert _header(v4_slot) == (0x67677371, 4)
    with LoaderPool(str(MODEL), llama_lib=str(llama_v4_lib)) as pool:
        r = pool.load(str(v4_slot))
        assert r.ok and r.body_bytes == v4_slot.stat().st_size, r.message
    with LoaderPool(str(MODEL)) as pool:
        r = pool.load(str(v4_slot))
        assert not r.ok and not r.crashed


def test_verify_a_v4_file_with_llama_lib_deep_included(v4_slot, llama_v4_lib):
    r = slotfile_cli(
        "verify", v4_slot, "--model", MODEL, "--deep", "--llama-lib", llama_v4_lib, "--json", env=NO_LIB_ENV
    )
    assert r.exit_code == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    f = d["files"][0]
    assert [f["levels"][n]["status"] for n in ("structure", "model", "load", "deep")] == ["pass"] * 4
    assert f["levels"]["load"]["details"]["library"] == str(llama_v4_lib / "libllama.so")
    assert d["loader"]["state_seq_version"] == 4 and d["loader"]["session_version"] == 11
    assert d["loader"]["library_source"] == "--llama-lib" and d["loaders"] == [d["loader"]]
    table = slotfile_cli("verify", v4_slot, "--model", MODEL, "--llama-lib", llama_v4_lib, env=NO_LIB_ENV)
    assert table.exit_code == 0
    assert f"with {llama_v4_lib / 'libllama.so'} (state version 4, session version 11)" in table.stdout


def test_verify_a_v4_file_without_a_v4_library_says_what_to_pass(v4_slot, tmp_path):
    """No library of the file's version at hand: the load level cannot be checked here --
    skipped with the reason and what to pass, not failed (exit 0, "not fully checkable")."""
    env = dict(NO_LIB_ENV, PATH=str(tmp_path))  # no llama-server on PATH
    r = slotfile_cli("verify", v4_slot, "--model", MODEL, "--json", env=env)
    assert r.exit_code == 0, r.stdout + r.stderr
    load = json.loads(r.stdout)["files"][0]["levels"]["load"]
    assert load["status"] == "skipped" and load["skip_kind"] == "cannot-check"
    why = load["reason"]
    assert "state version 4" in why and "only loads version 3" in why and "no llama-server on PATH" in why
    assert "pass --llama-lib DIR with a version 4 build" in why and "Traceback" not in r.stderr
    table = slotfile_cli("verify", v4_slot, "--model", MODEL, env=env)
    assert table.exit_code == 0 and "not fully checkable here" in table.stdout


def test_a_named_library_of_another_version_fails_the_load(v4_slot, tmp_path):
    """--llama-lib names a version-3 library for a version-4 file: the user asked for exactly
    that load, so it fails (exit 4) with the same one-line reason."""
    import llama_cpp

    v3_dir = Path(llama_cpp.__file__).parent / "lib"
    env = dict(NO_LIB_ENV, PATH=str(tmp_path))
    r = slotfile_cli("verify", v4_slot, "--model", MODEL, "--llama-lib", v3_dir, "--json", env=env)
    assert r.exit_code == 4, r.stdout + r.stderr
    load = json.loads(r.stdout)["files"][0]["levels"]["load"]
    assert load["status"] == "fail"
    assert "state version 4" in load["problems"][0]["message"]


def test_a_llama_server_on_path_lends_its_library(v4_slot, llama_v4_lib, tmp_path):
    """The llama.cpp the user runs: libllama.so in ../lib of the llama-server on PATH."""
    bin_dir, lib_dir = tmp_path / "bin", tmp_path / "lib"
    bin_dir.mkdir()
    lib_dir.symlink_to(llama_v4_lib, target_is_directory=True)
    server = bin_dir / "llama-server"
    server.write_text("#!/bin/sh\nexit 0\n")
    server.chmod(0o755)
    env = dict(NO_LIB_ENV, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    old = os.environ.get("PATH")
    os.environ["PATH"] = env["PATH"]
    try:
        assert server_library()[0] == str(llama_v4_lib.resolve())
    finally:
        os.environ["PATH"] = old or ""
    r = slotfile_cli("verify", v4_slot, BASE, "--model", MODEL, "--json", env=env)
    assert r.exit_code == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert [f["levels"]["load"]["status"] for f in d["files"]] == ["pass", "pass"]
    libs = [f["levels"]["load"]["details"]["library"] for f in d["files"]]
    assert libs[0] == str(llama_v4_lib.resolve() / "libllama.so") and libs[1].endswith("llama_cpp/lib/libllama.so")
    assert [ld["library_source"] for ld in d["loaders"]] == ["installed", "llama-server on PATH"]
    assert [ld["state_seq_version"] for ld in d["loaders"]] == [3, 4] and [ld["files"] for ld in d["loaders"]] == [1, 1]
    table = slotfile_cli("verify", v4_slot, "--model", MODEL, env=env)
    assert table.exit_code == 0 and "the library of the llama-server on PATH" in table.stdout


def test_repairs_test_load_through_the_named_library(v4_slot, llama_v4_lib, tmp_path):
    out = tmp_path / "o.slot"
    r = slotfile_cli(
        "strip-draft", v4_slot, "-o", out, "--model", MODEL, "--llama-lib", llama_v4_lib, "--json", env=NO_LIB_ENV
    )
    assert r.exit_code == 0, r.stdout + r.stderr
    tl = json.loads(r.stdout)["test_load"]
    assert tl["ok"] and tl["library"] == str(llama_v4_lib / "libllama.so") and tl["state_seq_version"] == 4
    assert out.read_bytes() == v4_slot.read_bytes()


def test_a_rebuild_refuses_a_library_of_another_version(tmp_path):
    """Prefilling a v4 file's tokens through a v3 library would silently write version 3."""
    env_path = os.environ.get("PATH")
    os.environ["PATH"] = str(tmp_path)  # no llama-server to fall back on
    try:
        r = _prefill(None, tmp_path / "x.slot", state_version=4)
    finally:
        os.environ["PATH"] = env_path or ""
    assert not r.ok and not r.crashed  # type: ignore[attr-defined]
    assert "the file has state version 4" in r.message and "pass --llama-lib DIR" in r.message  # type: ignore[attr-defined]
    assert not (tmp_path / "x.slot").exists()


# ----------------------------------------------------------------------------- unusable libraries


def _bad_lib_folders(tmp: Path, v4: Path | None) -> dict[str, tuple[Path, str]]:
    empty = tmp / "empty"
    empty.mkdir()
    bogus = tmp / "bogus"
    bogus.mkdir()
    (bogus / "libllama.so").write_bytes(b"not an ELF file at all\n" * 10)
    cases = {
        "missing": (tmp / "nowhere", "no such folder"),
        "empty": (empty, "holds no libllama.so"),
        "bogus": (bogus, "cannot be loaded"),
    }
    if v4 is not None:  # libllama.so without its libggml*.so
        alone = tmp / "alone"
        alone.mkdir()
        shutil.copy(v4 / "libllama.so", alone / "libllama.so")
        cases["no-ggml"] = (alone, "libggml")
    return cases


@pytest.mark.parametrize("case", ["missing", "empty", "bogus"])
def test_an_unusable_library_folder_is_one_line_exit_8_nothing_written(case, tmp_path):
    folder, why = _bad_lib_folders(tmp_path, None)[case]
    r = slotfile_cli("verify", BASE, "--model", MODEL, "--llama-lib", folder, env=NO_LIB_ENV)
    assert r.exit_code == 8, r.stdout + r.stderr
    assert why in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert r.stdout == ""
    out = tmp_path / "out.slot"
    r = slotfile_cli("strip-draft", BASE, "-o", out, "--model", MODEL, "--llama-lib", folder, env=NO_LIB_ENV)
    assert r.exit_code == 8 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
    with pytest.raises(LoaderError, match=why):
        LoaderPool(str(MODEL), llama_lib=str(folder))


def test_a_libllama_without_its_ggml_libraries_is_one_line(llama_v4_lib, tmp_path):
    folder, _why = _bad_lib_folders(tmp_path, llama_v4_lib)["no-ggml"]
    with pytest.raises(LoaderError) as e:
        LoaderPool(str(MODEL), llama_lib=str(folder))
    msg = str(e.value)
    assert "\n" not in msg and str(folder) in msg and "libggml" in msg and "cannot open shared object" in msg
    r = run_worker({"op": "prefill", "model": str(MODEL), "llama_lib": str(folder), "settings": {}}, timeout=60)
    assert not r.ok and r.crashed and "libggml" in r.message and "\n" not in r.message


def test_a_library_that_crashes_on_load_is_one_line(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a library that aborts in its constructor")
    src = tmp_path / "boom.c"
    src.write_text("#include <stdlib.h>\n__attribute__((constructor)) static void boom(void) { abort(); }\n")
    folder = tmp_path / "crash"
    folder.mkdir()
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(folder / "libllama.so"), str(src)], check=True)
    r = slotfile_cli("verify", BASE, "--model", MODEL, "--llama-lib", folder, env=NO_LIB_ENV)
    assert r.exit_code == 8, r.stdout + r.stderr
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "crashed while loading" in err and "SIGABRT" in err, err
    assert str(folder) in err and "Traceback" not in err


def test_an_unknown_state_version_is_refused(tmp_path):
    """A library writing a version slotfile does not know: the check on the worker's hello."""
    from slotfile.llama.loader import WorkerProcess

    w = WorkerProcess(str(MODEL), None, 0, 1)
    try:
        hello = w.wait_hello(120)
        assert w.library_problem(dict(hello), "") is None
        why = w.library_problem(dict(hello, state_seq_version=9), "")
        assert why is not None and "state version 9, which slotfile does not know" in why
        why = w.library_problem(dict(hello, state_seq_version=None, version_error="no context"), "")
        assert why is not None and "cannot tell which state version" in why and "no context" in why
    finally:
        w.close()


def test_the_worker_never_loads_llama_cpp_in_the_main_process():
    code = (
        "import sys; import slotfile.llama.loader, slotfile.llama.requests, slotfile.verify, slotfile.cli.app; "
        "print('llama_cpp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
