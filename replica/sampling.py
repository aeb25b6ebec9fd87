"""Picking the next token of each running row (argmax, or sampling with temperature and top-p), the
log-probabilities a request asks for, and the calls that score a prompt as decoding would.

The engine calls `pick_tokens` once per forward; a row's draws come from a generator of its own, so
a request's tokens do not depend on its batch neighbours' draws. A row whose sampling fails (a
distribution that is not finite, a generator that refuses its seed) fails alone: `pick_tokens` sets
its ``sample_error`` and gives it the token `FAILED_TOKEN`; the engine fails that request and the
other rows go on.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FAILED_TOKEN",
    "pick_tokens",
    "prompt_call_lengths",
    "score_prompt",
    "top_logprobs",
]

#: The token `pick_tokens` gives a row whose sampling failed (never a vocabulary id).
FAILED_TOKEN = -1


def top_logprobs(logp: torch.Tensor, k: int) -> list[list]:
    """The `k` most likely ``[token_id, logprob]`` pairs of one row's `logp` (vocab,), best first."""
    if k <= 0:
        return []
    values, ids = logp.topk(min(k, logp.shape[-1]))
    return [[i, v] for i, v in zip(ids.tolist(), values.tolist())]


def _sample(row: torch.Tensor, seq) -> torch.Tensor:
    """One row's sampled token (temperature, then top-p) with its own generator; raises when it cannot."""
    r = seq.request
    probs = torch.softmax(row / r.temperature, dim=-1)  # (vocab,)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError(f"temperature {r.temperature!r} gives a probability distribution that is not finite")
    if r.top_p < 1:
        p_sorted, order = probs.sort(descending=True)
        outside = p_sorted.cumsum(0) - p_sorted >= r.top_p  # tokens after the nucleus is full
        p_sorted[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, p_sorted)
    if seq.generator is None:
        gen = torch.Generator(device=row.device)
        if r.seed is not None:
            gen.manual_seed(r.seed)
        else:
            gen.seed()
        seq.generator = gen
    return torch.multinomial(probs, 1, generator=seq.generator)[0]


def pick_tokens(logits: torch.Tensor, seqs: list, eos_token_id: int | None) -> torch.Tensor:
    """The next token of each row: `logits` (rows, vocab) -> (rows, 1) long.

    Argmax for greedy rows; sampled (temperature, then top-p) with the row's own generator for the
    others; EOS masked while a row that stops at EOS has fewer than `min_new_tokens` tokens. A row
    whose request asks for `logprobs` gets ``seq.token_logprob`` (the picked token's log-probability
    under the model's distribution, before temperature, top-p and the EOS mask) and
    ``seq.token_top_logprobs`` (the `logprobs` most likely pairs). A row whose sampling raises gets
    `FAILED_TOKEN` and ``seq.sample_error`` (the message); the other rows are unaffected.
    """
    reqs = [s.request for s in seqs]
    if all(
        r.greedy and r.logprobs is None and (r.min_new_tokens == 0 or r.ignore_eos or eos_token_id is None)
        for r in reqs
    ):
        # argmax's index (the first of tied maxima): torch.max's reduction is the faster one in bfloat16 on a CPU
        return torch.max(logits, dim=-1, keepdim=True).indices  # (rows, 1)
    out = []
    for row, seq in zip(logits.float(), seqs):  # row: (vocab,)
        r = seq.request
        try:
            if r.logprobs is not None:
                logp = torch.log_softmax(row, dim=-1)
            if eos_token_id is not None and not r.ignore_eos and len(seq.result.output_ids) < r.min_new_tokens:
                row = row.clone()
                row[eos_token_id] = -math.inf
            tok = row.argmax() if r.greedy else _sample(row, seq)
            if r.logprobs is not None:
                seq.token_logprob = float(logp[tok])
                seq.token_top_logprobs = top_logprobs(logp, r.logprobs)
        except Exception as e:  # noqa: BLE001 - one row's failure is its own request's, never its neighbours'
            seq.sample_error = f"sampling failed: {type(e).__name__}: {e}"
            tok = torch.tensor(FAILED_TOKEN)
        out.append(tok)
    return torch.stack(out).view(-1, 1).to(logits.device)  # (rows, 1)


def prompt_call_lengths(cache, total_tokens: int) -> list[int]:
    """The forward calls that feed a prompt of `total_tokens` into an empty `cache` as token-by-token
    decoding would (the quality runner's rule, `workloads.quality.chunks.evaluation_call_lengths`).

    * a 4-bit cache (``kv_bits``: its rounding depends on the calls), or a prompt beyond the budget ``B``
      of an evicting policy whose `merged_schedule_exact` is False: one token per call;
    * a cache that never evicts, or a prompt within ``B``: one call;
    * else ``[B, 1, m - 1, 1, m - 1, ...]`` (refill to ``B`` in one call, one token when full: drop
      ``m = drop_tokens`` first, then append).
    """
    budget = getattr(cache, "budget", None)
    policy = getattr(cache, "policy", None)
    never_evicts = budget is None or policy is None or not policy.evicts or total_tokens <= budget.tokens
    if getattr(cache, "kv_bits", None) is not None or not (never_evicts or policy.merged_schedule_exact):
        return [1] * total_tokens
    if never_evicts:
        return [total_tokens] if total_tokens else []
    calls, held, left = [], 0, total_tokens
    while left:
        if held >= budget.tokens:
            q, held = 1, held - budget.drop_tokens + 1
        else:
            q = min(budget.tokens - held, left)
            held += q
        calls.append(q)
        left -= q
    return calls


@torch.inference_mode()
def score_prompt(model, cache, prompt_ids: list[int], top_k: int, device) -> tuple[list, list]:
    """Each prompt token's log-probability given the tokens before it, fed into the empty `cache` as
    decoding would (`prompt_call_lengths`: the evictions of generating the prompt one token at a time).

    Returns:
        ``(token_logprobs, top)``: lists of ``len(prompt_ids)`` entries (natural logs, float32 logits);
        the first token has no context, so its entries are None; ``top[i]`` is the `top_k` most
        likely ``[token_id, logprob]`` pairs at position i, best first.
    """
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, n)
    lps: list[float | None] = [None]
    tops: list[list | None] = [None]
    start = 0
    for q in prompt_call_lengths(cache, len(prompt_ids)):
        logits = model(input_ids=ids[:, start : start + q], cache=cache, use_cache=True).logits  # (1, q, vocab)
        logp = torch.log_softmax(logits[0].float(), dim=-1)  # (q, vocab)
        for j in range(q):
            pos = start + j + 1  # the prompt token this row scores
            if pos >= len(prompt_ids):
                break
            lps.append(float(logp[j, prompt_ids[pos]]))
            tops.append(top_logprobs(logp[j], top_k))
        start += q
    return lps, tops
