"""Words for counts in messages, shared by the library's notes and the CLI's screens."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """1 -> '1 file', 2 -> '2 files' (``plural`` when adding an s is wrong: 'entries')."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
