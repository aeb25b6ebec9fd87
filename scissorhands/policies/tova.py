"""``tova``: Token Omission Via Attention (Oren et al., 2024, arXiv 2401.06104).

At each eviction the slot that received the least attention from the *last* query is dropped.
The attention is averaged over all heads of the layer (the paper's choice), so every KV head of a
layer keeps the same tokens. The paper keeps no separate recent window (``recent_window``
defaults to 0) and evicts one token per step (``drop_tokens`` defaults to 1). A prompt longer than
the budget is compressed with the attention of its last token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy


@dataclass
class TOVA(Policy):
    """Keeps the slots most attended by the last query (head-averaged); state: that attention, float32."""

    name: ClassVar[str] = "tova"
    merged_schedule_exact: ClassVar[bool] = True
    needs_attention: ClassVar[bool] = True
    state_width: ClassVar[int] = 1
    uses_query_time: ClassVar[bool] = False

    def default_recent_window(self, budget_tokens: int) -> int:
        return 0

    def default_drop_tokens(self, budget_tokens: int) -> int:
        return 1

    def observe(self, state, probs, visible, first_query) -> None:
        # (b, h, q, S) -> last query, mean over the KV heads (each already the mean of its group) -> (b, 1, S)
        state[..., 0] = probs[:, :, -1].mean(1, keepdim=True)

    def observed_queries(self, first_query: int, q_len: int) -> int:
        return 1  # the last query only

    def keep_score(self, state, token_index, *, layer_idx, budget_tokens):
        return state[..., 0].to(torch.float64)
