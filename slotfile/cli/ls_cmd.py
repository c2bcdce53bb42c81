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
     "errors": [str], "files_per_second": float, "exit_code": 0 | 4 | 8}
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from slotfile.cli.common import fail
from slotfile.cli.server_common import server_dict, wide_console
from slotfile.cli.terminal import escape_text, human_size
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.slotdir.walk import DirScan, FileSummary, human_age, scan_dir, summarize

SCHEMA = "slotfile.ls/1"
SORTS = ("path", "size", "age", "tokens")


def run_ls(
    root: Path,
    json_out: bool,
    sort: str,
    server_args: str | None,
    model: Path | None,
    settle: float = 5.0,
    models: list[Path] | None = None,
) -> int:
    if sort not in SORTS:
        fail(f"--sort takes {', '.join(SORTS)}, not {sort!r}", "ls")
        return USAGE
    server, side = None, None
    if server_args is not None:
        from slotfile.cli.server_common import server_and_model

        got = server_and_model(server_args, model, "ls", need_model=False)
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
    if not root.is_dir():
        fail(f"{root}: not a directory", "ls")
        return OPERATIONAL
    t0 = time.monotonic()
    now = time.time()
    scan = scan_dir(root, settle=settle, now=now)
    rows = [summarize(e) for e in scan.slots]
    fates: dict[str, Any] = {}
    if server is not None:
        from slotfile.slotdir.restore import predict

        for s in rows:
            if s.error is None:
                fates[s.path] = predict(s, None, server, side, None).to_dict()
    from slotfile.seal.verify_hook import ls_states

    sealed, gone, bad_manifest = ls_states(root, [s.path for s in rows])  # a manifest there: the sealed column
    elapsed = time.monotonic() - t0
    picked: dict[str, Any] | None = None
    if models:  # the model column: identify (slotfile.seal); not in files/s
        from slotfile.seal.identify import IdentifyError
        from slotfile.seal.verify_hook import ls_models

        try:
            picked = ls_models([s.path for s in rows if s.error is None], models)
        except IdentifyError as why:
            fail(str(why), "ls")
            return OPERATIONAL
    rows = _sorted(rows, sort, now)
    for e in scan.errors:
        fail(e, "ls")
    for s in rows:
        if s.error:
            fail(s.error, "ls")
    rc = _exit(scan, rows)
    if bad_manifest is not None:
        fail(bad_manifest, "ls")
        rc = OPERATIONAL
    if json_out:
        doc = document(scan, rows, fates, server, now, elapsed, rc)
        if sealed is not None:
            for f in doc["files"]:
                f["sealed"] = sealed.get(f["path"])
            doc["sealed_missing"] = gone
        if picked is not None:
            for f in doc["files"]:
                f["model"] = picked.get(f["path"])
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render(scan, rows, fates, now, elapsed, sealed, gone, picked)
    return rc


def _exit(scan: DirScan, rows: list[FileSummary]) -> int:
    if scan.errors or any(s.error for s in rows):
        return OPERATIONAL
    return PROBLEMS if any(s.damaged for s in rows) else OK


def _sorted(rows: list[FileSummary], sort: str, now: float) -> list[FileSummary]:
    key = {
        "path": lambda s: s.rel,
        "size": lambda s: -s.size,
        "age": lambda s: -s.age(now),  # oldest first
        "tokens": lambda s: -(s.n_tokens or 0),
    }[sort]
    return sorted(rows, key=key)


def document(
    scan: DirScan, rows: list[FileSummary], fates: dict[str, Any], server: Any, now: float, elapsed: float, rc: int
) -> dict[str, Any]:
    files = []
    for s in rows:
        d = s.to_dict(now)
        if s.path in fates:
            d["restore"] = fates[s.path]
        files.append(d)
    return {
        "schema": SCHEMA,
        "root": scan.root,
        "server": server_dict(server) if server is not None else None,
        "files": files,
        "totals": {
            "files": len(rows),
            "bytes": sum(s.size for s in rows),
            "tokens": sum(s.n_tokens or 0 for s in rows),
            "damaged": sum(1 for s in rows if s.damaged),
            "unreadable": sum(1 for s in rows if s.error),
        },
        "temp": {"files": len(scan.temps), "bytes": sum(e.size for e in scan.temps)},
        "busy": {"files": len(scan.busy), "bytes": sum(e.size for e in scan.busy)},
        "symlinks_skipped": len(scan.symlinks),
        "errors": scan.errors,
        "files_per_second": round(len(rows) / elapsed, 1) if elapsed > 0 else None,
        "exit_code": rc,
    }


def _streams(s: FileSummary) -> str:
    if s.n_stream is None:
        return "-"
    return f"{s.active_streams}/{s.n_stream}" if s.n_stream > 1 else "1"


def _fa(s: FileSummary) -> str:
    return {True: "on", False: "off", None: "-"}[s.flash_attn]


def render(
    scan: DirScan,
    rows: list[FileSummary],
    fates: dict[str, Any],
    now: float,
    elapsed: float,
    sealed: dict[str, str] | None = None,
    gone: list[str] | None = None,
    picked: dict[str, Any] | None = None,
) -> None:
    from rich.table import Table

    from slotfile.cli.common import out

    table = Table(title=f"slotfile ls {escape_text(scan.root)}", title_justify="left")
    cols = ["file", "size", "tokens", "ver", "memory", "streams", "K/V", "fa", "ckpt", "draft", "age"]
    if fates:
        cols.append("restore")
    if sealed is not None:
        cols.append("sealed")
    if picked is not None:
        cols.append("model")
    for c in cols:
        table.add_column(c, justify="right" if c in ("size", "tokens", "ckpt", "age") else "left", overflow="fold")
    for s in rows:
        if s.error:
            table.add_row(escape_text(s.rel), human_size(s.size), "-", "-", "unreadable", *["-"] * (len(cols) - 5))
            continue
        kv = f"{s.type_k}/{s.type_v or '-'}" if s.type_k else "-"
        mem = (s.memory_class or s.format or "?") + (" DAMAGED" if s.damaged else "")
        row = [
            escape_text(s.rel),
            human_size(s.size),
            str(s.n_tokens if s.n_tokens is not None else "-"),
            str(s.version if s.version is not None else "-"),
            mem,
            _streams(s),
            kv,
            _fa(s),
            str(s.checkpoints),
            "yes" if s.draft else "-",
            human_age(s.age(now)),
        ]
        if fates:
            f = fates.get(s.path)
            row.append(escape_text(f"{f['fate']}: {f['reason']}") if f else "-")
        if sealed is not None:
            row.append(sealed.get(s.path, "-"))
        if picked is not None:
            from slotfile.seal.verify_hook import model_cell

            row.append(escape_text(model_cell(picked.get(s.path))))
        table.add_row(*row)
    if rows:
        wide_console().print(table)
    line = (
        f"{len(rows)} slot file(s), {human_size(sum(s.size for s in rows))}, "
        f"{sum(s.n_tokens or 0 for s in rows)} tokens"
    )
    damaged = sum(1 for s in rows if s.damaged)
    if damaged:
        line += f", {damaged} damaged"
    line += (
        f"; apart: {len(scan.temps)} temp file(s) ({human_size(sum(e.size for e in scan.temps))}), "
        f"{len(scan.busy)} being written ({human_size(sum(e.size for e in scan.busy))})"
    )
    if scan.symlinks:
        line += f", {len(scan.symlinks)} symlink(s) not followed"
    if fates:
        line += " [restore: from the structure only; verify --server-args proves it with a load]"
    if sealed is not None:
        n_ok = sum(1 for v in sealed.values() if v == "sealed")
        line += f"; manifest: {n_ok} sealed as they are, {len(sealed) - n_ok} changed or unsealed"
        line += f", {len(gone or [])} sealed file(s) gone (verify DIR checks the bytes)"
    line += f"; {len(rows) / elapsed:.0f} files/s" if elapsed > 0 and rows else ""
    out.print(line, soft_wrap=True)
