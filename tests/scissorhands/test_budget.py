"""Budgets from a compression ratio (`scissorhands.budget_from_ratio`): never below what the policy needs (its
protected windows plus one slot), never below the floor `min_budget_tokens` (a sequence no longer than the floor
is not compressed), the paper's ceil(L / r) above both."""

from __future__ import annotations

import math

import pytest
import torch

from scissorhands import DEFAULT_MIN_BUDGET_TOKENS, POLICIES, budget_from_ratio, cache_policy, get_policy, make_cache
from tests.generate_helpers import greedy_generate

EVICTING = [name for name, cls in POLICIES.items() if cls.evicts]


@pytest.mark.parametrize(
    "name, params, needed",
    [
        ("scissorhands", dict(recent_window=8), 9),  # window + 1
        ("streaming_llm", dict(recent_window=8), 13),  # window + 4 sinks + 1
        ("streaming_llm", dict(recent_window=8, n_sink=0), 9),
        ("scissorhands", dict(recent_window=8, drop_tokens=5), 13),  # window + one compression of 5
        ("h2o", dict(recent_window=3), 4),
        ("snapkv", dict(recent_window=0), 1),
        ("scissorhands", {}, 1),  # default windows shrink to fit any budget
        ("streaming_llm", {}, 1),
        ("h2o", dict(drop_tokens=5), 9),  # default window B // 2 leaves B - B // 2 >= 5 from B = 9
    ],
)
def test_needed_budget_is_the_smallest_budget_the_policy_accepts(name, params, needed):
    pol = get_policy(name, **params)
    assert pol.needed_budget_tokens() == needed
    pol.resolve(needed)
    if needed > 1:
        with pytest.raises(ValueError, match="budget_tokens|drop_tokens"):
            pol.resolve(needed - 1)


@pytest.mark.parametrize("name", EVICTING)
@pytest.mark.parametrize("length", [1, 3, 15, 40, 70, 1000])
def test_a_ratio_budget_never_falls_below_what_an_explicit_window_needs(name, length):
    """At ratio 5 with recent_window 8 and no floor: max(ceil(L / 5), window + sinks + 1), accepted by the policy."""
    pol = get_policy(name, recent_window=8, min_budget_tokens=0)
    budget = budget_from_ratio(length, 5, pol)
    sinks = pol.sink_tokens(1 << 20)
    assert budget == max(math.ceil(length / 5), 8 + sinks + 1)
    pol.resolve(budget)  # no error


def test_the_floor_keeps_short_sequences_whole_and_leaves_long_ones_to_the_ratio():
    pol = get_policy("scissorhands", min_budget_tokens=32)
    got = {n: budget_from_ratio(n, 5, pol) for n in (1, 10, 32, 70, 160, 161, 1000)}
    assert got == {1: 1, 10: 10, 32: 32, 70: 32, 160: 32, 161: 33, 1000: 200}
    assert budget_from_ratio(70, 5) == 14  # without a policy: the bare formula, ceil(L / r)
    # the final length unknown (a prompt of 10 before generation): the floor, not capped at the prompt
    assert budget_from_ratio(10, 5, pol, length_is_final=False) == 32
    assert budget_from_ratio(70, 5, get_policy("scissorhands", min_budget_tokens=0)) == 14
    assert get_policy("scissorhands").min_budget_tokens == DEFAULT_MIN_BUDGET_TOKENS
    assert get_policy("h2o").params()["min_budget_tokens"] == DEFAULT_MIN_BUDGET_TOKENS  # recorded with every result


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_a_bad_floor_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"min_budget_tokens: expected an integer >= 0, got"):
        get_policy("scissorhands", min_budget_tokens=bad)


def test_cache_policy_sets_make_cache_arguments_aside():
    pol = cache_policy("tova", kv_bits=4, max_length=9, min_budget_tokens=7, recent_window=2)
    assert (pol.name, pol.min_budget_tokens, pol.recent_window) == ("tova", 7, 2)
    with pytest.raises(ValueError, match="unknown parameter"):
        cache_policy("tova", history_window=4)


@pytest.mark.parametrize("policy", EVICTING)
def test_make_cache_applies_the_floor_to_a_ratio_and_not_to_an_absolute_budget(model, policy):
    """A 20-token prompt + 10 new tokens at ratio 5: the default floor keeps it whole (the full cache's tokens);
    floor 0 compresses it to ceil(20 / 5) = 4 slots; an absolute budget_tokens is used as given."""
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    full = greedy_generate(model, ids, make_cache("full", model), 10)
    floored = make_cache(policy, model, compression_ratio=5)
    got = greedy_generate(model, ids, floored, 10)
    assert floored.budget_tokens == DEFAULT_MIN_BUDGET_TOKENS and floored.evicted_tokens == 0
    assert torch.equal(got.sequences, full.sequences)
    known = make_cache(policy, model, compression_ratio=5, max_length=30)  # 30 <= the floor: B = L, not compressed
    greedy_generate(model, ids, known, 10)
    assert known.budget_tokens == 30 and known.evicted_tokens == 0
    bare = make_cache(policy, model, compression_ratio=5, min_budget_tokens=0)
    greedy_generate(model, ids, bare, 10)
    assert bare.budget_tokens == 4 and bare.evicted_tokens > 0
    absolute = make_cache(policy, model, budget_tokens=4)
    greedy_generate(model, ids, absolute, 10)
    assert absolute.budget_tokens == 4 and absolute.evicted_tokens > 0


def test_make_cache_with_a_ratio_accepts_an_explicit_window_on_a_short_sequence(model):
    """recent_window 8 at ratio 5 on 15 tokens, no floor: B = 9 (window + 1), not an error; an absolute
    budget below that is still refused, naming the field."""
    cache = make_cache("scissorhands", model, compression_ratio=5, max_length=15, recent_window=8, min_budget_tokens=0)
    assert cache.budget_tokens == 9 and cache.budget.recent_window == 8
    with pytest.raises(ValueError, match="budget_tokens"):
        make_cache("scissorhands", model, budget_tokens=3, recent_window=8)
