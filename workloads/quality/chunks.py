"""Feed a text through a budgeted cache at prefill speed, with exactly the evictions of decoding.

Token-by-token decoding with a budgeted cache (``scissorhands.cache``, Algorithm 1) evicts at
fixed points: a single new token that finds its sequence holding ``B = budget_tokens`` tokens
first drops ``m = drop_tokens`` of them, then is appended; the cache then refills for ``m``
steps. A forward call of several tokens is instead appended whole, attended in full and
compressed to ``B`` afterwards, which equals ``q`` single steps only when no compression falls
inside the call (``held + q <= B``).

So a text is fed as the calls token-by-token decoding would make, merged wherever no compression
happens in between (:func:`decode_call_lengths`):

* while the sequence holds ``held < B`` tokens: one call of ``min(B - held, remaining)`` tokens
  (appended and attended in full; nothing is evicted because ``held + q <= B``);
* when it holds ``B``: one call of a single token (drop ``m`` first, then append).

From an empty cache that is ``[B, 1, m - 1, 1, m - 1, ...]``: about ``2 (L - B) / m`` calls for
``L`` tokens instead of ``L``, and the losses equal token-by-token decoding (same queries, same
visible keys, same statistics, same evictions); ``tests/workloads/test_quality_chunks.py`` proves it for
every policy. No library hook is needed: the single-token call is the library's own decode rule.

Where the merged schedule is used: the merged calls compute the same quantities as single calls,
but a matrix product over ``q`` rows is not bit-identical to ``q`` products over one row.
Without quantization the difference stays in the last float bits, and
``tests/workloads/test_quality_chunks.py`` proves equality (losses and kept slots) on the tiny model
for every policy and, in its ``slow`` test, on the embedded model. With 4-bit keys and values
(``kv_bits``) those last bits flip rounding to the 4-bit grid, so a quantized cache is always fed one
token per call (:func:`evaluation_call_lengths`), exactly as decoding feeds it. The same last bits can
flip a policy's *selection* where it ranks continuous scores (``knorm``, key norms), but not where it
ranks integer counts (``scissorhands``). So only the evicting policies in
whose class sets ``merged_schedule_exact`` (`scissorhands.policies.base.Policy`), each proved equal on the
embedded model by the ``slow`` test, use the
merged schedule; every other one (a new policy included) is fed one token per call. The measured
differences are in ``docs/performance.md`` ("Measurements behind the quality code").
"""

from __future__ import annotations

import torch


def decode_call_lengths(
    total_tokens: int, budget_tokens: int | None, drop_tokens: int | None, held_tokens: int = 0
) -> list[int]:
    """Lengths of the forward calls that feed ``total_tokens`` tokens as token-by-token decoding would.

    Args:
        total_tokens: tokens to feed (>= 0).
        budget_tokens: ``B``, slots per KV head; ``None`` for a cache that never evicts (one call).
        drop_tokens: ``m``, slots dropped by one decode-time compression (``1 <= m <= B``).
        held_tokens: tokens the sequence holds before the first call (``<= B``), e.g. after a prompt.

    Returns:
        Call lengths (each >= 1) that sum to ``total_tokens``.

    Raises:
        ValueError: a negative count, ``budget_tokens < 1``, ``drop_tokens`` outside ``[1, B]`` or
            ``held_tokens > budget_tokens``.
    """
    if total_tokens < 0 or held_tokens < 0:
        raise ValueError(f"total_tokens and held_tokens must be >= 0, got {total_tokens}, {held_tokens}")
    if budget_tokens is None:
        return [total_tokens] if total_tokens else []
    if budget_tokens < 1:
        raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
    if drop_tokens is None or not 1 <= drop_tokens <= budget_tokens:
        raise ValueError(f"drop_tokens must be in [1, budget_tokens={budget_tokens}], got {drop_tokens}")
    if held_tokens > budget_tokens:
        raise ValueError(f"held_tokens ({held_tokens}) exceeds budget_tokens ({budget_tokens})")
    calls, held, left = [], held_tokens, total_tokens
    while left:
        if held >= budget_tokens:  # decode step on a full sequence: drop m, then append
            q, held = 1, held - drop_tokens + 1
        else:  # refill up to B; no compression inside the call
            q = min(budget_tokens - held, left)
            held += q
        calls.append(q)
        left -= q
    return calls


def cache_schedule(cache) -> tuple[int | None, int | None]:
    """``(budget_tokens, drop_tokens)`` of a cache from ``scissorhands.make_cache``; ``(None, None)`` if it never evicts.

    The budget must already be resolved (pass ``budget_tokens`` or ``max_length`` to ``make_cache``).

    Raises:
        ValueError: the cache evicts but its budget is not resolved yet.
    """
    budget = getattr(cache, "budget", None)
    policy = getattr(cache, "policy", None)
    if budget is None or policy is None or not policy.evicts:
        return None, None
    if budget.tokens is None:
        raise ValueError("the cache's budget is not resolved: pass budget_tokens or max_length to make_cache")
    return budget.tokens, budget.drop_tokens


def evaluation_call_lengths(cache, total_tokens: int, held_tokens: int = 0) -> list[int]:
    """The calls a quality evaluation makes to feed ``total_tokens`` into ``cache``: decoding's numbers, fastest.

    * a quantized cache (``cache.kv_bits`` set), or an evicting policy whose class leaves
      ``merged_schedule_exact`` False: one token per call, exactly as decoding (the merged schedule
      changes 4-bit rounding, and a ranking of continuous scores; see the module docstring);
    * otherwise :func:`decode_call_lengths` (one call for a cache that never evicts), proved equal
      to one token per call on the tiny and the embedded model.

    Raises:
        ValueError: as :func:`decode_call_lengths` and :func:`cache_schedule`.
    """
    budget, drop = cache_schedule(cache)
    never_evicts = budget is None or held_tokens + total_tokens <= budget
    merged_exact = never_evicts or cache.policy.merged_schedule_exact
    if getattr(cache, "kv_bits", None) is not None or not merged_exact:
        if total_tokens < 0:
            raise ValueError(f"total_tokens must be >= 0, got {total_tokens}")
        return [1] * total_tokens
    return decode_call_lengths(total_tokens, budget, drop, held_tokens=held_tokens)


@torch.inference_mode()
def token_logprobs(
    model,
    cache,
    input_ids: torch.Tensor,
    target_ids: torch.Tensor,
    held_tokens: int = 0,
    call_lengths: list[int] | None = None,
) -> torch.Tensor:
    """Feed ``input_ids`` into ``cache`` as decoding would; return the log-probability of each target.

    Position ``i``'s logits (after feeding ``input_ids[:, :i + 1]``) score ``target_ids[:, i]``.

    Args:
        model: a transformers causal LM (attention implementation ``"scissorhands"`` for budgeted caches).
        cache: the cache to fill (``make_cache(...)``), possibly holding a prompt already.
        input_ids: ``(1, n)`` int64 token ids to feed.
        target_ids: ``(1, n)`` int64 ids to score.
        held_tokens: tokens the sequence already holds in ``cache`` (``min(prompt, B)`` after a prompt).
        call_lengths: override the call schedule (default :func:`evaluation_call_lengths`; tests use
            ``[1] * n`` for token-by-token decoding).

    Returns:
        ``(n,)`` float32 natural-log probabilities.
    """
    if input_ids.shape != target_ids.shape or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"input_ids and target_ids must both be (1, n), got {tuple(input_ids.shape)} and {tuple(target_ids.shape)}"
        )
    n = input_ids.shape[1]
    if call_lengths is None:
        call_lengths = evaluation_call_lengths(cache, n, held_tokens=held_tokens)
    if sum(call_lengths) != n:
        raise ValueError(f"call_lengths sum to {sum(call_lengths)}, expected {n}")
    out = torch.empty(n, dtype=torch.float32)
    start = 0
    for q in call_lengths:
        logits = model(input_ids=input_ids[:, start : start + q], cache=cache, use_cache=True).logits  # (1, q, vocab)
        logp = torch.log_softmax(logits[0].float(), dim=-1)  # (q, vocab)
        out[start : start + q] = logp.gather(-1, target_ids[0, start : start + q, None]).squeeze(-1).cpu()
        start += q
    return out
