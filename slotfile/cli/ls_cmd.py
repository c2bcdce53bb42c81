"""``slotfile ls DIR``: one row per slot file under DIR (structure level), and totals.

JSON (``--json``), schema ``slotfile.ls/1``::

    {"schema": "slotfile.ls/1", "root": str, "server": {...} | null,
     "files": [{"path", "rel", "size", "age_s", "format", "version", "n_tokens", "memory_class",
                "n_stream", "active_streams", "kv_cells", "type_k", "type_v", "flash_attn",
                "checkpoints", "draft", "damaged", "first_problem", "error",
                "restore"?: {"fate", "reason", "changes", "proven": false, "load": null},
                "sealed"?: "sealed" | "changed" | "unsealed",    # DIR holds slotfile-manifest.json
                "model"?: {"model", "name", "verdict", "proof"} | null}],   # --models
     "sealed_missing"?: [rel],
     "totals": {"files", "bytes", "tokens", "damaged", "unreadable"},
     "temp": {"files", "bytes"}, "busy": {"files", "bytes"}, "symlinks_skipped": int,
     "errors": [str], "still_being_written": [str], "tally": {"handled", "skipped", "failed"},
     "files_per_second": float, "exit_code": 0 | 4 | 8}

``busy``: the files still being written once ``--settle-wait`` ran out (named in
``still_being_written``; they make the exit code 4).  Exit codes: 0 every slot file found was
listed and none is damaged; 4 a damaged file, or one still being written; 8 a path could not
be read; 2 usage.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotfile.cli.common import fail, out_console, say_waiting, write_json
from slotfile.cli.jsonout import Later, LazyList
from slotfile.cli.listing import Row, pipe_line, plain_pipe, print_rows, screen_width, summary
from slotfile.cli.terminal import count, escape_text, human_size
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.slotdir.walk import (
    SETTLE_SECONDS,
    SETTLE_WAIT_SECONDS,
    DirScan,
    FileSummary,
    Tally,
    human_age,
    path_order,
    scan_dir,
    settle_problem,
    summarize_all,
    summarize_stream,
    walk_dir,
)

SCHEMA = "slotfile.ls/1"
SORTS = ("path", "size", "age", "tokens")


@dataclass(frozen=True, slots=True)
class LsArgs:
    """``slotfile ls``'s command line."""

    root: Path
    json_out: bool = False
    sort: str = "path"
    server_args: str | None = None
    model: Path | None = None
    settle: float = SETTLE_SECONDS
    settle_wait: float = SETTLE_WAIT_SECONDS
    models: tuple[Path, ...] = ()  # candidate GGUFs: the model column (slotfile.seal.identify)


def run_ls(args: LsArgs) -> int:
    """Check the arguments, scan the directory, summarize every slot file, then print."""
    root = args.root
    bad = _bad_args(args)
    if bad is not None:
        return bad
    got = _server_side(args)
    if isinstance(got, int):
        return got
    server, side = got
    if not root.is_dir():
        fail(f"{root}: not a directory", "ls")
        return OPERATIONAL
    t0 = time.monotonic()
    if args.sort == "path" and server is None and not args.models and not _has_manifest(root):
        # streamed: each file read as the walk reaches it (on forked processes for a large
        # DIR), written and dropped; nothing held (memory flat in the files).  The walk's
        # order is the paths' (part by part, as verify lists them): no sort, no copy
        scan, found = walk_dir(root, settle=args.settle, settle_wait=args.settle_wait, on_wait=say_waiting("ls"))
        rows = Rows(summarize_stream(found), scan, t0)
        return _print(args, rows, {}, server, time.time(), (None, [], None), None)
    scan = scan_dir(root, settle=args.settle, settle_wait=args.settle_wait, on_wait=say_waiting("ls"))
    now = time.time()  # ages from after the wait
    listed = summarize_all(scan.slots)  # every row kept: the columns below need them all
    fates = _fates(listed, server, side)
    seal = _seal_states(root, listed)
    picked = _picked(args, listed)
    if isinstance(picked, int):
        return picked
    rows = Rows(iter(_sorted(listed, args.sort, now)), scan, t0)
    return _print(args, rows, fates, server, now, seal, picked)


class Rows:
    """A listing's rows, taken once (as they are written), their totals summed as they pass;
    an unreadable file is named on stderr as it passes, and so is each of the walk's error
    lines (a walk taken as it goes meets them between rows); the files still being written
    after the wait are named after the last row."""

    def __init__(self, rows: Iterator[FileSummary], scan: DirScan, t0: float) -> None:
        self._rows, self.scan, self.t0 = rows, scan, t0
        self.files = self.bytes = self.tokens = self.damaged = self.unreadable = 0
        self._said = 0  # the walk's error lines said so far

    def __iter__(self) -> Iterator[FileSummary]:
        self._say_errors()
        for s in self._rows:
            self.files += 1
            self.bytes += s.size
            self.tokens += s.n_tokens or 0
            self.damaged += s.damaged
            self._say_errors()
            if s.error:
                self.unreadable += 1
                fail(s.error, "ls")
            yield s
        self._say_errors()
        for line in self.scan.busy_lines():
            fail(line, "ls")

    def _say_errors(self) -> None:
        errors = self.scan.errors
        for e in errors[self._said :]:
            fail(e, "ls")
        self._said = len(errors)

    def elapsed(self) -> float:
        """Seconds of work so far, the wait for files being written left out."""
        return time.monotonic() - self.t0 - self.scan.waited

    def exit_code(self) -> int:
        if self.scan.errors or self.unreadable:
            return OPERATIONAL
        return PROBLEMS if self.scan.busy or self.damaged else OK

    def tally(self) -> Tally:
        scan = self.scan
        failed = self.unreadable + len(scan.busy) + len(scan.errors)
        return Tally(self.files - self.unreadable, len(scan.temps) + len(scan.symlinks), failed)


def _print(
    args: LsArgs,
    rows: Rows,
    fates: dict[str, Any],
    server: Any,
    now: float,
    seal: tuple[dict[str, str] | None, list[str], str | None],
    picked: dict[str, Any] | None,
) -> int:
    """The JSON document or the listing (the rows read as they are written); the exit code."""
    sealed, gone, bad_manifest = seal
    if bad_manifest is not None:
        fail(bad_manifest, "ls")

    def rc() -> int:
        return OPERATIONAL if bad_manifest is not None else rows.exit_code()

    if args.json_out:
        doc = document(rows, fates, server, now, rc, (sealed, picked))
        if sealed is not None:
            doc["sealed_missing"] = gone
        write_json(doc)  # streamed, each file's dict made as it is written: memory flat in the files
    else:
        render(rows, fates, now, sealed, gone, picked)
    return rc()


def _has_manifest(root: Path) -> bool:
    from slotfile.seal.manifest import find_manifest

    return find_manifest(root) is not None


def _seal_states(root: Path, rows: list[FileSummary]) -> tuple[dict[str, str] | None, list[str], str | None]:
    """A manifest in DIR: the sealed column (slotfile.seal.verify_hook, imported only then)."""
    from slotfile.seal.manifest import find_manifest

    if find_manifest(root) is None:
        return None, [], None
    from slotfile.seal.verify_hook import ls_states

    return ls_states(root, [s.path for s in rows])


def _bad_args(args: LsArgs) -> int | None:
    """USAGE (after saying why) for a --sort or settle option that cannot work, else None."""
    if args.sort not in SORTS:
        fail(f"--sort takes {', '.join(SORTS)}, not {args.sort!r}", "ls")
        return USAGE
    why = settle_problem(args.settle, args.settle_wait)
    if why is not None:
        fail(why, "ls")
        return USAGE
    return None


def _server_side(args: LsArgs) -> tuple[Any, Any] | int:
    """The server (``--server-args``) and, when a model is given, its model side; an exit code
    when either cannot be had."""
    server, side = None, None
    if args.server_args is not None:
        from slotfile.cli.server_common import server_and_model

        got = server_and_model(args.server_args, args.model, "ls", need_model=False)
        if isinstance(got, int):
            return got
        server, model_path = got
        if model_path is not None:
            from slotfile.model.bridge import ModelError
            from slotfile.slotdir.restore import model_side

            try:
                side = model_side(model_path)
            except ModelError as why:
                fail(str(why), "ls")
                return OPERATIONAL
    return server, side


def _fates(rows: list[FileSummary], server: Any, side: Any) -> dict[str, Any]:
    """The predicted restore of every readable file on the server (none without one)."""
    fates: dict[str, Any] = {}
    if server is not None:
        from slotfile.slotdir.restore import predict

        for s in rows:
            if s.error is None:
                fates[s.path] = predict(s, None, server, side, None).to_dict()
    return fates


def _picked(args: LsArgs, rows: list[FileSummary]) -> dict[str, Any] | int | None:
    """The model column (``--models``: slotfile.seal's identify; not in files/s), None without
    it, or an exit code when identify cannot run."""
    if not args.models:
        return None
    from slotfile.seal.identify import IdentifyError
    from slotfile.seal.verify_hook import ls_models

    try:
        return ls_models([s.path for s in rows if s.error is None], list(args.models))
    except IdentifyError as why:
        fail(str(why), "ls")
        return OPERATIONAL


def _sorted(rows: list[FileSummary], sort: str, now: float) -> list[FileSummary]:
    key = {
        "path": lambda s: path_order(s.rel),  # the walk's order, part by part
        "size": lambda s: -s.size,
        "age": lambda s: -s.age(now),  # oldest first
        "tokens": lambda s: -(s.n_tokens or 0),
    }[sort]
    return sorted(rows, key=key)


def document(
    rows: Rows,
    fates: dict[str, Any],
    server: Any,
    now: float,
    rc: Callable[[], int],
    columns: tuple[dict[str, str] | None, dict[str, Any] | None] = (None, None),
) -> dict[str, Any]:
    """The ``slotfile.ls/1`` document; its ``files`` a :class:`LazyList`, each file read (when
    streamed) and its dict made as it is written, and what follows counted from them
    (:class:`Later`).  ``columns``: the sealed states and the models picked, when shown."""

    def files() -> Iterator[dict[str, Any]]:
        sealed, picked = columns
        for s in rows:
            d = s.to_dict(now)
            if s.path in fates:
                d["restore"] = fates[s.path]
            if sealed is not None:
                d["sealed"] = sealed.get(s.path)
            if picked is not None:
                d["model"] = picked.get(s.path)
            yield d

    if server is not None:
        from slotfile.cli.server_common import server_dict  # --server-args only

    scan = rows.scan
    return {
        "schema": SCHEMA,
        "root": scan.root,
        "server": server_dict(server) if server is not None else None,
        "files": LazyList(files),
        "totals": Later(
            lambda: {
                "files": rows.files,
                "bytes": rows.bytes,
                "tokens": rows.tokens,
                "damaged": rows.damaged,
                "unreadable": rows.unreadable,
            }
        ),
        # the walk's findings after its files (a walk taken as it goes has them once it is done)
        "temp": Later(lambda: {"files": len(scan.temps), "bytes": sum(e.size for e in scan.temps)}),
        "busy": Later(lambda: {"files": len(scan.busy), "bytes": sum(e.size for e in scan.busy)}),
        "symlinks_skipped": Later(lambda: len(scan.symlinks)),
        "errors": scan.errors,
        "still_being_written": Later(lambda: [e.path for e in scan.busy]),
        "tally": Later(lambda: rows.tally().to_dict()),
        "files_per_second": Later(lambda: _rate(rows)),
        "exit_code": Later(rc),
    }


def _rate(rows: Rows) -> float | None:
    elapsed = rows.elapsed()
    return round(rows.files / elapsed, 1) if elapsed > 0 else None


def _streams(s: FileSummary) -> str:
    if s.n_stream is None:
        return "-"
    return f"{s.active_streams}/{s.n_stream}" if s.n_stream > 1 else "1"


def _fa(s: FileSummary) -> str:
    return {True: "on", False: "off", None: "-"}[s.flash_attn]


# the memory class first, left-aligned: a row never starts with spaces, as the name under it does
HEADS = ("memory", "ver", "size", "tokens", "streams", "K/V", "fa", "ckpt", "draft", "age")
RIGHT = ("size", "tokens", "ckpt", "age")


def render(
    rows: Rows,
    fates: dict[str, Any],
    now: float,
    sealed: dict[str, str] | None = None,
    gone: list[str] | None = None,
    picked: dict[str, Any] | None = None,
) -> None:
    """One row per slot file (:mod:`slotfile.cli.listing`: fixed columns and the name on a
    terminal, where the columns need every row first; one plain line per file on a pipe, each
    written as it is read), then the totals."""
    out = None if plain_pipe() else out_console()
    width = None if out is None else screen_width(out)
    heads = (*HEADS, *(("sealed",) if sealed is not None else ()))
    if width is None:
        for s in rows:
            row = _row(s, fates, now, sealed, picked)
            pipe_line(s.rel, ", ".join(f"{h} {c}" for h, c in zip(heads, row.cells, strict=False)), _plain(row))
    elif out is not None:
        table = [_row(s, fates, now, sealed, picked) for s in rows]
        if table:
            print_rows(out, (*heads, "file"), table, width, right=RIGHT)
    line = _totals_line(rows, fates, sealed, gone)
    if out is None:
        sys.stdout.write(escape_text(line) + "\n")  # what rich prints on a pipe
    else:
        summary(out, line, width)


def _plain(row: Row) -> list[str]:
    return [text for _, text in row.details]


def _row(
    s: FileSummary, fates: dict[str, Any], now: float, sealed: dict[str, str] | None, picked: dict[str, Any] | None
) -> Row:
    """A file's row: the cells (then its name), and the lines under it: why it is damaged,
    the restore predicted (``--server-args``), the model (``--models``)."""
    seal = (sealed.get(s.path, "-"),) if sealed is not None else ()
    if s.error:
        cells = ("unreadable", "-", human_size(s.size), *["-"] * (len(HEADS) - 3), *seal, s.rel)
        return Row(cells, "bold magenta")
    kv = f"{s.type_k}/{s.type_v or '-'}" if s.type_k else "-"
    cells = (
        s.memory_class or s.format or "?",
        str(s.version if s.version is not None else "-"),
        human_size(s.size),
        str(s.n_tokens if s.n_tokens is not None else "-"),
        _streams(s),
        kv,
        _fa(s),
        str(s.checkpoints),
        "yes" if s.draft else "-",
        human_age(s.age(now)),
        *seal,
        s.rel,
    )
    details: list[tuple[str, str]] = []
    if s.damaged:
        details.append(("red", f"damaged: {s.first_problem}"))
    if fates:
        f = fates.get(s.path)
        details.append(("cyan", f"restore: {f['fate']}: {f['reason']}" if f else "restore: -"))
    if picked is not None:
        from slotfile.seal.verify_hook import model_cell

        details.append(("", f"model: {model_cell(picked.get(s.path))}"))
    return Row(cells, "bold red" if s.damaged else "", tuple(details))


def _totals_line(
    rows: Rows,
    fates: dict[str, Any],
    sealed: dict[str, str] | None,
    gone: list[str] | None,
) -> str:
    """The line under the listing: totals, the files set apart, the manifest, the rate."""
    scan = rows.scan
    line = f"{count(rows.files, 'slot file')}, {human_size(rows.bytes)}, {count(rows.tokens, 'token')}"
    if rows.damaged:
        line += f", {rows.damaged} damaged"
    line += (
        f"; set apart: {count(len(scan.temps), 'temp file')} ({human_size(sum(e.size for e in scan.temps))}), "
        f"{len(scan.busy)} still being written ({human_size(sum(e.size for e in scan.busy))})"
    )
    if scan.symlinks:
        line += f", {count(len(scan.symlinks), 'symlink')} not followed"
    if fates:
        line += "; restore: from the structure only, verify --server-args proves it with a load"
    if sealed is not None:
        n_ok = sum(1 for v in sealed.values() if v == "sealed")
        line += f"; manifest: {n_ok} sealed as they are, {len(sealed) - n_ok} changed or unsealed"
        line += f", {count(len(gone or []), 'sealed file')} gone (verify DIR checks the bytes)"
    line += f"; {rows.tally().line()}"
    elapsed = rows.elapsed()
    line += f"; {rows.files / elapsed:.0f} files/s" if elapsed > 0 and rows.files else ""
    return line
