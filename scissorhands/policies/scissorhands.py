"""``scissorhands``: keep the pivotal tokens (Liu et al., NeurIPS 2023, arXiv 2305.17118).

Persistence of importance: tokens that received above-average attention keep receiving it.
For every kept slot and KV head we count, over the last ``history_window`` steps, how often the
current query gave it *less* than the average attention (``p < threshold / n_t``, ``n_t`` = keys
the query attended). When the cache must shrink, the slots with the largest count (the most
often unimportant) are dropped; the ``recent_window`` newest tokens are never dropped; ties drop
the older token. Under grouped-query attention the group's query-head probabilities are averaged
first (the rule kvpress and cold-compress use).

Windowed counting (a choice this project makes, docs/library.md "Windowed counting"): counts are kept per chunk of
``count_chunk_steps`` steps in ``history_window // count_chunk_steps`` uint8 buckets per slot and
head. A count covers the current chunk plus the previous full chunks of the window, i.e. between
``history_window - count_chunk_steps + 1`` and ``history_window`` steps; with
``count_chunk_steps=1`` it is exact over ``history_window`` steps (and costs ``history_window`` bytes
per slot and head). The default (400 / 50 = 8 bytes per slot and head) costs 1.6% of a float32 KV
slot of head_dim 64, 3.1% of a 16-bit one and 10% of a 4-bit one (80 bytes with group 32); with
4-bit KV, ``count_chunk_steps=100`` (4 bytes, 5%) keeps the counts within 5%.
A step is one query token: a prompt of L tokens contributes its queries as L steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Policy


@dataclass
class Scissorhands(Policy):
    """Scissorhands (Algorithms 1 and 2 of the paper).

    Attributes:
        history_window: ``w``, steps of attention history that count (paper: 400).
        threshold: a slot is unimportant for a query when ``p < threshold / n_t`` (1.0 = average).
        count_chunk_steps: granularity of the windowed count; must divide ``history_window`` and be <= 255.
    """

    name: ClassVar[str] = "scissorhands"
    merged_schedule_exact: ClassVar[bool] = True
    needs_attention: ClassVar[bool] = True
    state_dtype: ClassVar[torch.dtype] = torch.uint8

    history_window: int = 400
    threshold: float = 1.0
    count_chunk_steps: int = 50

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.history_window, int) or self.history_window < 1:
            raise ValueError(f"history_window must be an integer >= 1, got {self.history_window!r}")
        if not isinstance(self.threshold, (int, float)) or not self.threshold > 0:
            raise ValueError(f"threshold must be a number > 0, got {self.threshold!r}")
        c = self.count_chunk_steps
        if not isinstance(c, int) or not 1 <= c <= 255 or self.history_window % c:
            raise ValueError(
                f"count_chunk_steps must be an integer in [1, 255] dividing history_window "
                f"({self.history_window}), got {c!r}"
            )
        self.threshold = float(self.threshold)

    @property
    def num_buckets(self) -> int:
        return self.history_window // self.count_chunk_steps

    @property
    def state_width(self) -> int:  # type: ignore[override]
        return self.num_buckets

    def observe(self, state, probs, visible, first_query) -> None:
        """Add this call's below-threshold indicators to the windowed counts (in place).

        ``state``: ``(batch_size, num_kv_heads, num_slots, num_buckets)`` uint8; bucket ``g % num_buckets``
        holds chunk ``g`` (queries ``g * c .. g * c + c - 1``). Calls observe consecutive tokens, so a
        chunk that starts inside this call is zeroed before it is filled: a bucket never mixes steps of
        two windows.
        """
        below = self._below(probs, visible)  # (b, h, q, S) bool
        c, k = self.count_chunk_steps, self.num_buckets
        t0, t1 = first_query, first_query + probs.shape[2] - 1  # query token indices
        first, last = t0 // c, t1 // c
        continued = (t0 - 1) // c if t0 > 0 else -1  # chunk the previous call was filling
        for g in range(max(first, last - k + 1), last + 1):
            col = state[..., g % k]  # (b, h, S) view
            if g != continued:
                col.zero_()
            s, e = max(t0, g * c) - t0, min(t1 + 1, (g + 1) * c) - t0  # this chunk's queries in the call
            if e - s == 1:
                col.add_(below[:, :, s])
            else:  # (b, h, q_g, S) -> (b, h, S); <= c <= 255
                col.add_(below[:, :, s:e].view(torch.uint8).sum(2, dtype=torch.uint8))

    def _below(self, probs, visible):
        """``(b, h, q, S)`` bool: the slot got less than ``threshold`` times the average attention,
        ``p * n_t < threshold`` in exact arithmetic, as one float32 comparison per slot: ``p < c`` with ``c``
        the smallest float32 at or above ``threshold / n_t`` (no float32 lies between the two, so for a float32
        ``p`` the comparisons agree; no product pass over the probabilities)."""
        if visible is None:  # every slot visible: n_t = num_slots
            limit = torch.tensor(self.threshold / probs.shape[-1], dtype=torch.float64, device=probs.device)
            return probs < _ceil_float32(limit)
        n_t = visible.sum(-1, keepdim=True)  # (b, h, q, 1) keys attended
        return visible & (probs < _ceil_float32(self.threshold / n_t.to(torch.float64)))  # p < threshold / n_t

    def observe_rows(self, state, probs, visible, first_query) -> None:
        """One decode step of rows on their own clocks in one pass: row ``i``'s query ``t_i`` adds to
        bucket ``(t_i // c) % num_buckets``, zeroed first when ``t_i`` starts a chunk (as ``observe``)."""
        if probs.shape[2] != 1:
            super().observe_rows(state, probs, visible, first_query)
            return
        b, h, n, _ = state.shape
        t = first_query.to(state.device)  # (b,) each row's query index
        idx = ((t // self.count_chunk_steps) % self.num_buckets).view(b, 1, 1, 1).expand(b, h, n, 1)
        count = state.gather(-1, idx)  # (b, h, S, 1) the row's bucket
        fresh = (t % self.count_chunk_steps == 0).view(b, 1, 1, 1)
        below = self._below(probs, visible)[:, :, 0, :, None]  # (b, h, S, 1)
        state.scatter_(-1, idx, count.masked_fill(fresh, 0) + below)

    def observed_queries(self, first_query: int, q_len: int) -> int:
        """The queries of the chunks still inside the window after this call (older buckets are
        overwritten by newer chunks before any count reads them)."""
        c, k = self.count_chunk_steps, self.num_buckets
        end = first_query + q_len
        return end - max(first_query, ((end - 1) // c - k + 1) * c)

    def keep_score(self, state, token_index, *, layer_idx, budget_tokens):
        """``-count``: the most often unimportant slots go first."""
        return -state.sum(-1, dtype=torch.int32).to(torch.float64)


def _ceil_float32(x: torch.Tensor) -> torch.Tensor:
    """The smallest float32 at or above each float64 value of ``x`` (same shape, float32)."""
    c = x.to(torch.float32)
    return torch.where(c.to(torch.float64) < x, torch.nextafter(c, c.new_tensor(float("inf"))), c)
