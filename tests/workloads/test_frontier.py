"""The throughput-quality frontier (`make frontier`, workloads/frontier): the Pareto rule, the suite, one point's
two measurements on one cache, and the whole path end to end on the tiny model (Ray, through `make`)."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scissorhands import POLICIES
from workloads.core import results as res
from workloads.core.suite import SuiteError
from workloads.frontier.report import frontier_rows, markdown, pareto_front
from workloads.frontier.suite import FrontierSuite
from workloads.kinds import load_suite, parse_suite

REPO = Path(__file__).resolve().parents[2]
TINY_SUITE = REPO / "tests" / "suites" / "tiny-frontier.yaml"


def test_pareto_front_keeps_exactly_the_undominated_points():
    # (output tok/s, perplexity): higher tok/s and lower perplexity are better
    points = [(10.0, 20.0), (30.0, 22.0), (25.0, 25.0), (30.0, 21.0), (5.0, 19.0), (10.0, 20.0), (5.0, 19.5)]
    # (30, 22) and (25, 25) lose to (30, 21); (5, 19.5) to (5, 19); the two equal (10, 20) both stay
    assert pareto_front(points) == [True, False, False, True, True, True, False]
    assert pareto_front([]) == []
    with pytest.raises(ValueError, match=r"points\[1\]"):
        pareto_front([(1.0, 2.0), (3.0, math.nan)])


def test_shipped_frontier_suite_runs_every_policy_at_each_ratio_and_full_once():
    suite = load_suite(str(REPO / "workloads" / "suites" / "frontier.yaml"))
    assert isinstance(suite, FrontierSuite)
    points = suite.points()
    evicting = [p for p in POLICIES if POLICIES[p].evicts]
    assert [(p.policy, p.compression_ratio) for p in points] == [
        (name, r) for name in POLICIES for r in ((None,) if name not in evicting else (2.0, 5.0))
    ]
    assert len({p.point_id for p in points}) == len(points)
    assert {(p.prompt_tokens, p.new_tokens, p.kv_limit_full_sequences) for p in points} == {(128, 32, 4)}
    assert suite.throughput == "capacity" and suite.capacity.probes == 4 and suite.num_requests == 16
    assert {p.perplexity_windows for p in points} == {4} and suite.quality_gate.max_perplexity_increase == 0.01
    quick = load_suite(str(REPO / "workloads" / "suites" / "frontier-quick.yaml"))
    assert quick.perplexity_windows == 4 and quick.quality_gate.max_perplexity_increase == 0.01


BASE = {  # the max-batch axis (capacity points: tests/workloads/test_frontier_capacity.py)
    "kind": "frontier",
    "throughput": "max_batch",
    "model": "tiny-llama",
    "policies": ["full", {"name": "scissorhands", "params": {"min_budget_tokens": 0}}],  # 32 tokens: no floor
    "compression_ratios": [4],
    "prompt_tokens": 24,
    "new_tokens": 8,
}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"kv_memory_limit": {"full_sequences": 2, "bytes": 1000}}, r"kv_memory_limit: give exactly one"),
        ({"kv_memory_limit": {}}, r"kv_memory_limit: give exactly one"),
        ({"budget_tokens": [8]}, r"budget_tokens: frontier suites compress by compression_ratios"),
        ({"prompt_tokens": 0}, r"prompt_tokens"),
        ({"perplexity_tokens": 64}, r"perplexity_tokens: unknown key"),
        ({"kv_memory_limit": {"bytes": 0}}, r"kv_memory_limit.bytes: Input should be greater than or equal to 1"),
    ],
)
def test_invalid_frontier_suites_name_the_field(change, message):
    with pytest.raises(SuiteError, match=message):
        parse_suite({**BASE, **change})


def test_point_ids_cover_the_limit_and_policy_parameters():
    a = parse_suite(BASE).points()
    b = parse_suite({**BASE, "kv_memory_limit": {"full_sequences": 3}}).points()
    c = parse_suite({**BASE, "policies": ["full", {"name": "scissorhands", "params": {"recent_window": 4}}]}).points()
    assert len({a[1].point_id, b[1].point_id, c[1].point_id}) == 3
    assert a[0].compression_ratio is None and a[1].compression_ratio == 4.0


def test_one_point_measures_both_numbers_on_one_cache(model):
    """Throughput at the max batch the limit admits (verified by running it) and perplexity with the same B."""
    from replica.common.types import EngineConfig
    from replica.engine import ContinuousBatchingEngine
    from scissorhands import budget_from_ratio
    from workloads.frontier.gate import perplexity_interval
    from workloads.frontier.point import run_frontier_point
    from workloads.quality.perplexity import heldout_windows, perplexity

    full_row_bytes = (
        ContinuousBatchingEngine(model, EngineConfig(max_length_tokens=32)).final_slots(24, 8)
        * ContinuousBatchingEngine(model, EngineConfig(max_length_tokens=32)).slot_bytes
    )
    points = parse_suite(BASE).points()
    full, sh = (run_frontier_point(model, None, p) for p in points)
    assert full["kv_memory_limit_bytes"] == sh["kv_memory_limit_bytes"] == 2 * full_row_bytes
    assert full["batch_size"] == 2 and full["budget_tokens"] is None
    assert sh["budget_tokens"] == sh["perplexity_budget_tokens"] == budget_from_ratio(32, 4) == 8
    assert sh["batch_size"] > full["batch_size"] and sh["max_batch_verified"] and full["max_batch_verified"]
    assert sh["kv_cache_bytes"] <= sh["kv_memory_limit_bytes"]
    assert sh["output_tokens"] == 8 * sh["batch_size"] and sh["output_throughput_tok_per_s"] > 0
    expected = perplexity(  # the default: 4 windows, each point's 95% interval across them
        model,
        heldout_windows(None, 32, 4, 0, vocab_size=model.config.vocab_size),
        "scissorhands",
        4.0,
        policy_params={"min_budget_tokens": 0},
    )
    assert sh["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-9) and sh["perplexity_tokens_scored"] == 128
    assert sh["perplexity_windows"] == 4
    assert sh["window_nll_per_token"] == pytest.approx([math.log(p) for p in expected["window_perplexity"]])
    assert (sh["perplexity_ci_low"], sh["perplexity_ci_high"]) == pytest.approx(
        perplexity_interval(sh["window_nll_per_token"])
    )
    assert sh["perplexity_ci_low"] < sh["perplexity"] < sh["perplexity_ci_high"]
    one = run_frontier_point(model, None, parse_suite({**BASE, "perplexity_windows": 1}).points()[1])
    assert one["perplexity_ci_low"] is None and one["perplexity_ci_high"] is None  # one window: no interval


def test_report_marks_the_frontier_in_the_table():
    def rec(pid, policy, ratio, tok_s, ppl):
        return {
            "point_id": pid,
            "status": "ok",
            "policy": policy,
            "compression_ratio": ratio,
            "budget_tokens": 8,
            "batch_size": 2,
            "output_throughput_tok_per_s": tok_s,
            "output_tok_per_cpu_s": tok_s / 2,
            "decode_tokens_per_s": tok_s,
            "perplexity": ppl,
            "kv_cache_bytes": 1 << 20,
            "max_batch_verified": True,
            "kv_memory_limit_bytes": 2 << 20,
            "prompt_tokens": 24,
            "new_tokens": 8,
            "perplexity_tokens_scored": 32,
            "dtype": "bfloat16",
        }

    rows = frontier_rows(
        [
            rec("a", "full", None, 10.0, 20.0),
            rec("b", "h2o", 4.0, 30.0, 25.0),
            rec("c", "tova", 4.0, 20.0, 26.0),
            {"point_id": "d", "status": "error", "error": "boom", "policy": "random"},
        ]
    )
    assert [(r["label"], r["on_frontier"]) for r in rows] == [
        ("h2o x4", True),
        ("tova x4", False),
        ("full", True),
        ("random", None),
    ]
    table = markdown(rows)
    # records without per-window NLLs (older runs): no intervals, the gate still judged on the point estimates
    assert (
        "| h2o x4 | bfloat16 | 8 | 2 | 30.0 | 15.00 | 30.0 | 25.000 | - | 1.2500 | fail | 1.00 | True | yes | - | ok |"
        in table
    )
    assert (
        "| tova x4 | bfloat16 | 8 | 2 | 20.0 | 10.00 | 20.0 | 26.000 | - | 1.3000 | fail | 1.00 | True |  | - | ok |"
        in table
    )
    assert "| random |" in table and "error: boom" in table and "Not one comparison" not in table


def test_points_of_another_dtype_get_their_own_frontier():
    """Measured: under load, `dtype: auto` resolved to bfloat16 on one replica and float32 on the other; a
    float32 point (its own KV limit in bytes) must not be ranked against the bfloat16 ones."""
    base = {
        "status": "ok",
        "policy": "h2o",
        "batch_size": 2,
        "kv_memory_limit_bytes": 100,
        "prompt_tokens": 24,
        "new_tokens": 8,
        "perplexity_tokens_scored": 32,
        "dtype": "bfloat16",
    }
    rows = frontier_rows(
        [
            dict(base, point_id="a", compression_ratio=2.0, output_throughput_tok_per_s=10.0, perplexity=20.0),
            dict(base, point_id="b", compression_ratio=5.0, output_throughput_tok_per_s=30.0, perplexity=19.0),
            dict(
                base,
                point_id="c",
                compression_ratio=4.0,
                output_throughput_tok_per_s=5.0,
                perplexity=21.0,
                dtype="float32",
                kv_memory_limit_bytes=200,
            ),
        ]
    )
    assert [(r["point_id"], r["on_frontier"]) for r in rows] == [("b", True), ("a", False), ("c", True)]
    first, conditions = markdown(rows).split("\n\n")[:2]
    assert first.startswith(
        "**No quality gate (output tok/s, bfloat16, 100 B, 24 + 8 tokens): no full-cache point finished"
    )
    assert conditions.startswith(
        "**Not one comparison: the points ran in 2 settings (throughput axis, dtype, KV limit in bytes, seed, prompt "
        "and new tokens, perplexity windows, capacity search): output tok/s, bfloat16, 100 B, 24 + 8 tokens; output "
        "tok/s, float32, 200 B, 24 + 8 tokens"
    )


@pytest.mark.ray
def test_make_frontier_end_to_end_on_the_tiny_model(tmp_path):
    """`make frontier` with a tiny suite: an embedded Ray, one replica, both points recorded through the one
    record builder, then frontier.png and table.md; the points equal the same suite run in this process."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = Path(sys.executable).parent.parent
    cmd = [
        "make",
        "-s",
        "-C",
        str(REPO),
        f"VENV={venv}",
        "-o",
        f"{venv}/.installed",
        "frontier",
        f"FRONTIER_SUITE={TINY_SUITE}",
        f"ARGS=--results-dir {tmp_path} --run-id e2e --pushgateway off",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "e2e"
    recs = res.read_records(str(run_dir / "points.jsonl"))
    assert [(r["kind"], r["policy"], r["status"]) for r in recs] == [
        ("frontier", "full", "ok"),
        ("frontier", "scissorhands", "ok"),
    ]
    replica_ids = {r["replica_id"] for r in recs}  # Serve's id of the one replica, on both
    assert len(replica_ids) == 1 and isinstance(replica_ids.pop(), str)
    assert [(r["capacity_status"], r["capacity_lo_req_per_s"]) for r in recs] == [("at_least_max_rate", 100.0)] * 2
    assert recs[1]["budget_tokens"] == 32 and recs[0]["budget_tokens"] is None  # ceil(32 / 4) = 8, floored to 32
    assert recs[1]["policy_params"]["effective_recent_window"] is not None  # build_record resolved them
    assert (run_dir / "frontier.png").stat().st_size > 10_000
    table = (run_dir / "table.md").read_text()
    assert (
        "| scissorhands x4 | float32 | 32 | ≥ 100 |" in table
        and "| full | float32 | - | ≥ 100 |" in table
        and table in out.stdout
    )
    assert json.loads((run_dir / "run.json").read_text())["suite"]["kind"] == "frontier"

    from workloads.frontier import runner

    assert (
        runner.main(
            [str(TINY_SUITE), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path), "--run-id", "local"]
        )
        == 0
    )
    local = res.read_records(str(tmp_path / "local" / "points.jsonl"))
    for a, b in zip(recs, local):
        assert a["point_id"] == b["point_id"] and a["capacity_probes"] == b["capacity_probes"] == 2
        assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-6)
