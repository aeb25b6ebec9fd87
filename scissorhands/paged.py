"""Paged KV storage: one pool of fixed-size blocks for every layer, a block table per sequence and layer.

The layout people serve with (vLLM's PagedAttention, SGLang, transformers' continuous batching):
memory is one pool allocated once; a sequence takes blocks of ``block_tokens`` slots as it grows and
returns them when it leaves, so nothing is reserved for tokens not generated yet and no row is padded
to the longest one. ``BlockPool`` is that pool; ``PagedLayer`` is a ``BudgetedLayer`` whose keys and
values live in it (every policy and the 4-bit codec run unchanged on top).

Layout of one ``PagedLayer``:

* the codec's per-slot buffers (keys and values, or their 4-bit codes, scales and zeros) live in the
  pool, ``(num_kv_heads, num_blocks * block_tokens, *trailing)`` each; slot ``s`` of row ``i`` sits at
  pool slot ``blocks[i][s // block_tokens] * block_tokens + s % block_tokens``;
* a row's held tokens are its slots ``0 .. held[i] - 1`` in time order (valid first: no filler slot
  ever takes pool memory); attention reads them through one gather into a dense
  ``(batch_size, num_kv_heads, max_held, *trailing)`` tensor, slots past a row's own count pointing at
  block 0, which the pool keeps zero and never hands out;
* the bookkeeping (slot times, policy statistics: 2-10 bytes a slot against 128-512 of keys and values)
  stays dense per row, ``(batch_size, num_kv_heads, max_held, ...)``, and is counted in ``nbytes``.

A budgeted row grows to ``ceil(B / block_tokens)`` blocks and then refills its slots in place; its
prompt's blocks beyond that are returned when the prompt is compressed. Blocks are per layer (a block
holds one layer's slots), so a budgeted prefill holds the whole prompt in one layer at a time, as the
preallocated layout does. Not supported here: left padding, beam search (row reorder or repeat),
simulation mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import PAD, BudgetedLayer
from .checks import check_int
from .storage import SlotStore, Spec

__all__ = [
    "BlockPool",
    "PagedLayer",
    "PagedRows",
    "PoolExhausted",
    "bookkeeping_slot_bytes",
    "cache_blocks",
    "paged_rows",
    "release_cache",
]

BOOKKEEPING = ("slot_time", "state")  # per-slot buffers kept dense per row (the rest go to the pool)


class PoolExhausted(RuntimeError):
    """The pool has fewer free blocks than a write needs (an engine checks before each step)."""


class BlockPool:
    """Fixed-size KV blocks shared by every layer of one model (and by every cache built on it).

    Args:
        num_blocks: blocks the pool holds (block 0 included, kept zero, never handed out).
        block_tokens: slots per block (per KV head).

    Buffers are allocated at the first layer's first call (``attach``), when the codec's shapes and the
    model dtype are known: ``num_blocks * block_tokens`` slots per KV head, the pool's whole memory.

    Raises:
        ValueError: ``block_tokens`` not a whole number >= 1, or ``num_blocks`` below 2.
    """

    def __init__(self, num_blocks: int, block_tokens: int = 16):
        check_int("block_tokens", block_tokens, 1)
        check_int("num_blocks", num_blocks, 2)
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.buffers: dict[str, torch.Tensor] = {}
        self._free = list(range(num_blocks - 1, 0, -1))  # a stack of free block ids
        # the last validity mask a layer built (PagedStore.validity): the other layers of that step reuse it
        self.validity_cache: tuple | None = None
        self.peak_blocks_in_use = 0

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def usable_blocks(self) -> int:
        """Blocks a sequence can ever get (all but the zero block)."""
        return self.num_blocks - 1

    @property
    def blocks_in_use(self) -> int:
        return self.usable_blocks - len(self._free)

    def attach(self, num_heads: int, specs: Spec, device) -> None:
        """Allocate the buffers for ``specs`` (name -> (trailing dims, dtype)) once; later calls must agree."""
        if self.buffers:
            got = {n: (tuple(b.shape[2:]), b.dtype) for n, b in self.buffers.items()}
            want = {n: (tuple(t), d) for n, (t, d) in specs.items()}
            if got != want or next(iter(self.buffers.values())).shape[0] != num_heads:
                raise ValueError(f"a block pool serves one model and one codec: buffers {got}, asked for {want}")
            return
        slots = self.num_blocks * self.block_tokens
        self.buffers = {
            # zeros: the pool is committed memory from the start, and a stale slot read past a row's count (in
            # its last block, masked) is always finite, never an uninitialized NaN that 0 * NaN would spread
            name: torch.zeros(num_heads, slots, *trailing, dtype=dtype, device=device)
            for name, (trailing, dtype) in specs.items()
        }

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks. Raises ``PoolExhausted`` (nothing taken) when fewer are free."""
        if n > len(self._free):
            raise PoolExhausted(f"{n} KV blocks needed, {len(self._free)} free of {self.usable_blocks}")
        taken = [self._free.pop() for _ in range(n)]
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use)
        return taken

    def release(self, blocks: list[int]) -> None:
        """Return ``blocks`` to the pool. Raises ``ValueError`` for block 0 or more blocks than are in use (a
        double release)."""
        if 0 in blocks or len(blocks) > self.blocks_in_use:
            raise ValueError(
                f"cannot release blocks {blocks[:8]}: block 0 or more than the {self.blocks_in_use} in use"
            )
        self._free.extend(sorted(blocks, reverse=True))

    def block_nbytes(self) -> int:
        """Bytes of one block (every pool buffer, all KV heads); 0 before ``attach``."""
        return sum(b[:, : self.block_tokens].numel() * b.element_size() for b in self.buffers.values())

    def nbytes(self) -> int:
        """Bytes the pool allocated (its whole memory, in use or not)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class PagedStore:
    """The ``SlotStore`` interface of one ``PagedLayer``: pool-backed codec buffers, dense bookkeeping.

    ``row_slots`` ``(batch_size,)`` int64: slots each row holds (its tokens, valid first);
    ``num_slots`` = the largest. ``blocks[i]``: the pool blocks of row ``i``, in slot order.
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.dense = SlotStore()
        self.blocks: list[list[int]] = []
        self.row_slots: torch.Tensor | None = None
        self._slots: list[int] | None = None  # row_slots on the host, None when stale (read back on use)
        self._table_t: torch.Tensor | None = None  # (b, max_blocks) block ids, rebuilt after blocks change
        self._index: torch.Tensor | None = None  # (b, h, max_blocks) block index for reads, likewise

    # ------------------------------------------------------------------ shape
    @property
    def num_slots(self) -> int:
        return self.dense.num_slots

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The dense bookkeeping buffers (slot times are read and retyped through it)."""
        return self.dense.buffers

    def allocate(self, batch_size: int, num_heads: int, specs: Spec, device, capacity: int = 0) -> None:
        self.pool.attach(num_heads, {n: s for n, s in specs.items() if n not in BOOKKEEPING}, device)
        self.dense.allocate(batch_size, num_heads, {n: s for n, s in specs.items() if n in BOOKKEEPING}, device)
        self.blocks = [[] for _ in range(batch_size)]
        self.row_slots = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self._slots = [0] * batch_size
        self._changed()

    # ------------------------------------------------------------------ addressing
    def _table(self) -> torch.Tensor:
        """``(batch_size, max_blocks)`` int64 block ids, 0 (the zero block) past a row's own."""
        if self._table_t is None:
            width = max((len(b) for b in self.blocks), default=0)
            self._table_t = torch.tensor(
                [b + [0] * (width - len(b)) for b in self.blocks], dtype=torch.int64, device=self.row_slots.device
            ).view(len(self.blocks), width)
        return self._table_t

    def _changed(self) -> None:
        """Blocks or rows changed: the cached table and read index are stale."""
        self._table_t = self._index = None

    def slots_list(self) -> list[int]:
        """``row_slots`` as a host list (kept beside the tensor: a decode step reads it without a device sync)."""
        if self._slots is None:
            self._slots = self.row_slots.tolist()
        return self._slots

    def validity(self) -> torch.Tensor | None:
        """``(batch_size, 1, 1, num_slots)`` bool, True for the slots a row holds (valid first: slot ``s`` of row
        ``i`` is a token iff ``s < row_slots[i]``), or None when every row holds every slot. Built once per step
        for every layer that holds the same rows (shared through the pool: all layers of a batch hold the same
        slots per row)."""
        slots, n = self.slots_list(), self.num_slots
        if min(slots, default=n) >= n:
            return None
        key = (n, tuple(slots), torch.is_inference_mode_enabled())
        cached = self.pool.validity_cache
        if cached is None or cached[0] != key:
            mask = torch.arange(n, device=self.row_slots.device)[None, :] < self.row_slots[:, None]  # (b, S)
            cached = self.pool.validity_cache = (key, mask[:, None, None, :])
        return cached[1]

    def _addresses(self, slots: torch.Tensor) -> torch.Tensor:
        """Pool slot of each row's slot ``slots`` ``(batch_size, n)``; slots past a row's count read block 0."""
        bt = self.pool.block_tokens
        table = self._table()
        if table.shape[1] == 0:
            return torch.zeros_like(slots)
        held = slots < self.row_slots[:, None]
        block = table.gather(1, (slots // bt).clamp(max=table.shape[1] - 1))
        return torch.where(held, block * bt + slots % bt, torch.zeros_like(slots))

    def _flat(self, addresses: torch.Tensor) -> torch.Tensor:
        """``(b, n)`` pool slots -> ``(b, h, n)`` indices into a buffer viewed as ``(h * pool_slots, ...)``."""
        h, slots = next(iter(self.pool.buffers.values())).shape[:2]
        return addresses[:, None, :] + torch.arange(h, device=addresses.device)[None, :, None] * slots

    def _read_index(self) -> torch.Tensor:
        """``(b, h, max_blocks)``: each row's blocks as rows of a buffer viewed ``(h * num_blocks, block_tokens, ...)``."""
        if self._index is None:
            table = self._table()
            h = next(iter(self.pool.buffers.values())).shape[0]
            heads = torch.arange(h, device=table.device)[None, :, None] * self.pool.num_blocks
            self._index = table[:, None, :] + heads
        return self._index

    def view(self, name: str) -> torch.Tensor:
        """``(batch_size, num_kv_heads, num_slots, *trailing)``: a view for bookkeeping, a gathered copy of
        the pool for keys and values. Whole blocks are copied (a few KiB each, many times faster than slot by
        slot); slots past a row's count read what its last block or the zero block holds, always masked."""
        if name in BOOKKEEPING:
            return self.dense.view(name)
        buf = self.pool.buffers[name]
        idx = self._read_index()
        b, h, nb = idx.shape
        bt, trailing = self.pool.block_tokens, buf.shape[2:]
        blocks = buf.view(h * self.pool.num_blocks, bt, *trailing).index_select(0, idx.reshape(-1))
        return blocks.view(b, h, nb * bt, *trailing)[:, :, : self.num_slots]

    # ------------------------------------------------------------------ writes
    def _grow(self, slots_needed: list[int]) -> None:
        """Give each row the blocks ``slots_needed`` (one count per row) slots take (all or nothing)."""
        bt = self.pool.block_tokens
        want = [max(0, -(-n // bt) - len(b)) for n, b in zip(slots_needed, self.blocks)]
        if sum(want):
            taken = self.pool.allocate(sum(want))
            for b, k in zip(self.blocks, want):
                b.extend(taken[:k])
                del taken[:k]
            self._changed()

    @torch.inference_mode()  # the pool is written between forward calls too (merge, leave, compact)
    def append(self, new: dict[str, torch.Tensor], capacity: int) -> None:
        """Write ``new[name]`` ``(batch_size, num_kv_heads, q, *trailing)`` after each row's own slots
        (bookkeeping entries may broadcast); blocks are taken as rows cross a block boundary, and the dense
        bookkeeping grows a whole block of slots at a time (``capacity``, the preallocated layout's, is not used:
        the bookkeeping a batch holds follows its widest row, not a maximum length).

        Raises:
            PoolExhausted: the pool lacks the blocks (nothing written).
        """
        q = next(iter(new.values())).shape[2]
        b = len(self.blocks)
        slots = self.slots_list()
        self._grow([n + q for n in slots])
        bt = self.pool.block_tokens
        if q == 1:  # a decode step: each row's pool slot from its host-side count and block list, one small tensor
            h, pool_slots = next(iter(self.pool.buffers.values())).shape[:2]
            addr = [blocks[n // bt] * bt + n % bt for blocks, n in zip(self.blocks, slots)]
            flat = torch.tensor([a + k * pool_slots for a in addr for k in range(h)], device=self.row_slots.device)
        else:
            pos = self.row_slots[:, None] + torch.arange(q, device=self.row_slots.device)  # (b, q)
            flat = self._flat(self._addresses_for_write(pos)).reshape(-1)
        for name, t in new.items():
            if name in BOOKKEEPING:
                continue
            buf = self.pool.buffers[name]
            buf.view(-1, *buf.shape[2:]).index_copy_(0, flat, t.reshape(-1, *buf.shape[2:]).to(buf.dtype))
        start, widest = min(slots, default=0), max(slots, default=0)
        uniform = start == widest
        old_slots, n_after = self.dense.num_slots, widest + q
        if n_after > self.dense.capacity:
            self.dense.resize(-(-n_after // bt) * bt)
        dense_new = {n: t for n, t in new.items() if n in BOOKKEEPING}
        if uniform:  # every row at the same slot (a fresh prefill, budgeted rows at their budget)
            for name, t in dense_new.items():
                self.dense.buffers[name][:, :, start : start + q] = t
        else:
            pos = self.row_slots[:, None] + torch.arange(q, device=self.row_slots.device)  # (b, q)
            rows = torch.arange(b, device=pos.device)[:, None]  # (b, 1) with pos (b, q): dims (b, q, h, ...)
            for name, t in dense_new.items():
                buf = self.dense.buffers[name]
                full = torch.as_tensor(t, dtype=buf.dtype, device=buf.device).expand(b, buf.shape[1], q, *buf.shape[3:])
                buf[rows, :, pos] = full.movedim(2, 1)
        self.dense.num_slots = n_after
        self.row_slots += q
        self._slots = [n + q for n in slots]
        if not uniform and n_after > old_slots:
            # slots below old_slots past a row's count are padding already; the new columns are not
            self._pad_tail(old_slots)

    def _addresses_for_write(self, pos: torch.Tensor) -> torch.Tensor:
        bt = self.pool.block_tokens
        table = self._table()
        return table.gather(1, pos // bt) * bt + pos % bt

    def _pad_tail(self, first: int = 0) -> None:
        """Mark the dense slots from ``first`` on past each row's count as padding (never attended, never a token)."""
        st = self.dense.view("slot_time")[:, :, first:]
        if min(self.slots_list(), default=0) >= self.dense.num_slots:
            return
        past = torch.arange(first, first + st.shape[-1], device=st.device)[None, :] >= self.row_slots[:, None]  # (b, S)
        st.masked_fill_(past[:, None, :], PAD)

    @torch.inference_mode()  # the pool is written between forward calls too (merge, leave, compact)
    def compact(
        self, idx: torch.Tensor, row_slots: torch.Tensor, keep_slots, pinned: torch.Tensor | None = None
    ) -> None:
        """Keep slots ``idx`` ``(batch_size, num_kv_heads, n_keep)`` (each row's own first, in order) as the
        rows' slots ``0 .. row_slots[i] - 1``; a row keeps blocks for ``max(row_slots[i], keep_slots)``
        slots (at most what it has; ``keep_slots`` an int or a ``(batch_size,)`` tensor: its budget) and
        returns the rest. ``pinned`` ``(batch_size,)`` int64 (or None): each row's first slots that stay in place
        (``BudgetedCache.set_pinned_tokens``); the row's blocks that hold only such slots are neither read nor
        written, so a block shared read-only (a prefix cache's) stays untouched."""
        b, h, n_keep = idx.shape
        kept = torch.arange(n_keep, device=idx.device)[None, :] < row_slots[:, None]  # (b, n_keep)
        if pinned is not None:  # whole blocks of pinned slots (in place: never evicted, the oldest) are not written
            pos_ = torch.arange(n_keep, device=idx.device)
            frozen = pinned // self.pool.block_tokens * self.pool.block_tokens
            kept &= ~((pos_[None, :] < frozen[:, None]) & (idx == pos_).all(1))  # a slot that moved still moves
        src_slots = self._addresses_all(idx)  # (b, h, n_keep) pool slots of the kept slots
        self.row_slots = row_slots.clone()
        self._slots = None
        bt = self.pool.block_tokens
        keep = keep_slots.tolist() if isinstance(keep_slots, torch.Tensor) else [keep_slots] * b
        for i, blocks in enumerate(self.blocks):  # return blocks a row no longer needs
            need = min(len(blocks), max(-(-int(row_slots[i]) // bt), -(-keep[i] // bt)))
            if need < len(blocks):
                self.pool.release(blocks[need:])
                del blocks[need:]
                self._changed()
        pos = torch.arange(n_keep, device=idx.device).expand(b, n_keep)
        dst = torch.where(kept, self._addresses_for_write(pos.clamp(max=max(0, self._table().shape[1] * bt - 1))), 0)
        pool_slots = next(iter(self.pool.buffers.values())).shape[1]
        heads = torch.arange(h, device=idx.device)[None, :, None] * pool_slots
        src = torch.where(kept[:, None, :], src_slots, 0) + heads
        dst = dst[:, None, :] + heads
        if pinned is not None:  # only the slots that move: a frozen block's address is neither read nor written
            moving = kept[:, None, :].expand(b, h, n_keep)
            src, dst = src[moving], dst[moving]
        for buf in self.pool.buffers.values():
            flat = buf.view(-1, *buf.shape[2:])
            moved = flat.index_select(0, src.reshape(-1))  # read every kept slot before any write
            flat.index_copy_(0, dst.reshape(-1), moved)
        self.dense.gather(idx, -(-n_keep // bt) * bt)  # whole blocks of what is kept, as `append` grows it
        self._pad_tail()

    def _addresses_all(self, idx: torch.Tensor) -> torch.Tensor:
        """Pool slots ``(b, h, n)`` of row-slots ``idx`` ``(b, h, n)`` (slots past a row's count: block 0)."""
        b, h, n = idx.shape
        return self._addresses(idx.reshape(b, h * n)).view(b, h, n)

    def trim(self) -> None:
        """Drop dense slots no row holds (after rows left)."""
        n = max(self.slots_list(), default=0)
        if n < self.dense.num_slots:
            self.dense.num_slots = n

    # ------------------------------------------------------------------ rows
    @torch.inference_mode()  # the pool is written between forward calls too (merge, leave, compact)
    def concat_rows(self, other: "PagedStore") -> None:
        """Append ``other``'s rows (same pool); dense bookkeeping is padded on the right to the longer side."""
        if other.pool is not self.pool:
            raise ValueError("cannot merge rows of caches on different block pools")
        n = max(self.num_slots, other.num_slots)
        for store in (self, other):
            if store.dense.capacity < n:
                store.dense.resize(n)
            for name, buf in store.dense.buffers.items():
                buf[:, :, store.num_slots : n] = PAD if name == "slot_time" else 0
            store.dense.num_slots = n
        self.dense.concat_rows(other.dense)
        self.blocks += other.blocks
        other.blocks = []
        self.row_slots = torch.cat([self.row_slots, other.row_slots])
        self._slots = None
        self._changed()

    @torch.inference_mode()  # the pool is written between forward calls too (merge, leave, compact)
    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (indices, in order); the others' blocks return to the pool."""
        kept = set(keep.tolist())
        for i, blocks in enumerate(self.blocks):
            if i not in kept:
                self.pool.release(blocks)
        self.blocks = [self.blocks[i] for i in keep.tolist()]
        self.dense.map_batch(lambda t: t.index_select(0, keep))
        self.row_slots = self.row_slots.index_select(0, keep)
        self._slots = None
        self.trim()
        self._changed()

    def release(self) -> None:
        """Return every block to the pool (the cache is dropped)."""
        for blocks in self.blocks:
            self.pool.release(blocks)
        self.blocks = [[] for _ in self.blocks]
        self._changed()

    def retype(self, name: str, dtype: torch.dtype) -> None:
        self.dense.retype(name, dtype)

    def gather(self, idx: torch.Tensor, capacity: int) -> None:
        raise NotImplementedError("a paged layer compacts with PagedStore.compact (valid slots first)")

    def prepend(self, n: int, fill=None) -> None:
        raise NotImplementedError("a paged layer holds no filler slots (rows of different lengths need none)")

    def map_batch(self, fn) -> None:
        raise NotImplementedError("a paged layer cannot reorder or repeat rows (beam search): blocks are not shared")

    # ------------------------------------------------------------------ bytes
    def blocks_in_use(self) -> int:
        return sum(len(b) for b in self.blocks)

    def nbytes(self) -> int:
        """Bytes of the blocks this layer's rows hold plus its dense bookkeeping buffers."""
        return self.blocks_in_use() * self.pool.block_nbytes() + self.dense.nbytes()


class PagedLayer(BudgetedLayer):
    """A ``BudgetedLayer`` whose keys and values live in a shared ``BlockPool`` (layout: module docstring).

    Args:
        pool: the block pool (one per model, shared by every layer and every cache built on it);
        the rest as ``BudgetedLayer``.

    Raises:
        ValueError: ``simulate=True`` (simulation keeps evicted slots and saves no memory: use the
            preallocated layout), or a padded batch.
    """

    def __init__(self, *args, pool: BlockPool, **kwargs):
        super().__init__(*args, **kwargs)
        if self.simulate:
            raise ValueError("simulate=True needs kv_layout 'preallocated' (a paged layer removes what it evicts)")
        self.pool = pool
        self.store = PagedStore(pool)

    def attend(self, query, padding_mask, scaling, query_chunk=None):
        if padding_mask is not None and not bool(padding_mask[:, -self._pending_q :].all()):
            raise ValueError("a paged KV layer takes no padded batch: prefill prompts of equal length together")
        return super().attend(query, None, scaling, query_chunk)

    def _all_slots_valid(self, st: torch.Tensor) -> bool:
        # valid first (nothing padded, evicted slots removed at once): every row full iff none is shorter
        return self.store.validity() is None

    def _valid_slots(self, st: torch.Tensor) -> torch.Tensor:
        # slot s of row i is a token iff s < its count: one mask per step for every layer (PagedStore.validity)
        return self.store.validity().expand(-1, st.shape[1], -1, -1)

    def _compact(self) -> None:
        """Move each row's valid slots first (time order kept), return blocks past what it keeps."""
        valid = self.slot_time >= 0  # (b, h, S)
        n = valid.shape[-1]
        n_keep = int(valid.sum(-1).max()) if n else 0
        first = torch.arange(n, device=self.device)[None, None, :] < self.held[:, None, None]
        # already valid first with nothing evicted past a row's tokens (rows left): no data moves; an evicted tail
        # slot goes through compact, so a row's count is its tokens (PagedStore.validity reads it so)
        if bool((valid == first).all()) and torch.equal(self.held, self.store.row_slots):
            self.store.trim()
            return
        key = (~valid).to(torch.int64) * n + torch.arange(n, device=self.device)  # valid first, in time order
        idx = key.sort(dim=-1).indices[..., :n_keep]  # (b, h, n_keep)
        self.store.compact(idx, self.held.clone(), self.kept_limit() if self._compacts else 0, self.row_pinned)

    def append_rows(self, other: "PagedLayer") -> None:
        for layer, peer in ((self, other), (other, self)):  # widen int16 slot times to match
            if layer.store.buffers["slot_time"].dtype.itemsize < peer.store.buffers["slot_time"].dtype.itemsize:
                layer.store.retype("slot_time", peer.store.buffers["slot_time"].dtype)
        self.store.concat_rows(other.store)
        self._maybe_masked = True  # rows of different lengths: padding past the shorter ones
        self._cat_rows(other)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self.store.select_rows(indices)
        self._map_rows(lambda t: t[indices])

    def release(self) -> None:
        """Return this layer's blocks to the pool."""
        if self.is_initialized:
            self.store.release()

    def reset(self) -> None:
        self.release()
        super().reset()
        self.store = PagedStore(self.pool)

    def slot_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        dense = sum(buf[0, :, :1].numel() * buf.element_size() for buf in self.store.buffers.values())
        return dense + self.pool.block_nbytes() // self.pool.block_tokens

    def bookkeeping_nbytes(self) -> int:
        return self.store.dense.nbytes() if self.is_initialized else 0

    def blocks_in_use(self) -> int:
        return self.store.blocks_in_use() if self.is_initialized else 0


def cache_blocks(cache) -> int:
    """Blocks the rows of ``cache`` hold, summed over layers (0 for a preallocated cache or None)."""
    if cache is None:
        return 0
    return sum(layer.blocks_in_use() for layer in cache.layers if isinstance(layer, PagedLayer))


@dataclass(frozen=True)
class PagedRows:
    """How the rows of a paged cache sit in its pool, as one layer holds them (every layer of a batch holds the
    same slots per row): ``row_slots[i]`` slots and ``row_blocks[i]`` blocks of row ``i``, and the slots per row
    of the dense bookkeeping (``bookkeeping_slots``, the widest row's, padding included)."""

    row_slots: list[int]
    row_blocks: list[int]
    bookkeeping_slots: int


def paged_rows(cache) -> PagedRows:
    """The rows of ``cache`` (a cache of ``PagedLayer`` s, or None: no rows) as its first layer holds them: what a
    scheduler counts blocks by, without reading the store."""
    if cache is None:
        return PagedRows([], [], 0)
    store = cache.layers[0].store
    return PagedRows(store.row_slots.tolist(), [len(b) for b in store.blocks], store.dense.capacity)


def bookkeeping_slot_bytes(cache) -> int:
    """Bytes of one row's bookkeeping slot (slot times, policy statistics: the buffers a paged layer keeps dense),
    summed over the layers of ``cache`` that hold buffers (0 for None). On the paged layout a batch of ``b`` rows
    holds ``b * width`` of them, ``width`` its widest row's slots (padding included)."""
    if cache is None:
        return 0
    return sum(
        buf[0, :, :1].numel() * buf.element_size()
        for layer in cache.layers
        if getattr(layer, "is_initialized", False)
        for name, buf in layer.store.buffers.items()
        if name in BOOKKEEPING
    )


def release_cache(cache) -> None:
    """Return every block ``cache`` holds to its pool (a no-op for a preallocated cache or None)."""
    if cache is not None:
        for layer in cache.layers:
            if isinstance(layer, PagedLayer):
                layer.release()
