"""The documented ways to reach a cluster, end to end from the Makefile.

One module-scoped head started by the real `make cluster-up` (`ray start --head`) on free loopback
ports (never 6379/8265, which a user's own `make cluster-up` holds) under its own root folder, in
an environment with Ray's real default: `RAY_AUTH_MODE` unset and a token in `$HOME/.ray/auth_token`
(a HOME of the test's own, so nobody's token is touched), so the head runs with token auth as it
does after any embedded `ray.init()` on the machine. tests/conftest.py sets RAY_AUTH_MODE=disabled
for the pytest process only; every command here runs in a subprocess without it.

* `make sweep ARGS="--address 127.0.0.1:PORT"` runs a tiny-model point on that head (exit 0);
  before the fix the driver was refused with InvalidAuthToken and the sweep failed;
* `RAY_ADDRESS=127.0.0.1:PORT make sweep` does the same;
* `make submit` runs the suite as a Ray job on it;
* `make cluster-node` joins a second node that the sweep's replica is placed on (custom resource);
* `make cluster-down` stops that head and its node, and a second Ray started beside it still answers.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.waiting import free_port

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
SUITE = REPO / "tests" / "suites" / "tiny-one-point.yaml"  # inside the working dir `make submit` uploads


def _make(env: dict, *targets: str, timeout: float = 300, **variables: str) -> subprocess.CompletedProcess:
    cmd = ["make", "-s", "-C", str(REPO), f"VENV={VENV}", "-o", f"{VENV}/.installed", *targets]
    cmd += [f"{k}={v}" for k, v in variables.items()]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def head():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    from cluster import local_head

    # short paths: Ray's socket paths under the temp dir must stay below the 107-byte limit
    home = Path(tempfile.mkdtemp(prefix="shm-"))
    temp_dir = home / "ray"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_TMPDIR")}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), SCISSORHANDS_PUSHGATEWAY="off")
    subprocess.run(
        [str(VENV / "bin" / "ray"), "get-auth-token", "--generate"],
        env=env,
        capture_output=True,
        check=True,
        timeout=60,
    )
    assert (home / ".ray" / "auth_token").is_file()
    ports = dict(
        RAY_PORT=free_port(),
        DASHBOARD_PORT=free_port(),
        METRICS_PORT=free_port(),
        AGENT_PORT=free_port(),
        CLIENT_PORT=free_port(),
    )
    variables = {k: str(v) for k, v in ports.items()} | {"CLUSTER_TEMP_DIR": str(temp_dir)}
    suite = SUITE
    try:
        up = _make(env, "cluster-up", **variables)
        assert up.returncode == 0, up.stdout + up.stderr
        yield {
            "env": env,
            "home": home,
            "temp_dir": temp_dir,
            "vars": variables,
            "suite": suite,
            "address": f"127.0.0.1:{ports['RAY_PORT']}",
            "up": up,
        }
    finally:
        local_head.stop(temp_dir, timeout_s=10, log=lambda s: None)  # only this test's cluster
        shutil.rmtree(home, ignore_errors=True)


def test_cluster_up_runs_a_head_with_token_auth_under_its_own_folder(head):
    import psutil

    from cluster.local_head import cluster_pids

    state = json.loads((head["temp_dir"] / "cluster.json").read_text())
    assert state["gcs_address"] == head["address"]
    pids = cluster_pids(head["temp_dir"])
    names = {psutil.Process(p).name() for p in pids}
    assert {"gcs_server", "raylet"} <= names
    gcs = next(p for p in pids if psutil.Process(p).name() == "gcs_server")
    # the real default: `ray start` found the token and turned token auth on for the head
    assert psutil.Process(gcs).environ().get("RAY_AUTH_MODE") == "token"


def _sweep_ok(head, run_id: str, extra_env: dict | None = None, args: str = "") -> dict:
    results = head["home"] / "results"
    env = dict(head["env"], **(extra_env or {}))
    out = _make(env, "sweep", SUITE=str(head["suite"]), ARGS=f"{args} --results-dir {results} --run-id {run_id}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"Connecting to existing Ray cluster at address: {head['address']}" in out.stderr
    assert "InvalidAuthToken" not in out.stderr
    (rec,) = _lines(results / run_id / "points.jsonl")
    assert rec["status"] == "ok" and rec["output_tokens"] == 4
    return rec


def test_sweep_with_address_joins_the_token_auth_head(head):
    # `make cluster-up`, then `make sweep ARGS="--address 127.0.0.1:PORT"`
    rec = _sweep_ok(head, "by-address", args=f"--address {head['address']}")
    assert rec["node_id"]


def test_sweep_with_ray_address_env_joins_the_head(head):
    _sweep_ok(head, "by-env", extra_env={"RAY_ADDRESS": head["address"]})


def test_make_submit_runs_the_suite_as_a_job(head):
    results = head["home"] / "job-results"
    out = _make(
        head["env"],
        "submit",
        timeout=420,
        SUITE=str(SUITE.relative_to(REPO)),
        DASHBOARD_PORT=head["vars"]["DASHBOARD_PORT"],
        RESULTS=str(results),
        ARGS="--run-id job1",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (rec,) = _lines(results / "job1" / "points.jsonl")
    assert rec["status"] == "ok"
    assert json.loads((results / "job1" / "job.json").read_text())["status"] == "SUCCEEDED"


def test_cluster_node_joins_and_takes_a_replica(head):
    results = head["home"] / "results"
    suite = head["home"] / "on-node-b.yaml"
    suite.write_text(yaml.safe_dump(dict(yaml.safe_load(SUITE.read_text()), placement={"resources": {"node_b": 1}})))
    node = subprocess.Popen(
        [
            "make",
            "-s",
            "-C",
            str(REPO),
            f"VENV={VENV}",
            "-o",
            f"{VENV}/.installed",
            "cluster-node",
            f"RAY_PORT={head['vars']['RAY_PORT']}",
            f"ARGS=--num-cpus 1 --resources node_b=1 --metrics-export-port {free_port()}",
        ],
        env=head["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        seen = []
        while not seen or "joined" not in seen[-1]:
            seen.append(node.stdout.readline())
            assert seen[-1] and len(seen) < 200, "".join(seen)  # the node exited, or never said it joined
        line = seen[-1]
        out = _make(
            head["env"],
            "sweep",
            SUITE=str(suite),
            ARGS=f"--address {head['address']} --results-dir {results} --run-id on-node-b",
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        (rec,) = _lines(results / "on-node-b" / "points.jsonl")
        node_id = line.split("node ", 1)[1].split(" ", 1)[0]
        assert rec["status"] == "ok" and rec["node_id"] == node_id
    finally:
        os.killpg(node.pid, signal.SIGTERM)  # the node's own process group only
        node.wait(timeout=60)


OTHER_RAY = """
import sys, ray
ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=sys.argv[1])
print("READY", flush=True)
sys.stdin.readline()
print("ANSWER", ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=120), flush=True)
"""


def test_cluster_down_stops_only_its_cluster(head):
    """Another Ray (like a sweep's embedded one) started beside the head still answers after
    `make cluster-down`, and every process of the head is gone."""
    from cluster.local_head import cluster_pids

    other_dir = head["home"] / "other"
    env = dict(head["env"], RAY_AUTH_MODE="disabled")
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_RAY, str(other_dir)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert other.stdout.readline().strip() == "READY"
        other_pids = cluster_pids(other_dir)
        assert other_pids
        head_pids = cluster_pids(head["temp_dir"])
        assert head_pids and not set(head_pids) & set(other_pids)
        down = _make(head["env"], "cluster-down", CLUSTER_TEMP_DIR=str(head["temp_dir"]))
        assert down.returncode == 0, down.stdout + down.stderr
        assert cluster_pids(head["temp_dir"]) == []
        import psutil

        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in head_pids)
        other.stdin.write("go\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "ANSWER 42"
        assert other.wait(timeout=60) == 0
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
