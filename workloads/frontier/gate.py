"""Quality on the frontier with its spread, and the quality gate (`workloads.frontier.report`).

* :func:`perplexity_interval`: a point's 95% interval. A point scores ``perplexity_windows`` held-out windows of
  equal length (`workloads.quality.perplexity.heldout_windows`), so its NLL per token (nats) is the mean of the
  per-window NLLs per token ``x_1..x_n``, and its perplexity ``exp(mean)``. The interval is Student's
  t-interval of that mean, ``mean +- t_{0.975, n-1} s / sqrt(n)`` (``s`` the sample standard deviation), mapped
  through ``exp``: ``(perplexity_ci_low, perplexity_ci_high)``. It treats the windows (speeches drawn with
  seeds ``seed, seed + 1, ...``) as a sample of held-out text, so it holds the text's variation as well as the
  cache's. With one window it is ``(None, None)``: one window says nothing about its spread (not zero).
* :func:`paired_ratio_interval`: every point of a run scores the *same* windows, so its perplexity relative to
  the full cache's is ``exp(mean d)`` with ``d_i`` = the point's NLL per token minus the full cache's on window
  ``i``; the t-interval of ``mean d`` through ``exp`` is the 95% interval of that ratio. The text's variation
  cancels in ``d``, so this interval is much narrower than the two unpaired ones and is the one that says
  whether a gate decision is resolved.
* :func:`gate_passed`, the rule: a point passes ``quality_gate: {max_perplexity_increase: b}`` when its
  perplexity (the point estimate over all windows) is at most the full cache's in the same run (same dtype and KV
  limit) times ``1 + b``; null when there is no full-cache point to compare with. The intervals do not change
  the decision (as MLPerf's accuracy targets compare the measured accuracy); `gate_resolved` says whether the
  paired interval lies wholly on one side of the bound, i.e. whether more windows could flip it.

The t quantile is SciPy's (`scipy.stats.t`).
"""

from __future__ import annotations

import math

from scipy import stats

#: The default of ``quality_gate.max_perplexity_increase``: perplexity within 1% of the full cache's.
DEFAULT_MAX_PERPLEXITY_INCREASE = 0.01
CONFIDENCE = 0.95


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """The two-sided Student t critical value: ``t`` with ``P(|T| <= t) = confidence`` for ``df`` degrees of
    freedom (12.706 for ``df = 1``, 2.776 for 4, 2.365 for 7 at 95%; `scipy.stats.t`).

    Raises:
        ValueError: ``df`` not an integer >= 1, or ``confidence`` outside (0, 1).
    """
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be an integer >= 1, got {df!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return float(stats.t.ppf((1 + confidence) / 2, df))


def mean_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float | None, float | None]:
    """Student's t-interval ``(low, high)`` of the mean of ``values`` (``mean +- t s / sqrt(n)``, ``s`` the
    sample standard deviation); ``(None, None)`` for one value.

    Raises:
        ValueError: no values, or a value that is not a finite number.
    """
    if not values:
        raise ValueError("values: need at least one value")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"values[{i}]: expected a finite number, got {v!r}")
    n = len(values)
    if n < 2:
        return None, None
    mean = sum(values) / n
    half = t_quantile(n - 1, confidence) * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean - half, mean + half


def perplexity_interval(window_nll_per_token: list[float]) -> tuple[float | None, float | None]:
    """The 95% interval ``(perplexity_ci_low, perplexity_ci_high)`` of a point's perplexity from its per-window
    NLLs per token (nats, windows of equal length): ``exp`` of `mean_interval`; ``(None, None)`` for one window.

    Raises:
        ValueError: as `mean_interval`.
    """
    low, high = mean_interval(window_nll_per_token)
    return (None, None) if low is None else (math.exp(low), math.exp(high))


def paired_ratio_interval(
    window_nll_per_token: list[float] | None, full_window_nll_per_token: list[float] | None
) -> tuple[float | None, float | None]:
    """The 95% interval of ``perplexity / full cache's perplexity`` on the same windows: ``exp`` of the t-interval
    of the per-window NLL differences (nats per token); ``(None, None)`` when either list is missing, their
    lengths differ (not the same windows) or there is one window.

    Raises:
        ValueError: a value that is not a finite number.
    """
    if not window_nll_per_token or not full_window_nll_per_token:
        return None, None
    if len(window_nll_per_token) != len(full_window_nll_per_token):
        return None, None
    low, high = mean_interval([a - b for a, b in zip(window_nll_per_token, full_window_nll_per_token)])
    return (None, None) if low is None else (math.exp(low), math.exp(high))


def gate_perplexity(full_perplexity: float | None, max_perplexity_increase: float) -> float | None:
    """The highest perplexity that passes: ``full_perplexity x (1 + max_perplexity_increase)``; None without a
    full-cache perplexity.

    Raises:
        ValueError: ``max_perplexity_increase`` not a finite number > 0.
    """
    if (
        isinstance(max_perplexity_increase, bool)
        or not isinstance(max_perplexity_increase, (int, float))
        or not (math.isfinite(max_perplexity_increase) and max_perplexity_increase > 0)
    ):
        raise ValueError(f"max_perplexity_increase must be a finite number > 0, got {max_perplexity_increase!r}")
    return None if full_perplexity is None else full_perplexity * (1 + max_perplexity_increase)


def gate_passed(perplexity: float, full_perplexity: float | None, max_perplexity_increase: float) -> bool | None:
    """Whether ``perplexity <= full_perplexity x (1 + max_perplexity_increase)`` (the point estimates); None when
    there is no full-cache perplexity to compare with.

    Raises:
        ValueError: as `gate_perplexity`.
    """
    bound = gate_perplexity(full_perplexity, max_perplexity_increase)
    return None if bound is None else perplexity <= bound


def gate_resolved(ratio_ci: tuple[float | None, float | None], max_perplexity_increase: float) -> bool | None:
    """Whether the paired interval of the ratio to the full cache (`paired_ratio_interval`) lies wholly on one side
    of ``1 + max_perplexity_increase`` (True: more windows would not be expected to flip the gate; False: the
    bound lies inside it); None without an interval."""
    low, high = ratio_ci
    if low is None or high is None:
        return None
    bound = 1 + max_perplexity_increase
    return high <= bound or low > bound
