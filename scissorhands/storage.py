"""Per-slot storage of one budgeted cache layer: preallocated buffers and the KV codecs.

``SlotStore`` holds every per-slot tensor of a layer (keys and values in their stored form, slot
times, policy statistics) as buffers of shape ``(batch_size, num_kv_heads, capacity, *trailing)``
of which the first ``num_slots`` slots are in use. Appending a decode token writes into the
buffer in place (no ``torch.cat`` of the whole cache per step); eviction gathers the kept slots
into fresh buffers of the capacity the layer asks for (the budget, so memory is released).

A codec decides how keys and values are stored: ``DenseKV`` (as computed, the model dtype) or
``scissorhands.quant.Int4KV`` (4-bit, packed). The layer only ever sees ``encode`` / ``decode``.

Bytes of one slot (one token of one KV head in one layer), ``head_dim`` d = 64 (SmolLM2-135M):

| buffer | dense, 16-bit | 4-bit, groups 32/32 (default) | 4-bit, group 64, 8-bit scale + zero | 4-bit, group 64, 8-bit symmetric |
|---|---|---|---|---|
| keys (+ scale and zero) | 128 | 32 + 8 | 32 + 2 | 32 + 1 |
| values (+ scale and zero) | 128 | 32 + 8 | 32 + 2 | 32 + 1 |
| ``slot_time`` (int16 below 32,768 positions, else int32) | 2 | 2 | 2 | 2 |
| Scissorhands' counters (``history_window / count_chunk_steps`` uint8) | 8 | 8 | 8 (c=50) or 2 (c=200) | 2 (c=200) |
| total | 266 | 90 | 78 or 72 | 70 |

At compression ratio 5 a budgeted cache holds ``ceil(L / 5)`` slots where a 16-bit full cache holds
``L`` tokens of 256 bytes, so 4-bit Scissorhands is about ``5 * 256 / slot bytes`` smaller: 14.2x by
default, 18.3x with the 70-byte slot (18.2x at L = 512, where B = 103). The packed 4-bit codes alone
are 64 bytes, so 18x (a slot of at most 71 bytes) leaves 7 bytes for every scale, zero, slot time and
counter; what that costs in perplexity is measured in docs/performance.md (``make bench-quant``).
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
        self.buffers = {
            name: torch.empty(batch_size, num_heads, capacity, *trailing, dtype=dtype, device=device)
            for name, (trailing, dtype) in specs.items()
        }
        self.num_slots = 0

    @property
    def capacity(self) -> int:
        return next(iter(self.buffers.values())).shape[2] if self.buffers else 0

    def view(self, name: str) -> torch.Tensor:
        """``(batch_size, num_kv_heads, num_slots, *trailing)`` view of the used slots."""
        return self.buffers[name][:, :, : self.num_slots]

    def append(self, new: dict[str, torch.Tensor], capacity: int) -> None:
        """Write ``new[name]`` ``(batch_size, num_kv_heads, q, *trailing)`` after the used slots (anything that
        broadcasts to it: a scalar, or size-1 dims); the first entry must have all of its dims (``q`` is read there).

        When the buffers are too small they are reallocated with ``capacity`` (>= num_slots + q) slots.
        """
        q = next(iter(new.values())).shape[2]
        n = self.num_slots
        if n + q > self.capacity:
            self.resize(max(capacity, n + q))
        for name, t in new.items():
            self.buffers[name][:, :, n : n + q] = t
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
                base = torch.arange(b * h, device=idx.device)[:, None] * cap  # (b * h, 1)
                rows = ((base + idx.reshape(b * h, n_keep)).reshape(-1), cap)  # (b * h * k,)
            kept = buf.view(b * h * cap, *trailing).index_select(0, rows[0])  # (b * h * k, *trailing)
            new = buf.new_empty(b, h, max(capacity, n_keep), *trailing)
            new[:, :, :n_keep] = kept.view(b, h, n_keep, *trailing)
            self.buffers[name] = new
        self.num_slots = n_keep

    def prepend(self, n: int, fill: dict[str, int] | None = None) -> None:
        """Insert ``n`` slots before the used ones, zero-filled (or ``fill[name]``)."""
        fill = fill or {}
        for name, buf in self.buffers.items():
            new = buf.new_full((buf.shape[0], buf.shape[1], n + self.num_slots, *buf.shape[3:]), fill.get(name, 0))
            new[:, :, n:] = buf[:, :, : self.num_slots]
            self.buffers[name] = new
        self.num_slots += n

    def retype(self, name: str, dtype: torch.dtype) -> None:
        """Convert buffer ``name`` to ``dtype`` (values kept; used to widen int16 slot times)."""
        self.buffers[name] = self.buffers[name].to(dtype)

    def concat_rows(self, other: "SlotStore") -> None:
        """Append ``other``'s rows (same buffers and ``num_slots``) along the batch dim."""
        if other.num_slots != self.num_slots or other.buffers.keys() != self.buffers.keys():
            raise ValueError("cannot concatenate rows of stores with different slots or buffers")
        self.buffers = {name: torch.cat([self.view(name), other.view(name)], dim=0) for name in self.buffers}

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dim operation (reorder, repeat, select) to the used slots of every buffer."""
        self.buffers = {name: fn(buf[:, :, : self.num_slots]).contiguous() for name, buf in self.buffers.items()}

    def nbytes(self) -> int:
        """Bytes of every buffer, capacity included (the memory the layer really holds)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
