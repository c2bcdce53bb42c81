"""``slotfile dump``: every field with its byte offset (gguf_dump style)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotfile.cli.common import exit_code, load_model_or_report, open_or_report
from slotfile.cli.terminal import escape_text
from slotfile.exitcodes import OPERATIONAL
from slotfile.report import to_json


@dataclass(frozen=True, slots=True)
class DumpArgs:
    """``slotfile dump``'s command line."""

    file: Path
    json_out: bool = False
    tokens: bool = False
    model: Path | None = None


def run_dump(args: DumpArgs) -> int:
    model, ok = load_model_or_report(args.model)
    if not ok:
        return OPERATIONAL
    sf = open_or_report(args.file, model)
    if sf is None:
        return OPERATIONAL
    text = model.detokenize(sf.tokens.tokens) if model is not None and sf.tokens is not None else None
    doc = to_json(sf, with_tokens=args.tokens, text=text, model_path=str(args.model) if args.model else None)
    if args.json_out:
        json.dump(doc, sys.stdout, indent=1, ensure_ascii=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.writelines(text_lines(doc))
    return exit_code([sf])


def text_lines(doc: dict[str, Any]) -> Iterator[str]:
    """The text form: every field in file order (sorted by offset), then each problem with its
    offset and message, then the verdict."""
    # sorted() is stable: a section's own line stays before the fields that share its offset
    for offset, name, value in sorted(_fields(doc), key=lambda f: (f[0] is None, f[0] or 0)):
        yield _line(offset, name, escape_text(str(value), 200))
    for i, p in enumerate(doc["problems"]):
        # never capped: one problem, one whole line (people grep for these)
        yield _line(
            p["offset"], f"problems[{i}]", escape_text(f"{p['severity']} {p['code']}: {p['section']}: {p['message']}")
        )
    yield _line(None, "verdict", escape_text(str(doc["verdict"])))
    if doc.get("cause"):
        yield _line(None, "cause", escape_text(str(doc["cause"])))
    if doc.get("next_step"):
        step = doc["next_step"] + (f": {doc['repair_command']}" if doc.get("repair_command") else "")
        yield _line(None, "next_step", escape_text(step))


def _line(offset: int | None, name: str, value: str) -> str:
    where = "" if offset is None else str(offset)
    return f"{where:>12}  {name:<64} {value}\n"


def _fields(node: Any, name: str = "") -> Iterator[tuple[int, str, Any]]:
    """Flatten the JSON form to (offset, dotted name, value) lines, in file order per section."""
    if isinstance(node, dict):
        if set(node) == {"offset", "value"}:
            yield node["offset"], name, node["value"]
            return
        if "offset" in node and name:
            desc = ", ".join(
                f"{k}={node[k]}"
                for k in ("size", "length", "type", "row_size", "role", "layout")
                if k in node and not isinstance(node[k], (dict, list))
            )
            yield node["offset"], name, desc
        for k, v in node.items():
            if k in ("offset", "sections") or (not name and k in ("file", "schema", "problems")):
                continue
            if isinstance(v, (dict, list)):
                yield from _fields(v, f"{name}.{k}" if name else k)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _fields(v, f"{name}[{i}]")
