"""The CLI's text helpers: escaping what comes from a file, sizes, problem lines."""

from __future__ import annotations

from dataclasses import replace

from slotfile.cli.terminal import escape_text, human_size, problem_line
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
