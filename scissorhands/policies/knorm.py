"""``knorm``: keep the keys of lowest L2 norm (Devoto et al., EMNLP 2024, arXiv 2406.11430).

"A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression": a key's L2 norm is
strongly anti-correlated with the attention it receives, so the keys of *lowest* norm are kept and
the highest-norm ones dropped, without computing any attention. The norm is taken per KV head over
``head_dim`` of the key as cached (after RoPE, which rotates pairs of channels and leaves the norm
unchanged), in float32, once when the slot is added (the key seam, ``Policy.init_state``), before
any 4-bit encoding. Same schedule as ``scissorhands`` (``drop_tokens`` defaults to
``budget_tokens // 2``, recent window 10): the paper compresses once and keeps no window; the newest
tokens are protected here so every policy is compared with the same recent window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy


@dataclass
class Knorm(Policy):
    """Keeps the slots whose key has the lowest L2 norm (+ the recent window); state: the norm, float32."""

    name: ClassVar[str] = "knorm"
    state_width: ClassVar[int] = 1

    def init_state(self, keys, values):
        # (b, h, q, d) -> (b, h, q, 1)
        return torch.linalg.vector_norm(keys.float(), dim=-1, keepdim=True)

    def keep_score(self, state, token_index, *, layer_idx, budget_tokens):
        """``-norm``: the highest-norm keys go first."""
        return -state[..., 0].to(torch.float64)
