"""Invariants of the budgeted cache for every policy: real eviction computes the logits of simulation
over a long generation, memory measured against transformers' own cache, in-place decode storage,
bookkeeping costs, validation."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from scissorhands import POLICIES, make_cache
from scissorhands.testing import tiny_llama
from tests.generate_helpers import greedy_generate

ALL = list(POLICIES)
EVICTING = [p for p, cls in POLICIES.items() if cls.evicts]


def _ids(batch, n, seed=0):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _feed(model, cache, ids, new):
    """Prefill ``ids``, then feed ``new`` greedy tokens one at a time; returns the per-call logits."""
    logits = []
    with torch.inference_mode():
        out = model(ids, cache=cache)
        logits.append(out.logits[:, -1])
        for _ in range(new):
            out = model(out.logits[:, -1].argmax(-1, keepdim=True), cache=cache)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)  # (batch, new + 1, vocab)


@pytest.mark.parametrize("policy", EVICTING)
def test_real_eviction_equals_simulation_over_a_long_left_padded_generation(model, policy):
    ids = _ids(2, 24, 1)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    outs = []
    for simulate in (False, True):
        cache = make_cache(policy, model, budget_tokens=16, simulate=simulate)
        outs.append(greedy_generate(model, ids, cache, 120, mask=mask))
        if not simulate:
            assert max(cache.num_slots()) <= 16 and cache.evicted_tokens > 2 * 2 * 100
        else:
            assert cache.num_slots() == [143, 143]  # nothing removed, only masked
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(outs[0].logits, outs[1].logits)) < 1e-5


@pytest.mark.parametrize("policy", EVICTING)
@pytest.mark.parametrize("ratio", [2, 4, 5])
def test_bytes_at_ratio_r_are_at_most_full_over_r_plus_the_stated_bookkeeping(model, policy, ratio):
    ids, new = _ids(2, 100, 2), 100  # 200 tokens seen in the end
    full = DynamicCache(config=model.config)
    _feed(model, full, ids, new)
    full_bytes = sum(t.numel() * t.element_size() for layer in full.layers for t in (layer.keys, layer.values))
    cache = make_cache(policy, model, compression_ratio=ratio, max_length=200)
    _feed(model, cache, ids, new)
    assert cache.get_seq_length() == 200 and cache.budget_tokens == 200 // ratio
    pol = cache.policy
    # bytes per slot and head: an int16 slot time (tiny llama: 512 positions) + the policy's statistics
    stated = 2 + pol.state_width * torch.empty((), dtype=pol.state_dtype).element_size()
    bookkeeping = 2 * 2 * 2 * cache.budget_tokens * stated  # layers x rows x kv heads x B
    assert cache.bookkeeping_bytes() == bookkeeping
    assert cache.kv_cache_bytes() <= full_bytes / ratio + bookkeeping
    assert cache.peak_kv_cache_bytes == cache.kv_cache_bytes()  # flat: B slots from the first call


def test_decode_tokens_are_written_in_place_between_evictions(model):
    cache = make_cache("scissorhands", model, budget_tokens=16)  # m = 8: evicts every 8 steps
    ids = _ids(1, 16, 3)
    pointers, slots = [], []
    with torch.inference_mode():
        out = model(ids, cache=cache)
        for _ in range(24):
            out = model(out.logits[:, -1].argmax(-1, keepdim=True), cache=cache)
            pointers.append(cache.layers[0].store.buffers["keys"].data_ptr())
            slots.append(cache.layers[0].num_slots)
    assert slots[:9] == [9, 10, 11, 12, 13, 14, 15, 16, 9]
    assert len(set(pointers[:8])) == 1 and len(set(pointers[8:16])) == 1  # a new buffer only at an eviction
    assert cache.layers[0].store.capacity == 16


def test_full_with_max_length_allocates_once_and_grows_exactly_without(model):
    sized, exact = make_cache("full", model, max_length=40), make_cache("full", model)
    ptrs = []
    with torch.inference_mode():
        for cache in (sized, exact):
            out = model(_ids(1, 10, 4), cache=cache)
            for _ in range(20):
                out = model(out.logits[:, -1].argmax(-1, keepdim=True), cache=cache)
                if cache is sized:
                    ptrs.append(cache.layers[0].store.buffers["keys"].data_ptr())
    assert len(set(ptrs)) == 1 and sized.layers[0].store.capacity == 40
    assert exact.layers[0].store.capacity == exact.layers[0].num_slots == 30
    assert exact.kv_cache_bytes() == 2 * 2 * 30 * (2 * 16 * 4 + 2)  # layers x heads x slots x (k, v, int16 time)


def test_prompt_compression_releases_the_prompt_sized_buffer(model):
    cache = make_cache("h2o", model, budget_tokens=32)
    with torch.inference_mode():
        model(_ids(1, 300, 5), cache=cache)
    assert all(layer.store.capacity == 32 == layer.num_slots for layer in cache.layers)
    assert cache.kv_cache_bytes() == 2 * 2 * 32 * (2 * 16 * 4 + 2 + 4)  # k, v, int16 time, h2o's float32 score


def test_windowed_counts_cost_at_most_5_percent_of_a_16_bit_kv_slot():
    model = tiny_llama(0, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    model.to(torch.bfloat16)
    cache = make_cache("scissorhands", model, budget_tokens=16)
    with torch.inference_mode():
        model(_ids(1, 40, 6), cache=cache)
    store = cache.layers[0].store
    kv = sum(store.buffers[n].numel() * store.buffers[n].element_size() for n in ("keys", "values"))
    counts = store.buffers["state"].numel() * store.buffers["state"].element_size()
    assert store.buffers["keys"].shape[-1] == 64 and counts / kv == pytest.approx(8 / 256)
    assert counts / kv <= 0.05


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(budget_tokens=8, compression_ratio=2), "exactly one"),
        (dict(), "exactly one"),
        (dict(budget_tokens=8, max_length=0), "max_length"),
        (dict(budget_tokens=8, recent_window=8), "budget_tokens"),
        (dict(budget_tokens=8, drop_tokens=9), "drop_tokens"),
        (dict(budget_tokens=2.5), "budget_tokens"),
        (dict(compression_ratio=float("inf")), "compression_ratio"),
        (dict(budget_tokens=8, simulate=True, kv_bits=8), "kv_bits"),
    ],
)
def test_make_cache_validates_and_names_the_field(model, kw, field):
    with pytest.raises(ValueError, match=field):
        make_cache("scissorhands", model, **kw)


@pytest.mark.parametrize("policy", ALL)
def test_reset_cache_is_reusable_and_num_return_sequences_expands_rows(model, policy):
    kw = {} if policy == "full" else dict(budget_tokens=10)
    cache = make_cache(policy, model, **kw)
    ids = _ids(1, 20, 7)
    first = model.generate(
        ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.kv_cache_bytes() == 0
    again = model.generate(
        ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0
    )
    assert torch.equal(first, again)
    torch.manual_seed(0)
    fresh = make_cache(policy, model, **kw)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=fresh,
        max_new_tokens=12,
        do_sample=True,
        num_return_sequences=3,
        pad_token_id=0,
    )
    assert out.shape == (3, 32) and fresh.layers[0].held.shape == (3,)
    assert policy == "full" or max(fresh.num_slots()) <= 10


def test_keys_are_read_only_views_of_the_layer_storage(model):
    cache = make_cache("scissorhands", model, budget_tokens=8)
    with torch.inference_mode():
        model(_ids(1, 6, 8), cache=cache)
    layer = cache.layers[0]
    assert layer.keys.data_ptr() == layer.store.buffers["keys"].data_ptr()
    with pytest.raises(AttributeError, match="read-only"):
        layer.keys = torch.zeros(1)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_fused_prefill_output_and_lse_probabilities_equal_the_explicit_attention(dtype, atol):
    """A fresh prompt's outputs come from the fused causal kernel (the full cache's numbers) and its observed
    queries' probabilities from exp(score - lse) over the keys they see: equal to the softmax of
    `explicit_attention` (float32: to rounding; bfloat16: to the rounding of bfloat16 scores)."""
    from scissorhands.attention import causal_attention_lse, causal_probs, causal_probs_chunks, explicit_attention

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, h, 40, 16, generator=g).to(dtype) for h in (4, 2, 2))  # GQA: 4 query heads, 2 KV
    out, lse = causal_attention_lse(q, k, v, 0.25)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    assert torch.equal(out, sdpa)
    visible = torch.ones(40, 40, dtype=torch.bool).tril().expand(2, 2, 40, 40)
    expect = explicit_attention(q, k, None, visible, 0.25)[1]  # (2, 2, 2, 40, 40)
    for s, e in ((30, 40), (12, 25)):  # queries [s, e), keys [0, e)
        probs = causal_probs(q[:, :, s:e], k[:, :, :e], 0.25, lse[:, :, s:e])
        torch.testing.assert_close(probs, expect[..., s:e, :e], atol=atol, rtol=0)
        assert bool((probs[..., :, -1][..., :-1] == 0).all())  # a later key gets zero
        without_lse = causal_probs(q[:, :, s:e], k[:, :, :e], 0.25, None)
        torch.testing.assert_close(without_lse, expect[..., s:e, :e], atol=atol, rtol=0)
    # the chunked form (bfloat16: one matmul per 10 queries, 12 rounded down to whole chunks of 5): the same
    # numbers chunk by chunk, over the last 24 queries
    chunks = [(s, e, p.clone()) for s, e, p in causal_probs_chunks(q[:, :, 16:], k, 0.25, lse[:, :, 16:], 5, 12)]
    assert [(s, e) for s, e, _ in chunks] == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 24)]
    for s, e, probs in chunks:
        torch.testing.assert_close(probs, expect[..., 16 + s : 16 + e, : 16 + e], atol=atol, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_one_query_decode_attention_equals_grouped_query_sdpa(dtype, atol):
    """A decode step's attention (one query per row; in bfloat16 the query heads of a KV head passed as that
    head's queries, in float32 the grouped-query kernel itself) gives grouped-query sdpa's output to rounding,
    with and without the layer's per-slot mask, and zeros for a row that sees no slot; a chunk of several
    queries runs the grouped-query kernel."""
    from scissorhands.cache import BudgetedLayer

    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 6, 1, 16, generator=g).to(dtype)  # 6 query heads, 2 KV heads
    k, v = (torch.randn(3, 2, 37, 16, generator=g).to(dtype) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = BudgetedLayer._sdpa_chunk(q, k, v, None, 0.25)
    assert out.shape == (3, 6, 1, 16) and out.dtype == dtype
    torch.testing.assert_close(out, sdpa(q, k, v, scale=0.25, enable_gqa=True), atol=atol, rtol=0)
    visible = torch.rand(3, 2, 1, 37, generator=g) > 0.4  # (b, hkv, 1, S)
    visible[2, 1] = False  # row 2, KV head 1: nothing
    out = BudgetedLayer._sdpa_chunk(q, k, v, visible, 0.25)
    ref = sdpa(q, k, v, attn_mask=visible.repeat_interleave(3, dim=1), scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out[:2], ref[:2], atol=atol, rtol=0)
    torch.testing.assert_close(out[2, :3], ref[2, :3], atol=atol, rtol=0)
    assert bool((out[2, 3:] == 0).all())  # its 3 query heads: zeros
    qc = torch.randn(3, 6, 4, 16, generator=g).to(dtype)  # 4 queries: grouped-query kernel
    vis4 = torch.ones(4, 37, dtype=torch.bool).tril(33).expand(3, 2, 4, 37)
    assert torch.equal(
        BudgetedLayer._sdpa_chunk(qc, k, v, vis4, 0.25),
        sdpa(qc, k, v, attn_mask=vis4.repeat_interleave(3, dim=1), scale=0.25, enable_gqa=True),
    )


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_decode_attention_edge_layouts(dtype, atol):
    """One query head per KV head (group 1: the grouped layout is the plain one), and a chunk of several
    queries where one query of one row sees no slot: its heads get zeros, every other query sdpa's output."""
    from scissorhands.cache import BudgetedLayer

    g = torch.Generator().manual_seed(7)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(2, 2, 1, 16, generator=g).to(dtype)  # 2 query heads, 2 KV heads
    k, v = (torch.randn(2, 2, 23, 16, generator=g).to(dtype) for _ in range(2))
    visible = torch.rand(2, 2, 1, 23, generator=g) > 0.5
    visible[..., 0] = True
    torch.testing.assert_close(
        BudgetedLayer._sdpa_chunk(q, k, v, visible, 0.3), sdpa(q, k, v, attn_mask=visible, scale=0.3), atol=atol, rtol=0
    )
    qc = torch.randn(2, 6, 4, 16, generator=g).to(dtype)  # 4 queries, 6 heads on 2 KV heads
    kc, vc = (torch.randn(2, 2, 23, 16, generator=g).to(dtype) for _ in range(2))
    vis = torch.ones(4, 23, dtype=torch.bool).tril(19).expand(2, 2, 4, 23).clone()
    vis[1, 0, 2] = False  # row 1, KV head 0, query 2: nothing
    out = BudgetedLayer._sdpa_chunk(qc, kc, vc, vis, 0.3)
    ref = sdpa(qc, kc, vc, attn_mask=vis.repeat_interleave(3, dim=1), scale=0.3, enable_gqa=True)
    assert bool((out[1, :3, 2] == 0).all())  # its 3 query heads: zeros
    blank = torch.zeros_like(out, dtype=torch.bool)
    blank[1, :3, 2] = True
    torch.testing.assert_close(out[~blank], ref[~blank], atol=atol, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_explicit_attention_over_a_slice_of_the_slot_buffer(dtype, atol):
    """Keys and values as a layer hands them over (the used slots of a larger buffer, a strided view): the
    probabilities are the float32 softmax of the scaled scores, contiguous, per query head of each KV head,
    and the output is probs @ values; in bfloat16 to the rounding of bfloat16 scores."""
    from scissorhands.attention import explicit_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 1, 16, generator=g).to(dtype)  # 6 query heads, 2 KV heads
    kbuf, vbuf = (torch.randn(2, 2, 30, 16, generator=g).to(dtype) for _ in range(2))
    k, v = kbuf[:, :, :21], vbuf[:, :, :21]  # 21 used slots of 30
    visible = torch.rand(2, 2, 1, 21, generator=g) > 0.3
    out, probs = explicit_attention(q, k, v, visible, 0.25)
    assert probs.shape == (2, 2, 3, 1, 21) and probs.dtype == torch.float32 and probs.is_contiguous()
    scores = torch.einsum("bkgd,bksd->bkgs", q.double().view(2, 2, 3, 16), k.double()) * 0.25
    ref = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)  # (2, 2, 3, 21)
    torch.testing.assert_close(probs[:, :, :, 0].double(), ref, atol=atol, rtol=0)
    expect = torch.einsum("bkgs,bksd->bkgd", ref, v.double()).reshape(2, 6, 1, 16)
    torch.testing.assert_close(out.double(), expect, atol=5 * atol, rtol=0)
    # several queries (a prefill chunk over kept slots): the keys @ q^T form of bfloat16, transposed back
    qc = torch.randn(2, 6, 5, 16, generator=g).to(dtype)
    vis5 = torch.rand(2, 2, 5, 21, generator=g) > 0.3
    vis5[..., 0] = True
    out, probs = explicit_attention(qc, k, v, vis5, 0.25)
    assert probs.shape == (2, 2, 3, 5, 21) and out.shape == (2, 6, 5, 16)
    scores = torch.einsum("bkgqd,bksd->bkgqs", qc.double().view(2, 2, 3, 5, 16), k.double()) * 0.25
    ref = torch.softmax(scores.masked_fill(~vis5[:, :, None], float("-inf")), -1)  # (2, 2, 3, 5, 21)
    torch.testing.assert_close(probs.double(), ref, atol=atol, rtol=0)
    expect = torch.einsum("bkgqs,bksd->bkgqd", ref, v.double()).reshape(2, 6, 5, 16)
    torch.testing.assert_close(out.double(), expect, atol=5 * atol, rtol=0)
