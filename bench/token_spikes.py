"""What clean files and token-changed copies show to the cross-build changed-token rule
(slotfile/verify/shape.py ``spiked_tokens``, ``TOKEN_SPIKE``): verify each file with ``--deep``
and record, for every recompute, the rule's view of each position no first layer holds
(``spike_scores``: V at the position and K at the next one, in floors and in times their
background, and how far the positions after it stay).

``--copies N`` also writes N copies of each file with one stored token replaced by another id
the file holds, at a seeded position before the first layer's window (the positions the rule
is for), and captures them with the position recorded.

    python bench/token_spikes.py --out /tmp/spikes.json --copies 1 --seed 12 DIR/g-*long*.bin
    python bench/token_spikes.py --report /tmp/spikes.json

The report gives, for clean files, the positions that meet every condition but the ratio and
the largest ratio among them (the rule's clean margin), and the nearest misses of the other
conditions; for the copies, each one's ratio and verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _views(j: Any, first_block: str | None) -> list[dict[str, Any]]:
    """The rule's view of one judgment: per block other than the first layer's, the positions
    whose V and K (next) are over the limit, with their scores."""
    from slotfile.verify import shape

    held, lowest = shape.lowest_layers(j, first_block)
    out = []
    for block, k, v in lowest:
        s = shape.spike_scores(k, v, held)
        over = (s["v_at"] > shape.MARGIN_LIMIT) & (s["k_next"] > shape.MARGIN_LIMIT)
        back = 2 * np.nan_to_num(s["after"]) <= np.minimum(s["v_at"], s["k_next"])
        times = np.minimum(s["v_times"], s["k_times"])
        floor = shape.token_spike_rule(True)[0]
        floors = (s["v_at"] > floor) & (s["k_next"] > floor)
        out.append(
            {
                "block": block,
                "positions": int(s["p"].size),
                # every position over the limit: its ratio, and whether the later positions come back
                "over": [
                    {
                        "p": int(s["p"][i]),
                        "times": float(times[i]),
                        "back": bool(back[i]),
                        "v_at": float(s["v_at"][i]),
                        "k_next": float(s["k_next"][i]),
                        "after": float(s["after"][i]),
                    }
                    for i in np.flatnonzero(over)
                ],
                "max_times_back": float(times[back].max()) if bool(back.any()) else 0.0,
                # the low-bit K rule's view (TOKEN_SPIKE_LOW_BIT): over the floors, coming back
                "over_floors": [
                    {
                        "p": int(s["p"][i]),
                        "times": float(times[i]),
                        "v_at": float(s["v_at"][i]),
                        "k_next": float(s["k_next"][i]),
                        "after": float(s["after"][i]),
                    }
                    for i in np.flatnonzero(floors & back)
                ],
            }
        )
    return out


def _copy_with_token(src: Path, dest: Path, rng: np.random.Generator) -> dict[str, Any] | None:
    """``src`` with one stored token, before the first layer's window, replaced (None: no such
    position): the window holds the last ``n_swa + 512`` cells at most (Gemma 3: 1,024)."""
    from slotfile.format.reader import open_slot_file

    sf = open_slot_file(src)
    try:
        tp = sf.tokens
        if tp is None or tp.tokens.size < 1200:
            return None
        n = int(tp.tokens.size)
        p = int(rng.integers(40, n - 1100))
        ids = np.unique(tp.tokens[tp.tokens >= 0])
        old = int(tp.tokens[p])
        new = int(ids[(int(np.searchsorted(ids, old)) + 1 + int(rng.integers(ids.size - 1))) % ids.size])
        off = tp.ids_offset + 4 * p
    finally:
        sf.close()
    data = bytearray(src.read_bytes())
    data[off : off + 4] = np.int32(new).tobytes()
    dest.write_bytes(bytes(data))
    return {"position": p, "old": old, "new": new, "source": str(src)}


def capture(files: list[Path], out: Path, model: str | None, copies: int, seed: int) -> None:
    """Verify each file (and its token-changed copies) with --deep, recording the rule's view of
    every recompute's judgment."""
    from bench.detect import default_v4_lib
    from slotfile.verify import Verifier, VerifyOptions, shape

    rows: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    current: list[list[dict[str, Any]]] = []
    real = shape.judge_layers

    def spy(file_body: Any, body: Any, inputs: Any, *a: Any, **k: Any) -> Any:
        j = real(file_body, body, inputs, *a, **k)
        current.append(_views(j, shape.first_layer_block(inputs.caches)))
        return j

    shape.judge_layers = spy  # type: ignore[assignment]
    rng = np.random.default_rng(seed)
    tmp = Path(tempfile.mkdtemp(prefix="token-spikes-"))
    todo: list[tuple[Path, Path, dict[str, Any] | None]] = []
    for f in files:
        todo.append((f, f, None))
        for c in range(copies):
            dest = tmp / f"{f.stem}__token{c}.bin"
            made = _copy_with_token(f, dest, rng)
            if made is not None:
                todo.append((f, dest, made))
    groups: dict[tuple[str, int], list[tuple[Path, dict[str, Any] | None]]] = {}
    for src, f, made in todo:
        if f"{f}" in rows:
            continue
        sidecar = Path(f"{src}.json")
        side: dict[str, Any] = (
            json.loads(sidecar.read_text()) if sidecar.exists() else {"model_path": model, "state_version": 3}
        )
        groups.setdefault((side["model_path"], side["state_version"]), []).append((f, made))
    for (mpath, version), fs in groups.items():
        lib = default_v4_lib() if version == 4 else None
        with Verifier(VerifyOptions(model=mpath, deep=True, llama_lib=lib)) as v:
            for f, made in fs:
                current.clear()
                d = v.verify(f).levels["deep"]
                rows[str(f)] = {
                    "status": d.status,
                    "decided_by": (d.details or {}).get("decided_by"),
                    "changed": made,
                    "recomputes": current[:],
                }
                print(f.name, d.status, rows[str(f)]["decided_by"], made and made["position"], flush=True)
                out.write_text(json.dumps(rows))


def report(paths: list[Path]) -> None:
    """The clean margin and each copy's ratio (markdown)."""
    from slotfile.verify.shape import TOKEN_SPIKE, TOKEN_SPIKE_LOW_BIT

    clean = [(f, r) for p in paths for f, r in json.loads(p.read_text()).items() if not r["changed"]]
    made = [(f, r) for p in paths for f, r in json.loads(p.read_text()).items() if r["changed"]]
    views = [v for _, r in clean for rec in r["recomputes"] for v in rec]
    over = [o for v in views for o in v["over"]]
    print(f"Clean: {len(clean)} files, {sum(len(r['recomputes']) for _, r in clean)} recomputes, ", end="")
    print(f"{sum(v['positions'] for v in views)} positions no first layer holds.")
    print(f"- over the limit in V and in K at the next position: {len(over)}", end="")
    print(f", of them coming back after: {sum(o['back'] for o in over)}")
    worst = max((o["times"] for o in over if o["back"]), default=0.0)
    print(f"- the largest ratio where every other condition holds: {worst:.3g} (rule: {TOKEN_SPIKE:g})")
    loose = max((v["max_times_back"] for v in views), default=0.0)
    print(f"- without the limit, the largest ratio coming back: {loose:.3g}")

    low = [o for v in views for o in v.get("over_floors", [])]
    top = max(low, key=lambda o: o["times"], default=None)
    print(f"- over their floors (the low-bit K rule) and coming back: {len(low)}", end="")
    print(f", the largest ratio {top['times']:.3g} at {top['p']} (rule: {TOKEN_SPIKE_LOW_BIT:g})" if top else "")

    def back_ratio(o: dict[str, Any]) -> float:
        return min(o["v_at"], o["k_next"]) / max(2 * o["after"], 1e-9)

    for o in sorted((o for o in over if not o["back"]), key=back_ratio, reverse=True)[:3]:
        print(
            f"  - nearest not coming back: position {o['p']}, V {o['v_at']:.3g}, K next {o['k_next']:.3g}, "
            f"after {o['after']:.3g} ({back_ratio(o):.2f} of the way)"
        )
    print("\n| copy | position | V at it | K at the next | times the background | comes back | deep |")
    print("|---|---:|---:|---:|---:|---|---|")
    for f, r in made:
        p = r["changed"]["position"]
        at = [o for rec in r["recomputes"] for v in rec for o in v["over"] if o["p"] == p]
        if len(at) < len(r["recomputes"]):  # under the limit: the low-bit K rule's view
            floors = [o for rec in r["recomputes"] for v in rec for o in v.get("over_floors", [])]
            at = [dict(o, back=True) for o in floors if o["p"] == p]
        low = min(at, key=lambda o: o["times"]) if len(at) == len(r["recomputes"]) else None
        cells = (
            f"{low['v_at']:.3g} | {low['k_next']:.3g} | {low['times']:.3g} | {'yes' if low['back'] else 'no'}"
            if low
            else "under the floors or not coming back in a recompute | | |"
        )
        print(f"| {Path(f).name} | {p} | {cells} | {r['status']} ({r['decided_by']}) |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, help="capture into this JSON (resumes: files already in it are skipped)")
    ap.add_argument("--model", help="the model of files without a .json sidecar (version 3)")
    ap.add_argument("--copies", type=int, default=0, help="token-changed copies of each file")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--report", type=Path, action="append", default=[], help="report on captured JSON files")
    ns = ap.parse_args(argv)
    if ns.out:
        capture(ns.files, ns.out, ns.model, ns.copies, ns.seed)
    if ns.report:
        report(ns.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
