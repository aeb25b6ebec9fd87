"""The progress bars' ETA (`replica.progress`): none until items after the warm-up have been timed, then the
remaining items at the measured rate, on a scripted clock."""

from __future__ import annotations

import io

import pytest

from replica.progress import MeasuredEta, MeasuredEtaBar


def _scripted_run(bar_or_eta, clock: list[float]) -> list[float | None]:
    """A 6-minute run of 1000 tokens: a 30 s warm-up (first compile, prefill) yields the first 10 tokens, then
    the other 990 at 3 tokens per second (330 s). Returns the ETA after each update."""
    etas = []
    clock[0] = 30.0
    bar_or_eta.update(10)
    etas.append(_eta(bar_or_eta))
    for step in range(1, 34):
        clock[0] = 30.0 + 10.0 * step
        bar_or_eta.update(30)
        etas.append(_eta(bar_or_eta))
    return etas


def _eta(x) -> float | None:
    return x.measured.eta_s() if isinstance(x, MeasuredEtaBar) else x.eta_s()


class _Counted(MeasuredEta):
    """`MeasuredEta` fed increments, as a bar is."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.n = 0

    def update(self, n):
        self.n += n
        super().update(self.n)


def test_no_eta_until_an_item_after_the_warm_up_is_timed_then_the_scripted_truth():
    clock = [0.0]
    etas = _scripted_run(_Counted(1000, lambda: clock[0]), clock)
    assert etas[0] is None  # only the warm-up's items: tqdm's average would say (990 / (10 / 30)) s = 49.5 min
    truth = [330.0 - 10.0 * step for step in range(1, 34)]
    assert etas[1:] == pytest.approx(truth)


def test_bar_prints_no_eta_first_then_the_measured_one():
    clock = [0.0]
    out = io.StringIO()
    bar = MeasuredEtaBar(total=1000, file=out, clock=lambda: clock[0], mininterval=0, miniters=1, ncols=100)
    clock[0] = 30.0
    bar.update(10)
    first = str(bar)
    clock[0] = 40.0
    bar.update(30)
    second = str(bar)
    bar.close()
    assert "10/1000 [00:30<?, ?it/s]" in first
    # 960 tokens left at 3 tokens/s measured since the warm-up: 320 s
    assert "40/1000 [00:40<05:20,  3.00it/s]" in second
    assert bar.measured.eta_s() == pytest.approx(320.0)


def test_disabled_bar_counts_nothing_and_raises_nothing():
    bar = MeasuredEtaBar(total=5, disable=True)
    bar.update(3)
    bar.close()
    assert bar.measured.eta_s() is None
    assert bar.measured.rate_per_s() is None


def test_no_eta_without_a_total_or_without_progress():
    clock = [0.0]
    eta = MeasuredEta(None, lambda: clock[0])
    eta.update(5)
    clock[0] = 10.0
    eta.update(15)
    assert eta.rate_per_s() == pytest.approx(1.0)
    assert eta.eta_s() is None
    stalled = MeasuredEta(100, lambda: clock[0])
    stalled.update(5)
    clock[0] = 20.0
    stalled.update(5)
    assert stalled.rate_per_s() is None and stalled.eta_s() is None


def test_updates_that_count_nothing_are_warm_up_too():
    """Steps that finish no item (chunks of a long prefill) before the first token do not start the clock."""
    clock = [0.0]
    eta = MeasuredEta(100, lambda: clock[0])
    for t in (5.0, 10.0, 20.0):
        clock[0] = t
        eta.update(0)
        assert eta.eta_s() is None
    clock[0] = 30.0
    eta.update(10)
    assert eta.eta_s() is None
    clock[0] = 40.0
    eta.update(20)  # 10 items in 10 s since the first counted update: 80 left at 1 item/s
    assert eta.eta_s() == pytest.approx(80.0)
