"""What clean files show to the scaled-row rule (slotfile/verify/judge.py ``scaled_cell``,
``SCALED_STANDOUT``, ``SCALED_TURN``): verify each clean real-server file (its ``.json`` sidecar
names the model) with ``--deep`` and record, for every layer the rule looks at, its cell with the
largest head-norm difference: that ``|ln(norm ratio)|``, how many times the next cell's it is
(the standout), how far the cell's head turned (degrees, and the stretch over the turn in
radians), and whether the rule's other conditions (size, angle) hold there.

The limits must stay above what any clean file shows where those conditions hold; the report
gives the worst such layers.

    python bench/scaled_rows.py --out /tmp/scaled.json DIR/*.bin
    python bench/scaled_rows.py --report /tmp/scaled.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _row(cs: Any, floor: dict[str, float]) -> dict[str, Any] | None:
    """The rule's view of one layer: its top cell and what decides it (None: fewer than 2 cells)."""
    from slotfile.verify import judge

    if cs.lnorm.size < 2 or not np.all(np.isfinite(cs.lnorm)):
        return None
    c = int(np.argmax(cs.lnorm))
    top = float(cs.lnorm[c])
    second = float(np.partition(cs.lnorm, -2)[-2])
    others = np.delete(cs.angle, c)
    angle = float(cs.angle[c])
    return {
        "lnorm": top,
        "second": second,
        "standout": top / max(second, 1e-12),
        "angle": angle,
        "stretch_over_turn": top / max(math.radians(angle), 1e-12),
        "big": top >= max(judge.SCALED_MIN_LNORM, judge.MARGIN_LIMIT * floor["lnorm"]),
        "angle_ok": angle <= max(float(others.max()), judge.MARGIN_LIMIT * floor["angle"]),
        "floor_lnorm": floor["lnorm"],
    }


def capture(files: list[Path], out: Path, model: str | None = None) -> None:
    """Verify each file with --deep, recording every scaled_cell call's layer view.  ``model``: for
    files without a sidecar (a version-3 file then, verified with the installed loader)."""
    from bench.detect import default_v4_lib
    from slotfile.verify import Verifier, VerifyOptions, judge

    rows: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    current: list[dict[str, Any]] = []
    real = judge.scaled_cell

    def spy(cs: Any, floor: dict[str, float]) -> Any:
        r = _row(cs, floor)
        if r is not None:
            current.append(r)
        return real(cs, floor)

    judge.scaled_cell = spy  # type: ignore[assignment]
    groups: dict[tuple[str, int], list[Path]] = {}
    for f in files:
        if str(f) not in rows:
            sidecar = Path(f"{f}.json")
            side = json.loads(sidecar.read_text()) if sidecar.exists() else {"model_path": model, "state_version": 3}
            groups.setdefault((side["model_path"], side["state_version"]), []).append(f)
    for (model, version), fs in groups.items():
        lib = default_v4_lib() if version == 4 else None
        with Verifier(VerifyOptions(model=model, deep=True, llama_lib=lib)) as v:
            for f in fs:
                current.clear()
                d = v.verify(f).levels["deep"]
                rows[str(f)] = {
                    "status": d.status,
                    "decided_by": (d.details or {}).get("decided_by"),
                    "layers": current[:],
                }
                print(f.name, d.status, rows[str(f)]["decided_by"], len(current), flush=True)
                out.write_text(json.dumps(rows))


def report(paths: list[Path], top: int = 8) -> None:
    """The worst layers where the size and angle conditions hold, by standout and by stretch."""
    cand: list[tuple[dict[str, Any], str]] = []
    n = 0
    for p in paths:
        for f, r in json.loads(p.read_text()).items():
            n += 1
            cand += [(lay, Path(f).name) for lay in r["layers"] if lay["big"] and lay["angle_ok"]]
    print(f"{n} files; {len(cand)} layer judgments with a top cell big enough and no angle outlier")
    for key in ("standout", "stretch_over_turn"):
        print(f"worst by {key}:")
        for lay, f in sorted(cand, key=lambda t: -t[0][key])[:top]:
            print(
                f"  {lay[key]:8.3f}  {f}: |ln| {lay['lnorm']:.3f}, second {lay['second']:.3f}, "
                f"standout {lay['standout']:.2f}, angle {lay['angle']:.2f} deg, stretch/turn "
                f"{lay['stretch_over_turn']:.2f}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, help="capture into this JSON (resumes: files already in it are skipped)")
    ap.add_argument("--model", help="the model of files without a .json sidecar (version 3)")
    ap.add_argument("--report", type=Path, action="append", default=[], help="report on captured JSON files")
    ns = ap.parse_args(argv)
    if ns.out:
        capture(ns.files, ns.out, ns.model)
    if ns.report:
        report(ns.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
