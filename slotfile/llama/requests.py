"""llama.cpp work for the repairs (prefill, re-save), always run in a worker process.

An abort inside llama.cpp (``GGML_ABORT`` on a bad blob, an assertion) ends the process it
runs in; it must never end slotfile.  So each request runs in a fresh ``python -m
slotfile.llama.worker`` (the program the loader pool uses, :mod:`slotfile.llama.worker.program`, where
the operations are described): it loads the request's model (and draft model), answers the
one request and is killed.  A worker that dies by a signal, exits without a result or runs
past its timeout gives ``WorkerResult(ok=False, crashed=True)``; llama.cpp's warnings and
errors meanwhile come back as ``log``.

Operations: ``prefill`` (decode the stored tokens, taking checkpoint blobs on the way, and
save with ``llama_state_seq_save_file``) and ``resave`` (load with
``llama_state_seq_load_file`` and save again).

Which llama.cpp: the request's ``llama_lib`` (a folder holding libllama.so), else
$SLOTFILE_LLAMA_LIB, else llama-cpp-python's own.  A request with ``state_version`` (the input
file's) is only run by a library that writes that version: when the first library's differs
and none was named, the library beside the llama-server on PATH is tried; otherwise the
request is refused with a one-line reason (the output would silently change version).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from slotfile.llama.loader import (
    LIB_ENV,
    Library,
    LoaderError,
    WorkerProcess,
    library_label,
    resolve_library,
    server_library,
    telling_line,
)
from slotfile.llama.worker.program import default_checkpoint_positions

__all__ = ["WorkerResult", "default_checkpoint_positions", "run_worker", "settings_dict"]

LOG_TAIL = 4000  # characters of llama.cpp's log kept in a result


@dataclass(slots=True)
class WorkerResult:
    ok: bool
    message: str
    data: dict[str, Any]
    crashed: bool = False
    log: str = ""
    seconds: float = 0.0


def settings_dict(settings: Any) -> dict[str, Any] | None:
    """A LoadSettings (or a dict, or None) as a plain JSON-able dict."""
    if settings is None:
        return None
    if is_dataclass(settings):
        return asdict(settings)  # type: ignore[arg-type]
    return dict(settings)


def run_worker(request: dict[str, Any], timeout: float = 600.0) -> WorkerResult:
    """Run one request (``op``, ``model``, ``draft_model``, ``settings``, ``llama_lib``,
    ``state_version``, ...) in a fresh worker; never raises for a worker failure.  ``timeout``
    covers the model load too.  ``data`` gets ``library`` and ``state_seq_version``: the
    llama.cpp that answered."""
    t0 = time.monotonic()
    try:
        lib = resolve_library(request.get("llama_lib"))
    except LoaderError as e:
        return WorkerResult(False, str(e), {}, True, "", time.monotonic() - t0)
    want = request.get("state_version")
    res = _run_one(request, timeout, lib, t0)
    have = res.data.get("state_seq_version")
    if want is None or have is None or int(have) == int(want) or not res.data.get("_wrong_version"):
        res.data.pop("_wrong_version", None)
        return res
    tried = ""
    if lib.source not in ("--llama-lib", LIB_ENV):
        folder, where = server_library()
        if folder is not None and folder != res.data.get("library_dir"):
            left = max(1.0, timeout - (time.monotonic() - t0))
            alt = _run_one(request, left, Library(folder, "llama-server on PATH"), t0)
            if not alt.data.get("_wrong_version"):
                alt.data.pop("_wrong_version", None)
                return alt
            tried = f" ({where} writes version {alt.data.get('state_seq_version')})"
        else:
            tried = f" ({where})"
    res.message = (
        f"the file has state version {want}, the loader ({res.data.get('label')}) writes version {have}"
        f"{tried}: pass --llama-lib DIR with a version {want} build of llama.cpp"
    )
    res.data.pop("_wrong_version", None)
    return res


def _run_one(request: dict[str, Any], timeout: float, lib: Library, t0: float) -> WorkerResult:
    """One worker over ``lib``; a refusal for a version mismatch has ``data["_wrong_version"]``."""
    n_gpu_layers = int((request.get("settings") or {}).get("n_gpu_layers") or 0)
    try:
        w = WorkerProcess(
            str(request["model"]),
            request.get("draft_model"),
            n_gpu_layers,
            None,
            env={"OMP_NUM_THREADS": "1"},
            library=lib,
        )
    except OSError as e:
        return WorkerResult(False, f"could not start the llama.cpp worker: {e}", {}, True, "", time.monotonic() - t0)
    try:
        return _converse(w, request, timeout, t0)
    finally:
        w.close()  # SIGKILL: freeing the model and contexts would only cost time


def _converse(w: WorkerProcess, request: dict[str, Any], timeout: float, t0: float) -> WorkerResult:
    """The hello, the library and version checks, then the request itself."""
    hello, died = w.read(timeout)
    why = w.library_problem(hello, died)
    if why is not None:  # an unusable library: operational, one line
        return WorkerResult(False, why, {}, True, w.log_since(0)[-LOG_TAIL:], time.monotonic() - t0)
    facts: dict[str, Any] = {}
    log = ""
    if hello is not None and hello.get("ok"):
        facts = {
            "library": hello.get("library"),
            "library_dir": hello.get("library_dir"),
            "state_seq_version": hello.get("state_seq_version"),
            "label": library_label(hello),
        }
        want = request.get("state_version")
        if want is not None and int(want) != int(hello["state_seq_version"]):
            return WorkerResult(
                False, "wrong version", dict(facts, _wrong_version=True), False, "", time.monotonic() - t0
            )
        left = max(0.0, timeout - (time.monotonic() - t0))
        resp, died, log = w.request(request, left) if left > 0 else (None, "", "")
        if left <= 0:
            w.kill()
            w.timed_out = True
    else:
        resp = hello
    log = (w.log_since(0) if resp is None or not resp.get("ok") else log)[-LOG_TAIL:]
    return _result(w, resp, died, log, facts, timeout, time.monotonic() - t0)


def _result(
    w: WorkerProcess,
    resp: dict[str, Any] | None,
    died: str,
    log: str,
    facts: dict[str, Any],
    timeout: float,
    dt: float,
) -> WorkerResult:
    """The worker's answer (or its death) as a result, with the library's facts in ``data``."""
    if resp is None:
        if w.timed_out:
            return WorkerResult(False, f"llama.cpp worker ran past {timeout:.0f} s and was stopped", {}, True, log, dt)
        line = telling_line(log)
        return WorkerResult(
            False,
            f"llama.cpp worker crashed ({w.exit_status or died})" + (f": {line}" if line else ""),
            {},
            True,
            log,
            dt,
        )
    data = dict(resp)
    data.update(facts)
    ok = bool(data.pop("ok", False))
    msg = str(data.pop("message", ""))
    data.pop("id", None)
    return WorkerResult(ok, msg, data, False, log, dt)
