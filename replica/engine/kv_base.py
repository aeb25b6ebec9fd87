"""The layout-independent part of an engine's KV budget (`replica.engine.kv_budget`): budgets and slots."""

from __future__ import annotations

from typing import Callable

from replica.engine.requests import EngineView, Sequence
from replica.types import EngineConfig
from scissorhands import budget_from_ratio
from scissorhands.paged import BlockPool

__all__ = ["KVBudget"]


class KVBudget:
    """The layout-independent part: a request's budget ``B`` and slots, and the policy's check of a per-request B.

    Args:
        config: the engine's config.
        num_layers: the model's layers.
        slot_bytes: bytes of one slot in every layer, bookkeeping included (`cache_slot_bytes`).
        bookkeeping_slot_bytes: bytes of one row's bookkeeping slot, all layers (`bookkeeping_slot_bytes`).
        limit_bytes: the KV memory limit (None: unlimited).
        check_budget: raises ValueError when the policy refuses a budget (a per-request B).
    """

    def __init__(
        self,
        config: EngineConfig,
        num_layers: int,
        slot_bytes: int,
        bookkeeping_slot_bytes: int,
        limit_bytes: int | None,
        check_budget: Callable[[int], None],
    ):
        self.config = config
        self.num_layers = num_layers
        self.slot_bytes = slot_bytes
        self.bookkeeping_slot_bytes = bookkeeping_slot_bytes
        self.limit_bytes = limit_bytes
        self.check_budget = check_budget
        self.budget_tokens = config.resolved_budget_tokens()
        self.per_request = config.budget == "per_request"
        # slots every row's buffers preallocate: B (budgeted), the workload's longest sequence (full, when
        # max_length_tokens is given), or None (full: buffers grow with the longest row)
        self.row_capacity = self.budget_tokens if self.budget_tokens is not None else config.max_length_tokens
        self.pool: BlockPool | None = None

    def budget_of(self, prompt_tokens: int, max_new_tokens: int) -> int | None:
        """A request's B: its own ``ceil((prompt + max_new) / ratio)`` under ``budget: per_request``, else
        the engine's fixed B (None for a policy that keeps every token)."""
        if self.per_request:
            return budget_from_ratio(prompt_tokens + max_new_tokens, self.config.compression_ratio)
        return self.budget_tokens

    def final_slots(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Slots a sequence's row needs at most: ``B`` (budgeted), else ``prompt + max_new - 1`` or the
        preallocated ``max_length_tokens``, whichever is larger."""
        budget = self.budget_of(prompt_tokens, max_new_tokens)
        if budget is not None:
            return budget
        return max(prompt_tokens + max_new_tokens - 1, self.row_capacity or 0)

    def prefill_slots(self, prompt_tokens: int, budget: int | None = None) -> int:
        """Slots one row holds per layer after its prefill (the preallocated capacity, or the prompt)."""
        budget = budget if budget is not None else self.budget_tokens
        if budget is not None:
            return budget
        return max(prompt_tokens, self.row_capacity or 0)

    def held_after_decode(self, seq: Sequence) -> int:
        """The slots `seq`'s row holds after one more decode step (a buffer at its capacity is written in place)."""
        cap = seq.budget_tokens or self.row_capacity
        return seq.held_slots + 1 if cap is None or seq.held_slots < cap else seq.held_slots

    def fits_alone(self, prompt_tokens: int, max_new_tokens: int, chunk_tokens: int | None = None) -> str | None:
        """Why a request of these lengths can never run under the KV memory limit, even alone (None: it can).

        `chunk_tokens`: the most prompt tokens the scheduler feeds in one forward (None: the whole prompt at once,
        ``scheduler: prefill_first``). Under `budget: per_request`, also whether the policy accepts the request's
        own budget (`Policy.resolve`: a recent window must fit)."""
        budget = self.budget_of(prompt_tokens, max_new_tokens)
        if self.per_request:
            try:
                self.check_budget(budget)
            except ValueError as e:
                return f"its budget of {budget} slots (ceil((prompt + max_new) / ratio)) does not suit the policy: {e}"
        if self.limit_bytes is None:
            return None
        return self.memory_refusal(prompt_tokens, max_new_tokens, budget, chunk_tokens)

    def memory_refusal(self, prompt_tokens: int, max_new_tokens: int, budget: int | None, chunk: int | None):
        raise NotImplementedError

    def growth(self, view: EngineView, steps: int = 1) -> int:
        """What the running rows take over their next `steps` decode steps (the layout's unit; 0: nothing)."""
        return 0

    def must_preempt(self, view: EngineView) -> bool:
        """Whether the next decode step of `view`'s running rows does not fit (a row must leave first)."""
        return False
