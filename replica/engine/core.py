"""The engine's core: the queue and each request's lifecycle; it asks the scheduler for a plan, has the runner
feed it, and answers the requests (the only part that does, through `replica.engine.lifecycle`).

One `step()`: apply the aborts; `Scheduler.plan` (admissions, rejections, prompt chunks); the runner prefills each
chunk, and a prompt's last chunk picks its first token and joins its rows to the running batch; while the next
decode step does not fit (`Scheduler.preemption`), the newest row leaves (back to the head of the queue, prefilled
again later from its prompt and the tokens it generated); one decode step of every running row; finished rows
leave.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from replica.common.types import EngineConfig, GenerationRequest, GenerationResult
from replica.engine.in_flight import InFlight
from replica.engine.kv_budget import KV_BUDGETS
from replica.engine.lifecycle import Lifecycle, recording
from replica.engine.readout import EngineReadout
from replica.engine.request_queue import RequestQueue
from replica.engine.requests import Prefill, Sequence, StepPlan
from replica.engine.runner import ModelRunner
from replica.engine.scheduler import SCHEDULERS
from replica.metrics import NullMetrics
from scissorhands import POLICIES

__all__ = ["ContinuousBatchingEngine"]

log = logging.getLogger(__name__)


class ContinuousBatchingEngine(EngineReadout):
    """The continuous-batching engine of one replica (thread-safe `submit` and `abort`, single-threaded `step`);
    what it answers without stepping (`fits_alone`, `max_batch_for`, `running`, `fault`, ...) is its base,
    `replica.engine.readout.EngineReadout`.

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
        self.kv_memory_limit_bytes = config.kv_memory_limit_bytes_on(model, self.device)
        self.kv = KV_BUDGETS[config.kv_layout](config, self.runner, self.kv_memory_limit_bytes)
        self.pool = self.runner.pool = self.kv.pool
        self.block_bytes, self.budget_tokens = getattr(self.kv, "block_bytes", None), self.kv.budget_tokens
        if self.pool is None:
            with recording():  # no pool: no block series (not the pool of a paged engine these labels had before)
                self.metrics.clear_kv_blocks()
        if self.kv.prefix is None:
            with recording():  # no prefix cache: no series of one (not those of an engine these labels had before)
                self.metrics.clear_prefix_cache()
        self.scheduler = SCHEDULERS[config.scheduler](config)
        self.life = Lifecycle(clock, self.metrics, eos_token_id, self.device)
        self.queue = RequestQueue()
        self.flight = InFlight(self.runner)
        self.reset_stats()

    # ------------------------------------------------------------------ submission
    def submit(
        self,
        request: GenerationRequest,
        on_done: Callable[[GenerationResult], None],
        on_token: Callable[[int, float], None] | None = None,
    ) -> None:
        """Queue `request`; `on_done(result)` is called once, from the thread running `step()` (or, when the
        engine is dead, `healthy` False, from the calling thread before `submit` returns: refused with its
        `fault`), and `on_token(token_id, time_s)` for each token as it is decoded (before `on_done` for the
        last)."""
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
            pinned_tokens=self.kv.pinned_of(prompt),
        )
        fault = self.queue.put(seq, lambda: self.life.count(seq, "received"))
        if fault is not None:  # a dead engine refuses at once rather than queue a request nobody will step
            self.life.fail(seq, "error", fault)

    def stop_on_fault(self, message: str) -> int:
        """Mark the engine dead with `message` (naming the fault): every request it holds, queued or running, is
        answered with it now and later `submit`s are refused with it at once. Returns how many were answered.
        Call it only when `step()` is not running (its loop ended on the fault)."""
        return self.abort_all(message, fault=True)

    def abort(self, request_id: str) -> None:
        """Drop `request_id` (queued or running) at the start of the next step (any thread); its
        `on_done` gets `error_kind="aborted"`. Unknown or finished ids are ignored."""
        self.queue.end(request_id, "aborted")  # a `finish` asked first stands

    def finish(self, request_id: str) -> None:
        """End `request_id` at the start of the next step as completed (any thread): its client has what it asked
        (a stop string in its text), so it counts as completed with ``finish_reason="stop"``, not aborted. An
        `abort` of the same id after this (the client closing its stream) changes nothing. Unknown or finished
        ids are ignored."""
        self.queue.end(request_id, "stop")

    def _apply_aborts(self) -> None:
        """Fail the aborted requests; running ones leave the cache (`select_rows`), freeing their slots."""
        aborts, gone = self.queue.take_ends()
        gone += self.flight.remove(aborts)
        t = self.clock()
        for s in gone:
            if aborts[s.request.request_id] == "stop":
                self.life.complete(s, "stop", t)
            else:
                self.life.fail(s, "aborted", "the client aborted the request")

    # ------------------------------------------------------------------ one step
    def _plan(self) -> StepPlan:
        """This step's plan, applied to the queue: admitted and rejected requests leave it, rejected ones are
        answered, groups that stay part-way fed are registered; a stalled plan yields the newest such group."""
        while True:
            with self.queue.lock:  # submit only appends: the head the plan read stays the head
                plan = self._planned()
                self.queue.pop_front(plan.consumed)
                self.flight.admit(plan.chunks, plan.started)  # held from here until finished: `abort_all` sees them
            for seq, why in plan.rejected:
                self.life.fail(seq, "rejected", f"request cannot run under the KV memory limit: {why}")
            for p, _ in plan.chunks:
                if p.cache is None:  # before any prefill of this step takes blocks: its cached ones are claimed
                    self._start_from_cache(p)
            if plan.yield_newest:
                self._preempt(self.flight.prefilling[-1])  # prompts part-way fed hold the pool: the newest yields
            elif not plan.chunks and not self.flight.running and self.flight.prefilling:
                self._refuse_stalled(self.flight.prefilling[-1])  # alone with the whole pool: it never goes on
            else:
                return plan

    def _refuse_stalled(self, p: Prefill) -> None:
        """Answer `p`'s requests as rejected (their blocks freed): a prompt part-way fed that gets no chunk with
        nothing else running and no kept state left to reclaim would wait forever (`fits_alone` should refuse
        such a request at `submit`; this is the net under it)."""
        for seq in self.flight.remove({s.request.request_id for s in p.group}):
            self.life.fail(
                seq,
                "rejected",
                f"request cannot run under the KV memory limit: its prompt, fed {p.fed} of {p.length} tokens, "
                "gets no blocks for its next chunk with nothing else running",
            )

    def _planned(self) -> StepPlan:
        """`Scheduler.plan`; under ``kv_reuse: session_state`` kept states count as in use while it plans
        (`SessionStatePool.plan_free_blocks`) and each session's state is promised to one request of the step at
        most (`SessionStatePool.promise`). When work waits on blocks (`_waiting`: a prompt part-way fed gets no
        chunk, or nothing is admitted while requests wait below the batch cap) and a plan with the states free
        would feed or admit more, the oldest state is reclaimed and the step planned again (memory pressure), until
        the work goes on or no state is left; only then may the newest prompt part-way fed yield."""
        sessions = self.kv.sessions
        if sessions is None:
            return self.scheduler.plan(self._view(), self.kv)
        while True:
            sessions.begin_plan()
            plan = self.scheduler.plan(self._view(), self.kv)
            if not sessions.states or not self._waiting(plan):
                return plan
            sessions.begin_plan(states_free=True)
            free = self.scheduler.plan(self._view(), self.kv)
            if self._fed_part_way(free) <= self._fed_part_way(plan) and not (free.consumed and not plan.consumed):
                return plan  # the states free: no more work goes on, so they stay
            sessions.reclaim_oldest()

    def _fed_part_way(self, plan: StepPlan) -> int:
        """How many prompts part-way fed `plan` feeds a chunk of."""
        return sum(any(p is q for q in self.flight.prefilling) for p, _ in plan.chunks)

    def _waiting(self, plan: StepPlan) -> bool:
        """Whether `plan` leaves work waiting for blocks: a prompt part-way fed without a chunk, or requests
        queued below the batch cap with none admitted."""
        queued = not plan.consumed and len(self.queue) and self.flight.rows < self.scheduler.cap
        return bool(queued) or self._fed_part_way(plan) < len(self.flight.prefilling)

    def _start_from_cache(self, p: Prefill) -> None:
        """Start a group just admitted from its rows' cached blocks (`PagedBudget.attach_prefix`) and count the
        prefix cache's hit and miss tokens (the tokens its prefill takes from the cache, and those it computes); a
        fault fails the group alone (its prefill is then skipped)."""
        try:
            cached = self.kv.attach_prefix(p, self.runner.new_cache)
        except Exception as e:  # noqa: BLE001 - one group's failure never fails another request
            self.life.fail_all(p.group, e)
            p.group = []
            return
        if self.kv.sessions is not None:
            self._count_session(p, cached)
        if self.kv.prefix is None:
            return
        for seq in p.group:
            if not seq.preempted:  # the prompt's tokens served from the cache: a recompute's hits are not prompt
                seq.result.cached_prompt_tokens += cached
            self.life.add(self.life.key(seq, "prefix_cache_hit_tokens"), cached)
            self.life.add(self.life.key(seq, "prefix_cache_miss_tokens"), p.length - cached)
            with recording():
                self.metrics.add_prefix_cache_tokens(cached, p.length - cached, self.life.phase(seq))

    def _count_session(self, p: Prefill, cached: int) -> None:
        """Count a group's tokens taken from its session's kept state and those of the session's previous request
        it computes again (`PagedBudget.attach_prefix` set them on each result)."""
        for seq in p.group:
            if not seq.preempted:  # as `_count_prefix`: the first admission's prompt tokens only
                seq.result.cached_prompt_tokens += cached
            if cached:
                self.life.add(self.life.key(seq, "session_reused_tokens"), cached)
                self.life.add(self.life.key(seq, "session_state_hits"))
            elif seq.result.session_recomputed_tokens and not seq.preempted:
                self.life.add(self.life.key(seq, "session_recomputed_tokens"), seq.result.session_recomputed_tokens)
                self.life.add(self.life.key(seq, "session_state_misses"))

    def _keep_session(self, cache, i: int, seq: Sequence) -> None:
        """Keep row `i` of `cache` for `seq`'s session (`PagedBudget.keep_session`). A failure keeps nothing and
        loses no block (the row's blocks go back to the pool when the row leaves: `SessionStatePool.keep_row`), is
        counted (``session_state_keep_failures``) and logged, and never fails a request (the session's next request
        recomputes from text); so is a row that was not the row of its history (nothing kept), never silently."""
        try:
            kept = self.kv.keep_session(cache, i, seq)
        except Exception as e:  # noqa: BLE001 - a kept state only saves work: losing it is a recompute
            kept, why = False, f"{type(e).__name__}: {e}"
        else:
            why = "its row had not fed its history (prompt + answer but the last token)"
        if kept is False:  # a reuse check reads the count as what explains the next turn's recompute
            self.life.add("session_state_keep_failures")
            log.warning(
                "session %r: the state of request %r was not kept (%s); its next request recomputes it",
                seq.request.session_id,
                seq.request.request_id,
                why,
            )

    def step(self) -> bool:
        """One scheduling iteration (aborts, plan, prefill, preemptions, one decode step, retire); False when idle.

        Under ``scheduler: mixed`` the prefill phase feeds this step's prompt chunks; a prompt's last chunk picks
        its first token and its rows join the decode step of the same step."""
        aborted = bool(self.queue.ends)
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
        self.life.add("prefill_s", t1 - t0)
        self.life.add("decode_s", time.perf_counter() - t1)
        self._record_state()
        return True

    def _prefill_chunk(self, p: Prefill, chunk: int | None = None) -> None:
        """Feed the next `chunk` tokens of `p`'s prompts (None: all of them); after the last, answer each row's
        first token and join the rows that go on to the running batch."""
        if p.cache is None:
            p.group = [s for s in p.group if s.preempted or not self._score_prompt(s)]  # score-only ones end here
            if not p.group:
                self.flight.drop(p)
                return
        group, chunk = p.group, p.length - p.fed if chunk is None else chunk
        last = p.fed + chunk == p.length
        fwd = self.runner.prefill(p, chunk)
        if fwd.error is not None:
            self.flight.drop(p)
            self.life.fail_all(group, fwd.error)
            return
        t = self.clock()
        self.kv.register_prefix(p, chunk)  # its full blocks, computed now, are cached for the next prompts
        for seq in group:
            seq.result.prefilled_prompt_tokens += chunk
        self.life.prefilled(group, chunk, fwd, last)
        # the chunk's peak beside every other live cache (the running batch's, the other part-way prompts'); a
        # cache's peak is since its first chunk, so under mixed this is an upper bound
        if self.kv.prefix is None:
            others = sum(c.kv_cache_bytes() for c in self.flight.caches() if c is not p.cache)
            self.life.track_bytes(p.cache.peak_kv_cache_bytes + others)
        else:  # rows share blocks: the pool counts each once (a full cache's chunk peaks at its end)
            self.life.track_bytes(self.flight.kv_cache_bytes())
        self.life.track_running(self.running)
        if not last:
            return
        keep = []
        for i, (seq, tok) in enumerate(zip(group, fwd.tokens)):
            seq.held_slots = self.kv.prefill_slots(
                len(seq.prefill_ids()), seq.kept_tokens, seq.final_slots
            )  # a recompute: + outputs
            if not self.life.emit(seq, tok, t):
                keep.append(i)
            else:  # before the row leaves: its blocks move to the session's kept state
                self._keep_session(p.cache, i, seq)
        self.flight.join(p, fwd.picked, keep)  # then `p` is dropped: a fault in the merge leaves it held
        if keep:
            self.life.track_bytes(self.flight.kv_cache_bytes())
            self.life.track_running(self.running)

    def _decode_step(self) -> None:
        """One token for every running sequence, each at its own position; retire finished ones."""
        fwd = self.runner.decode(self._running)
        if fwd.error is not None:  # the runner freed the batch's cache: every row leaves
            running, self.flight.running = self.flight.running, []
            self.life.fail_all(running, fwd.error)
            return
        t = self.clock()
        self.life.decoded(self._running, fwd, self.pool.blocks_in_use if self.pool is not None else 0)
        self.life.track_bytes(self.flight.kv_cache_bytes())
        keep = []
        for i, (seq, tok) in enumerate(zip(self._running, fwd.tokens)):
            seq.held_slots = self.kv.held_after_decode(seq)  # the full cache's buffers grow past their capacity
            if not self.life.emit(seq, tok, t):
                keep.append(i)
            else:  # before the row leaves: its blocks move to the session's kept state
                self._keep_session(self.runner.cache, i, seq)
        self.flight.keep_running(keep)

    def _score_prompt(self, seq: Sequence) -> bool:
        """The prompt's log-probabilities of a request that asks for them (`Lifecycle.score`); True when that
        finished the request (no new tokens, or a failure)."""
        return seq.request.prompt_logprobs is not None and self.life.score(seq, self._scored)

    def _scored(self, seq: Sequence) -> tuple[list, list]:
        """`ModelRunner.score_prompt`, its cache's peak counted beside every live cache in the reported peak."""
        lps, tops, peak_bytes = self.runner.score_prompt(seq)
        self.life.track_bytes(peak_bytes + self.flight.kv_cache_bytes())
        return lps, tops

    # ------------------------------------------------------------------ preemption (paged layout)
    def _make_room_for_decode(self) -> None:
        """Preempt until the next decode step fits (`Scheduler.preemption`)."""
        while (victim := self.scheduler.preemption(self._view(), self.kv)) is not None:
            self._preempt(victim)

    def _preempt(self, victim: Prefill | Sequence) -> None:
        """`victim`'s requests go back to the head of the queue, in order (`InFlight.preempt`: its blocks freed),
        the tokens their next prefill computes again counted as recomputed."""
        taken = self.flight.preempt(victim)
        for _, recomputed in taken:
            self.life.preempted(recomputed)
        self.queue.push_front(seq for seq, _ in taken)

    # ------------------------------------------------------------------ state and counters
    def _record_state(self) -> None:
        """The live gauges now: running sequences (part-way prompts included), queued ones, KV bytes and slots of
        every live cache, and on the paged layout the pool's used and free blocks (the preallocated layout has no
        pool, so no block series)."""
        caches = self.flight.caches()
        self.kv.track_held()
        with recording():
            self.metrics.set_running(self.running)
            self.metrics.set_queued(len(self.queue))
            self.metrics.set_kv_cache(self.flight.kv_cache_bytes(), sum(c.held_tokens() for c in caches))
            if self.pool is not None:
                self.metrics.set_kv_blocks(used=self.pool.blocks_in_use, free=self.pool.free_blocks)
            if self.kv.prefix is not None:
                reclaimed = self.kv.prefix.reclaimed_blocks
                if reclaimed < self._reclaimed_seen:  # `reset_stats` zeroed the pool's count: count from there
                    self._reclaimed_seen = 0
                self.metrics.set_prefix_cache(self.kv.prefix.cached_blocks, reclaimed - self._reclaimed_seen)
                self._reclaimed_seen = reclaimed

    def reset_stats(self) -> None:
        """Zero the counters and peaks reported by `stats()` (between sweep points)."""
        self.life.reset()
        self.kv.reset_peak()
        self._reclaimed_seen = 0  # the prefix cache's reclaimed blocks already recorded (the counter's increments)

    def stats(self) -> dict:
        """Counters since `reset_stats` (units in the names). Request counts and generated tokens
        are of measured requests; the load generator's warm-up requests are in the ``warmup_*``
        keys. Steps, times and peaks are the engine's, whichever requests ran in them."""
        with self.queue.lock:  # received is counted under it: the counts and the queue agree
            s, queued = self.life.snapshot(), len(self.queue)
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
            "kv_cache_bytes": self.flight.kv_cache_bytes(),
            **Lifecycle.request_stats(s),
            "kv_layout": self.config.kv_layout,
            **self.scheduler.stats(),
            **self.kv.pool_stats(s.get("decode_steps", 0), s.get("block_steps", 0)),
            **{k: s.get(k, 0) for k in ("preemptions", "recomputed_tokens")},
            # tokens the policy evicted (warm-up rows' too); None for a policy that keeps every token
            "evicted_tokens": s.get("evicted_tokens", 0) if POLICIES[self.config.policy].evicts else None,
            **self._prefix_stats(s),
            **self.kv.held_stats(),
        }

    def _prefix_stats(self, s: dict) -> dict:
        """`stats()`'s prefix cache keys: whether it is on; the prompt tokens of measured requests' prefills taken
        from it (hits) and computed (misses), counted at each admission (a preempted request's recompute again);
        the pool blocks holding cached entries now, and the blocks of idle entries reclaimed for other rows since
        `reset_stats`. None for the counts when it is off."""
        on = self.kv.prefix is not None
        out = {"prefix_caching": on}
        for k in ("prefix_cache_hit_tokens", "prefix_cache_miss_tokens"):
            out[k] = s.get(k, 0) if on else None
        if self.kv.sessions is not None:  # kv_reuse: session_state (its keys only then)
            for k in (
                "session_reused_tokens",
                "session_recomputed_tokens",
                "session_state_hits",
                "session_state_misses",
                "session_state_keep_failures",
            ):
                out[k] = s.get(k, 0)
        return {**out, **self.kv.prefix_stats()}

    def abort_all(self, message: str, fault: bool = False) -> int:
        """Fail every request the engine holds and has not answered, queued or taken from the queue (wherever a
        fault in a step left it), with `error_kind="error"`; return how many. Call it only when `step()` is not
        running (the loop stopped). `fault`: refuse every later request with `message`."""
        queued = self.queue.drain(message if fault else None)
        held = self.flight.clear()  # a preempted request is queued and held: answered once
        ids = {id(s) for s in held}
        seqs = held + [s for s in queued if id(s) not in ids]
        for seq in seqs:
            self.life.fail(seq, "error", message)
        self._record_state()
        return len(seqs)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step until nothing is queued or running (tests, offline batches)."""
        for _ in range(max_steps):
            if not self.step() and not len(self.queue):
                return
        raise RuntimeError(f"engine still busy after {max_steps} steps")
