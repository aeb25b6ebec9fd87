"""The test session's exit (`tests/conftest.py`): pytest's own status, whatever the interpreter's
teardown would have done after the report (in CI it once crashed after every test had passed)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CRASH_AT_TEARDOWN = """
import ctypes


class CrashAtTeardown:
    def __del__(self, string_at=ctypes.string_at):  # at exit, when the interpreter clears this module
        string_at(0)  # reads address 0: SIGSEGV


kept = CrashAtTeardown()


def test_one():
    assert {outcome}
"""


def run_pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m pytest -q` in a fresh process in `cwd`, this repository importable (`-p tests.conftest`)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("outcome, status", [("True", 0), ("False", 1)])
def test_the_session_exits_with_pytests_status_even_when_the_interpreters_teardown_would_crash(
    tmp_path, outcome, status
):
    path = tmp_path / "test_teardown.py"
    path.write_text(CRASH_AT_TEARDOWN.format(outcome=outcome))

    assert run_pytest(tmp_path, str(path)).returncode == -signal.SIGSEGV  # the staged crash, without the hook
    assert run_pytest(tmp_path, "-p", "tests.conftest", str(path)).returncode == status


def test_a_usage_error_found_in_the_session_keeps_its_message_and_status(tmp_path):
    run = run_pytest(tmp_path, "-p", "tests.conftest", "no_such_test.py")
    assert run.returncode == 4
    assert "file or directory not found: no_such_test.py" in run.stdout + run.stderr
