"""A repair killed with SIGKILL at any point leaves the destination absent or complete,
the input byte-identical, and no visible stray files; the next run cleans the stale temps."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slotfile.format.reader import open_slot_file
from slotfile.format.synth import SynthSpec, write_slot

KILL_POINTS = 8


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _strip(src: Path, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "slotfile", "strip-draft", str(src), "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ~100 MB with a draft appendix: long enough that kills land inside the copy
    p = tmp_path_factory.mktemp("crash") / "in.slot"
    write_slot(p, SynthSpec(n_cells=1024, n_layer=16, draft_layers=8, checkpoints=1))
    return p


@pytest.mark.slow
def test_sigkill_during_a_repair(big: Path, tmp_path: Path) -> None:
    digest = _sha(big)
    ref = tmp_path / "ref.slot"
    t0 = time.monotonic()
    assert _strip(big, ref).wait(timeout=300) == 0
    full = time.monotonic() - t0
    want = _sha(ref)
    outcomes = {"absent": 0, "complete": 0, "mid-write": 0}
    for i in range(KILL_POINTS):
        d = tmp_path / f"k{i}"
        d.mkdir()
        out = d / "out.slot"
        p = _strip(big, out)
        if i % 2:  # spread over the whole run: start-up, parse, write, rename
            time.sleep(full * (i + 0.5) / KILL_POINTS)
        else:  # inside the write: as soon as the temp file shows, then a little later each time
            deadline = time.monotonic() + 60
            while (
                p.poll() is None and time.monotonic() < deadline and not any(n.startswith(".") for n in os.listdir(d))
            ):
                time.sleep(0.0005)
            time.sleep(0.002 * i)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert _sha(big) == digest, "the input changed"
        if out.exists():
            assert _sha(out) == want, f"kill {i}: a partial destination is visible"
            assert not open_slot_file(out).errors
            outcomes["complete"] += 1
        else:
            outcomes["absent"] += 1
        outcomes["mid-write"] += any(n.startswith(".") for n in os.listdir(d))
        visible = [n for n in os.listdir(d) if not n.startswith(".") and n != "out.slot"]
        assert visible == [], f"kill {i}: stray files {visible}"
        # the next run into the same directory removes what the killed one left behind
        out.unlink(missing_ok=True)
        assert _strip(big, out).wait(timeout=300) == 0
        assert _sha(out) == want
        assert [n for n in os.listdir(d) if n != "out.slot"] == [], f"kill {i}: stale temporaries kept"
    print(outcomes)
    assert outcomes["absent"] > 0 and outcomes["mid-write"] > 0  # some kills landed inside the write


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slotfile", *args], capture_output=True, text=True, timeout=120)


def test_output_symlink_and_directory_are_refused(tmp_path: Path) -> None:
    from .conftest import SLOTS

    src = str(SLOTS / "llama_draft_sdft.slot")
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    link = tmp_path / "out.slot"
    link.symlink_to(victim)
    for extra in ([], ["--force"]):
        r = _cli("strip-draft", src, "-o", str(link), *extra)
        assert r.returncode == 2 and "symlink" in r.stderr, r.stderr
    assert victim.read_bytes() == b"keep me" and link.is_symlink()
    r = _cli("strip-draft", src, "-o", str(tmp_path))
    assert r.returncode == 2 and "is a directory" in r.stderr


def test_read_only_file_system_is_refused(tmp_path: Path) -> None:
    """A read-only tmpfs mounted in a private mount namespace (unshare; with a user namespace
    when not root), so the test needs no privilege and leaves no mount behind."""
    from .conftest import SLOTS

    mnt = tmp_path / "ro"
    mnt.mkdir()
    ns = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    mount_then_run = 'mount -t tmpfs -o ro,size=1m tmpfs "$0" || exit 99; exec "$@"'
    cmd = [
        sys.executable,
        "-m",
        "slotfile",
        "strip-draft",
        str(SLOTS / "llama_draft_sdft.slot"),
        "-o",
        str(mnt / "out.slot"),
    ]
    r = subprocess.run([*ns, "sh", "-c", mount_then_run, str(mnt), *cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode != 99, f"{' '.join(ns)} could not mount a read-only tmpfs: {r.stderr}"
    assert r.returncode == 2 and "Read-only file system" in r.stderr, (r.returncode, r.stderr)
    assert "\n" not in r.stderr.strip()
