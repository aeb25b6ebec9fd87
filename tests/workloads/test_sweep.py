"""The sweep end to end on the tiny model and 2 Ray replicas (loopback), resume, kill, missing model.

One local Ray cluster serves the whole module; the sweep joins it (in-process, or as a
subprocess through `--address`).
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from scissorhands.models import cpu_model_name
from tests.ray_helpers import local_ray
from tests.suite_helpers import tiny_batch
from workloads import sweep
from workloads.core.suite import tag_of

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
#: The fields every batch record has, written out here (not read from the code under test).
FIELDS = set(
    "batch_size budget_tokens budget_tokens_requested compression_ratio decode_s decode_step_s decode_tokens_per_s "
    "e2e_latency_s error finished_at_unix_s git_commit hostname input_tokens kv_cache_bytes model model_id new_tokens "
    "node_id output_throughput_tok_per_s output_tokens peak_rss_bytes point_id point_index policy policy_params "
    "prefill_s prompt_tokens ray_nodes replica_id run_id schema_version seed started_at_unix_s status torch_threads "
    "total_throughput_tok_per_s tpot_s ttft_s".split()
)
#: `full` only, at batch 1: one point per prompt and new-token shape.
FULL_AT_BATCH_1 = dict(policies=["full"], compression_ratios=[], batch_sizes=[1])


@pytest.fixture(scope="module")
def ray_address():
    import ray

    with local_ray():
        yield ray.get_runtime_context().gcs_address


def write_suite(path: Path, **overrides) -> str:
    path.write_text(yaml.safe_dump(tiny_batch(**overrides)))
    return str(path)


def lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def tiny_run(ray_address, tmp_path_factory):
    """One real sweep of 6 points on 2 replicas; returns (results dir, run dir, stdout, rc)."""
    tmp = tmp_path_factory.mktemp("sweep")
    suite = write_suite(tmp / "tiny.yaml")
    results = tmp / "results"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = sweep.main([suite, "--results-dir", str(results), "--run-id", "run1"])
    return tmp, results / "run1", out.getvalue(), rc


def test_sweep_records_every_point(tiny_run):
    tmp, run_dir, stdout, rc = tiny_run
    assert rc == 0
    recs = lines(run_dir / "points.jsonl")
    assert [r["point_index"] for r in recs] != [] and len(recs) == 6
    assert sorted(r["point_index"] for r in recs) == list(range(6))
    for r in recs:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["status"] == "ok" and r["error"] is None
        assert (
            r["schema_version"] == 2
            and r["kind"] == "batch"
            and r["run_id"] == "run1"
            and r["model_id"] == "tiny-llama"
        )
        assert len(r["git_commit"]) == 40 or r["git_commit"] == "unknown"
        assert r["input_tokens"] == r["batch_size"] * r["prompt_tokens"]
        assert r["output_tokens"] == r["batch_size"] * r["new_tokens"]
        assert 0 < r["prefill_s"] == r["ttft_s"] < 30
        assert len(r["decode_step_s"]) == r["new_tokens"] - 1
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch_size"] * 15 / r["decode_s"])
        assert r["total_throughput_tok_per_s"] > r["output_throughput_tok_per_s"] > 0
        assert 50 * 2**20 < r["peak_rss_bytes"] < 8 * 2**30
        assert r["torch_threads"] == 1  # 2 CPUs // 2 replicas
        assert r["ray_nodes"] and r["ray_nodes"][0]["resources"]["CPU"] == 2
        assert r["node_id"] == r["ray_nodes"][0]["node_id"]
        assert r["started_at_unix_s"] < r["finished_at_unix_s"]
    ids = {r["replica_id"] for r in recs}
    assert len(ids) == 2 and all(i.startswith("replica-") for i in ids)  # both replicas ran points
    by = {(r["policy"], r["compression_ratio"], r["batch_size"]): r for r in recs}
    for batch in (1, 4):
        full = by[("full", None, batch)]
        r2, r5 = by[("scissorhands", 2.0, batch)], by[("scissorhands", 5.0, batch)]
        # at 5x: ceil(80 / 5) = 16 raised to the budget floor (min_budget_tokens, recorded with the parameters)
        assert full["budget_tokens"] is None and r2["budget_tokens"] == 40 and r5["budget_tokens"] == 32
        assert r5["policy_params"]["history_window"] == 400 and r5["policy_params"]["effective_recent_window"] == 10
        assert r5["policy_params"]["min_budget_tokens"] == 32
        # 32/80 of full plus the bookkeeping (slot times + uint8 counts: 12 B per 128 B slot here)
        assert r5["kv_cache_bytes"] <= full["kv_cache_bytes"] * 32 / 80 * 1.15
        assert r5["kv_cache_bytes"] < r2["kv_cache_bytes"] < full["kv_cache_bytes"]


def test_sweep_writes_table_and_csv(tiny_run):
    tmp, run_dir, stdout, rc = tiny_run
    table = (run_dir / "table.md").read_text()
    assert stdout == table
    for header in (
        "policy",
        "ratio (x)",
        "budget (tok)",
        "prefill (s)",
        "TTFT (s)",
        "decode (tok/s)",
        "output (tok/s)",
        "KV cache (MiB)",
        "KV saved vs full (x)",
        "peak RSS (MiB)",
        "replica",
    ):
        assert header in table.splitlines()[2]
    conditions = table.splitlines()[0]
    resolved = lines(run_dir / "points.jsonl")[0]["dtype"]  # auto's probe may resolve either on a loaded machine
    assert resolved in ("float32", "bfloat16")
    assert (
        conditions.startswith(f"Conditions: model tiny-llama; dtype {resolved} (auto: ")
        and "1 torch thread(s)" in conditions
    )
    assert f"CPU {cpu_model_name()};" in conditions
    assert len([line for line in table.splitlines() if line.startswith("|")]) == 2 + 6  # contended points add a note
    csv_lines = (run_dir / "points.csv").read_text().splitlines()
    assert len(csv_lines) == 7 and csv_lines[0].startswith("schema_version,run_id,")
    assert json.loads((run_dir / "run.json").read_text())["suite"]["model"] == "tiny-llama"


def test_resume_of_a_finished_run_runs_nothing(tiny_run, capsys):
    tmp, run_dir, _, _ = tiny_run
    before = (run_dir / "points.jsonl").read_bytes()
    rc = sweep.main([str(tmp / "tiny.yaml"), "--results-dir", str(run_dir.parent), "--resume", "run1"])
    assert rc == 0
    assert (run_dir / "points.jsonl").read_bytes() == before
    assert "6 already done, 0 to run" in capsys.readouterr().err


def test_a_resume_runs_auto_in_the_dtype_the_runs_points_recorded(tiny_run, capsys):
    """The run's points were recorded in one resolved dtype, as on a machine resolving auto to the other one than
    these replicas' probe: the resume does not probe again, its last point runs in the recorded dtype with the
    recorded reason (before: it probed, and the sweep refused to mix the two, exit 2, or passed as the probe
    resolved under load)."""
    tmp, run_dir, _, _ = tiny_run
    recs = lines(run_dir / "points.jsonl")
    now = recs[0]["dtype"]  # what auto resolved to on these replicas
    assert recs[0]["dtype_requested"] == "auto" and recs[0]["dtype_reason"].startswith("auto:")
    other = "bfloat16" if now == "float32" else "float32"
    moved = run_dir.parent / "moved"  # as if recorded on a machine resolving `other`
    moved.mkdir()
    text = "".join(json.dumps({**r, "dtype": other}) + "\n" for r in recs[:-1])  # the last point still to run
    (moved / "points.jsonl").write_text(text)
    rc = sweep.main([str(tmp / "tiny.yaml"), "--results-dir", str(run_dir.parent), "--resume", "moved"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"dtype: 'auto' is '{other}', as this run's points recorded it" in err
    after = lines(moved / "points.jsonl")
    assert len(after) == len(recs) and (moved / "points.jsonl").read_text().startswith(text)
    assert after[-1]["status"] == "ok" and after[-1]["point_id"] == recs[-1]["point_id"]
    assert (after[-1]["dtype"], after[-1]["dtype_reason"]) == (other, recs[0]["dtype_reason"])


def test_new_run_with_an_existing_id_is_refused(tiny_run, capsys):
    tmp, run_dir, _, _ = tiny_run
    assert sweep.main([str(tmp / "tiny.yaml"), "--results-dir", str(run_dir.parent), "--run-id", "run1"]) == 2
    assert "--resume run1" in capsys.readouterr().err


def test_failed_point_is_recorded_and_the_sweep_goes_on(ray_address, tmp_path, capsys, monkeypatch):
    """A point that raises inside the replica becomes an `error` record; the others still run; exit 1.

    Validation catches bad parameters before any point runs, so the failing point is injected
    into the expansion: it sends the replica history_window=0, which the policy rejects there."""
    from workloads.batch import suite as suite_mod

    class BadPoint(suite_mod.BatchPoint):
        def spec(self):
            return dataclasses.replace(super().spec(), policy_params={"history_window": 0})

    real_points = suite_mod.BatchSuite.points
    monkeypatch.setattr(
        suite_mod.BatchSuite,
        "points",
        lambda self: [BadPoint(0, "scissorhands", {}, 1.5, None, 1, 8, 2, 0, "bad-0", {}), real_points(self)[0]],
    )
    suite = write_suite(tmp_path / "s.yaml", **FULL_AT_BATCH_1, prompt_tokens=[8], new_tokens=[2])
    rc = sweep.main([suite, "--results-dir", str(tmp_path / "results"), "--run-id", "f", "--replicas", "1"])
    assert rc == 1
    recs = sorted(lines(tmp_path / "results" / "f" / "points.jsonl"), key=lambda r: r["point_index"])
    assert [r["status"] for r in recs] == ["error", "ok"]
    assert "ValueError" in recs[0]["error"] and "history_window" in recs[0]["error"]
    assert recs[0]["replica_id"].startswith("replica-") and "prefill_s" not in recs[0]
    assert recs[1]["replica_id"] == recs[0]["replica_id"]  # the replica went on after the failed point
    assert "1 point(s) failed" in capsys.readouterr().err


def test_kill_during_point_3_then_resume_starts_at_3(ray_address, tmp_path):
    """a 3-point sweep killed during point 3 leaves points 1-2 complete; resume runs only point 3."""
    # dtype auto: the resume runs in the dtype the first two points recorded, never probed again (the probe on the
    # tiny model sits near its 1.2x threshold, so a loaded machine could resolve it otherwise)
    suite = write_suite(tmp_path / "s.yaml", **FULL_AT_BATCH_1, prompt_tokens=[16], new_tokens=[2, 3, 200])
    results = tmp_path / "results"
    points = results / "k" / "points.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workloads.sweep",
            suite,
            "--results-dir",
            str(results),
            "--run-id",
            "k",
            "--replicas",
            "1",
            "--address",
            ray_address,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if points.exists() and points.read_text().count("\n") >= 2:
                break
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started
    finally:
        proc.wait(timeout=30)
    recs = lines(points)
    assert [tag_of(r["point_id"]) for r in recs] == ["full-b1-p16-n2-s0", "full-b1-p16-n3-s0"]
    assert all(r["status"] == "ok" for r in recs)

    rc = sweep.main([suite, "--results-dir", str(results), "--resume", "k", "--address", ray_address])
    assert rc == 0
    recs = lines(points)
    assert [tag_of(r["point_id"]) for r in recs] == ["full-b1-p16-n2-s0", "full-b1-p16-n3-s0", "full-b1-p16-n200-s0"]
    assert recs[2]["output_tokens"] == 200
    assert recs[2]["dtype_requested"] == "auto" and recs[2]["dtype"] == recs[0]["dtype"]
    assert recs[2]["dtype_reason"] == recs[0]["dtype_reason"]


def test_missing_model_path_fails_and_keeps_points(tiny_run, capsys):
    """a replica whose model path does not exist -> exit non-zero, the error names the path,
    points already written stay."""
    tmp, run_dir, _, _ = tiny_run
    missing = str(tmp / "no-such-model")
    suite = write_suite(tmp / "missing.yaml", model=missing)
    before = (run_dir / "points.jsonl").read_bytes()
    rc = sweep.main([suite, "--results-dir", str(run_dir.parent), "--resume", "run1"])
    assert rc == 2  # resuming with another model: refused, naming it
    err = capsys.readouterr().err
    assert missing in err and "changed field(s) ['model']" in err
    rc = sweep.main([suite, "--results-dir", str(run_dir.parent), "--run-id", "run-missing"])
    assert rc == 1
    err = capsys.readouterr().err
    assert missing in err and "replica failed to start" in err
    assert (run_dir / "points.jsonl").read_bytes() == before
