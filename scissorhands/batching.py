"""Row-level operations on a ``BudgetedCache`` for continuous batching.

A serving engine prefills newly admitted sequences in a cache of their own, then merges them into
the running batch (``merge_rows``) and drops finished sequences between decode steps
(``select_rows``). Rows of one batch then started at different times, so the merged cache runs
per-row clocks (``BudgetedLayer.row_time``): every row keeps the slot times, query times and
eviction decisions it would have had alone. The engine passes each row's own ``position_ids``
(``row_positions``) so RoPE sees the same positions as well.

Layout after a merge (per layer): ``(rows_running + rows_new, num_kv_heads, num_slots, ...)`` with
``num_slots`` the larger of the two; the shorter side is padded on the left with filler slots
(slot time ``-1``, zero keys and values, zero statistics) that are masked and hold no token. A
removal compacts away slots that no remaining row needs, so the tensors always have as many slots
as the fullest row holds (``physical_slots``).

Memory: the cache's tensors hold ``rows * num_slots`` slots per layer and head, where
``num_slots`` is at most the largest number of tokens any row holds; ``sequence_slot_bytes``
measures the bytes of one slot in every layer (keys, values and bookkeeping), so an engine can
bound the bytes of a batch before admitting a sequence into it.
"""

from __future__ import annotations

import torch

from . import make_cache
from .cache import BudgetedCache

__all__ = [
    "cache_slot_bytes",
    "measured_cache",
    "merge_rows",
    "physical_slots",
    "row_positions",
    "select_rows",
    "sequence_slot_bytes",
    "use_row_clocks",
]


def _check_compatible(a: BudgetedCache, b: BudgetedCache) -> None:
    if type(a.policy) is not type(b.policy) or a.policy != b.policy:
        raise ValueError(f"cannot merge caches of different policies: {a.policy!r} and {b.policy!r}")
    per_row = a.layers[0].row_budget is not None and b.layers[0].row_budget is not None
    if a.policy.evicts and not per_row and a.budget.tokens != b.budget.tokens:
        raise ValueError(f"cannot merge caches of different budgets: {a.budget.tokens} and {b.budget.tokens} tokens")
    if len(a.layers) != len(b.layers) or a.simulate != b.simulate:
        raise ValueError("cannot merge caches of different models (layer count) or simulation modes")


def use_row_clocks(cache: BudgetedCache) -> None:
    """Switch every initialized layer of ``cache`` to per-row clocks (``row_time``), in place.

    A row's clock starts at the shared ``tokens_seen`` (every row of a batch prefilled together).
    """
    for layer in cache.layers:
        if layer.is_initialized and layer.row_time is None:
            layer.row_time = torch.full((layer.batch_size,), layer.tokens_seen, dtype=torch.int64, device=layer.device)


def merge_rows(running: BudgetedCache | None, new: BudgetedCache) -> BudgetedCache:
    """Append the rows of ``new`` (just prefilled) after the rows of ``running``; return the merged cache.

    ``running`` is updated in place and returned (``new`` itself when ``running`` is None); ``new``
    must not be used afterwards. Both switch to per-row clocks. Row ``i`` of ``new`` becomes row
    ``running_rows + i``.

    Raises:
        ValueError: the caches differ in policy, budget, layer count or simulation mode, or ``new``
            has not seen any token.
    """
    if not new.layers[0].is_initialized:
        raise ValueError("the cache to merge holds no rows (run its prefill first)")
    use_row_clocks(new)
    if running is None or not running.layers[0].is_initialized:
        return new
    _check_compatible(running, new)
    use_row_clocks(running)
    for a, b in zip(running.layers, new.layers):
        a.append_rows(b)  # filler slots on the shorter side, then (b_a + b_b, h, S, ...) per buffer
    return running


def select_rows(cache: BudgetedCache, keep: torch.Tensor | list[int]) -> BudgetedCache | None:
    """Keep only rows ``keep`` (indices, in the order given) of ``cache``, in place.

    Slots no remaining row needs are removed afterwards. Returns the cache, or None when ``keep`` is
    empty (a cache of zero rows is never kept).
    """
    keep = torch.as_tensor(keep, dtype=torch.long)
    if keep.numel() == 0:
        return None
    use_row_clocks(cache)
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        layer.batch_select_indices(keep.to(layer.device))
        layer._compact()  # drop slots that only removed rows needed
    return cache


def row_positions(cache: BudgetedCache) -> torch.Tensor:
    """``(batch_size, 1)`` int64 position id of each row's next token (its own clock)."""
    layer = cache.layers[0]
    if layer.row_time is None:
        return torch.full((layer.batch_size, 1), layer.tokens_seen, dtype=torch.int64, device=layer.device)
    return layer.row_time[:, None].clone()


def physical_slots(cache: BudgetedCache | None) -> int:
    """Slots per row and head the largest layer holds physically (0 for None / empty)."""
    if cache is None:
        return 0
    return max(cache.num_slots(), default=0)


@torch.inference_mode()
def measured_cache(model, policy: str, **cache_kwargs) -> BudgetedCache:
    """A fresh ``make_cache(policy, model, **cache_kwargs)`` cache after a one-token forward of ``model``: one row,
    its buffers allocated, so the bytes they cost per slot can be read (`sequence_slot_bytes`,
    `scissorhands.paged.bookkeeping_slot_bytes`)."""
    cache = make_cache(policy, model, **cache_kwargs)
    device = next(model.parameters()).device
    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def sequence_slot_bytes(model, policy: str, **cache_kwargs) -> int:
    """Bytes one sequence's slot costs across every layer of ``model`` (keys, values, bookkeeping).

    Measured, not computed from a formula (`measured_cache`): the bytes of its allocated buffers divided by their
    slot capacity, plus the per-row counters, in every layer. A sequence holding ``n`` tokens in a batch whose
    buffers hold ``S >= n`` slots costs ``S * sequence_slot_bytes`` (``S`` is the budget for a policy that evicts).
    """
    return cache_slot_bytes(measured_cache(model, policy, **cache_kwargs))


def cache_slot_bytes(cache: BudgetedCache) -> int:
    """Bytes one row's slot costs across every layer of `cache` (its buffers allocated)."""
    return int(sum(layer.slot_nbytes() for layer in cache.layers))
