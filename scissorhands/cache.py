"""A budgeted KV cache for Hugging Face transformers, driven by an eviction policy.

Integration goes only through transformers' official seams: ``BudgetedLayer`` is a
``CacheLayerMixin`` composed into a ``Cache`` (``BudgetedCache``), and the attention function in
``scissorhands.attention`` (registered with ``AttentionInterface`` and ``AttentionMaskInterface``)
hands the layer its queries; the layer computes the attention probabilities its policy needs with
``scissorhands.attention.explicit_attention``.

A policy sees two things (``scissorhands.policies.base``): each new slot's key and value as computed
(``init_state``, before any 4-bit encoding) and the attention probabilities of the queries it asks for
(``observe``).

Storage layout of one layer (stated once, used everywhere). Every per-slot tensor lives in a
``SlotStore`` (``scissorhands.storage``): a buffer ``(batch_size, num_kv_heads, capacity, ...)`` of
which the first ``num_slots`` slots are used; a decode token is written in place when the capacity
allows (no copy of the whole cache). Capacity: once a layer that evicts has evicted, it keeps
``budget_tokens`` slots (refilled in place, memory flat); when ``max_length`` is known, buffers are
allocated for ``min(max_length, budget_tokens)`` slots (``max_length`` for ``full`` and simulation
mode) at the first call; otherwise they grow exactly to what is held (as transformers'
``DynamicCache`` does). ``kv_cache_bytes`` counts the buffers whole.

* ``keys``, ``values``: ``(batch_size, num_kv_heads, num_slots, head_dim)``, keys after RoPE, never
  re-rotated; stored as computed, or 4-bit (``kv_bits=4``: packed values plus a scale, and a zero unless
  symmetric, per group, float16 or 8-bit: see ``scissorhands.quant``) and dequantized for attention. Kept slots are in time
  order (oldest first) in every row and head.
* ``slot_time``: ``(batch_size, num_kv_heads, num_slots)`` int16 or int32 (``time_dtype``), the token
  index of each slot (tokens seen before it, padding included); ``-1`` marks a padding slot (never a
  token, always masked), ``-2`` a slot evicted in simulation mode. int16 (2 bytes) when every token
  index fits (``make_cache`` picks it when ``max_length`` and the model's ``max_position_embeddings``
  are <= 32,767); a layer whose next token index would not fit widens its slot times to int32 in place
  before writing it (exact: no time is ever truncated).
* ``state``: ``(batch_size, num_kv_heads, num_slots, policy.state_width)`` per-slot policy statistics.
* ``row_time``: ``None`` (every row shares the clock ``tokens_seen``), or ``(batch_size,)`` int64, the
  token index of each row's next token (per-row clocks, set by ``scissorhands.batching`` when rows that
  started at different times share one batch). Slot times, query times and the times a policy sees are
  then each row's own, exactly as if the row ran alone.

When evictions happen (Algorithm 1 of Scissorhands, arXiv 2305.17118; docs/library.md, "Schedule"):

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
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import (
    causal_attention_lse,
    causal_probs,
    causal_probs_chunks,
    explicit_attention,
    scratch,
    set_active_layer,
)
from .policies.base import Policy
from .storage import DenseKV, SlotStore


def min_budget(tokens) -> int:
    """The smallest budget of ``tokens`` (an int, or a ``(batch_size,)`` tensor of per-row budgets)."""
    return tokens if isinstance(tokens, int) else int(tokens.min())


PAD = -1
EVICTED = -2
INT16_MAX_TIME = torch.iinfo(torch.int16).max  # largest token index an int16 slot time holds
# Scores of one explicit-attention chunk, (batch_size, num_heads, query_chunk, num_slots), hold at most
# this many elements (8 MiB in float32), so a prefill of several rows runs smaller query chunks instead of
# tensors that outgrow the CPU's caches: over 1,024 slots the embedded model (9 heads) gets chunks of 227
# queries for one row, 56 for four.
CHUNK_SCORE_ELEMENTS = 1 << 21
# The probabilities of a fresh prompt's observed queries (computed without the output) run in chunks of at
# most this many scores (1 MiB in float32), so each of their elementwise passes stays in the CPU's cache.
CAUSAL_PROB_ELEMENTS = 1 << 19
# In a low-precision dtype their scores come from one matmul per this many queries (see
# scissorhands.attention.causal_probs_chunks: small bfloat16 matmuls cost several times more per score).
CAUSAL_MATMUL_QUERIES = 128


def budget_from_ratio(
    length_tokens: int, compression_ratio: float, policy: Policy | None = None, *, length_is_final: bool = True
) -> int:
    """The slots per KV head a ratio ``r >= 1`` leaves a sequence of ``L`` tokens: ``B = ceil(L / r)`` (at least 1).

    With ``policy``, the budget a sequence gets: ``max(needed, min(L, max(ceil(L / r), floor)))``, where ``floor``
    is the policy's ``min_budget_tokens`` (a sequence no longer than it is not compressed) and ``needed`` its
    ``needed_budget_tokens()`` (its protected windows plus one slot: a budget from a ratio never falls below what
    the policy needs, however short the sequence). ``length_is_final=False`` when ``L`` is only the prompt (the
    final length unknown): the budget is then not capped at ``L``, so the floor holds while the sequence grows.

    The one place this project computes a budget from a ratio (paper: a fixed budget B per head,
    arXiv 2305.17118; the choices around it are listed in docs/library.md).
    """
    budget = max(1, math.ceil(length_tokens / compression_ratio))
    if policy is None:
        return budget
    budget = max(budget, policy.min_budget_tokens)
    if length_is_final:
        budget = min(budget, max(1, length_tokens))
    return max(budget, policy.needed_budget_tokens())


@dataclass
class Budget:
    """The budget shared by all layers of one cache, resolved once.

    ``budget_tokens`` (absolute) wins, used as given; else ``budget_from_ratio(L, compression_ratio, policy)``
    (``ceil(L / r)``, raised to the policy's floor and needs) where ``L`` is ``max_length`` when known
    (prompt + max_new_tokens), else the length of the first call (then the floor is not capped at ``L``).
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
                final = self.max_length is not None
                b = budget_from_ratio(length, self.compression_ratio, self.policy, length_is_final=final)
            self.recent_window, self.drop_tokens = self.policy.resolve(b)
            self.tokens = b
        return self.tokens


class BudgetedLayer(CacheLayerMixin):
    """One attention layer's budgeted KV cache (layout in the module docstring).

    Args:
        layer_idx: the model layer this cache serves.
        policy, budget: the eviction policy and the budget shared by all layers.
        simulate: mask evicted slots instead of removing them.
        codec: how keys and values are stored (``DenseKV`` by default, ``Int4KV`` for 4-bit).
        time_dtype: ``torch.int16`` or ``torch.int32`` (default) slot times; int16 widens itself to int32
            when a token index passes 32,767.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(
        self,
        layer_idx: int,
        policy: Policy,
        budget: Budget,
        simulate: bool = False,
        codec=None,
        time_dtype: torch.dtype = torch.int32,
    ):
        super().__init__()
        if time_dtype not in (torch.int16, torch.int32):
            raise ValueError(f"time_dtype must be torch.int16 or torch.int32, got {time_dtype!r}")
        self.time_dtype = time_dtype
        self.layer_idx = layer_idx
        self.policy = policy
        self.budget = budget
        self.simulate = simulate
        self.codec = codec if codec is not None else DenseKV()
        self.store = SlotStore()
        self.tokens_seen = 0  # tokens this layer has seen (padding included)
        self.held: torch.Tensor | None = None  # (batch_size,) int64 tokens held per sequence
        self.pad_tokens: torch.Tensor | None = None  # (batch_size,) int64 padding tokens seen per sequence
        self.row_time: torch.Tensor | None = None  # (batch_size,) int64 per-row clocks, or None (shared)
        self.evicted_tokens = 0  # tokens evicted so far, summed over sequences
        # per-sequence budgets (BudgetedCache.set_row_budgets), (batch_size,) int64 each, or None: every row has
        # the shared budget; a row's recent window and drop size are its own budget's
        self.row_budget: torch.Tensor | None = None
        self.row_recent: torch.Tensor | None = None
        self.row_drop: torch.Tensor | None = None
        # slots a row can ever hold, min(budget, its final length) (set_row_budgets): what its buffers reserve
        self.row_capacity: torch.Tensor | None = None
        # pinned tokens per row (BudgetedCache.set_pinned_tokens), (batch_size,) int64, or None: none pinned; a
        # row's first row_pinned[i] tokens are never evicted and hold slots beside its budget
        self.row_pinned: torch.Tensor | None = None
        self._pending_q: int | None = None
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None
        # False only while no slot time is negative (no padding, filler or evicted slot): attention then
        # skips the validity check (a host sync per layer and step). Set wherever a negative time is written.
        self._maybe_masked = False

    # ------------------------------------------------------------------ storage
    # ``keys`` / ``values`` are read-only views (dequantized for 4-bit) of the kept slots.
    @property
    def keys(self) -> torch.Tensor | None:
        return self.keys_values()[0] if self.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("BudgetedLayer.keys is read-only; the layer owns its storage")

    @property
    def values(self) -> torch.Tensor | None:
        return self.keys_values()[1] if self.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("BudgetedLayer.values is read-only; the layer owns its storage")

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the kept slots, ``(batch_size, num_kv_heads, num_slots, head_dim)`` each,
        in the model dtype (views for the dense codec, dequantized copies for 4-bit)."""
        return self.codec.decode(self.store, self.dtype)

    @property
    def slot_time(self) -> torch.Tensor | None:
        """``(batch_size, num_kv_heads, num_slots)`` int16/int32 view: token index of each slot, -1 pad, -2 evicted."""
        return self.store.view("slot_time") if self.is_initialized else None

    @property
    def state(self) -> torch.Tensor | None:
        """``(batch_size, num_kv_heads, num_slots, state_width)`` view of the policy statistics, or None."""
        return self.store.view("state") if self.is_initialized and self.policy.state_width else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        specs = self.codec.specs(d, value_states.shape[-1], self.dtype)
        specs["slot_time"] = ((), self.time_dtype)
        if self.policy.state_width:
            specs["state"] = ((self.policy.state_width,), self.policy.state_dtype)
        self.store.allocate(b, h, specs, self.device)
        self.kv_dims = (d, value_states.shape[-1])  # head_dim of keys and of values, as computed
        self.held = torch.zeros(b, dtype=torch.int64, device=self.device)
        self.pad_tokens = torch.zeros(b, dtype=torch.int64, device=self.device)
        if self.row_budget is not None:
            if self.row_budget.shape[0] != b:
                raise ValueError(f"set_row_budgets gave {self.row_budget.shape[0]} budgets for a batch of {b} rows")
            self.row_budget, self.row_recent, self.row_drop, self.row_capacity = (
                t.to(self.device) for t in (self.row_budget, self.row_recent, self.row_drop, self.row_capacity)
            )
        if self.row_pinned is not None:
            if self.row_pinned.shape[0] != b:
                raise ValueError(f"set_pinned_tokens gave {self.row_pinned.shape[0]} counts for a batch of {b} rows")
            self.row_pinned = self.row_pinned.to(self.device)
        self.is_initialized = True

    @property
    def _compacts(self) -> bool:
        return self.policy.evicts and not self.simulate

    def _capacity(self, needed: int) -> int:
        """Slots to allocate when ``needed`` slots must fit (see the module docstring)."""
        target = self.budget.max_length or 0
        if self._compacts and self.row_budget is not None:
            target = self.budget_capacity()  # rows of other budgets joined: the largest, not this cache's first
        elif self._compacts and target:
            target = min(target, self.budget_capacity())
        return max(needed, target)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``(batch_size, num_kv_heads, q_len, head_dim)`` new keys/values; return all kept slots.

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
        b, h, q, _ = key_states.shape
        if self.tokens_seen + q - 1 > INT16_MAX_TIME and self.store.buffers["slot_time"].dtype == torch.int16:
            self.store.retype("slot_time", torch.int32)  # row clocks never pass tokens_seen
        if self.policy.evicts:
            self.budget.resolve(self.tokens_seen + q)
            if q == 1:  # Algorithm 1: full -> drop m, then append
                if self.row_budget is None:
                    self.evict(torch.where(self.held >= self.kept_limit(), self.budget.drop_tokens, 0))
                else:
                    self.evict(torch.where(self.held >= self.kept_limit(), self.row_drop, 0))
        # slot times, broadcast over heads (and rows) by the store's write: a decode call writes the clock
        # itself (a Python int or a (b, 1, 1) view, no arange: a few small ops fewer per layer and step)
        if q == 1:
            times = self.tokens_seen if self.row_time is None else self.row_time[:, None, None]
        else:
            times = torch.arange(q, dtype=torch.int32, device=self.device)
            times = (
                (times + self.tokens_seen)[None, None, :]
                if self.row_time is None  # (1, 1, q): shared
                else (times + self.row_time[:, None].to(torch.int32))[:, None, :]
            )  # (b, 1, q): per row
        new = self.codec.encode(key_states, value_states)
        new["slot_time"] = times
        if self.policy.state_width:  # the policy's key seam, else zero
            init = self.policy.init_state(key_states, value_states)  # (b, h, q, state_width) or None
            new["state"] = (
                init
                if init is not None
                else torch.zeros((), dtype=self.policy.state_dtype, device=self.device).expand(
                    b, h, q, self.policy.state_width
                )
            )
        self.store.append(new, self._capacity(self.store.num_slots + q))
        if self.row_time is not None:
            self.row_time += q  # after the write: `times` may view it
        self.tokens_seen += q
        self.held += q
        self._pending_q = q
        self._kv = self.keys_values()
        set_active_layer(self)
        return self._kv

    # ------------------------------------------------------------------ attention
    def attend(
        self, query: torch.Tensor, padding_mask: torch.Tensor | None, scaling: float, query_chunk: int | None = None
    ) -> torch.Tensor:
        """Attention of this call's queries over the kept slots, then observe and compress.

        Args:
            query: ``(batch_size, num_heads, q_len, head_dim)``.
            padding_mask: ``(batch_size, tokens_seen)`` bool (True = real token) or None.
            scaling: softmax scale.
            query_chunk: queries per explicit-attention call; default: as many as keep a chunk's
                scores within ``CHUNK_SCORE_ELEMENTS`` (at least 1).
        Returns:
            ``(batch_size, q_len, num_heads, head_dim)`` attention output; padded queries get zeros.
        """
        q_len, self._pending_q = self._pending_q, None
        keys, values = self._kv
        self._kv = None
        b, hq, _, d = query.shape
        st = self.slot_time  # (b, hkv, S)
        if query_chunk is None:
            query_chunk = max(1, CHUNK_SCORE_ELEMENTS // (b * hq * st.shape[-1]))
        if padding_mask is not None and padding_mask.shape[-1] >= q_len:
            new_valid = padding_mask[:, -q_len:].to(torch.bool)  # (b, q)
            if not bool(new_valid.all()):
                tail = st[:, :, -q_len:]
                tail.copy_(torch.where(new_valid[:, None, :], tail, tail.new_full((), PAD)))
                n_pad = (~new_valid).sum(-1)
                self.held -= n_pad
                self.pad_tokens += n_pad
                self._maybe_masked = True
        all_valid = self._all_slots_valid(st)
        if q_len == 1 and not self.policy.needs_attention:
            # decode_step of a policy that needs no probabilities (full, streaming_llm, knorm, random): one sdpa
            # over the kept slots, the layer's validity mask only when a slot is masked
            out = self._sdpa_chunk(query, keys, values, None if all_valid else self._valid_slots(st), scaling)
            return out.transpose(1, 2).contiguous()  # (b, 1, hq, d_v)
        # first query's token index: (1,) the shared clock, or (b,) each row's own
        t0 = (torch.tensor([self.tokens_seen], device=self.device) if self.row_time is None else self.row_time) - q_len
        # Only the last `n_obs` queries feed the policy's statistics (Scissorhands: those inside the
        # history window; TOVA: the last one); they run the explicit attention that yields the
        # probabilities, every query before them runs sdpa's fused kernel.
        n_obs = 0
        if self.policy.needs_attention:
            n_obs = max(self.policy.observed_queries(t, q_len) for t in set(t0.tolist()))
        obs_from = q_len - n_obs
        if q_len > 1 and self.row_time is None and all_valid and st.shape[-1] == q_len:
            # A fresh prompt, no padding: slot i is token i. Every query's output comes from the fused causal
            # kernel, the same numbers as the full cache's; the observed queries of chunk [s, e) see keys
            # [0, e) only, and their probabilities are exp(score - lse) with the kernel's log-sum-exp (the
            # state of slots >= e, added by this call, is still fresh: the policy sees the first e slots).
            out, lse = causal_attention_lse(query, keys, values, scaling)
            state = self.state
            query_chunk = max(1, min(query_chunk, CAUSAL_PROB_ELEMENTS // (b * hq * q_len)))
            if lse is None:
                chunks = ((s, min(q_len, s + query_chunk)) for s in range(obs_from, q_len, query_chunk))
                observed = ((s, e, causal_probs(query[:, :, s:e], keys[:, :, :e], scaling, None)) for s, e in chunks)
            else:  # (s, e, (b, hkv, g, q_c, e))
                observed = (
                    (obs_from + s, obs_from + e, p)
                    for s, e, p in causal_probs_chunks(
                        query[:, :, obs_from:], keys, scaling, lse[:, :, obs_from:], query_chunk, CAUSAL_MATMUL_QUERIES
                    )
                )
            for s, e, probs in observed:
                visible = torch.ones(e - s, e, dtype=torch.bool, device=self.device).tril(s)[None, None]
                mean = torch.mean(
                    probs, 2, out=scratch("mean_probs", probs.shape[:2] + probs.shape[3:], probs.dtype, self.device)
                )  # GQA: average the group
                self._observe(mean, visible, t0 + s, None if state is None else state[:, :, :e])
            chunks = ()
        else:
            out = query.new_empty(b, hq, q_len, values.shape[-1])
            chunks = [*range(0, obs_from, query_chunk), *range(obs_from, q_len, query_chunk)]
        for s in chunks:
            e = min(obs_from if s < obs_from else q_len, s + query_chunk)
            if e - s == 1 and s == q_len - 1:  # the newest query sees every valid slot
                visible = None if all_valid else self._valid_slots(st)  # (b, hkv, 1, S)
            else:
                qt = (t0[:, None] + torch.arange(s, e, device=self.device)).to(torch.int32)  # (1 or b, q_c)
                visible = (st[:, :, None, :] >= 0) & (st[:, :, None, :] <= qt[:, None, :, None])  # (b, hkv, q_c, S)
            if s < obs_from:
                out[:, :, s:e] = self._sdpa_chunk(query[:, :, s:e], keys, values, visible, scaling)
            else:
                out[:, :, s:e] = self._attend_chunk(query[:, :, s:e], keys, values, visible, scaling, t0 + s)
        if self.policy.evicts:  # prompt / chunk: compress to B
            self.evict((self.held - self.kept_limit()).clamp(min=0))
        return out.transpose(1, 2).contiguous()

    def _all_slots_valid(self, st: torch.Tensor) -> bool:
        """Whether no slot of ``st`` ``(b, hkv, S)`` is masked (padding, filler, evicted)."""
        # no slot time can be negative unless padding, filler or eviction wrote one (then look, one host sync)
        all_valid = not self._maybe_masked or not bool((st < 0).any())
        if all_valid:
            self._maybe_masked = False
        return all_valid

    def _valid_slots(self, st: torch.Tensor) -> torch.Tensor:
        """``(b, hkv, 1, S)`` bool: the slots a row's newest query sees (every unmasked one)."""
        return (st >= 0)[:, :, None, :]

    @staticmethod
    def _sdpa_chunk(query, keys, values, visible, scaling):
        """Attention output only (sdpa), same arguments and result as :meth:`_attend_chunk`.

        One query per row (``q_c == 1``, a decode step) in a dtype other than float32: the ``group`` query
        heads that share a KV head are passed to sdpa as that head's ``group`` queries, ``(b, hkv, group, d)``
        against ``(b, hkv, S, d)``, with the layer's ``(b, hkv, 1, S)`` mask broadcast over them. The same
        attention (one query sees the same slots as its group), computed by sdpa's ordinary kernel instead of
        its grouped-query one, which on a CPU in bfloat16 runs one query several times slower; in float32 the
        grouped-query kernel is the faster one, so float32 keeps it (docs/performance.md, "Decode attention").
        """
        b, hq, q_c, _ = query.shape
        hkv = keys.shape[1]
        group = hq // hkv
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if q_c == 1 and query.dtype != torch.float32:
            o = sdpa(
                query.reshape(b, hkv, group, -1),
                keys,
                values,
                attn_mask=visible,  # (b, hkv, g, d_v)
                scale=scaling,
            ).reshape(b, hq, 1, -1)  # (b, hq, 1, d_v)
        else:
            mask = None if visible is None else visible.repeat_interleave(group, dim=1)  # (b, hq, q_c, S)
            o = sdpa(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=group > 1)
        if visible is None:
            return o
        seen = visible.any(-1, keepdim=True)  # padded queries see nothing
        if bool(seen.all()):
            return o
        return torch.where(seen.repeat_interleave(group, dim=1), o, o.new_zeros(()))  # (b, hq, q_c, 1) mask

    def _attend_chunk(self, query, keys, values, visible, scaling, first_query, state=None):
        """Attention of ``query`` ``(b, hq, q_c, d)`` over ``keys``/``values`` ``(b, hkv, S, d)`` with explicit
        probabilities (``scissorhands.attention.explicit_attention``), handed to the policy, averaged over
        the query heads of each KV head (grouped-query attention).

        ``visible``: ``(b, hkv, q_c, S)`` bool or None (all visible); ``first_query``: ``(1 or b,)`` token
        index of the first query; ``state``: the policy statistics of these ``S`` slots (default: all).
        Returns ``(b, hq, q_c, d_v)``, or None when ``values`` is None (probabilities only).
        """
        out, probs = explicit_attention(query, keys, values, visible, scaling)  # probs (b, hkv, g, q_c, S)
        self._observe(probs.mean(2), visible, first_query, state)  # GQA: average the group
        return out

    def _observe(self, probs, visible, first_query, state=None) -> None:
        """Hand the policy ``probs`` ``(b, hkv, q_c, S)``; ``first_query`` is ``(1 or b,)``: one shared clock,
        or each row's own (``Policy.observe_rows``); ``state``: these ``S`` slots' statistics (default: all)."""
        state = self.state if state is None else state
        if first_query.numel() == 1:
            self.policy.observe(state, probs, visible, int(first_query))
        else:
            self.policy.observe_rows(state, probs, visible, first_query)

    # ------------------------------------------------------------------ eviction
    def token_index(self) -> torch.Tensor:
        """``(batch_size, num_kv_heads, num_slots)`` int64: each slot's index in its own sequence
        (slot time minus the sequence's padding, which is left padding in a batch); negative for padding,
        filler and evicted slots (slot times -1 and -2)."""
        return self.slot_time.to(torch.int64) - self.pad_tokens[:, None, None]

    def evict(self, n_drop: torch.Tensor) -> None:
        """Drop ``n_drop[i]`` tokens of sequence ``i`` in every KV head (Algorithm 2).

        The policy's keep score orders the candidates; the newest ``recent_window`` tokens of each
        sequence and its pinned first tokens (``set_pinned_tokens``) are protected; ties drop the older token (stable sort over slots in time order).
        Dropped slots are masked; then, unless simulating, every slot that no row needs is removed
        and the survivors stay in time order.

        Args:
            n_drop: ``(batch_size,)`` int64, tokens to drop per sequence.
        """
        if not bool((n_drop > 0).any()):
            return
        st = self.slot_time
        valid = st >= 0  # (b, h, S)
        score = self.policy.keep_score(
            self.state, self.token_index(), layer_idx=self.layer_idx, budget_tokens=int(min_budget(self.row_tokens()))
        ).masked_fill(~valid, float("inf"))
        r = self.budget.recent_window if self.row_budget is None else self.row_recent[:, None, None]
        if self.row_budget is not None or r:
            newer = valid.flip(-1).cumsum(-1).flip(-1)  # tokens at or after the slot
            score = score.masked_fill(valid & (newer <= r), float("inf"))
        if self.row_pinned is not None:  # a pinned prefix is kept like the recent window
            score = score.masked_fill(valid & (self.token_index() < self.row_pinned[:, None, None]), float("inf"))
        order = torch.sort(score, dim=-1, stable=True).indices  # lowest keep score first
        positions = torch.arange(order.shape[-1], device=self.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, positions)  # rank of each slot
        st.masked_fill_(rank < n_drop[:, None, None], EVICTED)
        self._maybe_masked = True
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
        key = valid.to(torch.int64) * n + torch.arange(n, device=self.device)  # tokens first, then filler
        idx = key.topk(n_keep, dim=-1).indices.sort(dim=-1).values  # (b, h, n_keep) time order
        # keep the budget allocated when evicting (the next tokens refill it in place); else what is kept
        self.store.gather(idx, self.budget_capacity() if self._compacts else n_keep)

    # ------------------------------------------------------------------ per-sequence budgets
    def row_tokens(self) -> torch.Tensor | int:
        """Each row's budget: ``(batch_size,)`` int64 under per-sequence budgets, else the shared ``B``."""
        return self.budget.tokens if self.row_budget is None else self.row_budget

    def kept_limit(self) -> torch.Tensor | int:
        """The most tokens each row keeps: its budget (``row_tokens``) plus its pinned tokens (``set_pinned_tokens``),
        ``(batch_size,)`` int64, or the shared ``B`` when no row has pinned tokens."""
        return self.row_tokens() if self.row_pinned is None else self.row_tokens() + self.row_pinned

    def budget_capacity(self) -> int:
        """Slots a row's buffers keep after an eviction: the largest budget of any row, each capped at the slots
        its row can ever hold (``set_row_budgets``' capacities; a row that evicts holds its whole budget), plus the
        row's pinned tokens."""
        base = self.budget.tokens if self.row_budget is None else self.row_capacity
        if self.row_pinned is None:
            return base if isinstance(base, int) else int(base.max())
        return int((base + self.row_pinned).max())

    def _map_rows(self, fn) -> None:
        """Apply a batch-dim operation to every per-row tensor (counters, clocks, budgets)."""
        self.held, self.pad_tokens = fn(self.held), fn(self.pad_tokens)
        for name in ("row_time", "row_budget", "row_recent", "row_drop", "row_capacity", "row_pinned"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def _cat_rows(self, other: "BudgetedLayer") -> None:
        """Append ``other``'s per-row tensors after this layer's (both or neither with per-row budgets)."""
        if (self.row_budget is None) != (other.row_budget is None):
            raise ValueError("cannot merge rows with per-sequence budgets and rows with the shared budget")
        if (self.row_pinned is None) != (other.row_pinned is None):  # the side without pinned tokens pins none
            for layer in (self, other):
                if layer.row_pinned is None:
                    layer.row_pinned = torch.zeros_like(layer.held)
        for name in (
            "held",
            "pad_tokens",
            "row_time",
            "row_budget",
            "row_recent",
            "row_drop",
            "row_capacity",
            "row_pinned",
        ):
            if getattr(self, name) is not None:
                setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.tokens_seen = max(self.tokens_seen, other.tokens_seen)
        self.evicted_tokens += other.evicted_tokens

    # ------------------------------------------------------------------ transformers API
    def _map_batch(self, fn) -> None:
        if self.is_initialized:
            self.store.map_batch(fn)
            self._map_rows(fn)

    # ------------------------------------------------------------------ rows (continuous batching)
    @property
    def batch_size(self) -> int:
        return self.held.shape[0] if self.is_initialized else 0

    def prepend_filler_slots(self, n: int) -> None:
        """Prepend ``n`` filler slots (slot time -1: masked, no token; zero keys, values, statistics)."""
        if n <= 0:
            return
        self.store.prepend(n, fill={"slot_time": PAD})
        self._maybe_masked = True

    def append_rows(self, other: "BudgetedLayer") -> None:
        """Append the rows of ``other`` (same policy, codec and model) after this layer's rows.

        Both must run per-row clocks (``row_time``); the side with fewer slots gets filler slots first.
        """
        n = max(self.num_slots, other.num_slots)
        for layer, peer in ((self, other), (other, self)):  # widen int16 slot times to match
            if layer.store.buffers["slot_time"].dtype.itemsize < peer.store.buffers["slot_time"].dtype.itemsize:
                layer.store.retype("slot_time", peer.store.buffers["slot_time"].dtype)
        self.prepend_filler_slots(n - self.num_slots)
        other.prepend_filler_slots(n - other.num_slots)
        self.store.concat_rows(other.store)
        self._maybe_masked = self._maybe_masked or other._maybe_masked
        self._cat_rows(other)  # (b_a + b_b,) counters, clocks and budgets

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder keys, values, slot times, every per-slot statistic and the counters."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def get_seq_length(self) -> int:
        """Tokens seen (the position of the next token), not the number of kept slots."""
        return self.tokens_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_slots + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a budgeted cache cannot be cropped (evicted tokens cannot be restored)")

    def offload(self):
        raise NotImplementedError("a budgeted cache does not support offloading")

    def reset(self) -> None:
        self.store = SlotStore()
        self.is_initialized = False
        self.held = self.pad_tokens = self.row_time = None
        self.row_budget = self.row_recent = self.row_drop = self.row_capacity = self.row_pinned = None
        self.tokens_seen = self.evicted_tokens = 0
        self._pending_q = None
        self._kv = None
        self._maybe_masked = False

    @property
    def num_slots(self) -> int:
        """Slots physically held per row and head."""
        return self.store.num_slots if self.is_initialized else 0

    def nbytes(self) -> int:
        """Bytes of every per-slot tensor this layer owns: key/value buffers (their whole capacity, in
        stored form), slot times and policy statistics. The per-row counters (``held``, ``pad_tokens``,
        ``row_time``: 8 bytes each per row) are not per slot and not counted."""
        return self.store.nbytes() if self.is_initialized else 0

    def slot_nbytes(self) -> int:
        """Bytes one slot of one row costs in this layer (every buffer, all KV heads), measured from the
        allocated buffers."""
        if not self.is_initialized:
            return 0
        return sum(buf[0, :, :1].numel() * buf.element_size() for buf in self.store.buffers.values())

    def bookkeeping_nbytes(self) -> int:
        """The part of :meth:`nbytes` that is not keys/values: slot times and policy statistics."""
        if not self.is_initialized:
            return 0
        kv = sum(
            buf.numel() * buf.element_size()
            for name, buf in self.store.buffers.items()
            if name not in ("slot_time", "state")
        )
        return self.nbytes() - kv

    def uncompressed_nbytes(self, bytes_per_value: int) -> int:
        """Bytes an uncompressed cache would hold for every token seen, at ``bytes_per_value`` per value."""
        if not self.is_initialized:
            return 0
        b, h = self.held.shape[0], self.store.buffers["slot_time"].shape[1]
        return b * h * self.tokens_seen * sum(self.kv_dims) * bytes_per_value


class BudgetedCache(Cache):
    """A transformers ``Cache`` whose layers keep at most ``budget_tokens`` slots per KV head.

    Build it with ``scissorhands.make_cache``. ``get_seq_length()`` counts tokens seen, so new tokens
    get their true absolute positions after evictions.
    """

    def __init__(
        self,
        policy: Policy,
        num_layers: int,
        budget: Budget,
        simulate: bool = False,
        codec_factory=DenseKV,
        time_dtype: torch.dtype = torch.int32,
        layer_factory=BudgetedLayer,
    ):
        super().__init__(
            layers=[layer_factory(i, policy, budget, simulate, codec_factory(), time_dtype) for i in range(num_layers)]
        )
        self.policy = policy
        self.budget = budget
        self.simulate = simulate
        self.kv_bits = self.layers[0].codec.bits  # None (stored as computed) or 4
        self._peak_bytes = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self._track_peak()  # bytes held after the previous forward call
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _track_peak(self) -> None:
        self._peak_bytes = max(self._peak_bytes, self.kv_cache_bytes())

    @property
    def budget_tokens(self) -> int | None:
        """Slots per KV head actually used (``None`` for ``full``; resolved at the first call)."""
        return self.budget.tokens if self.policy.evicts else None

    def set_row_budgets(self, budgets: list[int], capacities: list[int] | None = None) -> None:
        """Give each row of the first call its own budget ``budgets[i]`` (slots per KV head), with the recent
        window and drop size its policy resolves for that budget; call it before the first forward. Rows keep
        their budgets through merges and removals (``scissorhands.batching``).

        ``capacities[i]``: the most slots row ``i`` can ever hold (its prompt + new tokens, when known); its
        buffers reserve ``min(budgets[i], capacities[i])`` slots (a budget above the sequence's length, e.g. a
        floor or a recent window >= L, reserves nothing it could use). None: each row's budget.

        A policy whose scores read the budget itself (``snapkv``'s candidate window, ``streaming_llm``'s sink
        count when B is tiny) scores a batch of mixed budgets with its smallest.

        Raises:
            ValueError: the policy does not evict, a budget or capacity below 1, a budget too small for the
                policy's recent window (``Policy.resolve``), capacities not one per budget, or the cache has
                already seen tokens.
        """
        if not self.policy.evicts:
            raise ValueError(f"policy {self.policy.name!r} keeps every token: it takes no per-sequence budget")
        if self.layers[0].is_initialized:
            raise ValueError("set_row_budgets must be called before the cache's first forward call")
        capacities = list(budgets) if capacities is None else list(capacities)
        if len(capacities) != len(budgets):
            raise ValueError(f"capacities: {len(capacities)} given for {len(budgets)} budgets; give one per row")
        resolved = []
        for b, c in zip(budgets, capacities):
            if not isinstance(b, int) or b < 1:
                raise ValueError(f"budget_tokens must be an integer >= 1, got {b!r}")
            if not isinstance(c, int) or c < 1:
                raise ValueError(f"capacities: each must be an integer >= 1, got {c!r}")
            resolved.append((b, *self.policy.resolve(b), min(b, c)))
        columns = [torch.tensor(c, dtype=torch.int64) for c in zip(*resolved)]
        for layer in self.layers:
            layer.row_budget, layer.row_recent, layer.row_drop, layer.row_capacity = columns

    def set_pinned_tokens(self, tokens: list[int]) -> None:
        """Pin each row's first ``tokens[i]`` token positions (one count per row of the cache, or of its first call
        when it has seen none yet): they are never evicted (a keep score of +inf, as the recent window's) and hold
        slots beside the row's budget, so row ``i`` keeps at most ``tokens[i] + B_i`` slots per KV head (``B_i`` its
        budget: ``set_row_budgets``' or the shared one). Pinned slots are the row's oldest, so they stay its slots
        ``0 .. tokens[i] - 1`` through every eviction; on the paged layout a compaction never writes a block that
        holds only pinned slots (``scissorhands.paged.PagedStore.compact``), so such a block can be shared read-only
        (TensorRT-LLM's TriAttention keeps the prompt prefix so, and compresses what follows). Rows keep their
        counts through merges and removals (``scissorhands.batching``; a row merged from a cache without pinned
        tokens pins none). All zeros behaves exactly as no pinned tokens.

        Raises:
            ValueError: the policy does not evict, a count not a whole number >= 0, or not one count per row.
        """
        if not self.policy.evicts:
            raise ValueError(f"policy {self.policy.name!r} keeps every token: it takes no pinned tokens")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"pinned tokens: each must be an integer >= 0, got {t!r}")
        rows = self.layers[0].batch_size if self.layers[0].is_initialized else None
        if rows is not None and len(tokens) != rows:
            raise ValueError(f"pinned tokens: {len(tokens)} given for {rows} rows; give one per row")
        for layer in self.layers:
            device = layer.device if layer.is_initialized else None
            layer.row_pinned = torch.tensor(list(tokens), dtype=torch.int64, device=device)

    def pinned_tokens(self) -> list[int]:
        """Each row's pinned tokens (``set_pinned_tokens``; zeros when none is set)."""
        layer = self.layers[0]
        if layer.row_pinned is not None:
            return layer.row_pinned.tolist()
        return [0] * layer.batch_size

    def kv_cache_bytes(self) -> int:
        """Bytes of every tensor the cache holds now, bookkeeping included."""
        return sum(layer.nbytes() for layer in self.layers)

    def bookkeeping_bytes(self) -> int:
        """The part of ``kv_cache_bytes()`` that is not keys/values (slot times and policy statistics)."""
        return sum(layer.bookkeeping_nbytes() for layer in self.layers)

    def compression_report(self) -> dict:
        """Measured bytes now against an uncompressed cache of every token seen.

        Returns a dict: ``kv_cache_bytes`` (measured, bookkeeping included), ``bookkeeping_bytes``,
        ``dtype`` (of the model's keys), ``uncompressed_16bit_bytes`` and ``uncompressed_dtype_bytes``
        (every token seen, keys and values in 16 bits / in the dtype actually run),
        ``ratio_vs_16bit`` and ``ratio_vs_dtype`` (uncompressed / measured; the paper reports the first).
        """
        layers = [layer for layer in self.layers if layer.is_initialized]
        dtype = layers[0].dtype if layers else None
        size = torch.finfo(dtype).bits // 8 if dtype is not None and dtype.is_floating_point else 2
        measured = self.kv_cache_bytes()
        full16 = sum(layer.uncompressed_nbytes(2) for layer in layers)
        full_dtype = sum(layer.uncompressed_nbytes(size) for layer in layers)
        return {
            "kv_cache_bytes": measured,
            "bookkeeping_bytes": self.bookkeeping_bytes(),
            "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
            "uncompressed_16bit_bytes": full16,
            "uncompressed_dtype_bytes": full_dtype,
            "ratio_vs_16bit": full16 / measured if measured else float("nan"),
            "ratio_vs_dtype": full_dtype / measured if measured else float("nan"),
        }

    @property
    def peak_kv_cache_bytes(self) -> int:
        """Largest ``kv_cache_bytes()`` held between forward calls so far."""
        return max(self._peak_bytes, self.kv_cache_bytes())

    def held_tokens(self) -> int:
        """Tokens held now per KV head in layer 0, summed over sequences (0 before the first call): the
        slots in use that live metrics report."""
        layer = self.layers[0]
        return int(layer.held.sum()) if layer.is_initialized else 0

    @property
    def evicted_tokens(self) -> int:
        """Slots evicted so far, summed over layers, rows and heads counted once per row-head."""
        return sum(layer.evicted_tokens for layer in self.layers)

    def num_slots(self) -> list[int]:
        """Slots physically held per row and head, for every layer."""
        return [layer.num_slots for layer in self.layers]
