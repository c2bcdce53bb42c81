"""slotfile: inspect, verify and repair llama.cpp slot save files.

The library entry point is :func:`slotfile.format.reader.open_slot_file`; it is imported lazily so
that ``import slotfile`` (and ``slotfile --version``) stays cheap.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "open_slot_file", "parse_buffer"]


def __getattr__(name: str) -> Any:
    if name in ("open_slot_file", "parse_buffer"):
        from slotfile.format import reader

        return getattr(reader, name)
    raise AttributeError(name)
