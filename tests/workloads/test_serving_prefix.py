"""Prefix caching in serving suites: a policy entry's own `enable_prefix_caching` (one series each, paired on the same
requests), the point record's prefix cache figures (`workloads.serving.point.prefix_cache_fields`), the report's hit
rate column, and workloads/suites/serving-prefix.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from workloads import sweep
from workloads.load.metrics import RequestRecord
from workloads.serving.point import prefix_cache_fields
from workloads.serving.report import sessions_markdown, table_markdown
from workloads.serving.suite import ServingSuite

ROOT = Path(__file__).resolve().parents[2]

SUITE = """
kind: serving
name: prefix-tiny
mode: sessions
model: tiny-llama
dtype: float32
device: cpu
policies: [{name: full, enable_prefix_caching: false}, {name: full, enable_prefix_caching: true}]
kv_layout: paged
block_tokens: 4
kv_memory_limit_bytes: 200000
sessions: {users: 2, turns: 2, message_tokens: 6, think_time_s: 0.05, system_prompt_tokens: 12}
new_tokens: 3
loads: [4]
warmup_requests: 0
seed: 0
replicas: 1
"""


def _record(prompt_tokens: int, cached: int | None, ok: bool = True, warmup: bool = False) -> RequestRecord:
    rec = RequestRecord("r", prompt_tokens, 2, send_time_s=0.0, warmup=warmup, cached_prompt_tokens=cached)
    if ok:
        rec.token_times_s, rec.output_tokens, rec.finish_time_s = [0.1, 0.2], 2, 0.2
    else:
        rec.error_kind = "error"
    return rec


def test_prefix_cache_fields_sum_the_replicas_and_the_measured_requests_and_are_null_without_the_cache():
    on = {"prefix_caching": True, "prefix_cache_hit_tokens": 48, "prefix_cache_miss_tokens": 16}
    stats = [on, {**on, "prefix_cache_hit_tokens": 0, "prefix_cache_miss_tokens": 32}]
    # the warm-up request and the failed one are left out of the per-request figures
    records = [_record(40, 32), _record(24, 0), _record(30, 16, warmup=True), _record(20, 8, ok=False)]
    assert prefix_cache_fields(stats, records) == {
        "prefix_cache_hit_tokens": 48,
        "prefix_cache_miss_tokens": 48,
        "prefix_cache_hit_rate": 0.5,
        "cached_prompt_tokens_sum": 32,
        "cached_prompt_share": 0.5,
    }
    off = prefix_cache_fields([{"prefix_caching": False, "prefix_cache_hit_tokens": None}], records)
    assert off == dict.fromkeys(off) and len(off) == 5
    assert set(prefix_cache_fields([{"engine": "openvino"}], records).values()) == {None}  # OpenVINO reports none
    nothing = prefix_cache_fields([{**on, "prefix_cache_hit_tokens": 0, "prefix_cache_miss_tokens": 0}], [])
    assert nothing["prefix_cache_hit_rate"] is None and nothing["cached_prompt_share"] is None


def test_the_report_shows_the_hit_rate_column_only_when_a_point_has_one():
    base = {"series": "s", "status": "ok", "point_index": 0}
    with_rate = table_markdown([{**base, "prefix_cache_hit_rate": 0.625}, {**base, "point_index": 1}])
    header = next(line for line in with_rate.splitlines() if line.startswith("| series"))
    assert "prefix cache hit rate" in header
    assert "0.625" in with_rate
    without = table_markdown([{**base, "prefix_cache_hit_rate": None}])
    assert "prefix cache hit rate" not in without


def test_a_policy_entry_sets_its_series_prefix_cache_on_the_same_requests():
    suite = ServingSuite(**yaml.safe_load(SUITE))
    points = suite.points()
    assert [p.series for p in points] == ["sessions-full-noprefix", "sessions-full+prefix"]
    assert [suite.engine_config(p).enable_prefix_caching for p in points] == [False, True]
    assert points[0].point_id != points[1].point_id
    assert suite.workload_seed(points[0]) == suite.workload_seed(points[1])  # paired: the same sessions


def test_a_policy_prefix_cache_outside_serving_or_not_a_boolean_exits_2_naming_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SUITE.replace("enable_prefix_caching: true", "enable_prefix_caching: maybe"))
    args = ["--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r")]
    assert sweep.main([str(bad), *args]) == 2
    err = capsys.readouterr().err
    assert "policies[1].enable_prefix_caching: Input should be a valid boolean, got 'maybe'" in err
    quality = tmp_path / "quality.yaml"
    quality.write_text(
        "kind: quality\nname: q\nmodel: tiny-llama\npolicies: [{name: full, enable_prefix_caching: true}]\n"
        "task: perplexity\n"
    )
    assert sweep.main([str(quality), *args]) == 2
    assert "policies[0].enable_prefix_caching: only a serving suite" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_a_prefix_series_records_its_hit_rate_and_cached_tokens_and_the_other_series_none(tmp_path):
    path = tmp_path / "prefix.yaml"
    path.write_text(SUITE)
    args = [str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r"), "--run-id", "p"]
    assert sweep.main(args) == 0
    run = tmp_path / "r" / "p"
    off, on = [json.loads(line) for line in (run / "points.jsonl").read_text().splitlines()]
    assert off["status"] == on["status"] == "ok" and off["completed_requests"] == on["completed_requests"] == 4
    assert off["input_tokens"] == on["input_tokens"]  # the same requests
    for k in ("prefix_cache_hit_rate", "prefix_cache_hit_tokens", "cached_prompt_tokens_sum", "cached_prompt_share"):
        assert off[k] is None, k
    (stats,) = on["replica_stats"]
    assert on["prefix_cache_hit_tokens"] == stats["prefix_cache_hit_tokens"] > 0
    assert on["prefix_cache_miss_tokens"] == stats["prefix_cache_miss_tokens"] > 0
    hit, miss = on["prefix_cache_hit_tokens"], on["prefix_cache_miss_tokens"]
    assert on["prefix_cache_hit_rate"] == pytest.approx(hit / (hit + miss))
    assert hit + miss == on["input_tokens"]  # no warm-up, no preemption: every measured prompt token once
    assert on["cached_prompt_tokens_sum"] == hit  # each request's own count sums to the engine's
    assert on["cached_prompt_share"] == pytest.approx(hit / on["input_tokens"])
    # every turn after the first shares at least the system prompt's 3 full blocks of 4 tokens
    assert hit >= 12 * (4 - 1)
    assert "prefix cache hit rate" in (run / "table.md").read_text()


def test_the_serving_prefix_suite_pairs_the_paged_full_cache_without_and_with_prefix_caching():
    raw = yaml.safe_load((ROOT / "workloads" / "suites" / "serving-prefix.yaml").read_text())
    suite = ServingSuite(**raw)
    points = suite.points()
    loads = sorted({p.load for p in points})
    for load in loads:
        off, on = [p for p in points if p.load == load]
        assert (off.policy, on.policy) == ("full", "full")
        assert [suite.engine_config(p).enable_prefix_caching for p in (off, on)] == [False, True]
        assert suite.engine_config(on).kv_layout == "paged"
        assert suite.workload_seed(off) == suite.workload_seed(on)
    assert suite.kv_memory_limit.full_sequences == 4 and suite.sessions.system_prompt_tokens == 128


def test_the_sessions_table_shows_session_state_reused_and_recomputed_tokens_and_hits_and_misses():
    turns = [{"turn": 0, "n": 2, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "tpot_p50_s": 0.01, "tpot_p99_s": 0.02}]
    base = dict(load=0.5, sessions=2, sessions_slo_met=2, session_slo_attainment=1.0, session_goodput_per_s=0.1,
                expected_reuse_tokens=100, cached_prompt_tokens=90, turns=turns)  # fmt: skip
    kept = dict(base, series="sessions-scissorhands+reuse-session_state-r5", point_index=1, session_reused_tokens=90,
                session_recomputed_tokens=7, session_state_hits=3, session_state_misses=1)  # fmt: skip
    none = dict(base, series="sessions-full", point_index=0)
    md = sessions_markdown([kept, none])
    head = md.splitlines()[2]
    assert "session state reused/recomputed (tok)" in head and "session state hits/misses (turns)" in head
    rows = {x.split("|")[1].strip(): [c.strip() for c in x.split("|")[2:-1]] for x in md.splitlines()[4:6]}
    assert rows["sessions-scissorhands+reuse-session_state-r5"][-2:] == ["90/7", "3/1"]
    assert rows["sessions-full"][-2:] == ["-", "-"]  # no kept state: not zero, not reported
    assert "Cached is below expected by design" in md
