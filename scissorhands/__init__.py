"""Scissorhands and baseline KV-cache policies at a fixed budget, for Hugging Face transformers.

    from scissorhands import make_cache
    cache = make_cache("scissorhands", model, compression_ratio=5)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)

No Ray anywhere in this package (it imports torch and transformers only).
"""
from __future__ import annotations

import math

from .attention import ATTN_IMPLEMENTATION
from .cache import Budget, BudgetedCache, BudgetedLayer
from .policies import POLICIES, Policy, get_policy

__all__ = ["ATTN_IMPLEMENTATION", "POLICIES", "Policy", "BudgetedCache", "BudgetedLayer", "make_cache", "get_policy"]


def make_cache(policy: str, model, *, budget_tokens: int | None = None, compression_ratio: float | None = None,
               max_length: int | None = None, simulate: bool = False, **policy_params) -> BudgetedCache:
    """Build a budgeted KV cache for ``model`` (a transformers model or its config).

    Args:
        policy: a key of ``POLICIES`` (``"full"``, ``"scissorhands"``, ...).
        model: the model (its attention implementation is switched to ``"scissorhands"``, which gives
            the same outputs as ``sdpa`` for any other cache) or a ``PretrainedConfig``.
        budget_tokens: slots per KV head (absolute budget, B).
        compression_ratio: ``r >= 1``; ``B = ceil(L / r)`` with ``L = max_length`` when given, else the
            length of the first forward call (the prompt). One of the two is required unless ``policy == "full"``.
        max_length: the longest length the cache will hold (prompt + max_new_tokens), when known.
        simulate: mask evicted slots instead of removing them (saves no memory; for verification).
        **policy_params: the policy dataclass fields (``recent_window``, ``drop_tokens``, ``history_window``, ...).

    Raises:
        ValueError: unknown policy (lists valid names), unknown parameter, ``compression_ratio < 1``,
            ``budget_tokens < 1``, both or neither of budget_tokens / compression_ratio, or a budget
            smaller than ``recent_window + 1``.
    """
    pol = get_policy(policy, **policy_params)
    if pol.evicts:
        if (budget_tokens is None) == (compression_ratio is None):
            raise ValueError(f"policy {policy!r} needs exactly one of budget_tokens or compression_ratio")
        if budget_tokens is not None and (isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int)
                                          or budget_tokens < 1):
            raise ValueError(f"budget_tokens must be an integer >= 1, got {budget_tokens!r}")
        if compression_ratio is not None and not (isinstance(compression_ratio, (int, float))
                                                  and math.isfinite(compression_ratio) and compression_ratio >= 1):
            raise ValueError(f"compression_ratio must be a number >= 1, got {compression_ratio!r}")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be an integer >= 1, got {max_length!r}")
    budget = Budget(pol, budget_tokens=budget_tokens, compression_ratio=compression_ratio, max_length=max_length)
    if pol.evicts and (budget_tokens is not None or max_length is not None):
        budget.resolve(max_length or 1)          # validate recent_window / drop_tokens now
    config = getattr(model, "config", model)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if hasattr(model, "set_attn_implementation") and getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return BudgetedCache(pol, text_config.num_hidden_layers, budget, simulate=simulate)
