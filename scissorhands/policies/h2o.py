"""``h2o``: heavy hitters + recent window (Zhang et al., NeurIPS 2023, arXiv 2306.14048).

Every slot accumulates the attention it has received from every query since it entered the cache
(per KV head; under grouped-query attention the group's query heads are averaged first). The
budget is split in half: the newest ``budget_tokens // 2`` tokens are kept as the recent window,
the rest of the budget holds the slots with the largest accumulated attention (the heavy hitters).
As in the paper, one token is evicted per step (``drop_tokens`` defaults to 1). A prompt longer
than the budget is compressed once with the accumulated attention of all its queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy


@dataclass
class H2O(Policy):
    """Keeps the heavy hitters (accumulated attention, float32 per slot and KV head) + the recent window (half of B each)."""

    name: ClassVar[str] = "h2o"
    merged_schedule_exact: ClassVar[bool] = True
    needs_attention: ClassVar[bool] = True
    state_width: ClassVar[int] = 1
    uses_query_time: ClassVar[bool] = False

    def default_recent_window(self, budget_tokens: int) -> int:
        return budget_tokens // 2

    def default_drop_tokens(self, budget_tokens: int) -> int:
        return 1

    def observe(self, state, probs, visible, first_query) -> None:
        state[..., 0] += probs.sum(2)  # (b, h, q, S) -> (b, h, S)

    def keep_score(self, state, token_index, *, layer_idx, budget_tokens):
        return state[..., 0].to(torch.float64)
