"""``slotfile seal PATH... [-o MANIFEST] [--model M.gguf]``: write a checksum manifest.

JSON (``--json``), schema ``slotfile.seal/1``::

    {"schema": "slotfile.seal/1", "manifest": str, "written": bool, "files": int,
     "added": [rel], "changed": [rel], "unchanged": [rel], "removed": [rel], "forced": [rel],
     "refused": [{"path", "reason"}], "errors": [str], "bytes_hashed": int, "seconds": float,
     "exit_code": 0 | 4 | 8}

Exit codes: 0 every file sealed; 4 a file failed verification and was left out (without
--force); 8 a path, the model or an --update's manifest cannot be read; 2 usage (the manifest
exists without --update/--force, a file outside the manifest's directory).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from slotfile.cli.common import fail
from slotfile.cli.terminal import count, escape_text, human_size
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS, USAGE
from slotfile.seal.build import SealError, SealOptions, SealResult, SealUsage, seal
from slotfile.seal.manifest import ManifestError


@dataclass(frozen=True, slots=True)
class SealArgs:
    """``slotfile seal``'s command line."""

    paths: tuple[Path, ...]
    output: Path | None = None
    model: Path | None = None
    draft_model: Path | None = None
    deep: bool = False
    force: bool = False
    update: bool = False
    jobs: int = 1
    timeout: float = 300.0
    llama_lib: Path | None = None
    json_out: bool = False
    quiet: bool = False

    def options(self) -> SealOptions:
        return SealOptions(
            output=self.output,
            model=str(self.model) if self.model else None,
            draft_model=str(self.draft_model) if self.draft_model else None,
            deep=self.deep,
            force=self.force,
            update=self.update,
            jobs=self.jobs,
            timeout=self.timeout,
            llama_lib=str(self.llama_lib) if self.llama_lib else None,
        )


def run_seal(args: SealArgs) -> int:
    opts, json_out, quiet = args.options(), args.json_out, args.quiet
    if opts.jobs < 1:
        fail("--jobs must be at least 1", "seal")
        return USAGE
    if opts.deep and opts.model is None:
        fail("--deep needs --model", "seal")
        return USAGE
    if opts.draft_model is not None and opts.model is None:
        fail("--draft-model needs --model", "seal")
        return USAGE
    if opts.update and opts.force:
        fail("give --update or --force, not both", "seal")
        return USAGE
    try:
        res = seal(list(args.paths), opts)
    except SealUsage as e:
        fail(str(e), "seal")
        return USAGE
    except (SealError, ManifestError) as e:
        fail(str(e), "seal")
        return OPERATIONAL
    except OSError as e:
        fail(f"{e.filename or ''}: {e.strerror or e}", "seal")
        return OPERATIONAL
    for line in res.errors:
        fail(line, "seal")
    rc = OPERATIONAL if res.errors else (PROBLEMS if res.refused else OK)
    if json_out:
        doc = res.to_dict()
        doc["exit_code"] = rc
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _render(res, quiet)
    return rc


def _render(res: SealResult, quiet: bool) -> None:
    from slotfile.cli.common import out_console

    out = out_console()

    if not quiet:
        for label, items in (("new", res.added), ("changed", res.changed), ("removed", res.removed)):
            for rel in items:
                out.print(escape_text(f"{label}: {rel}"), soft_wrap=True)
        for rel in res.forced:
            out.print(escape_text(f"sealed although it fails (--force): {rel}"), soft_wrap=True)
    for r in res.refused:
        out.print(escape_text(f"NOT sealed: {r.path}: {r.reason} (--force seals it with its verdict)"), soft_wrap=True)
    parts = [f"{count(len(res.manifest.entries), 'file')} sealed in {res.output}"]
    if res.unchanged or res.changed or res.removed:
        parts.append(
            f"{len(res.added)} new, {len(res.changed)} changed, {len(res.unchanged)} unchanged, "
            f"{len(res.removed)} removed"
        )
    if res.refused:
        parts.append(f"{len(res.refused)} refused")
    rate = res.bytes_hashed / res.seconds if res.seconds > 0 else 0.0
    parts.append(f"{human_size(res.bytes_hashed)} hashed in {res.seconds:.2f} s ({human_size(int(rate))}/s)")
    out.print(escape_text("; ".join(parts)), soft_wrap=True)
