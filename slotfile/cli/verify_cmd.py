"""``slotfile verify``: a table (or JSON, or JUnit XML) of what each level found.

JSON (``--json``), schema ``slotfile.verify/1``; keys are only ever added::

    {"schema": "slotfile.verify/1",
     "loader": {"llama_cpp_python": "0.3.36", "state_seq_version": 3, "session_version": 10,
                "library": "/path/to/libllama.so", "library_source": "installed" | "--llama-lib" |
                "SLOTFILE_LLAMA_LIB" | "LLAMA_CPP_LIB_PATH" | "llama-server on PATH", "files": int} | null,
     "loaders": [same as "loader", one per library used: the run's own first, then the
                 llama-server's when its version matched files the first could not load],
     "model": str | null, "draft_model": str | null, "deep": bool,
     "tolerances": {"limit": 4.0, "min_floor": {"float"|"8-bit"|"low-bit": {"angle", "lnorm", "median"}},
                    "logits_min_floor": {...}, "tail": 32},
     "files": [{
        "path": str, "size": int | null, "n_tokens": int | null, "format": "GGSQ"|"GGSN"|"unknown"|null,
        "version": int | null,
        "levels": {"structure" | "model" | "load" | "deep": {
            "status": "pass" | "fail" | "skipped",
            "problems": [{"severity": "error"|"warning", "code": str, "section": str,
                          "offset": int | null, "message": str}],
            "reason": str (only when skipped), "details": {...} (level-specific), "seconds": float,
            "unchecked_parts": [{"section", "offset", "reason", "hint"}] (only when some: deep's blobs
                               it could not recompute, the body's shifted cells; --require deep fails on them)}},
        "level_reached": 0..4,       # highest n with levels 1..n all "pass"
        "verdict": "pass" | "fail" | "error",   # error: the file could not be read
        "first_problem": str | null, # "<level>: <section> at offset <o>: <message>"
        "unmet_requirements": [{"level", "reason", "skip_kind", "hint"}],  # --require levels skipped
        "error": str | null, "seconds": float}],
     "errors": [str],                # paths that do not exist
     "require": [level, ...],        # --require, with the levels below the highest one named
     "summary": {"files": n, "pass": n, "fail": n, "error": n, "unmet_requirements": n, "seconds": float},
     "tally": {"handled": n, "skipped": n, "failed": n},   # as ls, prune and re-save DIR count
     "still_being_written": [str],   # files still changing after --settle-wait (exit 4)
     "exit_code": 0 | 4 | 8}

``details``: structure {format, version, layout, checkpoints, draft}; model {arch, n_vocab,
n_ctx_train, memory_class}; load {library, settings, body_bytes, crashed, message, checkpoints,
checkpoint_drafts, draft, log}; deep {layers: [{section, block, part, layer, type, cells, max_abs, rel,
worst_cell_rel, angle, lnorm, median_angle, floor {angle, lnorm, median}, ratios {angle, lnorm,
median}, ratio, by, worst_cell, worst_pos, limit}], logits {max_abs, mean_abs, rel, floor_rel,
floor, ratio, scale, top5_restored, top5_recomputed, all_finite}, probe_token, n_batch, n_ubatch,
tail, limit, margin, worst {section, part, layer, ratio, by, worst_pos}, rotation {stored,
recompute, matches, median_angle_as_recomputed, median_angle_other_setting, layers} | null,
min_floor}.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.slotdir.walk import SETTLE_SECONDS, SETTLE_WAIT_SECONDS, Tally

# Nothing of the reader (numpy, construct) or the verify levels is imported with this module:
# run_verify starts the loader workers first, and they load the model while this process
# imports those (a deep check on a short file: ~0.3 s of its critical path otherwise).

if TYPE_CHECKING:
    from slotfile.cli.verify_output import Counts
    from slotfile.llama.loader import LoaderPool
    from slotfile.seal.check import CheckResult
    from slotfile.verify import FileReport, Verifier, VerifyOptions
    from slotfile.verify.collect import Collected


@dataclass(frozen=True)
class VerifyRequest:
    """``slotfile verify``'s command line, as the typer wiring (cli/app.py) received it."""

    paths: tuple[Path, ...]
    model: Path | None = None
    draft_model: Path | None = None
    deep: bool = False
    n_gpu_layers: int = 0
    jobs: int | None = None  # --jobs; None: 1 loader worker, or the directory default (slotfile.slotdir.forked)
    json_out: bool = False
    junit: Path | None = None
    timeout: float = 300.0
    scan: bool = False
    quiet: bool = False  # no table: the failing files and the summary (JSON is unchanged)
    llama_lib: Path | None = None  # the folder holding the libllama.so the workers load
    n_batch: int = 0  # the deep recompute's; 0: the server's default
    n_ubatch: int = 0
    settle: float = SETTLE_SECONDS  # a directory's files modified more recently are waited for
    settle_wait: float = SETTLE_WAIT_SECONDS  # ... up to this long; then named, and the run fails
    require: tuple[str, ...] = ()  # --require values, comma lists split (levels that must run)
    manifest: Path | None = None  # check against this manifest (default: the directory's own, slotfile.seal)
    models: tuple[Path, ...] = ()  # candidate models: each file's picked by identify (slotfile.seal)

    def usage_error(self) -> str | None:
        from slotfile.slotdir.walk import settle_problem
        from slotfile.verify.options import require_usage

        why = require_usage(self.require, self.model is not None, self.deep)
        why = why or settle_problem(self.settle, self.settle_wait)
        if why is not None:
            return why
        if self.deep and self.model is None:
            return "--deep needs --model (the recompute runs the model)"
        if self.draft_model is not None and self.model is None:
            return "--draft-model needs --model"
        if self.jobs is not None and self.jobs < 1:
            return "--jobs must be at least 1"
        if self.models and self.model is not None:
            return "give --model or --models, not both"
        if self.models and self.draft_model is not None:
            return "--draft-model goes with --model, not --models"
        return None

    def options(self) -> VerifyOptions:
        from slotfile.verify import VerifyOptions

        return VerifyOptions(
            model=str(self.model) if self.model else None,
            draft_model=str(self.draft_model) if self.draft_model else None,
            deep=self.deep,
            n_gpu_layers=self.n_gpu_layers,
            jobs=self.jobs or 1,
            read_jobs=self.jobs,
            timeout=self.timeout,
            scan=self.scan,
            llama_lib=str(self.llama_lib) if self.llama_lib is not None else None,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            require=self.require,
        )


def run_verify(req: VerifyRequest) -> int:
    """The command: the loader workers start first, so that they load the model while this
    process imports numpy and rich and reads the files."""
    pool = _start_pool(req)
    try:
        return _run_verify(req, pool)
    finally:
        if pool is not None:
            pool.close()


def _start_pool(req: VerifyRequest) -> LoaderPool | None:
    """Workers for ``--model`` (None: no model, a usage error, or a model path that is not a
    file; the Verifier reports those with their exit codes)."""
    model, draft = req.model, req.draft_model
    if (
        model is None
        or (req.jobs is not None and req.jobs < 1)
        or not model.is_file()
        or (draft is not None and not draft.is_file())
    ):
        return None
    from slotfile.llama.loader import LoaderError, LoaderPool

    try:
        return LoaderPool.start(
            str(model), str(draft) if draft else None, req.n_gpu_layers, req.jobs or 1, llama_lib=req.llama_lib
        )
    except LoaderError:  # an unusable --llama-lib: the Verifier reports it, with its exit code
        return None


def _run_verify(req: VerifyRequest, pool: LoaderPool | None) -> int:
    from slotfile.cli.common import fail, say_waiting
    from slotfile.verify import Verifier, VerifyError, collect

    usage = req.usage_error()
    if usage is not None:
        fail(usage)
        return USAGE
    t0 = time.monotonic()
    mode = _stream_mode(req)
    if mode is not None:
        return _run_streamed(req, pool, t0, mode)
    col = collect(list(req.paths), settle=req.settle, settle_wait=req.settle_wait, on_wait=say_waiting("verify"))
    files, errors = col.files, col.errors
    for e in errors + col.busy + col.notes:
        fail(e)
    opts = req.options()
    check = _manifest_check(req)
    if isinstance(check, int):
        return check
    if req.models:
        return _run_with_models(req, files, col, check, t0)
    try:
        verifier = Verifier(opts, pool)
    except VerifyError as e:
        fail(str(e))
        return OPERATIONAL
    show = _progress_shown(req, req.model is not None or len(files) > 1)
    reports: list[FileReport] = []
    try:
        _import_output_beside(req)
        reports = _run_with_progress(verifier, files) if show else verifier.run(files)
        loaders = verifier.loaders()
    except VerifyError as e:
        fail(str(e))
        return OPERATIONAL
    finally:
        verifier.close()
    elapsed = time.monotonic() - t0
    for r in reports:
        if r.error:
            fail(r.error)
    return _emit(req, reports, col, loaders, elapsed, check)


def _import_output_beside(req: VerifyRequest) -> None:
    """With a model this process mostly waits on the loader worker (its load, prefill and
    decodes) before the report is printed with rich, whose import (~45 ms) then came after
    the last reply: it is imported on a thread meanwhile.  Whoever imports it next waits for
    that import to finish (the import lock)."""
    if req.model is None or req.json_out or "rich.console" in sys.modules:
        return
    import threading

    threading.Thread(target=_import_rich, daemon=True).start()


def _import_rich() -> None:
    import contextlib

    with contextlib.suppress(Exception):  # said, if it matters, by the import that needs it
        import rich.console  # noqa: F401


def _progress_shown(req: VerifyRequest, many: bool) -> bool:
    """Whether a progress bar goes to stderr: a terminal, no ``-q``, and a directory or
    ``many`` (several files, or a model's slow levels)."""
    from slotfile.cli.common import err_console
    from slotfile.cli.listing import plain_pipe

    return (
        not req.quiet
        and not plain_pipe(sys.stderr)  # no rich import for a bar that cannot show
        and err_console().is_terminal
        and (many or any(p.is_dir() for p in req.paths))
    )


def _stream_mode(req: VerifyRequest) -> str | None:
    """How a structure-only run writes each file as it is read, keeping no report: "json",
    "pipe" (one line per file) or "quiet"; None when the output needs every report first (a
    terminal's columns, --junit, --models, a manifest check)."""
    from slotfile.cli.listing import plain_pipe

    if req.model is not None or req.junit is not None or req.models or _manifest_path(req) is not None:
        return None
    if req.json_out:
        return "json"
    if req.quiet:
        return "quiet"
    return "pipe" if plain_pipe() else None


def _manifest_path(req: VerifyRequest) -> Path | None:
    """--manifest, or the directory's own slotfile-manifest.json; None without one."""
    from slotfile.seal.manifest import find_manifest

    one = req.paths[0] if len(req.paths) == 1 and req.paths[0].is_dir() else None
    if req.manifest is None and (one is None or find_manifest(one) is None):
        return None  # no manifest (seal.check.discover's rule): seal's modules are not imported
    from slotfile.seal.verify_hook import manifest_for

    return manifest_for(list(req.paths), req.manifest)


def _run_streamed(req: VerifyRequest, pool: LoaderPool | None, t0: float, mode: str) -> int:
    """Structure only: each file read as the walk reaches it (on forked processes for a
    directory's worth), its row made where it was read and written here as it comes, in
    order; then the summary.  No file list is held: memory stays flat in the number of files."""
    from slotfile.cli.common import fail
    from slotfile.verify import Verifier, VerifyError

    try:
        verifier = Verifier(req.options(), pool)
    except VerifyError as e:
        fail(str(e))
        return OPERATIONAL
    try:
        return _write_streamed(req, verifier, t0, mode)
    finally:
        verifier.close()


def _write_streamed(req: VerifyRequest, verifier: Verifier, t0: float, mode: str) -> int:
    """:func:`_run_streamed`'s output.  Error lines are said as they come (a directory's once
    its walk is done, with the files still being written and the notes)."""
    from functools import partial

    from slotfile.cli.common import fail, say_waiting
    from slotfile.cli.jsonout import Encoded, LazyList
    from slotfile.cli.verify_output import Counts, Digest, digest, summary_line
    from slotfile.verify.collect import collect_stream

    col, files = collect_stream(list(req.paths), req.settle, req.settle_wait, say_waiting("verify"))
    base = req.paths[0] if len(req.paths) == 1 and req.paths[0].is_dir() else None
    # the workers are forked here, once the walk's first files are in: before the document's
    # head (its tolerances import the model side) and before a progress bar's thread
    got = verifier.stream(files, partial(digest, mode=mode, base=base))
    if _progress_shown(req, len(req.paths) > 1):
        got = _with_progress(got, None)  # how many files: known once the walk is done
    c = Counts()
    said = 0

    def say_errors() -> None:  # the error lines, each once, as they come
        nonlocal said
        for e in col.errors[said:]:
            fail(e)
        said = len(col.errors)

    def rows() -> Iterator[str]:
        d: Digest
        for d in got:
            c.add(d)
            say_errors()
            if d.error:
                fail(d.error)
            if d.text:
                yield d.text
        say_errors()
        for e in col.busy + col.notes:
            fail(e)

    def rc() -> int:
        return _exit_code(col.errors, [], col.busy, c)

    def elapsed() -> float:
        return time.monotonic() - t0

    t = partial(_tally, col, c)
    if mode == "json":
        from slotfile.cli.common import write_json
        from slotfile.cli.verify_output import document

        encoded = LazyList(lambda: (Encoded(x) for x in rows()))
        doc = document(encoded, col.errors, verifier.opts, [], elapsed, rc, lambda: t().to_dict(), col.busy_paths, c)
        write_json(doc)
        return rc()
    from slotfile.cli.common import out_console
    from slotfile.cli.listing import summary

    out = out_console()
    for line in rows():
        (sys.stdout.write(line + "\n") if mode == "pipe" else out.print(line, soft_wrap=True))
    if c.files:  # nothing verified: the error lines on stderr say why, stdout stays empty
        line = summary_line(c, [], elapsed(), structure_only=True)
        summary(out, line + (f"; {t().line()}" if col.dirs else ""), None)
    return rc()


def _with_progress(got: Iterator[Any], total: int | None) -> Iterator[Any]:
    """``got`` passed through, a progress bar on stderr (a terminal) advanced as it goes."""
    from slotfile.cli.common import progress_bar

    with progress_bar() as progress:
        task = progress.add_task("verifying", total=total)
        for d in got:
            progress.update(task, advance=1)
            yield d


def _manifest_check(req: VerifyRequest) -> CheckResult | int | None:
    """The manifest check (:func:`_manifest_path`); an exit code when the manifest or the model
    cannot be used (slotfile.seal.verify_hook)."""
    path = _manifest_path(req)
    if path is None:
        return None
    from slotfile.cli.common import fail
    from slotfile.seal.manifest import ManifestError
    from slotfile.seal.verify_hook import run_check

    try:
        return run_check(
            path,
            list(req.paths),
            str(req.model) if req.model else None,
            str(req.draft_model) if req.draft_model else None,
        )
    except ManifestError as e:
        fail(str(e))
        return OPERATIONAL


def _run_with_models(
    req: VerifyRequest, files: Sequence[Path], col: Collected, check: CheckResult | None, t0: float
) -> int:
    """--models: each file verified with the model identify picks for it (slotfile.seal.verify_hook)."""
    from slotfile.cli.common import fail
    from slotfile.seal.identify import IdentifyError
    from slotfile.seal.verify_hook import verify_with_models
    from slotfile.verify import VerifyError

    try:
        reports, idents = verify_with_models(files, list(req.models), req.options())
    except (IdentifyError, VerifyError) as e:
        fail(str(e))
        return OPERATIONAL
    for r in reports:
        if r.error:
            fail(r.error)
    return _emit(req, reports, col, [], time.monotonic() - t0, check, idents)


def tally(col: Collected, reports: list[FileReport]) -> Tally:
    """handled: files verified (pass or fail); skipped: temp names and symlinks under a
    directory; failed: unreadable files, missing paths, unreadable directories and files still
    being written after --settle-wait."""
    from slotfile.cli.verify_output import Counts

    return _tally(col, Counts.of(reports))


def _tally(col: Collected, c: Counts) -> Tally:
    from slotfile.verify.records import Verdict

    unread = c.verdicts[Verdict.ERROR]
    return Tally(c.files - unread, col.skipped, unread + len(col.errors) + len(col.busy))


def _emit(
    req: VerifyRequest,
    reports: list[FileReport],
    col: Collected,
    loaders: list[dict[str, Any]],
    elapsed: float,
    check: CheckResult | None = None,
    idents: dict[str, dict[str, Any]] | None = None,
) -> int:
    """The JUnit file, then the JSON document or the listing; the exit code."""
    from slotfile.cli.common import fail
    from slotfile.cli.verify_output import document, render, write_junit

    opts = req.options()
    errors = col.errors
    rc = _exit_code(errors, reports, col.busy)
    t = tally(col, reports)
    doc = document(reports, errors, opts, loaders, elapsed, rc, tally=t.to_dict(), busy=col.busy_paths)
    rc = _annotate(doc, rc, check, idents)
    if req.junit is not None:
        try:
            write_junit(req.junit, reports, errors, opts, elapsed)
            if check is not None:
                from slotfile.seal.verify_hook import junit_add

                junit_add(req.junit, check)
        except OSError as e:
            fail(f"{req.junit}: {e.strerror or e}")
            rc = OPERATIONAL
            doc["exit_code"] = rc
    if req.json_out:
        from slotfile.cli.common import write_json

        write_json(doc)  # streamed: memory flat in the number of files
    elif reports:  # nothing verified: the error lines on stderr say why, stdout stays empty
        paths = req.paths
        base = paths[0] if len(paths) == 1 and paths[0].is_dir() else None
        render(
            reports,
            loaders,
            elapsed,
            structure_only=opts.model is None,
            quiet=req.quiet,
            base=base,
            tally=t.line() if col.dirs else None,
        )
    if check is not None and not req.json_out:
        from slotfile.cli.common import out_console
        from slotfile.cli.terminal import escape_text
        from slotfile.seal.verify_hook import lines

        out = out_console()

        for line in lines(check, req.quiet):
            out.print(escape_text(line), soft_wrap=True)
    return rc


def _annotate(doc: dict[str, Any], rc: int, check: CheckResult | None, idents: dict[str, dict[str, Any]] | None) -> int:
    """The --manifest check and the --identify results added to the JSON document; the exit
    code the manifest check makes of ``rc``."""
    if check is not None or idents is not None:
        from slotfile.seal.verify_hook import annotate, exit_code

        doc["files"] = list(doc["files"])  # the rows annotated in place: made now, not as written

        if check is not None:
            rc = exit_code(rc, check)
            annotate(doc, check)
        for f in doc["files"] if idents is not None else []:
            f["identify"] = idents.get(f["path"])  # type: ignore[union-attr]
        doc["exit_code"] = rc
    return rc


def _exit_code(
    errors: list[str], reports: list[FileReport], busy: list[str] | None = None, counts: Counts | None = None
) -> int:
    """OPERATIONAL when a file could not be read or checked, PROBLEMS when one fails or a file
    was still being written after --settle-wait (left out: never a pass), else OK.  ``counts``:
    a streamed run's, in place of the reports."""
    from slotfile.cli.verify_output import Counts
    from slotfile.verify.records import Verdict

    v = (counts if counts is not None else Counts.of(reports)).verdicts
    if errors or v[Verdict.ERROR]:
        return OPERATIONAL
    if busy or v[Verdict.FAIL]:
        return PROBLEMS
    return OK


def _run_with_progress(verifier: Verifier, files: Sequence[Path]) -> list[FileReport]:
    """The run with a progress bar on stderr (a terminal)."""
    from slotfile.cli.common import progress_bar
    from slotfile.cli.terminal import escape_text

    with progress_bar() as progress:
        task = progress.add_task("verifying", total=len(files))

        def done(r: FileReport) -> None:
            progress.update(task, advance=1, description=f"verified {escape_text(Path(r.path).name, 40)}")

        return verifier.run(files, done)
