"""The test session's exit (`tests/conftest.py`): pytest's own status, whatever the interpreter's
teardown would have done after the report (a native thread of Ray crashing it, as it did in CI)."""

import os
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

    assert pytest_status() == -11  # SIGSEGV: the crash this file stages, without the session's exit hook
    assert pytest_status("-p", "tests.conftest") == status
