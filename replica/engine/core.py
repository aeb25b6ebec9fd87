"""The engine's core: the queue and each request's lifecycle; it asks the scheduler for a plan, has the runner
feed it, and answers the requests (the only part that does, through `replica.engine.lifecycle`).

One `step()`: apply the aborts; `Scheduler.plan` (admissions, rejections, prompt chunks); the runner prefills each
chunk, and a prompt's last chunk picks its first token and joins its rows to the running batch; while the next
decode step does not fit (`Scheduler.preemption`), the newest row leaves (back to the head of the queue, prefilled
again later from its prompt and the tokens it generated); one decode step of every running row; finished rows
leave.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from replica.engine.kv_budget import KV_BUDGETS
from replica.engine.lifecycle import Lifecycle, recording
from replica.engine.limits import resolve_kv_limit_bytes
from replica.engine.requests import EngineView, Prefill, Sequence, StepPlan
from replica.engine.runner import ModelRunner
from replica.engine.scheduler import SCHEDULERS
from replica.metrics import NullMetrics
from replica.types import EngineConfig, GenerationRequest, GenerationResult

__all__ = ["ContinuousBatchingEngine"]


class ContinuousBatchingEngine:
    """The continuous-batching engine of one replica (thread-safe `submit` and `abort`, single-threaded `step`).

    Args:
        model: a transformers causal LM (its attention implementation becomes ``"scissorhands"``).
        config: `EngineConfig`.
        eos_token_id: stops a request that does not set `ignore_eos` (None: never).
        clock: seconds, used for every timestamp (default `time.time`, comparable across processes
            of one machine and, with synchronized clocks, across machines).
        replica_id: recorded in every result.
        metrics: live metrics (a `replica.metrics.ReplicaMetrics`, or anything with its methods);
            None records nothing (`replica.metrics.NullMetrics`). A failing recorder never stops the
            engine (`replica.engine.lifecycle.recording`).

    Raises:
        ValueError: from `make_cache` for an invalid policy parameter or budget; a paged pool under one block a layer.
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
        self.model, self.config, self.eos_token_id = model, config, eos_token_id
        self.clock, self.replica_id = clock, replica_id
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.runner = ModelRunner(model, config, eos_token_id)
        self.device, self.num_layers = self.runner.device, self.runner.num_layers
        self.slot_bytes, self.bookkeeping_slot_bytes = self.runner.slot_bytes, self.runner.bookkeeping_slot_bytes
        self.kv_memory_limit_bytes = resolve_kv_limit_bytes(model, config, self.device)
        self.kv = KV_BUDGETS[config.kv_layout](
            config,
            self.num_layers,
            self.slot_bytes,
            self.bookkeeping_slot_bytes,
            self.kv_memory_limit_bytes,
            self.runner.check_budget,
        )
        self.pool = self.runner.pool = self.kv.pool
        self.block_bytes = getattr(self.kv, "block_bytes", None)
        self.budget_tokens, self.per_request = self.kv.budget_tokens, self.kv.per_request
        self.row_capacity = self.kv.row_capacity
        if self.pool is None:
            with recording():  # no pool: no block series (not the pool of a paged engine these labels had before)
                self.metrics.clear_kv_blocks()
        self.scheduler = SCHEDULERS[config.scheduler](config)
        self.mixed = config.scheduler == "mixed"
        self.life = Lifecycle(clock, self.metrics, eos_token_id, self.device)
        self._lock = threading.Condition()
        self._queue: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []  # in the order of the running batch's rows
        self._prefilling: list[Prefill] = []  # scheduler: mixed, prompts part-way fed (oldest first)
        self._aborts: dict[str, str] = {}  # request id -> how it ends at the next step: "aborted" or "stop"
        self.fault: str | None = None  # why the engine stopped serving (`stop_on_fault`); None while healthy
        self.reset_stats()

    # ------------------------------------------------------------------ the KV budget's answers
    def budget_of(self, prompt_tokens: int, max_new_tokens: int) -> int | None:
        """A request's B (`KVBudget.budget_of`)."""
        return self.kv.budget_of(prompt_tokens, max_new_tokens)

    def final_slots(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Slots a sequence's row needs at most (`KVBudget.final_slots`)."""
        return self.kv.final_slots(prompt_tokens, max_new_tokens)

    def fits_alone(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """Why a request of these lengths can never run under the KV memory limit, even alone, as this engine's
        scheduler feeds it (None: it can; `KVBudget.fits_alone`)."""
        return self.kv.fits_alone(prompt_tokens, max_new_tokens, self.scheduler.chunk_tokens())

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Largest batch of identical requests the memory limit (and `max_batch`) admits at once: on the paged
        layout, as many as hold their final blocks together (so none is preempted)."""
        cap = self.config.max_batch or 1 << 30
        if self.kv_memory_limit_bytes is None:
            return cap
        return self.kv.max_batch_for(prompt_tokens, max_new_tokens, cap, self.scheduler.chunk_tokens())

    # ------------------------------------------------------------------ the running batch (read by tests)
    @property
    def _cache(self):
        return self.runner.cache

    def _new_cache(self, group: list[Sequence] | None = None, paged: bool = True):
        return self.runner.new_cache(group, paged)

    def _view(self) -> EngineView:
        return EngineView(self._running, self.runner.cache, self._prefilling, self._queue)

    # ------------------------------------------------------------------ submission
    def submit(
        self,
        request: GenerationRequest,
        on_done: Callable[[GenerationResult], None],
        on_token: Callable[[int, float], None] | None = None,
    ) -> None:
        """Queue `request`; `on_done(result)` is called once, from the thread running `step()`, and
        `on_token(token_id, time_s)` for each token as it is decoded (before `on_done` for the last)."""
        prompt, new = len(request.prompt_ids), request.max_new_tokens
        result = GenerationResult(request.request_id, prompt, received_time_s=self.clock(), replica_id=self.replica_id)
        seq = Sequence(
            request,
            result,
            on_done,
            self.kv.final_slots(prompt, new),
            self.kv.budget_of(prompt, new),
            on_token=on_token,
            unfit=self.fits_alone(prompt, new),
        )
        with self._lock:
            self.life.count(seq, "received")
            fault = self.fault
            if fault is None:
                self._queue.append(seq)
                self._lock.notify_all()
        if fault is not None:  # a dead engine refuses at once rather than queue a request nobody will step
            self.life.fail(seq, "error", fault)

    @property
    def healthy(self) -> bool:
        """False once the engine stopped on a fault (`stop_on_fault`): it refuses every request."""
        return self.fault is None

    def stop_on_fault(self, message: str) -> int:
        """Mark the engine dead with `message` (naming the fault): every request it holds, queued or running, is
        answered with it now and later `submit`s are refused with it at once. Returns how many were answered.
        Call it only when `step()` is not running (its loop ended on the fault)."""
        with self._lock:
            self.fault = message
        return self.abort_all(message)

    def abort(self, request_id: str) -> None:
        """Drop `request_id` (queued or running) at the start of the next step (any thread); its
        `on_done` gets `error_kind="aborted"`. Unknown or finished ids are ignored."""
        with self._lock:
            self._aborts.setdefault(request_id, "aborted")  # a `finish` asked first stands
            self._lock.notify_all()

    def finish(self, request_id: str) -> None:
        """End `request_id` at the start of the next step as completed (any thread): its client has what it asked
        (a stop string in its text), so it counts as completed with ``finish_reason="stop"``, not aborted. An
        `abort` of the same id after this (the client closing its stream) changes nothing. Unknown or finished
        ids are ignored."""
        with self._lock:
            self._aborts[request_id] = "stop"
            self._lock.notify_all()

    def _apply_aborts(self) -> None:
        """Fail the aborted requests; running ones leave the cache (`select_rows`), freeing their slots."""
        with self._lock:
            if not self._aborts:
                return
            aborts, self._aborts = self._aborts, {}
            gone = [s for s in self._queue if s.request.request_id in aborts]
            for s in gone:
                self._queue.remove(s)
        for p in list(self._prefilling):
            rows = [i for i, s in enumerate(p.group) if s.request.request_id not in aborts]
            if len(rows) < p.rows:
                gone += [s for s in p.group if s.request.request_id in aborts]
                if not rows:
                    self.runner.release_group(p)
                    self._prefilling.remove(p)
                    continue
                self.runner.keep_prefill_rows(p, rows)
        keep = [i for i, s in enumerate(self._running) if s.request.request_id not in aborts]
        if len(keep) < len(self._running):
            gone += [s for s in self._running if s.request.request_id in aborts]
            self._running = [self._running[i] for i in keep]
            self.runner.keep(keep)
        t = self.clock()
        for s in gone:
            if aborts[s.request.request_id] == "stop":
                self.life.complete(s, "stop", t)
            else:
                self.life.fail(s, "aborted", "the client aborted the request")

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
        return self.life.counts["tokens"]

    # ------------------------------------------------------------------ one step
    def _plan(self) -> StepPlan:
        """This step's plan, applied to the queue: admitted and rejected requests leave it, rejected ones are
        answered, groups that stay part-way fed are registered; a stalled plan yields the newest such group."""
        while True:
            with self._lock:
                plan = self.scheduler.plan(self._view(), self.kv)
                for _ in range(plan.consumed):
                    self._queue.popleft()
            self._prefilling.extend(plan.started)
            for seq, why in plan.rejected:
                self.life.fail(seq, "rejected", f"request cannot run under the KV memory limit: {why}")
            if not plan.yield_newest:
                return plan
            self._requeue(self._prefilling.pop())  # prompts part-way fed hold the pool: the newest yields

    def step(self) -> bool:
        """One scheduling iteration (aborts, plan, prefill, preemptions, one decode step, retire); False when idle.

        Under ``scheduler: mixed`` the prefill phase feeds this step's prompt chunks; a prompt's last chunk picks
        its first token and its rows join the decode step of the same step."""
        aborted = bool(self._aborts)
        if aborted:
            self._apply_aborts()
        plan = self._plan()
        if not plan.chunks and not self._running:
            if aborted:  # the aborted rows' slots and blocks are free now: the gauges say so
                self._record_state()
            return False
        now = self.clock()
        t0 = time.perf_counter()
        for p, chunk in plan.chunks:
            for seq in p.group:
                if seq.result.admitted_time_s is None:  # a preempted request keeps its first admission
                    seq.result.admitted_time_s = now
            self._prefill_chunk(p, chunk)
        t1 = time.perf_counter()
        self._make_room_for_decode()
        if self._running:
            self._decode_step()
        self.life.counts["prefill_s"] += t1 - t0
        self.life.counts["decode_s"] += time.perf_counter() - t1
        self._record_state()
        return True

    def _drop(self, p: Prefill) -> None:
        if p in self._prefilling:
            self._prefilling.remove(p)

    def _prefill_chunk(self, p: Prefill, chunk: int | None = None) -> None:
        """Feed the next `chunk` tokens of `p`'s prompts (None: all of them); after the last, answer each row's
        first token and join the rows that go on to the running batch."""
        if p.cache is None:
            p.group = [s for s in p.group if s.preempted or not self._score_prompt(s)]  # score-only ones end here
            if not p.group:
                self._drop(p)
                return
        group, chunk = p.group, p.length - p.fed if chunk is None else chunk
        last = p.fed + chunk == p.length
        fwd = self.runner.prefill(p, chunk)
        if fwd.error is not None:
            self._drop(p)
            self.life.fail_all(group, fwd.error)
            return
        t = self.clock()
        warm = sum(s.request.warmup for s in group)  # warm-up rows: phase "warmup", counted apart
        with recording():
            self.metrics.observe_prefill(fwd.seconds, (len(group) - warm) * chunk, warm * chunk)
            self.metrics.add_evictions(fwd.evicted_tokens)
            if last:
                self.metrics.add_generated_tokens(len(group) - warm)
                self.metrics.add_generated_tokens(warm, "warmup")
        self.life.counts["prefill_calls"] += 1
        # the chunk's peak beside every other live cache (the running batch's, the other part-way prompts'); a
        # cache's peak is since its first chunk, so under mixed this is an upper bound
        others = sum(c.kv_cache_bytes() for c in self.runner.caches(self._prefilling) if c is not p.cache)
        self.life.track_bytes(p.cache.peak_kv_cache_bytes + others)
        self.life.track_running(self.running)
        if not last:
            return
        self._drop(p)
        keep = []
        for i, (seq, tok) in enumerate(zip(group, fwd.tokens)):
            seq.held_slots = self.kv.prefill_slots(len(seq.prefill_ids()), seq.budget_tokens)  # a recompute: + outputs
            if not self.life.emit(seq, tok, t):
                keep.append(i)
        self.runner.join(p, fwd.picked, keep)
        if keep:
            self._running.extend(group[i] for i in keep)
            self.life.track_bytes(self._kv_cache_bytes())
            self.life.track_running(self.running)

    def _decode_step(self) -> None:
        """One token for every running sequence, each at its own position; retire finished ones."""
        fwd = self.runner.decode(self._running)
        if fwd.error is not None:
            running, self._running = self._running, []
            self.life.fail_all(running, fwd.error)
            return
        t = self.clock()
        warm = sum(s.request.warmup for s in self._running)  # warm-up rows: phase "warmup", counted apart
        with recording():
            self.metrics.observe_decode_step(fwd.seconds, len(self._running))
            self.metrics.add_generated_tokens(len(self._running) - warm)
            self.metrics.add_generated_tokens(warm, "warmup")
            self.metrics.add_evictions(fwd.evicted_tokens)
        self.life.counts["decode_steps"] += 1
        if self.pool is not None:
            self.life.counts["block_steps"] += self.pool.blocks_in_use
        self.life.track_bytes(self._kv_cache_bytes())
        keep = []
        for i, (seq, tok) in enumerate(zip(self._running, fwd.tokens)):
            seq.held_slots = self.kv.held_after_decode(seq)  # the full cache's buffers grow past their capacity
            if not self.life.emit(seq, tok, t):
                keep.append(i)
        if len(keep) < len(self._running):
            self._running = [self._running[i] for i in keep]
            self.runner.keep(keep)

    def _score_prompt(self, seq: Sequence) -> bool:
        """The prompt's log-probabilities of a request that asks for them; True when that finished the request
        (no new tokens, or a failure)."""
        if seq.request.prompt_logprobs is None:
            return False
        try:
            seq.result.prompt_logprobs, seq.result.prompt_top_logprobs = self.runner.score_prompt(seq)
        except Exception as e:  # noqa: BLE001 - reported on this request only
            self.life.fail_all([seq], e)
            return True
        if seq.request.max_new_tokens > 0:
            return False
        self.life.finish_scored(seq)
        return True

    # ------------------------------------------------------------------ preemption (paged layout)
    def _make_room_for_decode(self) -> None:
        """Preempt until the next decode step fits (`Scheduler.preemption`): a group part-way fed goes back to the
        queue whole; a running row leaves the batch and goes back to the head of the queue, recomputed later."""
        while (victim := self.scheduler.preemption(self._view(), self.kv)) is not None:
            if isinstance(victim, Prefill):
                self._requeue(self._prefilling.pop())
                continue
            seq = self._running.pop()
            self.runner.keep(list(range(len(self._running))))
            seq.preempted = True
            # every token whose KV it held is computed again: the prompt and the outputs fed so far
            self._count_preemption(len(seq.request.prompt_ids) + len(seq.result.output_ids) - 1)
            with self._lock:
                self._queue.appendleft(seq)

    def _requeue(self, p: Prefill) -> None:
        """Preempt a group part-way prefilled: its blocks back to the pool, its requests back to the head of
        the queue (in order), their chunks fed so far counted as recomputed."""
        self.runner.release_group(p)
        for seq in p.group:
            seq.preempted = True  # scored already (prompt_logprobs): the next prefill only feeds
            self._count_preemption(p.fed)
        with self._lock:
            self._queue.extendleft(reversed(p.group))

    def _count_preemption(self, recomputed: int) -> None:
        self.life.counts["preemptions"] += 1
        self.life.counts["recomputed_tokens"] += recomputed
        with recording():
            self.metrics.add_preemption(recomputed)

    # ------------------------------------------------------------------ state and counters
    def _kv_cache_bytes(self) -> int:
        return sum(c.kv_cache_bytes() for c in self.runner.caches(self._prefilling))

    def _record_state(self) -> None:
        """The live gauges now: running sequences (part-way prompts included), queued ones, KV bytes and slots of
        every live cache, and on the paged layout the pool's used and free blocks (the preallocated layout has no
        pool, so no block series)."""
        caches = self.runner.caches(self._prefilling)
        with recording():
            self.metrics.set_running(self.running)
            self.metrics.set_queued(len(self._queue))
            self.metrics.set_kv_cache(sum(c.kv_cache_bytes() for c in caches), sum(c.held_tokens() for c in caches))
            if self.pool is not None:
                self.metrics.set_kv_blocks(used=self.pool.blocks_in_use, free=self.pool.free_blocks)

    def reset_stats(self) -> None:
        """Zero the counters and peaks reported by `stats()` (between sweep points)."""
        self.life.reset()
        if self.pool is not None:
            self.pool.peak_blocks_in_use = self.pool.blocks_in_use

    def stats(self) -> dict:
        """Counters since `reset_stats` (units in the names). Request counts and generated tokens
        are of measured requests; the load generator's warm-up requests are in the ``warmup_*``
        keys. Steps, times and peaks are the engine's, whichever requests ran in them."""
        with self._lock:
            s = dict(self.life.counts)
            queued = len(self._queue)
        pool = self.pool
        return {
            "replica_id": self.replica_id,
            "policy": self.config.policy,
            "budget_tokens": self.budget_tokens,  # None under budget: per_request (each request its own)
            "budget": self.config.budget,
            "slot_bytes": self.slot_bytes,
            "kv_memory_limit_bytes": self.kv_memory_limit_bytes,
            "running_sequences": self.running,
            "queued_requests": queued,
            "peak_running_sequences": self.life.peak_running,
            "peak_kv_cache_bytes": self.life.peak_bytes,
            "kv_cache_bytes": self._kv_cache_bytes(),
            **{f"{k}_requests": s.get(k, 0) for k in ("received", "completed", "failed")},
            "generated_tokens": s.get("tokens", 0),
            **{f"warmup_{k}_requests": s.get(f"warmup_{k}", 0) for k in ("received", "completed", "failed")},
            "warmup_generated_tokens": s.get("warmup_tokens", 0),
            "decode_steps": s.get("decode_steps", 0),
            "prefill_calls": s.get("prefill_calls", 0),
            "prefill_s": s.get("prefill_s", 0.0),  # wall time in prefill phases
            "decode_s": s.get("decode_s", 0.0),  # wall time in decode steps
            "kv_layout": self.config.kv_layout,
            "scheduler": self.config.scheduler,
            "max_num_batched_tokens": self.config.max_num_batched_tokens if self.mixed else None,
            "block_tokens": self.config.block_tokens if pool is not None else None,
            "kv_pool_blocks": pool.usable_blocks if pool is not None else None,
            "peak_kv_blocks_in_use": pool.peak_blocks_in_use if pool is not None else None,
            "mean_kv_blocks_in_use": (
                s.get("block_steps", 0) / s["decode_steps"] if pool is not None and s.get("decode_steps") else None
            ),
            "preemptions": s.get("preemptions", 0),
            "recomputed_tokens": s.get("recomputed_tokens", 0),
        }

    def abort_all(self, message: str) -> int:
        """Fail every queued and running request (`error_kind="error"`); return how many. Call it only
        when `step()` is not running (the loop stopped)."""
        with self._lock:
            seqs = list(self._queue) + [s for p in self._prefilling for s in p.group] + self._running
            self._queue.clear()
        try:
            self.runner.release(self._prefilling)
        except Exception:  # noqa: BLE001 - a cache broken by the fault must not keep its requests waiting
            pass
        self._running, self._prefilling = [], []
        for seq in seqs:
            self.life.fail(seq, "error", message)
        self._record_state()
        return len(seqs)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step until nothing is queued or running (tests, offline batches)."""
        for _ in range(max_steps):
            if not self.step() and not self._queue:
                return
        raise RuntimeError(f"engine still busy after {max_steps} steps")
