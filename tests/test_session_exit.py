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


@pytest.mark.parametrize("outcome, status", [("True", 0), ("False", 1)])
def test_the_session_exits_with_pytests_status_even_when_the_interpreters_teardown_would_crash(
    tmp_path, outcome, status
):
    path = tmp_path / "test_teardown.py"
    path.write_text(CRASH_AT_TEARDOWN.format(outcome=outcome))

    def pytest_status(*plugins: str) -> int:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, str(path)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=120).returncode

    assert pytest_status() == -signal.SIGSEGV  # the crash this file stages, without the session's exit hook
    assert pytest_status("-p", "tests.conftest") == status


def test_a_usage_error_found_in_the_session_keeps_its_message_and_status(tmp_path):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "no_such_test.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 4
    assert "file or directory not found: no_such_test.py" in run.stdout + run.stderr
