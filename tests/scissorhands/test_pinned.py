"""Pinned tokens (BudgetedCache.set_pinned_tokens): a row's first tokens are never evicted and hold slots beside its
budget, on the preallocated and the paged layout, through row selection and merges."""

from __future__ import annotations

import pytest
import torch

from scissorhands import make_cache
from scissorhands.batching import merge_rows, row_positions, select_rows
from scissorhands.paged import BlockPool, release_cache
from scissorhands.testing import tiny_llama

PARAMS = {"scissorhands": dict(history_window=4, count_chunk_steps=2), "h2o": {}, "streaming_llm": {}}


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _prompt(n, seed=3):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _run(model, policy, pool, prompt, pinned, budget=8, per_row=False, steps=20, check=None):
    """Prefill `prompt` (one row) with `pinned` tokens pinned (None: no call), decode `steps` greedy tokens;
    `check(cache)` after the prefill and every step. Returns every step's logits ``(1, vocab)`` and the cache."""
    cache = make_cache(policy, model, pool=pool, budget_tokens=budget, **PARAMS[policy])
    if per_row:
        cache.set_row_budgets([budget])
    if pinned is not None:
        cache.set_pinned_tokens([pinned])
    out = [model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1]]
    for _ in range(steps):
        if check is not None:
            check(cache)
        out.append(model(input_ids=out[-1].argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1])
    if check is not None:
        check(cache)
    return out, cache


@pytest.mark.parametrize("per_row", [False, True], ids=["shared-budget", "per-row-budget"])
@pytest.mark.parametrize("paged", [False, True], ids=["preallocated", "paged"])
@pytest.mark.parametrize("policy", list(PARAMS))
def test_a_pinned_row_keeps_its_first_tokens_and_its_budget_applies_to_the_rest(model, policy, paged, per_row):
    pinned, budget = 8, 8

    def check(cache):
        for layer in cache.layers:
            st = layer.slot_time[0].to(torch.int64)  # (heads, slots)
            assert torch.equal(st[:, :pinned], torch.arange(pinned).expand(st.shape[0], pinned))
            held = int(layer.held[0])
            assert held <= pinned + budget
            assert int((st >= pinned).sum(-1).max()) <= budget  # the budget bounds what follows the pinned prefix

    pool = BlockPool(200, 4) if paged else None
    _, cache = _run(model, policy, pool, _prompt(30), pinned, budget, per_row, check=check)
    assert int(cache.layers[0].held[0]) == pinned + budget  # 30 + 20 tokens seen: full to P + B
    assert cache.evicted_tokens > 0
    if paged:
        # the row holds ceil((P + B) / 4) = 4 blocks per layer, the pool all of them
        assert pool.blocks_in_use == 4 * len(cache.layers)
        release_cache(cache)
        assert pool.blocks_in_use == 0


@pytest.mark.parametrize("policy", list(PARAMS))
def test_the_paged_and_preallocated_layouts_compute_the_same_pinned_rows(model, policy):
    want, _ = _run(model, policy, None, _prompt(30), 8)
    got, cache = _run(model, policy, BlockPool(200, 4), _prompt(30), 8)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    release_cache(cache)


@pytest.mark.parametrize("paged", [False, True], ids=["preallocated", "paged"])
@pytest.mark.parametrize("policy", list(PARAMS))
def test_no_pinned_tokens_is_bit_identical_to_no_call_and_pinning_changes_what_is_kept(model, policy, paged):
    pools = [BlockPool(200, 4) if paged else None for _ in range(3)]
    base, c0 = _run(model, policy, pools[0], _prompt(30), None)
    zero, c1 = _run(model, policy, pools[1], _prompt(30), 0)
    pinned, c2 = _run(model, policy, pools[2], _prompt(30), 8)
    for a, b in zip(base, zero):
        assert torch.equal(a, b)
    assert all(torch.equal(x.slot_time, y.slot_time) for x, y in zip(c0.layers, c1.layers))
    assert int(c2.layers[0].held[0]) == int(c0.layers[0].held[0]) + 8  # the pinned tokens are held beside B
    for c in (c0, c1, c2):
        release_cache(c)


@pytest.mark.parametrize("paged", [False, True], ids=["preallocated", "paged"])
@torch.inference_mode()
def test_pinned_counts_survive_merges_and_row_selection(model, paged):
    """Row 0 pins 8 tokens, row 1 (from a cache that pinned none) pins none; merged, decoded, row 1 leaves: each
    row computes what it computes alone, and row 0 keeps its pinned tokens throughout."""
    pool = BlockPool(300, 4) if paged else None
    prompts = [_prompt(30, seed=4), _prompt(14, seed=5)]
    policy, budget = "scissorhands", 8

    def alone(i):
        return _run(model, policy, None, prompts[i], 8 if i == 0 else None, steps=24)[0]

    caches, logits = [], []
    for i in range(2):
        cache = make_cache(policy, model, pool=pool, budget_tokens=budget, **PARAMS[policy])
        if i == 0:
            cache.set_pinned_tokens([8])
        logits.append(model(input_ids=prompts[i], cache=cache, use_cache=True).logits[:, -1])
        caches.append(cache)
    cache = merge_rows(*caches)
    assert cache.pinned_tokens() == [8, 0]
    steps = [torch.cat(logits)]
    rows = [0, 1]
    for step in range(24):
        if step == 12:  # row 1 leaves
            cache, rows = select_rows(cache, [0]), [0]
            assert cache.pinned_tokens() == [8]
        nxt = steps[-1][: len(rows)].argmax(-1, keepdim=True)
        out = model(input_ids=nxt, position_ids=row_positions(cache), cache=cache, use_cache=True).logits[:, -1]
        steps.append(out if len(rows) == 2 else torch.cat([out, out.new_full(out.shape, float("nan"))]))
        st = cache.layers[0].slot_time[0].to(torch.int64)
        assert torch.equal(st[:, :8], torch.arange(8).expand(st.shape[0], 8))
        assert int(cache.layers[0].held[0]) <= 8 + budget
        assert len(rows) == 1 or int(cache.layers[0].held[1]) <= budget
    for i in range(2):
        n = 25 if i == 0 else 13
        for got, want in zip([s[i] for s in steps][:n], alone(i)[:n]):
            torch.testing.assert_close(got, want[0], rtol=0, atol=1e-5)
    release_cache(cache)


@torch.inference_mode()
def test_a_paged_compaction_never_writes_a_block_holding_only_pinned_slots(model, monkeypatch):
    """After the prefill, no write (decode appends, compactions at every eviction) reaches the pool blocks that hold
    only the row's pinned slots: such a block can be shared read-only."""
    pool = BlockPool(200, 4)
    cache = make_cache("h2o", model, pool=pool, budget_tokens=8)
    cache.set_pinned_tokens([10])  # slots 0..9: blocks 0 and 1 whole, block 2 half pinned
    model(input_ids=_prompt(30), cache=cache, use_cache=True)
    before = [layer.store.blocks[0][:2] for layer in cache.layers]
    frozen = {b for blocks in before for b in blocks}
    slots = next(iter(pool.buffers.values())).shape[1]
    buffers = {b.data_ptr() for b in pool.buffers.values()}
    written: set[int] = set()
    index_copy = torch.Tensor.index_copy_

    def spy(self, dim, index, source):
        if self.data_ptr() in buffers:
            written.update(((index % slots) // pool.block_tokens).tolist())
        return index_copy(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", spy)
    nxt = torch.tensor([[5]])
    for _ in range(20):
        nxt = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    assert cache.evicted_tokens > 0 and written  # evictions happened, and the pool was written
    assert not written & frozen
    assert [layer.store.blocks[0][:2] for layer in cache.layers] == before  # still the row's first blocks
    release_cache(cache)


def test_pinned_tokens_are_checked(model):
    with pytest.raises(ValueError, match="keeps every token"):
        make_cache("full", model).set_pinned_tokens([4])
    cache = make_cache("h2o", model, budget_tokens=8)
    with pytest.raises(ValueError, match="pinned tokens: each must be an integer >= 0, got -1"):
        cache.set_pinned_tokens([-1])
    with torch.inference_mode():
        model(input_ids=torch.arange(5).expand(2, 5), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="pinned tokens: 1 given for 2 rows"):
        cache.set_pinned_tokens([3])
