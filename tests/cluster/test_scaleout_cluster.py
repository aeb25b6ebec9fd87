"""Scale-out on a Ray cluster of two nodes on loopback (`ray.cluster_utils.Cluster`).

One module-scoped cluster: a head ("node_head": 1, "fake_gpu": 1, 2 CPUs, dashboard and job
server on) and a worker ("node_worker": 1, "fake_gpu": 2, 2 CPUs), 80 MB object stores, each
node exporting metrics on its own port. The custom resource `fake_gpu` stands in for GPUs.

* a sweep's replicas land on both nodes, and every point records its node;
* a replica that needs 2 "GPUs" lands whole on the node that has 2; one that needs 3 (the
  cluster has 3, but on two nodes) is refused at once, naming the resource;
* a replica process killed mid-sweep is replaced by Serve, the point in flight runs again, the
  sweep finishes with every point ok, and the lines written before the kill are unchanged;
* through `ray job submit`: a suite whose model path does not exist makes the job
  FAILED (exit 1), the points already written stay, the error names the path;
* both nodes' metrics reach Prometheus (when its binaries are installed).
"""

import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.suite_helpers import tiny_suite
from tests.waiting import free_port, wait_for

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
OBJECT_STORE_BYTES = 80 * 1024 * 1024


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    # (RAY_AUTH_MODE is "disabled" for the whole session, tests/conftest.py: the job's driver,
    # given an explicit address, never turns token auth on by itself)
    saved = {k: os.environ.get(k) for k in ("RAY_metrics_report_interval_ms", "RAY_TMPDIR")}
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # a temp dir of our own: this cluster's session files, its address file (which a job's
    # driver reads to find the cluster) and its Prometheus service-discovery file never replace,
    # or get mixed up with, those of another Ray on the machine
    temp_root = Path(f"/tmp/rso-{os.getpid()}")
    temp_root.mkdir(exist_ok=True)
    os.environ["RAY_TMPDIR"] = str(temp_root)
    dashboard_port, agent_port = free_port(), free_port()
    ports = {"head": free_port(), "worker": free_port()}
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=2,
            resources={"node_head": 1, "fake_gpu": 1},
            object_store_memory=OBJECT_STORE_BYTES,
            node_ip_address="127.0.0.1",
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=dashboard_port,
            dashboard_agent_listen_port=agent_port,
            metrics_export_port=ports["head"],
        ),
    )
    try:
        # the worker node gets a temp folder of its own, as a second machine would: sharing the head's, both
        # nodes' runtime-env agents unpacked a job's working dir into one folder, and once a job's driver lost a
        # module it was importing (FileNotFoundError under runtime_resources/working_dir_files/_ray_pkg_*)
        cluster.add_node(
            num_cpus=2,
            resources={"node_worker": 1, "fake_gpu": 2},
            object_store_memory=OBJECT_STORE_BYTES,
            node_ip_address="127.0.0.1",
            metrics_export_port=ports["worker"],
            temp_dir=str(temp_root / "worker"),
        )
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        wait_for(lambda: _port_open(agent_port), 120, "the head's job agent")  # jobs go through it
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        by_resource = {
            ("node_head" if "node_head" in n["Resources"] else "node_worker"): nid for nid, n in nodes.items()
        }
        yield {
            "cluster": cluster,
            "head": by_resource["node_head"],
            "worker": by_resource["node_worker"],
            "dashboard": f"http://127.0.0.1:{dashboard_port}",
            "metrics_ports": ports,
            "session_dir": Path(ray._private.worker._global_node.get_session_dir_path()),
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_root, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _suite(path: Path, **over) -> Path:
    data = tiny_suite(
        "batch",
        name="scaleout",
        compression_ratios=[2],
        batch_sizes=[1, 2],
        prompt_tokens=[8],
        new_tokens=[3],
        replicas=2,
        placement={"strategy": "STRICT_SPREAD", "num_cpus": 1},
    )
    data.update(over)
    import yaml

    path.write_text(yaml.safe_dump(data))
    return path


def _sweep(suite: Path, results: Path, *extra: str) -> int:
    from workloads import sweep

    return sweep.run(sweep.parse_args([str(suite), "--results-dir", str(results), *extra]))


def _records(results: Path, run_id: str) -> list[dict]:
    return [json.loads(line) for line in (results / run_id / "points.jsonl").read_text().splitlines()]


def test_replicas_land_on_both_nodes_and_the_sweep_completes(two_nodes, tmp_path):
    suite = _suite(tmp_path / "suite.yaml")
    assert _sweep(suite, tmp_path / "results", "--run-id", "spread") == 0
    recs = _records(tmp_path / "results", "spread")
    assert len(recs) == 4 and all(r["status"] == "ok" for r in recs)
    assert {r["node_id"] for r in recs} == {two_nodes["head"], two_nodes["worker"]}
    by_replica = {}
    for r in recs:
        by_replica.setdefault(r["replica_id"], set()).add(r["node_id"])
    assert len(by_replica) == 2 and all(len(n) == 1 for n in by_replica.values())  # each replica stays put
    assert all(r["node_ip"] == "127.0.0.1" and r["devices"] == ["cpu"] and r["accelerator_ids"] == [] for r in recs)
    assert all(r["kv_cache_bytes"] > 0 and r["output_tokens"] == r["batch_size"] * 3 for r in recs)
    assert len(recs[0]["ray_nodes"]) == 2


def test_multi_gpu_replica_stays_on_one_node(two_nodes):
    import ray

    from cluster.placement import PlacementError, parse_placement
    from cluster.replica_set import point_replicas

    rs = point_replicas(
        1,
        parse_placement({"num_cpus": 1, "resources": {"fake_gpu": 2}}),
        {"model_spec": "tiny-llama", "warmup": False},
        num_cpus=1,
        num_gpus=0,
        num_threads=1,
        app_name="multi-gpu-test",
    )
    try:
        rs.start()
        (info,) = rs.broadcast("info").values()
        assert info["node_id"] == two_nodes["worker"]  # the only node with 2 fake GPUs
        groups = [
            g
            for g in ray.util.placement_group_table().values()
            if g["state"] == "CREATED" and g["bundles"] == {0: {"CPU": 1.0, "fake_gpu": 2.0}}
        ]
        assert len(groups) == 1 and set(groups[0]["bundles_to_node_id"].values()) == {two_nodes["worker"]}
    finally:
        rs.shutdown()
    # 3 fake GPUs exist, but no node has 3: refused at once, before any replica starts
    too_big = point_replicas(
        1,
        parse_placement({"num_cpus": 1, "resources": {"fake_gpu": 3}}),
        {},
        num_cpus=1,
        num_gpus=0,
        num_threads=1,
        app_name="too-big-test",
    )
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match="fake_gpu: asks 3, the largest node has 2"):
        too_big.start()
    assert time.monotonic() - t0 < 10 and too_big.handle is None


def test_replica_killed_mid_sweep_is_restarted_and_nothing_written_is_lost(two_nodes, tmp_path):
    suite = _suite(
        tmp_path / "suite.yaml",
        replicas=1,
        batch_sizes=[1, 2, 3, 4, 5, 6, 7, 8],
        new_tokens=[48],
        placement={"num_cpus": 1, "max_restarts": 2, "max_task_retries": 1},
    )
    results = tmp_path / "results"
    points = results / "kill" / "points.jsonl"
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.setdefault("rc", _sweep(suite, results, "--run-id", "kill")))
    worker.start()
    first = wait_for(lambda: points.exists() and points.read_text().splitlines()[:1], 180, "the first point")
    victim = json.loads(first[0])["replica_pid"]
    os.kill(victim, signal.SIGKILL)  # the replica's process dies mid-sweep
    worker.join(timeout=300)
    assert not worker.is_alive()
    assert outcome["rc"] == 0
    lines = points.read_text().splitlines()
    assert lines[0] == first[0]  # written before the kill, unchanged
    recs = [json.loads(line) for line in lines]
    assert len(recs) == 16 and all(r["status"] == "ok" for r in recs)
    assert len({r["point_id"] for r in recs}) == 16
    replaced = [r for r in recs if r["replica_pid"] != victim]  # Serve's new replica ran the rest
    assert replaced and {r["replica_id"] for r in replaced}.isdisjoint({recs[0]["replica_id"]})


def test_missing_model_path_fails_the_job_and_keeps_written_points(two_nodes, tmp_path, capsys):
    """`make submit` against the head: the job is FAILED, earlier points stay, the error names the path."""
    from cluster import submit

    missing = "/nonexistent/scaleout-model"
    # the job's working dir: this repo's packages (links; Ray packs what they point to) + the suite
    work = tmp_path / "work"
    work.mkdir()
    for name in ("scissorhands", "cluster", "workloads"):
        (work / name).symlink_to(REPO / name, target_is_directory=True)
    suite = _suite(
        work / "missing-model.yaml",
        name="missing-model",
        model=missing,
        policies=["full"],
        batch_sizes=[1, 2],
        replicas=1,
        placement={"num_cpus": 1},
    )
    results = tmp_path / "results"
    run_dir = results / "missing-model"
    run_dir.mkdir(parents=True)
    earlier = json.dumps(
        {
            "point_id": "full-b1-p8-n3-s0",
            "status": "ok",
            "model": missing,
            "policy": "full",
            "batch_size": 1,
            "prompt_tokens": 8,
            "new_tokens": 3,
            "run_id": "missing-model",
        },
        sort_keys=True,
    )
    (run_dir / "points.jsonl").write_text(earlier + "\n")
    rc = submit.main(
        [
            str(suite),
            "--working-dir",
            str(work),
            "--address",
            two_nodes["dashboard"],
            "--results-dir",
            str(results),
            "--run-id",
            "missing-model",
            "--",
            "--resume",
            "missing-model",
        ]
    )
    assert rc == 1
    assert (run_dir / "points.jsonl").read_text() == earlier + "\n"  # the point written before stays
    job = json.loads((run_dir / "job.json").read_text())
    assert job["status"] == "FAILED" and job["submission_id"].startswith("sweep-missing-model-")
    error = json.loads((run_dir / "error.json").read_text())
    assert error["exit_code"] == 1
    assert f"FileNotFoundError: model: path does not exist: {missing}" in error["error"]
    assert missing in (run_dir / "job.log").read_text()
    assert "FAILED" in capsys.readouterr().err


def test_both_nodes_metrics_reach_prometheus(two_nodes, tmp_path):
    from dashboards import check, serve

    missing = [k for k, v in serve.binaries().items() if not v]
    if missing:
        pytest.skip(f"missing {', '.join(missing)} (apt-get install prometheus prometheus-pushgateway)")
    import ray

    sd_file = two_nodes["session_dir"] / "prom_metrics_service_discovery.json"
    targets = {f"127.0.0.1:{p}" for p in two_nodes["metrics_ports"].values()}
    wait_for(
        lambda: sd_file.exists() and targets <= set(json.loads(sd_file.read_text())[0]["targets"]),
        60,
        "both metrics ports in Ray's service-discovery file",
    )

    def record(run_id: str, replica: str) -> int:
        from replica.metrics import ReplicaMetrics

        m = ReplicaMetrics("full", None, replica, "tiny-llama", run_id)
        end = time.monotonic() + 6
        n = 0
        while time.monotonic() < end:
            m.set_running(2)
            m.add_generated_tokens(2)
            n += 1
            time.sleep(0.2)
        return n

    data_dir = tmp_path / "prom"
    prom_port, pg_port = free_port(), free_port()
    serve.up(data_dir, prom_port, pg_port, (str(sd_file),), "1s", install=False)
    try:
        prom = f"http://127.0.0.1:{prom_port}"
        run_id = f"scaleout-{os.getpid()}"
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        fn = ray.remote(num_cpus=0)(record)
        refs = [
            fn.options(resources={res: 0.01}).remote(run_id, f"replica-{res}") for res in ("node_head", "node_worker")
        ]
        assert all(n > 5 for n in ray.get(refs))
        series = wait_for(
            lambda: (
                len(check.query(prom, f'ray_scissorhands_running_sequences{{run_id="{run_id}"}}')) >= 2
                and check.query(prom, f'ray_scissorhands_running_sequences{{run_id="{run_id}"}}')
            ),
            60,
            "replica metrics of both nodes in Prometheus",
        )
        instances = {s["metric"]["instance"] for s in series}
        assert instances == targets
        up = check.query(prom, 'up{job="ray"} == 1')
        assert targets <= {s["metric"]["instance"] for s in up}
    finally:
        serve.down(data_dir)
