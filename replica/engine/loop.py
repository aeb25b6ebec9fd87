"""The engine's thread: `EngineLoop` runs `step()` until stopped."""

from __future__ import annotations

import threading

from replica.engine.core import ContinuousBatchingEngine

__all__ = ["EngineLoop"]


class EngineLoop:
    """Runs `engine.step()` on a daemon thread until `stop()`; idles on the engine's condition.

    When `step()` raises, the thread ends: `error` holds the exception, and the engine is stopped on that fault
    (`ContinuousBatchingEngine.stop_on_fault`): every request it held is answered with an error naming the fault,
    the engine reports itself unhealthy (`healthy`, `fault`) and refuses later requests at once."""

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
        except BaseException as e:  # noqa: BLE001 - surfaced through `alive` / `error` and the engine's `fault`
            self.error = e
            # nothing steps the engine after this: answer what it holds now, and refuse what comes
            self.engine.stop_on_fault(f"the engine loop stopped on a fault: {type(e).__name__}: {e}")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop stepping; requests still queued or running are answered with an error, never left waiting."""
        self._stop.set()
        self.engine.queue.wake()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.engine.abort_all("the replica's engine was stopped (reconfigured or shut down)")
