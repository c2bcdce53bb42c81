"""The loader workers: one ``python -m slotfile.llama.worker`` process per job, spoken to in
JSON lines, and the pool that hands files to them and replaces a worker that died.  See
:mod:`slotfile.llama.loader` for the whole picture."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.format import versions
from slotfile.format.magics import FileFormat
from slotfile.llama.library import Library, LoaderError, resolve_library
from slotfile.llama.settings import draft_settings_for, settings_for
from slotfile.llama.worker.settings import LoadSettings

if TYPE_CHECKING:
    from slotfile.format.reader import SlotFile

WORKER_MODULE = "slotfile.llama.worker"  # the one llama.cpp worker program (slotfile/llama/worker/program.py)
# The folder that holds the ``slotfile`` package (this file is slotfile/llama/pool.py), put on
# the worker's PYTHONPATH so that it imports this very slotfile.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 600.0  # seconds for a worker to load its model(s)


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
    floor: str | None = None  # the state with the last ``n_stepwise`` tokens decoded one per call
    n_batch: int = 0
    n_ubatch: int = 0
    n_stepwise: int = 0  # the last tokens decoded again one per call for the noise floor (0: none)
    cuts: list[int] = field(default_factory=list)  # positions where the prefill started a new call
    stepwise: list[tuple[int, int]] = field(default_factory=list)  # ranges [a, b) decoded one token per call


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


def telling_line(log: str) -> str:
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


class WorkerProcess:
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
        known = versions.known(FileFormat.GGSQ)  # the state versions slotfile reads
        if int(version) not in known:
            return (
                f"the llama.cpp library {lib} writes state version {version}, which slotfile does not know "
                f"(it knows versions {', '.join(map(str, known))})"
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
            raise LoaderError(f"the loader did not start: {why}" + (f"\n{_log_tail(log)}" if log else ""))
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

    def request(
        self, req: dict[str, Any], timeout: float, on_interim: Callable[[], None] | None = None
    ) -> tuple[dict[str, Any] | None, str, str]:
        """(response or None, why it died, the log written meanwhile).  A line the worker sends
        before its response (``{"interim": ...}``) goes to ``on_interim``, which runs while the
        worker goes on; the timeout covers both."""
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
        deadline = time.monotonic() + timeout
        resp, died = self.read(timeout)
        while resp is not None and "interim" in resp:
            if on_interim is not None:
                on_interim()
            resp, died = self.read(max(deadline - time.monotonic(), 0.001))
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


def _log_tail(log: str, n: int = 12) -> str:
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
        self._idle: queue.Queue[WorkerProcess | None] = queue.Queue()
        self._all: list[WorkerProcess] = []
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

    def _spawn(self) -> WorkerProcess:
        w = WorkerProcess(self.model, self.draft_model, self.n_gpu_layers, self.threads, library=self.library)
        with self._lock:
            self._all.append(w)
        return w

    def _acquire(self) -> WorkerProcess:
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

    def _retire(self, w: WorkerProcess) -> None:
        with self._lock:
            if w in self._all:
                self._all.remove(w)
        w.close()

    def _call(
        self, req: dict[str, Any], timeout: float, on_interim: Callable[[], None] | None = None
    ) -> tuple[dict[str, Any] | None, str, str]:
        w = self._acquire()
        try:
            resp, died, log = w.request(req, timeout, on_interim)
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
        have = self.session_version if fmt == FileFormat.GGSN else self.state_seq_version
        return (
            version is None
            or have is None
            or fmt not in (FileFormat.GGSQ, FileFormat.GGSN)
            or int(version) == int(have)
        )

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
            try:
                from slotfile.format.reader import open_slot_file  # here: the pool starts without the reader

                sf = open_slot_file(path)
            except OSError as e:
                return LoadResult(False, f"cannot read {path}: {e.strerror or e}", 0, [], None)
        s = settings or settings_for(sf, self.n_gpu_layers)
        ds = draft_settings_for(sf, self.n_gpu_layers) if self.draft_model else None
        req = {
            "op": "load",
            "path": str(Path(path).resolve()),
            "settings": s.to_dict(),
            "format": FileFormat.GGSN if sf.format == FileFormat.GGSN else FileFormat.GGSQ,
            "draft_settings": ds.to_dict() if ds else None,
        }
        resp, died, log = self._call(req, timeout)
        if resp is None:
            line = telling_line(log)
            return LoadResult(False, died + (f": {line}" if line else ""), 0, [], None, crashed=True, log=log)
        msg = resp.get("message", "")
        if not resp.get("ok"):
            line = telling_line(log)
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
        n_stepwise: int = 0,
        out_floor: str | None = None,
        cuts: list[int] | None = None,
        stepwise: Sequence[tuple[int, int]] = (),
        swa_full: bool = False,
        on_recomputed: Callable[[], None] | None = None,
    ) -> DeepResult:
        """Restore ``path`` and recompute ``tokens`` from scratch with the same settings; the
        recomputed state is written to ``out`` (a GGSQ file with no tokens).  ``batch``: the
        prefill's n_batch (tokens per llama_decode call), ``n_ubatch`` its micro-batch (0: the
        server's defaults, 2048 and 512).  With ``n_stepwise`` and ``out_floor``: the last
        ``n_stepwise`` tokens decoded again one per call, that state written to ``out_floor`` (the
        noise floor).  ``cuts``: where the prefill starts a new llama_decode call (a server's
        checkpoint breaks, a reused prefix).  ``stepwise``: ranges ``(a, b)`` of positions decoded
        one token per call (replies the server generated).  ``swa_full``: the recompute's context
        with a whole-context sliding-window cache (llama-server's ``--swa-full``).
        ``on_recomputed``: called once ``out`` is written, while the worker decodes the noise
        floor's tokens (the two run side by side)."""
        if settings is None:
            settings = self._settings_of(path)
        req = {
            "op": "deep",
            "path": str(Path(path).resolve()),
            "settings": settings.to_dict(),
            "tokens": [int(t) for t in tokens],
            "probe": int(probe),
            "out": str(out),
            "n_batch": int(batch),
            "n_ubatch": int(n_ubatch),
            "n_stepwise": int(n_stepwise),
            "out_floor": str(out_floor) if out_floor else None,
            "cuts": [int(c) for c in cuts or []],
            "stepwise": [[int(a), int(b)] for a, b in stepwise],
            "swa_full": bool(swa_full),
            "early": on_recomputed is not None,
        }
        resp, died, log = self._call(req, timeout, on_recomputed)
        if resp is None:
            line = telling_line(log)
            return DeepResult(False, died + (f": {line}" if line else ""), crashed=True, log=log)
        msg = resp.get("message", "")
        if not resp.get("ok"):
            line = telling_line(log)
            if line and line not in msg:
                msg = f"{msg}: {line}"
        return DeepResult(
            bool(resp.get("ok")),
            msg,
            log=log,
            logits=resp.get("logits"),
            recomputed=str(out) if resp.get("ok") else None,
            restored_pos_max=resp.get("restored_pos_max"),
            floor=str(out_floor) if resp.get("ok") and resp.get("n_stepwise") else None,
            n_batch=int(resp.get("n_batch") or 0),
            n_ubatch=int(resp.get("n_ubatch") or 0),
            n_stepwise=int(resp.get("n_stepwise") or 0),
            cuts=[int(c) for c in resp.get("cuts") or []],
            stepwise=[(int(a), int(b)) for a, b in resp.get("stepwise") or []],
        )

    def _settings_of(self, path: str) -> LoadSettings:
        from slotfile.format.reader import open_slot_file

        return settings_for(open_slot_file(path), self.n_gpu_layers)

    def deep_blobs(
        self,
        tokens: list[int],
        at: list[int],
        out: str,
        settings: LoadSettings,
        draft_settings: LoadSettings | None = None,
        timeout: float = 300,
        *,
        n_batch: int = 0,
        n_ubatch: int = 0,
        n_stepwise: int = 0,
        floor_at: list[int] | None = None,
        draft_floor_at: list[int] | None = None,
    ) -> tuple[dict[str, Any] | None, str, bool]:
        """Prefill ``tokens`` with ``settings``, taking the PARTIAL_ONLY blob at each n_tokens in
        ``at`` (and with a draft model and ``draft_settings``, the draft's blobs and its whole
        state at the end), written to ``out`` (``Worker.deep_blobs``); with ``n_stepwise`` and
        ``floor_at`` / ``draft_floor_at``, instead the noise floor of those blobs.  Returns (the
        worker's reply: ``checkpoints`` [{n_tokens, pos_min, pos_max, tgt: [offset, length],
        dft}], ``draft`` [offset, length] or None, ``floors`` / ``draft_floors`` [{n_tokens, k,
        full, blob}]; None when it failed, why, whether the worker died)."""
        req = {
            "op": "deep_blobs",
            "settings": settings.to_dict(),
            "draft_settings": draft_settings.to_dict() if draft_settings and self.draft_model else None,
            "tokens": [int(t) for t in tokens],
            "at": [int(a) for a in at],
            "out": str(out),
            "n_batch": int(n_batch),
            "n_ubatch": int(n_ubatch),
            "n_stepwise": int(n_stepwise),
            "floor_at": [int(a) for a in floor_at or []],
            "draft_floor_at": [int(a) for a in draft_floor_at or []],
        }
        resp, died, log = self._call(req, timeout)
        if resp is not None and resp.get("ok"):
            return resp, "", False
        line = telling_line(log)
        msg = died if resp is None else str(resp.get("message", ""))
        return None, msg + (f": {line}" if line and line not in msg else ""), resp is None

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
