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
# the llama.cpp libraries that write state versions 2 and 4 (scripts/build-llama-v2.sh, -v4.sh)
# ---------------------------------------------------------------------------------------

V4_ENV = "SLOTFILE_TEST_LLAMA_V4"  # .ci/run sets it to the folder the build script printed
V4_SCRIPT = ROOT / "scripts" / "build-llama-v4.sh"
V2_ENV = "SLOTFILE_TEST_LLAMA_V2"  # likewise for scripts/build-llama-v2.sh
V2_SCRIPT = ROOT / "scripts" / "build-llama-v2.sh"
_LIBS = {4: (V4_ENV, V4_SCRIPT), 2: (V2_ENV, V2_SCRIPT)}


def _lib_cache(version: int) -> Path:
    """The build script's cache folder for its pinned source (keyed by the sdist's sha256)."""
    sha = re.search(r'^SHA256="([0-9a-f]{64})"', _LIBS[version][1].read_text(), re.M)
    cache = os.environ.get("SLOTFILE_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotfile"
    )
    return Path(cache) / f"llama-v{version}" / (sha.group(1) if sha else "?")


def llama_lib_dir(version: int) -> Path | None:
    """The built library folder of state ``version``: $SLOTFILE_TEST_LLAMA_V<N>, else the build
    script's cache folder for the pinned source (when a build finished there), else None."""
    env = os.environ.get(_LIBS[version][0])
    if env:
        return Path(env)
    d = _lib_cache(version)
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


def build_llama(config: pytest.Config, version: int) -> Path:
    """Build the library of state ``version`` with its script (the cached build .ci/run uses; the
    script takes a lock, so a concurrent run waits for this one's build and reuses it)."""
    env_name, script = _LIBS[version]
    cache = _lib_cache(version)
    _say(
        config,
        f"slotfile tests: building the llama.cpp library that writes state version {version} ({script.name}, "
        f"once per machine, about 3 min on 2 free cores, cached in {cache}): the version-{version} tests load "
        f"through it (or set {env_name} to one already built)",
    )
    cache.mkdir(parents=True, exist_ok=True)
    log = cache.parent / f"build-{os.getpid()}.log"
    env = {**os.environ, "PYTHON": sys.executable}
    with open(log, "w") as err:
        r = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines or not (Path(lines[-1]) / "libllama.so").is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        pytest.fail(f"{script.name} failed (exit {r.returncode}; log {log}):\n{tail}", pytrace=False)
    _say(config, f"slotfile tests: version-{version} library ready: {lines[-1]}")
    return Path(lines[-1])


def _llama_lib(request: pytest.FixtureRequest, version: int) -> Path:
    d = llama_lib_dir(version)
    if d is None:
        d = build_llama(request.config, version)
    if not (d / "libllama.so").is_file():
        pytest.fail(f"{_LIBS[version][0]}={d}: no libllama.so there")
    return d


@pytest.fixture(scope="session")
def llama_v4_lib(request: pytest.FixtureRequest) -> Path:
    """The v4 llama.cpp library folder, built on first use when neither $SLOTFILE_TEST_LLAMA_V4
    nor the cache has one; fails when $SLOTFILE_TEST_LLAMA_V4 names a folder without libllama.so."""
    return _llama_lib(request, 4)


@pytest.fixture(scope="session")
def llama_v2_lib(request: pytest.FixtureRequest) -> Path:
    """The v2 llama.cpp library folder (llama-cpp-python 0.3.35's llama.cpp), the same way."""
    return _llama_lib(request, 2)
