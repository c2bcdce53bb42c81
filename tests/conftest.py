"""Shared fixtures: the committed fixture files and their manifests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

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


@pytest.fixture(scope="session")
def manifest() -> dict[str, Any]:
    return MANIFEST


@pytest.fixture(scope="session")
def extra_manifest() -> dict[str, Any]:
    return EXTRA
