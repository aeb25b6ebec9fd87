"""Every cache the engine builds counts against the KV memory limit and in the reported peak: the cache that scores
a prompt (`prompt_logprobs`, echo) is built like the request's prefill cache (in the block pool on the paged
layout) and freed before the prefill, inside what admission reserved for it (replica/engine/runner.py)."""

from __future__ import annotations

import pytest
import torch

from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine

SH = dict(policy="scissorhands", budget_tokens=16, policy_params=dict(history_window=20, count_chunk_steps=5))
PAGED = dict(kv_layout="paged", block_tokens=4)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _serve(engine, requests):
    results = {}
    for r in requests:
        engine.submit(r, lambda res: results.__setitem__(res.request_id, res))
    engine.run_until_idle()
    return results


@pytest.mark.parametrize("policy", [{}, SH], ids=["full", "scissorhands-B16"])
def test_a_score_only_request_on_the_paged_layout_takes_its_blocks_from_the_pool(model, policy):
    prompt = _prompt(40, 0)
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**6, **policy))
    got = _serve(engine, [GenerationRequest("p", prompt, 0, prompt_logprobs=2)])["p"]
    dense = _serve(
        ContinuousBatchingEngine(model, EngineConfig(**policy)), [GenerationRequest("p", prompt, 0, prompt_logprobs=2)]
    )
    assert got.error is None and got.prompt_logprobs[0] is None
    assert got.prompt_logprobs[1:] == pytest.approx(dense["p"].prompt_logprobs[1:], abs=1e-5)
    kept = 40 if not policy else 16
    s = engine.stats()
    assert s["peak_kv_blocks_in_use"] == engine.num_layers * (kept // 4)  # the scoring cache's blocks, in the pool
    assert s["peak_kv_cache_bytes"] > 0 and engine.pool.blocks_in_use == 0


def test_a_score_only_request_is_in_the_reported_peak_on_the_preallocated_layout(model):
    prompt = _prompt(40, 1)
    limit = ContinuousBatchingEngine(model, EngineConfig()).slot_bytes * 60
    engine = ContinuousBatchingEngine(model, EngineConfig(kv_memory_limit_bytes=limit))
    got = _serve(engine, [GenerationRequest("p", prompt, 0, prompt_logprobs=1)])["p"]
    assert got.error is None and len(got.prompt_logprobs) == 40
    assert engine.slot_bytes * 40 <= engine.stats()["peak_kv_cache_bytes"] <= limit


@pytest.mark.parametrize(
    "scheduler", [{}, dict(scheduler="mixed", max_num_batched_tokens=8)], ids=["prefill_first", "mixed"]
)
def test_scoring_requests_beside_running_ones_wait_for_blocks_and_never_pass_the_pool(model, scheduler):
    """A pool of 40 blocks of 4 (2 layers): prompts of 30-50 tokens, a third scoring theirs; every request
    finishes, the pool never holds more than it has, and the scored log-probabilities are those of a lone run."""
    block_bytes = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**6)).block_bytes
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, **scheduler, kv_memory_limit_bytes=40 * block_bytes))
    requests = [
        GenerationRequest(
            f"r{i}", _prompt(30 + 4 * i, i), 12, ignore_eos=True, prompt_logprobs=1 if i % 3 == 0 else None
        )
        for i in range(6)
    ]
    got = _serve(engine, requests)
    s = engine.stats()
    assert all(r.error is None and len(r.output_ids) == 12 for r in got.values()) and len(got) == 6
    assert s["peak_kv_blocks_in_use"] <= 40 and engine.pool.blocks_in_use == 0
    for r in requests[::3]:
        alone = _serve(
            ContinuousBatchingEngine(model, EngineConfig()),
            [GenerationRequest("a", r.prompt_ids, 0, prompt_logprobs=1)],
        )
        assert got[r.request_id].prompt_logprobs[1:] == pytest.approx(alone["a"].prompt_logprobs[1:], abs=1e-5)
