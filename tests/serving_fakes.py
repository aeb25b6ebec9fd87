"""Test doubles for the serving stack: a virtual-time asyncio loop and a replica with scripted timings.

`run_virtual(coro)` runs `coro` on an event loop whose clock jumps to the next timer whenever
nothing is ready, so scripted seconds cost no real time and results are exact and repeatable.
Use `clock=asyncio.get_running_loop().time` (or `virtual_clock()`) wherever a clock is injected.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from replica import cpu_share
from replica.common.types import GenerationRequest, GenerationResult


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` is virtual: it fast-forwards to the next timer when idle."""

    def __init__(self):
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self):
        if not self._ready and self._scheduled:
            nxt = self._scheduled[0]._when  # the earliest timer (a heap)
            if nxt > self._virtual_now:
                self._virtual_now = nxt
        super()._run_once()


def run_virtual(coro):
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def virtual_clock() -> Callable[[], float]:
    return asyncio.get_running_loop().time


@dataclass
class Script:
    """Timings of one request: first token after `ttft_s`, then `chunks` arrivals `gap_s` apart,
    each carrying `chunk_tokens` tokens (the first arrival included)."""

    ttft_s: float = 0.1
    gap_s: float = 0.01
    chunk_tokens: int = 1
    error_kind: str | None = None
    raises: BaseException | None = None


@dataclass
class FakeReplica:
    """A replica whose requests take scripted times (virtual clock); counts what reached it.

    `script(request) -> Script`; default: 0.1 s TTFT, 10 ms per token, `max_new_tokens` tokens.
    `capacity`: most requests it runs at once (the rest wait inside, as in a full batch).
    """

    script: Callable[[GenerationRequest], Script] = lambda r: Script()
    capacity: int | None = None
    replica_id: str = "fake-0"
    clock: Callable[[], float] | None = None  # None: the event loop's (virtual) time
    received: list = field(default_factory=list)
    running: int = 0
    peak_running: int = 0
    _sem: asyncio.Semaphore | None = None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        loop = asyncio.get_running_loop()
        now_fn = self.clock or loop.time
        self.received.append(request.request_id)
        if self.capacity and self._sem is None:
            self._sem = asyncio.Semaphore(self.capacity)
        if self._sem is not None:
            await self._sem.acquire()
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            s = self.script(request)
            res = GenerationResult(
                request.request_id, len(request.prompt_ids), received_time_s=now_fn(), replica_id=self.replica_id
            )
            if s.raises is not None:
                await asyncio.sleep(s.ttft_s)
                raise s.raises
            if s.error_kind is not None:
                await asyncio.sleep(s.ttft_s)
                res.error_kind, res.error, res.finish_reason = s.error_kind, f"scripted {s.error_kind}", "error"
                return res
            await asyncio.sleep(s.ttft_s)
            n = request.max_new_tokens
            while True:
                take = min(s.chunk_tokens, n - len(res.output_ids))
                now = now_fn()
                res.output_ids.extend([7] * take)
                res.token_times_s.extend([now] * take)
                if len(res.output_ids) >= n:
                    break
                await asyncio.sleep(s.gap_s)
            res.finish_time_s, res.finish_reason = now_fn(), "length"
            return res
        finally:
            self.running -= 1
            if self._sem is not None:
                self._sem.release()


class OneReplicaPool:
    """What a serving sweep asks of its replica pool (`workloads.serving.pools.ReplicaPool`), for one fake replica:
    a subclass's `configure` sets `self.replica` (a `FakeReplica`) for each point."""

    replica: FakeReplica

    def start(self):
        return [{"replica_id": "fake-0"}]

    def client(self):
        return self.replica

    def max_batch_for(self, p, n):
        return 4

    def stats(self, reset=False):
        return [{"replica_id": "fake-0", "peak_running_sequences": self.replica.peak_running}]

    def cpu_samples(self):
        return {"fake-0": cpu_share.sample().as_dict()}  # the fake replica runs in this process

    def restart_dead(self):
        return []

    def close(self):
        pass


def requests(n: int = 16, prompt_tokens: int = 8, new_tokens: int = 4) -> list[GenerationRequest]:
    return [GenerationRequest(f"q{i}", [1] * prompt_tokens, new_tokens) for i in range(n)]
