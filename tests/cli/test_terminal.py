"""The CLI's text helpers: escaping what comes from a file, sizes, problem lines."""

from __future__ import annotations

import io
import os
from dataclasses import replace

from slotfile.cli.terminal import count, escape_text, human_size, problem_line
from slotfile.problems import Problem, ProblemCode, Severity


def test_escape_text():
    assert escape_text("a\x1b[31mb\nc\u202e") == "a\\x1b[31mb\\nc\\u202e"
    assert escape_text("tab\there \\ back") == "tab\\there \\\\ back"
    assert len(escape_text("x" * 500, 100)) == 100 and escape_text("x" * 500, 100).endswith("…")


def test_human_size():
    assert [human_size(n) for n in (0, 1023, 1024, 1536, 5 * 2**20, 3 * 2**30, 2**42)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 GiB",
        "4096.0 GiB",
    ]


def test_problem_line():
    p = Problem(Severity.ERROR, ProblemCode.TRUNCATED, "body", 244, "cut")
    assert problem_line("structure", p) == "structure: body at offset 244: cut"
    assert problem_line("load", replace(p, offset=None)) == "load: body: cut"
    assert problem_line("load", replace(p, section="", offset=None)) == "load: cut"


def test_escape_text_shows_the_bytes_of_a_name_that_is_not_utf8():
    name = os.fsdecode(b"bad\xff\xfe.slot")  # surrogateescape: U+DCFF U+DCFE
    assert escape_text(name) == "bad\\xff\\xfe.slot"
    assert escape_text("x\ud800y") == "x\\ud800y"  # any other lone surrogate: its code point
    assert escape_text(name).encode("ascii")  # printable anywhere


def test_count():
    assert [count(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    assert count(1, "entry", "entries") == "1 entry" and count(3, "entry", "entries") == "3 entries"


def test_print_rows_puts_a_name_that_would_reach_the_edge_on_its_own_line():
    from rich.console import Console

    from slotfile.cli.listing import Row, print_rows

    buf = io.StringIO()
    out = Console(file=buf, width=200, highlight=False, markup=False, soft_wrap=False)
    long = "x" * 50 + "\x1b.slot"
    rows = [Row(("ok", "1 B", "a.slot"), details=(("", "a word " * 12),)), Row(("ok", "2 B", long))]
    print_rows(out, ("verdict", "size", "file"), rows, 60, right=("size",))
    lines = buf.getvalue().splitlines()
    assert lines[0] == "verdict  size  file"
    assert lines[1] == "ok        1 B  a.slot"
    assert lines[2].startswith("    a word") and lines[3].startswith("      a word")
    assert all(len(ln) < 60 for ln in lines[2:4])
    assert lines[-2] == "ok        2 B" and lines[-1] == "    " + "x" * 50 + "\\x1b.slot"
    buf.seek(0)
    buf.truncate(0)
    print_rows(out, ("verdict", "size", "file"), [], 60)  # no rows: the header alone
    assert buf.getvalue() == "verdict  size  file\n"
