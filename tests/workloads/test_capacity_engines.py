"""Capacity at an SLO (`mode: capacity`) with engine backends as series: ours and OpenVINO GenAI's rows (a stub in the
fast tier, tests/peer_stub.py; the real pipeline on the embedded model in the slow tier) searched on one grid, on the
same requests and arrival times, under one KV byte limit; an interrupted run resumes without probing a rate again."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import yaml

from scissorhands.testing import tiny_llama
from tests import peer_stub
from tests.suite_helpers import serving_suite, uniform
from workloads import sweep
from workloads.core.template import run_suite
from workloads.serving.pools import LocalReplicaPool
from workloads.serving.runner import ServingKind

OV_FULL = {"name": "full", "engine": "openvino"}
OV_EVICT = {"name": "openvino_eviction", "engine": "openvino", "params": {"start_size": 32, "recent_size": 32}}
SUITE = serving_suite(
    name="cap-peer",
    mode="capacity",
    dtype="float32",
    policies=["full", OV_FULL, OV_EVICT],
    compression_ratios=[4],
    prompt_tokens=uniform(8, 24),
    new_tokens=uniform(2, 4),
    capacity={"min_rate_req_per_s": 10, "max_rate_req_per_s": 160, "resolution": 1.0},  # 10, 20, 40, 80, 160
    # a TTFT the tiny model meets on a loaded CPU; the stub misses it above its rate (2 s late)
    slo={"ttft_s": 1.0, "tpot_s": 60.0},
    num_requests=3,
    kv_layout="paged",
    block_tokens=4,
    budget="per_request",
    scheduler="mixed",
    max_num_batched_tokens=64,
    kv_memory_limit={"full_sequences": 2},
)


@pytest.fixture(scope="module")
def tiny_model():
    torch.set_num_threads(1)
    return tiny_llama(0)


class StopsAt(LocalReplicaPool):
    """The in-process pool, killed (as Ctrl-C would) when the `kill_at`-th probe is configured; `configured` lists
    every probe's (engine, policy) in order."""

    def __init__(self, model, kill_at: int | None = None):
        super().__init__(1, "tiny-llama", model=model)
        self.kill_at, self.configured = kill_at, []

    def configure(self, engine_config, run_id=None):
        if len(self.configured) + 1 == self.kill_at:
            raise KeyboardInterrupt("killed during this probe")
        self.configured.append((engine_config.engine, engine_config.policy))
        super().configure(engine_config, run_id)


def _args(suite: str, results: Path, resume=None) -> argparse.Namespace:
    return argparse.Namespace(
        suite=suite,
        replicas=None,
        results_dir=str(results),
        run_id=None if resume else "run",
        resume=resume,
        address=None,
        pushgateway="off",
        set=[],
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_openvino_series_are_bisected_on_the_same_grid_requests_and_arrivals_as_ours_and_resume_after_a_kill(
    tmp_path, tiny_model, monkeypatch
):
    stub = peer_stub.install(monkeypatch, passes_up_to=40.0)
    path = tmp_path / "cap.yaml"
    path.write_text(yaml.safe_dump(SUITE))
    with pytest.raises(KeyboardInterrupt):  # killed during OpenVINO full's second probe (80 req/s)
        run_suite(_args(str(path), tmp_path / "r"), ServingKind(StopsAt(tiny_model, kill_at=5)))
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert [(r["engine"], r["load"], r["capacity_status"]) for r in recs] == [
        ("ours", 40, "searching"),
        ("ours", 80, "searching"),
        ("ours", 160, "at_least_max_rate"),
        ("openvino", 40, "searching"),
    ]
    pool = StopsAt(tiny_model)
    assert run_suite(_args(str(path), tmp_path / "r", resume="run"), ServingKind(pool)) == 0
    # no recorded probe runs again: OpenVINO full's 80 req/s, then its eviction's search
    assert pool.configured == [
        ("openvino", "full"),
        ("openvino", "openvino_eviction"),
        ("openvino", "openvino_eviction"),
    ]
    recs = _lines(tmp_path / "r" / "run" / "points.jsonl")
    assert len({r["point_id"] for r in recs}) == len(recs) == 7
    assert [(r["series"], r["load"], r["capacity_passed"]) for r in recs[3:]] == [
        ("capacity-openvino-full", 40, True),
        ("capacity-openvino-full", 80, False),
        ("capacity-openvino-openvino_eviction@cd48b9fd-r4", 40, True),
        ("capacity-openvino-openvino_eviction@cd48b9fd-r4", 80, False),
    ]
    for last in (recs[4], recs[6]):  # passes 40, misses 80 (every request 2 s late over a 1 s TTFT)
        assert (last["capacity_status"], last["capacity_req_per_s"], last["capacity_hi_req_per_s"]) == ("ok", 40, 80)
    assert recs[6]["slo_attainment"] == 0.0 and recs[5]["slo_attainment"] == 1.0
    # one KV byte limit for every series; the peer's preemptions are not counted (null), ours are
    assert len({r["kv_memory_limit_bytes"] for r in recs}) == 1 and recs[0]["kv_memory_limit_bytes"] > 0
    assert recs[0]["preemptions"] == 0 and all(r["preemptions"] is None for r in recs[3:])
    assert recs[5]["budget_tokens"] == 96  # OpenVINO's max_cache_size at ratio 4: ceil(28 / 4) = 7 -> 96
    # the same requests and arrival times at a rate, on each engine: one workload seed, the same prompt lengths
    at_40 = [r for r in recs if r["load"] == 40]
    assert len({r["load_config"]["seed"] for r in recs}) == 1
    assert len({(r["input_tokens"], r["scheduled_rate_req_per_s"]) for r in at_40}) == 1
    assert stub.seen[("full", 40.0)] == stub.seen[("openvino_eviction", 40.0)] and len(stub.seen[("full", 40.0)]) == 3
    table = (tmp_path / "r" / "run" / "table.md").read_text()
    assert "capacity-openvino-full" in table and "capacity-full" in table


# ---------------------------------------------------------------------------------------------- the real backend
@pytest.mark.slow
def test_a_local_capacity_run_of_the_real_openvino_pipeline_beside_ours_on_the_embedded_model(tmp_path):
    """The real path: ``--local``, the embedded model, ours full and OpenVINO GenAI's full cache and eviction, 2 requests
    a probe at 2 rates with an SLO every engine meets (600 s): each series passes both rates."""
    peer_stub.real_runtime_or_skip()
    doc = {
        **SUITE,
        "model": "embedded",
        "policies": ["full", OV_FULL, OV_EVICT],
        "compression_ratios": [5],
        "prompt_tokens": uniform(64, 128),
        "new_tokens": uniform(8, 16),
        "capacity": {"min_rate_req_per_s": 0.5, "max_rate_req_per_s": 1.0, "resolution": 1.0},
        "slo": {"ttft_s": 600.0, "tpot_s": 600.0},
        "num_requests": 2,
        "block_tokens": 16,
        "max_num_batched_tokens": 256,
    }
    path = tmp_path / "cap.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = tmp_path / "r"
    assert sweep.main([str(path), "--local", "--pushgateway", "off", "--results-dir", str(out), "--run-id", "run"]) == 0
    recs = _lines(out / "run" / "points.jsonl")
    assert [(r["engine"], r["policy"], r["load"]) for r in recs] == [
        ("ours", "full", 0.5),
        ("ours", "full", 1.0),
        ("openvino", "full", 0.5),
        ("openvino", "full", 1.0),
        ("openvino", "openvino_eviction", 0.5),
        ("openvino", "openvino_eviction", 1.0),
    ]
    assert all(r["status"] == "ok" and r["completed_requests"] == 2 and r["slo_attainment"] == 1.0 for r in recs)
    assert [r["capacity_status"] for r in recs[1::2]] == ["at_least_max_rate"] * 3
    assert len({r["kv_memory_limit_bytes"] for r in recs}) == 1
    for a, b, c in zip(recs[0::2], recs[2::2], recs[4::2]):  # per rate: the same requests, the same arrival times
        assert a["input_tokens"] == b["input_tokens"] == c["input_tokens"]
        assert a["scheduled_rate_req_per_s"] == b["scheduled_rate_req_per_s"] == c["scheduled_rate_req_per_s"]
    stats = recs[4]["replica_stats"][0]
    # ceil((128 + 16) / 5) = 29 -> 96: whole 32-token blocks, one evictable block above start + recent (32 + 32)
    assert stats["openvino_eviction"]["max_cache_size"] == recs[4]["budget_tokens"] == 96
    assert stats["openvino_max_cache_size_rounding"] == "ceil(144 / 5) = 29 -> 96 (32-token blocks)"
    assert stats["openvino_genai_version"].startswith("2026.")
