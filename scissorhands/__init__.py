"""Scissorhands and baseline KV-cache policies at a fixed budget, for Hugging Face transformers.

    from scissorhands import make_cache
    cache = make_cache("scissorhands", model, compression_ratio=5)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)

No Ray anywhere in this package (it imports torch and transformers only).
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

from .attention import ATTN_IMPLEMENTATION
from .cache import INT16_MAX_TIME, Budget, BudgetedCache, BudgetedLayer, budget_from_ratio
from .checks import check_int
from .paged import BlockPool, PagedLayer
from .policies import POLICIES, Policy, get_policy
from .policies.base import DEFAULT_MIN_BUDGET_TOKENS
from .quant import Int4KV, check_group_size, check_scale_format, hadamard
from .storage import DenseKV

__all__ = [
    "ATTN_IMPLEMENTATION",
    "budget_from_ratio",
    "cache_policy",
    "DEFAULT_MIN_BUDGET_TOKENS",
    "POLICIES",
    "SUPPORTED_MODEL_TYPES",
    "Policy",
    "BudgetedCache",
    "BudgetedLayer",
    "BlockPool",
    "make_cache",
    "get_policy",
    "check_model_supported",
]

#: ``config.model_type`` values whose attention goes through transformers' attention interface with
#: ``cache.update(...)`` and no sliding window: tested with tiny random configs in tests/scissorhands/test_standalone.py.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "opt")
KV_BITS = (None, 4)


def check_model_supported(config) -> None:
    """Raise ``ValueError`` unless the (text) config is an architecture the budgeted cache supports.

    Supported: ``SUPPORTED_MODEL_TYPES`` (grouped-query or multi-head attention, RoPE or learned
    positions) with full attention in every layer. Sliding-window layers are refused: the cache keeps
    its own budget and the ``scissorhands`` attention function does not apply a window.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported by the budgeted cache; supported model "
            f"types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layer_types)
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        sliding = True
    if sliding or getattr(config, "use_sliding_window", False):
        raise ValueError(
            f"model type {model_type!r} with sliding-window attention layers is not supported "
            f"(the budgeted cache does not apply a window); set config.sliding_window = None "
            f"(and use_sliding_window = False) if your sequences stay inside the window"
        )


def make_cache(
    policy: str,
    model,
    *,
    budget_tokens: int | None = None,
    compression_ratio: float | None = None,
    max_length: int | None = None,
    simulate: bool = False,
    kv_bits: int | None = None,
    kv_group_size: int = 32,
    kv_value_group_size: int | None = None,
    kv_scale_bits: int = 16,
    kv_zero_point: bool = True,
    kv_rotate: bool = False,
    pool: BlockPool | None = None,
    **policy_params,
) -> BudgetedCache:
    """Build a budgeted KV cache for ``model`` (a transformers model or its config).

    Args:
        policy: a key of ``POLICIES`` (``"full"``, ``"scissorhands"``, ``"streaming_llm"``, ``"h2o"``,
            ``"tova"``, ``"random"``, ``"knorm"``, ``"snapkv"``).
        model: the model (its attention implementation is switched to ``"scissorhands"``, which gives
            the same outputs as ``sdpa`` for any other cache) or a ``PretrainedConfig``.
        budget_tokens: slots per KV head (absolute budget, B).
        compression_ratio: ``r >= 1``; ``B = ceil(L / r)`` with ``L = max_length`` when given, else the
            length of the first forward call (the prompt). One of the two is required unless ``policy == "full"``.
        max_length: the longest length the cache will hold (prompt + max_new_tokens), when known.
        simulate: mask evicted slots instead of removing them (saves no memory; for verification).
        kv_bits: ``None`` (keys/values stored in the model dtype) or ``4`` (group-wise asymmetric 4-bit,
            see ``scissorhands.quant``); composes with every policy.
        kv_group_size: values per quantization group along ``head_dim`` (even, divides head_dim).
        kv_value_group_size: the values' group size when it differs from the keys' (None: ``kv_group_size``);
            bytes and perplexity of each choice: docs/performance.md.
        kv_scale_bits: 16 (float16 scale and zero per group) or 8 (8-bit log-scale code and int8 zero);
            ``scissorhands.quant`` states the formats.
        kv_zero_point: True (asymmetric, a zero per group) or False (symmetric, no zero stored).
        kv_rotate: quantize keys and values after a fixed Hadamard rotation of head_dim (a power of two);
            nothing more is stored (``scissorhands.quant.Int4KV``).
        pool: a ``scissorhands.paged.BlockPool``: keys and values live in its blocks (paged layout, as
            serving engines hold them: blocks taken as a sequence grows); None: each cache holds its own
            buffers (the preallocated layout). A paged cache's blocks go back to the pool with
            ``scissorhands.paged.release_cache(cache)`` (an engine does it as rows leave).
            When it runs out: ``scissorhands.paged.PoolExhausted``.
        **policy_params: the policy dataclass fields (``recent_window``, ``drop_tokens``, ``min_budget_tokens``,
            ``history_window``, ...).

    Raises:
        ValueError: unknown policy (lists valid names), unknown parameter, ``compression_ratio < 1``,
            ``budget_tokens < 1``, both or neither of budget_tokens / compression_ratio, an absolute
            ``budget_tokens`` smaller than ``recent_window + sinks + 1`` (a budget from a ratio is raised to what the
            policy needs and to its floor, ``min_budget_tokens``: ``budget_from_ratio``), ``kv_bits`` not in (None, 4), a bad ``kv_group_size``,
            ``kv_scale_bits`` not in (16, 8), a non-bool ``kv_zero_point``,
            or an unsupported model type (``SUPPORTED_MODEL_TYPES``).
    """
    pol = get_policy(policy, **policy_params)
    if pol.evicts:
        if (budget_tokens is None) == (compression_ratio is None):
            raise ValueError(f"policy {policy!r} needs exactly one of budget_tokens or compression_ratio")
        check_int("budget_tokens", budget_tokens, 1, optional=True)
        if compression_ratio is not None and not (
            isinstance(compression_ratio, (int, float)) and math.isfinite(compression_ratio) and compression_ratio >= 1
        ):
            raise ValueError(f"compression_ratio must be a number >= 1, got {compression_ratio!r}")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be an integer >= 1, got {max_length!r}")
    if kv_bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {KV_BITS} (None = the model dtype), got {kv_bits!r}")
    config = getattr(model, "config", model)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    check_model_supported(text_config)
    if kv_bits == 4:
        check_scale_format(kv_scale_bits, kv_zero_point)
        Int4KV(rotate=kv_rotate)  # validates kv_rotate
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        if kv_rotate:
            hadamard(head_dim)  # raises unless head_dim is a power of two
        check_group_size(head_dim, kv_group_size)
        if kv_value_group_size is not None:
            try:
                check_group_size(head_dim, kv_value_group_size)
            except ValueError as e:
                raise ValueError(str(e).replace("kv_group_size", "kv_value_group_size")) from None
    budget = Budget(pol, budget_tokens=budget_tokens, compression_ratio=compression_ratio, max_length=max_length)
    if pol.evicts and (budget_tokens is not None or max_length is not None):
        budget.resolve(max_length or 1)  # validate recent_window / drop_tokens now
    if (
        hasattr(model, "set_attn_implementation")
        and getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION
    ):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    codec = (
        functools.partial(Int4KV, kv_group_size, kv_value_group_size, kv_scale_bits, kv_zero_point, kv_rotate)
        if kv_bits == 4
        else DenseKV
    )
    # slot times: 2 bytes when every token index the model (and max_length) allows fits in int16; a layer that
    # still meets a longer sequence widens to int32 itself (scissorhands.cache)
    longest = max(max_length or 0, getattr(text_config, "max_position_embeddings", None) or INT16_MAX_TIME + 1)
    time_dtype = torch.int16 if longest <= INT16_MAX_TIME + 1 else torch.int32
    return BudgetedCache(
        pol,
        text_config.num_hidden_layers,
        budget,
        simulate=simulate,
        codec_factory=codec,
        time_dtype=time_dtype,
        layer_factory=BudgetedLayer if pool is None else functools.partial(PagedLayer, pool=pool),
    )


def cache_policy(policy: str, **params) -> Policy:
    """The policy that ``make_cache(policy, model, **params)`` builds: ``params`` may mix ``make_cache``'s own
    arguments (``kv_bits``, ``max_length``, ...; set aside here) with the policy's fields (an engine's
    ``policy_params``), so a caller computes a budget with the same floor and windows as the cache it builds.

    Raises:
        ValueError: unknown policy or policy parameter, or an invalid value (``get_policy``), naming it.
    """
    own = set(inspect.signature(make_cache).parameters) - {"policy", "model", "policy_params"}
    return get_policy(policy, **{k: v for k, v in params.items() if k not in own})
