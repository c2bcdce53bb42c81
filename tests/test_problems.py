"""The problem-code registry (slotfile/problems.py): every code raised anywhere is registered,
the classes are those the JSON reports had before the registry, and the README agrees."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from slotfile.format.records import FileFormat, SlotFile
from slotfile.problems import (
    REGISTRY,
    CheckLevel,
    Problem,
    ProblemClass,
    ProblemCode,
    Severity,
    cause_of,
    codes,
    info,
)

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "slotfile"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("problem_codes", ROOT / "scripts" / "problem_codes.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------
# the codes in the source
# ---------------------------------------------------------------------------------------


# where the code goes in each call that takes one: (name, number of positional args or None for
# any number from the index on, index of the code)
_CODE_ARG = {
    ("problem", None): 1,  # SlotFile.problem(severity, code, section, offset, message)
    ("Problem", None): 1,  # Problem(severity, code, ...)
    ("add", 5): 1,  # verify's Level.add(severity, code, section, offset, message)
    ("error", 4): 0,  # verify's Level.error(code, section, offset, message)
    ("warn", 4): 0,  # verify's Level.warn(code, section, offset, message)
    ("Failure", 5): 2,  # layout's Failure(offset, message, code, loc, layout)
    ("FormatError", None): 2,  # FormatError(message, offset, code, loc)
    ("cause_of", None): 0,  # cause_of(code, severity)
    ("ProblemCode", 1): 0,  # ProblemCode("...")
}

# where the severity goes, in the same manner
_SEVERITY_ARG = {
    ("problem", None): 0,
    ("Problem", None): 0,
    ("add", 5): 0,
    ("cause_of", None): 1,
}


def _code_args(call: ast.Call) -> list[ast.expr]:
    """The arguments of ``call`` that carry a problem code, by the shape of the call."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    out = [k.value for k in call.keywords if k.arg == "code"]
    i = _CODE_ARG.get((name, len(call.args)), _CODE_ARG.get((name, None)))
    if i is not None and i < len(call.args):
        out.append(call.args[i])
    return out


def _severity_args(call: ast.Call) -> list[ast.expr]:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    out = [k.value for k in call.keywords if k.arg == "severity"]
    i = _SEVERITY_ARG.get((name, len(call.args)), _SEVERITY_ARG.get((name, None)))
    if i is not None and i < len(call.args):
        out.append(call.args[i])
    return out


def _strings(node: ast.expr, consts: dict[str, str]) -> list[str]:
    """The string literals ``node`` can evaluate to (both arms of a conditional, a module
    constant by name); [] for anything computed (a FormatError's code, a variable)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _strings(node.body, consts) + _strings(node.orelse, consts)
    if isinstance(node, ast.Name) and node.id in consts:
        return [consts[node.id]]
    return []


def _is_code(node: ast.expr) -> bool:
    """``x.code`` or ``x["code"]``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "code"
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "code"


def source_codes(root: Path = PKG, skip: Path | None = None) -> tuple[dict[str, list[str]], set[str]]:
    """(every code literal passed where a problem code goes, with where; every ProblemCode.X named)."""
    literals, members, _ = source_scan(root, skip)
    return literals, members


def source_scan(
    root: Path = PKG, skip: Path | None = None
) -> tuple[dict[str, list[str]], set[str], dict[str, list[str]]]:
    """:func:`source_codes`, and every string literal passed where a severity goes, with where."""
    literals: dict[str, list[str]] = {}
    members: set[str] = set()
    severities: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path == skip:
            continue
        tree = ast.parse(path.read_text(), str(path))
        consts = {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for arg in _code_args(node):
                    for s in _strings(arg, consts):
                        literals.setdefault(s, []).append(f"{path.name}:{node.lineno}")
                for arg in _severity_args(node):
                    for s in _strings(arg, consts):
                        severities.setdefault(s, []).append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Compare) and any(_is_code(x) for x in [node.left, *node.comparators]):
                for x in [node.left, *node.comparators]:  # f.code == "truncated", p["code"] == "deep-rotation"
                    for s in _strings(x, {}):
                        literals.setdefault(s, []).append(f"{path.name}:{node.lineno}")
            elif (
                isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ProblemCode"
            ):
                members.add(node.attr)
    return literals, members, severities


def test_every_code_in_the_source_is_a_registered_member():
    """Problems are raised with ProblemCode and Severity members, never bare strings (mypy
    enforces it for the typed parameters; this scan also covers comparisons and keywords)."""
    literals, members, severities = source_scan()
    # the scan sees the reader's, verify's and the grammar's codes
    assert len(members) >= 40, sorted(members)
    assert not literals, f"bare-string problem codes (use ProblemCode members): {literals}"
    assert not severities, f"bare-string severities (use Severity members): {severities}"
    unknown = sorted(m for m in members if m not in ProblemCode.__members__)
    assert not unknown, f"ProblemCode members that do not exist: {unknown}"


def test_every_registered_code_is_raised_somewhere():
    literals, members = source_codes(skip=PKG / "problems.py")  # the registry names them all
    used = set(literals) | {str(ProblemCode[m]) for m in members if m in ProblemCode.__members__}
    assert set(ProblemCode) - used == set(), "registered but never raised"


def test_the_scan_finds_a_misspelt_code(tmp_path: Path):
    pkg = tmp_path / "slotfile"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        'CODE = "bad-magik"\n'
        "def f(sf, lv, ok):\n"
        '    sf.problem("error", CODE, "header", 0, "m")\n'
        '    lv.error("crashed" if ok else "load-faild", "body", None, "m")\n'
        '    raise FormatError("m", 0, code="over-capp")\n'
        "    sf.problem(Severity.WARNING, ProblemCode.K_ONLY, 'body', 0, 'm')\n"
        "    lv.warn(ProblemCode.TRUNKATED, 'body', None, 'm')\n"
        '    return [p for p in sf.problems if p.code == "trunkated" or p["code"] != "k-only"]\n'
    )
    literals, members, severities = source_scan(pkg)
    assert {"bad-magik", "load-faild", "over-capp", "crashed", "trunkated", "k-only"} <= set(literals)
    unknown = {c for c in literals if c not in set(ProblemCode)}
    assert unknown == {"bad-magik", "load-faild", "over-capp", "trunkated"}
    assert set(severities) == {"error"}  # the bare one; Severity.WARNING is a member
    assert members == {"K_ONLY", "TRUNKATED"} and "TRUNKATED" not in ProblemCode.__members__


# ---------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------


def test_each_code_is_defined_once_with_all_its_facts():
    assert list(REGISTRY) == list(ProblemCode)
    for code, i in REGISTRY.items():
        assert i.code is code and i.levels and i.meaning and len(i.meaning) <= 100, code
        assert code == code.value and code.value == code.value.lower() and " " not in code.value
    assert len({c.value for c in ProblemCode}) == len(ProblemCode)


def test_an_unregistered_code_raises():
    with pytest.raises(ValueError):
        ProblemCode("bad-magik")
    with pytest.raises(ValueError):
        info("bad-magik")
    with pytest.raises(ValueError):
        cause_of("bad-magik", "error")
    with pytest.raises(ValueError):
        Problem(Severity.ERROR, "bad-magik", "header", 0, "m")
    sf = SlotFile("x.slot", 0, FileFormat.UNKNOWN)
    with pytest.raises(ValueError):
        sf.problem("error", "bad-magik", "header", 0, "m")
    sf.problem("error", "bad-magic", "header", 0, "m")
    assert sf.problems[0].code is ProblemCode.BAD_MAGIC


# The classes as slotfile.diagnosis decided them before the registry (seven frozensets and a
# severity rule): the registry must give the same "class" in every JSON report.
_OLD_SETS = {
    ProblemClass.NOT_SLOT_FILE: {"not-slot-file"},
    ProblemClass.MISMATCH: {
        "wrong-arch",
        "model-mismatch",
        "token-out-of-vocab",
        "position-beyond-context",
        "version-mismatch",
    },
    ProblemClass.CANNOT_CHECK: {
        "not-modelled",
        "not-checked",
        "draft-not-checked",
        "draft-not-loaded",
        "unscanned-type",
        "deep-shifted",  # new with the registry: deep could not compare the shifted cells' values
        "recompute-crashed",  # new: llama.cpp crashed recomputing the tokens of a file that restored
        "deep-unreplayed",  # new: drift no split replays in a cache of one stream per slot, left unverified
    },
    ProblemClass.UNSUPPORTED: {"unsupported-layout"},
}


def _old_class(code: str, severity: str) -> ProblemClass:
    for cls, members in _OLD_SETS.items():
        if code in members:
            return cls
    return ProblemClass.DAMAGED if severity == "error" else ProblemClass.NOTICE


@pytest.mark.parametrize("severity", list(Severity))
def test_classes_are_those_the_reports_had(severity: Severity):
    for code in ProblemCode:
        assert cause_of(code, severity) == _old_class(code, severity), (code, severity)


def test_the_registry_severity_gives_the_registry_class():
    for code, i in REGISTRY.items():
        assert cause_of(code, i.severity) == i.cls, code
        assert (i.cls == ProblemClass.NOTICE) <= (i.severity == Severity.WARNING), code


def test_lookups():
    assert info("k-only").severity == Severity.WARNING and info(ProblemCode.K_ONLY).level == CheckLevel.STRUCTURE
    assert info("crashed").levels == (CheckLevel.LOAD,) and info("recompute-crashed").levels == (CheckLevel.DEEP,)
    assert CheckLevel.SCAN.reported_in == CheckLevel.STRUCTURE and CheckLevel.DEEP.reported_in == CheckLevel.DEEP
    assert codes(cls=ProblemClass.UNSUPPORTED) == (ProblemCode.UNSUPPORTED_LAYOUT,)
    assert set(codes(level=CheckLevel.SCAN)) == {ProblemCode.NON_FINITE, ProblemCode.UNSCANNED_TYPE}


def test_problem_json_is_plain_strings():
    p = Problem("warning", "k-only", "body.kv", 12, "m")
    assert p.severity is Severity.WARNING and p.code is ProblemCode.K_ONLY and not p.from_model
    assert json.loads(json.dumps(p.to_dict())) == {
        "severity": "warning",
        "code": "k-only",
        "section": "body.kv",
        "offset": 12,
        "message": "m",
    }
    assert p.cls == ProblemClass.NOTICE and p.line() == "body.kv at offset 12: m"


# ---------------------------------------------------------------------------------------
# the README
# ---------------------------------------------------------------------------------------


def test_the_readme_problem_codes_are_generated_from_the_registry():
    mod = _script()
    text = (ROOT / "README.md").read_text()
    assert mod.current(text) == mod.block(), "README.md is out of date: run python scripts/problem_codes.py"
    for code in ProblemCode:
        assert f"`{code}`" in mod.current(text), code
