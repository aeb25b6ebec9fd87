"""``streaming_llm``: attention sinks + a sliding window (Xiao et al., ICLR 2024, arXiv 2309.17453).

Keeps the first ``n_sink`` tokens of each sequence (the "attention sinks") and the most recent
tokens; when the cache is full the oldest non-sink token goes first. Positions are absolute (keys
are cached after RoPE and new tokens get their true position), not re-assigned inside the cache as
in the paper's rolling variant: this project compares every policy at the same positions (docs/library.md).
Padding is never a sink: sinks are counted in each sequence's own tokens. The paper evicts one
token per step, so ``drop_tokens`` defaults to 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..checks import check_int
from .base import Policy


@dataclass
class StreamingLLM(Policy):
    """Sinks + most recent tokens.

    Attributes:
        n_sink: tokens at the start of each sequence that are never evicted (paper: 4). When the budget
            cannot hold them plus one more token, the sinks shrink to ``budget_tokens - 1``.
    """

    name: ClassVar[str] = "streaming_llm"
    merged_schedule_exact: ClassVar[bool] = True

    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n_sink", self.n_sink, 0)

    def sink_tokens(self, budget_tokens: int) -> int:
        return min(self.n_sink, budget_tokens - 1)

    def default_drop_tokens(self, budget_tokens: int) -> int:
        return 1

    def keep_score(self, state, token_index, *, layer_idx, budget_tokens):
        """The token index (older = lower = dropped first); ``+inf`` for the sinks."""
        score = token_index.to(torch.float64)
        return score.masked_fill(token_index < self.sink_tokens(budget_tokens), float("inf"))
