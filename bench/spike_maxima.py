"""The clean maxima the isolated-spike limits come from (slotfile/verify/spikes.py ``CLEAN_MAX``,
``CLEAN_MAX_SCALED``): each clean file's layers against its first recompute, the worst ratio per
kind (K, V, R/S, quantized blocks; exact contexts apart) in each of the rule's two views.

``capture``: verify each clean real-server file (its ``.json`` sidecar names the model) with
``--deep`` and keep a copy of the first recompute, the state the spike rule judges against
(``slotfile.verify.deep._judge_deep`` is wrapped for that: the worker writes it to a scratch file).
``maxima``: the worst ratios over the captured files, offline (seconds per file).

    python bench/spike_maxima.py capture --cache /tmp/spikes ~/.cache/slotfile/corpus/v4-cuda/*.bin
    python bench/spike_maxima.py maxima --cache /tmp/spikes
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
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

    def keep(lv: Any, body: Any, run: Any, res: Any, caches: Any, retry: Any) -> None:
        out = cache / f"{current['tag']}.rec"
        if not out.exists():
            shutil.copy(res.recomputed, out)
            heads = {role: {"K": c.head_k, "V": c.head_v} for role, c in caches.items()}
            (cache / f"{current['tag']}.json").write_text(json.dumps({"file": current["file"], "heads": heads}))
        judge(lv, body, run, res, caches, retry)

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


def maxima(cache: Path, top: int = 3) -> dict[str, list[tuple[float, str]]]:
    """Per view and kind, the ``top`` worst ratios over the captured files (a ratio, where)."""
    found: dict[str, list[tuple[float, str]]] = {}
    for scaled in (False, True):
        _views(scaled)
        for rec_path in sorted(cache.glob("*.rec")):
            meta = json.loads(rec_path.with_suffix(".json").read_text())
            if not Path(meta["file"]).is_file():
                print(f"skipped {rec_path.stem}: no {meta['file']}", file=sys.stderr)
                continue
            sf, rec = open_slot_file(meta["file"]), open_slot_file(rec_path)
            for fb, rb in zip(sf.body.blocks, rec.body.blocks, strict=False):  # type: ignore[union-attr]
                for sec, fr, rr, pos in layer_pairs(fb, rb):
                    if fr is None or rr is None:
                        continue
                    head = meta["heads"].get(fb.role, {}).get(fr.part, 0)
                    sp = spikes.find_spike(fr, rr, head, align_cells(pos, _stream_positions(rb, sec)))
                    if sp is None or sp.scaled is not scaled:
                        continue
                    kind = "quantized" if sp.block > 1 else fr.part if fr.part in ("K", "V") else "rec"
                    key = f"{'scaled ' if scaled else ''}{kind}{' exact' if sp.exact else ''}"
                    where = f"{rec_path.stem} {fb.role} {fr.part} layer {fr.index} cell {sp.cell} element {sp.element}"
                    found.setdefault(key, []).append((round(sp.ratio, 3), where))
    return {k: sorted(v, reverse=True)[:top] for k, v in sorted(found.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("capture", "maxima"))
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("files", nargs="*", type=Path)
    a = ap.parse_args()
    if a.what == "capture":
        capture(a.files, a.cache)
    else:
        print(json.dumps(maxima(a.cache), indent=1))


if __name__ == "__main__":
    main()
