"""The policy base class: what every KV-cache eviction policy shares.

A policy decides *which* slots a budgeted cache layer keeps. The layer (``scissorhands.cache``)
owns everything else: storage, selection, protected windows, gather, time order and bookkeeping.
A policy only

* declares the per-slot statistics it needs (``state_width`` columns of ``state_dtype``),
* updates them from the attention probabilities of each forward call (``observe``), and
* turns them into a keep score per slot (``keep_score``; higher = keep).

Ties are broken by the layer: among slots with equal keep score the *older* slot is dropped
first. Slots in the recent window (and a policy's own protected slots, via ``+inf`` keep score)
are never dropped.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class Policy:
    """Parameters shared by every budgeted policy.

    Attributes:
        recent_window: ``r``, the newest tokens of each sequence that are never evicted. ``None``
            means ``min(10, budget_tokens // 2)`` (the paper's 10, kept below the budget).
        drop_tokens: ``m``, slots evicted in one compression during decoding. ``None`` means
            ``max(1, budget_tokens // 2)`` (capped at ``budget_tokens - recent_window``).
    """

    name: ClassVar[str] = "base"
    #: True when the policy scores slots from attention probabilities.
    needs_attention: ClassVar[bool] = False
    #: False for the uncompressed reference: the layer never evicts.
    evicts: ClassVar[bool] = True
    #: Per-slot statistic columns the layer stores for this policy (0 = none).
    state_width: ClassVar[int] = 0
    state_dtype: ClassVar[torch.dtype] = torch.float32

    recent_window: int | None = None
    drop_tokens: int | None = None

    def __post_init__(self) -> None:
        for f in ("recent_window", "drop_tokens"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (0 if f == "recent_window" else 1)):
                lo = 0 if f == "recent_window" else 1
                raise ValueError(f"{f} must be an integer >= {lo} or None, got {v!r}")

    # ----------------------------------------------------------------- parameters
    def resolve(self, budget_tokens: int) -> tuple[int, int]:
        """Return the effective ``(recent_window, drop_tokens)`` for a budget of ``budget_tokens``.

        Raises:
            ValueError: an explicit ``recent_window >= budget_tokens`` or an explicit
                ``drop_tokens`` outside ``[1, budget_tokens - recent_window]``.
        """
        if self.recent_window is None:
            r = min(10, budget_tokens // 2)
        else:
            r = self.recent_window
            if r >= budget_tokens:
                raise ValueError(
                    f"budget_tokens ({budget_tokens}) must be at least recent_window + 1 ({r + 1}); "
                    f"pass a larger budget_tokens or a smaller recent_window"
                )
        if self.drop_tokens is None:
            m = max(1, min(budget_tokens // 2, budget_tokens - r))
        else:
            m = self.drop_tokens
            if m > budget_tokens - r:
                raise ValueError(
                    f"drop_tokens ({m}) must be at most budget_tokens - recent_window ({budget_tokens - r})"
                )
        return r, m

    def params(self) -> dict:
        """The policy's parameters as a plain dict (recorded with every result)."""
        return dataclasses.asdict(self)

    # ----------------------------------------------------------------- scoring
    def observe(self, state: torch.Tensor, probs: torch.Tensor, visible: torch.Tensor,
                query_times: torch.Tensor) -> None:
        """Update ``state`` in place from one forward call's attention.

        Args:
            state: ``(batch_size, num_kv_heads, num_slots, state_width)`` per-slot statistics.
            probs: ``(batch_size, num_kv_heads, q_len, num_slots)`` float32 attention probabilities,
                averaged over the query heads of each KV head (grouped-query attention).
            visible: ``(batch_size, num_kv_heads, q_len, num_slots)`` bool, slot visible to query.
            query_times: ``(q_len,)`` int64 token index of each query (tokens seen before it).
        """

    def keep_score(self, state: torch.Tensor | None, slot_time: torch.Tensor) -> torch.Tensor:
        """Keep score per slot, ``(batch_size, num_kv_heads, num_slots)`` float64; higher is kept.

        ``slot_time`` is ``(batch_size, num_kv_heads, num_slots)`` int32, the token index of each
        slot (``-1`` for padding). Return ``+inf`` for slots the policy protects.
        """
        raise NotImplementedError
