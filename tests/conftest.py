"""Process-wide settings every test module shares.

Ray reads `RAY_AUTH_MODE` into a per-process config the first time it starts or joins a
cluster, while the processes it spawns read the variable afresh. A local `ray.init()` turns
token auth on by itself when the variable is unset, so one module's cluster would be started
with token auth and a later module's with it off (or the reverse), and the driver's cached mode
then disagrees with its own GCS ("InvalidAuthToken ... RAY_AUTH_MODE is currently 'disabled'";
the actors of a cluster never start). Every Ray cluster of the tests is on loopback only, so one
mode for the whole session, fixed before Ray is imported: disabled.

The session's process ends with `os._exit` once pytest has written its report (`pytest_unconfigure`
below): `ray.shutdown()` leaves Ray's C++ I/O and gRPC threads running (and Ray Serve's router loop
records metrics from its own thread); after dozens of clusters started and stopped in one process, the
interpreter's teardown once crashed with them still running (SIGSEGV in CI after "1785 passed"), and a
crash there would fail a session whose tests all passed (`tests/test_session_exit.py`).
"""

import atexit
import os
import sys

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import pytest  # after the environment is set


@pytest.fixture(scope="module")
def model():
    """The tiny random-weight Llama of most tests (seed 0, EOS off so greedy runs have exact lengths),
    on one torch thread. A module may define its own `model` fixture instead."""
    import torch

    from scissorhands.testing import tiny_llama

    torch.set_num_threads(1)
    m = tiny_llama(0)
    m.generation_config.eos_token_id = None
    return m


_session = None


def pytest_sessionstart(session):
    global _session
    _session = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Exit with pytest's status without the interpreter's teardown (see the module docstring); the
    `atexit` handlers still run (pytest's temporary-folder locks, tqdm, Ray's shutdown of a Ray still running),
    threads still running are not joined."""
    if _session is None or sys.exc_info()[0] is not None:  # no session ran (--help), or an error pytest prints
        return  # after this hook (a usage error found in the session, such as a path not found): the usual exit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(_session.exitstatus))
