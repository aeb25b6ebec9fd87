"""``random``: evict uniformly at random; the floor any policy must beat.

Not from a paper; the control every KV-compression study needs. Each eviction draws, for every
candidate slot, a pseudo-random number from a hash of ``(seed, layer, KV head, token index,
tokens the sequence has seen)`` and drops the smallest: deterministic for a seed, independent
between evictions, layers and heads, identical in real and simulation mode, and identical for a
sequence alone or in a left-padded batch. Same schedule as ``scissorhands`` (``drop_tokens``
defaults to ``budget_tokens // 2``, recent window 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..checks import check_int
from .base import Policy

_MASK62 = (1 << 62) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A splitmix-style integer hash on int64 (kept to 62 bits so nothing overflows to the sign)."""
    for mul in (0x2545F4914F6CDD1D & _MASK62, 0x1B873593):
        x = (x ^ (x >> 29)) & _MASK62
        x = (x * mul) & _MASK62
    return x ^ (x >> 31)


@dataclass
class Random(Policy):
    """Keeps a uniformly random subset of the older tokens (plus the recent window); seeded.

    Attributes:
        seed: the integer seed; the same seed gives the same selections.
    """

    name: ClassVar[str] = "random"
    merged_schedule_exact: ClassVar[bool] = True

    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("seed", self.seed, 0)

    def keep_score(self, state, token_index, *, layer_idx, budget_tokens):
        """A uniform number in [0, 1) per slot, fresh for every eviction (keyed by tokens seen)."""
        b, h, _ = token_index.shape
        seen = token_index.amax(-1, keepdim=True) + 1  # (b, h, 1) tokens of the sequence
        head = torch.arange(h, device=token_index.device).view(1, h, 1)
        x = token_index.clamp(min=0) + (seen << 20) + (head << 44) + (layer_idx << 50)
        x = _mix(_mix(x ^ (self.seed & 0xFFFFFFFF)) + self.seed)
        return (x & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)
