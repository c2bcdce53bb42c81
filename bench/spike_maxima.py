"""The clean maxima the isolated-spike limits come from (slotfile/verify/spikes.py ``CLEAN_MAX``,
``CLEAN_MAX_SCALED``): each clean file's layers against its first recompute, the worst ratio per
kind (K, V, R/S, quantized blocks; exact contexts apart) in each of the rule's two views.

``capture``: verify each clean real-server file (its ``.json`` sidecar names the model) with
``--deep`` and keep a copy of the first recompute, the state the spike rule judges against
(``slotfile.verify.deep._judge_deep`` is wrapped for that: the worker writes it to a scratch file).
``maxima``: the worst ratios over the captured files, offline (seconds per file).
``layers``: per layer, its largest unit difference over the largest of every other unit of the
layer (what a limit on the whole layer, not the unit's neighbourhood, would have to allow), the
worst per kind where the unit moved more than ``EXACT_LIMIT`` storage steps.

    python bench/spike_maxima.py capture --cache /tmp/spikes ~/.cache/slotfile/corpus/v4-cuda/*.bin
    python bench/spike_maxima.py maxima --cache /tmp/spikes
    python bench/spike_maxima.py layers --cache /tmp/spikes --cache /tmp/spikes-v3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slotfile.format.reader import open_slot_file  # noqa: E402
from slotfile.verify import spikes  # noqa: E402
from slotfile.verify.judge import _stream_positions, align_cells, layer_pairs  # noqa: E402


def _tag(f: Path) -> str:
    return f"{f.parent.name}__{f.stem}"


def capture(files: list[Path], cache: Path) -> None:
    """Verify each file with --deep, copying its first recompute and the heads into ``cache``."""
    import slotfile.verify.deep as deep
    from bench.detect import default_v4_lib
    from slotfile.verify import Verifier, VerifyOptions

    cache.mkdir(parents=True, exist_ok=True)
    current: dict[str, str] = {}
    judge = deep._judge_deep

    def keep(lv: Any, body: Any, run: Any, res: Any, early: Any, retry: Any) -> None:
        out = cache / f"{current['tag']}.rec"
        if not out.exists():
            shutil.copy(res.recomputed, out)
            heads = {role: {"K": c.head_k, "V": c.head_v} for role, c in early.caches.items()}
            (cache / f"{current['tag']}.json").write_text(json.dumps({"file": current["file"], "heads": heads}))
        judge(lv, body, run, res, early, retry)

    deep._judge_deep = keep
    groups: dict[tuple[str, int], list[Path]] = {}
    for f in files:
        if not (cache / f"{_tag(f)}.rec").exists():
            side = json.loads(Path(f"{f}.json").read_text())
            groups.setdefault((side["model_path"], side["state_version"]), []).append(f)
    for (model, version), fs in groups.items():
        with Verifier(VerifyOptions(model=model, deep=True, llama_lib=default_v4_lib() if version == 4 else None)) as v:
            for f in fs:
                current.update(tag=_tag(f), file=str(f))
                d = v.verify(f).levels["deep"]
                print(_tag(f), d.status, (d.details or {}).get("decided_by"), flush=True)


def _views(scaled: bool) -> None:
    """Module limits under which find_spike returns every layer's worst unit in one view: its
    raw ratio, every threshold out of the way (exact contexts judged like the rest, flagged)."""
    big, tiny = 1e12, 1e-12
    spikes.SPIKE_MARGIN = tiny
    spikes.EXACT_LIMIT = spikes.EXACT_BLOCK_LIMIT = spikes.LAYER_EXACT_LIMIT = big
    spikes.CLEAN_MAX = dict.fromkeys(spikes.CLEAN_MAX, big if scaled else 1.0)
    spikes.CLEAN_MAX_SCALED = dict.fromkeys(("K", "V"), 1.0) if scaled else {}


def _captured(caches: list[Path]) -> Iterator[tuple[str, dict[str, Any], Any, Any, Any, Any]]:
    """Every layer pair of every captured file: (its tag, its metadata, the file's block, the
    file's run, the recomputed run, the recompute's cell for each of the file's cells)."""
    for cache in caches:
        for rec_path in sorted(cache.glob("*.rec")):
            meta = json.loads(rec_path.with_suffix(".json").read_text())
            if not Path(meta["file"]).is_file():
                print(f"skipped {rec_path.stem}: no {meta['file']}", file=sys.stderr)
                continue
            sf, rec = open_slot_file(meta["file"]), open_slot_file(rec_path)
            try:
                for fb, rb in zip(sf.body.blocks, rec.body.blocks, strict=False):  # type: ignore[union-attr]
                    for sec, fr, rr, pos in layer_pairs(fb, rb):
                        if fr is not None and rr is not None:
                            yield rec_path.stem, meta, fb, fr, rr, align_cells(pos, _stream_positions(rb, sec))
            finally:
                sf.close()
                rec.close()


def maxima(cache: Path, top: int = 3) -> dict[str, list[tuple[float, str]]]:
    """Per view and kind, the ``top`` worst ratios over the captured files (a ratio, where)."""
    found: dict[str, list[tuple[float, str]]] = {}
    for scaled in (False, True):
        _views(scaled)
        for tag, meta, fb, fr, rr, b_cells in _captured([cache]):
            sp = spikes.find_spike(fr, rr, meta["heads"].get(fb.role, {}).get(fr.part, 0), b_cells)
            if sp is None or sp.scaled is not scaled:
                continue
            key = f"{'scaled ' if scaled else ''}{spikes.spike_kind(fr)}{' exact' if sp.exact else ''}"
            where = f"{tag} {fb.role} {fr.part} layer {fr.index} cell {sp.cell} element {sp.element}"
            found.setdefault(key, []).append((round(sp.ratio, 3), where))
    return {k: sorted(v, reverse=True)[:top] for k, v in sorted(found.items())}


def _lone_in_layer(a: Any, b: Any, b_cells: Any) -> tuple[float, float, int, int] | None:
    """A layer's largest unit difference over the largest of every other unit, that unit's
    storage steps, its cell and unit (None: no difference or no such type)."""
    import numpy as np

    from slotfile.verify.stats import CHUNK_CELLS, FLOAT_TYPES

    n, t = a.n_cells, a.type_id
    if n == 0 or a.row_size == 0 or (t not in FLOAT_TYPES and t not in spikes._QMAX):
        return None
    top: list[tuple[float, float, int, int]] = []  # (difference, step, cell, unit): each chunk's two largest
    for c0 in range(0, n, CHUNK_CELLS):
        x, y = spikes._pair(a, b, c0, min(n, c0 + CHUNK_CELLS), b_cells)
        u, res = spikes.unit_diffs(x - y, t), spikes.resolution(y, t)
        flat = u.ravel()
        for i in np.argpartition(flat, -2)[-2:] if flat.size >= 2 else range(flat.size):
            c, k = np.unravel_index(int(i), u.shape)
            top.append((float(flat[i]), float(res[c, k]), int(c) + c0, int(k)))
    top.sort(reverse=True)
    if not top or top[0][0] == 0:
        return None
    d, step, c, k = top[0]
    rest = top[1][0] if len(top) > 1 else 0.0
    return d / max(rest, step), d / step, c, k


def layers(caches: list[Path], top: int = 3) -> dict[str, list[tuple[float, str]]]:
    """Per kind, the ``top`` worst whole-layer ratios (:func:`_lone_in_layer`) over the captured
    files whose unit moved more than ``EXACT_LIMIT`` storage steps."""
    found: dict[str, list[tuple[float, str]]] = {}
    for tag, _meta, fb, fr, rr, b_cells in _captured(caches):
        got = _lone_in_layer(fr, rr, b_cells)
        if got is None or got[1] <= spikes.EXACT_LIMIT:
            continue
        where = f"{tag} {fb.role} {fr.part} layer {fr.index} cell {got[2]} unit {got[3]}"
        found.setdefault(spikes.spike_kind(fr), []).append((round(got[0], 3), where))
    return {k: sorted(v, reverse=True)[:top] for k, v in sorted(found.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("capture", "maxima", "layers"))
    ap.add_argument("--cache", type=Path, action="append", required=True, help="repeat for layers")
    ap.add_argument("files", nargs="*", type=Path)
    a = ap.parse_intermixed_args()  # the files follow --cache
    if a.what == "layers":
        print(json.dumps(layers(a.cache), indent=1))
    elif len(a.cache) > 1:
        ap.error(f"{a.what} takes one --cache")
    elif a.what == "capture":
        capture(a.files, a.cache[0])
    else:
        print(json.dumps(maxima(a.cache[0]), indent=1))


if __name__ == "__main__":
    main()
