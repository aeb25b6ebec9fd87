"""transformers' continuous batching as an outside peer (`replica.generate_baseline.run_generate_batch`) on the tiny
model: its paged cache holds the KV limit's bytes, and its greedy tokens are our engine's (paged full cache)."""

from __future__ import annotations

import pytest

from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import full_batch_kv_limit_bytes
from replica.generate_baseline import generate_batch_cache_blocks, run_engines, run_generate_batch
from scissorhands import ATTN_IMPLEMENTATION

# the tiny model: 2 layers, 2 KV heads of 16 dims, float32: one token's keys and values in every layer
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4


def _requests() -> list[GenerationRequest]:
    """A few short requests of different prompt and output lengths (the tiny model has 128 ids)."""
    lengths = [(12, 5), (20, 9), (7, 3), (16, 12)]
    return [
        GenerationRequest(f"r{i}", [1 + (7 * i + 3 * j) % 127 for j in range(p)], n) for i, (p, n) in enumerate(lengths)
    ]


def test_its_cache_holds_the_limits_bytes_in_whole_blocks(model):
    limit = full_batch_kv_limit_bytes(model, 2, 20, 12)
    blocks, block_bytes = generate_batch_cache_blocks(model, limit, 4)
    assert block_bytes == 4 * TOKEN_BYTES and blocks == limit // block_bytes
    peer = run_generate_batch(model, _requests()[:1], kv_memory_limit_bytes=limit, page_tokens=4, desc=None)
    # the cache transformers built: those blocks, no more bytes of keys and values than the limit
    assert peer["kv_cache_blocks"] == blocks and peer["page_tokens"] == 4
    assert peer["kv_cache_bytes"] == blocks * block_bytes and limit - block_bytes < peer["kv_cache_bytes"] <= limit
    assert peer["kv_cache_tensor_bytes"] == peer["kv_cache_bytes"] + 2 * block_bytes  # its two padding blocks
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION  # ours again after the run


def test_its_greedy_tokens_are_our_paged_full_caches(model):
    reqs = _requests()
    limit = full_batch_kv_limit_bytes(model, 2, 20, 12)
    (ours,) = run_engines(
        model, [(EngineConfig(kv_layout="paged", kv_memory_limit_bytes=limit, block_tokens=4), reqs)], desc=None
    )
    peer = run_generate_batch(model, reqs, kv_memory_limit_bytes=limit, page_tokens=4, desc=None)
    assert peer["finished"] and peer["completed_requests"] == len(reqs)
    assert peer["output_tokens"] == sum(r.max_new_tokens for r in reqs) == ours["output_tokens"]  # EOS off
    assert peer["outputs"] == ours["outputs"]
    assert peer["wall_s"] > 0 and peer["cpu_s"] > 0 and peer["output_tok_per_s"] > 0


def test_a_limit_without_one_block_or_a_page_below_4_tokens_is_refused(model):
    with pytest.raises(ValueError, match="kv_memory_limit_bytes: 100 bytes hold no block"):
        generate_batch_cache_blocks(model, 100, 16)
    with pytest.raises(ValueError, match="page_tokens"):
        generate_batch_cache_blocks(model, 1 << 20, 3)
