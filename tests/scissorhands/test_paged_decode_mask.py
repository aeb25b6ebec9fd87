"""The paged layer's decode fast path (scissorhands.paged.PagedStore.validity): the slots a row's newest query sees,
read from its host-side slot count, are exactly the slots whose time is not masked, at every layer and step, for
every policy (tail evictions included), and the host counts follow the device ones."""

from __future__ import annotations

import pytest
import torch

from scissorhands import POLICIES, make_cache
from scissorhands.batching import merge_rows, row_positions, select_rows
from scissorhands.paged import BlockPool, PagedLayer, release_cache


def _check_layers(cache) -> None:
    for layer in cache.layers:
        st = layer.slot_time
        want = (st >= 0)[:, :, None, :]
        assert layer.store.slots_list() == layer.store.row_slots.tolist() == layer.held.tolist()
        if layer._all_slots_valid(st):
            assert bool(want.all())
        else:
            assert torch.equal(layer._valid_slots(st), want)


@pytest.mark.parametrize("policy", list(POLICIES))
@torch.inference_mode()
def test_paged_decode_mask_is_each_rows_unmasked_slots_for_every_policy(model, policy):
    pool = BlockPool(300, 4)
    budget = {} if policy == "full" else dict(budget_tokens=9)
    g = torch.Generator().manual_seed(1)
    caches, picked = [], []
    for length in (13, 5, 8):  # rows of different lengths, prefilled apart and merged
        c = make_cache(policy, model, pool=pool, **budget)
        ids = torch.randint(0, 128, (1, length), generator=g)
        picked.append(model(input_ids=ids, cache=c, use_cache=True).logits[:, -1].argmax(-1, keepdim=True))
        caches.append(c)
    cache = merge_rows(merge_rows(caches[0], caches[1]), caches[2])
    assert all(isinstance(layer, PagedLayer) for layer in cache.layers)
    nxt = torch.cat(picked)
    masked_steps = 0
    for step in range(20):
        if step == 10:  # a row leaves
            cache, nxt = select_rows(cache, [0, 2]), nxt[[0, 2]]
        _check_layers(cache)
        masked_steps += not cache.layers[0]._all_slots_valid(cache.layers[0].slot_time)
        out = model(input_ids=nxt, position_ids=row_positions(cache), cache=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    _check_layers(cache)
    assert masked_steps > 0  # the rows' counts differed: the mask path ran, not only the all-valid one
    release_cache(cache)
    assert pool.blocks_in_use == 0
