"""Shared fixtures: the committed fixture files and their manifests; the CLI in-process.

Markers (declared in pyproject.toml): ``llama`` on tests that load llama.cpp (llama-cpp-python, in-process or in a loader
worker), ``slow`` on tests that take more than about 5 s.  The fast part alone:
``python -m pytest -m "not slow and not llama"``; ``.ci/run`` runs everything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from typer.testing import Result

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
SLOTS = FIXTURES / "slots"
MODELS = FIXTURES / "models"

if str(ROOT) not in sys.path:  # make `import fixtures.make_fixtures` work from any cwd
    sys.path.insert(0, str(ROOT))


def _load(name: str) -> dict[str, Any]:
    return json.loads((SLOTS / name).read_text())


MANIFEST = _load("manifest.json")
EXTRA = _load("extra-manifest.json")
SLOT_FILES = sorted(p for p in SLOTS.iterdir() if p.suffix in (".slot", ".session"))


def slotfile_cli(*args: object, env: dict[str, str | None] | None = None) -> Result:
    """``slotfile ARGS`` run in-process (typer's CliRunner): exit code, stdout and stderr apart.
    For tests that only check a command's output; a separate process stays where it is the point."""
    from typer.testing import CliRunner

    from slotfile.cli.app import app

    return CliRunner(env=env).invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="session")
def manifest() -> dict[str, Any]:
    return MANIFEST


@pytest.fixture(scope="session")
def extra_manifest() -> dict[str, Any]:
    return EXTRA


# ---------------------------------------------------------------------------------------
# the llama.cpp library that writes state version 4 (scripts/build-llama-v4.sh)
# ---------------------------------------------------------------------------------------

V4_ENV = "SLOTFILE_TEST_LLAMA_V4"  # .ci/run sets it to the folder the build script printed
V4_SCRIPT = ROOT / "scripts" / "build-llama-v4.sh"


def _v4_cache() -> Path:
    """The build script's cache folder for its pinned source (keyed by the sdist's sha256)."""
    sha = re.search(r'^SHA256="([0-9a-f]{64})"', V4_SCRIPT.read_text(), re.M)
    cache = os.environ.get("SLOTFILE_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotfile"
    )
    return Path(cache) / "llama-v4" / (sha.group(1) if sha else "?")


def llama_v4_dir() -> Path | None:
    """The built v4 library folder: $SLOTFILE_TEST_LLAMA_V4, else the build script's cache
    folder for the pinned source (when a build finished there), else None."""
    env = os.environ.get(V4_ENV)
    if env:
        return Path(env)
    d = _v4_cache()
    return d / "bin" if (d / ".complete").is_file() and (d / "bin" / "libllama.so").is_file() else None


def _say(config: pytest.Config, line: str) -> None:
    """One line on the terminal, even under -q and with output captured."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        sys.stderr.write(line + "\n")
        return
    if capman is not None:
        with capman.global_and_fixture_disabled():
            reporter.write_line(line)
    else:
        reporter.write_line(line)


def build_llama_v4(config: pytest.Config) -> Path:
    """Build the v4 library with scripts/build-llama-v4.sh (the cached build .ci/run uses; the
    script takes a lock, so a concurrent run waits for this one's build and reuses it)."""
    cache = _v4_cache()
    _say(
        config,
        f"slotfile tests: building the llama.cpp library that writes state version 4 ({V4_SCRIPT.name}, "
        f"once per machine, about 3 min on 2 cores, cached in {cache}): the version-4 tests load through it "
        f"(or set {V4_ENV} to one already built)",
    )
    cache.mkdir(parents=True, exist_ok=True)
    log = cache.parent / f"build-{os.getpid()}.log"
    env = {**os.environ, "PYTHON": sys.executable}
    with open(log, "w") as err:
        r = subprocess.run(["bash", str(V4_SCRIPT)], stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines or not (Path(lines[-1]) / "libllama.so").is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        pytest.fail(f"{V4_SCRIPT.name} failed (exit {r.returncode}; log {log}):\n{tail}", pytrace=False)
    _say(config, f"slotfile tests: version-4 library ready: {lines[-1]}")
    return Path(lines[-1])


@pytest.fixture(scope="session")
def llama_v4_lib(request: pytest.FixtureRequest) -> Path:
    """The v4 llama.cpp library folder, built on first use when neither $SLOTFILE_TEST_LLAMA_V4
    nor the cache has one; fails when $SLOTFILE_TEST_LLAMA_V4 names a folder without libllama.so."""
    d = llama_v4_dir()
    if d is None:
        d = build_llama_v4(request.config)
    if not (d / "libllama.so").is_file():
        pytest.fail(f"{V4_ENV}={d}: no libllama.so there")
    return d
