"""Submission bounds a request by the peak of the prefill its scheduler runs (replica/engine/kv_blocks.py): a
budgeted cache fed in chunks holds at most its budget plus a chunk in the layer being computed, so a prompt the
mixed scheduler serves is not refused for the peak of a whole-prompt prefill it never runs."""

from __future__ import annotations

import pytest
import torch

from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine

SH32 = dict(policy="scissorhands", budget_tokens=32, policy_params=dict(history_window=20, count_chunk_steps=5))
MIXED16 = dict(kv_layout="paged", block_tokens=16, scheduler="mixed", max_num_batched_tokens=16)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, blocks: int | None, **cfg) -> ContinuousBatchingEngine:
    """An engine whose pool holds `blocks` usable blocks (None: a pool far larger than any request here)."""
    if blocks is None:
        return ContinuousBatchingEngine(model, EngineConfig(kv_memory_limit_bytes=10**8, **cfg))
    block_bytes = ContinuousBatchingEngine(model, EngineConfig(kv_memory_limit_bytes=10**8, **cfg)).block_bytes
    engine = ContinuousBatchingEngine(model, EngineConfig(kv_memory_limit_bytes=blocks * block_bytes, **cfg))
    assert engine.pool.usable_blocks == blocks
    return engine


def _serve(engine, requests):
    results = {}
    for r in requests:
        engine.submit(r, lambda res: results.__setitem__(res.request_id, res))
    engine.run_until_idle()
    return results


def test_a_chunked_budgeted_prompt_runs_in_a_pool_smaller_than_its_whole_prompt_prefill(model):
    """Scissorhands B=32, blocks of 16, a 16-token step, 8 blocks: 200 + 8 tokens peak at 5 blocks (2 layers:
    the other layer's 2 blocks of B, the current one's B + 16 = 3), not the 15 of a whole 207-token prefill."""
    engine = _engine(model, 8, **MIXED16, **SH32)
    assert engine.fits_alone(200, 8) is None
    assert engine.max_batch_for(200, 8) == 1  # final 4 blocks each, the last one's prefill peaking at 5
    request = GenerationRequest("r", _prompt(200), 8, ignore_eos=True)
    got = _serve(engine, [request])["r"]
    want = _serve(_engine(model, None, **MIXED16, **SH32), [request])["r"]
    assert got.error is None and got.output_ids == want.output_ids and len(got.output_ids) == 8
    assert engine.stats()["peak_kv_blocks_in_use"] == 5 and engine.stats()["preemptions"] == 0
    assert engine.pool.blocks_in_use == 0


def test_the_chunked_bound_is_tight_five_blocks_run_four_are_refused_naming_the_chunked_prefill(model):
    request = GenerationRequest("r", _prompt(200, seed=1), 8, ignore_eos=True)
    five = _engine(model, 5, **MIXED16, **SH32)
    got = _serve(five, [request])["r"]
    assert got.error is None and len(got.output_ids) == 8
    assert got.output_ids == _serve(_engine(model, None, **MIXED16, **SH32), [request])["r"].output_ids
    why = _engine(model, 4, **MIXED16, **SH32).fits_alone(200, 8)
    assert why == (
        "it needs 5 KV blocks alone (a prefill of up to 207 tokens (a recompute: prompt + outputs but the last) fed "
        "in chunks of at most 16 tokens peaks at 5, its row ends at 4), more than the pool's 4"
    )


def test_prefill_first_still_refuses_the_prompt_it_would_feed_whole(model):
    engine = _engine(model, 8, kv_layout="paged", block_tokens=16, **SH32)
    why = engine.fits_alone(200, 8)
    assert why is not None and why.startswith("it needs 15 KV blocks alone") and "fed at once" in why
    results = _serve(engine, [GenerationRequest("r", _prompt(200), 8, ignore_eos=True)])
    assert results["r"].error_kind == "rejected" and "15 KV blocks alone" in results["r"].error
    assert engine.max_batch_for(200, 8) == 0


def test_a_full_cache_cannot_shrink_so_chunks_do_not_lower_its_bound(model):
    """The full cache keeps all 207 tokens in both layers: 2 x 13 = 26 blocks, chunked or not."""
    engine = _engine(model, 8, **MIXED16)
    assert engine.fits_alone(200, 8).startswith("it needs 26 KV blocks alone")
    results = _serve(engine, [GenerationRequest("r", _prompt(200), 8, ignore_eos=True)])
    assert results["r"].error_kind == "rejected"


def test_a_long_output_is_bounded_by_its_recompute_and_the_refusal_gives_both_numbers(model):
    """40 + 300 tokens, full cache: a recompute feeds 339 tokens, 2 layers x 22 blocks of 16, which is also where
    its row ends."""
    why = _engine(model, 30, **MIXED16).fits_alone(40, 300)
    assert why == (
        "it needs 44 KV blocks alone (a prefill of up to 339 tokens (a recompute: prompt + outputs but the last) fed "
        "in chunks of at most 16 tokens peaks at 44, its row ends at 44), more than the pool's 30"
    )
    assert _engine(model, 44, **MIXED16).fits_alone(40, 300) is None


def test_the_preallocated_layout_feeds_prompts_whole_and_says_so(model):
    limit = ContinuousBatchingEngine(model, EngineConfig(**SH32)).slot_bytes * 64  # 64 slots of every layer
    engine = ContinuousBatchingEngine(model, EngineConfig(kv_memory_limit_bytes=limit, **SH32))
    why = engine.fits_alone(200, 8)
    assert why is not None and "its prefill of 200 tokens at once" in why and f"limit of {limit} bytes" in why
    assert engine.fits_alone(60, 8) is None  # (32 + 60) / 2 layers' slots: within 64


@pytest.mark.parametrize("blocks", [5, 8, 12])
def test_chunked_requests_admitted_alone_all_finish_in_a_small_pool(model, blocks):
    """Two such requests share the pool (waiting, or preempted and recomputed in chunks): both finish, the pool
    never holds more than it has. (Their tokens may differ from a lone run: a budgeted cache compresses at chunk
    boundaries, which depend on what else runs in the step.)"""
    requests = [GenerationRequest(f"r{i}", _prompt(150 + 30 * i, seed=i), 12, ignore_eos=True) for i in range(2)]
    engine = _engine(model, blocks, **MIXED16, **SH32)
    assert all(engine.fits_alone(len(r.prompt_ids), 12) is None for r in requests)
    got = _serve(engine, requests)
    assert all(got[r.request_id].error is None and len(got[r.request_id].output_ids) == 12 for r in requests)
    assert engine.stats()["peak_kv_blocks_in_use"] <= blocks and engine.pool.blocks_in_use == 0
