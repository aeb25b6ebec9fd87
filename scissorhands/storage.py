"""Per-slot storage of one budgeted cache layer: preallocated buffers and the KV codecs.

``SlotStore`` holds every per-slot tensor of a layer (keys and values in their stored form, slot
times, policy statistics) as buffers of shape ``(batch_size, num_kv_heads, capacity, *trailing)``
of which the first ``num_slots`` slots are in use. Appending a decode token writes into the
buffer in place (no ``torch.cat`` of the whole cache per step); eviction gathers the kept slots
into fresh buffers of the capacity the layer asks for (the budget, so memory is released).

A codec decides how keys and values are stored: ``DenseKV`` (as computed, the model dtype) or
``scissorhands.quant.Int4KV`` (4-bit, packed). The layer only ever sees ``encode`` / ``decode``.

Bytes of one slot (one token of one KV head in one layer), ``head_dim`` d = 64 (SmolLM2-135M):

| buffer | dense, 16-bit | 4-bit, groups 32/32 | 4-bit, keys 32 / values 64 |
|---|---|---|---|
| keys (+ scale and zero, float16) | 128 | 32 + 8 | 32 + 8 |
| values (+ scale and zero, float16) | 128 | 32 + 8 | 32 + 4 |
| ``slot_time`` int32 | 4 | 4 | 4 |
| Scissorhands' counters (``history_window / count_chunk_steps`` = 8 uint8) | 8 | 8 | 8 |
| total | 268 | 92 | 88 |

At compression ratio 5 a budgeted cache holds ``L / 5`` slots where a 16-bit full cache holds
``L`` tokens of 256 bytes, so 4-bit Scissorhands is ``5 * 256 / 92 = 13.9x`` smaller (keys 32 /
values 64: 14.5x). The packed values alone are 64 bytes, so even with free scales the
bookkeeping's 12 bytes cap it at ``5 * 256 / 76 = 16.8x``: 18x needs the slot at <= 71 bytes,
i.e. smaller slot times or counters as well as cheaper scales (measured: docs/performance.md).
"""
from __future__ import annotations

from typing import Callable

import torch

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]


class DenseKV:
    """Keys and values stored as computed: ``(batch_size, num_kv_heads, slots, head_dim)`` model dtype."""

    bits: int | None = None

    def specs(self, key_dim: int, value_dim: int, dtype: torch.dtype) -> Spec:
        return {"keys": ((key_dim,), dtype), "values": ((value_dim,), dtype)}

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys, "values": values}

    def decode(self, store: "SlotStore", dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the used slots (no copy)."""
        return store.view("keys"), store.view("values")


class SlotStore:
    """Named per-slot buffers ``(batch_size, num_kv_heads, capacity, *trailing)``; slot dim is 2."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.num_slots = 0

    def allocate(self, batch_size: int, num_heads: int, specs: Spec, device, capacity: int = 0) -> None:
        self.buffers = {name: torch.empty(batch_size, num_heads, capacity, *trailing, dtype=dtype, device=device)
                        for name, (trailing, dtype) in specs.items()}
        self.num_slots = 0

    @property
    def capacity(self) -> int:
        return next(iter(self.buffers.values())).shape[2] if self.buffers else 0

    def view(self, name: str) -> torch.Tensor:
        """``(batch_size, num_kv_heads, num_slots, *trailing)`` view of the used slots."""
        return self.buffers[name][:, :, :self.num_slots]

    def append(self, new: dict[str, torch.Tensor], capacity: int) -> None:
        """Write ``new[name]`` ``(batch_size, num_kv_heads, q, *trailing)`` after the used slots.

        When the buffers are too small they are reallocated with ``capacity`` (>= num_slots + q) slots.
        """
        q = next(iter(new.values())).shape[2]
        n = self.num_slots
        if n + q > self.capacity:
            self.resize(max(capacity, n + q))
        for name, t in new.items():
            self.buffers[name][:, :, n:n + q] = t
        self.num_slots = n + q

    def resize(self, capacity: int) -> None:
        """Reallocate every buffer with ``capacity`` slots, keeping the used ones."""
        n = self.num_slots
        for name, buf in self.buffers.items():
            new = buf.new_empty(buf.shape[0], buf.shape[1], capacity, *buf.shape[3:])
            new[:, :, :n] = buf[:, :, :n]
            self.buffers[name] = new

    def gather(self, idx: torch.Tensor, capacity: int) -> None:
        """Keep slots ``idx`` ``(batch_size, num_kv_heads, n_keep)`` (in that order) in fresh buffers.

        The new buffers have ``max(capacity, n_keep)`` slots, so a prompt-sized buffer is released.
        """
        b, h, n_keep = idx.shape
        # whole slots are copied as rows of a flat (b * h * capacity, *trailing) view: index_select copies
        # contiguous rows, many times faster than torch.gather with an index expanded over head_dim
        rows = None
        for name, buf in self.buffers.items():
            buf = buf.contiguous()
            cap, trailing = buf.shape[2], buf.shape[3:]
            if rows is None or rows[1] != cap:
                base = torch.arange(b * h, device=idx.device)[:, None] * cap                   # (b * h, 1)
                rows = ((base + idx.reshape(b * h, n_keep)).reshape(-1), cap)                  # (b * h * k,)
            kept = buf.view(b * h * cap, *trailing).index_select(0, rows[0])                   # (b * h * k, *trailing)
            new = buf.new_empty(b, h, max(capacity, n_keep), *trailing)
            new[:, :, :n_keep] = kept.view(b, h, n_keep, *trailing)
            self.buffers[name] = new
        self.num_slots = n_keep

    def prepend(self, n: int, fill: dict[str, int] | None = None) -> None:
        """Insert ``n`` slots before the used ones, zero-filled (or ``fill[name]``)."""
        fill = fill or {}
        for name, buf in self.buffers.items():
            new = buf.new_full((buf.shape[0], buf.shape[1], n + self.num_slots, *buf.shape[3:]), fill.get(name, 0))
            new[:, :, n:] = buf[:, :, :self.num_slots]
            self.buffers[name] = new
        self.num_slots += n

    def concat_rows(self, other: "SlotStore") -> None:
        """Append ``other``'s rows (same buffers and ``num_slots``) along the batch dim."""
        if other.num_slots != self.num_slots or other.buffers.keys() != self.buffers.keys():
            raise ValueError("cannot concatenate rows of stores with different slots or buffers")
        self.buffers = {name: torch.cat([self.view(name), other.view(name)], dim=0) for name in self.buffers}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dim operation (reorder, repeat, select) to the used slots of every buffer."""
        self.buffers = {name: fn(buf[:, :, :self.num_slots]).contiguous() for name, buf in self.buffers.items()}

    def nbytes(self) -> int:
        """Bytes of every buffer, capacity included (the memory the layer really holds)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
