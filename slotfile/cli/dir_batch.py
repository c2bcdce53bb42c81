"""What ``re-save DIR`` and ``migrate DIR`` share: the output directory's usage checks, the exit
code and tally of a directory of :class:`~slotfile.repair.batch.FileResult` rows, and their
report (JSON ``slotfile.resave-dir/1`` / ``slotfile.migrate-dir/1`` or one line a file)."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotfile.cli.common import fail, out_console
from slotfile.cli.listing import Row, pipe_line, print_rows, screen_width, summary
from slotfile.cli.terminal import count
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.slotdir.walk import Tally

if TYPE_CHECKING:
    from slotfile.repair.batch import FileResult
    from slotfile.slotdir.walk import DirScan

HANDLED = ("copied", "converted", "would-copy", "would-convert")


def outdir_usage(root: Path, outdir: Path, command: str) -> int | None:
    """USAGE (after saying why) when ``outdir`` lies inside ``root`` or is something other than
    a directory; None when it can take the outputs."""
    rin, rout = os.path.realpath(root), os.path.realpath(outdir)
    if rout == rin or rout.startswith(rin + os.sep):
        fail(f"{outdir} lies inside {root}: choose an output directory outside it", command)
        return USAGE
    if os.path.lexists(outdir) and (os.path.islink(outdir) or not os.path.isdir(outdir)):
        fail(f"{outdir} exists and is not a directory", command)
        return USAGE
    return None


@dataclass
class BatchOutcome:
    """A directory batch summed up: the exit code, the count per action and the tally."""

    rc: int
    counts: dict[str, int]
    tally: Tally
    errors: list[str]
    busy: list[str]
    elapsed: float


def settle_batch(results: list[FileResult], scan: DirScan, errors: list[str], t0: float, command: str) -> BatchOutcome:
    """Say the errors and the files still being written; exit 8 on an operational error, 4 on
    a file skipped, failed or busy, else 0."""
    busy = scan.busy_lines()
    for line in errors + busy:
        fail(line, command)
    if errors or any(x.action == "error" for x in results):
        rc = OPERATIONAL
    elif busy or any(x.action in ("skipped", "failed") for x in results):
        rc = PROBLEMS
    else:
        rc = OK
    elapsed = time.monotonic() - t0
    counts: dict[str, int] = {}
    for x in results:
        counts[x.action] = counts.get(x.action, 0) + 1
    tally = Tally(
        sum(1 for x in results if x.action in HANDLED),
        counts.get("skipped", 0) + counts.get("left-out", 0) + len(scan.temps) + len(scan.symlinks),
        counts.get("failed", 0) + counts.get("error", 0) + len(busy) + len(errors),
    )
    return BatchOutcome(rc, counts, tally, errors, busy, elapsed)


def report_batch(
    results: list[FileResult], scan: DirScan, o: BatchOutcome, head: dict[str, Any], dry_run: bool, json_out: bool
) -> None:
    """The JSON document (``head``'s keys first, then the rows and the summary) or the text."""
    if json_out:
        doc = {
            **head,
            "files": [x.to_dict() for x in results],
            "errors": o.errors,
            "still_being_written": o.busy,
            "summary": {**o.counts, "seconds": round(o.elapsed, 3)},
            "tally": o.tally.to_dict(),
            "exit_code": o.rc,
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _print_batch(results, o.counts, scan, o.tally, o.elapsed, dry_run)


def _print_batch(
    results: list[FileResult], counts: dict[str, int], scan: DirScan, tally: Tally, elapsed: float, dry_run: bool
) -> None:
    """One row per file (:mod:`slotfile.cli.listing`): the action and the name, what was found
    and where the output went under it; one line per file in a pipe."""
    out = out_console()
    width = screen_width(out)
    rows = []
    for x in results:
        tail = f" -> {x.output}" if x.output and x.action in ("copied", "converted") else ""
        if width is None:
            pipe_line(x.rel, f"{x.action}: {x.fate}: {x.reason}{tail}")
        style = "bold red" if x.action in ("failed", "error") else ""
        rows.append(Row((x.action, x.rel), style, (("", f"{x.fate}: {x.reason}{tail}"),)))
    if width is not None and rows:
        print_rows(out, ("action", "file"), rows, width)
    done = ", ".join(f"{n} {k}" for k, n in counts.items()) or "nothing to do"
    left = (
        f"; left out: {count(len(scan.temps), 'temp file')}, {len(scan.busy)} still being written"
        if scan.temps or scan.busy
        else ""
    )
    line = f"{count(len(results), 'file')}: {done}{left}; {tally.line()} in {elapsed:.1f} s"
    summary(out, line + (" (dry run: nothing written)" if dry_run else ""), width)
