"""A JSON document on stdout exactly as ``json.dumps(doc, indent=2)`` writes it, at a fraction
of its cost, streamed.

With ``indent`` the standard library never uses its C encoder: every value goes through nested
Python generators (``json.encoder._make_iterencode``), about 200 generator steps per ``verify``
row; that was 15-20 % of ``ls DIR --json`` / ``verify DIR --json`` on 2,000 files.  Here each
container is one ``join`` of its encoded items (strings through the C ``encode_basestring_ascii``,
numbers through ``int.__repr__`` / ``float.__repr__``, as json does), and the document is written
a top-level key, and a list item, at a time.  A :class:`LazyList` stands for a list whose items
are made as they are written (a directory's rows: memory flat in the number of files).
``tests/test_scale_paths.py`` holds the text equal to ``json.dumps``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from json.encoder import encode_basestring_ascii as _string  # the C one where it exists, as json's
from typing import Any, TextIO

_INF = float("inf")
_CHUNK = 1 << 16  # characters written at once


class LazyList:
    """A JSON list whose items come from ``make()`` when it is written, once (a walk's rows
    read as it goes: how many there are is known only once they are written; the document's
    totals are counted from the rows)."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[], Iterable[Any]]) -> None:
        self._make = make

    def __iter__(self) -> Iterator[Any]:
        return iter(self._make())


class Later:
    """A top-level value of a document made when the writer reaches it: the summary after a
    streamed :class:`LazyList` of rows, counted as the rows were written."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


class Encoded(str):
    """An item of a top-level list already encoded (``encode(o, ITEM_INDENT)``: a forked
    worker's row), written as it is."""

    __slots__ = ()


ITEM_INDENT = "\n    "  # where an item of a top-level list starts


def _float(o: float) -> str:
    # json.encoder's floatstr with allow_nan=True
    if o != o:
        return "NaN"
    if o == _INF:
        return "Infinity"
    if o == -_INF:
        return "-Infinity"
    return float.__repr__(o)


def _key(k: Any) -> str:
    """A dict key as json writes it (str, float, bool, None and int keys; anything else is the
    TypeError json raises)."""
    if isinstance(k, str):
        return _string(k)
    if isinstance(k, float):
        return _string(_float(k))
    if k is True:
        return '"true"'
    if k is False:
        return '"false"'
    if k is None:
        return '"null"'
    if isinstance(k, int):
        return _string(int.__repr__(k))
    raise TypeError(f"keys must be str, int, float, bool or None, not {k.__class__.__name__}")


def encode(o: Any, nl: str = "\n") -> str:
    """``o`` as ``json.dumps(o, indent=2)`` writes it at the indentation ``nl`` (a newline and
    the spaces of the line ``o`` starts on).  The isinstance order is json's."""
    t = type(o)
    if t is str:
        return _string(o)
    if t is int:
        return int.__repr__(o)
    if o is None:
        return "null"
    if o is True:
        return "true"
    if o is False:
        return "false"
    if t is dict:
        if not o:
            return "{}"
        inner = nl + "  "
        # str keys and values inline (most of them): a verify row is ~45 values, and the calls
        # were half of its encoding
        items = [
            (_string(k) if type(k) is str else _key(k)) + ": " + (_string(v) if type(v) is str else encode(v, inner))
            for k, v in o.items()
        ]
        return "{" + inner + ("," + inner).join(items) + nl + "}"
    if t is list or t is tuple:
        if not o:
            return "[]"
        inner = nl + "  "
        items = [_string(v) if type(v) is str else encode(v, inner) for v in o]
        return "[" + inner + ("," + inner).join(items) + nl + "]"
    if t is float:
        return _float(o)
    return _other(o, nl)


def _other(o: Any, nl: str) -> str:
    """Subclasses (an enum of str or int) and floats, in json's order."""
    if isinstance(o, str):
        return _string(o)
    if isinstance(o, int):
        return int.__repr__(o)
    if isinstance(o, float):
        return _float(o)
    if isinstance(o, list | tuple | LazyList):
        return encode(list(o), nl)
    if isinstance(o, dict):
        return encode(dict(o), nl)
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


def write(doc: Any, out: TextIO) -> None:
    """``doc`` and a newline on ``out``, exactly as ``json.dumps(doc, indent=2) + "\\n"``, in
    pieces: each top-level value, and each item of a top-level list, encoded on its own."""
    buf: list[str] = []
    size = 0

    def put(s: str) -> None:
        nonlocal size
        buf.append(s)
        size += len(s)
        if size >= _CHUNK:
            out.write("".join(buf))
            buf.clear()
            size = 0

    if type(doc) is not dict or not doc:
        put(encode(doc))
    else:
        put("{")
        for i, (k, v) in enumerate(doc.items()):
            put(("\n  " if i == 0 else ",\n  ") + _key(k) + ": ")
            if type(v) is Later:
                v = v.make()
            if isinstance(v, list | tuple | LazyList) and not isinstance(v, str):
                _write_list(v, put)
            else:
                put(encode(v, "\n  "))
        put("\n}")
    buf.append("\n")
    out.write("".join(buf))


def _write_list(items: Iterable[Any], put: Callable[[str], None]) -> None:
    """A list one level in, an item at a time (a LazyList's items are made here)."""
    first = True
    for v in items:
        put(("[" if first else ",") + ITEM_INDENT + (v if type(v) is Encoded else encode(v, ITEM_INDENT)))
        first = False
    put("[]" if first else "\n  ]")
