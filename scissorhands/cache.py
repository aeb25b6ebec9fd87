"""A budgeted KV cache for Hugging Face transformers, driven by an eviction policy.

Integration goes only through transformers' official seams: ``BudgetedLayer`` is a
``CacheLayerMixin`` composed into a ``Cache`` (``BudgetedCache``), and the attention function in
``scissorhands.attention`` (registered with ``AttentionInterface`` and ``AttentionMaskInterface``)
computes the attention probabilities a policy needs and hands them to the layer.

Storage layout of one layer (stated once, used everywhere):

* ``keys``, ``values``: ``(batch_size, num_kv_heads, num_slots, head_dim)``, keys after RoPE, never
  re-rotated. Kept slots are in time order (oldest first) in every row and head.
* ``slot_time``: ``(batch_size, num_kv_heads, num_slots)`` int32, the token index of each slot
  (tokens seen before it, padding included); ``-1`` marks a padding slot (never a token, always
  masked), ``-2`` a slot evicted in simulation mode.
* ``state``: ``(batch_size, num_kv_heads, num_slots, policy.state_width)`` per-slot policy statistics.
* ``row_time``: ``None`` (every row shares the clock ``tokens_seen``), or ``(batch_size,)`` int64, the
  token index of each row's next token (per-row clocks, set by ``scissorhands.batching`` when rows that
  started at different times share one batch). Slot times, query times and the times a policy sees are
  then each row's own, exactly as if the row ran alone.

When evictions happen (Algorithm 1 of Scissorhands, SCISSORHANDS.md):

* a single new token (decoding) of a sequence that already holds ``budget_tokens`` tokens first
  drops ``drop_tokens`` of them, then is appended, so the layer never holds more than the budget;
* a call of several tokens (a prompt, a chunk of one) is appended whole, attended, and then
  compressed to ``budget_tokens`` with the statistics of its own queries. Between calls every layer
  holds at most ``budget_tokens`` slots per head; during such a call one layer at a time holds
  ``budget_tokens + q_len``.

The budget is per sequence and counts tokens only: in a left-padded batch each row evicts when
*its own* token count reaches the budget, exactly as it would alone. Padding and evicted slots are
masked; the tensor keeps as many slots as the fullest row needs (shorter rows hold masked filler
slots, never counted as tokens).

Simulation mode (``simulate=True``) runs the same policy but masks evicted slots instead of
removing them: it saves no memory and exists to prove that real eviction computes the same logits.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .policies.base import Policy

PAD = -1
EVICTED = -2

# The layer whose update() ran last in this thread; the attention function of the same layer
# (called right after update in the same forward) picks it up. Thread-local so replicas and
# tests running models in several threads never mix caches.
_ACTIVE = threading.local()


def active_layer(layer_idx: int) -> "BudgetedLayer | None":
    """The budgeted layer waiting for the attention of ``layer_idx`` in this thread, if any."""
    layer = getattr(_ACTIVE, "layer", None)
    if layer is not None and layer.layer_idx == layer_idx and layer._pending_q is not None:
        return layer
    return None


@dataclass
class Budget:
    """The budget shared by all layers of one cache, resolved once.

    ``budget_tokens`` (absolute) wins; else ``ceil(L / compression_ratio)`` where ``L`` is
    ``max_length`` when known (prompt + max_new_tokens), else the length of the first call.
    """

    policy: Policy
    budget_tokens: int | None = None
    compression_ratio: float | None = None
    max_length: int | None = None
    tokens: int | None = None
    recent_window: int | None = None
    drop_tokens: int | None = None

    def resolve(self, first_call_length: int) -> int:
        if self.tokens is None:
            if self.budget_tokens is not None:
                b = self.budget_tokens
            else:
                length = self.max_length if self.max_length is not None else first_call_length
                b = max(1, math.ceil(length / self.compression_ratio))
            self.recent_window, self.drop_tokens = self.policy.resolve(b)
            self.tokens = b
        return self.tokens


class BudgetedLayer(CacheLayerMixin):
    """One attention layer's budgeted KV cache (layout in the module docstring)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, layer_idx: int, policy: Policy, budget: Budget, simulate: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.policy = policy
        self.budget = budget
        self.simulate = simulate
        self.slot_time: torch.Tensor | None = None
        self.state: torch.Tensor | None = None
        self.tokens_seen = 0          # tokens this layer has seen (padding included)
        self.held: torch.Tensor | None = None   # (batch_size,) int64 tokens held per sequence
        self.row_time: torch.Tensor | None = None  # (batch_size,) int64 per-row clocks, or None (shared)
        self.evicted_tokens = 0       # tokens evicted so far, summed over sequences
        self._pending_q: int | None = None

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = key_states.new_empty(b, h, 0, d)
        self.values = value_states.new_empty(b, h, 0, value_states.shape[-1])
        self.slot_time = torch.empty(b, h, 0, dtype=torch.int32, device=self.device)
        width = self.policy.state_width
        self.state = torch.zeros(b, h, 0, width, dtype=self.policy.state_dtype, device=self.device) if width else None
        self.held = torch.zeros(b, dtype=torch.int64, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``(batch_size, num_kv_heads, q_len, head_dim)`` new keys/values; return all slots.

        Raises:
            RuntimeError: the previous call's attention never reached this layer although the policy
                evicts (the model does not run ``attn_implementation="scissorhands"``, so evicted slots
                would be attended with a wrong mask and attention-based scores would stay zero).
        """
        if self._pending_q is not None and self.policy.evicts:
            raise RuntimeError(
                f"policy {self.policy.name!r} needs the 'scissorhands' attention function, but layer "
                f"{self.layer_idx} never reached it: the model runs another attention implementation. Use "
                f"model.set_attn_implementation('scissorhands') (make_cache(policy, model) does it for you)."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if self.policy.evicts:
            budget = self.budget.resolve(self.tokens_seen + q)
            if q == 1:                                                  # Algorithm 1: full -> drop m, then append
                self.evict(torch.where(self.held >= budget, self.budget.drop_tokens, 0))
        b, h = key_states.shape[:2]
        times = torch.arange(q, dtype=torch.int32, device=self.device)
        if self.row_time is None:                                        # (1, 1, q): one shared clock
            times = (times + self.tokens_seen)[None, None, :]
        else:                                                            # (b, 1, q): each row's clock
            times = (times + self.row_time[:, None].to(torch.int32))[:, None, :]
            self.row_time += q
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.slot_time = torch.cat([self.slot_time, times.expand(b, h, q)], dim=-1)
        if self.state is not None:                                       # new slots start from zero
            self.state = torch.cat([self.state, self.state.new_zeros(b, h, q, self.state.shape[-1])], dim=2)
        self.tokens_seen += q
        self.held += q
        self._pending_q = q
        _ACTIVE.layer = self
        return self.keys, self.values

    # ------------------------------------------------------------------ attention
    def attend(self, query: torch.Tensor, padding_mask: torch.Tensor | None, scaling: float,
               query_chunk: int = 256) -> torch.Tensor:
        """Attention of this call's queries over the kept slots, then observe and compress.

        Args:
            query: ``(batch_size, num_heads, q_len, head_dim)``.
            padding_mask: ``(batch_size, tokens_seen)`` bool (True = real token) or None.
            scaling: softmax scale.
        Returns:
            ``(batch_size, q_len, num_heads, head_dim)`` attention output; padded queries get zeros.
        """
        q_len, self._pending_q = self._pending_q, None
        b, hq, _, d = query.shape
        hkv = self.keys.shape[1]
        group = hq // hkv
        if padding_mask is not None and padding_mask.shape[-1] >= q_len:
            new_valid = padding_mask[:, -q_len:].to(torch.bool)                          # (b, q)
            if not bool(new_valid.all()):
                tail = self.slot_time[:, :, -q_len:]
                self.slot_time[:, :, -q_len:] = torch.where(new_valid[:, None, :], tail, tail.new_full((), PAD))
                self.held -= (~new_valid).sum(-1)
        qt = torch.arange(-q_len, 0, device=self.device)                                  # (q,)
        # (1 or b, q) query times: the shared clock, or each row's own clock
        qt = (qt + self.tokens_seen)[None] if self.row_time is None else qt + self.row_time[:, None]
        out = query.new_empty(b, hq, q_len, d)
        for s in range(0, q_len, query_chunk):
            e = min(q_len, s + query_chunk)
            st = self.slot_time[:, :, None, :]                                          # (b, hkv, 1, S)
            visible = (st >= 0) & (st <= qt[:, None, s:e, None])                         # (b, hkv, q_c, S)
            out[:, :, s:e] = self._attend_chunk(query[:, :, s:e], visible, scaling, qt[:, s:e], group)
        if self.policy.evicts:                                                       # prompt / chunk: compress to B
            self.evict((self.held - self.budget.tokens).clamp(min=0))
        return out.transpose(1, 2).contiguous()

    def _attend_chunk(self, query, visible, scaling, qt, group):
        b, hq, qc, d = query.shape
        hkv, n = self.keys.shape[1], self.keys.shape[2]
        if not self.policy.needs_attention:
            mask = visible.repeat_interleave(group, dim=1)                               # (b, hq, q_c, S)
            o = torch.nn.functional.scaled_dot_product_attention(query, self.keys.repeat_interleave(group, 1),
                                                                 self.values.repeat_interleave(group, 1),
                                                                 attn_mask=mask, scale=scaling)
            return torch.where(mask.any(-1, keepdim=True), o, o.new_zeros(()))
        qg = query.view(b, hkv, group, qc, d)                                            # (b, hkv, g, q_c, d)
        scores = torch.matmul(qg, self.keys[:, :, None].transpose(-1, -2)).float() * scaling  # (b, hkv, g, q_c, S)
        scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(visible[:, :, None].any(-1, keepdim=True), probs, probs.new_zeros(()))  # padded queries
        o = torch.matmul(probs.to(self.values.dtype), self.values[:, :, None])          # (b, hkv, g, q_c, d)
        self._observe(probs.mean(2), visible, qt)                                       # GQA: average the group
        return o.view(b, hq, qc, d)

    def _observe(self, probs: torch.Tensor, visible: torch.Tensor, qt: torch.Tensor) -> None:
        """Hand the policy this chunk's probabilities; ``qt`` is ``(1 or batch_size, q_c)`` query times.

        Rows on different clocks (per-row clocks) are observed in groups of rows sharing a clock, so a
        policy always sees the ``(q_c,)`` query times of the rows it updates.
        """
        if qt.shape[0] == 1 or bool((qt[:, 0] == qt[0, 0]).all()):
            self.policy.observe(self.state, probs, visible, qt[0])
            return
        starts = qt[:, 0]
        for t in torch.unique(starts).tolist():
            rows = (starts == t).nonzero().squeeze(1)                                   # (n_rows,)
            sub = self.state[rows]                                                      # (n_rows, hkv, S, w) copy
            self.policy.observe(sub, probs[rows], visible[rows], qt[rows[0]])
            self.state[rows] = sub

    # ------------------------------------------------------------------ eviction
    def evict(self, n_drop: torch.Tensor) -> None:
        """Drop ``n_drop[i]`` tokens of sequence ``i`` in every KV head (Algorithm 2).

        The policy's keep score orders the candidates; the newest ``recent_window`` tokens of each
        sequence are protected; ties drop the older token (stable sort over slots in time order).
        Dropped slots are masked; then, unless simulating, every slot that no row needs is removed
        and the survivors stay in time order.

        Args:
            n_drop: ``(batch_size,)`` int64, tokens to drop per sequence.
        """
        if not bool((n_drop > 0).any()):
            return
        valid = self.slot_time >= 0                                                     # (b, h, S)
        score = self.policy.keep_score(self.state, self.slot_time).masked_fill(~valid, float("inf"))
        r = self.budget.recent_window
        if r:
            newer = valid.flip(-1).cumsum(-1).flip(-1)                                  # tokens at or after the slot
            score = score.masked_fill(valid & (newer <= r), float("inf"))
        order = torch.sort(score, dim=-1, stable=True).indices                          # lowest keep score first
        positions = torch.arange(order.shape[-1], device=self.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, positions)                   # rank of each slot
        self.slot_time = self.slot_time.masked_fill(rank < n_drop[:, None, None], EVICTED)
        self.held -= n_drop
        self.evicted_tokens += int(n_drop.sum())
        if not self.simulate:
            self._compact()

    def _compact(self) -> None:
        """Physically remove the masked slots no row needs; survivors keep their time order."""
        valid = self.slot_time >= 0
        n = valid.shape[-1]
        n_keep = int(valid.sum(-1).max())
        if n_keep == n:
            return
        key = valid.to(torch.int64) * n + torch.arange(n, device=self.device)          # tokens first, then filler
        self._gather(key.topk(n_keep, dim=-1).indices.sort(dim=-1).values)

    def _gather(self, idx: torch.Tensor) -> None:
        """Keep slots ``idx`` ``(batch_size, num_kv_heads, n_keep)`` of every per-slot tensor."""
        d_idx = idx[..., None]
        self.keys = self.keys.gather(2, d_idx.expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = self.values.gather(2, d_idx.expand(-1, -1, -1, self.values.shape[-1]))
        self.slot_time = self.slot_time.gather(2, idx)
        if self.state is not None:
            self.state = self.state.gather(2, d_idx.expand(-1, -1, -1, self.state.shape[-1]))

    # ------------------------------------------------------------------ transformers API
    def _per_slot(self):
        return [t for t in (self.keys, self.values, self.slot_time, self.state) if t is not None]

    def _map_batch(self, fn) -> None:
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)
            self.slot_time, self.held = fn(self.slot_time), fn(self.held)
            if self.state is not None:
                self.state = fn(self.state)
            if self.row_time is not None:
                self.row_time = fn(self.row_time)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder keys, values, slot times and every per-slot statistic."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def get_seq_length(self) -> int:
        """Tokens seen (the position of the next token), not the number of kept slots."""
        return self.tokens_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.keys.shape[-2] if self.is_initialized else 0) + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a budgeted cache cannot be cropped (evicted tokens cannot be restored)")

    def reset(self) -> None:
        self.keys = self.values = self.slot_time = self.state = None
        self.is_initialized = False
        self.held = self.row_time = None
        self.tokens_seen = self.evicted_tokens = 0
        self._pending_q = None

    @property
    def num_slots(self) -> int:
        """Slots physically held per row and head."""
        return self.keys.shape[-2] if self.is_initialized else 0

    def nbytes(self) -> int:
        """Bytes of every tensor this layer owns (keys, values, slot times, policy statistics)."""
        return sum(t.numel() * t.element_size() for t in self._per_slot()) if self.is_initialized else 0


class BudgetedCache(Cache):
    """A transformers ``Cache`` whose layers keep at most ``budget_tokens`` slots per KV head.

    Build it with ``scissorhands.make_cache``. ``get_seq_length()`` counts tokens seen, so new tokens
    get their true absolute positions after evictions.
    """

    def __init__(self, policy: Policy, num_layers: int, budget: Budget, simulate: bool = False):
        super().__init__(layers=[BudgetedLayer(i, policy, budget, simulate) for i in range(num_layers)])
        self.policy = policy
        self.budget = budget
        self.simulate = simulate
        self._peak_bytes = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self._track_peak()                     # bytes held after the previous forward call
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _track_peak(self) -> None:
        self._peak_bytes = max(self._peak_bytes, self.kv_cache_bytes())

    @property
    def budget_tokens(self) -> int | None:
        """Slots per KV head actually used (``None`` for ``full``; resolved at the first call)."""
        return self.budget.tokens if self.policy.evicts else None

    def kv_cache_bytes(self) -> int:
        """Bytes of every tensor the cache holds now, bookkeeping included."""
        return sum(layer.nbytes() for layer in self.layers)

    @property
    def peak_kv_cache_bytes(self) -> int:
        """Largest ``kv_cache_bytes()`` held between forward calls so far."""
        return max(self._peak_bytes, self.kv_cache_bytes())

    @property
    def evicted_tokens(self) -> int:
        """Slots evicted so far, summed over layers, rows and heads counted once per row-head."""
        return sum(layer.evicted_tokens for layer in self.layers)

    def num_slots(self) -> list[int]:
        """Slots physically held per row and head, for every layer."""
        return [layer.num_slots for layer in self.layers]
