"""The engine's queue (part of the core): requests waiting for admission, the ids to end at the next step, and the
fault that stopped the engine. Thread-safe: `submit`, `abort` and `finish` come from any thread, the step from one."""

from __future__ import annotations

import collections
import threading
from typing import Callable, Iterable

from replica.engine.requests import Sequence

__all__ = ["RequestQueue"]


class RequestQueue:
    """Waiting requests (head first), and how each id named by `end` leaves at the next step."""

    def __init__(self):
        self.lock = threading.Condition()
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.ends: dict[str, str] = {}  # request id -> how it ends at the next step: "aborted" or "stop"
        self.fault: str | None = None  # why the engine stopped serving; None while healthy

    def __len__(self) -> int:
        return len(self.waiting)

    def put(self, seq: Sequence, count: Callable[[], None]) -> str | None:
        """Append `seq` (calling `count()` under the lock), or return the fault that refuses it."""
        with self.lock:
            count()
            if self.fault is not None:
                return self.fault
            self.waiting.append(seq)
            self.lock.notify_all()
        return None

    def end(self, request_id: str, how: str) -> None:
        """End `request_id` at the next step: ``"aborted"`` (a `"stop"` asked first stands) or ``"stop"``."""
        with self.lock:
            if how == "stop":
                self.ends[request_id] = how
            else:
                self.ends.setdefault(request_id, how)
            self.lock.notify_all()

    def take_ends(self) -> tuple[dict[str, str], list[Sequence]]:
        """The ends asked since the last call, and the waiting requests they remove from the queue."""
        with self.lock:
            ends, self.ends = self.ends, {}
            gone = [s for s in self.waiting if s.request.request_id in ends]
            for s in gone:
                self.waiting.remove(s)
        return ends, gone

    def pop_front(self, n: int) -> None:
        with self.lock:
            for _ in range(n):
                self.waiting.popleft()

    def push_front(self, seqs: Iterable[Sequence]) -> None:
        """Put `seqs` back at the head, in their order (preempted requests)."""
        with self.lock:
            self.waiting.extendleft(reversed(list(seqs)))

    def drain(self, fault: str | None = None) -> list[Sequence]:
        """Take every waiting request; with `fault`, refuse every later one with it."""
        with self.lock:
            if fault is not None:
                self.fault = fault
            seqs = list(self.waiting)
            self.waiting.clear()
        return seqs

    def wait_for(self, busy: Callable[[], bool], timeout_s: float) -> bool:
        """Block until a request waits or `busy()` (or `timeout_s` passes); return whether either holds."""
        with self.lock:
            return self.lock.wait_for(lambda: bool(self.waiting) or busy(), timeout=timeout_s)

    def wake(self) -> None:
        with self.lock:
            self.lock.notify_all()
