"""The policy base class: what every KV-cache eviction policy shares.

A policy decides *which* slots a budgeted cache layer keeps. The layer (``scissorhands.cache``)
owns everything else: storage, selection, protected windows, gather, time order and bookkeeping.
A policy only

* declares the per-slot statistics it needs (``state_width`` columns of ``state_dtype``),
* initialises a new slot's statistics from its key and value (``init_state``, the key seam: the
  key after RoPE and the value as computed, before any 4-bit encoding; zero by default),
* updates them from the attention probabilities of each forward call (``observe``), and
* turns them into a keep score per slot (``keep_score``; higher = keep, ``+inf`` = protected).

Adding a policy is one file here (a dataclass subclass with validated fields, a docstring naming the
paper and what it keeps) and one line in ``POLICIES`` (``scissorhands.policies``); every test over the
registry then covers it.

Ties are broken by the layer: among slots with equal keep score the *older* slot is dropped
first. Slots in the recent window (and a policy's sinks, via ``+inf`` keep score) are never dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..checks import check_int

#: The default budget floor (``Policy.min_budget_tokens``), slots per KV head: a budget from a compression ratio is
#: never below it, and a sequence no longer than it is not compressed. Chosen by measurement on the embedded model:
#: greedy chat answers through Scissorhands x5 (docs/results/2026-12-06-budget-floor-6010da5.md).
DEFAULT_MIN_BUDGET_TOKENS = 32


@dataclass
class Policy:
    """Parameters shared by every budgeted policy.

    Attributes:
        recent_window: ``r``, the newest tokens of each sequence that are never evicted. ``None``
            means the policy's default (``min(10, budget_tokens // 2)`` unless the policy says otherwise).
        drop_tokens: ``m``, slots evicted in one compression during decoding. ``None`` means the
            policy's default (``budget_tokens // 2`` unless the policy says otherwise), capped at
            ``budget_tokens - recent_window - sinks``.
        min_budget_tokens: the budget floor (slots per KV head): a budget made from a compression ratio
            (``scissorhands.budget_from_ratio`` with this policy: ``make_cache(compression_ratio=...)``, the
            engine's ``budget: per_request``) is at least this, and at most the sequence's length, so a sequence
            no longer than the floor is not compressed. 0: the paper's ``ceil(L / r)`` alone. An absolute
            ``budget_tokens`` is used as given. Default ``DEFAULT_MIN_BUDGET_TOKENS``, measured
            (docs/results/2026-12-06-budget-floor-6010da5.md).
    """

    name: ClassVar[str] = "base"
    #: True when the policy scores slots from attention probabilities.
    needs_attention: ClassVar[bool] = False
    #: False for the uncompressed reference: the layer never evicts.
    evicts: ClassVar[bool] = True
    #: Per-slot statistic columns the layer stores for this policy (0 = none).
    state_width: ClassVar[int] = 0
    state_dtype: ClassVar[torch.dtype] = torch.float32
    #: Whether ``observe`` reads ``first_query`` (query token indices): then rows on different clocks are
    #: observed per clock (``observe_rows``). True unless a policy declares it ignores them.
    uses_query_time: ClassVar[bool] = True
    #: Whether feeding tokens in the merged call schedule (refill to the budget in one call, one token when
    #: full) keeps the very slots and, up to float noise, the losses of one-token decoding, proved on the
    #: embedded model by the slow test of tests/workloads/test_quality_chunks.py. False (a new policy included):
    #: the quality runner and the engine's prompt scoring feed it one token per call.
    merged_schedule_exact: ClassVar[bool] = False

    recent_window: int | None = None
    drop_tokens: int | None = None
    min_budget_tokens: int = DEFAULT_MIN_BUDGET_TOKENS

    def __post_init__(self) -> None:
        check_int("recent_window", self.recent_window, 0, optional=True)
        check_int("drop_tokens", self.drop_tokens, 1, optional=True)
        check_int("min_budget_tokens", self.min_budget_tokens, 0)

    # ----------------------------------------------------------------- parameters
    def sink_tokens(self, budget_tokens: int) -> int:
        """Oldest tokens of each sequence the policy protects (``streaming_llm``'s sinks); 0 here."""
        return 0

    def default_recent_window(self, budget_tokens: int) -> int:
        return min(10, (budget_tokens - self.sink_tokens(budget_tokens)) // 2)

    def default_drop_tokens(self, budget_tokens: int) -> int:
        return budget_tokens // 2

    def resolve(self, budget_tokens: int) -> tuple[int, int]:
        """Return the effective ``(recent_window, drop_tokens)`` for a budget of ``budget_tokens``.

        Raises:
            ValueError: ``budget_tokens < recent_window + sinks + 1`` for an explicit recent_window,
                or an explicit ``drop_tokens`` outside ``[1, budget_tokens - recent_window - sinks]``.
        """
        s = self.sink_tokens(budget_tokens)
        if self.recent_window is None:
            r = max(0, min(self.default_recent_window(budget_tokens), budget_tokens - s - 1))
        else:
            r = self.recent_window
            if r + s >= budget_tokens:
                raise ValueError(
                    f"budget_tokens ({budget_tokens}) must be at least recent_window + sinks + 1 ({r + s + 1}); "
                    f"pass a larger budget_tokens or a smaller recent_window"
                )
        room = budget_tokens - r - s
        if self.drop_tokens is None:
            m = max(1, min(self.default_drop_tokens(budget_tokens), room))
        else:
            m = self.drop_tokens
            if m > room:
                raise ValueError(f"drop_tokens ({m}) must be at most budget_tokens - recent_window - sinks ({room})")
        return r, m

    def needed_budget_tokens(self) -> int:
        """The smallest budget this policy's parameters accept (``resolve`` raises below it): room for its
        protected tokens (an explicit ``recent_window`` plus its sinks) and one compression (an explicit
        ``drop_tokens``, else 1); 1 when every parameter is the policy's default (its windows shrink to fit)."""
        start = (self.recent_window or 0) + 1
        for budget in itertools.count(start):  # the room resolve checks grows with the budget: the first fit is it
            try:
                self.resolve(budget)
            except ValueError:
                continue
            return budget
        raise AssertionError("unreachable")  # itertools.count never ends

    def params(self) -> dict:
        """The policy's parameters as a plain dict (recorded with every result)."""
        return dataclasses.asdict(self)

    # ----------------------------------------------------------------- scoring
    def init_state(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
        """Statistics of the slots a forward call adds, from their keys and values (only when
        ``state_width > 0``); called once per call and layer, before the call's attention.

        Args:
            keys: ``(batch_size, num_kv_heads, q_len, head_dim)`` in the model dtype, after RoPE (before
                any 4-bit encoding); padding tokens included (their slots are masked by the layer).
            values: ``(batch_size, num_kv_heads, q_len, head_dim_v)``, likewise.
        Returns:
            ``(batch_size, num_kv_heads, q_len, state_width)`` of ``state_dtype``, or None: start from zero
            (the default).
        """
        return None

    def observe(self, state: torch.Tensor, probs: torch.Tensor, visible: torch.Tensor | None, first_query: int) -> None:
        """Update ``state`` in place from one forward call's attention (only when ``needs_attention``): the
        probabilities of the call's last ``observed_queries`` queries.

        Args:
            state: ``(batch_size, num_kv_heads, num_slots, state_width)`` per-slot statistics. In a fresh
                prompt (the first call, no padding) a chunk of queries gets only the slots its queries
                can see (the first ``num_slots``); the later slots were added by this call and are as
                ``init_state`` left them.
            probs: ``(batch_size, num_kv_heads, q_len, num_slots)`` float32 attention probabilities,
                averaged over the query heads of each KV head (grouped-query attention); zero for
                slots a query cannot see.
            visible: bool, ``(batch_size, num_kv_heads, q_len, num_slots)`` or broadcastable to it (a fresh
                prompt's causal mask is ``(1, 1, q_len, num_slots)``), slot visible to the query; ``None``
                when every slot is visible to every query (decoding without masked slots).
            first_query: token index (tokens seen before it, padding included) of the first query;
                the queries are consecutive.
        """

    def observe_rows(
        self, state: torch.Tensor, probs: torch.Tensor, visible: torch.Tensor | None, first_query: torch.Tensor
    ) -> None:
        """``observe`` for rows on clocks of their own (continuous batching): ``first_query`` is
        ``(batch_size,)`` int64, each row's first query index. Here: ``observe`` once when the policy
        ignores query indices (``uses_query_time`` False) or all rows share one, else once per group of
        rows sharing one (on copies of their rows' state, written back)."""
        starts = first_query.tolist()
        if not self.uses_query_time or len(set(starts)) == 1:
            self.observe(state, probs, visible, starts[0])
            return
        for t in sorted(set(starts)):
            rows = torch.tensor([i for i, x in enumerate(starts) if x == t], device=state.device)  # (n_rows,)
            sub = state[rows]  # (n_rows, hkv, S, w) copy
            self.observe(sub, probs[rows], None if visible is None else visible[rows], t)
            state[rows] = sub

    def observed_queries(self, first_query: int, q_len: int) -> int:
        """How many of a call's last queries ``observe`` needs (the others' probabilities would not
        change the statistics, so the layer computes only their attention output, with a fused kernel).

        Args:
            first_query: token index of the call's first query; q_len: queries in the call.
        Returns an integer in ``[1, q_len]``; here every query (``q_len``).
        """
        return q_len

    def keep_score(
        self, state: torch.Tensor | None, token_index: torch.Tensor, *, layer_idx: int, budget_tokens: int
    ) -> torch.Tensor:
        """Keep score per slot, ``(batch_size, num_kv_heads, num_slots)`` float64; higher is kept.

        Args:
            state: the per-slot statistics (None when ``state_width == 0``).
            token_index: ``(batch_size, num_kv_heads, num_slots)`` int64, the slot's token index within
                its own sequence (0 = first non-padding token); negative for padding, filler and (in
                simulation mode) evicted slots, which the layer masks whatever their score.
            layer_idx: the layer asking; budget_tokens: the resolved budget.
        Returns ``+inf`` for slots the policy protects.
        """
        raise NotImplementedError
