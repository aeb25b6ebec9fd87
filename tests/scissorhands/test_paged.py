"""Paged KV storage (scissorhands.paged): every policy computes what the preallocated layout computes, and the
block pool is the memory."""

from __future__ import annotations

import pytest
import torch

from scissorhands import POLICIES, make_cache
from scissorhands.batching import merge_rows, row_positions, select_rows
from scissorhands.paged import BlockPool, PoolExhausted, cache_blocks, release_cache
from scissorhands.testing import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _cache(model, policy, pool, kv_bits):
    budget = {} if policy == "full" else dict(budget_tokens=12)
    return make_cache(policy, model, pool=pool, kv_bits=kv_bits, kv_group_size=16, **budget)


@torch.inference_mode()
def _serve(model, policy, pool, kv_bits, steps=30, leave_at=15):
    """Rows prefilled apart (one of 20 tokens, two of 7), merged, decoded greedily; row 0 leaves at `leave_at`.
    Returns every step's logits and the cache."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 128, (1, 20), generator=g), torch.randint(0, 128, (2, 7), generator=g)
    first = _cache(model, policy, pool, kv_bits)
    la = model(input_ids=a, cache=first, use_cache=True).logits[:, -1]
    second = _cache(model, policy, pool, kv_bits)
    lb = model(input_ids=b, cache=second, use_cache=True).logits[:, -1]
    cache = merge_rows(first, second)
    logits = [torch.cat([la, lb])]
    nxt = logits[0].argmax(-1, keepdim=True)
    for step in range(steps):
        if step == leave_at:
            cache = select_rows(cache, [1, 2])
            nxt = nxt[[1, 2]]
        out = model(input_ids=nxt, position_ids=row_positions(cache), cache=cache, use_cache=True).logits[:, -1]
        logits.append(out)
        nxt = out.argmax(-1, keepdim=True)
    return logits, cache


@pytest.mark.parametrize("kv_bits", [None, 4], ids=["dense", "4-bit"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_computes_the_preallocated_logits_on_rows_of_different_lengths(model, policy, kv_bits):
    want, _ = _serve(model, policy, None, kv_bits)
    pool = BlockPool(200, 4)
    got, cache = _serve(model, policy, pool, kv_bits)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    # two rows of 7 + 31 = 38 tokens hold ceil(38 / 4) = 10 blocks per layer; budgeted rows ceil(12 / 4) = 3
    per_row = 10 if policy == "full" else 3
    assert cache_blocks(cache) == pool.blocks_in_use == 2 * per_row * len(cache.layers)
    release_cache(cache)
    assert pool.blocks_in_use == 0


@torch.inference_mode()
def test_the_pool_is_the_allocation_and_kv_cache_bytes_counts_blocks_in_use(model):
    pool = BlockPool(50, 8)
    cache = make_cache("full", model, pool=pool)
    model(input_ids=torch.arange(20)[None], cache=cache, use_cache=True)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    slot_bytes = cfg.num_key_value_heads * head_dim * 4 * 2  # keys and values, float32, one layer
    assert pool.nbytes() == sum(b.untyped_storage().nbytes() for b in pool.buffers.values()) == 50 * 8 * slot_bytes
    assert pool.block_nbytes() == 8 * slot_bytes
    assert pool.blocks_in_use == cache_blocks(cache) == 3 * cfg.num_hidden_layers  # ceil(20 / 8) per layer
    bookkeeping = cache.bookkeeping_bytes()
    assert bookkeeping == sum(layer.store.dense.nbytes() for layer in cache.layers) > 0
    assert cache.kv_cache_bytes() == pool.blocks_in_use * pool.block_nbytes() + bookkeeping
    release_cache(cache)
    assert pool.free_blocks == pool.usable_blocks == 49


@torch.inference_mode()
def test_a_budgeted_row_returns_its_prompt_blocks_and_refills_its_budget_in_place(model):
    pool = BlockPool(100, 4)
    cache = make_cache("scissorhands", model, pool=pool, budget_tokens=10, history_window=4, count_chunk_steps=2)
    model(input_ids=torch.arange(40)[None], cache=cache, use_cache=True)
    layers = len(cache.layers)
    assert pool.blocks_in_use == 3 * layers  # ceil(10 / 4) kept of ceil(40 / 4) = 10 at the prompt's peak
    assert pool.peak_blocks_in_use == (layers - 1) * 3 + 10  # one layer at a time holds the whole prompt
    for t in range(40, 60):
        model(input_ids=torch.tensor([[t % 128]]), cache=cache, use_cache=True)
        assert pool.blocks_in_use == 3 * layers
        assert all(layer.num_slots <= 10 for layer in cache.layers)


@torch.inference_mode()
def test_an_exhausted_pool_raises_before_writing_and_keeps_its_blocks(model):
    pool = BlockPool(4, 4)  # 3 usable blocks: a 2-layer model's 16-token prompt needs 4 per layer
    cache = make_cache("full", model, pool=pool)
    with pytest.raises(PoolExhausted, match="4 KV blocks needed, 3 free"):
        model(input_ids=torch.arange(16)[None], cache=cache, use_cache=True)
    assert pool.free_blocks == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=10, block_tokens=0), "block_tokens"),
        (dict(num_blocks=10, block_tokens=2.5), "block_tokens"),
        (dict(num_blocks=1, block_tokens=4), "num_blocks"),
    ],
)
def test_bad_pool_sizes_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockPool(**kwargs)


@torch.inference_mode()
def test_what_the_paged_layout_cannot_do_is_refused_clearly(model):
    with pytest.raises(ValueError, match="simulate=True needs kv_layout 'preallocated'"):
        make_cache("scissorhands", model, pool=BlockPool(10, 4), budget_tokens=8, simulate=True)
    cache = make_cache("full", model, pool=BlockPool(40, 4))
    ids = torch.arange(10).expand(2, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="takes no padded batch"):
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)


@pytest.mark.parametrize("paged", [False, True], ids=["preallocated", "paged"])
@pytest.mark.parametrize("policy", ["scissorhands", "h2o", "streaming_llm"])
@torch.inference_mode()
def test_rows_with_their_own_budgets_compute_what_each_computes_alone(model, policy, paged):
    """Rows of one batch, budgets 8 and 20 (set_row_budgets), merged and decoded: each row's logits are those of
    the row run alone with its budget, and each holds at most its own budget."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (1, n), generator=g) for n in (30, 12)]
    budgets = [8, 20]
    params = dict(history_window=4, count_chunk_steps=2) if policy == "scissorhands" else {}
    pool = BlockPool(100, 4) if paged else None

    def alone(i):
        cache = make_cache(policy, model, budget_tokens=budgets[i], **params)
        out = [model(input_ids=prompts[i], cache=cache, use_cache=True).logits[0, -1]]
        for _ in range(25):
            out.append(model(input_ids=out[-1].argmax()[None, None], cache=cache, use_cache=True).logits[0, -1])
        return out

    caches = []
    logits = []
    for i in range(2):
        cache = make_cache(policy, model, pool=pool, budget_tokens=max(budgets), **params)
        cache.set_row_budgets([budgets[i]])
        logits.append(model(input_ids=prompts[i], cache=cache, use_cache=True).logits[:, -1])
        caches.append(cache)
    cache = merge_rows(*caches)
    steps = [torch.cat(logits)]
    for _ in range(25):
        nxt = steps[-1].argmax(-1, keepdim=True)
        steps.append(model(input_ids=nxt, position_ids=row_positions(cache), cache=cache, use_cache=True).logits[:, -1])
        held = cache.layers[0].held.tolist()
        assert held[0] <= budgets[0] and held[1] <= budgets[1]
    for i in range(2):
        for got, want in zip((s[i] for s in steps), alone(i)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_per_row_budgets_are_checked(model):
    with pytest.raises(ValueError, match="keeps every token"):
        make_cache("full", model).set_row_budgets([4])
    cache = make_cache("h2o", model, budget_tokens=8)
    with pytest.raises(ValueError, match="budget_tokens must be an integer >= 1, got 0"):
        cache.set_row_budgets([0])
