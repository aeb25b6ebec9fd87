"""The OpenVINO GenAI backend (replica/backends/openvino.py): its KV blocks from the byte limit, a failing pipeline
failing only the requests it held, the make targets named when its runtime or export is absent (on a scripted
pipeline); and, in the slow tier, the real ``ContinuousBatchingPipeline`` on the embedded model's export."""

from __future__ import annotations

import argparse
import asyncio
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

from replica.backends import openvino as ovb
from replica.common.types import EngineConfig, GenerationRequest
from replica.continuous import ServingReplica
from replica.metrics import ReplicaMetrics
from replica.openvino_settings import eviction_reach, evicts_nothing
from scissorhands.testing import tiny_llama
from tests.peer_stub import real_runtime_or_skip
from tests.suite_helpers import serving_suite, uniform
from workloads.core.run import SweepError
from workloads.core.template import run_suite
from workloads.serving.pools import LocalReplicaPool
from workloads.serving.runner import ServingKind

OV = dict(engine="openvino", kv_layout="paged", scheduler="mixed")
BLOCK_BYTES = 1000
SNAPKV = "Total number of aggregated SnapKV scores during prefill phase may not be larger than the configured window"


class _Status:
    RUNNING = SimpleNamespace(name="RUNNING")
    FINISHED = SimpleNamespace(name="FINISHED")
    IGNORED = SimpleNamespace(name="IGNORED")
    CANCEL = SimpleNamespace(name="CANCEL")
    STOP = SimpleNamespace(name="STOP")


# The public names of openvino-genai 2026.4.1's objects the backend calls: the stand-ins expose exactly these (a
# call under another name fails here as on the real runtime) and the slow test checks them against the real one.
HANDLE_API = {
    "can_read",
    "cancel",
    "get_perf_metrics",
    "get_status",
    "get_vlm_perf_metrics",
    "read",
    "read_all",
    "stop",
}
PIPELINE_API = {
    "add_request", "finish_chat", "generate", "get_config", "get_metrics", "get_tokenizer",
    "has_non_finished_requests", "start_chat", "step",
}  # fmt: skip
METRICS_USED = {"cache_usage", "scheduled_requests", "requests", "kv_cache_size_in_bytes"}


def _public(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


class _Handle:
    """A handle of 2026.4.1's public names only (`HANDLE_API`); its state is kept under private names."""

    def __init__(self, max_new: int, pipe=None):
        self._max_new, self._out, self._unread, self._status, self._cancelled = max_new, 0, [], _Status.RUNNING, False
        self._pipe = pipe

    def can_read(self):
        return bool(self._unread)

    def read(self):
        if self._pipe is not None and self._pipe.steps == _Pipeline.read_fails_at_step:
            _Pipeline.read_fails_at_step = None  # once
            raise RuntimeError("Exception from src/continuous_batching/pipeline_impl.cpp: read of a dropped sequence")
        ids, self._unread = self._unread, []
        return {0: SimpleNamespace(generated_ids=ids)}

    def read_all(self):
        return [SimpleNamespace(generated_ids=self.read()[0].generated_ids)]

    def get_status(self):
        return self._status

    def cancel(self):
        self._cancelled, self._status = True, _Status.CANCEL

    def stop(self):
        self._status = _Status.STOP

    def get_perf_metrics(self):
        return SimpleNamespace()

    def get_vlm_perf_metrics(self):
        return SimpleNamespace()


class _Pipeline:
    """One token per request per step (``500 + position``); raises ``fail_at_step`` (1-based) of this pipeline, its
    handles' ``read()`` once at ``read_fails_at_step``, its ``get_metrics()`` once at ``metrics_fail_at_step``; ends a request
    itself after ``stop_after`` tokens (its stop condition); the next ``builds_failing`` builds raise; a step runs
    at most ``schedule_at_most`` requests (the first ones held), as its scheduler does when its pool is short."""

    built: list = []
    fail_at_step: int | None = None
    read_fails_at_step: int | None = None
    metrics_fail_at_step: int | None = None
    stop_after: int | None = None
    builds_failing: int = 0
    schedule_at_most: int | None = None

    def __init__(self, model_dir, sc, device, props):
        if _Pipeline.builds_failing:
            _Pipeline.builds_failing -= 1
            raise RuntimeError("Exception from src/core/src/runtime/compilation: cannot allocate the KV cache")
        self.sc, self.props, self.handles, self.steps, self.scheduled = sc, props, [], 0, 0
        _Pipeline.built.append(self)

    def add_request(self, rid, ids, gc):
        h = _Handle(gc.max_new_tokens, self)
        self.handles.append(h)
        return h

    def step(self):
        self.steps += 1
        if self.steps == _Pipeline.fail_at_step:
            raise RuntimeError(SNAPKV)
        live = [h for h in self.handles if h._status is _Status.RUNNING]
        live = live[: _Pipeline.schedule_at_most]
        self.scheduled = len(live)
        for h in live:
            h._unread.append(500 + h._out)
            h._out += 1
            if h._out == h._max_new or h._out == _Pipeline.stop_after:
                h._status = _Status.FINISHED

    def get_metrics(self):
        if self.steps == _Pipeline.metrics_fail_at_step:
            _Pipeline.metrics_fail_at_step = None  # once
            raise RuntimeError("Exception from src/continuous_batching/metrics.cpp: no metrics")
        live = sum(h._status is _Status.RUNNING for h in self.handles)
        return SimpleNamespace(cache_usage=50.0 if live else 0.0, scheduled_requests=self.scheduled, requests=live)


def _fake_genai():
    return SimpleNamespace(
        SchedulerConfig=lambda: SimpleNamespace(),
        GenerationConfig=lambda: SimpleNamespace(),
        CacheEvictionConfig=lambda *a: a,
        AggregationMode=SimpleNamespace(SUM="SUM", NORM_SUM="NORM_SUM"),
        GenerationStatus=_Status,
        ContinuousBatchingPipeline=_Pipeline,
    )


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    """The backend on the scripted pipeline: blocks of `BLOCK_BYTES`, an export folder that exists."""
    _Pipeline.built, _Pipeline.fail_at_step, _Pipeline.read_fails_at_step = [], None, None
    _Pipeline.metrics_fail_at_step, _Pipeline.stop_after, _Pipeline.builds_failing = None, None, 0
    _Pipeline.schedule_at_most = None
    fake_np = SimpleNamespace(array=lambda x, dtype=None: x, int64=int)
    monkeypatch.setattr(ovb, "runtime", lambda: (_fake_genai(), SimpleNamespace(Tensor=lambda x: x), fake_np))
    monkeypatch.setattr(ovb, "measured_block_bytes", lambda *a: BLOCK_BYTES)
    for f in ("openvino_model.xml", "openvino_model.bin"):
        (tmp_path / f).write_text("")
    monkeypatch.setattr(ovb, "EXPORT_DIR", tmp_path)
    return _Pipeline


@pytest.fixture(scope="module")
def tiny_model():
    torch.set_num_threads(1)
    return tiny_llama(0)


def _generate(replica, reqs):
    async def go():
        return await asyncio.gather(*(replica.generate(r) for r in reqs))

    return asyncio.run(go())


def test_the_kv_limit_bytes_become_whole_blocks_and_the_settings_reach_the_pipeline(tiny_model, scripted):
    cfg = EngineConfig(
        **OV,
        kv_memory_limit_bytes=10 * BLOCK_BYTES + 999,
        policy="openvino_eviction",
        policy_params={"aggregation_mode": "NORM_SUM"},
        compression_ratio=4,
        max_length_tokens=544,
        openvino_kv_precision="bf16",
        max_num_batched_tokens=256,
    )
    eng = ovb.OpenVINOEngine(tiny_model, cfg)
    sc, props = scripted.built[-1].sc, scripted.built[-1].props
    assert eng.num_kv_blocks == sc.num_kv_blocks == 10  # rounded down: the limit is never exceeded
    assert props["KV_CACHE_PRECISION"] == "bf16" and props["INFERENCE_PRECISION_HINT"] == "f32"
    assert sc.max_num_batched_tokens == 256 and sc.enable_prefix_caching is False
    assert sc.use_cache_eviction and sc.cache_eviction_config == (32, 32, 160, "NORM_SUM")  # ceil(544/4)=136 -> 160
    assert sc.dynamic_split_fuse is False  # split-fuse with eviction fails whole batches on 2026.4.1
    s = eng.stats()
    assert (
        s["budget_tokens"] == 160
        and s["openvino_max_cache_size_rounding"] == "ceil(544 / 4) = 136 -> 160 (32-token blocks)"
    )
    assert s["preemptions"] is None and "preemptions" in s["not_reported"] and s["kv_pool_blocks"] == 10
    # a request needing more blocks than the pool, even alone, is named with the numbers
    assert "needs 11 KV blocks of 32 tokens, the OpenVINO pool holds 10" in eng.fits_alone(340, 8)


def test_running_queued_and_kv_figures_come_from_the_pipelines_metrics_as_ours_and_the_rest_is_absent(
    tiny_model, scripted
):
    """Three requests held, the pipeline schedules two a step (50% of a 10-block pool in use): running 2 and queued
    1 in ``stats()`` and in the live gauges labelled ``engine="openvino"``; no preemption, eviction or forward-time
    series at all (the pipeline counts none), and None with ``not_reported`` in the record."""
    metrics = ReplicaMetrics("full", None, "r-ov", "embedded", "run-ov", use_ray=False, engine="openvino")
    eng = ovb.OpenVINOEngine(tiny_model, EngineConfig(**OV, kv_memory_limit_bytes=10 * BLOCK_BYTES), metrics=metrics)
    scripted.schedule_at_most = 2
    done = []
    for i in range(3):
        eng.submit(GenerationRequest(f"r{i}", [1, 2, 3], max_new_tokens=2), done.append)
    assert eng.step()
    s = eng.stats()
    assert (eng.running, eng.queued, s["running_sequences"], s["queued_requests"]) == (2, 1, 2, 1)
    assert s["kv_cache_bytes"] == 5 * BLOCK_BYTES and s["peak_kv_blocks_in_use"] == 5  # 50% of 10 blocks
    snap = metrics.snapshot()
    assert snap["scissorhands_running_sequences"] == 2 and snap["scissorhands_queued_sequences"] == 1
    assert (snap["scissorhands_kv_used_blocks"], snap["scissorhands_kv_free_blocks"]) == (5, 5)
    assert snap["scissorhands_kv_cache_bytes"] == 5 * BLOCK_BYTES and snap["scissorhands_generated_tokens_total"] == 2
    assert metrics.tags["engine"] == "openvino"
    while eng.step():
        pass
    s = eng.stats()
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"] and s["completed_requests"] == 3
    assert s["peak_running_sequences"] == 2 and (eng.running, eng.queued) == (0, 0)  # never more than it scheduled
    absent = {f"scissorhands_{n}" for n in ("preemptions_total", "recomputed_tokens_total", "evicted_tokens_total")}
    absent |= {"scissorhands_prefill_seconds", "scissorhands_decode_step_seconds"}
    assert not absent & set(metrics.snapshot())  # absent, never a zero
    assert s["preemptions"] is None and s["recomputed_tokens"] is None
    assert {"preemptions", "recomputed_tokens", "prefill_s", "decode_s"} <= set(s["not_reported"])


def test_a_pipeline_that_raises_fails_the_requests_it_held_with_its_message_and_the_next_ones_run(tiny_model, scripted):
    replica = ServingReplica(model=tiny_model, engine_config=EngineConfig(**OV, kv_memory_limit_bytes=40 * BLOCK_BYTES))
    try:
        scripted.fail_at_step = 2
        failed = _generate(replica, [GenerationRequest(f"a{i}", [1, 2, 3], max_new_tokens=4) for i in range(3)])
        for r in failed:
            assert (
                r.error_kind == "error" and SNAPKV in r.error and r.error.startswith("OpenVINO GenAI failed the step")
            )
            assert r.output_ids == [500]  # the token before the failure was answered
        assert replica.loop.alive and replica.engine.healthy  # a peer's failure is not the replica's
        scripted.fail_at_step = None
        (ok,) = _generate(replica, [GenerationRequest("b", [1, 2], max_new_tokens=3)])
        assert ok.error is None and ok.output_ids == [500, 501, 502] and len(scripted.built) == 2
        s = asyncio.run(replica.stats())
        assert (s["failed_requests"], s["completed_requests"], s["engine"]) == (3, 1, "openvino")
    finally:
        replica.shutdown()


@pytest.mark.parametrize(
    "where, message",
    [
        ("read_fails_at_step", "OpenVINO GenAI failed reading its output: RuntimeError: Exception from"),
        ("metrics_fail_at_step", "OpenVINO GenAI failed reading its output: RuntimeError: Exception from"),
    ],
)
def test_a_pipeline_raising_while_its_output_is_read_fails_only_the_requests_it_held_and_the_next_run(
    tiny_model, scripted, where, message
):
    replica = ServingReplica(model=tiny_model, engine_config=EngineConfig(**OV, kv_memory_limit_bytes=40 * BLOCK_BYTES))
    try:
        setattr(scripted, where, 2)
        failed = _generate(replica, [GenerationRequest(f"a{i}", [1, 2, 3], max_new_tokens=4) for i in range(2)])
        for r in failed:
            assert r.error_kind == "error" and r.error.startswith(message) and r.finish_reason == "error"
        assert replica.loop.alive and replica.engine.healthy and replica.engine.fault is None
        (ok,) = _generate(replica, [GenerationRequest("b", [1, 2], max_new_tokens=3)])
        assert ok.error is None and ok.output_ids == [500, 501, 502] and len(scripted.built) == 2
        s = asyncio.run(replica.stats())
        assert (s["failed_requests"], s["completed_requests"]) == (2, 1)
    finally:
        replica.shutdown()


def test_a_pipeline_that_cannot_be_rebuilt_fails_the_next_requests_with_its_message_until_a_build_succeeds(
    tiny_model, scripted
):
    replica = ServingReplica(model=tiny_model, engine_config=EngineConfig(**OV, kv_memory_limit_bytes=40 * BLOCK_BYTES))
    try:
        scripted.fail_at_step, scripted.builds_failing = 1, 2  # the rebuild after the failed step and the next one
        (first,) = _generate(replica, [GenerationRequest("a", [1, 2, 3], max_new_tokens=4)])
        assert first.error.startswith("OpenVINO GenAI failed the step")
        scripted.fail_at_step = None
        (second,) = _generate(replica, [GenerationRequest("b", [1, 2], max_new_tokens=3)])
        assert second.error_kind == "error"
        assert second.error.startswith("OpenVINO GenAI could not rebuild its pipeline: RuntimeError: Exception from")
        assert replica.loop.alive and replica.engine.healthy
        (ok,) = _generate(replica, [GenerationRequest("c", [1, 2], max_new_tokens=3)])
        assert ok.error is None and ok.output_ids == [500, 501, 502]
    finally:
        replica.shutdown()


def test_a_request_the_pipeline_ends_is_length_only_at_its_max_new_tokens(tiny_model, scripted):
    eng = ovb.OpenVINOEngine(tiny_model, EngineConfig(**OV, kv_memory_limit_bytes=40 * BLOCK_BYTES))
    scripted.stop_after = 3  # the pipeline's own stop condition ends every request at its third token
    done = {}
    for rid, n in (("early", 8), ("exact", 3)):
        eng.submit(GenerationRequest(rid, [1, 2], max_new_tokens=n), lambda r: done.setdefault(r.request_id, r))
    while eng.step():
        pass
    assert done["early"].output_ids == [500, 501, 502] and done["early"].finish_reason == "eos"
    assert done["early"].outcome == "stop"
    assert done["exact"].finish_reason == "length" and done["exact"].outcome == "length"
    assert eng.stats()["completed_requests"] == 2


def test_an_unfit_request_is_rejected_by_name_without_touching_the_others(tiny_model, scripted):
    replica = ServingReplica(model=tiny_model, engine_config=EngineConfig(**OV, kv_memory_limit_bytes=2 * BLOCK_BYTES))
    try:
        big, small = _generate(
            replica,
            [
                GenerationRequest("big", list(range(80)), max_new_tokens=4),
                GenerationRequest("s", [1], max_new_tokens=2),
            ],
        )
        assert big.error_kind == "rejected" and "the OpenVINO pool holds 2" in big.error
        assert small.output_ids == [500, 501]
    finally:
        replica.shutdown()


def test_the_replica_refuses_by_kind_and_sizes_max_tokens_from_the_openvino_pool(tiny_model, scripted):
    replica = ServingReplica(model=tiny_model, engine_config=EngineConfig(**OV, kv_memory_limit_bytes=10 * BLOCK_BYTES))
    try:
        why = asyncio.run(replica.check(300, 40))  # 340 tokens: 11 blocks of 32, the pool holds 10
        assert why.kind == "kv_memory"
        assert why.startswith("a request of 300 prompt + 40 new tokens: it needs 11 KV blocks of 32 tokens")
        assert asyncio.run(replica.check(300, 20)) is None
        assert asyncio.run(replica.check(500, 20)).kind == "context"  # the tiny model's context is 512
        # a chat without max_tokens: the longest output the 320-token pool holds beside the prompt
        assert asyncio.run(replica.max_new_tokens_for(300, 100)) == 20
        assert asyncio.run(replica.max_new_tokens_for(300, 10)) == 10
        assert asyncio.run(replica.max_new_tokens_for(320, 10)) == 0
    finally:
        replica.shutdown()


def test_the_openvino_replica_refuses_log_probabilities_as_unsupported_before_its_lengths(tiny_model, scripted):
    replica = ServingReplica(model=tiny_model, engine_config=EngineConfig(**OV, kv_memory_limit_bytes=10 * BLOCK_BYTES))
    try:
        why = asyncio.run(replica.check(10, 5, logprobs=True))
        assert (why.kind, str(why)) == ("unsupported", "engine 'openvino' gives no log-probabilities")
        assert asyncio.run(replica.check(300, 40, logprobs=True)).kind == "unsupported"
        assert asyncio.run(replica.check(10, 5)) is None
        replica.configure(EngineConfig())  # ours gives them
        assert asyncio.run(replica.check(10, 5, logprobs=True)) is None
    finally:
        replica.shutdown()


def test_max_new_tokens_for_is_the_longest_output_fits_alone_accepts_with_and_without_eviction(tiny_model, scripted):
    evict = dict(policy="openvino_eviction", compression_ratio=4, max_length_tokens=544)  # max_cache_size 160
    for blocks, extra, prompt, most, expected in [
        (10, {}, 100, 400, 220),
        (10, evict, 200, 400, 400),  # 160 + a block fits in 10 blocks: eviction bounds it, not the output
        (5, evict, 100, 400, 60),  # 160 + a block exceeds 5 blocks: the whole sequence must fit
        (5, evict, 160, 400, 0),
    ]:
        eng = ovb.OpenVINOEngine(tiny_model, EngineConfig(**OV, kv_memory_limit_bytes=blocks * BLOCK_BYTES, **extra))
        got = eng.max_new_tokens_for(prompt, most)
        assert got == expected, (blocks, extra, prompt)
        if got:
            assert eng.fits_alone(prompt, got) is None
        if got < most:
            assert eng.fits_alone(prompt, got + 1).kind == "kv_memory"


def test_without_its_runtime_or_export_the_backend_names_the_make_target(monkeypatch, tmp_path):
    with pytest.raises(ovb.BackendUnavailable, match=r"make openvino-peer.*lacks openvino_model.xml"):
        ovb.check_export(tmp_path)
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # an import that fails
    with pytest.raises(
        ovb.BackendUnavailable, match=r"openvino-genai runtime in this Python \(make openvino-runtime\)"
    ):
        ovb.runtime()
    with pytest.raises(ovb.BackendUnavailable, match=r"model: engine 'openvino' runs the embedded model's export"):
        ovb.check_available("tiny-llama")


def test_a_suite_naming_openvino_where_it_cannot_run_exits_2_before_any_point(tmp_path, tiny_model, monkeypatch):
    def absent(model):
        raise ovb.BackendUnavailable("engine: 'openvino' needs the openvino-genai runtime (make openvino-runtime)")

    monkeypatch.setattr("workloads.core.run.check_openvino", absent)
    doc = serving_suite(
        mode="concurrency",
        loads=[1],
        policies=["full", {"name": "full", "engine": "openvino"}],
        prompt_tokens=uniform(8, 16),
        new_tokens=uniform(2, 4),
        num_requests=2,
        kv_layout="paged",
        scheduler="mixed",
        kv_memory_limit={"bytes": 1_000_000},
    )
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    args = argparse.Namespace(
        suite=str(path), replicas=None, results_dir=str(tmp_path / "r"), run_id="run", resume=None, address=None
    )
    args.pushgateway = "off"
    with pytest.raises(SweepError, match=r"make openvino-runtime") as err:
        run_suite(args, ServingKind(LocalReplicaPool(1, "tiny-llama", model=tiny_model)))
    assert err.value.code == 2 and not (tmp_path / "r" / "run").exists()


# ---------------------------------------------------------------------------------------------- the real backend


@pytest.mark.slow
def test_the_real_pipeline_serves_the_embedded_model_beside_ours_full_and_evicting():
    real_runtime_or_skip()
    torch.set_num_threads(2)
    replica = ServingReplica("embedded", dtype="float32")
    base = dict(**OV, kv_memory_limit_bytes=20_000_000, max_length_tokens=80)
    reqs = lambda tag: [GenerationRequest(f"{tag}{i}", list(range(100 + i, 164 + i)), 16) for i in range(4)]  # noqa: E731
    try:
        replica.configure(EngineConfig(**base))
        full = _generate(replica, reqs("f"))
        s = asyncio.run(replica.stats())
        assert all(r.error is None and len(r.output_ids) == 16 and r.finish_reason == "length" for r in full)
        assert s["engine"] == "openvino" and s["completed_requests"] == 4 and s["generated_tokens"] == 64
        assert s["openvino_genai_version"].startswith("2026.") and s["openvino_kv_precision"] == "u8"
        assert s["openvino_inference_precision"] == "f32" and s["openvino_threads"] == 2
        assert s["kv_pool_blocks"] == 20_000_000 // s["openvino_block_bytes"]
        assert (
            0 < s["peak_kv_cache_bytes"] <= 20_000_000 and s["peak_kv_blocks_in_use"] >= 4
        )  # 80 tokens: 3 blocks each
        # the pipeline's own scheduled_requests: the four ran together (a 256-token prefill fits the 512-token step)
        assert (s["peak_running_sequences"], s["running_sequences"], s["queued_requests"]) == (4, 0, 0)
        assert replica.engine.metrics.tags["engine"] == "openvino"
        replica.configure(EngineConfig(**base, policy="openvino_eviction", compression_ratio=2))
        evicted = _generate(replica, reqs("e"))
        s = asyncio.run(replica.stats())
        assert all(r.error is None and len(r.output_ids) == 16 for r in evicted)
        assert s["openvino_eviction"]["max_cache_size"] == 96 and s["budget_tokens"] == 96
        replica.configure(EngineConfig())  # ours on the same request: the same model, greedy
        (ours,) = _generate(replica, [GenerationRequest("o", list(range(100, 164)), 16)])
        assert ours.output_ids[:4] == full[0].output_ids[:4]
    finally:
        replica.shutdown()


def test_an_aborted_request_is_cancelled_in_the_pipeline_and_a_finished_one_ends_as_stop(tiny_model, scripted):
    cfg = EngineConfig(**OV, kv_memory_limit_bytes=40 * BLOCK_BYTES)
    eng = ovb.OpenVINOEngine(tiny_model, cfg)
    done = {}
    for rid in ("gone", "stays", "stopped"):
        eng.submit(GenerationRequest(rid, [1, 2], max_new_tokens=5), lambda r: done.setdefault(r.request_id, r))
    assert eng.step() and eng.running == 3
    eng.abort("gone")
    eng.finish("stopped")
    eng.step()
    handles = scripted.built[-1].handles
    assert handles[0]._cancelled and handles[2]._cancelled and not handles[1]._cancelled
    assert done["gone"].error_kind == "aborted" and done["gone"].output_ids == [500]
    assert done["stopped"].finish_reason == "stop" and done["stopped"].error is None
    while eng.step():
        pass
    assert done["stays"].output_ids == [500, 501, 502, 503, 504] and done["stays"].finish_reason == "length"
    s = eng.stats()
    assert (s["completed_requests"], s["failed_requests"], s["generated_tokens"]) == (2, 1, 7)


def test_the_stand_in_handle_and_pipeline_expose_only_the_real_runtimes_names():
    assert _public(_Handle(3)) == HANDLE_API
    methods = {n for n in _public(_Pipeline) if callable(getattr(_Pipeline, n))}
    assert methods <= PIPELINE_API and {"add_request", "step", "get_metrics"} <= methods


def test_ending_running_requests_early_keeps_the_engine_serving_the_next(tiny_model, scripted):
    """An abort (the client gone mid-stream) and a finish (a stop string hit) while the pipeline still runs the
    request: both cancel it there, and the next request is served, not failed with the engine's fault."""
    eng = ovb.OpenVINOEngine(tiny_model, EngineConfig(**OV, kv_memory_limit_bytes=40 * BLOCK_BYTES))
    done = {}
    for rid in ("gone", "stopped"):
        eng.submit(GenerationRequest(rid, [1, 2], max_new_tokens=50), lambda r: done.setdefault(r.request_id, r))
    eng.step()
    eng.abort("gone")
    eng.finish("stopped")
    eng.step()
    eng.submit(GenerationRequest("next", [1, 2], max_new_tokens=3), lambda r: done.setdefault(r.request_id, r))
    while eng.step():
        pass
    assert eng.healthy and eng.fault is None
    assert done["gone"].error_kind == "aborted" and done["stopped"].finish_reason == "stop"
    assert done["next"].error is None and done["next"].output_ids == [500, 501, 502]
    assert [h.get_status().name for h in scripted.built[-1].handles] == ["CANCEL", "CANCEL", "FINISHED"]


@pytest.mark.slow
def test_the_real_runtime_has_every_name_the_backend_calls_and_serves_on_after_an_abort():
    """The real 2026.4.1 pipeline built as the backend builds it: its handle's, pipeline's and metrics' names are the
    stand-ins' (`HANDLE_API`, `PIPELINE_API`, `METRICS_USED`); a request aborted while running is cancelled (its KV
    freed) and the engine then serves the next request."""
    real_runtime_or_skip()
    cfg = EngineConfig(**OV, kv_memory_limit_bytes=20_000_000, max_length_tokens=80)
    eng = ovb.OpenVINOEngine(torch.nn.Linear(1, 1), cfg)  # the model gives only its dtype (f32)
    g, ov, np = ovb.runtime()
    gc = g.GenerationConfig()
    gc.max_new_tokens = 4
    handle = eng.pipe.add_request(10_000, ov.Tensor(np.array([[1, 2, 3, 4]], dtype=np.int64)), gc)
    assert _public(handle) == HANDLE_API and PIPELINE_API <= _public(eng.pipe)
    assert METRICS_USED <= _public(eng.pipe.get_metrics())
    assert {"RUNNING", "FINISHED", "CANCEL", "IGNORED", "STOP"} <= _public(g.GenerationStatus)
    handle.cancel()
    while eng.pipe.has_non_finished_requests():
        eng.pipe.step()
    done = {}
    for rid in ("gone", "stopped"):
        eng.submit(GenerationRequest(rid, list(range(100, 132)), 40), lambda r: done.setdefault(r.request_id, r))
    eng.step()
    eng.step()
    eng.abort("gone")
    eng.finish("stopped")
    eng.step()
    eng.submit(GenerationRequest("next", list(range(100, 132)), 8), lambda r: done.setdefault(r.request_id, r))
    while eng.step():
        pass
    assert eng.healthy and done["gone"].error_kind == "aborted" and done["stopped"].finish_reason == "stop"
    assert done["next"].error is None and len(done["next"].output_ids) == 8
    assert not eng.pipe.has_non_finished_requests()  # the cancelled ones hold nothing (get_metrics lags a step)


def test_an_eviction_whose_max_cache_size_holds_the_longest_sequence_is_recorded_as_evicting_nothing():
    why = "evicts nothing: max_cache_size 96 >= longest sequence 96"
    assert evicts_nothing(96, 96) == why and evicts_nothing(96, 97) is None
    ev = {"start_size": 32, "recent_size": 32, "max_cache_size": 96, "aggregation_mode": "SUM"}
    assert eviction_reach(ev, 80) == {
        "evicts": False,
        "evicts_reason": "evicts nothing: max_cache_size 96 >= longest sequence 80",
    }
    assert eviction_reach(ev, 544) == {"evicts": True, "evicts_reason": None}
    assert eviction_reach(None, 80) == {}  # the full cache: nothing to say
