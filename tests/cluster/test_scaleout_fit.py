"""Resource requests fit the nodes that exist; a sweep that cannot go on fails in bounded time.

* `fit_share` / `replica_resources`: a replica never asks for more than one node has (two 1-CPU
  nodes: 1 CPU, where the cluster's total of 2 made a serving replica wait forever);
* on a real cluster of two 1-CPU nodes on loopback, a serving suite and a batch suite with one
  replica run to the end (exit 0);
* with every CPU held by other work, a serving suite and a batch suite fail within their
  bound (a few seconds here) with a message naming the cause, exit 1, no point left running;
* a replica asking for a resource no node has (a GPU, a custom resource) is refused at once.
"""

import json
import time
from pathlib import Path

import pytest
import yaml

from cluster.connect import replica_resources
from cluster.placement import (
    DEFAULT_READY_TIMEOUT_S,
    READY_TIMEOUT_ENV,
    PlacementConfig,
    PlacementError,
    default_ready_timeout_s,
    fit_share,
)
from tests.suite_helpers import serving_suite, tiny_suite, uniform
from workloads import sweep

OBJECT_STORE_BYTES = 80 * 1024 * 1024
BATCH = tiny_suite(
    "batch",
    policies=["full"],
    compression_ratios=[2],
    batch_sizes=[1, 2],
    prompt_tokens=[16],
    new_tokens=[4],
    seed=0,
    replicas=1,
)
SERVING = serving_suite(
    policies=["full"],
    compression_ratios=[2],
    mode="concurrency",
    loads=[1, 2],
    prompt_tokens=uniform(8, 16),
    new_tokens=uniform(2, 4),
    num_requests=3,
)


# -- units --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "amounts,replicas,share",
    [
        ([1, 1], 1, 1.0),  # two 1-CPU nodes: not the cluster's 2
        ([1, 1], 2, 1.0),
        ([1, 1], 3, 0.5),
        ([4, 2], 3, 2.0),  # 2 on the 4-CPU node, 1 on the 2-CPU node
        ([3], 2, 1.5),
        ([8], 1, 8.0),
        ([0, 2], 1, 2.0),
        ([], 1, 0.0),
    ],
)
def test_fit_share_is_the_largest_amount_every_replica_gets_on_one_node(amounts, replicas, share):
    assert fit_share(amounts, replicas) == pytest.approx(share)


class FakeRay:
    def __init__(self, nodes):
        self._nodes = [{"NodeID": f"n{i}", "Alive": True, "Resources": r} for i, r in enumerate(nodes)]

    def nodes(self):
        return self._nodes + [{"NodeID": "dead", "Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]

    def cluster_resources(self):
        raise AssertionError("the totals of the cluster must not size a replica")


@pytest.mark.parametrize(
    "nodes,replicas,device,expected",
    [
        ([{"CPU": 1.0}, {"CPU": 1.0}], 1, "cpu", (1, 1.0, 0.0)),  # not (2, 2.0, 0.0), which no node holds
        ([{"CPU": 2.0}], 2, "cpu", (1, 1.0, 0.0)),
        ([{"CPU": 3.0}], 2, "cpu", (1, 1.0, 0.0)),  # whole CPUs when they fit
        ([{"CPU": 1.0}], 2, "cpu", (1, 0.5, 0.0)),
        ([{"CPU": 16.0, "GPU": 1.0}, {"CPU": 16.0, "GPU": 1.0}], 2, "cuda", (16, 16.0, 1.0)),
        ([{"CPU": 8.0, "GPU": 1.0}], 2, "cuda", (4, 4.0, 0.5)),
    ],
)
def test_replica_resources_fit_the_nodes_that_exist(nodes, replicas, device, expected):
    assert replica_resources(FakeRay(nodes), replicas, device) == expected


def test_cuda_without_a_gpu_node_is_refused():
    from cluster.connect import ClusterError

    with pytest.raises(ClusterError, match="no GPU") as e:
        replica_resources(FakeRay([{"CPU": 4.0}]), 1, "cuda")
    assert e.value.code == 2


def test_ready_timeout_default_and_environment(monkeypatch):
    monkeypatch.delenv(READY_TIMEOUT_ENV, raising=False)
    assert default_ready_timeout_s() == DEFAULT_READY_TIMEOUT_S == 600.0
    assert PlacementConfig().ready_timeout_s == 600.0
    monkeypatch.setenv(READY_TIMEOUT_ENV, "7.5")
    assert PlacementConfig().ready_timeout_s == 7.5
    for bad in ("soon", "0", "-1", "inf"):
        monkeypatch.setenv(READY_TIMEOUT_ENV, bad)
        with pytest.raises(PlacementError, match=READY_TIMEOUT_ENV):
            default_ready_timeout_s()


# -- a real cluster of two 1-CPU nodes ------------------------------------------------------
@pytest.fixture(scope="module")
def one_cpu_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=1, object_store_memory=OBJECT_STORE_BYTES, node_ip_address="127.0.0.1", include_dashboard=False
        ),
    )
    try:
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        ray.cluster = cluster  # for the test that removes a node
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


def _run(tmp: Path, name: str, body: dict, run_id: str) -> tuple[int, Path, float]:
    suite = tmp / f"{name}.yaml"
    suite.write_text(yaml.safe_dump({"name": name, **body}))
    t0 = time.monotonic()
    rc = sweep.main([str(suite), "--results-dir", str(tmp / "r"), "--run-id", run_id, "--pushgateway", "off"])
    return rc, tmp / "r" / run_id, time.monotonic() - t0


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "points.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.ray
def test_serving_suite_fits_on_1_cpu_nodes(one_cpu_nodes, tmp_path, capsys):
    rc, run_dir, _ = _run(tmp_path, "serving-fit", SERVING, "s1")
    assert rc == 0, capsys.readouterr().err[-3000:]
    recs = _records(run_dir)
    assert [r["status"] for r in recs] == ["ok", "ok"]


@pytest.mark.ray
def test_batch_suite_fits_on_1_cpu_nodes(one_cpu_nodes, tmp_path, capsys):
    rc, run_dir, _ = _run(tmp_path, "batch-fit", BATCH, "b1")
    assert rc == 0, capsys.readouterr().err[-3000:]
    recs = _records(run_dir)
    assert [r["status"] for r in recs] == ["ok", "ok"] and {r["torch_threads"] for r in recs} == {1}


@pytest.fixture
def cpus_held(one_cpu_nodes):
    """Other work holding every CPU of the cluster (one 1-CPU actor per node) while the test runs."""
    ray = one_cpu_nodes

    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self):
            return True

    holders = [Holder.options(scheduling_strategy="SPREAD").remote() for _ in range(2)]
    assert ray.get([h.ping.remote() for h in holders], timeout=120) == [True, True]
    yield
    for h in holders:
        ray.kill(h)
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.mark.ray
def test_serving_replica_never_placed_fails_within_the_bound(cpus_held, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(READY_TIMEOUT_ENV, "4")
    rc, run_dir, took_s = _run(tmp_path, "serving-held", SERVING, "s2")
    err = capsys.readouterr().err
    assert rc == 1
    assert "not placed and loaded within 4 s" in err and "free now" in err, err[-2000:]
    assert took_s < 60
    assert _records(run_dir) == []


@pytest.mark.ray
def test_batch_replica_never_placed_fails_within_the_bound(cpus_held, tmp_path, capsys):
    rc, run_dir, took_s = _run(tmp_path, "batch-held", {**BATCH, "placement": {"ready_timeout_s": 4}}, "b2")
    err = capsys.readouterr().err
    assert rc == 1
    assert "not placed and loaded within 4 s" in err and "free now" in err, err[-2000:]
    assert took_s < 60


@pytest.mark.ray
def test_quality_replicas_never_placed_fail_within_the_bound(cpus_held, tmp_path, capsys):
    """The quality runner starts its replicas like the sweep (workloads.core.run.start_replicas): bounded the same way."""
    from workloads.quality import runner

    suite = tmp_path / "quality-held.yaml"
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "quality-held",
                "kind": "quality",
                "model": "tiny-llama",
                "dtype": "float32",
                "policies": ["full"],
                "replicas": 1,
                "perplexity": {"tokens": 16, "windows": 1},
                "placement": {"ready_timeout_s": 4},
            }
        )
    )
    t0 = time.monotonic()
    rc = runner.main([str(suite), "--results-dir", str(tmp_path / "r"), "--run-id", "q", "--pushgateway", "off"])
    err = capsys.readouterr().err
    assert rc == 1 and "not placed and loaded within 4 s" in err and "free now" in err, err[-2000:]
    assert time.monotonic() - t0 < 60


@pytest.mark.ray
@pytest.mark.parametrize(
    "placement,names",
    [
        ({"num_gpus": 1}, "GPU: asks 1, the largest node has 0"),
        ({"resources": {"nobody_has_this": 1}}, "nobody_has_this: asks 1, the largest node has 0"),
    ],
)
def test_a_resource_no_node_has_is_refused_at_once(one_cpu_nodes, tmp_path, capsys, placement, names):
    rc, run_dir, took_s = _run(tmp_path, "batch-never", {**BATCH, "placement": placement}, "b3")
    err = capsys.readouterr().err
    assert rc == 1 and names in err, err[-2000:]
    assert took_s < 60


@pytest.mark.ray
def test_a_replica_whose_node_leaves_fails_the_sweep_within_the_bound(one_cpu_nodes, tmp_path, capsys):
    """The replica's node (the only one with `node_b`) leaves mid-sweep; Ray cannot place the
    replica again, so the sweep stops after its bound (30 s here: room to start the replica's worker on a
    loaded machine) with exit 1, the point written
    before stays, and the message says the node left."""
    import threading

    cluster = one_cpu_nodes.cluster
    node = cluster.add_node(
        num_cpus=1, resources={"node_b": 1}, object_store_memory=OBJECT_STORE_BYTES, node_ip_address="127.0.0.1"
    )
    cluster.wait_for_nodes()
    body = {
        **BATCH,
        "batch_sizes": [1],
        # then long points within tiny-llama's 512-token context, so the sweep is still running when the node leaves
        "new_tokens": [4, *range(480, 496)],
        "placement": {"resources": {"node_b": 1}, "ready_timeout_s": 30, "max_restarts": 1},
    }
    out: dict = {}
    worker = threading.Thread(
        target=lambda: out.update(zip(("rc", "run_dir", "took_s"), _run(tmp_path, "node-leaves", body, "n1")))
    )
    worker.start()
    points = tmp_path / "r" / "n1" / "points.jsonl"
    from tests.waiting import wait_for

    try:
        wait_for(
            lambda: not worker.is_alive() or (points.exists() and points.read_text().count("\n") >= 1),
            240,
            "the first point",
        )
        assert worker.is_alive(), capsys.readouterr().err[-3000:]
        written = points.read_text()
        cluster.remove_node(node)
        t0 = time.monotonic()
        worker.join(timeout=180)
        took_s = time.monotonic() - t0
    finally:
        if node in cluster.worker_nodes:
            cluster.remove_node(node)
    assert not worker.is_alive()
    err = capsys.readouterr().err
    assert out["rc"] == 1, err[-3000:]
    assert took_s < 120, took_s
    assert points.read_text().startswith(written) and json.loads(written.splitlines()[0])["status"] == "ok"
    # the bound plus its polls, with room for a loaded machine (time measured: docs/performance.md)
    assert "left the cluster and Ray did not run the replica again within 30 s" in err, err[-3000:]
    assert "16 point(s) not run" in err


@pytest.mark.ray
def test_a_cluster_that_goes_away_ends_the_sweep_with_our_message_and_keeps_its_points(tmp_path):
    """A sweep on a `cluster-up` head (its own folder and free ports) whose head is stopped after the
    first point: the sweep exits 1 within the watch's bound (`cluster.supervise`, 15 s by default,
    where Ray alone ended it after 60 s with its own "Failed to connect to GCS" and nothing about the
    run), with our message naming the cluster's address, the points kept and `--resume`; the lines
    written before stay as they were and `error.json` says the same."""
    import os
    import subprocess
    import sys
    import tempfile

    from cluster import local_head
    from cluster.supervise import DEFAULT_GONE_AFTER_S, GONE_AFTER_ENV
    from tests.waiting import free_port, wait_for

    repo = Path(__file__).resolve().parents[2]
    root = Path(tempfile.mkdtemp(prefix="shg-"))
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(repo), SCISSORHANDS_PUSHGATEWAY="off")
    env.pop("RAY_ADDRESS", None)
    env.pop(GONE_AFTER_ENV, None)  # the default bound
    port = free_port()
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.local_head",
            "up",
            "--temp-dir",
            str(root / "ray"),
            "--port",
            str(port),
            "--dashboard-port",
            str(free_port()),
            "--metrics-export-port",
            str(free_port()),
            "--dashboard-agent-listen-port",
            str(free_port()),
            "--ray-client-server-port",
            str(free_port()),
            "--num-cpus",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        suite = tmp_path / "long.yaml"
        suite.write_text(yaml.safe_dump({"name": "long", **BATCH, "new_tokens": [4, 400, 401, 402]}))
        points = tmp_path / "r" / "gone" / "points.jsonl"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workloads.sweep",
                str(suite),
                "--address",
                f"127.0.0.1:{port}",
                "--results-dir",
                str(tmp_path / "r"),
                "--run-id",
                "gone",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: points.exists() and points.read_text().count("\n") >= 1, 240, "the first point")
            written = points.read_text()
            local_head.stop(root / "ray", timeout_s=10, log=lambda s: None)
            t0 = time.monotonic()
            _, err = proc.communicate(timeout=180)
            took_s = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 1, err[-3000:]
        # the bound plus a poll and the probe's timeout; Ray's own exit came after 60 s
        assert took_s < DEFAULT_GONE_AFTER_S + 20, (took_s, err[-3000:])
        assert "Failed to connect to GCS" not in err, err[-3000:]
        n_written = points.read_text().count("\n")  # what the file holds at exit: a point may land during the stop
        assert n_written >= written.count("\n") >= 1
        message = (
            f"sweep: error: the Ray cluster at 127.0.0.1:{port} is gone: its GCS at 127.0.0.1:{port} has not "
            f"accepted a connection for"
        )
        assert message in err, err[-3000:]
        assert f"the {n_written} point(s) written to {points} stay" in err and "--resume gone" in err, err[-3000:]
        assert points.read_text().startswith(written) and json.loads(written.splitlines()[0])["status"] == "ok"
        error = json.loads((points.parent / "error.json").read_text())
        assert error["exit_code"] == 1 and f"the Ray cluster at 127.0.0.1:{port} is gone" in error["error"]
    finally:
        local_head.stop(root / "ray", timeout_s=10, log=lambda s: None)
        import shutil

        shutil.rmtree(root, ignore_errors=True)
