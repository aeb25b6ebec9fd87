"""The KV memory limit the benchmarks give engines. An engine's own limit is resolved by its config
(`replica.common.types.EngineConfig.kv_memory_limit_bytes_on`, the one place that turns a limit into bytes)."""

from __future__ import annotations

from replica.common.types import device_memory_bytes, full_rows_kv_bytes
from scissorhands.checks import check_int

__all__ = ["device_memory_bytes", "full_batch_kv_limit_bytes", "full_rows_kv_bytes"]


def full_batch_kv_limit_bytes(model, full_batch: int, prompt_tokens: int, new_tokens: int) -> int:
    """The KV memory limit (bytes) that holds exactly `full_batch` full-cache sequences of `prompt_tokens`
    + `new_tokens` tokens: ``full_batch * (P + N) * slot_bytes`` (`replica.common.types.full_rows_kv_bytes`), the final
    slots and the bytes per slot (all layers, bookkeeping included) of a full-cache engine preallocating ``P + N``
    per row.

    Under this limit a full-cache engine's `max_batch_for(P, N)` is `full_batch` (one byte less gives
    `full_batch - 1`); the benchmarks give every other policy the same limit and let it fit its own batch.

    Raises:
        ValueError: `full_batch`, `prompt_tokens` or `new_tokens` below 1.
    """
    for name, value in (("full_batch", full_batch), ("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        check_int(name, value, 1)
    return full_rows_kv_bytes(model, full_batch, prompt_tokens + new_tokens)
