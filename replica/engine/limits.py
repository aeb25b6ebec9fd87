"""The KV memory limit of an engine, resolved from its config, and the limits the benchmarks give engines."""

from __future__ import annotations

import torch

from replica.types import EngineConfig
from scissorhands.batching import sequence_slot_bytes
from scissorhands.checks import check_int

__all__ = ["device_memory_bytes", "full_batch_kv_limit_bytes", "full_rows_kv_bytes", "resolve_kv_limit_bytes"]


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of `device` (bytes): the GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().total)


def resolve_kv_limit_bytes(model, config: EngineConfig, device: torch.device) -> int | None:
    """The KV memory limit (bytes) `config` gives: ``kv_memory_limit_bytes``, a fraction of the device's memory,
    or ``kv_limit_full_sequences`` full-cache rows in the model's dtype (`full_rows_kv_bytes`); None: unlimited."""
    if config.kv_memory_limit_bytes is not None:
        return config.kv_memory_limit_bytes
    if config.kv_memory_fraction is not None:
        return int(config.kv_memory_fraction * device_memory_bytes(device))
    if config.kv_limit_full_sequences is not None:  # full-cache rows in this model's dtype
        return full_rows_kv_bytes(model, config.kv_limit_full_sequences, config.max_length_tokens)
    return None


def full_rows_kv_bytes(model, rows: int, length_tokens: int) -> int:
    """The bytes `rows` full-cache rows of `length_tokens` slots need: ``rows * length_tokens * slot_bytes``, with
    the bytes per slot (all layers, bookkeeping included) of the full cache preallocating `length_tokens` per row,
    measured on `model` as loaded, so in its dtype (a float32 slot holds about twice a bfloat16 one's bytes).

    What `EngineConfig.kv_limit_full_sequences` resolves to when an engine is built (the suites'
    ``kv_memory_limit: {full_sequences: N}``, `length_tokens` their longest prompt + longest output).

    Raises:
        ValueError: `rows` or `length_tokens` below 1 (the message names it).
    """
    check_int("rows", rows, 1)
    check_int("length_tokens", length_tokens, 1)
    return rows * length_tokens * sequence_slot_bytes(model, "full", max_length=length_tokens)


def full_batch_kv_limit_bytes(model, full_batch: int, prompt_tokens: int, new_tokens: int) -> int:
    """The KV memory limit (bytes) that holds exactly `full_batch` full-cache sequences of `prompt_tokens`
    + `new_tokens` tokens: ``full_batch * (P + N) * slot_bytes`` (`full_rows_kv_bytes`), the final slots and the
    bytes per slot (all layers, bookkeeping included) of a full-cache engine preallocating ``P + N`` per row.

    Under this limit a full-cache engine's `max_batch_for(P, N)` is `full_batch` (one byte less gives
    `full_batch - 1`); the benchmarks give every other policy the same limit and let it fit its own batch.

    Raises:
        ValueError: `full_batch`, `prompt_tokens` or `new_tokens` below 1.
    """
    for name, value in (("full_batch", full_batch), ("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        check_int(name, value, 1)
    return full_rows_kv_bytes(model, full_batch, prompt_tokens + new_tokens)
