"""A progress bar whose ETA comes from measured items only: `MeasuredEtaBar`, a `tqdm` bar that shows no ETA
until items have been timed after the first update that counts any, and then the remaining items at the mean rate since it.

The first update of a timed run carries the warm-up: the first compile, the prefill before the first token, a
cold cache. tqdm's default rate (an average from the bar's start) counts that time against the first few items
and so projects it over the whole run (a first ETA of 56 minutes for a 6-minute run); this bar starts its clock
at the first update instead. Imports tqdm only.
"""

from __future__ import annotations

import time
from typing import Callable

from tqdm import tqdm

__all__ = ["MeasuredEta", "MeasuredEtaBar"]


class MeasuredEta:
    """The rate and ETA of a count of items, from the items done after the first update that counts any
    (the warm-up's end) only.

    Args:
        total: items planned (None: unknown, so no ETA).
        clock: seconds, monotonic (`time.perf_counter` by default; a fake clock in tests).
    """

    def __init__(self, total: int | None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total = total
        self._clock = clock
        self._start: tuple[float, int] | None = None  # (time, items) at the first update: the warm-up's end
        self._last: tuple[float, int] | None = None

    def update(self, n: int) -> None:
        """Note that `n` items (the running count) are done now."""
        now = self._clock()
        if self._start is None:
            if n <= 0:  # a step that finished nothing (a chunk of prefill) is still warm-up
                return
            self._start = (now, n)
        self._last = (now, n)

    def rate_per_s(self) -> float | None:
        """Items per second since the first update; None until an item after it has been timed."""
        if self._start is None or self._last is None:
            return None
        dt, dn = self._last[0] - self._start[0], self._last[1] - self._start[1]
        return dn / dt if dt > 0 and dn > 0 else None

    def eta_s(self) -> float | None:
        """Seconds left at `rate_per_s`; None while there is no rate or no total."""
        rate = self.rate_per_s()
        if rate is None or self.total is None or self._last is None:
            return None
        return max(self.total - self._last[1], 0) / rate


class MeasuredEtaBar(tqdm):
    """A `tqdm` bar whose rate and ETA are `MeasuredEta`'s: ``?`` until an item after the first update has
    been timed. Takes tqdm's arguments, plus `clock` (seconds; `time.perf_counter` by default)."""

    def __init__(self, *args, clock: Callable[[], float] = time.perf_counter, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.measured = MeasuredEta(self.total, clock)
        if not self.disable:
            self._time = clock  # tqdm's own clock, for its elapsed time and refresh interval
            self.start_t = self.last_print_t = clock()

    def update(self, n: float | None = 1) -> bool | None:
        if not self.disable:
            self.measured.update(self.n + (n or 0))
        return super().update(n)

    @property
    def format_dict(self) -> dict:
        d = super().format_dict
        if hasattr(self, "measured"):
            # 0, not None: tqdm prints "?" for a zero rate, but would average from its start for None
            d["rate"] = self.measured.rate_per_s() or 0.0
        return d
