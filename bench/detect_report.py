"""The markdown tables of bench/detect.py's results (one JSON document: ``meta`` and ``files``).

    .venv/bin/python bench/detect_report.py bench/detect.json     # the tables again, from a results file

A case counts only on a file whose clean copy passed with the deep level run: damage in a file
that already fails, or that deep cannot recompute, says nothing about detection power.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPAN_KINDS = ("zero-span", "random-span")
FLIP_KINDS = ("flip-sign", "flip-exponent", "flip-mantissa", "flip-quant")


def judged(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The files whose clean copy passed with the deep level run."""
    return [r for r in records if r["clean"]["verdict"] == "pass" and r["clean"]["deep"] == "pass"]


def cases_of(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for r in records for c in r["cases"]]


def detected(c: dict[str, Any]) -> bool:
    return bool(c["verdict"] != "pass")


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3g}" if xs else "-"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.3g}%"


def _rate(n: int, k: int) -> str:
    return f"{k}/{n} ({100 * k / n:.0f}%)" if n else "-"


def _by_kind(cases: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cases:
        out.setdefault((c["kind"], c["size"]), []).append(c)
    return out


def kind_table(records: list[dict[str, Any]]) -> list[str]:
    """Per kind and size: detection rate, median margin, and the undetected cases' next-token logits."""
    good = judged(records)
    clean = {r["file"]: r["clean"].get("logits_rel") for r in records}
    na: dict[tuple[str, str], int] = {}
    for r in good:
        for x in r["not_applicable"]:
            na[(x["kind"], x["size"])] = na.get((x["kind"], x["size"]), 0) + 1
    lines = [
        "| damage | size | detected | median margin (floors) | undetected: max logits diff (its clean file's) | "
        "undetected: top token changed | files n/a |",
        "|---|---|---|---|---|---|---|",
    ]
    for (kind, size), cs in _by_kind(cases_of(good)).items():
        margins = [float(c["margin"]) for c in cs if c.get("margin") is not None]
        miss = [c for c in cs if not detected(c)]
        worst = max(miss, key=lambda c: float(c.get("logits_rel") or 0.0), default=None)
        lg = "-" if worst is None else f"{_pct(worst.get('logits_rel'))} ({_pct(clean.get(worst['file']))})"
        top = sum(1 for c in miss if c.get("top1_changed"))
        lines.append(
            f"| {kind} | {size if size == '-' else size + (' B' if size.isdigit() else '')} | "
            f"{_rate(len(cs), len(cs) - len(miss))} | {_med(margins)} | {lg} | "
            f"{f'{top}/{len(miss)}' if miss else '-'} | {na.get((kind, size), 0)} |"
        )
    return lines


BINS = ((0.0, 1.0, "<= 1x"), (1.0, 10.0, "1-10x"), (10.0, float("inf"), "> 10x"))


def _bin(c: dict[str, Any]) -> str:
    if c["noise"] <= 0:
        return "layer noise 0"
    r = c["delta"] / c["noise"]
    return next(name for lo, hi, name in BINS if lo < r <= hi or (lo == 0 and r <= hi))


def flip_table(records: list[dict[str, Any]]) -> list[str]:
    """Bit flips by how far the value moved against the layer's noise (the clean file's largest
    stored-vs-recomputed difference in that layer; 0 where the server's rows equal the recompute's)."""
    lines = [
        "| flip | change / layer noise | detected | undetected: median change | "
        "undetected: max logits diff (its clean file's) | undetected: top token changed | undetected bits |",
        "|---|---|---|---|---|---|---|",
    ]
    clean = {r["file"]: r["clean"].get("logits_rel") for r in records}
    for kind in FLIP_KINDS:
        cs = [c for c in cases_of(judged(records)) if c["kind"] == kind and c.get("noise") is not None]
        for name in ("layer noise 0", *(b[2] for b in BINS)):
            sel = [c for c in cs if _bin(c) == name]
            if not sel:
                continue
            miss = [c for c in sel if not detected(c)]
            worst = max(miss, key=lambda c: float(c.get("logits_rel") or 0.0), default=None)
            lg = "-" if worst is None else f"{_pct(worst.get('logits_rel'))} ({_pct(clean.get(worst['file']))})"
            top = f"{sum(1 for c in miss if c.get('top1_changed'))}/{len(miss)}" if miss else "-"
            bits = ", ".join(str(b) for b in sorted({int(c["bit"]) for c in miss})) or "-"
            lines.append(
                f"| {kind} | {name} | {_rate(len(sel), len(sel) - len(miss))} | "
                f"{_med([float(c['delta']) for c in miss])} | {lg} | {top} | {bits} |"
            )
    return lines


def _part(c: dict[str, Any]) -> str:
    """The part a case damaged, V with its layout (kv-swap and layer-swap: every part they moved)."""
    part = str(c.get("part"))
    if "V" in part.split("+"):
        return part.replace("V", "V transposed" if c.get("transposed") or c.get("v_transposed") else "V rows")
    return part


def coverage_table(records: list[dict[str, Any]]) -> list[str]:
    """Cases and detections by cache type, block and damaged part with its V layout (body damage only)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for c in cases_of(judged(records)):
        if c.get("region") == "body" and c.get("type") is not None:
            groups.setdefault((str(c["type"]), str(c.get("block")), _part(c)), []).append(c)
    lines = [
        "| type | block | damaged part | detected | of them spans >= 512 B, x2 rows, swaps: detected |",
        "|---|---|---|---|---|",
    ]
    for (t, blk, part), cs in sorted(groups.items()):
        strong = [c for c in cs if _strong(c)]
        lines.append(
            f"| {t} | {blk} | {part} | {_rate(len(cs), sum(map(detected, cs)))} | "
            f"{_rate(len(strong), sum(map(detected, strong)))} |"
        )
    return lines


def _strong(c: dict[str, Any]) -> bool:
    """Damage the issue expects every recompute to see: spans of 512 B and more, a row doubled, swaps."""
    if c["kind"] in SPAN_KINDS:
        return int(c["size"]) >= 512
    return c["kind"] in ("cell-swap", "kv-swap", "layer-swap") or (c["kind"], c["size"]) == ("row-scale", "x2")


def targets(records: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, each with what this run measured."""
    cs = cases_of(judged(records))

    def rate(sel: list[dict[str, Any]]) -> str:
        k = sum(map(detected, sel))
        return f"{_rate(len(sel), k)} {'met' if sel and k == len(sel) else ('**not met**' if sel else 'no cases')}"

    spans = [c for c in cs if c["kind"] in SPAN_KINDS and int(c["size"]) >= 512]
    flips = [c for c in cs if c["kind"] in FLIP_KINDS and c.get("noise") is not None and c["delta"] > c["noise"]]
    fa = [r for r in records if r["clean"]["verdict"] != "pass"]
    out = [
        f"* every span >= 512 B: {rate(spans)}",
        f"* every bit flip that moves a value more than the layer's noise: {rate(flips)}",
    ]
    for kind in ("kv-swap", "layer-swap", "cell-swap", "token", "ckpt-span"):
        out.append(f"* {kind}: {rate([c for c in cs if c['kind'] == kind])}")
    out.append(f"* false alarms on clean files: {len(fa)} of {len(records)} {'met' if not fa else '**not met**'}")
    return out


def clean_summary(records: list[dict[str, Any]]) -> list[str]:
    """The clean files: how many pass, the false alarms, those deep could not recompute."""
    fails = [r for r in records if r["clean"]["verdict"] != "pass"]
    skipped = [r for r in records if r["clean"]["verdict"] == "pass" and r["clean"]["deep"] != "pass"]
    margins = [float(r["clean"]["margin"]) for r in records if r["clean"].get("margin") is not None]
    out = [
        f"Clean files: {len(records)}, {len(records) - len(fails)} pass, {len(fails)} fail (false alarms); "
        f"margins median {_med(margins)}, max {max(margins) if margins else '-'} floors."
    ]
    out += [f"* false alarm: {Path(r['file']).name}: {r['clean']['first_problem']}" for r in fails]
    out += [f"* deep skipped (cases not counted): {Path(r['file']).name}: {r['clean']['deep_reason']}" for r in skipped]
    return out


def markdown(meta: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """Every table of one run, with what it ran on."""
    n_v = {v: sum(1 for r in records if r["version"] == v) for v in (3, 4)}
    n_o = {o: sum(1 for r in records if r["origin"] == o) for o in ("corpus", "fixture")}
    models = sorted({r["model"] for r in records})
    n_cases = len(cases_of(judged(records)))
    head = [
        f"Run {meta['date']}, slotfile {meta['commit']}, seed {meta['seed']}, {meta['cases_per_kind']} case(s) "
        f"per kind and size per file, {meta['seconds'] / 60:.1f} min: {len(records)} clean files "
        f"({n_o['corpus']} real-server corpus, {n_o['fixture']} committed fixtures with checkpoints; "
        f"{n_v[3]} state v3, {n_v[4]} v4; models {', '.join(models)}), {n_cases} damaged copies judged.",
        "",
    ]
    parts = [
        head,
        clean_summary(records),
        [""],
        kind_table(records),
        [""],
        flip_table(records),
        [""],
        coverage_table(records),
        ["", "Targets:"],
        targets(records),
    ]
    return "\n".join(line for p in parts for line in p) + "\n"


if __name__ == "__main__":
    doc = json.loads(Path(sys.argv[1]).read_text())
    print(markdown(doc["meta"], doc["files"]))
