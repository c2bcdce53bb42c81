"""Text for a terminal: escaping what comes from a file, and the small formats the commands share."""

from __future__ import annotations

import re

from slotfile.problems import Problem
from slotfile.text import count  # noqa: F401  (re-exported: the CLI modules take it from here)

# what escape_text rewrites: a text without any of it is printed as it is
# (and lone surrogates: a file name that is not UTF-8 arrives with each undecodable byte as
# U+DC80..U+DCFF, Python's surrogateescape; printed raw they would be those bytes again)
_NEEDS_ESCAPE = re.compile(r"[\\\x00-\x1f\x7f-\x9f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def escape_text(text: str, limit: int | None = None) -> str:
    """Printable form of text taken from a file: control characters escaped, length capped."""
    if not _NEEDS_ESCAPE.search(text):
        return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"
    out = []
    for ch in text:
        o = ord(ch)
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\\":
            out.append("\\\\")
        elif 0xDC80 <= o <= 0xDCFF:  # an undecodable byte of a name: shown as that byte
            out.append(f"\\x{o - 0xDC00:02x}")
        elif _NEEDS_ESCAPE.match(ch):
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")
        else:
            out.append(ch)
    s = "".join(out)
    if limit is not None and len(s) > limit:
        s = s[: limit - 1] + "…"
    return s


def human_size(n: int) -> str:
    """1536 -> '1.5 KiB'; bytes below 1 KiB stay exact."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def problem_line(level: str, p: Problem) -> str:
    """'<level>: <section> at offset <o>: <message>', the form verify's first_problem has."""
    return f"{level}: {p.where()}{p.message}"
