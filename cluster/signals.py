"""Run in the foreground until Ctrl-C or `kill`: the wait of `make serve` and `make cluster-node`.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread is. A
handler that takes a lock, such as `threading.Event.set`, deadlocks when a second signal lands while
the main thread holds that same lock inside `Event.wait`; and two signals at once are the usual case
here: `kill` of a process group reaches both `make` and its child, and `make` forwards SIGTERM to
the child again (how often the Event pattern hung: docs/performance.md, "Measurements behind the
library and cluster code"; tests/cluster/test_signals.py). So the handler here only appends to a list.
"""

from __future__ import annotations

import signal
import time

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Records SIGINT and SIGTERM from construction on; `wait()` blocks until the first.

    Install it before a long start-up, so a `kill` during the start-up is kept and the caller still
    shuts down what it started. Later signals do not interrupt the caller's shutdown, nor its exit
    (only SIGKILL does).
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.received: list[int] = []
        self.signals = signals
        for sig in signals:
            signal.signal(sig, self._record)

    def _record(self, signum: int, _frame) -> None:
        self.received.append(signum)  # no lock: see the module docstring

    def wait(self, poll_s: float = 0.2) -> int:
        """Block until a stop signal has arrived (checked every `poll_s` seconds); return its number.

        From then on the stop signals are ignored: at exit Python puts its handlers back to the default,
        and a late signal of the same burst would kill the process after a clean shutdown (exit -15).
        """
        while not self.received:
            time.sleep(poll_s)
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        return self.received[0]
