"""The engine backend seam (replica/backends): a replica runs whichever backend ``EngineConfig.engine`` names, a
serving sweep takes the backend per policy entry, and its records say which engine served each point. A stub
backend (a plain class answering scripted tokens) stands in for a production engine."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import threading
import time

import pytest
import torch
import yaml

from replica import backends
from replica.backends import BACKENDS, EngineBackend
from replica.common.types import ConfigError, EngineConfig, GenerationRequest, GenerationResult, Refusal
from replica.continuous import ServingReplica
from replica.engine import ContinuousBatchingEngine
from replica.openvino_settings import eviction_from_policy, max_cache_size_for
from scissorhands import budget_from_ratio, cache_policy
from scissorhands.testing import tiny_llama
from tests.suite_helpers import serving_suite, uniform
from workloads.core.suite import SuiteError
from workloads.core.template import run_suite
from workloads.kinds import load_suite
from workloads.serving.pools import LocalReplicaPool
from workloads.serving.runner import ServingKind

#: Suite knobs both engines run alike: one block pool of the limit, one token budget a step.
PAGED = dict(kv_layout="paged", scheduler="mixed", kv_memory_limit={"bytes": 4_000_000})
OV = dict(engine="openvino", **{k: v for k, v in PAGED.items() if k != "kv_memory_limit"})


class _Queue:
    def __init__(self):
        self.lock = threading.Condition()

    def wake(self) -> None:
        with self.lock:
            self.lock.notify_all()


class ScriptedBackend:
    """Answers request ``i`` of a step with tokens ``1000, 1001, ...``, one per `step()`; nothing else."""

    FIRST_TOKEN = 1000

    def __init__(self, model, config, *, eos_token_id=None, clock=time.time, replica_id="replica-0", metrics=None):
        self.config, self.replica_id, self.clock = config, replica_id, clock
        self.kv_memory_limit_bytes, self.budget_tokens, self.slot_bytes = 4_000_000, None, None
        self.queue = _Queue()
        self.pending: list[tuple] = []
        self.live: dict[str, tuple] = {}
        self.ends: set[str] = set()
        self.reset_stats()

    def submit(self, request, on_done, on_token=None) -> None:
        with self.queue.lock:
            result = GenerationResult(request.request_id, len(request.prompt_ids), received_time_s=self.clock())
            result.replica_id = self.replica_id
            self.pending.append((request, result, on_done, on_token))
            self.counts["warmup_received" if request.warmup else "received"] += 1
            self.queue.lock.notify_all()

    def abort(self, request_id: str) -> None:
        with self.queue.lock:
            self.ends.add(request_id)

    finish = abort

    def step(self) -> bool:
        with self.queue.lock:
            for item in self.pending:
                self.live[item[0].request_id] = item
            self.pending, ends, self.ends = [], self.ends, set()
        for rid in ends & set(self.live):
            req, result, on_done, _ = self.live.pop(rid)
            result.error_kind, result.finish_reason = "aborted", "error"
            self.counts["warmup_failed" if req.warmup else "failed"] += 1
            on_done(result)
        if not self.live:
            return False
        self.peak_running = max(self.peak_running, len(self.live))
        t = self.clock()
        for rid, (req, result, on_done, on_token) in list(self.live.items()):
            tok = self.FIRST_TOKEN + len(result.output_ids)
            result.output_ids.append(tok)
            result.token_times_s.append(t)
            if not req.warmup:
                self.counts["tokens"] += 1
            if on_token is not None:
                on_token(tok, t)
            if len(result.output_ids) == req.max_new_tokens:
                result.finish_reason, result.finish_time_s = "length", t
                self.counts["warmup_completed" if req.warmup else "completed"] += 1
                del self.live[rid]
                on_done(result)
        return True

    def wait_for_work(self, timeout_s: float) -> bool:
        with self.queue.lock:
            return self.queue.lock.wait_for(lambda: bool(self.pending or self.live), timeout=timeout_s)

    def reset_stats(self) -> None:
        self.counts, self.peak_running = collections.Counter(), 0

    def stats(self) -> dict:
        c = self.counts
        return {
            "replica_id": self.replica_id,
            "policy": self.config.policy,
            "running_sequences": len(self.live),
            "queued_requests": len(self.pending),
            "peak_running_sequences": self.peak_running,
            "peak_kv_cache_bytes": 0,
            "completed_requests": c["completed"],
            "failed_requests": c["failed"],
            "generated_tokens": c["tokens"],
            "preemptions": None,
            "recomputed_tokens": None,
            "not_reported": ["preemptions", "recomputed_tokens"],
        }

    def fits_alone(self, prompt_tokens: int, max_new_tokens: int) -> Refusal | None:
        return None

    def max_new_tokens_for(self, prompt_tokens: int, most: int) -> int:
        return max(0, most)

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return 8

    def abort_all(self, message: str, fault: bool = False) -> int:
        held = self.pending + list(self.live.values())
        self.pending, self.live = [], {}
        for _, result, on_done, _ in held:
            result.error_kind, result.error, result.finish_reason = "error", message, "error"
            on_done(result)
        return len(held)

    def stop_on_fault(self, message: str) -> int:
        return self.abort_all(message, fault=True)

    running = property(lambda self: len(self.live))
    queued = property(lambda self: len(self.pending))
    healthy = property(lambda self: True)
    fault = property(lambda self: None)


@pytest.fixture(scope="module")
def tiny_model():
    torch.set_num_threads(1)
    return tiny_llama(0)


@pytest.fixture
def stub_openvino(monkeypatch):
    """``engine: openvino`` runs the scripted stub; the suite-load check of its runtime passes."""
    monkeypatch.setitem(BACKENDS, "openvino", ScriptedBackend)
    monkeypatch.setattr("workloads.core.run.check_openvino", lambda model: None)


def test_ours_and_a_plain_class_both_satisfy_the_backend_protocol_and_a_class_without_step_does_not(tiny_model):
    ours = ContinuousBatchingEngine(tiny_model, EngineConfig())
    stub = ScriptedBackend(tiny_model, EngineConfig())
    assert isinstance(ours, EngineBackend) and isinstance(stub, EngineBackend)

    assert not isinstance(type("Bare", (), {})(), EngineBackend)
    assert set(BACKENDS) == {"ours", "openvino"} and BACKENDS["ours"] is ContinuousBatchingEngine


def test_a_replica_configured_with_engine_openvino_streams_the_backends_tokens(tiny_model, stub_openvino):
    replica = ServingReplica(model=tiny_model, engine_config=EngineConfig(**OV, kv_memory_limit_bytes=4_000_000))
    try:
        assert isinstance(replica.engine, ScriptedBackend) and replica.info()["engine"] == "openvino"
        result = asyncio.run(replica.generate(GenerationRequest("r0", [5, 6, 7], max_new_tokens=4)))
        assert result.output_ids == [1000, 1001, 1002, 1003] and result.finish_reason == "length"
        stats = asyncio.run(replica.stats())
        assert stats["engine"] == "openvino" and stats["completed_requests"] == 1 and stats["generated_tokens"] == 4
        replica.configure(EngineConfig())  # back to ours: the tiny model's own tokens
        assert isinstance(replica.engine, ContinuousBatchingEngine)
        assert asyncio.run(replica.stats())["engine"] == "ours"
    finally:
        replica.shutdown()


def _args(suite: str, results, run_id="run"):
    return argparse.Namespace(
        suite=suite,
        replicas=None,
        results_dir=str(results),
        run_id=run_id,
        resume=None,
        address=None,
        pushgateway="off",
    )


def _suite_file(tmp_path, policies, **kw) -> str:
    doc = serving_suite(
        name="peer",
        mode="concurrency",
        loads=[2],
        policies=policies,
        compression_ratios=[2],
        prompt_tokens=uniform(8, 24),
        new_tokens=uniform(2, 8),
        num_requests=6,
        slo={"ttft_s": 600, "tpot_s": 600},
        **PAGED,
        **kw,
    )
    path = tmp_path / "peer.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_a_serving_sweep_runs_ours_and_the_stub_backend_on_the_same_requests_and_records_the_engine(
    tmp_path, tiny_model, stub_openvino
):
    both = _suite_file(tmp_path, ["full", "scissorhands", {"name": "full", "engine": "openvino"}])
    rc = run_suite(_args(both, tmp_path / "r"), ServingKind(LocalReplicaPool(1, "tiny-llama", model=tiny_model)))
    assert rc == 0
    recs = [json.loads(x) for x in (tmp_path / "r" / "run" / "points.jsonl").read_text().splitlines()]
    assert [r["engine"] for r in recs] == ["ours", "ours", "openvino"]
    assert [r["policy"] for r in recs] == ["full", "scissorhands", "full"]
    for r in recs:
        assert r["status"] == "ok" and r["completed_requests"] == 6
    # the same requests on each engine: one workload seed per load, not per series
    assert len({r["load_config"]["seed"] for r in recs}) == 1
    assert (
        recs[0]["output_tokens"] == recs[2]["output_tokens"] > 0 and recs[0]["input_tokens"] == recs[2]["input_tokens"]
    )
    # ours counts preemptions; the stub says it does not (null, not 0)
    assert recs[0]["preemptions"] == 0 and recs[2]["preemptions"] is None and recs[2]["recomputed_tokens"] is None
    # the entry's engine is part of its series and id; our series keep the ids they had without the peer
    ours_only = load_suite(_suite_file(tmp_path, ["full", "scissorhands"])).points()
    assert [r["point_id"] for r in recs[:2]] == [p.point_id for p in ours_only]
    assert recs[2]["point_id"].startswith("concurrency-openvino-full-")


def test_engine_ours_at_its_default_leaves_every_point_id_as_it_was(tmp_path):
    plain = load_suite(_suite_file(tmp_path, ["full", "scissorhands"])).points()
    named = load_suite(_suite_file(tmp_path, ["full", "scissorhands"], engine="ours")).points()
    assert [p.point_id for p in plain] == [p.point_id for p in named]
    other = load_suite(_suite_file(tmp_path, ["full"], engine="openvino")).points()
    assert other[0].identity["engine"] == "openvino" and other[0].point_id != plain[0].point_id


@pytest.mark.parametrize(
    ("policies", "extra", "message"),
    [
        (["scissorhands"], {"engine": "openvino"}, r"policy: engine 'openvino' runs full, openvino_eviction"),
        (["openvino_eviction"], {}, r"policy: 'openvino_eviction' runs on engine: openvino only"),
        (
            [{"name": "openvino_eviction", "engine": "openvino", "params": {"aggregation_mode": "MAX"}}],
            {},
            r"policy_params.aggregation_mode: 'MAX'; accepted: SUM, NORM_SUM",
        ),
        (
            [{"name": "openvino_eviction", "engine": "openvino", "params": {"window": 4}}],
            {},
            r"policy_params: openvino_eviction takes no window; accepted: aggregation_mode, start_size",
        ),
        (
            [{"name": "openvino_eviction", "engine": "openvino", "params": {"max_cache_size": 100}}],
            {},
            r"policy_params.max_cache_size: 100 is not a multiple of the KV block \(32 tokens\)",
        ),
        ([{"name": "full", "engine": "vllm"}], {}, r"engine"),
    ],
)
def test_a_policy_or_parameter_the_backend_cannot_run_fails_the_suite_naming_the_field(
    tmp_path, policies, extra, message
):
    with pytest.raises((SuiteError, ValueError), match=message):
        load_suite(_suite_file(tmp_path, policies, **extra))


def test_the_openvino_backend_needs_a_paged_mixed_config_and_refuses_ours_policies_by_name():
    with pytest.raises(ConfigError, match=r"kv_layout: engine 'openvino' is paged"):
        EngineConfig(engine="openvino", kv_memory_limit_bytes=1000)
    with pytest.raises(ConfigError, match=r"openvino_kv_precision: expected one of u8, bf16, got 'f32'"):
        EngineConfig(**OV, kv_memory_limit_bytes=1000, openvino_kv_precision="f32")
    cfg = EngineConfig(
        **OV, kv_memory_limit_bytes=1000, policy="openvino_eviction", compression_ratio=5, max_length_tokens=544
    )
    assert cfg.resolved_budget_tokens() is None  # its max_cache_size is the backend's (rounded to its block)


def test_a_ratio_becomes_max_cache_size_as_ours_becomes_a_budget_rounded_up_to_a_32_token_block():
    assert max_cache_size_for(544, 5, 32, 32) == (128, "ceil(544 / 5) = 109 -> 128 (32-token blocks)")
    assert max_cache_size_for(544, 2, 32, 32)[0] == 288  # ceil(272 / 32) blocks
    # at least one evictable block above start + recent
    assert max_cache_size_for(100, 10, 32, 64)[0] == 128
    ev, rounding = eviction_from_policy({"aggregation_mode": "NORM_SUM"}, 5, 544)
    assert ev == {"start_size": 32, "recent_size": 32, "max_cache_size": 128, "aggregation_mode": "NORM_SUM"}
    assert rounding.endswith("-> 128 (32-token blocks)")
    given, none = eviction_from_policy({"max_cache_size": 96}, 5, 544)
    assert given["max_cache_size"] == 96 and none is None  # given wins over the ratio, as budget_tokens does


def test_the_torch_free_max_cache_size_equals_the_librarys_budget_rounded_to_openvino_blocks():
    """replica/openvino_settings.py stays standard-library only (bench/peer_openvino.py loads it in the peer's venv):
    its ``ceil(L / r)`` must give what `scissorhands.budget_from_ratio` gives once rounded to whole 32-token blocks
    above ``start_size + recent_size`` (the policy's floor, 32, never exceeds that smallest cap of 96)."""
    policy = cache_policy("scissorhands")
    for length in (1, 20, 31, 32, 33, 95, 96, 97, 160, 544, 1000, 2048, 4096):
        for ratio in (1, 1.5, 2, 3, 4, 5, 8, 10, 32):
            for start, recent in ((32, 32), (32, 64), (64, 64)):
                ours = budget_from_ratio(length, ratio, policy)
                want = max(-(-ours // 32) * 32, start + recent + 32)
                got, words = max_cache_size_for(length, ratio, start, recent)
                assert got == want, (length, ratio, start, recent)
                assert f"= {budget_from_ratio(length, ratio)} ->" in words


def test_make_engine_builds_the_backend_the_config_names(tiny_model, stub_openvino):
    assert isinstance(backends.make_engine(tiny_model, EngineConfig()), ContinuousBatchingEngine)
    built = backends.make_engine(tiny_model, EngineConfig(**OV, kv_memory_limit_bytes=1000), replica_id="x")
    assert isinstance(built, ScriptedBackend) and built.replica_id == "x"
