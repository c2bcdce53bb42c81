"""Shared fixtures: the committed fixture files and their manifests; the CLI in-process.

Markers (declared in pyproject.toml): ``llama`` on tests that load llama.cpp (llama-cpp-python, in-process or in a loader
worker), ``slow`` on tests that take more than about 5 s.  The fast part alone:
``python -m pytest -m "not slow and not llama"``; ``.ci/run`` runs everything.
"""

from __future__ import annotations

import json
import os
import re
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


def llama_v4_dir() -> Path | None:
    """The built v4 library folder: $SLOTFILE_TEST_LLAMA_V4, else the build script's cache
    folder for the pinned source (when a build finished there), else None."""
    env = os.environ.get(V4_ENV)
    if env:
        return Path(env)
    script = (ROOT / "scripts" / "build-llama-v4.sh").read_text()
    sha = re.search(r'^SHA256="([0-9a-f]{64})"', script, re.M)
    cache = os.environ.get("SLOTFILE_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotfile"
    )
    d = Path(cache) / "llama-v4" / (sha.group(1) if sha else "?")
    return d / "bin" if (d / ".complete").is_file() and (d / "bin" / "libllama.so").is_file() else None


@pytest.fixture(scope="session")
def llama_v4_lib() -> Path:
    """The v4 llama.cpp library folder.  Skips (locally) when it was never built; fails when
    $SLOTFILE_TEST_LLAMA_V4 names a folder without libllama.so (CI must never skip these)."""
    d = llama_v4_dir()
    if d is None:
        pytest.skip(f"no v4 llama.cpp library: run scripts/build-llama-v4.sh (or set {V4_ENV} to its folder)")
    if not (d / "libllama.so").is_file():
        pytest.fail(f"{V4_ENV}={d}: no libllama.so there")
    return d
