"""A busy neighbour for tests that check what contention does: bounded Python spin loops in processes of their own."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

SPIN = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < {s}:\n    pass\n"
SPIN_LIMIT_S = 120  # a spinner left behind by a killed test ends on its own


@contextlib.contextmanager
def busy_neighbour(per_core: int = 3):
    """`per_core` spinning processes per CPU this process may run on, until the block ends."""
    cores = len(os.sched_getaffinity(0))
    if cores > 16:
        pytest.skip(f"{cores} CPUs: a spinning neighbour on every core would be too heavy for a test")
    procs = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=SPIN_LIMIT_S)]) for _ in range(per_core * cores)]
    try:
        time.sleep(0.5)  # every spinner running before the point starts
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
