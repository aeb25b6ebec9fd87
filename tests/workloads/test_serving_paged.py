"""A serving suite on the paged KV layout with per-request budgets, run in process on the tiny model."""

from __future__ import annotations

import json

import yaml

from workloads import sweep
from workloads.serving.suite import ServingSuite

SUITE = """
kind: serving
name: paged-tiny
mode: concurrency
model: tiny-llama
dtype: float32
device: cpu
policies: [full, {name: scissorhands, params: {min_budget_tokens: 0}}]  # no floor: these requests are all short
compression_ratios: [4]
prompt_tokens: {dist: uniform, min: 8, max: 40}
new_tokens: {dist: uniform, min: 4, max: 40}
kv_layout: paged
block_tokens: 4
budget: per_request
kv_memory_limit_bytes: 40000
loads: [6]
num_requests: 12
warmup_requests: 0
seed: 0
replicas: 1
"""


def test_a_paged_serving_suite_records_its_layout_blocks_and_preemptions(tmp_path):
    path = tmp_path / "paged.yaml"
    path.write_text(SUITE)
    args = [str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "r"), "--run-id", "p"]
    assert sweep.main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "r" / "p" / "points.jsonl").read_text().splitlines()]
    assert [r["policy"] for r in records] == ["full", "scissorhands"]
    for r in records:
        assert r["status"] == "ok" and r["completed_requests"] == 12 and r["kv_layout"] == "paged"
        (stats,) = r["replica_stats"]
        assert stats["kv_layout"] == "paged" and stats["block_tokens"] == 4
        assert 0 < stats["peak_kv_blocks_in_use"] <= stats["kv_pool_blocks"]
        assert r["preemptions"] == stats["preemptions"] and r["recomputed_tokens"] == stats["recomputed_tokens"]
    full, sh = records
    assert sh["replica_stats"][0]["budget"] == "per_request"
    # the same requests for both series (a paired comparison); the full cache outgrows the pool and is preempted
    assert full["input_tokens"] == sh["input_tokens"]
    assert full["preemptions"] > 0 and sh["preemptions"] == 0


def test_a_mixed_scheduler_suite_runs_records_its_scheduler_and_keeps_the_older_point_ids(tmp_path):
    """The same suite file twice, the second with `--set` (a flag wins over the file, validated as the file is)."""
    path = tmp_path / "paged.yaml"
    path.write_text(SUITE)
    for name, extra in (("first", []), ("mixed", ["--set", "scheduler=mixed", "--set", "max_num_batched_tokens=16"])):
        args = [str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / name), "--run-id", "p"]
        assert sweep.main(args + extra) == 0
    first, mixed = (
        [json.loads(line) for line in (tmp_path / n / "p" / "points.jsonl").read_text().splitlines()]
        for n in ("first", "mixed")
    )
    assert [(r["scheduler"], r["max_num_batched_tokens"]) for r in first] == [("prefill_first", None)] * 2
    assert [(r["scheduler"], r["max_num_batched_tokens"]) for r in mixed] == [("mixed", 16)] * 2
    assert all(r["status"] == "ok" and r["completed_requests"] == 12 for r in first + mixed)
    # prefill_first adds nothing to a point's identity (ids written before `scheduler:` stay); mixed does
    assert "scheduler" not in first[0]["point_config"] and mixed[0]["point_config"]["scheduler"] == "mixed"
    assert first[0]["point_id"] != mixed[0]["point_id"]
    assert first[0]["input_tokens"] == mixed[0]["input_tokens"]  # the same requests under both schedulers


def test_a_mixed_scheduler_without_paged_blocks_or_below_one_block_exits_2_naming_the_field(tmp_path, capsys):
    path = tmp_path / "paged.yaml"
    path.write_text(SUITE)
    for sets, field in (
        (["scheduler=mixed", "kv_layout=preallocated"], "scheduler: 'mixed'"),
        (["scheduler=mixed", "max_num_batched_tokens=3"], "max_num_batched_tokens: 3 is below one block"),
        (["scheduler"], "--set: expected KEY=VALUE"),
        (["slo.ttft_s=-1"], "ttft_s"),
    ):
        args = [str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path)]
        assert sweep.main(args + [a for s in sets for a in ("--set", s)]) == 2
        assert field in capsys.readouterr().err
    assert not any(tmp_path.glob("*/points.jsonl"))  # nothing recorded


def test_a_mixed_suite_id_carries_the_token_budget_even_at_its_default():
    """The ids written when `scheduler: mixed` came in carry its token budget whatever its value (the generic rule,
    a knob joins an id only off its default, would drop it at 512); prefill_first carries neither key."""
    base = yaml.safe_load(SUITE)
    first = ServingSuite(**base).identity()
    mixed = ServingSuite(**base, scheduler="mixed").identity()
    tuned = ServingSuite(**base, scheduler="mixed", max_num_batched_tokens=64).identity()
    assert "scheduler" not in first and "max_num_batched_tokens" not in first
    assert (mixed["scheduler"], mixed["max_num_batched_tokens"]) == ("mixed", 512)
    assert (tuned["scheduler"], tuned["max_num_batched_tokens"]) == ("mixed", 64)
    assert {k: v for k, v in mixed.items() if k not in ("scheduler", "max_num_batched_tokens")} == first
