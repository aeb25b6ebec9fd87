"""Continuous batching for one model replica: a package whose parts pass values (no Ray here), the shape of
vLLM's v1 core without its size.

```
submit ─► core (queue, lifecycle: the only caller of on_token / on_done / failures)
            │ view (running rows, part-fed prompts, queue)        ▲ tokens, faults
            ▼                                                      │
          scheduler.plan(view, kv) ─► StepPlan ─► runner (prefill / decode of the plan; the batch's cache)
            │ asks
            ▼
          kv budget (footprint, fits_alone, admits, growth, must_preempt; bytes or blocks)
```

* `replica.engine.core`: `ContinuousBatchingEngine`, the queue and each request's lifecycle
  (`replica.engine.request_queue`: the waiting requests; `replica.engine.in_flight`: the admitted ones;
  `replica.engine.lifecycle` answers requests and counts outcomes; `replica.engine.readout`: what it answers
  without stepping, the KV budget's answers for a request's lengths and its state);
* `replica.engine.requests`: the values the parts pass (`Sequence`, `Prefill`, `EngineView`, `StepPlan`);
* `replica.engine.scheduler`: `SCHEDULERS` (``prefill_first``, ``mixed``), ``plan(view, kv) -> StepPlan``;
* `replica.engine.kv_budget`: `KV_BUDGETS` by `kv_layout` (``preallocated``: bytes, ``paged``: blocks);
* `replica.engine.runner`: `ModelRunner`, prefill and decode forwards, the running batch's cache;
* `replica.engine.limits`: the KV memory limit the benchmarks give engines (`full_batch_kv_limit_bytes`; an
  engine's own limit is `replica.common.types.EngineConfig.kv_memory_limit_bytes_on`);
* `replica.engine.loop`: `EngineLoop`, the thread that steps the engine.

The model is injected, so tests pass a tiny one. Requests join the running batch after their prefill and leave it
when they finish, between decode steps. `abort(request_id)` (any thread) drops a queued or running request at the
start of the next step (`error_kind="aborted"`), so the slots it held are free again. `submit(..., on_token=f)`
calls `f(token_id, time_s)` for every token as soon as it is decoded (streaming servers). The cache never holds
more than the limit between forward calls (the transient copies a `torch.cat` makes during an update are not
counted; they are at most one layer's tensors). A request that could not fit even alone is rejected
(`error_kind="rejected"`), never queued forever.
"""

from replica.engine.core import ContinuousBatchingEngine
from replica.engine.limits import device_memory_bytes, full_batch_kv_limit_bytes, full_rows_kv_bytes
from replica.engine.loop import EngineLoop

__all__ = [
    "ContinuousBatchingEngine",
    "EngineLoop",
    "device_memory_bytes",
    "full_batch_kv_limit_bytes",
    "full_rows_kv_bytes",
]
