"""What Ray itself prints under our commands: its "set RAY_AUTH_MODE=disabled" line is kept out of a run that
starts the embedded Ray (`cluster.submit.token_auth_for_embedded`), and token authentication stays on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = [pytest.mark.ray]

START = (
    "import os\n"
    "from cluster.connect import init_ray\n"
    "ray, _ = init_ray(None)\n"
    "print('mode', os.environ.get('RAY_AUTH_MODE'))\n"
    "ray.shutdown()\n"
)


def test_embedded_ray_starts_without_rays_opt_out_line_and_with_token_auth(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    short = tempfile.mkdtemp(prefix="sh-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env.update(HOME=str(tmp_path), RAY_TMPDIR=short, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    try:
        done = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mode token" in done.stdout
    assert "RAY_AUTH_MODE=disabled" not in done.stderr and "Token authentication is enabled" not in done.stderr


@pytest.mark.parametrize("given, expected", [("disabled", "disabled"), (None, "token")])
def test_a_mode_the_user_set_wins(given, expected):
    """In a process of its own: the mode is cached by Ray per process."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env.update({"RAY_AUTH_MODE": given} if given else {})
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    code = "import os\nfrom cluster import submit\nsubmit.token_auth_for_embedded()\nprint(os.environ['RAY_AUTH_MODE'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == expected, done.stderr[-1000:]
