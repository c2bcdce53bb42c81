"""``slotfile identify FILE... --models PATH...``: rank candidate models for each slot file.

JSON (``--json``), schema ``slotfile.identify/1``::

    {"schema": "slotfile.identify/1", "models": [str],
     "files": [{"path", "verdict": "identified"|"likely"|"ambiguous"|"none"|"error",
                "model": str | null, "proof": "identical"|"within-noise" | null,
                "ranking": [{"model", "name", "arch", "fingerprint", "fit": "fits"|"unknown"|"no-fit",
                             "reasons": [str], "proof": "identical"|"within-noise"|"not-proven"|"differs"|"not-run",
                             "proof_message", "angle", "lnorm", "rows", "layers": [...], "seconds"}],
                "error": str | null}],
     "errors": [str], "seconds": float, "exit_code": 0 | 4 | 8}

Exit codes: 0 every file is identified (or fits a candidate that cannot be proven here:
``likely``); 4 a file that no candidate fits, or two candidates proven alike (``ambiguous``);
8 a file or a model path cannot be read; 2 usage.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotfile.cli.common import fail
from slotfile.cli.terminal import escape_text
from slotfile.exitcodes import OK, OPERATIONAL, PROBLEMS
from slotfile.seal.identify import Identification, IdentifyError, IdentifyOptions, collect_models, identify

SCHEMA = "slotfile.identify/1"


@dataclass(frozen=True, slots=True)
class IdentifyArgs:
    """``slotfile identify``'s command line."""

    files: tuple[Path, ...]
    models: tuple[Path, ...]
    proof: bool = True
    timeout: float = 300.0
    llama_lib: Path | None = None
    json_out: bool = False
    quiet: bool = False

    def options(self) -> IdentifyOptions:
        return IdentifyOptions(
            timeout=self.timeout, llama_lib=str(self.llama_lib) if self.llama_lib else None, prove=self.proof
        )


def run_identify(args: IdentifyArgs) -> int:
    files, models, opts, json_out, quiet = (
        list(args.files),
        list(args.models),
        args.options(),
        args.json_out,
        args.quiet,
    )
    t0 = time.monotonic()
    try:
        candidates = collect_models(models)
    except IdentifyError as e:
        fail(str(e), "identify")
        return OPERATIONAL
    from slotfile.seal.manifest import collect_slot_files

    paths, errors = collect_slot_files(files)
    results = identify(paths, candidates, opts)
    errors += [r.error for r in results if r.error is not None]
    for line in errors:
        fail(line, "identify")
    bad = [r for r in results if r.verdict in ("none", "ambiguous")]
    rc = OPERATIONAL if errors else (PROBLEMS if bad else OK)
    if json_out:
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "models": candidates,
            "files": [r.to_dict() for r in results],
            "errors": errors,
            "seconds": round(time.monotonic() - t0, 4),
            "exit_code": rc,
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _render(results, quiet)
    return rc


def _render(results: list[Identification], quiet: bool) -> None:
    from slotfile.cli.common import out_console

    out = out_console()

    for ident in results:
        if ident.error is not None:
            continue
        b = ident.best
        if b is not None:
            head = f"{ident.path}: {b.model.label} ({b.model.path}), {b.proof}: {b.proof_message}"
        elif ident.verdict == "likely":
            top = ident.ranking[0]
            head = f"{ident.path}: likely {top.model.label} (fits; not proven: {top.proof_message or top.proof})"
        else:
            head = f"{ident.path}: no candidate model fits"
        if ident.verdict == "ambiguous":
            m1, m2 = ident.ranking[0].model.label, ident.ranking[1].model.label
            head = f"{ident.path}: ambiguous: {m1} and {m2} prove alike"
        out.print(escape_text(head), soft_wrap=True)
        if quiet:
            continue
        for i, r in enumerate(ident.ranking, start=1):
            ang = f", worst head {r.angle:.3g} deg" if r.angle is not None else ""
            why = f": {r.reasons[0]}" if r.fit.value == "no-fit" and r.reasons else ""
            proof = "" if r.fit.value == "no-fit" else f", {r.proof}{ang}"
            out.print(escape_text(f"  {i}. {r.model.label} ({r.model.path}): {r.fit}{why}{proof}"), soft_wrap=True)
