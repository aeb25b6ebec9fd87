"""Prefix caching in the paged engine (`EngineConfig.enable_prefix_caching`), after vLLM's v1 KV cache manager
(vllm/v1/core/kv_cache_manager.py, block_pool.py): full blocks of prompt tokens are kept under a hash of their
tokens and their prefix's hash, reference counted, shared read-only by every row whose prompt starts with the same
tokens, kept after their rows leave and reclaimed least recently used when the pool needs blocks.

* A block's hash chains its prefix: ``h_j = sha256(h_{j-1} + the block's token ids as int64)`` (``h_{-1}`` empty),
  so two prompts share block ``j`` only when their first ``(j + 1) * block_tokens`` tokens are equal; a prompt that
  differs from another one inside a block shares none of that block nor any after it.
* One cached block is one block of every layer (blocks are per layer: `scissorhands.paged`), kept and reclaimed
  together: an entry is the tuple of its layer blocks, ``num_layers`` pool blocks.
* `PrefixCachingPool` is the engine's `BlockPool` with the cache: a block taken by `allocate` has one reference, a
  cached one claimed by a row one more; `release` drops a reference, and a block without one goes back to the free
  stack, or, when it is cached, its entry waits in the idle queue (least recently released first) once none of its
  layer blocks has a reference. `allocate` reclaims idle entries, oldest first, when the free stack runs short.
  Idle entries count as free (`free_blocks`); `blocks_in_use` counts every referenced block once however many rows
  share it, so the engine's KV memory limit counts a shared block once.
* A row fed from the cache starts with its cached blocks in its block table (`seed_rows`): its slot times, counts
  and positions are those its own prefill of these tokens would have left, so its first chunk is the prompt past
  them and every later step runs as it would have. At least one prompt token is always computed (the hit stops at
  ``prompt - 1`` tokens), so the first sampled token has its logits.

The full cache shares every full block of a prefill. A budgeted policy's kept slots depend on the whole sequence's
attention, so a block of its compressed cache is not a function of its prefix; under ``kv_reuse: shared_prefix``
(TensorRT-LLM's TriAttention way) a budgeted row pins its prompt's whole blocks (at most ``floor((prompt - 1) /
block_tokens)``: `scissorhands.cache.BudgetedCache.set_pinned_tokens`), which are never evicted nor written again
(`scissorhands.paged.PagedStore.compact` skips blocks of pinned slots only), so those blocks, and only those, are
cached and shared; what follows them is compressed to the row's budget B (``P + B`` slots a row). `EngineConfig`
refuses the knob with a budgeted policy otherwise.
"""

from __future__ import annotations

import collections
import hashlib
from array import array

import torch

from scissorhands.cache import INT16_MAX_TIME
from scissorhands.paged import BlockPool, PoolExhausted

__all__ = ["PrefixCachingPool", "chain_hashes", "seed_rows"]


def chain_hashes(tokens: list[int], block_tokens: int, known: list[bytes]) -> list[bytes]:
    """The hashes of the full blocks of `tokens` (``len(tokens) // block_tokens`` of them), `known` (the hashes of
    its first blocks, computed before) extended in place and returned: ``sha256(parent + tokens as int64)``."""
    parent = known[-1] if known else b""
    for j in range(len(known), len(tokens) // block_tokens):
        block = array("q", tokens[j * block_tokens : (j + 1) * block_tokens])
        parent = hashlib.sha256(parent + block.tobytes()).digest()
        known.append(parent)
    return known


class PrefixCachingPool(BlockPool):
    """A `BlockPool` that keeps full prompt blocks for reuse (module docstring).

    Args:
        num_blocks, block_tokens: as `BlockPool`.
        num_layers: the layers one cached block spans (a cached entry holds one block of each).

    Raises:
        ValueError: as `BlockPool`; `release` of a block without a reference (a double release) or of block 0.
    """

    def __init__(self, num_blocks: int, block_tokens: int, num_layers: int):
        super().__init__(num_blocks, block_tokens)
        self.num_layers = num_layers
        self.refs: dict[int, int] = {}  # references of every block in use
        self.entries: dict[bytes, tuple[int, ...]] = {}  # block hash -> its block in each layer
        self.hash_of: dict[int, bytes] = {}  # pool block -> the hash of the entry it belongs to
        self.idle: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # no reference; oldest first
        self.reclaimed_blocks = 0  # pool blocks of idle entries handed out again (since `reset_counts`)
        # per layer: (num_kv_heads, (key head_dim, value head_dim), dtype, device) of the rows that filled the cache
        self.layer_shapes: list[tuple] | None = None

    # ------------------------------------------------------------------ counts
    @property
    def free_blocks(self) -> int:
        """Blocks a row can take now: the free stack and every block of an idle entry (reclaimed on demand)."""
        return len(self._free) + self.num_layers * len(self.idle)

    @property
    def blocks_in_use(self) -> int:
        """Blocks some row references, each counted once however many rows share it."""
        return self.usable_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Pool blocks holding a cached entry (referenced or idle)."""
        return self.num_layers * len(self.entries)

    def reset_counts(self) -> None:
        self.reclaimed_blocks = 0

    # ------------------------------------------------------------------ blocks
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, reclaiming idle entries (least recently released first) when the free stack is short.
        Raises ``PoolExhausted`` (nothing taken) when fewer are free, idle entries included."""
        if n > self.free_blocks:
            raise PoolExhausted(f"{n} KV blocks needed, {self.free_blocks} free of {self.usable_blocks}")
        while len(self._free) < n:
            h, _ = self.idle.popitem(last=False)
            blocks = self.entries.pop(h)
            for b in blocks:
                del self.hash_of[b]
            self._free.extend(blocks)
            self.reclaimed_blocks += len(blocks)
        taken = [self._free.pop() for _ in range(n)]
        for b in taken:
            self.refs[b] = 1
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use)
        return taken

    def release(self, blocks: list[int]) -> None:
        """Drop one reference of each of ``blocks``; an unreferenced block is free again, or kept idle when cached.
        The last blocks are released first, so a sequence's deepest cached blocks are reclaimed before its first
        ones (vLLM's order: a prefix is more likely shared than its tail). Raises ``ValueError`` (nothing changed)
        for block 0 or a block without a reference."""
        if any(self.refs.get(b, 0) < 1 for b in blocks):
            raise ValueError(f"cannot release blocks {blocks[:8]}: block 0 or a block no row references")
        for b in reversed(blocks):
            r = self.refs.pop(b) - 1
            if r:
                self.refs[b] = r
                continue
            h = self.hash_of.get(b)
            if h is None:
                self._free.append(b)
            elif not any(x in self.refs for x in self.entries[h]):
                self.idle[h] = None

    # ------------------------------------------------------------------ the cache
    def hit(self, hashes: list[bytes], most_blocks: int) -> int:
        """How many of the first blocks `hashes` names (at most `most_blocks`) are cached, in a row from the first."""
        n = 0
        while n < most_blocks and hashes[n] in self.entries:
            n += 1
        return n

    def referenced(self, h: bytes) -> bool:
        """Whether cached entry `h` is held by a row (claiming it then takes no free block)."""
        return h in self.entries and h not in self.idle

    def claim(self, h: bytes) -> tuple[int, ...]:
        """One more reference to cached entry `h` (out of the idle queue); its block in each layer."""
        blocks = self.entries[h]
        for b in blocks:
            self.refs[b] = self.refs.get(b, 0) + 1
        self.idle.pop(h, None)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use)
        return blocks

    def register(self, h: bytes, blocks: tuple[int, ...]) -> bool:
        """Cache `blocks` (one per layer, referenced, full, computed from the tokens `h` hashes) under `h`; False
        when `h` is cached already (another row computed the same tokens: this copy stays private) or a block is."""
        if h in self.entries or any(b in self.hash_of for b in blocks):
            return False
        self.entries[h] = blocks
        for b in blocks:
            self.hash_of[b] = h
        return True

    def learn_shapes(self, cache) -> None:
        """Record each layer's KV heads, head dims, dtype and device from `cache` (a prefilled paged cache), which
        `seed_rows` builds a cache's layers with."""
        if self.layer_shapes is None:
            self.layer_shapes = [
                (layer.store.buffers["slot_time"].shape[1], layer.kv_dims, layer.dtype, layer.device)
                for layer in cache.layers
            ]


@torch.inference_mode()  # the pool's buffers are inference tensors: written between forward calls
def seed_rows(cache, pool: PrefixCachingPool, rows: list[list[tuple[int, ...]]]) -> None:
    """Start each row ``i`` of `cache` (a fresh paged cache of ``len(rows)`` rows, before its first forward) with
    the cached entries ``rows[i]`` (equal counts, each entry's block per layer, claimed), as if its prefill had fed
    their tokens: block table, slot counts, slot times ``0 .. n - 1`` and the tokens seen (the next position)."""
    b, n_blocks = len(rows), len(rows[0])
    tokens = n_blocks * pool.block_tokens
    for layer_idx, (layer, (heads, (dk, dv), dtype, device)) in enumerate(zip(cache.layers, pool.layer_shapes)):
        layer.lazy_initialization(
            torch.zeros(b, heads, 0, dk, dtype=dtype, device=device),
            torch.zeros(b, heads, 0, dv, dtype=dtype, device=device),
        )
        store = layer.store
        store.blocks = [[entry[layer_idx] for entry in row] for row in rows]
        store.row_slots.fill_(tokens)
        store._slots = [tokens] * b
        store._changed()
        if tokens - 1 > INT16_MAX_TIME and store.buffers["slot_time"].dtype == torch.int16:
            store.retype("slot_time", torch.int32)
        store.dense.resize(tokens)  # whole blocks, as `PagedStore.append` grows it
        store.dense.num_slots = tokens
        for name, buf in store.dense.buffers.items():
            if name == "slot_time":
                buf[:, :, :tokens] = torch.arange(tokens, dtype=buf.dtype, device=buf.device)
            else:  # a policy's statistics start at zero (the full cache keeps none)
                buf[:, :, :tokens] = 0
        layer.held.fill_(tokens)
        layer.tokens_seen = tokens
