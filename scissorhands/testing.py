"""Helpers for tests: a tiny random-weight Llama model that runs in milliseconds on a CPU."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .models import apply_attn_implementation

TINY_LLAMA_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
"""Default config fields of :func:`tiny_llama` (head_dim = 64 / 4 = 16)."""


def tiny_llama(seed: int = 0, *, attn_implementation: str | None = None, **overrides) -> LlamaForCausalLM:
    """A tiny ``LlamaForCausalLM`` with random weights, float32, on the CPU, in eval mode.

    Args:
        seed: seeds the weight initialization; the same seed gives the same weights.
        attn_implementation: as in :func:`scissorhands.models.load_model`: None means
            ``scissorhands.ATTN_IMPLEMENTATION`` (transformers' default while that is undefined).
        **overrides: ``LlamaConfig`` fields that replace :data:`TINY_LLAMA_CONFIG`
            (e.g. ``num_hidden_layers=3``).

    The global torch RNG state is left as it was.
    """
    config = LlamaConfig(**{**TINY_LLAMA_CONFIG, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(dtype=torch.float32, device="cpu")
    model.eval()
    return apply_attn_implementation(model, attn_implementation)
