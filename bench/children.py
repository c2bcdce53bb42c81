"""Child processes for the bench scripts: reaped with os.wait4 so their rusage is their own."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any


def reap(p: subprocess.Popen[bytes], t0: float, timeout: float) -> tuple[int, Any, bool]:
    """Wait for ``p`` until ``t0 + timeout``, killing it past that: (wait status, rusage,
    timed out).  Polls finely at first, so short commands are timed to the millisecond."""
    deadline = t0 + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            return status, ru, False
        if time.perf_counter() > deadline:
            p.kill()
            _, status, ru = os.wait4(p.pid, 0)
            return status, ru, True
        time.sleep(0.0005 if time.perf_counter() - t0 < 0.5 else 0.005)
