"""Continuous batching for one model replica: a scheduler over a budgeted KV cache (no Ray here).

`ContinuousBatchingEngine` is a plain class; the model is injected, so tests pass a tiny one.
Requests join the running batch after their prefill and leave it when they finish, between decode
steps. One `step()`:

1. `admit`: take queued requests in arrival order (first come, first served; the head of the queue
   is never skipped) while the batch stays within `max_batch` and the KV memory limit;
2. `prefill`: forward the admitted prompts (requests of equal prompt length together) into a cache
   of their own; the first token of each is picked from its last logits (`pick_tokens`: argmax, or
   sampled when the request asks); then merge those rows into the running cache
   (`scissorhands.batching.merge_rows`);
3. `decode_step`: one forward of every running sequence (each row at its own position);
4. finished sequences (their `max_new_tokens` reached, or EOS unless ignored) leave the batch.

Under ``scheduler: mixed`` (paged layout) steps 1-2 spend one token budget, `max_num_batched_tokens`: every
running row's decode token first, then chunks of the prompts part-way fed (oldest first) and of queued requests
(`_schedule_chunks`); a prompt's cache takes blocks chunk by chunk, a budgeted one is compressed back to its
budget after every chunk, and its rows join the running batch when its last chunk is fed (vLLM V1's schedule).

`abort(request_id)` (any thread) drops a queued or running request at the start of the next step:
its row leaves the cache then (`error_kind="aborted"`), so the slots it held are free again.
`submit(..., on_token=f)` calls `f(token_id, time_s)` for every token as soon as it is decoded
(streaming servers).

Memory accounting, known before admission. The cache of a batch holds `rows * S` slots per layer
and head, where `S` is the largest number of slots any row needs (rows are padded to it), and one
slot in every layer costs `slot_bytes` (measured once, bookkeeping included). A budgeted sequence
needs `final_slots = B` (its layers preallocate the budget, so decode writes in place); a full-cache
sequence of `prompt_tokens` and `max_new_tokens` ends at `prompt + max_new - 1` tokens (or holds
`max_length_tokens` preallocated, when the config gives it). A set of
rows is admitted only when

* steady state: `rows * max(final_slots) * slot_bytes <= kv_memory_limit_bytes`, and
* during each prefill: the bytes the running rows hold now plus that prefill's peak
  (`n * ((layers - 1) * kept + max(L, kept))` slots of one layer, `kept` = B or L: a budgeted
  prefill compresses one layer at a time) stay within the limit.

The paged layout (`kv_layout: paged`, `scissorhands.paged`) replaces these bounds with blocks of one pool sized
to the limit: a request is admitted when the blocks its prefill takes now are free (next to the block each
running row may take at its next step); before each decode step, while the running rows' next blocks are not
free, the most recently admitted row is preempted (its blocks freed; back to the head of the queue; prefilled
again later from its prompt and the tokens it generated). The dense bookkeeping, grown a block at a time to
the widest row, lies outside the pool: admission charges its padding as blocks, and a decode step that would
pass the limit preempts too. `fits_alone` rejects at submission what the pool could never hold alone,
counting a recompute's prefill, so an admitted request is never rejected later.

So the cache never holds more than the limit between forward calls (the transient copies a
`torch.cat` makes during an update are not counted; they are at most one layer's tensors).
A request that could not fit even alone is rejected (`error_kind="rejected"`), never queued forever.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from replica.metrics import NullMetrics
from replica.sampling import pick_tokens, score_prompt
from replica.types import EngineConfig, GenerationRequest, GenerationResult
from scissorhands import budget_from_ratio, cache_policy, make_cache
from scissorhands.batching import (
    cache_slot_bytes,
    measured_cache,
    merge_rows,
    row_positions,
    select_rows,
    sequence_slot_bytes,
)
from scissorhands.checks import check_int
from scissorhands.paged import BlockPool, bookkeeping_slot_bytes, release_cache

# The budget of the cache an engine under `budget: per_request` builds once, only to validate its policy parameters
# and measure the bytes of one slot (which do not depend on B); every request's cache gets the request's own B.
PROBE_BUDGET_TOKENS = 1024

__all__ = [
    "ContinuousBatchingEngine",
    "EngineLoop",
    "device_memory_bytes",
    "full_batch_kv_limit_bytes",
    "full_rows_kv_bytes",
]


def _recording() -> contextlib.AbstractContextManager:
    """The context of a group of live-metrics calls: a recorder error ends the group and is dropped,
    so metrics never stop serving (the requests' results and `stats()` do not depend on them)."""
    return contextlib.suppress(Exception)


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of `device` (bytes): the GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().total)


@dataclass
class _Seq:
    request: GenerationRequest
    result: GenerationResult
    on_done: Callable[[GenerationResult], None]
    final_slots: int
    budget_tokens: int | None  # this sequence's B (its own under `budget: per_request`), None for full
    held_slots: int = 0  # tokens the row holds in the cache now (for the prefill-time bound)
    on_token: Callable[[int, float], None] | None = None
    generator: torch.Generator | None = None  # this request's sampling draws (temperature > 0)
    preempted: bool = False  # paged layout: its row was freed; its next prefill recomputes prompt + output
    unfit: str | None = None  # why it can never run under the memory limit (`fits_alone`), checked at submit

    def prefill_ids(self) -> list[int]:
        """The tokens its next prefill feeds: the prompt, plus every output token after a preemption."""
        return self.request.prompt_ids + self.result.output_ids if self.preempted else self.request.prompt_ids

    sample_error: str | None = None  # why this row's last pick failed (pick_tokens): it fails alone
    token_logprob: float | None = None  # the last picked token's log-probability (request.logprobs)
    token_top_logprobs: list | None = None  # ... and its alternatives, [[token_id, logprob], ...]


class _Prefill:
    """A group of requests whose prompts are being prefilled (equal lengths fed, one budget): under
    ``scheduler: mixed`` chunk by chunk across steps, under ``prefill_first`` in one chunk."""

    def __init__(self, group: list[_Seq]):
        self.group = group
        self.cache = None  # built at the first chunk (in the block pool on the paged layout)
        self.ids: torch.Tensor | None = None  # (n, L) the tokens to feed
        self.fed = 0  # tokens of each row fed so far
        self.length = len(group[0].prefill_ids())

    @property
    def rows(self) -> int:
        return len(self.group)


class ContinuousBatchingEngine:
    """The continuous-batching scheduler of one replica (thread-safe `submit`, single-threaded `step`).

    Args:
        model: a transformers causal LM (its attention implementation becomes ``"scissorhands"``).
        config: `EngineConfig`.
        eos_token_id: stops a request that does not set `ignore_eos` (None: never).
        clock: seconds, used for every timestamp (default `time.time`, comparable across processes
            of one machine and, with synchronized clocks, across machines).
        replica_id: recorded in every result.
        metrics: live metrics (a `replica.metrics.ReplicaMetrics`, or anything with its methods);
            None records nothing (`replica.metrics.NullMetrics`). A failing recorder never stops the
            engine (`_recording`).

    Raises:
        ValueError: from `make_cache` for an invalid policy parameter or budget.
    """

    def __init__(
        self,
        model,
        config: EngineConfig,
        *,
        eos_token_id: int | None = None,
        clock: Callable[[], float] = time.time,
        replica_id: str = "replica-0",
        metrics=None,
    ):
        self.model = model
        self.config = config
        self.eos_token_id = eos_token_id
        self.clock = clock
        self.replica_id = replica_id
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.device = next(model.parameters()).device
        self.budget_tokens = config.resolved_budget_tokens()
        self.per_request = config.budget == "per_request"
        self._cache_kwargs: dict[str, Any] = dict(config.policy_params)
        # slots every row's buffers preallocate: B (budgeted), the workload's longest sequence (full,
        # when max_length_tokens is given), or None (full: buffers grow with the longest row)
        self.row_capacity = self.budget_tokens if self.budget_tokens is not None else config.max_length_tokens
        if self.budget_tokens is None and config.max_length_tokens is not None:
            self._cache_kwargs["max_length"] = config.max_length_tokens
        if self.budget_tokens is not None:
            # max_length = B: every layer preallocates B slots per row, so decode tokens are written in
            # place; a sequence then holds B slots from its prefill on (its bytes, known in advance)
            self._cache_kwargs.update(budget_tokens=self.budget_tokens, max_length=self.budget_tokens)
        elif self.per_request:  # each group's cache gets its requests' B; this one only validates and measures
            self._cache_kwargs.update(budget_tokens=PROBE_BUDGET_TOKENS, max_length=PROBE_BUDGET_TOKENS)
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(text_config.num_hidden_layers)
        probe = measured_cache(model, config.policy, **self._cache_kwargs)  # validates now, not at the first request
        self.slot_bytes = cache_slot_bytes(probe)
        # one row's slot of slot times and policy statistics, all layers: dense on the paged layout, padded
        self.bookkeeping_slot_bytes = bookkeeping_slot_bytes(probe)
        if config.kv_memory_limit_bytes is not None:
            self.kv_memory_limit_bytes: int | None = config.kv_memory_limit_bytes
        elif config.kv_memory_fraction is not None:
            self.kv_memory_limit_bytes = int(config.kv_memory_fraction * device_memory_bytes(self.device))
        elif config.kv_limit_full_sequences is not None:  # full-cache rows in this model's dtype
            self.kv_memory_limit_bytes = full_rows_kv_bytes(
                model, config.kv_limit_full_sequences, config.max_length_tokens
            )
        else:
            self.kv_memory_limit_bytes = None
        self.pool: BlockPool | None = None
        if config.kv_layout == "paged":
            # a block holds block_tokens slots of one layer (all KV heads): slot_bytes covers every layer
            self.block_bytes = math.ceil(config.block_tokens * self.slot_bytes / self.num_layers)
            usable = self.kv_memory_limit_bytes // self.block_bytes
            if usable < self.num_layers:
                raise ValueError(
                    f"kv_memory_limit_bytes: {self.kv_memory_limit_bytes} bytes hold {usable} KV blocks of "
                    f"{self.block_bytes} bytes; a paged pool needs at least one block per layer ({self.num_layers})"
                )
            self.pool = BlockPool(usable + 1, config.block_tokens)  # + the zero block
        else:
            with _recording():  # no pool: no block series (not the pool of a paged engine these labels had before)
                self.metrics.clear_kv_blocks()
        self._lock = threading.Condition()
        self._queue: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._prefilling: list[_Prefill] = []  # scheduler: mixed, prompts part-way fed (oldest first)
        self.mixed = config.scheduler == "mixed"
        self._cache = None
        self._next_tokens: torch.Tensor | None = None  # (rows, 1) last token of each running row
        self._aborts: set[str] = set()
        self.reset_stats()

    # ------------------------------------------------------------------ accounting
    def budget_of(self, prompt_tokens: int, max_new_tokens: int) -> int | None:
        """A request's B: its own ``budget_from_ratio(prompt + max_new, ratio, policy)`` under ``budget: per_request``
        (``ceil(L / ratio)`` raised to the policy's floor and needs), else the engine's fixed B (None: keeps every token)."""
        if self.per_request:
            policy = cache_policy(self.config.policy, **self.config.policy_params)
            return budget_from_ratio(prompt_tokens + max_new_tokens, self.config.compression_ratio, policy)
        return self.budget_tokens

    def final_slots(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Slots a sequence's row needs at most: ``B`` (budgeted), else ``prompt + max_new - 1`` or the
        preallocated ``max_length_tokens``, whichever is larger."""
        budget = self.budget_of(prompt_tokens, max_new_tokens)
        if budget is not None:
            return budget
        return max(prompt_tokens + max_new_tokens - 1, self.row_capacity or 0)

    def _prefill_slots(self, prompt_tokens: int, budget: int | None = None) -> int:
        """Slots one row holds per layer after its prefill (the preallocated capacity, or the prompt)."""
        budget = budget if budget is not None else self.budget_tokens
        if budget is not None:
            return budget
        return max(prompt_tokens, self.row_capacity or 0)

    def prefill_peak_bytes(self, rows: int, prompt_tokens: int, budget: int | None = None) -> int:
        """Peak bytes of a prefill cache of `rows` prompts of `prompt_tokens` (all layers): the layers
        before the current one hold their compressed slots, the current one the whole prompt."""
        kept = self._prefill_slots(prompt_tokens, budget)
        layer_slots = (self.num_layers - 1) * kept + max(prompt_tokens, kept)
        return math.ceil(rows * layer_slots * self.slot_bytes / self.num_layers)

    def batch_bytes_bound(self, slots: list[int]) -> int:
        """Bytes of a batch whose rows hold `slots` tokens each: rows * max(slots) * slot_bytes."""
        return len(slots) * max(slots, default=0) * self.slot_bytes

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Largest batch of identical requests the memory limit (and `max_batch`) admits at once: on the paged
        layout, as many as hold their final blocks together (so none is preempted)."""
        cap = self.config.max_batch or 1 << 30
        if self.kv_memory_limit_bytes is None:
            return cap
        if self.pool is not None:  # the others at their final blocks while the last one's prefill peaks
            final = self.final_blocks(prompt_tokens, max_new_tokens)
            peak = self.prefill_peak_blocks(prompt_tokens, self.budget_of(prompt_tokens, max_new_tokens))
            usable = self.pool.usable_blocks
            return max(0, min(cap, usable // final, 1 + (usable - peak) // final if peak <= usable else 0))
        per_row = self.final_slots(prompt_tokens, max_new_tokens) * self.slot_bytes
        n = min(cap, self.kv_memory_limit_bytes // per_row)
        budget = self.budget_of(prompt_tokens, max_new_tokens)
        kept = self._prefill_slots(prompt_tokens, budget)
        while (
            n > 0
            and self.batch_bytes_bound([kept] * (n - 1)) + self.prefill_peak_bytes(1, prompt_tokens, budget)
            > self.kv_memory_limit_bytes
        ):
            n -= 1  # the last one's prefill, next to the others' prompts, must fit too
        return int(n)

    def fits_alone(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """Why a request of these lengths can never run under the KV memory limit, even alone (None: it can).

        Preallocated layout: its final slots and its prefill's peak in bytes. Paged layout: its final blocks,
        and the peak of a prefill of its prompt plus every output but the last (what a recompute after a
        preemption feeds), so an admitted request is never refused later. Under `budget: per_request`, also
        whether the policy accepts the request's own budget (`Policy.resolve`: a recent window must fit).
        """
        budget = self.budget_of(prompt_tokens, max_new_tokens)
        if self.per_request:
            try:
                make_cache(self.config.policy, self.model, **{**self._cache_kwargs, "budget_tokens": budget})
            except ValueError as e:
                return f"its budget of {budget} slots (ceil((prompt + max_new) / ratio)) does not suit the policy: {e}"
        if self.kv_memory_limit_bytes is None:
            return None
        if self.pool is not None:
            usable = self.pool.usable_blocks
            need = max(
                self.final_blocks(prompt_tokens, max_new_tokens),
                self.prefill_peak_blocks(prompt_tokens + max(0, max_new_tokens - 1), budget),
            )
            if need > usable:
                return f"it needs {need} KV blocks alone, more than the pool's {usable}"
            return None
        need = max(
            self.batch_bytes_bound([self.final_slots(prompt_tokens, max_new_tokens)]),
            self.prefill_peak_bytes(1, prompt_tokens, budget),
        )
        if need > self.kv_memory_limit_bytes:
            return f"it needs {need} bytes of KV cache alone, more than the limit of {self.kv_memory_limit_bytes} bytes"
        return None

    # ------------------------------------------------------------------ paged accounting (blocks)
    def _blocks(self, slots: int) -> int:
        return -(-slots // self.config.block_tokens)

    @staticmethod
    def _kept_slots(tokens: int, budget: int | None) -> int:
        return tokens if budget is None else min(tokens, budget)

    def prefill_peak_blocks(self, prompt_tokens: int, budget: int | None) -> int:
        """Blocks one row's prefill of `prompt_tokens` holds at its peak, all layers: the layers before the
        current one their kept slots, the current one the whole prompt (paged layout)."""
        kept = self._kept_slots(prompt_tokens, budget)
        return (self.num_layers - 1) * self._blocks(kept) + self._blocks(prompt_tokens)

    def final_blocks(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Blocks a row holds at its end, all layers (paged layout): what it needs to finish alone."""
        budget = self.budget_of(prompt_tokens, max_new_tokens)
        return self.num_layers * self._blocks(self._kept_slots(prompt_tokens + max_new_tokens - 1, budget))

    def _growth_blocks(self, steps: int) -> int:
        """Blocks the running rows take, all layers, over their next `steps` decode steps (each row at most until
        its last token; a budgeted row at its budget evicts before it writes, so it never grows past its budget's
        blocks): at 1 step what the next decode step needs; at more, what a prompt fed over that many steps must
        leave free, or it is the first preempted when they grow."""
        if self._cache is None:
            return 0
        store = self._cache.layers[0].store
        return self.num_layers * sum(
            max(0, self._blocks(self._kept_slots(n + min(steps, self._left(seq)), seq.budget_tokens)) - len(blocks))
            for seq, n, blocks in zip(self._running, store.row_slots.tolist(), store.blocks)
        )

    @staticmethod
    def _left(seq: _Seq) -> int:
        """Decode steps a running row may still run (it writes one slot each): its new tokens not yet picked."""
        return seq.request.max_new_tokens - len(seq.result.output_ids)

    # Dense bookkeeping (slot times, policy statistics) is padded to a batch's widest row, outside the pool; a
    # block's share of the limit pays only its own slots' bookkeeping, so the padding is charged as blocks.
    def _width(self, seq: _Seq, tokens: int) -> int:
        """Slots of a row of `seq` after it has seen `tokens`: what it keeps (its budget at most) rounded up to
        whole blocks. Its blocks pay for that much bookkeeping; the paged layout grows the bookkeeping a block at
        a time to the widest row (`scissorhands.paged.PagedStore.append`)."""
        return self._blocks(self._kept_slots(tokens, seq.budget_tokens)) * self.config.block_tokens

    def _held_bookkeeping_slots(self) -> int:
        """Slots a row of the running batch's dense bookkeeping holds now (0 without a batch)."""
        return self._cache.layers[0].store.dense.capacity if self._cache is not None else 0

    def _padding_blocks(self, widths: list[int]) -> int:
        """Blocks' worth of the bookkeeping padding of one batch of rows of these widths (slots), padded to the
        widest or to what the running batch's bookkeeping already holds: ``ceil(bookkeeping_slot_bytes *
        sum(padded - w) / block_bytes)``."""
        padded = max([self._held_bookkeeping_slots(), *widths])
        return -(-sum(padded - w for w in widths) * self.bookkeeping_slot_bytes // self.block_bytes)

    def _added_padding_blocks(self, widths: list[int], width: int) -> int:
        """The padding blocks a row of `width` slots adds once merged with rows of `widths`."""
        return self._padding_blocks(widths + [width]) - self._padding_blocks(widths)

    def _running_widths(self) -> list[int]:
        """Each running row's width after the next decode step (the one it writes, when it decodes again): what
        admission and the decode step's byte check both charge."""
        if self._cache is None:
            return []
        rows = zip(self._running, self._cache.layers[0].store.row_slots.tolist())
        return [self._width(s, n + (self._left(s) > 0)) for s, n in rows]

    def _over_limit_after_decode(self) -> bool:
        """Whether the next decode step would take the live caches past the KV memory limit, in the bytes they
        will measure: every block in use and the blocks the step takes, the running batch's bookkeeping at the
        slots it will hold (`PagedStore.append`: grown to whole blocks once its widest row outgrows it), and the
        bookkeeping of the prompts part-way fed."""
        slots = max(self._held_bookkeeping_slots(), *self._running_widths())
        dense = len(self._running) * slots * self.bookkeeping_slot_bytes
        dense += sum(c.bookkeeping_bytes() for c in self._caches() if c is not self._cache)
        blocks = self.pool.blocks_in_use + self._growth_blocks(1)
        return blocks * self.pool.block_nbytes() + dense > self.kv_memory_limit_bytes

    def _make_room_for_decode(self) -> None:
        """Preempt the most recently admitted running rows until the next decode step's blocks are free and the
        live caches stay within the limit after it (vLLM's rule: the newest sequence goes back to the head of the
        queue and is recomputed later)."""
        # a lone row is never preempted for bytes: `fits_alone` bounds it (bookkeeping a left row's width kept
        # included: that row fit alone too), and its recompute would hold as much
        while self._running and (
            self._growth_blocks(1) > self.pool.free_blocks
            or ((len(self._running) > 1 or self._prefilling) and self._over_limit_after_decode())
        ):
            if self._prefilling:  # a prompt part-way fed is newer than every running row: it goes first
                self._requeue(self._prefilling.pop())
                continue
            seq = self._running.pop()
            keep = list(range(len(self._running)))
            self._cache = self._select(self._cache, keep)
            self._next_tokens = self._next_tokens[keep] if keep else None
            seq.preempted = True
            # every token whose KV it held is computed again: the prompt and the outputs fed so far
            recomputed = len(seq.request.prompt_ids) + len(seq.result.output_ids) - 1
            self._stats["preemptions"] += 1
            self._stats["recomputed_tokens"] += recomputed
            with _recording():
                self.metrics.add_preemption(recomputed)
            with self._lock:
                self._queue.appendleft(seq)

    def _requeue(self, p: _Prefill) -> None:
        """Preempt a group part-way prefilled: its blocks back to the pool, its requests back to the head of
        the queue (in order), their chunks fed so far counted as recomputed."""
        release_cache(p.cache)
        for seq in p.group:
            seq.preempted = True  # scored already (prompt_logprobs): the next prefill only feeds
            self._stats["preemptions"] += 1
            self._stats["recomputed_tokens"] += p.fed
            with _recording():
                self.metrics.add_preemption(p.fed)
        with self._lock:
            self._queue.extendleft(reversed(p.group))

    @staticmethod
    def _select(cache, keep: list[int]):
        """`select_rows`, or None with every block returned when no row stays."""
        if keep:
            return select_rows(cache, keep)
        release_cache(cache)
        return None

    # ------------------------------------------------------------------ submission
    def submit(
        self,
        request: GenerationRequest,
        on_done: Callable[[GenerationResult], None],
        on_token: Callable[[int, float], None] | None = None,
    ) -> None:
        """Queue `request`; `on_done(result)` is called once, from the thread running `step()`, and
        `on_token(token_id, time_s)` for each token as it is decoded (before `on_done` for the last)."""
        result = GenerationResult(
            request.request_id, len(request.prompt_ids), received_time_s=self.clock(), replica_id=self.replica_id
        )
        seq = _Seq(
            request,
            result,
            on_done,
            self.final_slots(len(request.prompt_ids), request.max_new_tokens),
            self.budget_of(len(request.prompt_ids), request.max_new_tokens),
            on_token=on_token,
            unfit=self.fits_alone(len(request.prompt_ids), request.max_new_tokens),
        )
        with self._lock:
            self._queue.append(seq)
            self._stats[self._key(seq, "received")] += 1
            self._lock.notify_all()

    def abort(self, request_id: str) -> None:
        """Drop `request_id` (queued or running) at the start of the next step (any thread); its
        `on_done` gets `error_kind="aborted"`. Unknown or finished ids are ignored."""
        with self._lock:
            self._aborts.add(request_id)
            self._lock.notify_all()

    def _apply_aborts(self) -> None:
        """Fail the aborted requests; running ones leave the cache (`select_rows`), freeing their slots."""
        with self._lock:
            if not self._aborts:
                return
            aborts, self._aborts = self._aborts, set()
            gone = [s for s in self._queue if s.request.request_id in aborts]
            for s in gone:
                self._queue.remove(s)
        for p in list(self._prefilling):
            rows = [i for i, s in enumerate(p.group) if s.request.request_id not in aborts]
            if len(rows) < p.rows:
                gone += [s for s in p.group if s.request.request_id in aborts]
                if not rows:
                    release_cache(p.cache)
                    self._prefilling.remove(p)
                    continue
                p.group = [p.group[i] for i in rows]
                p.cache = select_rows(p.cache, rows) if p.cache is not None else None
                p.ids = p.ids[rows] if p.ids is not None else None
        keep = [i for i, s in enumerate(self._running) if s.request.request_id not in aborts]
        if len(keep) < len(self._running):
            gone += [s for s in self._running if s.request.request_id in aborts]
            self._running = [self._running[i] for i in keep]
            self._cache = self._select(self._cache, keep)
            self._next_tokens = self._next_tokens[keep] if keep else None
        for s in gone:
            self._fail(s, "aborted", "the client aborted the request")

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block until a request is queued or running (or `timeout_s` passes); return whether one is."""
        with self._lock:
            return self._lock.wait_for(
                lambda: bool(self._queue or self._running or self._prefilling), timeout=timeout_s
            )

    @property
    def running(self) -> int:
        """Requests admitted and not finished: decoding, or part-way prefilled (`scheduler: mixed`)."""
        return len(self._running) + sum(p.rows for p in self._prefilling)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def generated_tokens(self) -> int:
        """Output tokens of measured requests generated since `reset_stats` (`stats()`'s ``generated_tokens``,
        without building the whole dict: cheap enough for a progress bar after every `step()`)."""
        return self._stats["tokens"]

    @staticmethod
    def _key(seq: "_Seq", counter: str) -> str:
        """The `_stats` key of `counter` for `seq`: warm-up requests are counted apart."""
        return "warmup_" + counter if seq.request.warmup else counter

    @staticmethod
    def _phase(seq: "_Seq") -> str:
        return "warmup" if seq.request.warmup else "measured"

    def reset_stats(self) -> None:
        """Zero the counters and peaks reported by `stats()` (between sweep points)."""
        self._stats = collections.Counter()
        self._peak_bytes = 0
        self._peak_running = 0
        if self.pool is not None:
            self.pool.peak_blocks_in_use = self.pool.blocks_in_use

    def stats(self) -> dict:
        """Counters since `reset_stats` (units in the names). Request counts and generated tokens
        are of measured requests; the load generator's warm-up requests are in the ``warmup_*``
        keys. Steps, times and peaks are the engine's, whichever requests ran in them."""
        with self._lock:
            s = dict(self._stats)
            queued = len(self._queue)
        return {
            "replica_id": self.replica_id,
            "policy": self.config.policy,
            "budget_tokens": self.budget_tokens,  # None under budget: per_request (each request its own)
            "budget": self.config.budget,
            "slot_bytes": self.slot_bytes,
            "kv_memory_limit_bytes": self.kv_memory_limit_bytes,
            "running_sequences": self.running,
            "queued_requests": queued,
            "peak_running_sequences": self._peak_running,
            "peak_kv_cache_bytes": self._peak_bytes,
            "kv_cache_bytes": self._kv_cache_bytes(),
            "received_requests": s.get("received", 0),
            "completed_requests": s.get("completed", 0),
            "failed_requests": s.get("failed", 0),
            "generated_tokens": s.get("tokens", 0),
            "warmup_received_requests": s.get("warmup_received", 0),
            "warmup_completed_requests": s.get("warmup_completed", 0),
            "warmup_failed_requests": s.get("warmup_failed", 0),
            "warmup_generated_tokens": s.get("warmup_tokens", 0),
            "decode_steps": s.get("decode_steps", 0),
            "prefill_calls": s.get("prefill_calls", 0),
            "prefill_s": s.get("prefill_s", 0.0),  # wall time in prefill phases
            "decode_s": s.get("decode_s", 0.0),  # wall time in decode steps
            "kv_layout": self.config.kv_layout,
            "scheduler": self.config.scheduler,
            "max_num_batched_tokens": self.config.max_num_batched_tokens if self.mixed else None,
            "block_tokens": self.config.block_tokens if self.pool is not None else None,
            "kv_pool_blocks": self.pool.usable_blocks if self.pool is not None else None,
            "peak_kv_blocks_in_use": self.pool.peak_blocks_in_use if self.pool is not None else None,
            "mean_kv_blocks_in_use": (
                s.get("block_steps", 0) / s["decode_steps"] if self.pool is not None and s.get("decode_steps") else None
            ),
            "preemptions": s.get("preemptions", 0),
            "recomputed_tokens": s.get("recomputed_tokens", 0),
        }

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> list[list[_Seq]]:
        """Pop the requests that fit now, grouped for prefill (same prompt length, consecutive)."""
        limit = self.kv_memory_limit_bytes
        cap = self.config.max_batch or 1 << 30
        finals = [s.final_slots for s in self._running]  # every row once admitted, at its end
        held = [s.held_slots for s in self._running]  # rows in the cache, tokens held now
        groups: list[list[_Seq]] = []
        group_held: list[int] = []  # tokens each admitted row holds after prefill
        prefill_tokens = 0
        with self._lock:
            while self._queue and len(finals) < cap:
                seq = self._queue[0]
                n_prompt = len(seq.request.prompt_ids)
                if seq.unfit is not None:
                    self._queue.popleft()
                    self._fail(seq, "rejected", f"request cannot run under the KV memory limit: {seq.unfit}")
                    continue
                if groups and prefill_tokens + n_prompt > self.config.max_prefill_tokens:
                    break  # enough prefill for this step; running rows decode first
                same = bool(groups) and self._same_group(groups[-1][0], seq)
                if limit is not None:
                    if self.batch_bytes_bound(finals + [seq.final_slots]) > limit:
                        break  # steady state would not fit: wait for rows to finish
                    # the rows in the cache while this request's group is prefilled: join the last
                    # group if its prefill still fits, else prefill alone after it is merged
                    if (
                        same
                        and self.batch_bytes_bound(held + group_held[: -len(groups[-1])])
                        + self.prefill_peak_bytes(len(groups[-1]) + 1, n_prompt, seq.budget_tokens)
                        > limit
                    ):
                        same = False
                    if (
                        not same
                        and self.batch_bytes_bound(held + group_held)
                        + self.prefill_peak_bytes(1, n_prompt, seq.budget_tokens)
                        > limit
                    ):
                        break
                self._queue.popleft()
                if same:
                    groups[-1].append(seq)
                else:
                    groups.append([seq])
                finals.append(seq.final_slots)
                group_held.append(self._prefill_slots(n_prompt, seq.budget_tokens))
                prefill_tokens += n_prompt
        return groups

    def _admit_paged(self) -> list[list[_Seq]]:
        """`_admit` for the paged layout: a request is admitted when the blocks its prefill takes now are
        free (next to the blocks the running rows take at their next step), not what it holds at its end."""
        cap = self.config.max_batch or 1 << 30
        widths = self._running_widths()  # the running batch's bookkeeping, with the rows admitted in this step
        free = self.pool.free_blocks - self._growth_blocks(1) - self._padding_blocks(widths)
        groups: list[list[_Seq]] = []
        committed = 0  # blocks the rows admitted in this step hold after their prefill
        before_last = 0  # ... before the last group
        last_peak = 0  # blocks the last group's rows hold at their prefill's peak (they peak together)
        prefill_tokens = 0
        with self._lock:
            while self._queue and len(self._running) + sum(map(len, groups)) < cap:
                seq = self._queue[0]
                n = len(seq.prefill_ids())
                if seq.unfit is not None:  # never a preempted one: fits_alone counted its recompute
                    self._queue.popleft()
                    self._fail(seq, "rejected", f"request cannot run under the KV memory limit: {seq.unfit}")
                    continue
                if groups and prefill_tokens + n > self.config.max_prefill_tokens:
                    break  # enough prefill for this step; running rows decode first
                peak = self.prefill_peak_blocks(n, seq.budget_tokens)
                # what it holds once merged, with the block its first decode step may take
                steady = self.num_layers * self._blocks(self._kept_slots(n + self._decodes([seq]), seq.budget_tokens))
                width = self._width(seq, n + 1)
                pad = self._added_padding_blocks(widths, width)
                peak = max(peak, steady + pad)
                steady += pad
                if groups and self._same_group(groups[-1][0], seq) and before_last + last_peak + peak <= free:
                    groups[-1].append(seq)  # prefilled with the last group: its rows peak together
                    last_peak += peak
                elif committed + peak <= free:
                    groups.append([seq])
                    before_last, last_peak = committed, peak
                else:
                    break  # wait for blocks: rows finish or are preempted
                self._queue.popleft()
                committed += steady
                prefill_tokens += n
                widths.append(width)
        return groups

    def _chunk_blocks(self, fed: int, chunk: int, budget: int | None, grows: bool) -> tuple[int, int]:
        """``(max(peak, after), after)``: blocks one row holds, all layers, while `chunk` tokens after the `fed` it
        holds are prefilled (the layers before the current one compressed, the current one its kept slots plus the
        chunk), and after it; `grows` adds the slot its first decode step writes (after the prompt's last chunk of
        a row that decodes again, `_decodes`)."""
        after = self.num_layers * self._blocks(self._kept_slots(fed + chunk + grows, budget))
        peak = (self.num_layers - 1) * self._blocks(self._kept_slots(fed + chunk, budget)) + self._blocks(
            self._kept_slots(fed, budget) + chunk
        )
        return max(peak, after), after

    @staticmethod
    def _decodes(seqs: list[_Seq]) -> bool:
        """Whether a row of `seqs` runs a decode step after its prefill (its prefill picks one token, so a row
        with one new token left ends there and its first decode never takes a block)."""
        return any(s.request.max_new_tokens - len(s.result.output_ids) > 1 for s in seqs)

    def _schedule_chunks(self) -> list[tuple[_Prefill, int]]:
        """`scheduler: mixed`: this step's prompt chunks, as vLLM V1 spends a step's token budget. Every running
        row's decode token comes first; the rest of `max_num_batched_tokens` goes to the prompts part-way fed
        (oldest first), then to queued requests (first come, first served; equal lengths fed join one chunk),
        each chunk as long as the tokens left and the free blocks allow (the running rows' next blocks kept).

        Blocks are taken chunk by chunk, but a queued request starts only when its whole prefill (its last
        chunk's peak) fits beside the rest of the prompts part-way fed and the blocks the running rows take while
        they are all fed (vLLM V0's whole-prompt admission, with the running rows' growth as its watermark): a
        prompt that took the last free blocks would be the first preempted when a running row grows, and fed
        again from its start."""
        tokens = self.config.max_num_batched_tokens - len(self._running)
        growth = self._growth_blocks(1)
        # the bookkeeping the running rows and the prompts part-way fed pad to once all are merged
        widths = self._running_widths() + [self._width(s, p.length + 1) for p in self._prefilling for s in p.group]
        free = self.pool.free_blocks - growth - self._padding_blocks(widths)
        committed = 0  # blocks the planned chunks add, once fed
        per_step = max(1, tokens)  # prompt tokens a step feeds while these rows run

        def held(p: _Prefill) -> int:
            return self.num_layers * self._blocks(self._kept_slots(p.fed, p.group[0].budget_tokens))

        def after(p: _Prefill, chunk: int, seqs: list[_Seq]) -> int:
            """Blocks one row of `p` holds after `chunk` more tokens."""
            end = p.fed + chunk == p.length
            return self._chunk_blocks(p.fed, chunk, p.group[0].budget_tokens, end and self._decodes(seqs))[1]

        def whole(p: _Prefill, seqs: list[_Seq]) -> int:
            """Blocks one row of `p` holds at its last chunk's peak (a budgeted row holds B + chunk in the layer
            being computed) or after it, whichever is more: what it takes by the end of its prefill."""
            last = min(p.length - p.fed, per_step)
            budget = p.group[0].budget_tokens
            return self._chunk_blocks(p.length - last, last, budget, self._decodes(seqs))[0]

        def longest(p: _Prefill, seqs: list[_Seq], most: int, base: int) -> int:
            """The longest chunk <= `most` tokens whose peak fits beside `base` committed blocks (0: none)."""
            budget, was = p.group[0].budget_tokens, held(p)
            lo, hi = 0, most
            while lo < hi:  # blocks grow with the chunk: bisect
                mid = (lo + hi + 1) // 2
                end = p.fed + mid == p.length
                peak, _ = self._chunk_blocks(p.fed, mid, budget, end and self._decodes(seqs))
                lo, hi = (mid, hi) if base + len(seqs) * (peak - was) <= free else (lo, mid - 1)
            return lo

        plan: list[tuple[_Prefill, int]] = []
        for p in self._prefilling:
            chunk = longest(p, p.group, min(p.length - p.fed, tokens // p.rows), committed)
            if chunk == 0:
                break  # the older prompt waits for blocks or tokens: so do the newer ones
            plan.append((p, chunk))
            tokens -= p.rows * chunk
            committed += p.rows * (after(p, chunk, p.group) - held(p))
        if len(plan) < len(self._prefilling):
            return plan
        # blocks the prompts part-way fed still take before they run, kept for them
        reserved = sum(p.rows * (whole(p, p.group) - held(p)) for p, _ in plan)
        feeding = sum(p.rows * (p.length - p.fed) for p in self._prefilling)  # prompt tokens still to feed

        def fits(extra_blocks: int, extra_tokens: int) -> bool:
            """Whether the reserve plus `extra_blocks` fits beside the running rows' growth until every prompt
            admitted so far, plus `extra_tokens` more, is fed."""
            steps = -(-(feeding + extra_tokens) // per_step)
            return reserved + extra_blocks + self._growth_blocks(steps) - growth <= free

        cap = self.config.max_batch or 1 << 30
        last: _Prefill | None = None  # the newest group of this step, which an equal request may join
        before_last = committed
        with self._lock:
            while self._queue and tokens > 0 and self.running < cap:
                seq = self._queue[0]
                if seq.unfit is not None:  # never a preempted one: fits_alone counted its recompute
                    self._queue.popleft()
                    self._fail(seq, "rejected", f"request cannot run under the KV memory limit: {seq.unfit}")
                    continue
                chunk = plan[-1][1] if last is not None else 0
                joined = last.group + [seq] if last is not None else []
                width = self._width(seq, len(seq.prefill_ids()) + 1)
                pad = self._added_padding_blocks(widths, width)
                if (
                    last is not None
                    and self._same_group(last.group[0], seq)
                    and tokens >= chunk
                    and fits(whole(last, [seq]) + pad, last.length)
                    and longest(last, joined, chunk, before_last) == chunk
                ):
                    last.group.append(seq)  # fed with the newest group: its rows peak together
                    committed = before_last + last.rows * after(last, chunk, last.group)
                    reserved += whole(last, [seq]) + pad
                else:
                    p = _Prefill([seq])
                    need = whole(p, p.group) + pad
                    chunk = longest(p, p.group, min(p.length, tokens), committed) if fits(need, p.length) else 0
                    if chunk == 0:
                        break  # wait for blocks: rows finish or are preempted
                    plan.append((p, chunk))
                    self._prefilling.append(p)
                    last, before_last = p, committed
                    committed += after(p, chunk, p.group)
                    reserved += need
                self._queue.popleft()
                widths.append(width)
                feeding += len(seq.prefill_ids())
                tokens -= chunk
        return plan

    def step(self) -> bool:
        """One scheduling iteration (aborts, admit, prefill, one decode step, retire); False when idle.

        Under ``scheduler: mixed`` the prefill phase feeds this step's prompt chunks (`_schedule_chunks`);
        a prompt's last chunk picks its first token and its rows join the decode step of the same step."""
        aborted = bool(self._aborts)
        if aborted:
            self._apply_aborts()
        if self.mixed:
            plan = self._schedule_chunks()
            while not plan and not self._running and len(self._prefilling) > 1:
                self._requeue(self._prefilling.pop())  # prompts part-way fed hold the pool: the newest yields
                plan = self._schedule_chunks()
        else:
            groups = self._admit() if self.pool is None else self._admit_paged()
            plan = [(_Prefill(g), None) for g in groups]
        if not plan and not self._running:
            if aborted:  # the aborted rows' slots and blocks are free now: the gauges say so
                self._record_state()
            return False
        now = self.clock()
        t0 = time.perf_counter()
        for p, chunk in plan:
            for seq in p.group:
                if seq.result.admitted_time_s is None:  # a preempted request keeps its first admission
                    seq.result.admitted_time_s = now
            self._prefill_chunk(p, chunk)
        t1 = time.perf_counter()
        if self.pool is not None:
            self._make_room_for_decode()
        if self._running:
            self._decode_step()
        self._stats["prefill_s"] += t1 - t0
        self._stats["decode_s"] += time.perf_counter() - t1
        self._record_state()
        return True

    def _caches(self) -> list:
        """Every live cache: the running batch's and those of the prompts part-way fed."""
        return [c for c in [self._cache, *(p.cache for p in self._prefilling)] if c is not None]

    def _kv_cache_bytes(self) -> int:
        return sum(c.kv_cache_bytes() for c in self._caches())

    def _record_state(self) -> None:
        """The live gauges now: running sequences (part-way prompts included), queued ones, KV bytes and slots of
        every live cache, and on the paged layout the pool's used and free blocks (the preallocated layout has no
        pool, so no block series)."""
        caches = self._caches()
        with _recording():
            self.metrics.set_running(self.running)
            self.metrics.set_queued(len(self._queue))
            self.metrics.set_kv_cache(sum(c.kv_cache_bytes() for c in caches), sum(c.held_tokens() for c in caches))
            if self.pool is not None:
                self.metrics.set_kv_blocks(used=self.pool.blocks_in_use, free=self.pool.free_blocks)

    def abort_all(self, message: str) -> int:
        """Fail every queued and running request (`error_kind="error"`); return how many. Call it only
        when `step()` is not running (the loop stopped)."""
        with self._lock:
            seqs = list(self._queue) + [s for p in self._prefilling for s in p.group] + self._running
            self._queue.clear()
        for p in self._prefilling:
            release_cache(p.cache)
        release_cache(self._cache)
        self._running, self._prefilling, self._cache, self._next_tokens = [], [], None, None
        for seq in seqs:
            self._fail(seq, "error", message)
        self._record_state()
        return len(seqs)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step until nothing is queued or running (tests, offline batches)."""
        for _ in range(max_steps):
            if not self.step() and not self._queue:
                return
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    # ------------------------------------------------------------------ phases
    @staticmethod
    def _same_group(a: _Seq, b: _Seq) -> bool:
        """Whether two requests prefill in one call: the same length fed and the same budget."""
        return len(a.prefill_ids()) == len(b.prefill_ids()) and a.budget_tokens == b.budget_tokens

    def _new_cache(self, group: list[_Seq] | None = None, paged: bool = True):
        """A cache for `group`'s rows (one budget; needed under `budget: per_request`), in the block pool (paged
        layout) unless `paged` is False."""
        pool = self.pool if paged else None
        if not self.per_request:
            return make_cache(self.config.policy, self.model, pool=pool, **self._cache_kwargs)
        budget = group[0].budget_tokens
        kwargs = {**self._cache_kwargs, "budget_tokens": budget, "max_length": budget}
        cache = make_cache(self.config.policy, self.model, pool=pool, **kwargs)
        cache.set_row_budgets([budget] * len(group))  # rows of other budgets merge into one batch
        return cache

    def _drop(self, p: _Prefill) -> None:
        if p in self._prefilling:
            self._prefilling.remove(p)

    def _prefill_chunk(self, p: _Prefill, chunk: int | None = None) -> None:
        """Forward the next `chunk` tokens of `p`'s prompts (equal lengths; None: all of them) into its cache,
        a fresh one at the first chunk; after the last, pick each row's first token and merge the rows that go
        on into the running batch. A policy that evicts compresses to its budget after every chunk (its
        layer's `attend`), so a chunk as long as the prompt is the whole-prompt prefill."""
        if p.cache is None:
            p.group = [s for s in p.group if s.preempted or not self._score_prompt(s)]  # score-only ones end here
            if not p.group:
                self._drop(p)
                return
            p.ids = torch.tensor([s.prefill_ids() for s in p.group], dtype=torch.long, device=self.device)  # (n, L)
        group, chunk = p.group, p.length - p.fed if chunk is None else chunk
        last = p.fed + chunk == p.length
        t0 = time.perf_counter()
        try:
            if p.cache is None:
                p.cache = self._new_cache(group)
            evicted0 = p.cache.layers[0].evicted_tokens
            with torch.inference_mode():
                out = self.model(
                    input_ids=p.ids[:, p.fed : p.fed + chunk], cache=p.cache, use_cache=True, logits_to_keep=1
                )  # positions follow the tokens the cache has seen
                first = pick_tokens(out.logits[:, -1, :], group, self.eos_token_id) if last else None  # (n, 1)
            tokens = first[:, 0].tolist() if last else []
        except Exception as e:  # noqa: BLE001 - every failure is reported per request
            release_cache(p.cache)
            self._drop(p)
            self._fail_all(group, e)
            return
        p.fed += chunk
        cache = p.cache
        t = self.clock()
        warm = sum(s.request.warmup for s in group)  # warm-up rows: phase "warmup", counted apart
        with _recording():
            self.metrics.observe_prefill(time.perf_counter() - t0, (len(group) - warm) * chunk, warm * chunk)
            self.metrics.add_evictions(int(cache.layers[0].evicted_tokens - evicted0))
            if last:
                self.metrics.add_generated_tokens(len(group) - warm)
                self.metrics.add_generated_tokens(warm, "warmup")
        self._stats["prefill_calls"] += 1
        # the chunk's peak beside every other live cache (the running batch's, the other part-way prompts'); a
        # cache's peak is since its first chunk, so under mixed this is an upper bound
        others = sum(c.kv_cache_bytes() for c in self._caches() if c is not cache)
        self._track_bytes(cache.peak_kv_cache_bytes + others)
        self._peak_running = max(self._peak_running, self.running)
        if not last:
            return
        self._drop(p)
        keep = []
        for i, (seq, tok) in enumerate(zip(group, tokens)):
            seq.held_slots = self._prefill_slots(len(seq.prefill_ids()), seq.budget_tokens)  # a recompute: + outputs
            if not self._emit(seq, tok, t):
                keep.append(i)
        if not keep:
            release_cache(cache)
            return
        if len(keep) < len(group):
            cache = select_rows(cache, keep)
            first = first[keep]
        self._cache = merge_rows(self._cache, cache)
        self._running.extend(group[i] for i in keep)
        self._next_tokens = first if self._next_tokens is None else torch.cat([self._next_tokens, first], dim=0)
        self._track_bytes(self._kv_cache_bytes())
        self._peak_running = max(self._peak_running, self.running)

    def _decode_step(self) -> None:
        """One token for every running sequence, each at its own position; retire finished ones."""
        t0 = time.perf_counter()
        evicted0 = self._cache.layers[0].evicted_tokens
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=self._next_tokens,
                    position_ids=row_positions(self._cache),
                    cache=self._cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                nxt = pick_tokens(out.logits[:, -1, :], self._running, self.eos_token_id)  # (rows, 1)
            tokens = nxt[:, 0].tolist()
        except Exception as e:  # noqa: BLE001
            release_cache(self._cache)
            running, self._running, self._cache, self._next_tokens = self._running, [], None, None
            self._fail_all(running, e)
            return
        t = self.clock()
        warm = sum(s.request.warmup for s in self._running)  # warm-up rows: phase "warmup", counted apart
        with _recording():
            self.metrics.observe_decode_step(time.perf_counter() - t0, len(self._running))
            self.metrics.add_generated_tokens(len(self._running) - warm)
            self.metrics.add_generated_tokens(warm, "warmup")
            self.metrics.add_evictions(int(self._cache.layers[0].evicted_tokens - evicted0))
        self._stats["decode_steps"] += 1
        if self.pool is not None:
            self._stats["block_steps"] += self.pool.blocks_in_use
        self._track_bytes(self._kv_cache_bytes())
        keep = []
        for i, (seq, tok) in enumerate(zip(self._running, tokens)):
            cap = seq.budget_tokens or self.row_capacity
            if cap is None or seq.held_slots < cap:
                seq.held_slots += 1  # the full cache's buffers grow past their capacity
            if not self._emit(seq, tok, t):
                keep.append(i)
        if len(keep) < len(self._running):
            self._running = [self._running[i] for i in keep]
            self._cache = self._select(self._cache, keep)
            nxt = nxt[keep] if keep else None
        self._next_tokens = nxt

    # ------------------------------------------------------------------ results
    def _score_prompt(self, seq: _Seq) -> bool:
        """The prompt's log-probabilities of a request that asks for them (`score_prompt`: a cache of its
        own, fed as decoding would); True when that finished the request (no new tokens, or a failure)."""
        req = seq.request
        if req.prompt_logprobs is None:
            return False
        try:
            lps, tops = score_prompt(
                self.model, self._new_cache([seq], paged=False), req.prompt_ids, req.prompt_logprobs, self.device
            )
        except Exception as e:  # noqa: BLE001 - reported on this request only
            self._fail_all([seq], e)
            return True
        seq.result.prompt_logprobs, seq.result.prompt_top_logprobs = lps, tops
        if req.max_new_tokens > 0:
            return False
        seq.result.finish_reason, seq.result.finish_time_s = "length", self.clock()
        self._stats[self._key(seq, "completed")] += 1
        self._done(seq)
        return True

    def _emit(self, seq: _Seq, token: int, t: float) -> bool:
        """Record one token; finish the request when done. Returns True when it finished (or its pick
        failed: `seq.sample_error`, then it fails alone and its row leaves the batch)."""
        r = seq.result
        if seq.sample_error is not None:
            self._fail(seq, "error", seq.sample_error)
            return True
        r.output_ids.append(int(token))
        r.token_times_s.append(t)
        if seq.request.logprobs is not None:
            if r.output_logprobs is None:
                r.output_logprobs, r.output_top_logprobs = [], []
            r.output_logprobs.append(seq.token_logprob)
            r.output_top_logprobs.append(seq.token_top_logprobs)
        self._stats[self._key(seq, "tokens")] += 1
        if seq.on_token is not None:
            try:
                seq.on_token(int(token), t)
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the engine
                pass
        eos = not seq.request.ignore_eos and self.eos_token_id is not None and int(token) == self.eos_token_id
        if eos or len(r.output_ids) >= seq.request.max_new_tokens:
            r.finish_reason = "eos" if eos else "length"
            r.finish_time_s = t
            with _recording():
                self.metrics.observe_ttft(max(0.0, r.token_times_s[0] - r.received_time_s), self._phase(seq))
                if len(r.output_ids) > 1:
                    self.metrics.observe_tpot(
                        max(0.0, t - r.token_times_s[0]) / (len(r.output_ids) - 1), self._phase(seq)
                    )
            self._stats[self._key(seq, "completed")] += 1
            self._done(seq)
            return True
        return False

    def _fail(self, seq: _Seq, kind: str, message: str) -> None:
        r = seq.result
        r.error_kind, r.error, r.finish_reason, r.finish_time_s = kind, message, "error", self.clock()
        self._stats[self._key(seq, "failed")] += 1
        self._done(seq)

    def _fail_all(self, seqs: list[_Seq], exc: BaseException) -> None:
        oom = isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        kind = "oom" if oom else "error"
        for seq in seqs:
            self._fail(seq, kind, f"{type(exc).__name__}: {exc}")
        if oom and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _done(self, seq: _Seq) -> None:
        try:
            seq.on_done(seq.result)
        except Exception:  # noqa: BLE001 - a caller's callback must not stop the engine
            pass

    def _track_bytes(self, nbytes: int) -> None:
        self._peak_bytes = max(self._peak_bytes, int(nbytes))


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


class EngineLoop:
    """Runs `engine.step()` on a daemon thread until `stop()`; idles on the engine's condition."""

    def __init__(self, engine: ContinuousBatchingEngine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-{engine.replica_id}", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.engine.step():
                    self.engine.wait_for_work(self.idle_wait_s)
        except BaseException as e:  # noqa: BLE001 - surfaced through `alive` / `error`
            self.error = e

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop stepping; requests still queued or running are answered with an error, never left waiting."""
        self._stop.set()
        with self.engine._lock:
            self.engine._lock.notify_all()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.engine.abort_all("the replica's engine was stopped (reconfigured or shut down)")
