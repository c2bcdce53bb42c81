"""Test-load slot files with the real llama.cpp loader, in a separate process.

``llama_cpp`` is never imported here: every llama.cpp call runs in a worker process
(``python -m slotfile.llama.worker``, started with ``subprocess`` and spoken to in JSON lines; the
repairs' prefill and re-save use the same program through :mod:`slotfile.llama.requests`), so an abort
or a segfault inside llama.cpp on a bad file costs one worker, never the caller.  The pool
notices the death, reports the file as ``crashed`` with the signal's name and the last lines
llama.cpp wrote, and starts a fresh worker for the next file.  Each worker loads its model(s)
once and keeps up to two contexts (keyed by settings) for all the files it is given.

    with LoaderPool("model.gguf") as pool:
        r = pool.load("slot0.bin")          # settings derived from the file
        if not r.ok: print(r.message, r.log)

A slot file only loads into a context that mirrors the one that saved it (slot-format.md
§10, facts.md): ``n_seq_max`` = the file's ``n_stream`` with a non-unified cache, a unified
cache when one stream served several slots, flash attention on exactly when ``v_trans == 0``,
and the same K/V cache types.  :func:`settings_for` reads those from the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.format.types import BY_NAME
from slotfile.llama.worker.settings import LoadSettings, pad_ctx

if TYPE_CHECKING:  # the reader (numpy, construct) is imported only where a file is opened, so
    # that a command can start its workers before its own heavy imports (see LoaderPool.start)
    from slotfile.format.reader import Body, MemoryBlock, SlotFile

WORKER_MODULE = "slotfile.llama.worker"  # the one llama.cpp worker program (slotfile/llama/worker/program.py)
PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # where the worker imports slotfile from
F16 = BY_NAME["f16"].id
START_TIMEOUT = 600.0  # seconds for a worker to load its model(s)

__all__ = [
    "DeepResult",
    "Library",
    "LoadResult",
    "LoadSettings",
    "LoaderError",
    "LoaderPool",
    "draft_settings_for",
    "library_dir",
    "resolve_library",
    "server_library",
    "settings_for",
    "test_load",
]


@dataclass
class LoadResult:
    ok: bool
    message: str
    body_bytes: int  # llama_state_seq_load_file's return (the offset where the body ends), 0 on failure
    checkpoints: list[tuple[bool, str]]  # per SCKP checkpoint: data_tgt set_data_ext(PARTIAL_ONLY)
    draft: tuple[bool, str] | None  # SDFT data_dft into a draft context (None: no draft or no draft model)
    crashed: bool = False  # the worker died (abort, segfault, timeout)
    log: str = ""  # llama.cpp's warnings and errors while this file was loaded
    checkpoint_drafts: list[tuple[bool, str]] = field(default_factory=list)  # per checkpoint: data_dft
    notes: list[str] = field(default_factory=list)  # appendix damage the server would skip over


@dataclass
class DeepResult:
    """What the worker measured for ``deep``: the restored vs recomputed next-token logits and
    the path of the recomputed state (a GGSQ file with no tokens) for the caller to compare."""

    ok: bool
    message: str
    crashed: bool = False
    log: str = ""
    logits: dict[str, Any] | None = None
    recomputed: str | None = None
    restored_pos_max: int | None = None
    floor: str | None = None  # the state with the last ``tail`` tokens decoded one per call
    n_batch: int = 0
    n_ubatch: int = 0
    tail: int = 0  # cells recomputed one by one for the noise floor (0: none)


class LoaderError(Exception):
    """The loader could not start (model missing or unloadable, a library folder that does not
    exist, holds no libllama or does not load): an operational error, one line."""


# ---------------------------------------------------------------------------------------
# which llama.cpp library the workers load
# ---------------------------------------------------------------------------------------

LIB_ENV = "SLOTFILE_LLAMA_LIB"  # the folder --llama-lib names, for every command
LIB_NAME = "libllama.so"


@dataclass(frozen=True)
class Library:
    """The llama.cpp library a worker loads: ``path`` a folder holding libllama.so (handed to
    llama-cpp-python as LLAMA_CPP_LIB_PATH in the worker's environment, never in this
    process), or None for llama-cpp-python's own; ``source`` says who chose it."""

    path: str | None
    source: str  # "--llama-lib", "SLOTFILE_LLAMA_LIB", "llama-server on PATH", "LLAMA_CPP_LIB_PATH", "installed"


def library_dir(path: str | os.PathLike[str], what: str = "--llama-lib") -> str:
    """``path`` checked as a llama.cpp library folder (or libllama.so itself): the absolute
    folder.  Raises LoaderError with a one-line reason."""
    p = Path(path).expanduser()
    if p.is_file() and p.name.startswith(LIB_NAME):
        p = p.parent
    if not p.exists():
        raise LoaderError(f"{what} {path}: no such folder")
    if not p.is_dir():
        raise LoaderError(f"{what} {path}: not a folder (give the folder that holds {LIB_NAME})")
    if not (p / LIB_NAME).is_file():
        raise LoaderError(
            f"{what} {path}: the folder holds no {LIB_NAME} (a llama.cpp build puts it and its "
            "libggml*.so in BUILD/bin)"
        )
    return str(p.resolve())


def resolve_library(llama_lib: str | os.PathLike[str] | None = None) -> Library:
    """``llama_lib`` (the --llama-lib option), else $SLOTFILE_LLAMA_LIB, else the library
    llama-cpp-python finds itself (its own, or $LLAMA_CPP_LIB_PATH).  Raises LoaderError."""
    if llama_lib is not None and str(llama_lib) != "":
        return Library(library_dir(llama_lib), "--llama-lib")
    env = os.environ.get(LIB_ENV)
    if env:
        return Library(library_dir(env, LIB_ENV), LIB_ENV)
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return Library(None, "LLAMA_CPP_LIB_PATH")
    return Library(None, "installed")


def server_library() -> tuple[str | None, str]:
    """The llama.cpp library of the ``llama-server`` on PATH (the llama.cpp the user runs):
    ``libllama.so`` in its folder or in ``../lib``, also behind a symlinked llama-server.
    Returns (folder or None, what was looked at, for messages)."""
    exe = shutil.which("llama-server")
    if exe is None:
        return None, "no llama-server on PATH"
    dirs: list[Path] = []
    for e in (Path(exe), Path(os.path.realpath(exe))):
        for d in (e.parent, e.parent.parent / "lib"):
            if d not in dirs:
                dirs.append(d)
    for d in dirs:
        if (d / LIB_NAME).is_file():
            return str(d.resolve()), f"the library beside {exe} ({d.resolve()})"
    return None, f"no {LIB_NAME} beside {exe} (looked in {', '.join(str(d) for d in dirs)})"


def library_label(info: dict[str, Any]) -> str:
    """How messages name a loader: ``llama-cpp-python 0.3.36 with /x/libllama.so``."""
    return f"llama-cpp-python {info.get('llama_cpp_python')} with {info.get('library') or '?'}"


# ---------------------------------------------------------------------------------------
# settings from the file
# ---------------------------------------------------------------------------------------


def _first_active_kv(blocks: list[MemoryBlock]) -> Any:
    for b in blocks:
        if b.kind == "KV":
            for st in b.active_streams():
                if st.k or st.v:
                    return b, st
    return None, None


LLAMA_MAX_SEQ = 256  # llama.cpp refuses contexts with more sequences
UNREADABLE_CAP = 1 << 18  # cells to make room for when the body cannot be read
SERVER_SLOTS = 4  # llama-server's default: --parallel auto = 4 slots with a unified KV cache


def _derive(
    blocks: list[MemoryBlock], *, whole: bool, need: int, seq_hint: int | None, n_gpu_layers: int
) -> LoadSettings:
    kv = [b for b in blocks if b.kind == "KV"]
    rec = [b for b in blocks if b.kind == "REC"]
    n_stream = max((b.n_stream for b in kv), default=1) or 1
    seq_ids: list[int] = []
    for b in kv:
        for st in b.active_streams():
            if st.cells is not None and st.cells.seq_ids.size:
                seq_ids += [int(x) for x in set(st.cells.seq_ids.tolist())]
            need = max(need, st.cell_count)  # cells, never positions: those need no room
    for b in rec:
        if b.cells is not None and b.cell_count and b.cells.seq_ids.size:
            seq_ids += [int(x) for x in set(b.cells.seq_ids.tolist())]
    seq_ids = [s for s in seq_ids if 0 <= s < LLAMA_MAX_SEQ]  # the loader ignores stored ids anyway
    _, st = _first_active_kv(blocks)
    if st is not None:
        flash = st.v_trans == 0
        type_k = st.k[0].type_id if st.k else F16
        type_v = st.v[0].type_id if st.v else type_k
    else:  # recurrent-only, empty or unreadable: nothing in the state depends on these
        flash, type_k, type_v = False, F16, F16
    # the recurrent memory has one cell per sequence (n_seq_max cells): room for the file's
    n_rec_cells = max((b.cell_count for b in rec), default=0)
    if whole:
        seq = 0
        n_seq = max(max(seq_ids, default=0) + 1, n_rec_cells, 1)
    else:
        ok_hint = seq_hint is not None and 0 <= seq_hint < LLAMA_MAX_SEQ
        seq = seq_hint if ok_hint else (min(seq_ids) if seq_ids else 0)  # type: ignore[assignment]
        n_seq = max(1, seq + 1, n_rec_cells)
    if n_stream > 1:
        # non-unified: one stream per slot; a single-sequence save fills only its own stream,
        # and n_seq_max must equal n_stream ("n_stream mismatch" otherwise)
        unified, n_seq = False, n_stream
        act = [s.index for b in kv for s in b.active_streams()]
        if act and not whole:
            seq = act[0]
    else:
        unified = True
        if not kv:  # no n_stream in the file to mirror: llama-server's default slot count
            n_seq = max(n_seq, SERVER_SLOTS)
    need += 1  # room for the probe token of the deep check
    n_ctx = pad_ctx(need) * (n_stream if n_stream > 1 else 1)
    return LoadSettings(
        n_ctx=n_ctx,
        n_seq_max=n_seq,
        kv_unified=unified,
        flash_attn=flash,
        type_k=type_k,
        type_v=type_v,
        n_gpu_layers=n_gpu_layers,
        seq_id=seq,
    )


def _blocks(body: Body | None) -> list[MemoryBlock]:
    return list(body.blocks) if body is not None and body.layout is not None else []


def _saved_seq(sf: SlotFile) -> int | None:
    _, st = _first_active_kv(_blocks(sf.body))
    if st is not None and st.cells is not None and st.cells.seq_ids.size:
        return int(st.cells.seq_ids[0])
    return None


def settings_for(sf: SlotFile, n_gpu_layers: int = 0) -> LoadSettings:
    """The context settings that mirror the one that saved ``sf``.

    * ``n_ctx``: room for every cell of the body and of every checkpoint blob (and one more,
      for the deep check's probe), padded to 256, times ``n_stream`` for a non-unified cache;
    * ``n_seq_max``: the file's ``n_stream`` when it is above 1 (non-unified cache, the saved
      sequence in its own stream); with one stream a unified cache and ``saved seq_id + 1``;
      at least the recurrent cell count (one cell per sequence);
    * ``flash_attn``: on exactly when ``v_trans == 0``; ``type_k``/``type_v``: the K/V type ids;
    * bodies with no KV block (recurrent-only, empty, unreadable) carry no ``n_stream``: the
      llama-server default (4 slots, unified cache), f16, flash attention off (nothing in such
      a state depends on the last three).
    """
    blocks = _blocks(sf.body)
    # Room is sized from what the file proves it holds (cells, each backed by its rows), never
    # from numbers a damaged file can inflate for free (positions, checkpoint n_tokens): a
    # context sized from those could ask for terabytes.  An unreadable body falls back to the
    # token count, capped.
    need = 0 if blocks else min(max(sf.n_tokens, 0), UNREADABLE_CAP)
    s = _derive(blocks, whole=sf.format == "GGSN", need=need, seq_hint=_saved_seq(sf), n_gpu_layers=n_gpu_layers)
    # a checkpoint blob may hold more cells than the body (an older, longer prompt)
    extra = 0
    for ck in sf.checkpoints:
        if ck.tgt.body is not None:
            for b in _blocks(ck.tgt.body):
                for st in b.active_streams() if b.kind == "KV" else []:
                    extra = max(extra, st.cell_count + 1)
    per = s.n_ctx // (s.n_seq_max if not s.kv_unified and s.n_seq_max > 1 else 1)
    if extra > per:
        extra = pad_ctx(extra)
        mult = s.n_seq_max if not s.kv_unified and s.n_seq_max > 1 else 1
        s = LoadSettings(
            extra * mult, s.n_seq_max, s.kv_unified, s.flash_attn, s.type_k, s.type_v, s.n_gpu_layers, s.seq_id
        )
    return s


def draft_settings_for(sf: SlotFile, n_gpu_layers: int = 0) -> LoadSettings | None:
    """Settings for the draft context, from the SDFT ``data_dft`` (or a checkpoint's
    ``data_dft``); None when the file holds no draft state."""
    blobs = []
    if sf.draft is not None and sf.draft.dft is not None and sf.draft.dft.length:
        blobs.append(sf.draft.dft)
    blobs += [ck.dft for ck in sf.checkpoints if ck.dft.length]
    if not blobs:
        return None
    for blob in blobs:
        if blob.body is not None and blob.body.layout is not None:
            return _derive(_blocks(blob.body), whole=False, need=0, seq_hint=blob.seq_id, n_gpu_layers=n_gpu_layers)
    t = settings_for(sf, n_gpu_layers)
    return LoadSettings(t.n_ctx, t.n_seq_max, t.kv_unified, t.flash_attn, F16, F16, n_gpu_layers, t.seq_id)


# ---------------------------------------------------------------------------------------
# the worker process
# ---------------------------------------------------------------------------------------


def _signal_name(rc: int) -> str:
    if rc < 0:
        try:
            return f"{signal.Signals(-rc).name} (signal {-rc})"
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def _clean_log(raw: bytes) -> str:
    lines = [ln for ln in raw.decode("utf-8", "replace").splitlines() if ln.strip() and not ln.startswith("@@slotfile")]
    return "\n".join(lines)


_SRC_PATH = re.compile(r"(?:/[^\s/:]+)+/((?:src|ggml|common|tools)/[^\s:]+)")


def _telling_line(log: str) -> str:
    """The lines of a log that best explain a failure: an assertion, else the error lines
    (most specific first, as llama.cpp logs them), build-machine paths shortened."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "GGML_ASSERT" in ln or "GGML_ABORT" in ln or "terminate called" in ln:
            return _SRC_PATH.sub(r"\1", ln)
    keys = ("error", "failed", "mismatch", "incompatible", "not enough", "invalid", "wrong", "unknown")
    picked: list[str] = []
    for ln in lines:
        if any(k in ln for k in keys) and ln not in picked:
            picked.append(ln)
    return "; ".join(picked[:4]) if picked else (lines[-1] if lines else "")


class _Worker:
    """One ``python -m slotfile.llama.worker`` process: requests in, JSON lines out, its log in a file.

    ``threads``: None lets the worker choose (SLOTFILE_THREADS, else by model size).
    ``env``: variables to set for it where the caller's environment does not."""

    def __init__(
        self,
        model: str,
        draft_model: str | None,
        n_gpu_layers: int,
        threads: int | None,
        env: dict[str, str] | None = None,
        library: Library | None = None,
    ) -> None:
        # the worker's stderr, open as long as the worker lives (closed in close())
        self.log = tempfile.TemporaryFile(prefix="slotfile-loader-", suffix=".log")
        cmd = [sys.executable, "-m", WORKER_MODULE, "--model", model, "--n-gpu-layers", str(n_gpu_layers)]
        if threads:
            cmd += ["--threads", str(threads)]
        if draft_model:
            cmd += ["--draft-model", draft_model]
        full = dict(os.environ)
        for k, v in {"GGML_NO_BACKTRACE": "1", **(env or {})}.items():  # no gdb attach on abort: slow, noisy
            full.setdefault(k, v)
        self.library = library or Library(None, "installed")
        if self.library.path is not None:  # llama-cpp-python opens LLAMA_CPP_LIB_PATH/libllama.so
            full["LLAMA_CPP_LIB_PATH"] = self.library.path
        # the worker imports this very slotfile, wherever the caller found it
        full["PYTHONPATH"] = os.pathsep.join(x for x in (str(PACKAGE_ROOT), full.get("PYTHONPATH")) if x)
        self.spawned = time.monotonic()  # the worker's hello["startup"] times are on this clock
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=full, close_fds=True
        )
        self.buf = b""
        self.hello: dict[str, Any] | None = None
        self.n = 0
        self.timed_out = False
        self.exit_status = ""  # how the process ended, once it has (a signal's name or an exit status)

    def _where(self) -> str:
        lib = self.library
        return f"the llama.cpp library in {lib.path} ({lib.source})" if lib.path else "llama-cpp-python's library"

    def library_problem(self, resp: dict[str, Any] | None, died: str) -> str | None:
        """A one-line reason when the worker's first answer (``resp``; None: it died) shows that
        its llama.cpp library is unusable: it crashed while loading, did not load, or writes a
        state version that cannot be told or that slotfile does not know.  A usable hello gets
        ``library_dir`` and ``library_source``."""
        if resp is None:
            if not self.timed_out and (self.proc.returncode or 0) < 0 and not self._library_loaded():  # dlopen, ctors
                return f"{self._where()} crashed while loading ({self.exit_status or died})"
            return None
        if resp.get("library_error"):
            return str(resp.get("message"))
        if not resp.get("ok"):
            return None
        version = resp.get("state_seq_version")
        lib = resp.get("library") or self._where()
        if version is None:
            return (
                f"cannot tell which state version the llama.cpp library {lib} writes: "
                f"{resp.get('version_error') or 'no answer'}"
            )
        from slotfile.format.reader import GGSQ_VERSIONS  # the versions slotfile reads

        if int(version) not in GGSQ_VERSIONS:
            return (
                f"the llama.cpp library {lib} writes state version {version}, which slotfile does not know "
                f"(it knows versions {', '.join(map(str, sorted(GGSQ_VERSIONS)))})"
            )
        resp["library_dir"] = self.library.path or os.path.dirname(str(resp.get("library") or "")) or None
        resp["library_source"] = self.library.source
        return None

    def wait_hello(self, timeout: float) -> dict[str, Any]:
        resp, died = self.read(timeout)
        why = self.library_problem(resp, died)
        if why is not None:
            self.kill()
            raise LoaderError(why)
        if resp is None or not resp.get("ok"):
            log = self.log_since(0)
            why = resp.get("message") if resp else died
            self.kill()
            raise LoaderError(f"the loader did not start: {why}" + (f"\n{_tail(log)}" if log else ""))
        # the worker's start-up phases, as seconds since the spawn (both on CLOCK_MONOTONIC)
        phases = resp.get("startup")
        phases = phases if isinstance(phases, dict) else {}
        resp["startup"] = {k: round(float(v) - self.spawned, 4) for k, v in phases.items()}
        resp["startup"]["hello"] = round(time.monotonic() - self.spawned, 4)
        self.hello = resp
        return resp

    def _library_loaded(self) -> bool:
        """Whether the worker got past ``import llama_cpp`` (its marker line is in the log)."""
        size = self.log_size()
        return b"@@slotfile library loaded" in os.pread(self.log.fileno(), size, 0) if size else False

    def log_size(self) -> int:
        return os.fstat(self.log.fileno()).st_size

    def log_since(self, off: int) -> str:
        size = self.log_size()
        return _clean_log(os.pread(self.log.fileno(), max(0, size - off), off)) if size > off else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def read(self, timeout: float) -> tuple[dict[str, Any] | None, str]:
        """One response line, or (None, why the worker is gone)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                self.timed_out = True
                return None, f"timed out after {timeout:g} s (the loader process was killed)"
            r, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not r:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.exit_status = _signal_name(self.proc.wait())
                return None, f"the loader process died with {self.exit_status}"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line), ""

    def request(self, req: dict[str, Any], timeout: float) -> tuple[dict[str, Any] | None, str, str]:
        """(response or None, why it died, the log written meanwhile)."""
        self.n += 1
        req = dict(req, id=self.n)
        off = self.log_size()
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.exit_status = _signal_name(self.proc.wait())
            return None, f"the loader process died with {self.exit_status}", self.log_since(off)
        resp, died = self.read(timeout)
        return resp, died, self.log_since(off)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        # The worker holds nothing that needs an orderly end (every reply is complete when it
        # is sent), and letting llama.cpp free its model and contexts costs tens of ms on
        # every run: the kernel reclaims them faster.
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self.log.close()


def _tail(log: str, n: int = 12) -> str:
    return "\n".join(log.splitlines()[-n:])


class LoaderPool:
    """Long-lived loader worker(s).  Each worker loads the model (and draft model) once and
    test-loads many files; ``jobs`` workers serve concurrent callers (thread-safe).

    The constructor waits until every worker has loaded its model (a missing or unloadable
    model raises :class:`LoaderError` there).  ``LoaderPool.start(...)`` only spawns them, so
    the workers load the model while the caller imports, parses and checks; :meth:`ready`
    (or the first load) then waits for them."""

    @classmethod
    def start(
        cls,
        model: str,
        draft_model: str | None = None,
        n_gpu_layers: int = 0,
        jobs: int = 1,
        threads: int | None = None,
        *,
        llama_lib: str | os.PathLike[str] | Library | None = None,
    ) -> LoaderPool:
        return cls(model, draft_model, n_gpu_layers, jobs, threads, wait=False, llama_lib=llama_lib)

    def __init__(
        self,
        model: str,
        draft_model: str | None = None,
        n_gpu_layers: int = 0,
        jobs: int = 1,
        threads: int | None = None,
        *,
        wait: bool = True,
        llama_lib: str | os.PathLike[str] | Library | None = None,
    ) -> None:
        """``llama_lib``: a folder holding libllama.so (or a resolved :class:`Library`); None:
        $SLOTFILE_LLAMA_LIB, else llama-cpp-python's own library (:func:`resolve_library`)."""
        for p in (model, draft_model):
            if p is not None and not Path(p).is_file():
                raise LoaderError(f"model not found: {p}")
        self.library = llama_lib if isinstance(llama_lib, Library) else resolve_library(llama_lib)
        self.model, self.draft_model = str(model), str(draft_model) if draft_model else None
        self.n_gpu_layers = n_gpu_layers
        self.jobs = max(1, jobs)
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.jobs)
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._info: dict[str, Any] = {}
        self.restarts = 0
        self._starting = [self._spawn() for _ in range(self.jobs)]
        if wait:
            self.ready()

    def ready(self) -> dict[str, Any]:
        """Wait until every worker started has loaded its model; returns the loader's facts.
        Raises LoaderError (and closes the pool) when one cannot."""
        with self._lock:
            starting, self._starting = self._starting, []
        try:
            for w in starting:
                self._info = w.wait_hello(START_TIMEOUT)
                self._idle.put(w)
        except LoaderError:
            self.close()
            raise
        return self._info

    @property
    def info(self) -> dict[str, Any]:
        """What the loader said when it started (versions, n_vocab, ...)."""
        return self.ready() if not self._info else self._info

    # ------------------------------------------------------------------ plumbing

    def _spawn(self) -> _Worker:
        w = _Worker(self.model, self.draft_model, self.n_gpu_layers, self.threads, library=self.library)
        with self._lock:
            self._all.append(w)
        return w

    def _acquire(self) -> _Worker:
        if self._closed:
            raise LoaderError("the loader pool is closed")
        if self._starting:
            self.ready()
        w = self._idle.get()
        if w is None or not w.alive():
            if w is not None:
                self._retire(w)
            self.restarts += 1
            try:
                w = self._spawn()
                w.wait_hello(START_TIMEOUT)
            except LoaderError:
                self._idle.put(None)
                raise
        return w

    def _retire(self, w: _Worker) -> None:
        with self._lock:
            if w in self._all:
                self._all.remove(w)
        w.close()

    def _call(self, req: dict[str, Any], timeout: float) -> tuple[dict[str, Any] | None, str, str]:
        w = self._acquire()
        try:
            resp, died, log = w.request(req, timeout)
        except BaseException:
            w.kill()
            self._retire(w)
            self._idle.put(None)
            raise
        if resp is None:
            self._retire(w)
            self._idle.put(None)  # a fresh worker starts on the next call
        else:
            self._idle.put(w)
        return resp, died, log

    @property
    def state_seq_version(self) -> int | None:
        """The state version the loaded library writes (detected by the worker)."""
        return self.info.get("state_seq_version")

    @property
    def session_version(self) -> int | None:
        return self.info.get("session_version")

    def loads_version_of(self, fmt: str | None, version: int | None) -> bool:
        """Whether this library's version is the file's (llama.cpp loads its own version only);
        True when either is unknown (the test-load then says what is wrong)."""
        have = self.session_version if fmt == "GGSN" else self.state_seq_version
        return version is None or have is None or fmt not in ("GGSQ", "GGSN") or int(version) == int(have)

    def describe(self) -> dict[str, Any]:
        """The loader as ``verify --json`` shows it."""
        info = self.info
        return {
            "llama_cpp_python": info.get("llama_cpp_python"),
            "state_seq_version": info.get("state_seq_version"),
            "session_version": info.get("session_version"),
            "library": info.get("library"),
            "library_source": info.get("library_source"),
        }

    # ------------------------------------------------------------------ API

    def load(
        self, path: str, settings: LoadSettings | None = None, timeout: float = 300, sf: SlotFile | None = None
    ) -> LoadResult:
        """Test-load one file the way the server restores a slot (see slotfile/llama/worker/program.py).
        ``sf``: the file as the caller already parsed it (otherwise it is parsed here)."""
        if sf is None:
            from slotfile.format.reader import open_slot_file

            try:
                sf = open_slot_file(path)
            except OSError as e:
                return LoadResult(False, f"cannot read {path}: {e.strerror or e}", 0, [], None)
        s = settings or settings_for(sf, self.n_gpu_layers)
        ds = draft_settings_for(sf, self.n_gpu_layers) if self.draft_model else None
        req = {
            "op": "load",
            "path": str(Path(path).resolve()),
            "settings": s.to_dict(),
            "format": "GGSN" if sf.format == "GGSN" else "GGSQ",
            "draft_settings": ds.to_dict() if ds else None,
        }
        resp, died, log = self._call(req, timeout)
        if resp is None:
            line = _telling_line(log)
            return LoadResult(False, died + (f": {line}" if line else ""), 0, [], None, crashed=True, log=log)
        msg = resp.get("message", "")
        if not resp.get("ok"):
            line = _telling_line(log)
            if line and line not in msg:
                msg = f"{msg}: {line}"
        return LoadResult(
            ok=bool(resp.get("ok")),
            message=msg,
            body_bytes=int(resp.get("body_bytes") or 0),
            checkpoints=[(bool(a), str(b)) for a, b in resp.get("checkpoints", [])],
            draft=(bool(resp["draft"][0]), str(resp["draft"][1])) if resp.get("draft") else None,
            log=log,
            checkpoint_drafts=[(bool(a), str(b)) for a, b in resp.get("checkpoint_drafts", [])],
            notes=list(resp.get("notes", [])),
        )

    def deep(
        self,
        path: str,
        tokens: list[int],
        probe: int,
        out: str,
        settings: LoadSettings | None = None,
        timeout: float = 300,
        batch: int = 0,
        *,
        n_ubatch: int = 0,
        tail: int = 0,
        out_floor: str | None = None,
    ) -> DeepResult:
        """Restore ``path`` and recompute ``tokens`` from scratch with the same settings; the
        recomputed state is written to ``out`` (a GGSQ file with no tokens).  ``batch``: the
        prefill's n_batch (tokens per llama_decode call), ``n_ubatch`` its micro-batch (0: the
        server's defaults, 2048 and 512).  With ``tail`` and ``out_floor``: the last ``tail``
        tokens decoded again one per call, that state written to ``out_floor`` (the noise floor)."""
        if settings is None:
            from slotfile.format.reader import open_slot_file

            settings = settings_for(open_slot_file(path), self.n_gpu_layers)
        req = {
            "op": "deep",
            "path": str(Path(path).resolve()),
            "settings": settings.to_dict(),
            "tokens": [int(t) for t in tokens],
            "probe": int(probe),
            "out": str(out),
            "n_batch": int(batch),
            "n_ubatch": int(n_ubatch),
            "tail": int(tail),
            "out_floor": str(out_floor) if out_floor else None,
        }
        resp, died, log = self._call(req, timeout)
        if resp is None:
            line = _telling_line(log)
            return DeepResult(False, died + (f": {line}" if line else ""), crashed=True, log=log)
        msg = resp.get("message", "")
        if not resp.get("ok"):
            line = _telling_line(log)
            if line and line not in msg:
                msg = f"{msg}: {line}"
        return DeepResult(
            bool(resp.get("ok")),
            msg,
            log=log,
            logits=resp.get("logits"),
            recomputed=str(out) if resp.get("ok") else None,
            restored_pos_max=resp.get("restored_pos_max"),
            floor=str(out_floor) if resp.get("ok") and resp.get("tail") else None,
            n_batch=int(resp.get("n_batch") or 0),
            n_ubatch=int(resp.get("n_ubatch") or 0),
            tail=int(resp.get("tail") or 0),
        )

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), []
        for w in workers:
            w.close()

    def __enter__(self) -> LoaderPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()


def test_load(
    path: str,
    model: str,
    draft_model: str | None = None,
    settings: LoadSettings | None = None,
    timeout: float = 300,
    llama_lib: str | os.PathLike[str] | Library | None = None,
) -> LoadResult:
    """One file, one short-lived worker.  Raises LoaderError when the model cannot be loaded."""
    with LoaderPool(
        model, draft_model, n_gpu_layers=settings.n_gpu_layers if settings else 0, jobs=1, llama_lib=llama_lib
    ) as pool:
        return pool.load(path, settings, timeout)


test_load.__test__ = False  # type: ignore[attr-defined]  # not a pytest test
