"""The ``scissorhands`` attention implementation for transformers.

Registered under one name with both ``AttentionInterface`` and ``AttentionMaskInterface`` (the
official seams; no model code is patched). With a ``BudgetedCache`` it hands the layer the
attention probabilities its policy needs and masks with the layer's own per-slot times (kept
slots are not contiguous positions, so the 2-D causal mask transformers builds would be wrong).
With any other cache, or none, it computes ordinary causal attention, so a model switched to
``attn_implementation="scissorhands"`` gives the same outputs as with ``"sdpa"``.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .cache import active_layer

ATTN_IMPLEMENTATION = "scissorhands"


def padding_mask_function(batch_size: int, q_length: int, kv_length: int, attention_mask=None, **kwargs):
    """Mask interface: pass the 2-D padding mask ``(batch_size, tokens_seen)`` through (bool) or None."""
    return attention_mask


def scissorhands_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """Attention forward.

    Args:
        query: ``(batch_size, num_heads, q_len, head_dim)``.
        key, value: ``(batch_size, num_kv_heads, kv_len, head_dim)`` as returned by the cache.
        attention_mask: ``(batch_size, tokens_seen)`` bool padding mask from ``padding_mask_function``,
            or a 4-D additive/bool mask a caller prepared, or None.
    Returns:
        ``((batch_size, q_len, num_heads, head_dim), None)``.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer = active_layer(getattr(module, "layer_idx", -1))
    if layer is not None:
        return layer.attend(query, attention_mask, scaling), None
    return _causal_attention(query, key, value, attention_mask, scaling, dropout if module.training else 0.0), None


def _causal_attention(query, key, value, attention_mask, scaling, dropout):
    """Plain causal attention for caches we do not own; the last ``q_len`` keys are the queries'."""
    b, hq, q_len, _ = query.shape
    kv_len = key.shape[-2]
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask[..., :kv_len]
    else:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
        mask = torch.arange(kv_len, device=query.device)[None, :] <= q_pos[:, None]              # (q, kv)
        mask = mask[None, None]
        if attention_mask is not None:
            pad = attention_mask[:, -kv_len:].to(torch.bool)                                      # (b, kv)
            mask = mask & pad[:, None, None, :]
            # a padded query sees nothing; let it see itself so the softmax stays finite
            mask = mask | _self_mask(q_len, kv_len, query.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != hq)
    return out.transpose(1, 2).contiguous()


def _self_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """``(1, 1, q_len, kv_len)`` bool, True where a query meets its own key."""
    m = torch.zeros(q_len, kv_len, dtype=torch.bool, device=device)
    m[torch.arange(q_len), torch.arange(kv_len - q_len, kv_len)] = True
    return m[None, None]


def register() -> None:
    """Register the attention function and its mask function under ``ATTN_IMPLEMENTATION``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, scissorhands_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask_function)


register()
