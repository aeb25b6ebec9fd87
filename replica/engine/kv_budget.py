"""The KV budget of an engine: what a request's KV cache holds, and whether it fits (the only code that knows a
layout's units).

One class per `EngineConfig.kv_layout` (`KV_BUDGETS`):

* `PreallocatedBudget` counts bytes. The cache of a batch holds ``rows * S`` slots per layer and head, ``S`` the
  most slots any row needs (rows are padded to it); one slot in every layer costs ``slot_bytes`` (measured once,
  bookkeeping included). A budgeted row needs ``B`` slots (its layers preallocate the budget, so decode writes in
  place); a full-cache row ends at ``prompt + max_new - 1`` (or holds ``max_length_tokens`` preallocated). A set
  of rows is admitted when the steady state, ``rows * max(final_slots) * slot_bytes``, and each prefill's peak
  beside the rows held now (``n * ((layers - 1) * kept + max(L, kept))`` slots of one layer, ``kept`` = B or L: a
  budgeted prefill compresses one layer at a time) stay within the limit.
* `PagedBudget` counts blocks of one pool sized to the limit (`scissorhands.paged.BlockPool`): a request is
  admitted when the blocks its prefill takes now are free beside the block each running row may take at its next
  step; the dense bookkeeping (slot times, policy statistics), grown a block at a time to the widest row, lies
  outside the pool, so its padding is charged as blocks. It reads the running rows' blocks through
  `scissorhands.paged.paged_rows`.

Both answer the same questions: `footprint` (what a request holds at its end), `fits_alone` (why it could never
run, even alone, under the scheduler that runs it), `admission` (one step's account: `admits`), `growth` (what the
running rows take over the next steps) and `must_preempt` (whether the next decode step does not fit).
"""

from __future__ import annotations

from replica.engine.kv_base import KVBudget
from replica.engine.kv_blocks import PagedBudget
from replica.engine.kv_bytes import PreallocatedBudget

__all__ = ["KV_BUDGETS", "KVBudget", "PagedBudget", "PreallocatedBudget"]

#: The KV budget of each `EngineConfig.kv_layout`.
KV_BUDGETS: dict[str, type[KVBudget]] = {"preallocated": PreallocatedBudget, "paged": PagedBudget}
