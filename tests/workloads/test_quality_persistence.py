"""The persistence ratio (workloads.quality.persistence) on a hand-built pattern and on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from scissorhands.testing import tiny_llama
from workloads.quality.persistence import PivotalSets, persistence_ratio


def _causal_rows(rows: list[list[float]]) -> torch.Tensor:
    """(1, T, T) attention from per-query rows over the visible keys (each row sums to 1)."""
    t = len(rows)
    probs = torch.zeros(1, t, t)
    for i, row in enumerate(rows):
        assert len(row) == i + 1 and abs(sum(row) - 1) < 1e-9
        probs[0, i, : i + 1] = torch.tensor(row)
    return probs


def test_hand_built_pattern_has_the_known_answer():
    # T = 6, split t = 3. "Pivotal" = strictly above 1 / (i + 1).
    rows = [
        [1.0],  # q0: 0 is not above 1/1 -> nothing
        [0.8, 0.2],  # q1: token 0 (0.8 > 0.5)
        [0.1, 0.1, 0.8],  # q2: token 2
        [0.7, 0.1, 0.1, 0.1],  # q3: token 0 (> 0.25)
        [0.1, 0.5, 0.1, 0.2, 0.1],  # q4: token 1 (> 0.2), token 3 not before t
        [0.05, 0.05, 0.3, 0.3, 0.2, 0.1],  # q5: token 2 (> 1/6), 3 and 4 not before t
    ]
    sets = PivotalSets(split_token=3)
    sets.update(0, _causal_rows(rows), torch.arange(6))
    # S_before = {0, 2}; S_after = {0, 1, 2}; |S_after ∩ S_before| / |S_after| = 2/3; |S_before| / t = 2/3
    assert sets.before[0][0].tolist() == [True, False, True]
    assert sets.after[0][0].tolist() == [True, True, True]
    out = sets.result()
    assert out["persistence_ratio"] == [pytest.approx(2 / 3)]
    assert out["pivotal_share"] == [pytest.approx(2 / 3)]


def test_heads_are_averaged_and_chunks_accumulate():
    uniform = [[1.0 / (i + 1)] * (i + 1) for i in range(4)]  # never above average: empty sets
    focused = [[1.0], [0.9, 0.1], [0.8, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1]]
    probs = torch.cat([_causal_rows(focused), _causal_rows(uniform)])  # (2 heads, 4, 4)
    sets = PivotalSets(split_token=2)
    sets.update(0, probs[:, :2], torch.arange(2))  # queries 0-1 first, then 2-3
    sets.update(0, probs[:, 2:], torch.arange(2, 4))
    out = sets.result()
    # head 0: S_before = {0}, S_after = {0} -> 1.0; head 1 has an empty S_after and is left out
    assert out["persistence_ratio"] == [pytest.approx(1.0)]
    assert out["pivotal_share"] == [pytest.approx((1 / 2 + 0) / 2)]


def test_model_path_matches_eager_attention_maps():
    model = tiny_llama(seed=0)
    g = torch.Generator().manual_seed(5)
    w = torch.randint(0, 128, (40,), generator=g).tolist()
    with torch.inference_mode():
        before = model(torch.tensor([w]), use_cache=False).logits
    ours = persistence_ratio(model, [w], split_fraction=0.5)
    with torch.inference_mode():
        after = model(torch.tensor([w]), use_cache=False).logits
    torch.testing.assert_close(before, after)  # attention implementation restored
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            maps = model(torch.tensor([w]), use_cache=False, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    ref = PivotalSets(20)
    for layer, a in enumerate(maps):
        ref.update(layer, a[0].float(), torch.arange(40))
    expected = ref.result()
    assert ours["split_token"] == 20 and len(ours["persistence_ratio"]) == 2
    assert ours["persistence_ratio"] == pytest.approx(expected["persistence_ratio"])
    assert ours["pivotal_share"] == pytest.approx(expected["pivotal_share"])
    assert all(0 < v <= 1 for v in ours["persistence_ratio"]) and not math.isnan(ours["persistence_ratio_mean"])
