"""The engine counts a finished request by its one classification, `GenerationResult.outcome`
(replica/engine/lifecycle.py `Lifecycle.finished`): completed = stop or length, failed = abort or error."""

from __future__ import annotations

from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine
from replica.metrics import NullMetrics


class TPOTRecorder(NullMetrics):
    def __init__(self):
        self.tpot_phases: list[str] = []

    def observe_tpot(self, seconds: float, phase: str = "measured") -> None:
        self.tpot_phases.append(phase)


def test_completed_and_failed_counters_and_tpot_follow_each_results_outcome(model):
    metrics = TPOTRecorder()
    engine = ContinuousBatchingEngine(
        model, EngineConfig(kv_layout="paged", block_tokens=4, kv_memory_limit_bytes=10**7), metrics=metrics
    )
    got: dict[str, object] = {}

    def answer(res):
        got[res.request_id] = res

    engine.submit(GenerationRequest("length", [3, 4, 5], 3), answer)
    engine.submit(GenerationRequest("scored", [3, 4, 5, 6], 0, prompt_logprobs=1), answer)
    engine.submit(GenerationRequest("stop", [5, 6, 7], 1000, ignore_eos=True), answer)
    engine.submit(GenerationRequest("abort", [6, 7, 8], 1000, ignore_eos=True), answer)
    engine.submit(GenerationRequest("rejected", [3, 4, 5], 10**7, ignore_eos=True), answer)
    for _ in range(4):
        engine.step()
    engine.finish("stop")
    engine.abort("abort")
    engine.run_until_idle()

    outcomes = {rid: res.outcome for rid, res in got.items()}
    assert outcomes == {"length": "length", "scored": "length", "stop": "stop", "abort": "abort", "rejected": "error"}
    assert got["rejected"].error_kind == "rejected" and got["abort"].error_kind == "aborted"
    s = engine.stats()
    assert (s["received_requests"], s["completed_requests"], s["failed_requests"]) == (5, 3, 2)
    # TPOT of the completed requests with more than one token (length: 3 tokens, stop: at least 4), none else
    assert got["stop"].output_tokens >= 4 and metrics.tpot_phases == ["measured", "measured"]
