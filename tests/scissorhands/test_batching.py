"""Continuous-batching row operations on a BudgetedCache (scissorhands.batching) with a tiny model.

A sequence that joins a running batch (prefilled alone, then merged), or that stays after others
left, must produce exactly the greedy tokens of its batch-of-1 `generate` run: with a budget that
never evicts, and with a real budget that evicts (per-row clocks keep each row's eviction decisions).
"""

from __future__ import annotations

import pytest
import torch

from scissorhands import make_cache
from scissorhands.batching import merge_rows, physical_slots, row_positions, select_rows, sequence_slot_bytes

CONFIGS = {
    "full": dict(policy="full"),
    "budget>=length": dict(policy="scissorhands", budget_tokens=200),
    "real-budget": dict(policy="scissorhands", budget_tokens=16, history_window=20, count_chunk_steps=5),
    "real-budget-exact-window": dict(policy="scissorhands", budget_tokens=12, history_window=8, count_chunk_steps=1),
    # one token dropped at a time: slots outlive the window, so expired counts must be cleared per row
    "real-budget-long-lived": dict(
        policy="scissorhands", budget_tokens=12, history_window=8, count_chunk_steps=2, drop_tokens=1
    ),
    # the key seam (state from the key) and an observation window + pooling, on per-row clocks
    "knorm-real-budget": dict(policy="knorm", budget_tokens=12),
    "snapkv-real-budget": dict(policy="snapkv", budget_tokens=12, window_size=4, kernel_size=3),
}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(model, ids, new_tokens, cfg, caches=None) -> list[int]:
    cache = make_cache(model=model, **cfg)
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        cache=cache,
        max_new_tokens=new_tokens,
        do_sample=False,
    )
    if caches is not None:
        caches.append(cache)
    return out[0, len(ids) :].tolist()


def _kept(cache, row: int) -> list:
    """Per layer and KV head: the row's kept slot times (its own clock) and their policy statistics."""
    out = []
    for layer in cache.layers:
        st = layer.slot_time[row]  # (h, S)
        for h in range(st.shape[0]):
            keep = st[h] >= 0
            out.append((st[h][keep].tolist(), None if layer.state is None else layer.state[row, h][keep].tolist()))
    return out


def _prefill(model, ids, cfg):
    cache = make_cache(model=model, **cfg)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)


def _decode(model, cache, tokens):
    with torch.inference_mode():
        out = model(input_ids=tokens, position_ids=row_positions(cache), cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True)  # (rows, 1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_joined_and_remaining_rows_match_their_batch_of_one_runs(model, name):
    cfg = CONFIGS[name]
    a, b, c = _ids(40, 1), _ids(23, 2), _ids(9, 3)
    new = 30
    alone = []
    expect = [_alone(model, x, new, cfg, alone) for x in (a, b, c)]

    cache, tokens = _prefill(model, a, cfg)
    cache = merge_rows(None, cache)
    outs = [[int(tokens[0, 0])]]
    for step in range(new - 1):
        if step in (7, 12):  # b joins at step 7, c at step 12
            joined, first = _prefill(model, b if step == 7 else c, cfg)
            cache = merge_rows(cache, joined)
            tokens = torch.cat([tokens, first])
            outs.append([int(first[0, 0])])
        tokens = _decode(model, cache, tokens)
        for row, t in enumerate(tokens[:, 0].tolist()):
            outs[row].append(t)
    assert outs[0] == expect[0]
    # a leaves; b and c go on in a compacted batch
    cache = select_rows(cache, [1, 2])
    tokens = tokens[1:]
    outs = outs[1:]
    while len(outs[1]) < new:
        tokens = _decode(model, cache, tokens)
        for row, t in enumerate(tokens[:, 0].tolist()):
            outs[row].append(t)
    assert outs[0][:new] == expect[1]
    assert outs[1] == expect[2]
    # c ran all its steps next to rows on other clocks: same kept slots and statistics as alone
    # (float statistics, the key norms and votes, equal up to the rounding of batched matmuls)
    kept, kept_alone = _kept(cache, 1), _kept(alone[2], 0)
    assert [times for times, _ in kept] == [times for times, _ in kept_alone]
    for (_, state), (_, state_alone) in zip(kept, kept_alone):
        assert (state is None) == (state_alone is None)
        if state is not None:
            torch.testing.assert_close(torch.tensor(state), torch.tensor(state_alone), atol=1e-6, rtol=1e-5)
    if "real-budget" in name:
        budget = cfg["budget_tokens"]
        assert 0 < physical_slots(cache) <= budget  # evicted: never more than B slots
        assert cache.evicted_tokens > 0
    else:
        # slots no remaining row needed were removed: the fullest row (b: 23 + 36 - 1 tokens) sets the size
        assert physical_slots(cache) == len(b) + len(outs[0]) - 1


def test_select_rows_compacts_and_empty_selection_is_none(model):
    cfg = CONFIGS["full"]
    long, _ = _prefill(model, _ids(50, 4), cfg)
    short, _ = _prefill(model, _ids(5, 5), cfg)
    cache = merge_rows(merge_rows(None, long), short)
    assert cache.num_slots() == [50, 50]  # the short row is padded to 50
    one_row_bytes = cache.kv_cache_bytes() // 2
    cache = select_rows(cache, [1])
    assert cache.num_slots() == [5, 5]
    assert cache.kv_cache_bytes() == one_row_bytes * 5 // 50
    assert select_rows(cache, []) is None


def test_merge_refuses_different_budgets(model):
    a, _ = _prefill(model, _ids(20, 6), dict(policy="scissorhands", budget_tokens=16))
    b, _ = _prefill(model, _ids(20, 7), dict(policy="scissorhands", budget_tokens=12))
    with pytest.raises(ValueError, match="budgets"):
        merge_rows(merge_rows(None, a), b)


def test_sequence_slot_bytes_is_one_slot_of_every_layer(model):
    # tiny llama: 2 layers x 2 KV heads x (keys + values: 2 x 16 float32 + slot time int16: 512 positions)
    assert sequence_slot_bytes(model, "full") == 2 * 2 * (2 * 16 * 4 + 2)
    # scissorhands adds history_window / count_chunk_steps uint8 counters per slot and head
    assert sequence_slot_bytes(model, "scissorhands", budget_tokens=16) == 2 * 2 * (2 * 16 * 4 + 2 + 400 // 50)


@pytest.mark.parametrize("name", ["full", "real-budget"])
def test_validity_check_is_skipped_only_while_no_slot_is_masked(model, name):
    """Decode attention skips the per-layer look for masked slots while `_maybe_masked` is False, so every
    writer of a negative slot time (left padding, filler slots of merged rows, eviction) must set it: after
    every call, a layer whose flag is False holds no padding, filler or evicted slot."""
    cfg = CONFIGS[name]

    def check(cache):
        for layer in cache.layers:
            assert layer._maybe_masked or not bool((layer.slot_time < 0).any())

    cache, tokens = _prefill(model, _ids(20, 1), cfg)
    check(cache)
    if name == "full":  # a fresh unpadded prompt: nothing masked
        assert not any(layer._maybe_masked for layer in cache.layers)
    cache = merge_rows(None, cache)
    for step in range(12):
        if step == 3:  # a shorter row joins: filler slots
            joined, first = _prefill(model, _ids(7, 2), cfg)
            cache = merge_rows(cache, joined)
            tokens = torch.cat([tokens, first])
            check(cache)
            assert all(layer._maybe_masked for layer in cache.layers)
        tokens = _decode(model, cache, tokens)
        check(cache)
    padded = make_cache(model=model, **cfg)
    ids, mask = torch.tensor(_ids(18, 4)).view(2, 9), torch.ones(2, 9, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, cache=padded)
    check(padded)
    assert all(layer._maybe_masked for layer in padded.layers)
