"""What an engine answers without stepping (part of the core): the KV budget's answers for a request's lengths
(the admission checks a replica and the HTTP API ask before they submit) and the engine's state (requests running
and queued, its fault, the tokens generated), read from the core's parts. `ContinuousBatchingEngine` is one."""

from __future__ import annotations

import threading

from replica.common.types import EngineConfig, Refusal
from replica.engine.in_flight import InFlight
from replica.engine.kv_base import KVBudget
from replica.engine.lifecycle import Lifecycle
from replica.engine.request_queue import RequestQueue
from replica.engine.requests import EngineView, Prefill, Sequence
from replica.engine.runner import ModelRunner
from replica.engine.scheduler import Scheduler

__all__ = ["EngineReadout"]


class EngineReadout:
    """The read side of `ContinuousBatchingEngine`: every method reads the parts the core builds (`config`, `kv`,
    `scheduler`, `runner`, `queue`, `flight`, `life`, `kv_memory_limit_bytes`) and changes none of them."""

    config: EngineConfig
    kv: KVBudget
    scheduler: Scheduler
    runner: ModelRunner
    queue: RequestQueue
    flight: InFlight
    life: Lifecycle
    kv_memory_limit_bytes: int | None

    # ------------------------------------------------------------------ the KV budget's answers
    def budget_of(self, prompt_tokens: int, max_new_tokens: int) -> int | None:
        """A request's B (`KVBudget.budget_of`)."""
        return self.kv.budget_of(prompt_tokens, max_new_tokens)

    def final_slots(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Slots a sequence's row needs at most (`KVBudget.final_slots`)."""
        return self.kv.final_slots(prompt_tokens, max_new_tokens)

    def fits_alone(self, prompt_tokens: int, max_new_tokens: int) -> Refusal | None:
        """Why a request of these lengths can never run under the KV memory limit, even alone, as this engine's
        scheduler feeds it (None: it can; `KVBudget.fits_alone`): a `Refusal` of kind ``kv_memory`` or ``policy``."""
        return self.kv.fits_alone(prompt_tokens, max_new_tokens, self.scheduler.chunk_tokens())

    def max_new_tokens_for(self, prompt_tokens: int, most: int) -> int:
        """The most new tokens (at most `most`) a request of `prompt_tokens` may ask and still run alone; 0: none."""
        return self.kv.max_new_tokens_for(prompt_tokens, most, self.scheduler.chunk_tokens())

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

    @property
    def _lock(self) -> threading.Condition:
        return self.queue.lock

    @property
    def _running(self) -> list[Sequence]:
        return self.flight.running

    @property
    def _prefilling(self) -> list[Prefill]:
        return self.flight.prefilling

    def _view(self) -> EngineView:
        return self.flight.view(self.queue.waiting)

    # ------------------------------------------------------------------ its state
    @property
    def fault(self) -> str | None:
        """Why the engine stopped serving (`stop_on_fault`); None while it is healthy."""
        return self.queue.fault

    @property
    def healthy(self) -> bool:
        """False once the engine stopped on a fault (`stop_on_fault`): it refuses every request."""
        return self.queue.fault is None

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block until a request is queued or running (or `timeout_s` passes); return whether one is."""
        return self.queue.wait_for(lambda: self.flight.rows > 0, timeout_s)

    @property
    def running(self) -> int:
        """Requests admitted and not finished: decoding, or part-way prefilled (`scheduler: mixed`)."""
        return self.flight.rows

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def generated_tokens(self) -> int:
        """Output tokens of measured requests generated since `reset_stats` (`stats()`'s ``generated_tokens``,
        without building the whole dict: cheap enough for a progress bar after every `step()`)."""
        return self.life.counts["tokens"]
