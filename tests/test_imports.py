"""The import graph of slotfile/: no cycle, and the records below everything that reads them.

The graph is built from the source (every ``import`` and ``from ... import`` anywhere in a
module: at the top, inside functions, under ``if TYPE_CHECKING``), so a cycle hidden in a
function-level import fails here as well.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "slotfile"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path = PKG) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, here: str, is_pkg: bool, known: set[str]) -> set[str]:
    """The slotfile modules an import statement names (``from . import x`` names module x when
    x is a module, else the package itself)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level:
        base = here.split(".") if is_pkg else here.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    out = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known}
    if mod in known and len(out) < len(node.names):
        out.add(mod)
    return out


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    mods = _modules(root)
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= _targets(node, name, path.name == "__init__.py", known)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself
    (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_the_graph_is_read_from_the_source():
    g = import_graph()
    # a top-level, a function-level and a TYPE_CHECKING import are all edges
    assert "slotfile.format.records" in g["slotfile.format.reader"]
    assert "slotfile.format.scan" in g["slotfile.verify.structure"]  # imported inside scan_into
    assert "slotfile.format.reader" in g["slotfile"]  # imported inside __getattr__ of the package
    assert "slotfile.cli.inspect_cmd" in g["slotfile.cli.app"]  # from .inspect_cmd import ... in a command


def test_no_import_cycle_in_slotfile():
    assert cycles(import_graph()) == []


def test_records_are_below_expectation_comparison_and_reader():
    g = import_graph()
    below = _reaches(g, "slotfile.format.records")
    assert not below & {
        "slotfile.format.reader",
        "slotfile.model.expect",
        "slotfile.model.compare",
        "slotfile.model.check",
    }, below
    for mod in ("slotfile.model.expect", "slotfile.model.compare", "slotfile.model.check"):
        assert "slotfile.format.records" in g[mod]
        assert "slotfile.format.reader" not in _reaches(g, mod), mod
    assert {"slotfile.model.expect", "slotfile.model.check"} <= g["slotfile.format.reader"]


def test_the_cycle_check_finds_a_function_level_cycle(tmp_path: Path):
    pkg = tmp_path / "slotfile"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\nx = 1\n")
    (pkg / "c.py").write_text("from slotfile import a\n")
    g = import_graph(pkg)
    assert g["slotfile.a"] == {"slotfile.b"} and g["slotfile.b"] == {"slotfile.a"}
    assert cycles(g) == [["slotfile.a", "slotfile.b"]]


def _is_in(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def forbidden_edges(graph: dict[str, set[str]], importers: str, targets: tuple[str, ...]) -> list[tuple[str, str]]:
    """Every import, at any level of a module (a function-level one too), from a module inside
    package ``importers`` (``"!slotfile.cli"``: every module outside slotfile.cli) of a module
    inside one of ``targets``."""
    outside = importers.startswith("!")
    pkg = importers.lstrip("!")
    out = []
    for mod, deps in sorted(graph.items()):
        if _is_in(mod, pkg) == outside:
            continue
        out += [(mod, d) for d in sorted(deps) if any(_is_in(d, t) for t in targets)]
    return out


def test_the_library_never_imports_the_cli():
    """The CLI sits on top: nothing outside slotfile/cli/ imports it, so the library works
    (and is tested) without typer's wiring and its consoles.  ``python -m slotfile``
    (slotfile/__main__.py) is the CLI's entry, not library."""
    edges = forbidden_edges(import_graph(), "!slotfile.cli", ("slotfile.cli",))
    assert [e for e in edges if e[0] != "slotfile.__main__"] == []


def test_format_never_imports_llama_verify_or_repair():
    """slotfile/format/ is bytes and records: neither it nor anything it imports reaches the
    llama.cpp side, the verify levels or the repairs."""
    g = import_graph()
    above = ("slotfile.llama", "slotfile.verify", "slotfile.repair", "slotfile.cli")
    assert forbidden_edges(g, "slotfile.format", above) == []
    reached = set().union(*(_reaches(g, m) for m in g if _is_in(m, "slotfile.format")))
    assert not [m for m in reached if any(_is_in(m, t) for t in above)], sorted(reached)


def test_the_layer_check_finds_a_function_level_import(tmp_path: Path):
    pkg = tmp_path / "slotfile"
    for sub in ("format", "llama", "cli"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "format" / "reader.py").write_text("def f():\n    from slotfile.llama import pool\n    return pool\n")
    (pkg / "llama" / "pool.py").write_text("import slotfile.cli.app\n")
    (pkg / "cli" / "app.py").write_text("from slotfile.format import reader\n")
    g = import_graph(pkg)
    assert forbidden_edges(g, "slotfile.format", ("slotfile.llama",)) == [
        ("slotfile.format.reader", "slotfile.llama.pool")
    ]
    assert forbidden_edges(g, "!slotfile.cli", ("slotfile.cli",)) == [("slotfile.llama.pool", "slotfile.cli.app")]


def test_a_structure_only_run_forks_before_the_model_side(tmp_path: Path):
    """A directory's structure-only verify forks its workers once the reader is imported: the
    judge, the deep level, the loader and the model bridge (~0.1 s of start-up before the
    fork, and memory in every worker) are not imported by then, nor by the workers.  Checked
    in a fresh interpreter, through the CLI, on 240 copies of real fixture files (forked from
    200 on: slotfile.slotdir.forked.PARALLEL_MIN)."""
    import shutil
    import subprocess
    import sys

    slots = sorted((PKG.parent / "fixtures" / "slots").glob("*.slot"))
    for i in range(240):
        p = tmp_path / f"s{i:03d}.slot"
        shutil.copyfile(slots[i % len(slots)], p)
        os.utime(p, (1, 1))  # long settled
    code = (
        "import sys\n"
        "import slotfile.slotdir.forked as F\n"
        "heavy = ['slotfile.verify.judge', 'slotfile.verify.deep', 'slotfile.llama.loader',\n"
        "         'slotfile.llama.pool', 'slotfile.model.bridge', 'slotfile.model.check']\n"
        "start = F._Forked._start\n"
        "def at_fork(self, fn):\n"
        "    sys.stderr.write(f'AT FORK {[m for m in heavy if m in sys.modules]}\\n')\n"
        "    start(self, fn)\n"
        "F._Forked._start = at_fork\n"
        "serve = F._serve\n"
        "def worker(fn, conn):\n"
        "    try:\n"
        "        serve(fn, conn)\n"
        "    finally:\n"
        "        sys.stderr.write(f'WORKER {[m for m in heavy if m in sys.modules]}\\n')\n"
        "F._serve = worker\n"
        "from slotfile.cli.app import main\n"
        "sys.argv = ['slotfile', 'verify', sys.argv[1], '--json']\n"
        "main()\n"
    )
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False)
    lines = sorted(x for x in got.stderr.splitlines() if x.startswith(("AT FORK", "WORKER")))
    assert lines == ["AT FORK []", "WORKER []", "WORKER []"], got.stderr[-3000:]
    assert '"files": 240' in got.stdout


def test_a_model_run_imports_the_report_printer_while_it_waits_on_the_loader():
    """With a model, the parent waits on the loader worker (load, prefill, decodes) and then
    prints its report with rich: rich is imported on a thread during the wait (~45 ms that
    followed the last reply), and not at all for --json.  Checked in a fresh interpreter
    through the CLI, on a fixture file and its model (the real loader)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import slotfile.verify.engine as E\n"
        "orun = E.Verifier.run\n"
        "def run(self, *a, **k):\n"
        "    r = orun(self, *a, **k)\n"
        "    sys.stderr.write(f\"RICH {'rich.console' in sys.modules}\\n\")\n"
        "    return r\n"
        "E.Verifier.run = run\n"
        "from slotfile.cli.app import main\n"
        "sys.argv = ['slotfile', 'verify', *sys.argv[1:]]\n"
        "main()\n"
    )
    slot, model = (
        PKG.parent / "fixtures" / "slots" / "llama_f16_fa.slot",
        PKG.parent / "fixtures" / "models" / "llama.gguf",
    )
    for extra, want in (((), "RICH True"), (("--json",), "RICH False")):  # when the last reply is in
        args = [sys.executable, "-c", code, str(slot), "--model", str(model), *extra]
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TTY_COMPATIBLE", "FORCE_COLOR")}
        got = subprocess.run(args, capture_output=True, text=True, check=False, env=env)  # stderr: a plain pipe
        assert got.returncode == 0 and want in got.stderr.splitlines(), (extra, got.stderr[-2000:])


def test_a_model_run_judges_with_one_blas_thread_unless_told_otherwise():
    """``verify --model --deep`` does its matrix work (the judgment, beside the loader's
    threads) with one OpenBLAS thread: a second one waited on the loader's threads on 2 cores
    (slotfile.cli.root.one_blas_thread).  An OPENBLAS_NUM_THREADS the user set is kept.
    Checked in a fresh interpreter through the CLI on a fixture file, its model and the real
    loader: OpenBLAS's own thread count, read from the loaded library after the run."""
    import subprocess
    import sys

    code = (
        "import atexit, ctypes, sys\n"
        "assert 'numpy' not in sys.modules\n"
        "def blas():  # main() ends with os._exit after the atexit handlers\n"
        "    path = next(ln.split()[-1] for ln in open('/proc/self/maps') if 'openblas' in ln)\n"
        "    lib = ctypes.CDLL(path)\n"
        "    names = ('scipy_openblas_get_num_threads64_', 'openblas_get_num_threads64_', 'openblas_get_num_threads')\n"
        "    get = next(getattr(lib, n) for n in names if hasattr(lib, n))\n"
        "    sys.stderr.write(f'BLAS {get()}\\n')\n"
        "atexit.register(blas)\n"
        "from slotfile.cli.app import main\n"
        "sys.argv = ['slotfile', 'verify', *sys.argv[1:]]\n"
        "main()\n"
    )
    slot, model = (
        PKG.parent / "fixtures" / "slots" / "llama_f16_fa.slot",
        PKG.parent / "fixtures" / "models" / "llama.gguf",
    )
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    for extra, want in (({}, "BLAS 1"), ({"OPENBLAS_NUM_THREADS": "2"}, "BLAS 2")):
        args = [sys.executable, "-c", code, str(slot), "--model", str(model), "--deep", "--json"]
        got = subprocess.run(args, capture_output=True, text=True, check=False, env={**base, **extra})
        lines = got.stderr.splitlines()
        assert got.returncode == 0 and want in lines, (extra, got.stderr[-2000:])
