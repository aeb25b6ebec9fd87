"""`dtype: auto` is resolved once per run, not by each replica (workloads.core.run.resolve_run_dtype).

The probe is faked to answer differently on every call (tests/dtype_fakes.py), as a loaded machine's
probe did: on the code before this fix two replicas of one run loaded bfloat16 and float32.
"""

import json
from pathlib import Path

import pytest
import yaml

from tests.dtype_fakes import COUNTER_ENV, install_alternating_probe, probe_calls
from tests.ray_helpers import local_ray
from tests.suite_helpers import serving_suite, tiny_batch, uniform
from workloads.core import results as res


@pytest.fixture
def alternating_probe(tmp_path, monkeypatch):
    import scissorhands.models as models

    path = tmp_path / "probe-calls"
    monkeypatch.setenv(COUNTER_ENV, str(path))
    monkeypatch.setattr(models.dtype, "cpu_flags", models.dtype.cpu_flags)  # restored after the test
    monkeypatch.setattr(models.dtype, "probe_bfloat16_speedup", models.dtype.probe_bfloat16_speedup)
    install_alternating_probe()
    return path


def test_the_fake_probe_splits_replicas_that_resolve_on_their_own(alternating_probe):
    from replica.static_batch import ModelReplica

    a = ModelReplica("tiny-llama", dtype="auto", warmup=False).info()
    b = ModelReplica("tiny-llama", dtype="auto", warmup=False).info()
    assert (a["dtype"], b["dtype"]) == ("bfloat16", "float32")  # the fault this module's tests guard


def test_local_run_resolves_once_and_every_replica_runs_it(alternating_probe):
    from replica.static_batch import ModelReplica
    from workloads.batch.suite import BatchSuite
    from workloads.core.run import resolve_run_dtype

    suite = BatchSuite(
        kind="batch",
        name="t",
        model="tiny-llama",
        policies=["full"],
        batch_sizes=[1],
        prompt_tokens=[8],
        new_tokens=[2],
        dtype="auto",
    )
    resolved = resolve_run_dtype(suite)
    infos = [ModelReplica("tiny-llama", replica_id=f"r{i}", warmup=False, **resolved).info() for i in range(2)]
    assert probe_calls(alternating_probe) == 1
    assert [i["dtype"] for i in infos] == ["bfloat16", "bfloat16"]
    assert infos[0]["dtype_reason"] == infos[1]["dtype_reason"] == resolved["dtype_reason"]
    assert "bfloat16 2.00x float32's speed" in resolved["dtype_reason"]
    assert "resolved once for the run on host " in resolved["dtype_reason"]


def test_forced_dtype_needs_no_probe(alternating_probe):
    from cluster.dtype_probe import resolve_run_dtype

    assert resolve_run_dtype("tiny-llama", "float32") == {"dtype": "float32"}
    assert probe_calls(alternating_probe) == 0
    with pytest.raises(ValueError, match="dtype: expected one of"):
        resolve_run_dtype("tiny-llama", "fp8")


def test_serve_app_deployments_share_one_dtype(alternating_probe):
    from cluster.serve_app import build_serve_app

    app = build_serve_app("tiny-llama", ["full", "scissorhands:5"], tokenizer_spec=None)
    handles = app._bound_deployment.init_args[0]
    args = {m: h._bound_deployment.init_args for m, h in handles.items()}
    assert probe_calls(alternating_probe) == 1
    assert len(args) == 2
    assert {a[3] for a in args.values()} == {"bfloat16"}  # dtype
    reasons = {a[6] for a in args.values()}  # dtype_reason
    assert len(reasons) == 1 and "resolved once for the run" in reasons.pop()


@pytest.fixture(scope="module")
def ray_fake_probe(tmp_path_factory):
    """A local Ray cluster whose workers run the alternating probe; yields its counter file (emptied per test)."""
    import os

    counter = tmp_path_factory.mktemp("probe") / "probe-calls"
    before = os.environ.get(COUNTER_ENV)
    os.environ[COUNTER_ENV] = str(counter)
    setup = {
        "worker_process_setup_hook": "tests.dtype_fakes.install_alternating_probe",
        "env_vars": {COUNTER_ENV: str(counter)},
    }
    with local_ray(runtime_env=setup):
        yield counter
    if before is None:
        os.environ.pop(COUNTER_ENV, None)
    else:
        os.environ[COUNTER_ENV] = before


@pytest.mark.ray
def test_ray_sweep_two_replicas_run_one_dtype(tmp_path, ray_fake_probe):
    """A real sweep on 2 Ray replicas (tiny model): the probe runs once, in one Ray task, and every point
    records the same dtype and reason (before: each replica probed, bfloat16 on one, float32 on the other)."""
    from workloads import sweep

    counter = ray_fake_probe
    counter.unlink(missing_ok=True)
    suite = tmp_path / "tiny.yaml"
    suite.write_text(
        yaml.safe_dump(
            tiny_batch(compression_ratios=[5], batch_sizes=[1], prompt_tokens=[16], new_tokens=[4], dtype="auto")
        )
    )
    rc = sweep.main([str(suite), "--results-dir", str(tmp_path / "results"), "--run-id", "run1"])
    run_dir = Path(tmp_path / "results" / "run1")
    points = [json.loads(line) for line in (run_dir / "points.jsonl").read_text().splitlines()]
    assert rc == 0
    assert len(points) == 2 and len({p["replica_id"] for p in points}) == 2  # one point on each replica
    assert {p["dtype"] for p in points} == {"bfloat16"}
    assert probe_calls(counter) == 1  # one Ray task probed, no replica
    reasons = {p["dtype_reason"] for p in points}
    assert len(reasons) == 1 and "resolved once for the run on node " in reasons.pop()
    meta = json.loads((run_dir / "run.json").read_text())
    assert [d["dtype"] for d in meta["dtypes"]] == ["bfloat16"]


@pytest.mark.ray
def test_ray_serving_sweep_two_replicas_run_one_dtype(tmp_path, ray_fake_probe, monkeypatch):
    """A serving sweep on 2 Ray serving replicas: both load the dtype resolved once for the run."""

    from workloads import sweep
    from workloads.core.template import run_suite
    from workloads.serving import pools, runner

    counter = ray_fake_probe
    counter.unlink(missing_ok=True)
    started = []
    real_start = pools.ServeReplicaPool.start

    def start(self):  # every replica's info, not only the one start() asks
        infos = real_start(self)
        started.extend(self.rset.broadcast("info").values())
        return infos

    monkeypatch.setattr(pools.ServeReplicaPool, "start", start)
    suite = tmp_path / "s.yaml"
    suite.write_text(
        yaml.safe_dump(
            serving_suite(
                name="s",
                policies=["full"],
                mode="concurrency",
                loads=[1],
                prompt_tokens=uniform(8, 12),
                new_tokens=uniform(2, 3),
                num_requests=2,
                replicas=2,
                dtype="auto",
            )
        )
    )
    args = sweep.parse_args(
        [str(suite), "--results-dir", str(tmp_path / "r"), "--run-id", "run", "--pushgateway", "off"]
    )
    assert run_suite(args, runner.KIND) == 0
    assert len(started) == 2
    assert [i["dtype"] for i in started] == ["bfloat16", "bfloat16"]
    assert probe_calls(counter) == 1
    assert started[0]["dtype_reason"] == started[1]["dtype_reason"]
    assert "resolved once for the run on node " in started[0]["dtype_reason"]


def test_a_report_of_points_from_two_runs_that_resolved_two_dtypes_warns(tmp_path, capsys):
    def record(point_id: str, dtype: str) -> dict:
        reason = f"auto: CPU has avx512_bf16; bfloat16 {'2.00' if dtype == 'bfloat16' else '1.04'}x"
        return {"point_id": point_id, "status": "ok", "dtype": dtype, "dtype_requested": "auto", "dtype_reason": reason}

    points = tmp_path / "points.jsonl"
    points.write_text("".join(json.dumps(r) + "\n" for r in [record("a", "bfloat16"), record("b", "float32")]))
    rc = res.report_main("report", lambda run_dir, records: res.Report("table\n", ()), [str(tmp_path)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "warning: dtype 'auto' resolved to bfloat16 (1 points, e.g. a) and float32 (1 points, e.g. b)" in err
    assert res.mixed_dtypes([record("a", "float32"), record("b", "float32")]) is None


def test_a_resumed_run_keeps_the_dtype_its_points_recorded_where_the_probe_now_resolves_the_other(
    alternating_probe, tmp_path, capsys
):
    """A local run resolves auto to bfloat16 (the probe's first call); resumed, where the probe would now resolve
    float32 (its second call), it runs its last point in bfloat16 with the recorded reason, without probing (before:
    it probed again, and the sweep refused the resume, as `check_resolved_dtype` refuses a mix). A suite that now
    names a dtype is still refused, naming ``dtype``."""
    from workloads import sweep

    path = tmp_path / "tiny.yaml"
    path.write_text(
        yaml.safe_dump(tiny_batch(policies=["full"], compression_ratios=[], batch_sizes=[1], new_tokens=[2, 3]))
    )
    args = [str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "results")]
    assert sweep.main([*args, "--run-id", "r"]) == 0
    points = tmp_path / "results" / "r" / "points.jsonl"
    first, second = points.read_text().splitlines(keepends=True)
    points.write_text(first)  # the second point still to run
    recorded = json.loads(first)
    assert recorded["dtype"] == "bfloat16" and probe_calls(alternating_probe) == 1
    capsys.readouterr()

    assert sweep.main([*args, "--resume", "r"]) == 0
    records = res.read_records(str(points))
    assert len(records) == 2 and probe_calls(alternating_probe) == 1  # not probed again
    assert [(r["dtype"], r["dtype_reason"]) for r in records] == [(recorded["dtype"], recorded["dtype_reason"])] * 2
    assert "dtype: 'auto' is 'bfloat16', as this run's points recorded it" in capsys.readouterr().err

    path.write_text(
        yaml.safe_dump(
            tiny_batch(policies=["full"], compression_ratios=[], batch_sizes=[1], new_tokens=[2, 3], dtype="float32")
        )
    )
    points.write_text(first)
    assert sweep.main([*args, "--resume", "r"]) == 2
    assert "changed field(s) ['dtype'] (dtype: 'auto' -> 'float32')" in capsys.readouterr().err
    assert points.read_text() == first and probe_calls(alternating_probe) == 1


def test_a_resumed_serving_run_keeps_the_dtype_its_points_recorded(alternating_probe, tmp_path):
    """As for a batch run, through the serving runner's own replica pool: the resumed run's last point runs in the
    bfloat16 its first point recorded, the probe not asked again (it would answer float32)."""
    from workloads import sweep

    path = tmp_path / "s.yaml"
    suite = serving_suite(
        name="s",
        policies=["full"],
        mode="concurrency",
        loads=[1, 2],
        prompt_tokens=uniform(8, 12),
        new_tokens=uniform(2, 3),
        num_requests=2,
        dtype="auto",
    )
    path.write_text(yaml.safe_dump(suite))
    args = [str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r")]
    assert sweep.main([*args, "--run-id", "s"]) == 0
    points = tmp_path / "r" / "s" / "points.jsonl"
    first = points.read_text().splitlines(keepends=True)[0]
    points.write_text(first)
    assert sweep.main([*args, "--resume", "s"]) == 0
    records = res.read_records(str(points))
    assert len(records) == 2 and probe_calls(alternating_probe) == 1
    assert [r["dtype"] for r in records] == ["bfloat16", "bfloat16"]
    assert records[0]["dtype_reason"] == records[1]["dtype_reason"]
