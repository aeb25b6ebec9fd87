"""Serving sweeps (workloads.serving.runner): in-process replicas on the tiny model, and fake pools.

Covers: concurrency and max-batch suites end to end (records with n, table, plots), a sweep killed
during point 3 (resume starts at point 3), a missing model path (non-zero, points kept, path
named), every request failing (summary written, nulls, non-zero), OOM points recorded and the
sweep goes on, a dead replica restarted and its point marked failed, saturation stops a series.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.serving_fakes import FakeReplica, OneReplicaPool, Script
from tests.suite_helpers import serving_suite, uniform
from workloads import sweep
from workloads.core.suite import SuiteError
from workloads.core.template import run_suite
from workloads.kinds import load_suite
from workloads.serving.point import point_outcome
from workloads.serving.pools import LocalReplicaPool
from workloads.serving.runner import KIND as SERVING
from workloads.serving.runner import ServingKind

BASE = serving_suite(
    policies=["full", {"name": "scissorhands", "params": {"min_budget_tokens": 0}}],  # short requests: no floor
    compression_ratios=[2],
    prompt_tokens=uniform(8, 24),
    new_tokens=uniform(2, 8),
    num_requests=6,
    warmup_requests=1,
)


def _suite(tmp: Path, name="s", **kw) -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, **BASE, **kw}))
    return str(path)


def _args(suite: str, results: Path, run_id="run", resume=None) -> argparse.Namespace:
    return argparse.Namespace(
        suite=suite,
        replicas=None,
        results_dir=str(results),
        run_id=None if resume else run_id,
        resume=resume,
        address=None,
        pushgateway="off",
    )


def _lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(x) for x in text.splitlines()]


@pytest.fixture(scope="module")
def tiny_model():
    torch.set_num_threads(1)
    from scissorhands.testing import tiny_llama

    return tiny_llama(0)


class CountingPool(LocalReplicaPool):
    """In-process replicas that count configure calls and can die (KeyboardInterrupt) at call k."""

    def __init__(self, model, kill_at: int | None = None):
        super().__init__(1, "tiny-llama", model=model)
        self.configured, self.kill_at = 0, kill_at

    def configure(self, cfg, run_id=None):
        self.configured += 1
        if self.configured == self.kill_at:
            raise KeyboardInterrupt("killed during this point")
        super().configure(cfg, run_id)


def test_concurrency_suite_records_every_point_with_metrics_table_and_plots(tmp_path, tiny_model):
    suite = _suite(tmp_path, mode="concurrency", loads=[1, 4], slo={"ttft_s": 600, "tpot_s": 600})
    rc = run_suite(_args(suite, tmp_path / "r"), ServingKind(CountingPool(tiny_model)))
    assert rc == 0
    run = tmp_path / "r" / "run"
    recs = _lines(run / "points.jsonl")
    assert [r["point_id"] for r in recs] == [p.point_id for p in load_suite(suite).points()]
    for r in recs:
        assert r["status"] == "ok" and r["stop_reason"] == "count"
        assert r["sent_requests"] == 6 and r["completed_requests"] == 6 and r["warmup_requests"] == 1
        assert r["ttft_n"] == 6 and r["ttft_p99_low_confidence"] is True and r["ttft_p50_s"] > 0
        assert r["output_throughput_tok_per_s"] > 0 and r["kv_cache_bytes"] > 0
        # the suite's SLO (generous: every request meets it) judged every measured request of the point
        assert (r["slo_ttft_s"], r["slo_tpot_s"], r["slo_e2e_latency_s"]) == (600.0, 600.0, None)
        assert (r["slo_requests"], r["slo_met_requests"], r["slo_attainment"]) == (6, 6, 1.0)
        assert r["goodput_req_per_s"] == r["request_throughput_req_per_s"] > 0  # count-bound: all end inside
        # goodput: the measured requests' tokens; throughput: every token inside the window (a warm-up still running)
        assert r["goodput_tok_per_s"] == pytest.approx(r["output_tokens"] / r["window_s"])
        assert r["output_throughput_tok_per_s"] == pytest.approx(r["window_output_tokens"] / r["window_s"])
        assert (
            r["window_output_tokens"] >= r["output_tokens"]
            and r["goodput_tok_per_s"] <= r["output_throughput_tok_per_s"]
        )
        assert r["ttft_p95_s"] >= r["ttft_p90_s"] and r["ttft_p95_low_confidence"] is True  # 6 < 20 samples
        assert r["git_commit"] and r["schema_version"] and r["model"] == "tiny-llama"
        assert r["replica_id"] == "local-0" and r["replica_ids"] == ["local-0"]  # the header names the replica
        # the suite's dtype "auto", resolved: what the replica runs in and why
        assert (r["dtype_requested"], r["dtype"], r["dtype_reason"]) == ("auto", "float32", "given model")
    assert json.loads((run / "run.json").read_text())["dtypes"] == [
        {"dtype": "float32", "dtype_requested": "auto", "dtype_reason": "given model"}
    ]
    assert [r["concurrency"] for r in recs] == [1, 4, 1, 4]  # the pushed series' labels
    assert recs[1]["achieved_peak_concurrency"] == 4 and max(recs[1]["peak_running_sequences_per_replica"]) >= 2
    assert recs[2]["budget_tokens"] == 16  # ceil((24 + 8) / 2)
    table = (run / "table.md").read_text()
    assert "TTFT p50/p90/p95/p99 (ms)" in table and "SLO attainment" in table and "goodput (tok/s)" in table
    assert "1.000 (n=6)" in table and "SLO per request: TTFT <= 600000 ms, TPOT <= 600000 ms" in table
    assert (run / "pareto_tokens_per_user.png").stat().st_size > 1000


def test_the_serving_table_prints_latencies_in_ms_with_p95_flags_attainment_with_n_and_the_slo():
    from workloads.serving.report import table_markdown

    rec = {
        "point_index": 0,
        "series": "rate-full",
        "load": 2.0,
        "completed_requests": 19,
        "sent_requests": 20,
        **{f"ttft_{p}_s": v for p, v in (("p50", 0.0123), ("p90", 0.0456), ("p95", 0.05), ("p99", 0.0601))},
        **{f"tpot_{p}_s": v for p, v in (("p50", 0.004), ("p90", 0.0045), ("p95", 0.0047), ("p99", 0.0049))},
        "ttft_p90_low_confidence": False,
        "ttft_p95_low_confidence": False,
        "ttft_p99_low_confidence": True,  # 20 samples: p99 only
        "tpot_p99_low_confidence": True,
        "slo_attainment": 0.9,
        "slo_requests": 20,
        "goodput_req_per_s": 1.8,
        "goodput_tok_per_s": 57.6,
        "slo_ttft_s": 2.0,
        "slo_tpot_s": 0.1,
        "slo_e2e_latency_s": None,
        "status": "ok",
    }
    table = table_markdown([rec])
    header, _, row = table.splitlines()[2:5]
    cells = dict(zip([h.strip() for h in header.split("|")[1:-1]], [c.strip() for c in row.split("|")[1:-1]]))
    assert cells["TTFT p50/p90/p95/p99 (ms)"] == "12.3/45.6/50/60.1*"
    assert cells["TPOT p50/p90/p95/p99 (ms)"] == "4/4.5/4.7/4.9*"
    assert cells["SLO attainment"] == "0.900 (n=20)"
    assert (cells["goodput (req/s)"], cells["goodput (tok/s)"]) == ("1.800", "57.6")
    assert "(s)" not in header.split("e2e")[0]  # no latency before e2e is printed in seconds
    assert "SLO per request: TTFT <= 2000 ms, TPOT <= 100 ms" in table
    assert "p95 below 20" in table


def test_serving_record_header_names_every_replica_and_node_that_answered():
    from workloads.core.template import Finished

    def where(info, stats):
        return SERVING.replica_fields(Finished(None, "ok", {"replica_stats": stats}, None, info, 0.0, 0.0))

    stats = [
        {"replica_id": "serving#b", "node_id": "n2", "hostname": "h"},
        {"replica_id": "serving#a", "node_id": "n1", "hostname": "h"},
    ]
    fields = where({"dtype": "float32", "dtype_reason": "r", "replica_id": "serving#a", "hostname": "h"}, stats)
    assert (fields["replica_id"], fields["node_id"], fields["hostname"], fields["dtype"]) == (
        "serving#a,serving#b",
        "n1,n2",
        "h",
        "float32",
    )
    assert where({"replica_id": "x"}, [])["replica_id"] == "x"  # no reply (every request failed early)


def test_max_batch_suite_finds_and_verifies_the_largest_batch_per_policy(tmp_path, tiny_model):
    suite = _suite(
        tmp_path,
        mode="max_batch",
        prompt_tokens=40,
        new_tokens=10,
        compression_ratios=[5],
        kv_memory_limit_bytes=6 * 50 * 528,
        rounds=1,
    )
    rc = run_suite(_args(suite, tmp_path / "r"), ServingKind(CountingPool(tiny_model)))
    assert rc == 0
    full, sh = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert full["max_batch_size"] == 6  # limit / (50 preallocated slots * 528 B)
    assert sh["max_batch_size"] >= 3 * full["max_batch_size"]
    for r in (full, sh):
        assert r["max_batch_verified"] is True and r["batch_size"] == r["max_batch_size"]
        assert (r["prompt_tokens"], r["new_tokens"]) == (40, 10)
        assert max(r["peak_running_sequences_per_replica"]) == r["max_batch_size"]
        assert r["kv_cache_bytes"] <= 6 * 50 * 528
    assert (tmp_path / "r" / "run" / "throughput_vs_batch.png").exists()


def test_L7_killed_during_point_3_keeps_points_1_and_2_and_resume_starts_at_point_3(tmp_path, tiny_model):
    suite = _suite(tmp_path, mode="concurrency", loads=[1, 2, 3], policies=["full"])
    with pytest.raises(KeyboardInterrupt):
        run_suite(_args(suite, tmp_path / "r"), ServingKind(CountingPool(tiny_model, kill_at=3)))
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert [r["load"] for r in recs] == [1, 2] and all(r["status"] == "ok" for r in recs)
    pool = CountingPool(tiny_model)
    assert run_suite(_args(suite, tmp_path / "r", resume="run"), ServingKind(pool)) == 0
    assert pool.configured == 1  # only point 3 ran again
    assert [r["load"] for r in _lines(tmp_path / "r" / "run" / "points.jsonl")] == [1, 2, 3]


def test_L13_missing_model_path_exits_non_zero_names_the_path_and_keeps_points(tmp_path, tiny_model, capsys):
    suite = _suite(tmp_path, mode="concurrency", loads=[1, 2], policies=["full"])
    run_suite(_args(suite, tmp_path / "r"), ServingKind(CountingPool(tiny_model)))
    before = (tmp_path / "r" / "run" / "points.jsonl").read_text()
    missing = tmp_path / "no-such-model"
    bad = _suite(tmp_path, mode="concurrency", loads=[1, 2, 4], policies=["full"], model=str(missing))
    with pytest.raises(sweep.SweepError) as e:  # resuming the run with another model: refused, nothing run
        run_suite(_args(bad, tmp_path / "r", resume="run"), ServingKind(LocalReplicaPool(1, str(missing))))
    assert e.value.code == 2 and "['model']" in str(e.value) and str(missing) in str(e.value)
    assert (tmp_path / "r" / "run" / "points.jsonl").read_text() == before
    with pytest.raises(sweep.SweepError) as e:  # a new run with replicas that cannot load
        run_suite(_args(bad, tmp_path / "r", run_id="run2"), ServingKind(LocalReplicaPool(1, str(missing))))
    assert e.value.code == 1 and str(missing) in str(e.value)
    assert (tmp_path / "r" / "run" / "points.jsonl").read_text() == before


def test_sweep_main_hands_serving_suites_over_and_reports_their_errors(tmp_path, capsys):
    assert sweep.main([_suite(tmp_path, mode="rate", loads=[0]), "--results-dir", str(tmp_path / "r")]) == 2
    assert "loads[0]" in capsys.readouterr().err


class FakePool(OneReplicaPool):
    """A pool of one scripted fake replica; `behaviour(point_index)` -> 'ok' | 'oom' | 'die' | 'fail'."""

    def __init__(self, behaviour):
        self.behaviour, self.configured, self.restarted = behaviour, -1, []

    def configure(self, cfg, run_id=None):
        self.configured += 1
        kind = self.behaviour(self.configured)

        class RayActorError(Exception):
            pass

        def script(req):
            if kind == "oom":
                return Script(ttft_s=0.001, error_kind="oom")
            if kind == "fail":
                return Script(ttft_s=0.001, raises=RuntimeError("boom"))
            if kind == "die" and not req.request_id.endswith("-0"):
                return Script(ttft_s=0.001, raises=RayActorError("The actor died unexpectedly"))
            if kind == "slow":
                return Script(ttft_s=0.05, gap_s=0.001)
            if kind == "hang":  # never answers within the suite's request_timeout_s
                return Script(ttft_s=30.0)
            return Script(ttft_s=0.001, gap_s=0.0005)

        self.kind, self.replica = kind, FakeReplica(script=script, clock=time.time)

    def stats(self, reset=False):
        return [
            {
                "replica_id": "fake-0",
                "peak_running_sequences": self.replica.peak_running,
                "peak_kv_cache_bytes": 1000,
                "budget_tokens": None,
                "slot_bytes": 10,
                "kv_memory_limit_bytes": None,
            }
        ]

    def restart_dead(self):
        if self.kind == "die":
            self.restarted.append("fake-0")
            return ["fake-0"]
        return []


def test_oom_point_is_recorded_and_a_dead_replica_is_restarted_with_its_point_failed(tmp_path):
    suite = _suite(tmp_path, mode="concurrency", loads=[1, 2, 3], saturation={"max_error_rate": None})
    pool = FakePool(lambda i: {1: "oom", 2: "die"}.get(i, "ok"))
    rc = run_suite(_args(suite, tmp_path / "r"), ServingKind(pool))
    assert rc == 1  # a failed point
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    # full: ok, oom, then no higher load (skipped); scissorhands: the replica died at load 1, goes on
    assert [r["status"] for r in recs] == ["ok", "oom", "skipped", "error", "ok", "ok"]
    assert recs[2]["stop_reason"] == "saturated at load 2: out of memory"
    recs = recs[:2] + recs[3:]
    assert recs[1]["stop_reason"] == "out of memory" and recs[1]["errors_by_kind"] == {"oom": 6}
    assert recs[2]["stop_reason"] == "replica died" and "restarted" in recs[2]["error"]
    assert pool.restarted == ["fake-0"] and recs[3]["completed_requests"] == 6


def test_saturation_stops_raising_the_load_and_resume_keeps_the_skips(tmp_path):
    suite = _suite(
        tmp_path,
        mode="concurrency",
        loads=[1, 2, 4, 8],
        policies=["full"],
        saturation={"max_error_rate": None, "max_p50_ttft_s": 0.02},
    )
    pool = FakePool(lambda i: "slow" if i >= 1 else "ok")
    assert run_suite(_args(suite, tmp_path / "r"), ServingKind(pool)) == 0
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert [r["status"] for r in recs] == ["ok", "ok", "skipped", "skipped"]
    assert recs[2]["stop_reason"].startswith("saturated at load 2: p50 TTFT")
    assert pool.configured == 1
    pool2 = FakePool(lambda i: "ok")
    assert run_suite(_args(suite, tmp_path / "r", resume="run"), ServingKind(pool2)) == 0
    assert pool2.configured == -1  # nothing ran again


def test_a_rate_point_where_every_request_times_out_is_a_result_of_attainment_0_and_saturates_its_series(tmp_path):
    suite = _suite(
        tmp_path, mode="rate", loads=[50, 100, 200], policies=["full"], num_requests=5, request_timeout_s=0.05
    )
    pool = FakePool(lambda i: "hang" if i >= 1 else "ok")
    assert run_suite(_args(suite, tmp_path / "r"), ServingKind(pool)) == 0
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert [r["status"] for r in recs] == ["ok", "ok", "skipped"]
    timed_out = recs[1]
    assert (timed_out["slo_attainment"], timed_out["errors_by_kind"], timed_out["completed_requests"]) == (
        0.0,
        {"timeout": 5},
        0,
    )
    assert timed_out["rate_shortfall"] is True  # nothing completed of the rate offered
    assert recs[2]["stop_reason"].startswith("saturated at load 100: error rate 100%")
    assert pool.configured == 1  # resumed: nothing runs again
    pool = FakePool(lambda i: "ok")
    assert run_suite(_args(suite, tmp_path / "r", resume="run"), ServingKind(pool)) == 0 and pool.configured == -1


def test_L14_every_request_failing_writes_the_summary_and_exits_non_zero(tmp_path):
    suite = _suite(tmp_path, mode="rate", loads=[50], policies=["full"], num_requests=5)
    rc = run_suite(_args(suite, tmp_path / "r"), ServingKind(FakePool(lambda i: "fail")))
    assert rc == 1
    (r,) = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert r["status"] == "error" and r["stop_reason"] == "every request failed"
    assert (r["completed_requests"], r["failed_requests"], r["errors_by_kind"]) == (0, 5, {"error": 5})
    assert r["ttft_p50_s"] is None and r["e2e_latency_p99_s"] is None and r["ttft_n"] == 0
    assert "every request failed" in (tmp_path / "r" / "run" / "table.md").read_text()


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(mode="rate"), "loads"),
        (dict(mode="concurrency", loads=[4, 2]), "loads"),
        (dict(mode="max_batch"), "kv_memory_limit_bytes"),
        (dict(mode="max_batch", kv_memory_limit_bytes=10**6), "fixed lengths"),
        (dict(mode="rate", loads=[1], burstiness=0.5), "burstiness"),
        (dict(mode="rate", loads=[1], arrival="uniform"), "arrival"),
        (dict(mode="streaming", loads=[1]), "mode"),
    ],
)
def test_serving_suite_errors_name_the_field(tmp_path, kw, field):
    with pytest.raises(SuiteError, match=field):
        load_suite(_suite(tmp_path, **kw))


def test_a_local_serving_run_in_dtype_auto_records_the_reason_and_the_cpu(tmp_path):
    """`--local` runs the suite's one replica in this process with the dtype the run resolved once (`auto` here)."""
    suite = _suite(tmp_path, mode="concurrency", loads=[1], policies=["full"], num_requests=2, warmup_requests=0)
    out = tmp_path / "r"
    assert sweep.main([suite, "--local", "--results-dir", str(out), "--run-id", "run", "--pushgateway", "off"]) == 0
    (rec,) = _lines(out / "run" / "points.jsonl")
    assert rec["status"] == "ok" and rec["dtype_requested"] == "auto" and rec["dtype_reason"].startswith("auto: ")
    assert rec["cpu_model"] and f"CPU {rec['cpu_model']};" in (out / "run" / "table.md").read_text()


def test_a_point_with_requests_sent_none_completed_and_no_error_kind_is_an_error_not_attainment_0():
    outcome, warning = point_outcome(5, 0, {}, [])
    assert outcome["status"] == "error" and outcome["stop_reason"] == "every request failed"
    assert "5 request(s) sent, none completed" in outcome["error"] and warning is None
    outcome, warning = point_outcome(5, 0, {"timeout": 3, "overloaded": 2}, [])
    assert outcome == {"status": "ok", "error": None}
    assert warning.startswith("every request missed the SLO by timing out or being refused for load (")
    assert "overloaded: 2, timeout: 3" in warning
    outcome, _ = point_outcome(5, 0, {"timeout": 3, "error": 2}, [])
    assert (outcome["status"], outcome["error"]) == ("error", "error: 2, timeout: 3")
    assert point_outcome(5, 5, {}, []) == ({"status": "ok", "error": None}, None)
    assert point_outcome(0, 0, {}, []) == ({"status": "ok", "error": None}, None)  # nothing sent: an empty window
    assert point_outcome(5, 0, {"oom": 5}, [])[0]["status"] == "oom"
    assert point_outcome(5, 5, {}, ["fake-0"])[0]["stop_reason"] == "replica died"
