"""A fault anywhere in a step leaves no request waiting: every request the engine took from its queue is answered
with the fault when the loop stops on it (replica/engine/core.py `abort_all`, replica/engine/in_flight.py)."""

from __future__ import annotations

import pytest
import torch

import replica.engine.runner as runner_module
from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine, EngineLoop
from tests.waiting import wait_for

PAGED = dict(kv_layout="paged", block_tokens=4, kv_memory_limit_bytes=10**7)
MIXED = dict(PAGED, scheduler="mixed", max_num_batched_tokens=16)
ANSWER_WAIT_S = 10.0  # generous: the failure this guards against is an endless wait


def _planted(*args, **kwargs):
    raise RuntimeError("planted fault")


def _fault_in_join(engine, monkeypatch):
    monkeypatch.setattr(engine.runner, "join", _planted)


def _fault_in_prefill(engine, monkeypatch):
    monkeypatch.setattr(engine.runner, "prefill", _planted)


def _fault_in_decode(engine, monkeypatch):
    monkeypatch.setattr(engine.runner, "decode", _planted)


def _fault_in_a_preemption(engine, monkeypatch):
    """The newest running row is preempted, and taking its row out of the batch raises."""
    monkeypatch.setattr(engine.scheduler, "preemption", lambda view, kv: view.running[-1] if view.running else None)
    monkeypatch.setattr(engine.runner, "keep", _planted)


def _fault_in_a_later_chunk(engine, monkeypatch):
    """The first chunk of a new prompt feeds; its next chunk (the prompt part-way fed) raises."""
    prefill = engine.runner.prefill

    def second_chunk_breaks(p, chunk):
        if p.fed > 0:
            raise RuntimeError("planted fault")
        return prefill(p, chunk)

    monkeypatch.setattr(engine.runner, "prefill", second_chunk_breaks)


@pytest.mark.parametrize(
    "cfg, plant",
    [
        (EngineConfig(), _fault_in_join),
        (EngineConfig(**PAGED), _fault_in_join),
        (EngineConfig(**PAGED), _fault_in_prefill),
        (EngineConfig(), _fault_in_decode),
        (EngineConfig(**MIXED), _fault_in_join),
        (EngineConfig(**MIXED), _fault_in_a_later_chunk),
        (EngineConfig(**MIXED), _fault_in_decode),
        (EngineConfig(**PAGED), _fault_in_a_preemption),
    ],
    ids=[
        "prefill_first-join-preallocated",
        "prefill_first-join-paged",
        "prefill_first-prefill-paged",
        "decode-preallocated",
        "mixed-join",
        "mixed-later-chunk",
        "mixed-decode",
        "preemption-paged",
    ],
)
def test_a_fault_in_a_step_answers_every_request_taken_from_the_queue(model, monkeypatch, cfg, plant):
    engine = ContinuousBatchingEngine(model, cfg)
    done: dict[str, object] = {}
    engine.submit(
        GenerationRequest("running", list(range(3, 12)), 10_000, ignore_eos=True),
        lambda r: done.update({r.request_id: r}),
    )
    loop = EngineLoop(engine).start()
    try:
        wait_for(lambda: len(engine._running) == 1, 30, "the first request to run", poll_s=0.005)
        with engine._lock:  # the next step sees the fault and the new requests together
            plant(engine, monkeypatch)
            for rid, n in (("a", 40), ("b", 40), ("c", 7)):  # a and b: one prompt group; 40 tokens: chunked under mixed
                engine.submit(
                    GenerationRequest(rid, list(range(2, 2 + n)), 8), lambda r: done.update({r.request_id: r})
                )
        wait_for(lambda: len(done) == 4, ANSWER_WAIT_S, "every held request to be answered", poll_s=0.005)
        for rid in ("running", "a", "b", "c"):
            res = done[rid]
            assert res.finish_reason == "error" and res.error_kind == "error", (rid, res)
            assert "RuntimeError: planted fault" in res.error, (rid, res.error)
        wait_for(lambda: not loop.alive, ANSWER_WAIT_S, "the engine loop to end on the fault", poll_s=0.005)
        assert isinstance(loop.error, RuntimeError)
        assert engine.running == 0 and engine.queued == 0 and not engine.healthy
        if engine.pool is not None:
            assert engine.pool.blocks_in_use == 0  # the groups' caches the fault caught went back to the pool
        s = engine.stats()
        assert s["received_requests"] == 4 and s["failed_requests"] == 4 and s["completed_requests"] == 0
    finally:
        loop.stop(timeout_s=5)


class _TensorFails:
    """`torch` as replica/engine/runner.py sees it, whose `torch.tensor` raises once."""

    def __init__(self):
        self.failed = False

    def __getattr__(self, name):
        return getattr(torch, name)

    def tensor(self, *args, **kwargs):
        if not self.failed:
            self.failed = True
            raise RuntimeError("planted fault")
        return torch.tensor(*args, **kwargs)


def test_a_failed_prompt_tensor_fails_its_group_alone_and_the_engine_serves_on(model, monkeypatch):
    """Building a group's token tensor (its copy to the device) is inside the prefill's fault handling."""
    engine = ContinuousBatchingEngine(model, EngineConfig())
    monkeypatch.setattr(runner_module, "torch", _TensorFails())
    got: dict[str, object] = {}
    engine.submit(GenerationRequest("broken", [3, 4, 5], 4), lambda r: got.update({r.request_id: r}))
    engine.run_until_idle()
    engine.submit(GenerationRequest("ok", [3, 4, 5, 6], 4), lambda r: got.update({r.request_id: r}))
    engine.run_until_idle()
    assert got["broken"].error_kind == "error" and "RuntimeError: planted fault" in got["broken"].error
    assert got["ok"].error_kind is None and got["ok"].output_tokens == 4
    assert engine.healthy and engine.running == 0
