"""What a person reads from ``ls`` and ``prune`` (and ``verify DIR``, which shares the listing):
one row per file at 80 columns with no word split, one plain line per file in a pipe, JSON of
the documented schema; and bad input (unreadable files and folders, files vanishing mid-run,
names with control characters or bytes that are not UTF-8): each file named once, escaped, the
run goes on, and the exit code says so (README, "Exit codes")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import SLOTS, slotfile_cli

ROOT = Path(__file__).resolve().parents[2]
HOUR = 3600.0
LONG = "sub/a-rather-long-name-of-a-saved-slot-0001.slot"
LS_HEADS = ["memory", "ver", "size", "tokens", "streams", "K/V", "fa", "ckpt", "draft", "age", "file"]
PRUNE_HEADS = ["action", "size", "age", "rule", "file"]


def _age(p: Path | bytes, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(p, (t, t))


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    """Every fixture slot file, one in a subfolder under a long name, and one cut short."""
    d = tmp_path / "slots"
    (d / "sub").mkdir(parents=True)
    for i, src in enumerate(sorted(SLOTS.glob("*.slot"))):
        shutil.copyfile(src, d / src.name)
        _age(d / src.name, 2 * HOUR + i)
    shutil.copyfile(SLOTS / "llama_q8_0_fa.slot", d / LONG)
    (d / "cut.slot").write_bytes((SLOTS / "llama_f16_fa.slot").read_bytes()[:9000])
    _age(d / LONG, HOUR)
    _age(d / "cut.slot", 9 * HOUR)
    return d


def _names(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*.slot"))


def _cli(*args: object, columns: int | None):
    return slotfile_cli(*args, env={"COLUMNS": str(columns) if columns else None})


def _check_screen(text: str, heads: list[str], names: list[str], width: int) -> None:
    """No line reaches the edge, the header's words are whole, no table borders, and every file
    is named once, whole: at the end of its row or alone on the line under it."""
    lines = text.splitlines()
    assert not [ln for ln in lines if len(ln) >= width], text
    assert not any(ch in text for ch in "┃│┏━")
    head = lines[0].split() + (lines[1].split() if lines[1].startswith("    ") else [])
    assert head == heads, lines[:2]
    for n in names:
        hits = [ln for ln in lines if ln.endswith(f"  {n}") or ln == f"    {n}"]
        assert len(hits) == 1, (n, text)


@pytest.mark.parametrize("columns", [80, 200])
def test_ls_one_row_per_file_at_the_terminal_width(store: Path, columns: int):
    r = _cli("ls", store, "--settle", "0", columns=columns)
    assert r.exit_code == 4, r.stderr  # cut.slot is damaged
    names = _names(store)
    _check_screen(r.stdout, LS_HEADS, names, columns)
    lines = r.stdout.splitlines()
    rows = [ln for ln in lines if ln[:1] != " "]
    assert len(rows) == 1 + len(names) + 1, r.stdout  # the header, a row per file, the summary
    cut = next(i for i, ln in enumerate(lines) if ln.endswith("cut.slot"))
    assert lines[cut + 1].startswith("    damaged: body at offset 7856: truncated")
    if columns == 200:  # every row whole on its line
        assert len(lines) == 1 + len(names) + 2  # and the damage under cut.slot's row
        assert any(ln.startswith("kv-cache ") and "q8_0/q8_0" in ln and ln.endswith(f"  {LONG}") for ln in lines)
    assert f"{len(names)} slot files, " in r.stdout and ", 1 damaged;" in r.stdout
    assert "file(s)" not in r.stdout


def test_ls_one_plain_line_per_file_in_a_pipe(store: Path):
    r = _cli("ls", store, "--settle", "0", columns=None)
    lines = r.stdout.splitlines()
    names = _names(store)
    assert len(lines) == len(names) + 1 and lines[-1].startswith(f"{len(names)} slot files, ")
    by_name = {ln.split(": ", 1)[0]: ln for ln in lines[:-1]}
    assert sorted(by_name) == names
    assert by_name["llama_q8_0_fa.slot"] == (
        "llama_q8_0_fa.slot: memory kv-cache, ver 3, size 12.9 KiB, tokens 54, streams 1, K/V q8_0/q8_0, fa on, "
        "ckpt 1, draft -, age 2.0h"
    )
    assert by_name["cut.slot"].endswith(
        "age 9.0h; damaged: body at offset 7856: truncated inside the body "
        "(KV, stream[0].V[0]): rows needs 3456 bytes, 1144 remain"
    )


LS_KEYS = {"schema", "root", "server", "files", "totals", "temp", "busy", "symlinks_skipped", "errors",
           "still_being_written", "tally", "files_per_second", "exit_code"}  # fmt: skip
LS_FILE_KEYS = {"path", "rel", "size", "age_s", "format", "version", "n_tokens", "memory_class", "n_stream",
                "active_streams", "kv_cells", "type_k", "type_v", "flash_attn", "checkpoints", "draft", "damaged",
                "first_problem", "error"}  # fmt: skip
PRUNE_KEYS = {"schema", "root", "delete", "rules", "remove", "total_before", "total_after", "untouchable_bytes",
              "quota_met", "note", "errors", "still_being_written", "tally", "exit_code"}  # fmt: skip


def test_ls_and_prune_json_have_the_documented_schema(store: Path):
    doc = json.loads(_cli("ls", store, "--settle", "0", "--json", columns=80).stdout)
    assert set(doc) == LS_KEYS and doc["schema"] == "slotfile.ls/1" and doc["exit_code"] == 4
    assert all(set(f) == LS_FILE_KEYS for f in doc["files"]) and len(doc["files"]) == len(_names(store))
    assert set(doc["totals"]) == {"files", "bytes", "tokens", "damaged", "unreadable"}
    doc = json.loads(_cli("prune", store, "--settle", "0", "--json", "--damaged", "--keep", "3", columns=80).stdout)
    assert set(doc) == PRUNE_KEYS and doc["schema"] == "slotfile.prune/1" and doc["exit_code"] == 0
    assert set(doc["rules"]) == {"max_total", "older_than_s", "keep", "damaged", "settle_s"}
    assert {x["rule"] for x in doc["remove"]} == {"damaged", "keep"} and doc["remove"][0]["rel"] == "cut.slot"
    assert all(set(x) == {"path", "rel", "size", "age_s", "rule", "why", "removed", "error"} for x in doc["remove"])


@pytest.mark.parametrize("columns", [80, None])
def test_prune_one_row_per_file_and_english(store: Path, columns: int | None):
    r = _cli("prune", store, "--settle", "0", "--damaged", "--keep", "3", columns=columns)
    assert r.exit_code == 0, r.stderr
    gone = len(_names(store)) - 3
    lines = r.stdout.splitlines()
    if columns:
        planned = [ln for ln in lines if ln.startswith("would remove  ")]
        assert len(planned) == gone and planned[0].split()[-2:] == ["damaged", "cut.slot"]
        _check_screen(r.stdout, PRUNE_HEADS, [ln.split()[-1] for ln in planned], columns)
        assert lines[lines.index(planned[0]) + 1].startswith("    damaged: body at offset 7856")
    else:
        assert len(lines) == gone + 1
        assert lines[0].startswith("cut.slot: would remove, size 8.8 KiB, age 9.0h: damaged: body at offset 7856")
        assert lines[1].endswith(": beyond the 3 newest files")
    text = " ".join(r.stdout.split())
    assert f"would remove {gone} files, " in text and "file(s)" not in text
    assert "a plan only: add --delete to remove them" in text
    one = _cli("prune", store, "--settle", "0", "--damaged", columns=columns)
    assert "would remove 1 file, 8.8 KiB;" in one.stdout.replace("\n  ", " ")
    done = _cli("prune", store, "--settle", "0", "--damaged", "--delete", columns=columns)
    assert done.exit_code == 0 and "removed 1 file, 8.8 KiB freed;" in done.stdout.replace("\n  ", " ")
    assert not (store / "cut.slot").exists()
    none = _cli("prune", store, "--settle", "0", "--damaged", columns=columns)
    assert none.stdout.startswith("nothing to remove; ")


# ---------------------------------------------------------------------------------------
# bad input: each file named once and escaped, the run goes on, the exit code says so
# ---------------------------------------------------------------------------------------

EVIL = "evil\x1b[31mred\nline.slot"
NOT_UTF8 = os.fsdecode(b"bad\xff\xfeutf.slot")
SHOWN = {EVIL: "evil\\x1b[31mred\\nline.slot", NOT_UTF8: "bad\\xff\\xfeutf.slot", "ok.slot": "ok.slot"}
COMMANDS = [("ls",), ("verify",), ("prune", "--keep", "0")]


def _proc(args: list[str], columns: int | None = None, prefix: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("COLUMNS", None)
    if columns:
        env["COLUMNS"] = str(columns)
    # strict UTF-8: a name written out raw (not escaped) fails the decoding
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "slotfile", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        encoding="utf-8",
        errors="strict",
    )


def _done(p: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


@pytest.fixture()
def odd_names(tmp_path: Path) -> Path:
    d = tmp_path / "odd"
    d.mkdir()
    for name in SHOWN:
        p = os.path.join(os.fsencode(d), os.fsencode(name))
        shutil.copyfile(SLOTS / "llama_f16_fa.slot", p)
        _age(p, HOUR)
    return d


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("columns", [None, 80])
def test_odd_names_are_escaped_on_one_line(odd_names: Path, cmd: tuple[str, ...], columns: int | None):
    rc, out, err = _done(_proc([cmd[0], str(odd_names), *cmd[1:], "--settle", "0"], columns))
    assert rc == 0 and err == "", err
    assert "\x1b" not in out and not any(0xDC80 <= ord(c) <= 0xDCFF for c in out)
    lines = out.splitlines()
    for shown in SHOWN.values():
        hits = [ln for ln in lines if shown in ln]
        assert len(hits) == 1, (shown, out)
        if columns:
            assert hits[0].endswith(f"  {shown}") or hits[0] == f"    {shown}"
        else:
            assert hits[0].startswith(f"{shown}: ")
    if not columns:
        assert len(lines) == len(SHOWN) + 1  # one line per file, then the summary
    assert all(len(ln) < 80 for ln in lines) if columns else True


def test_odd_names_in_json_give_the_bytes_back(odd_names: Path):
    doc = json.loads(slotfile_cli("ls", odd_names, "--settle", "0", "--json").stdout)
    assert {os.fsencode(f["rel"]) for f in doc["files"]} == {os.fsencode(n) for n in SHOWN}
    assert all(os.path.exists(os.fsencode(f["path"])) for f in doc["files"])


def _unprivileged() -> tuple[str, ...]:
    """What makes chmod 000 bite: nothing for a user; for root, dropping the capabilities that
    bypass file permissions (setpriv, util-linux)."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: chmod 000 does not stop root")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search")


@pytest.mark.parametrize("cmd", [("ls",), ("verify",), ("prune", "--damaged"), ("prune", "--keep", "5")], ids=" ".join)
def test_unreadable_files_and_folders_are_named_and_the_run_goes_on(tmp_path: Path, cmd: tuple[str, ...]):
    d = tmp_path / "perm"
    (d / "locked").mkdir(parents=True)
    for p in (d / "ok.slot", d / f"{EVIL}", d / "locked.slot", d / "locked" / "in.slot"):
        shutil.copyfile(SLOTS / "llama_f16_fa.slot", p)
        _age(p, HOUR)
    (d / EVIL).chmod(0)
    (d / "locked.slot").chmod(0)
    (d / "locked").chmod(0)
    try:
        rc, out, err = _done(_proc([cmd[0], str(d), *cmd[1:], "--settle", "0"], None, _unprivileged()))
    finally:
        (d / "locked").chmod(0o755)
    assert rc == 8, (out, err)  # README: 8, a path cannot be read
    errs = err.splitlines()
    assert f"{d / 'locked'}: Permission denied" in " ".join(errs)
    if cmd != ("prune", "--keep", "5"):  # the commands that read the files name each one
        for name in ("locked.slot", SHOWN[EVIL]):
            assert sum(ln.endswith(f"{d}/{name}: Permission denied") for ln in errs) == 1, err
    assert "\x1b" not in out + err
    # the run went on: the readable file handled; the unreadable ones and the folder failed
    assert ("3 handled, 0 skipped, 1 failed" if "--keep" in cmd else "1 handled, 0 skipped, 3 failed") in out
    assert "ok.slot" in out or cmd[0] == "prune"  # prune lists only what it removes


@pytest.mark.parametrize(
    "cmd, says",
    [
        (("ls",), "No such file or directory"),
        (("verify",), "No such file or directory"),
        (("prune", "--damaged"), "No such file or directory"),
        (("prune", "--keep", "0", "--delete"), "not removed: No such file or directory"),
    ],
    ids=lambda c: " ".join(c) if isinstance(c, tuple) else "",
)
def test_files_vanishing_mid_run_are_named_and_the_run_goes_on(tmp_path: Path, cmd: tuple[str, ...], says: str):
    """While the command waits for a file being written, that file and an already listed one
    are removed (a server rotating its saves): both named on stderr, the rest listed, exit 8."""
    d = tmp_path / "vanish"
    d.mkdir()
    for n in ("a.slot", "b.slot"):
        shutil.copyfile(SLOTS / "llama_f16_fa.slot", d / n)
        _age(d / n, HOUR)
    shutil.copyfile(SLOTS / "llama_f16_fa.slot", d / "fresh.slot")  # modified just now: waited for
    p = _proc([cmd[0], str(d), *cmd[1:], "--settle", "2", "--settle-wait", "60"])
    assert p.stderr is not None
    first = p.stderr.readline()
    assert "waiting up to 60 s for fresh.slot" in first, first
    (d / "b.slot").unlink()
    (d / "fresh.slot").unlink()
    rc, out, err = _done(p)
    assert rc == 8, (out, err)
    errs = err.splitlines()
    assert sum(ln.endswith(f"{d / 'fresh.slot'}: vanished while it was being written") for ln in errs) == 1, err
    named = [ln for ln in errs if "b.slot" in ln]
    assert len(named) == 1 and says in named[0], err
    assert "1 handled, 0 skipped, 2 failed" in out
    assert "a.slot" in out or cmd == ("prune", "--damaged")  # prune lists what it removes


@pytest.mark.llama
@pytest.mark.parametrize("columns", [80, None])
def test_verify_server_args_one_row_per_file(tmp_path: Path, columns: int | None):
    """``verify DIR --server-args``: the verdict, size, tokens and name on a row, the reason
    wrapped under it (a terminal); one line per file with the reason (a pipe)."""
    d = tmp_path / "r"
    d.mkdir()
    names = ["gemma3_iswa_fa.slot", "llama_2stream.slot", "llama_f16_fa.slot"]
    for n in names:
        shutil.copyfile(SLOTS / n, d / n)
        _age(d / n, HOUR)
    args = f"llama-server -m {SLOTS.parent / 'models' / 'llama.gguf'} -np 2 -c 1024"
    r = _cli("verify", d, "--server-args", args, "--settle", "0", columns=columns)
    assert r.exit_code == 4, r.stderr
    lines = r.stdout.splitlines()
    if columns:
        assert not any(ch in r.stdout for ch in "┃│┏━")
        assert [ln for ln in lines if len(ln) >= columns and " " in ln.strip()] == []
        rows = [ln for ln in lines if ln.endswith(tuple(f"  {n}" for n in names))]
        assert [ln.split("  ")[0] for ln in rows] == ["cannot", "restores as is", "needs re-save, exact"]
        assert "n_stream mismatch" in " ".join(ln.strip() for ln in lines)
    else:
        assert len(lines) == len(names) + 1
        assert lines[2].startswith("llama_f16_fa.slot: needs re-save, exact: streams 1 -> 2") and "n_stream" in lines[2]
        assert "; server: 2 slots, 2 streams, -c 1024" in lines[3]


@pytest.mark.llama
@pytest.mark.parametrize("require", [(), ("--require", "deep")])
def test_not_checked_here_fits_two_lines_and_says_what_to_pass(tmp_path: Path, require: tuple[str, ...]):
    """A version-4 file with the installed version-3 loader: what could not be checked, and the
    option that would check it, in two lines at 80 columns, without nested parentheses (the
    full reason, with the loader's path, stays in the JSON)."""
    d = tmp_path / "v"
    d.mkdir()
    shutil.copyfile(SLOTS / "v4" / "llama_f16_fa.slot", d / "v4.slot")
    _age(d / "v4.slot", HOUR)
    model = SLOTS.parent / "models" / "llama.gguf"
    r = _cli("verify", d, "--model", model, "--deep", "--settle", "0", *require, columns=80)
    assert r.exit_code == (4 if require else 0), r.stdout
    lines = r.stdout.splitlines()
    row = next(i for i, ln in enumerate(lines) if ln.endswith("  v4.slot"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("1 file: "))
    block = lines[row + 1 : end]
    assert all(len(ln) < 80 for ln in block), block
    text = " ".join(ln.strip() for ln in block)
    assert "libllama" not in text and text.count("(") <= 1 and "((" not in text
    if require:  # a required level: said as a failure, then what to pass; deep goes with load
        assert len(block) == 6 and text.startswith("required load not checked here: needs another llama.cpp")
        assert "to check deep: pass --llama-lib DIR with a llama.cpp build that loads state version 4" in text
    else:
        assert len(block) == 2 and text == (
            "not checked here: load, deep: needs another llama.cpp; "
            "pass --llama-lib DIR with a llama.cpp build that loads state version 4"
        )
    doc = json.loads(_cli("verify", d, "--model", model, "--deep", "--settle", "0", "--json", columns=80).stdout)
    assert "llama-cpp-python" in doc["files"][0]["levels"]["load"]["reason"]


@pytest.mark.parametrize("columns", [80, None])
def test_migrate_dir_one_row_per_file(tmp_path: Path, columns: int | None):
    """``migrate DIR`` and ``re-save DIR`` share dir_batch's report: the action and the name on
    a row, what was found under it (a terminal); one line per file, name first (a pipe)."""
    d = tmp_path / "m"
    d.mkdir()
    shutil.copyfile(SLOTS / "llama_f16_fa.slot", d / "a.slot")
    shutil.copyfile(SLOTS / "v4" / "llama_f16_fa.slot", d / "b-with-a-longer-name-than-most.slot")
    for p in d.iterdir():
        _age(p, HOUR)
    r = _cli("migrate", d, "-o", tmp_path / "out", "--to", "4", "--dry-run", columns=columns)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    if columns:
        assert lines[0].split() == ["action", "file"] and lines[1] == "would-convert  a.slot"
        assert all(len(ln) < columns for ln in lines), lines
        assert lines[-2].startswith("2 files: 1 would-convert, 1 would-copy;")
    else:
        assert len(lines) == 3 and lines[0].startswith("a.slot: would-convert: GGSQ 3 -> 4: ")
        assert lines[1].startswith("b-with-a-longer-name-than-most.slot: would-copy: GGSQ 4 -> 4")
