"""A dead engine loop answers every request it held and refuses new ones (replica/engine/loop.py)."""

from __future__ import annotations

import collections
import threading

import pytest

from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine, EngineLoop
from tests.waiting import wait_for

PAGED = dict(kv_layout="paged", block_tokens=4, kv_memory_limit_bytes=10**7)
ANSWER_WAIT_S = 10.0  # generous (busy cores): the failure this guards against is an endless wait


@pytest.mark.parametrize(
    "cfg",
    [EngineConfig(), EngineConfig(**PAGED), EngineConfig(**PAGED, scheduler="mixed", max_num_batched_tokens=16)],
    ids=["preallocated", "paged", "paged-mixed"],
)
def test_a_scheduler_fault_answers_every_held_request_and_refuses_later_ones(model, cfg):
    engine = ContinuousBatchingEngine(model, cfg)
    done: dict[str, object] = {}
    answered = threading.Event()

    def on_done(res):
        done[res.request_id] = res
        if len(done) == 4:  # 3 running + 1 queued behind them
            answered.set()

    for i in range(3):
        engine.submit(GenerationRequest(f"r{i}", list(range(3, 20 + i)), 10_000, ignore_eos=True), on_done)
    loop = EngineLoop(engine).start()
    try:
        wait_for(lambda: len(engine._running) == 3, 30, "the 3 requests to run", poll_s=0.005)
        plan = engine.scheduler.plan

        def broken(view, kv):
            engine.scheduler.plan = plan  # raises once
            raise RuntimeError("scheduler broke: planted fault")

        with engine._lock:
            engine.submit(GenerationRequest("queued", [5, 6, 7], 4), on_done)
            engine.scheduler.plan = broken
        assert answered.wait(ANSWER_WAIT_S), f"answered only {sorted(done)}"
        for rid in ("r0", "r1", "r2", "queued"):
            res = done[rid]
            assert res.error_kind == "error" and res.finish_reason == "error"
            assert "RuntimeError: scheduler broke: planted fault" in res.error
        assert 0 < len(done["r0"].output_ids) < 10_000  # it had run
        wait_for(lambda: not loop.alive, ANSWER_WAIT_S, "the engine loop to end on the fault", poll_s=0.005)
        assert isinstance(loop.error, RuntimeError)
        assert not engine.healthy and "scheduler broke" in engine.fault
        assert engine.running == 0 and engine.queued == 0
        if engine.pool is not None:
            assert engine.pool.blocks_in_use == 0  # the dead engine's blocks are back in the pool

        later: list = []
        engine.submit(GenerationRequest("later", [1, 2, 3], 4), later.append)
        assert later and engine.queued == 0  # refused in the call, not queued
        assert later[0].error_kind == "error" and "scheduler broke: planted fault" in later[0].error
        s = engine.stats()
        assert s["received_requests"] == 5 and s["failed_requests"] == 5 and s["completed_requests"] == 0
    finally:
        loop.stop(timeout_s=5)


def test_a_healthy_engine_reports_no_fault_and_serves_after_a_request_failure(model):
    """A request's own failure (a sampling error) is not an engine fault: the engine stays healthy."""
    engine = ContinuousBatchingEngine(model, EngineConfig())
    loop = EngineLoop(engine).start()
    got: list = []
    try:
        bad = GenerationRequest("bad", [3, 4, 5], 4, temperature=1.0, seed=1)
        bad.seed = 2**70  # torch.Generator.manual_seed raises for it: this request fails alone
        engine.submit(bad, got.append)
        engine.submit(GenerationRequest("ok", [3, 4, 5], 4), got.append)
        wait_for(lambda: len(got) == 2, 30, "both answers", poll_s=0.005)
        assert {r.request_id: r.error_kind for r in got} == {"bad": "error", "ok": None}
        assert engine.healthy and engine.fault is None and loop.alive
    finally:
        loop.stop(timeout_s=5)


class LockCheckedCounter(collections.Counter):
    """The engine's counters, noting every update made without the counters' lock held."""

    def __init__(self, lock):
        super().__init__()
        self.lock, self.unlocked = lock, []

    def __setitem__(self, key, value):
        if not self.lock.locked():
            self.unlocked.append((key, threading.current_thread().name))
        super().__setitem__(key, value)


def test_every_counter_update_holds_the_counters_lock_refusals_from_other_threads_included(model):
    """A dead engine answers `submit` on the caller's thread, so callers' threads and the step's thread count."""
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED))
    counts = engine.life.counts = LockCheckedCounter(engine.life.lock)
    got: list = []
    engine.submit(GenerationRequest("served", [3, 4, 5], 3), got.append)
    engine.run_until_idle()
    engine.stop_on_fault("planted fault")
    callers = [
        threading.Thread(target=engine.submit, args=(GenerationRequest(f"refused-{i}", [1, 2, 3], 2), got.append))
        for i in range(4)
    ]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert [r.error for r in got] == [None] + ["planted fault"] * 4
    assert counts["received"] == 5 and counts["completed"] == 1 and counts["failed"] == 4 and counts["tokens"] == 3
    assert counts["decode_steps"] > 0 and counts["prefill_calls"] == 1
    assert counts.unlocked == []
