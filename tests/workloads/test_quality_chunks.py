"""Chunked evaluation equals token-by-token decoding with eviction (workloads.quality.chunks / perplexity)."""

from __future__ import annotations

import math

import pytest
import torch

from scissorhands import POLICIES, make_cache
from scissorhands.testing import tiny_llama
from workloads.quality.chunks import (
    cache_schedule,
    decode_call_lengths,
    evaluation_call_lengths,
    token_logprobs,
)
from workloads.quality.perplexity import build_cache, perplexity, window_nll

TOKENS = 96

#: The evicting policies whose class declares its merged call schedule exact (`Policy.merged_schedule_exact`):
#: the ones the slow test below proves on the embedded model.
MERGED_EXACT = frozenset(name for name, cls in POLICIES.items() if cls.evicts and cls.merged_schedule_exact)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def text():
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, 128, (1, TOKENS + 1), generator=g)


def test_call_lengths_follow_the_decode_rule():
    # B = 10, m = 5 from empty: 10 at once, then (1 drop-and-append, 4 refill) per compression
    assert decode_call_lengths(23, 10, 5) == [10, 1, 4, 1, 4, 1, 2]
    assert decode_call_lengths(7, 10, 5) == [7]  # never reaches B: one call
    assert decode_call_lengths(4, 10, 5, held_tokens=10) == [1, 3]  # after a prompt compressed to B
    assert decode_call_lengths(3, 4, 1) == [3]
    assert decode_call_lengths(6, 4, 1) == [4, 1, 1]  # m = 1: every step past B is a single call
    assert decode_call_lengths(50, None, None) == [50]
    with pytest.raises(ValueError, match="drop_tokens"):
        decode_call_lengths(5, 4, 0)
    with pytest.raises(ValueError, match="held_tokens"):
        decode_call_lengths(5, 4, 2, held_tokens=5)


def _slot_times(cache):
    return [layer.slot_time.clone() for layer in cache.layers]


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "full"])
@pytest.mark.parametrize("ratio", [2, 3, 5])
def test_chunked_equals_token_by_token(model, text, policy, ratio):
    x, y = text[:, :-1], text[:, 1:]
    floor = dict(min_budget_tokens=0)  # the bare ceil(L / r): the floor would keep 96 tokens at 32 slots
    chunked = make_cache(policy, model, compression_ratio=ratio, max_length=TOKENS, **floor)
    stepwise = make_cache(policy, model, compression_ratio=ratio, max_length=TOKENS, **floor)
    a = token_logprobs(model, chunked, x, y)
    b = token_logprobs(model, stepwise, x, y, call_lengths=[1] * TOKENS)
    budget, drop = cache_schedule(chunked)
    assert budget == math.ceil(TOKENS / ratio)
    assert chunked.evicted_tokens > 0  # compressions did happen
    calls = decode_call_lengths(TOKENS, budget, drop)
    assert calls[0] == budget and all(q == 1 for q in calls[1::2])  # every compression is a 1-token call
    if drop > 1:
        assert len(calls) < TOKENS / 2  # prefill speed: far fewer calls
    torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    for sa, sb in zip(_slot_times(chunked), _slot_times(stepwise)):  # the very same tokens were kept
        assert torch.equal(sa, sb)


def test_naive_chunking_differs(model, text):
    """The control: fixed 32-token chunks put compressions inside calls, so the losses change."""
    x, y = text[:, :-1], text[:, 1:]
    naive = token_logprobs(
        model, make_cache("scissorhands", model, compression_ratio=3, max_length=TOKENS), x, y, call_lengths=[32] * 3
    )
    exact = token_logprobs(
        model,
        make_cache("scissorhands", model, compression_ratio=3, max_length=TOKENS),
        x,
        y,
        call_lengths=[1] * TOKENS,
    )
    assert (naive - exact).abs().max() > 1e-3


@pytest.mark.parametrize("policy", list(POLICIES))
def test_quantized_caches_are_fed_one_token_per_call(model, text, policy):
    """A 4-bit cache is evaluated exactly as decoding feeds it (one token per call, from the first token),
    in perplexity and in the few-shot continuation; an unquantized cache keeps the merged schedule."""
    kw = {} if policy == "full" else dict(compression_ratio=5, max_length=TOKENS)
    q = make_cache(policy, model, kv_bits=4, kv_group_size=16, **kw)
    assert evaluation_call_lengths(q, TOKENS) == [1] * TOKENS
    assert evaluation_call_lengths(q, 7, held_tokens=3) == [1] * 7
    plain = make_cache(policy, model, **kw)
    if policy == "full" or policy in MERGED_EXACT:
        assert evaluation_call_lengths(plain, TOKENS) == decode_call_lengths(TOKENS, *cache_schedule(plain))
    else:  # not proved equal on the embedded model (knorm is not): decoding's own schedule
        assert evaluation_call_lengths(plain, TOKENS) == [1] * TOKENS
    w = text[0].tolist()
    assert window_nll(model, w, policy, 5, kv_bits=4, policy_params={"kv_group_size": 16})["forward_calls"] == TOKENS
    x, y = text[:, :-1], text[:, 1:]
    a = token_logprobs(model, make_cache(policy, model, kv_bits=4, kv_group_size=16, **kw), x, y)
    b = token_logprobs(
        model, make_cache(policy, model, kv_bits=4, kv_group_size=16, **kw), x, y, call_lengths=[1] * TOKENS
    )
    assert torch.equal(a, b)  # bit for bit: the very same calls


def test_fewshot_continuation_with_4_bit_is_decoded_one_token_per_call(model, monkeypatch):
    from workloads.quality import chunks, fewshot

    calls = []
    real = chunks.evaluation_call_lengths

    def spy(cache, n, held_tokens=0):
        calls.append(real(cache, n, held_tokens))
        return calls[-1]

    monkeypatch.setattr(chunks, "evaluation_call_lengths", spy)
    doc = fewshot.Doc(
        0, (("a context that is long enough", " one answer"), ("a context that is long enough", " two")), 0
    )
    fewshot.score_doc(model, None, doc, "scissorhands", 3, kv_bits=4, policy_params={"kv_group_size": 16})
    assert calls == [[1] * (len(" one answer") - 1), [1] * (len(" two") - 1)]
    calls.clear()
    fewshot.score_doc(model, None, doc, "full", 1)
    assert calls == [[len(" one answer") - 1], [len(" two") - 1]]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_ratio_one_reproduces_full(model, text, policy):
    windows = [text[0].tolist()]
    full = perplexity(model, windows, "full")
    same = perplexity(model, windows, policy, compression_ratio=1)
    assert same["forward_calls"] == 1 and same["tokens_scored"] == TOKENS
    assert same["perplexity"] == pytest.approx(full["perplexity"], rel=1e-6)
    assert full["perplexity"] > 1.0


def test_compression_changes_perplexity(model, text):
    w = text[0].tolist()
    full = window_nll(model, w, "full")
    five = window_nll(model, w, "scissorhands", compression_ratio=5, policy_params={"min_budget_tokens": 0})
    assert five["budget_tokens"] == math.ceil(TOKENS / 5)
    assert five["peak_kv_cache_bytes"] < full["peak_kv_cache_bytes"]
    assert abs(five["nll_sum"] - full["nll_sum"]) > 1e-3


def test_full_ignores_ratio_and_build_cache_validates(model):
    assert build_cache(model, "full", 5).budget_tokens is None
    with pytest.raises(ValueError, match="compression_ratio"):
        build_cache(model, "scissorhands", 0.5, max_length=10)


@pytest.mark.slow
def test_embedded_ratio_one_matches_plain_forward():
    from scissorhands.models import load_model
    from workloads.quality.perplexity import heldout_windows

    model, tok = load_model("embedded", dtype=torch.float32, device="cpu")
    (w,) = heldout_windows(tok, 128, 1, seed=3)
    ours = perplexity(model, [w], "scissorhands", compression_ratio=1)
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            ids = torch.tensor([w])
            logits = model(ids[:, :-1], use_cache=False).logits[0].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="mean")
    finally:
        model.set_attn_implementation(previous)
    assert ours["tokens_scored"] == 128
    assert ours["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-4)


def _embedded():
    from scissorhands.models import load_model

    torch.set_num_threads(1)
    return load_model("embedded", dtype=torch.float32, device="cpu")


def test_merged_schedule_flag_marks_the_policies_proved_exact(model):
    """The flag's set is the six evicting policies the slow test below proves equal on the embedded model;
    `knorm` (its key-norm ranking flips under the merged calls) and `full` (never evicts) are not flagged, and
    an unflagged cache is fed one token per call once past its budget."""
    assert MERGED_EXACT == {"scissorhands", "h2o", "tova", "streaming_llm", "random", "snapkv"}
    assert not POLICIES["knorm"].merged_schedule_exact and not POLICIES["full"].merged_schedule_exact
    knorm = make_cache("knorm", model, compression_ratio=5, max_length=TOKENS)
    assert evaluation_call_lengths(knorm, TOKENS) == [1] * TOKENS
    h2o = make_cache("h2o", model, compression_ratio=5, max_length=TOKENS)
    assert evaluation_call_lengths(h2o, TOKENS) == decode_call_lengths(TOKENS, *cache_schedule(h2o))


@pytest.mark.slow
def test_embedded_merged_schedule_equals_decoding_without_quantization():
    """On the real model: without quantization the merged refills keep the very same slots as decoding
    (exact) and give its losses up to float32 noise, for every policy that uses them
    (`MERGED_EXACT`, from the policies' `merged_schedule_exact` flag); `knorm` does not (its key-norm ranking
    flips), so it is evaluated one token per call. The noise depends on the CPU's matmul kernels; the bounds (1e-4 + 1e-4 x |log p| a token,
    mean 1e-4) sit far below the schedule fault they guard against (4-bit merged). The measured noise per
    CPU is in docs/performance.md ("Measurements behind the quality code")."""
    from workloads.quality.perplexity import heldout_windows

    model, tok = _embedded()
    n = 96
    (w,) = heldout_windows(tok, n, 1, seed=0)
    ids = torch.tensor([w])
    x, y = ids[:, :-1], ids[:, 1:]
    for policy in sorted(MERGED_EXACT):
        merged = make_cache(policy, model, compression_ratio=3, max_length=n)
        step = make_cache(policy, model, compression_ratio=3, max_length=n)
        a = token_logprobs(model, merged, x, y)
        b = token_logprobs(model, step, x, y, call_lengths=[1] * n)
        assert len(evaluation_call_lengths(make_cache(policy, model, compression_ratio=3, max_length=n), n)) < n
        assert merged.evicted_tokens > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"policy {policy}")
        assert float((a - b).abs().mean()) < 1e-4, policy  # far below the 4-bit merged fault
        for sa, sb in zip(_slot_times(merged), _slot_times(step)):
            assert torch.equal(sa, sb), policy


@pytest.mark.slow
def test_embedded_4_bit_perplexity_is_decoding():
    """On SmolLM2-135M a 4-bit point's losses are bit-identical to a plain one-token-per-call decoding loop,
    while the merged schedule would be off by more than 0.01 nats per token on average (the fault)."""
    from workloads.quality.perplexity import heldout_windows

    model, tok = _embedded()
    n = 96
    (w,) = heldout_windows(tok, n, 1, seed=0)
    ids = torch.tensor([w])
    point = window_nll(model, w, "scissorhands", 5, kv_bits=4)
    assert point["forward_calls"] == n
    cache = make_cache("scissorhands", model, compression_ratio=5, max_length=n, kv_bits=4)
    step = torch.empty(n)
    with torch.inference_mode():
        for i in range(n):  # decoding, written out
            logits = model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits
            step[i] = torch.log_softmax(logits[0, -1].float(), -1)[ids[0, i + 1]]
    assert point["nll_sum"] == pytest.approx(-float(step.double().sum()), rel=1e-9, abs=1e-6)
    merged_cache = make_cache("scissorhands", model, compression_ratio=5, max_length=n, kv_bits=4)
    budget, drop = cache_schedule(merged_cache)
    merged = token_logprobs(
        model, merged_cache, ids[:, :-1], ids[:, 1:], call_lengths=decode_call_lengths(n, budget, drop)
    )
    assert float((merged - step).abs().mean()) > 0.01
