"""The engine's per-request budgets (`budget: per_request`) come from the library's formula
(`scissorhands.budget_from_ratio` with the policy): never below what the policy needs, never below its floor
(`min_budget_tokens`), so a short request is served, not refused; and on the embedded model the served
Scissorhands x5 answers docs/serving-http.md's chat as the full cache does."""

from __future__ import annotations

import pytest
import torch

from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine
from scissorhands import DEFAULT_MIN_BUDGET_TOKENS, POLICIES

EVICTING = [name for name, cls in POLICIES.items() if cls.evicts]
LAYOUTS = {
    "preallocated": {},
    "paged": dict(kv_layout="paged", kv_memory_limit_bytes=1 << 22, scheduler="mixed", max_num_batched_tokens=512),
}


def _serve(model, cfg: EngineConfig, requests, eos_token_id=None):
    engine = ContinuousBatchingEngine(model, cfg, eos_token_id=eos_token_id)
    done = {}
    for r in requests:
        engine.submit(r, lambda res: done.__setitem__(res.request_id, res))
    engine.run_until_idle()
    return done, engine


def _requests(lengths):
    g = torch.Generator().manual_seed(7)
    return [
        GenerationRequest(f"r{p}+{n}", torch.randint(1, 128, (p,), generator=g).tolist(), n, ignore_eos=True)
        for p, n in lengths
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", EVICTING)
def test_short_requests_with_an_explicit_window_get_the_budget_the_policy_needs(model, policy, layout):
    """Ratio 5, recent_window 8, no floor: 10 + 5 and 30 + 10 tokens get max(ceil(L / 5), 8 + sinks + 1) slots and
    are served (they were refused as if the KV memory limit were short), each with the tokens it gets alone under
    that fixed budget."""
    params = dict(recent_window=8, min_budget_tokens=0)
    cfg = EngineConfig(
        policy=policy, compression_ratio=5, budget="per_request", policy_params=params, **LAYOUTS[layout]
    )
    requests = _requests([(10, 5), (30, 10), (300, 40)])
    got, engine = _serve(model, cfg, requests)
    needed = 8 + (4 if policy == "streaming_llm" else 0) + 1
    expect = {"r10+5": needed, "r30+10": needed, "r300+40": 68}
    for r in requests:
        budget = engine.budget_of(len(r.prompt_ids), r.max_new_tokens)
        assert budget == expect[r.request_id], r.request_id
        res = got[r.request_id]
        assert res.error_kind is None and len(res.output_ids) == r.max_new_tokens, res.error
        fixed = EngineConfig(policy=policy, budget_tokens=budget, policy_params=params, **LAYOUTS[layout])
        alone, _ = _serve(model, fixed, [r])
        assert res.output_ids == alone[r.request_id].output_ids, r.request_id
    assert engine.stats()["failed_requests"] == 0


def test_the_default_floor_keeps_a_short_request_whole_and_caps_at_its_length(model):
    cfg = EngineConfig(policy="scissorhands", compression_ratio=5, budget="per_request")
    engine = ContinuousBatchingEngine(model, cfg)
    floor = DEFAULT_MIN_BUDGET_TOKENS
    assert engine.budget_of(10, 5) == 15  # shorter than the floor: its whole length, never compressed
    assert engine.budget_of(floor + 30, 40) == floor  # ceil(L / 5) below the floor: the floor
    assert engine.budget_of(1000, 24) == 205  # above it: the ratio's
    got, _ = _serve(model, cfg, _requests([(10, 5)]))
    full, _ = _serve(model, EngineConfig(policy="full"), _requests([(10, 5)]))
    assert got["r10+5"].output_ids == full["r10+5"].output_ids


def test_a_budget_above_the_sequence_length_reserves_only_the_slots_it_can_hold(model):
    """Ratio 5 and recent_window 8 give a 5 + 3 request B = 9 (the window plus one: `Policy.resolve` keeps it), but a
    sequence of 8 tokens stores at most 7 (its last token is never fed back): the preallocated layout reserves and
    allocates 7 slots, not 9, and decodes the full cache's tokens."""
    cfg = EngineConfig(
        policy="scissorhands", compression_ratio=5, budget="per_request", policy_params={"recent_window": 8}
    )
    engine = ContinuousBatchingEngine(model, cfg)
    assert engine.budget_of(5, 3) == 9
    assert engine.final_slots(5, 3) == 7
    assert engine.kv.footprint(5, 3) == 7 * engine.kv.slot_bytes
    got, engine = _serve(model, cfg, _requests([(5, 3)]))
    full, _ = _serve(model, EngineConfig(policy="full"), _requests([(5, 3)]))
    assert got["r5+3"].error is None and got["r5+3"].output_ids == full["r5+3"].output_ids
    peak = engine.stats()["peak_kv_cache_bytes"]
    assert 0 < peak <= 7 * engine.kv.slot_bytes, (peak, engine.kv.slot_bytes)
    # a fixed B = 9 over a workload of at most 8 tokens: rows preallocate 8 slots; a longer row still gets its B
    fixed = EngineConfig(
        policy="scissorhands", budget_tokens=9, max_length_tokens=8, policy_params={"recent_window": 8}
    )
    engine = ContinuousBatchingEngine(model, fixed)
    assert engine.budget_of(5, 3) == 9 and engine.final_slots(5, 3) == 8 and engine.final_slots(10, 5) == 9
    got, _ = _serve(model, fixed, _requests([(5, 3)]))
    assert got["r5+3"].output_ids == full["r5+3"].output_ids
