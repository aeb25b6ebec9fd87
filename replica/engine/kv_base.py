"""The layout-independent part of an engine's KV budget (`replica.engine.kv_budget`): budgets and slots."""

from __future__ import annotations

from typing import Callable

from replica.common.types import EngineConfig, Refusal
from replica.engine.requests import EngineView, Sequence
from scissorhands import POLICIES, budget_from_ratio, cache_policy
from scissorhands.paged import BlockPool

__all__ = ["KVBudget"]


class KVBudget:
    """The layout-independent part: a request's budget ``B`` and slots, and the policy's check of a per-request B.

    Args:
        config: the engine's config.
        measured: what the model runner measured (`ModelRunner`): ``num_layers``, ``slot_bytes`` (one slot in
            every layer, bookkeeping included), ``bookkeeping_slot_bytes`` (one row's bookkeeping slot, all
            layers) and ``check_budget(budget)`` (raises ValueError when the policy refuses a per-request B).
        limit_bytes: the KV memory limit (None: unlimited).
    """

    def __init__(self, config: EngineConfig, measured, limit_bytes: int | None):
        self.config = config
        self.num_layers: int = measured.num_layers
        self.slot_bytes: int = measured.slot_bytes
        self.bookkeeping_slot_bytes: int = measured.bookkeeping_slot_bytes
        self.check_budget: Callable[[int], None] = measured.check_budget
        self.limit_bytes = limit_bytes
        self.budget_tokens = config.resolved_budget_tokens()
        self.per_request = config.budget == "per_request"
        # the policy's own floor and needs bound every per-request B (scissorhands.budget_from_ratio)
        self.policy = cache_policy(config.policy, **config.policy_params) if self.per_request else None
        # slots every row's buffers preallocate: B (budgeted), the workload's longest sequence (full, when
        # max_length_tokens is given), or None (full: buffers grow with the longest row)
        # B is capped at the workload's longest sequence: a sequence of L tokens never holds more than L slots
        self.row_capacity = self.budget_tokens if self.budget_tokens is not None else config.max_length_tokens
        if self.budget_tokens is not None and config.max_length_tokens is not None:
            self.row_capacity = min(self.budget_tokens, config.max_length_tokens)
        self.pool: BlockPool | None = None
        self.prefix = None  # the paged layout's `PrefixCachingPool` when prefix caching is on
        self.sessions = None  # the paged layout's `SessionStatePool` under kv_reuse: session_state
        # kv_reuse: shared_prefix with a budgeted policy: each row keeps its prompt's whole blocks uncompressed
        self.pins_prefix = config.kv_reuse == "shared_prefix" and POLICIES[config.policy].evicts

    def pinned_of(self, prompt_tokens: int) -> int:
        """The prompt tokens a request's budgeted row keeps uncompressed under ``kv_reuse: shared_prefix``: the whole
        blocks the prefix cache may hold of a prompt of `prompt_tokens`, ``floor((prompt - 1) / block_tokens)``
        blocks (at least one prompt token is computed); 0 otherwise."""
        if not self.pins_prefix:
            return 0
        return max(0, prompt_tokens - 1) // self.config.block_tokens * self.config.block_tokens

    def kept_of(self, prompt_tokens: int, max_new_tokens: int) -> int | None:
        """The most slots a request's row keeps per layer: its B plus its pinned prefix (`pinned_of`); None: every
        token."""
        budget = self.budget_of(prompt_tokens, max_new_tokens)
        return None if budget is None else budget + self.pinned_of(prompt_tokens)

    def budget_of(self, prompt_tokens: int, max_new_tokens: int) -> int | None:
        """A request's B: its own ``budget_from_ratio(prompt + max_new, ratio, policy)`` under ``budget: per_request``
        (``ceil(L / ratio)`` raised to the policy's floor and needs), else the engine's fixed B (None: keeps every token)."""
        if self.per_request:
            return budget_from_ratio(prompt_tokens + max_new_tokens, self.config.compression_ratio, self.policy)
        return self.budget_tokens

    def final_slots(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Slots a sequence's row needs at most: ``B`` (budgeted) capped at what the sequence can hold (its own
        ``prompt + max_new - 1`` under ``budget: per_request``, else the preallocated ``min(B, max_length_tokens)`` or
        its own length if longer),
        else ``prompt + max_new - 1`` or the preallocated ``max_length_tokens``, whichever is larger. ``B`` itself
        (which a floor or a recent window may raise above ``L``) stays what the policy resolves."""
        budget = self.budget_of(prompt_tokens, max_new_tokens)
        if budget is not None:
            own = max(1, prompt_tokens + max_new_tokens - 1)
            # a fixed B's rows are preallocated to row_capacity; one longer than max_length_tokens grows to its own
            return min(budget, own if self.per_request else max(own, self.row_capacity))
        return max(prompt_tokens + max_new_tokens - 1, self.row_capacity or 0)

    def prefill_slots(self, prompt_tokens: int, budget: int | None = None, final_slots: int | None = None) -> int:
        """Slots one row holds per layer after its prefill (the preallocated capacity: its budget capped at its
        `final_slots` when given, or the prompt)."""
        budget = budget if budget is not None else self.budget_tokens
        if budget is not None:
            return budget if final_slots is None else min(budget, final_slots)
        return max(prompt_tokens, self.row_capacity or 0)

    def held_after_decode(self, seq: Sequence) -> int:
        """The slots `seq`'s row holds after one more decode step (a buffer at its capacity is written in place)."""
        cap = min(seq.kept_tokens, seq.final_slots) if seq.budget_tokens else self.row_capacity
        return seq.held_slots + 1 if cap is None or seq.held_slots < cap else seq.held_slots

    def fits_alone(self, prompt_tokens: int, max_new_tokens: int, chunk_tokens: int | None = None) -> Refusal | None:
        """Why a request of these lengths can never run under the KV memory limit, even alone (None: it can).

        `chunk_tokens`: the most prompt tokens the scheduler feeds in one forward (None: the whole prompt at once,
        ``scheduler: prefill_first``). Under `budget: per_request`, also whether the policy accepts the request's
        own budget (`Policy.resolve`: a recent window must fit)."""
        budget = self.budget_of(prompt_tokens, max_new_tokens)
        if self.per_request:
            try:
                self.check_budget(budget)
            except ValueError as e:
                why = f"its budget of {budget} slots (budget_from_ratio(prompt + max_new, ratio, policy)) does not suit the policy: {e}"
                return Refusal("policy", why)
        if self.limit_bytes is None:
            return None
        why = self.memory_refusal(
            prompt_tokens, max_new_tokens, self.kept_of(prompt_tokens, max_new_tokens), chunk_tokens
        )
        return None if why is None else Refusal("kv_memory", why)

    def max_new_tokens_for(self, prompt_tokens: int, most: int, chunk_tokens: int | None = None) -> int:
        """The most new tokens (at most `most`) a request of `prompt_tokens` may ask and still run alone
        (`fits_alone` None), by bisection as its bounds grow with the new tokens; 0: not one."""
        if most < 1 or self.fits_alone(prompt_tokens, most, chunk_tokens) is None:
            return max(0, most)
        lo, hi = 0, most  # the longest known to fit (0: none yet); hi does not fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits_alone(prompt_tokens, mid, chunk_tokens) is None else (lo, mid)
        return lo

    def memory_refusal(self, prompt_tokens: int, max_new_tokens: int, budget: int | None, chunk: int | None):
        raise NotImplementedError

    def reset_peak(self) -> None:
        """Start the peak of blocks in use (`pool_stats`) from now."""
        if self.pool is not None:
            self.pool.peak_blocks_in_use = self.pool.blocks_in_use
            if hasattr(self.pool, "reset_counts"):
                self.pool.reset_counts()

    def pool_stats(self, decode_steps: int, block_steps: int) -> dict:
        """`stats()`'s block keys: the block size, the pool's blocks, the peak since `reset_peak` and the mean
        blocks in use over `decode_steps` (`block_steps`: their sum); None without a pool."""
        pool = self.pool
        return {
            "block_tokens": self.config.block_tokens if pool is not None else None,
            "kv_pool_blocks": pool.usable_blocks if pool is not None else None,
            "peak_kv_blocks_in_use": pool.peak_blocks_in_use if pool is not None else None,
            "mean_kv_blocks_in_use": block_steps / decode_steps if pool is not None and decode_steps else None,
        }

    # ------------------------------------------------------------------ prefix caching (the paged layout's)
    def look_up_prefix(self, seq: Sequence) -> None:
        """Set ``seq.cached_tokens``: the first tokens of its next prefill the prefix cache holds (none here)."""
        seq.cached_tokens = 0

    def shared_blocks(self, seq: Sequence) -> int:
        """Blocks of `seq`'s cache hit that rows hold already (its prefill takes no free block for them)."""
        return 0

    def attach_prefix(self, p, new_cache) -> int:
        """Start group `p` from its rows' cached blocks; the tokens each takes from the cache (none here)."""
        return 0

    def keep_session(self, cache, i: int, seq: Sequence) -> None:
        """Keep row `i` of `cache` as `seq`'s session's state (`kv_reuse: session_state`; nothing here)."""

    def register_prefix(self, p, chunk: int) -> None:
        """Cache the full blocks of `p`'s rows its last `chunk` tokens completed (nothing here)."""

    def prefix_stats(self) -> dict:
        """`stats()`'s prefix cache gauges and counters of the pool (none here)."""
        return {"prefix_cache_blocks": None, "prefix_cache_reclaimed_blocks": None}

    def growth(self, view: EngineView, steps: int = 1) -> int:
        """What the running rows take over their next `steps` decode steps (the layout's unit; 0: nothing)."""
        return 0

    def must_preempt(self, view: EngineView) -> bool:
        """Whether the next decode step of `view`'s running rows does not fit (a row must leave first)."""
        return False
