"""Confidence for quality numbers: Wilson intervals, the exact McNemar test, spread across windows.

* :func:`wilson_interval`: the 95% score interval of a binomial proportion (Wilson, 1927), which
  stays inside [0, 1] and is sound for small ``n`` and accuracies near 0 or 1.
* :func:`mcnemar_exact`: the paired comparison of two classifiers scored on the same documents
  (McNemar, 1947), exact form: with ``b`` documents right only under A and ``c`` right only under
  B, under the null each discordant document is a fair coin, so the two-sided p-value is
  ``min(1, 2 P(X <= min(b, c)))`` for ``X ~ Binomial(b + c, 1/2)`` (1 when ``b + c = 0``).
* :func:`paired_accuracy`: accuracy difference of a point from the full cache on the documents
  both scored, with the McNemar counts and p-value.
* :func:`spread`: mean, sample standard deviation, min and max of per-window values.
* :func:`wilson_half_width`, :func:`docs_for_half_width`: what a document count can resolve before
  a run (the half-width of the 95% Wilson interval at an assumed accuracy, and its inverse).

Pure Python (``math.comb``): no SciPy needed.
"""

from __future__ import annotations

import math

from scissorhands.checks import check_int

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(correct: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` of ``correct / n`` (95% by default).

    Raises:
        ValueError: ``n < 1`` or ``correct`` outside ``[0, n]``.
    """
    check_int("n", n, 1)
    if isinstance(correct, bool) or not isinstance(correct, int) or not 0 <= correct <= n:
        raise ValueError(f"correct must be an integer in [0, n={n}], got {correct!r}")
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if correct == 0 else max(0.0, centre - half)  # exact ends (no 0.9999999999999999)
    high = 1.0 if correct == n else min(1.0, centre + half)
    return low, high


def wilson_half_width(n: int, accuracy: float = 0.5, z: float = Z_95) -> float:
    """Half the width of the 95% Wilson interval of an accuracy ``accuracy`` measured on ``n`` documents
    (the interval's continuous form; at 0.5 it is widest): 0.20 for 20 documents, 0.030 for 1,068.

    Raises:
        ValueError: ``n < 1`` or ``accuracy`` outside ``[0, 1]``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if not 0 <= accuracy <= 1:
        raise ValueError(f"accuracy must be in [0, 1], got {accuracy!r}")
    return z * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n)) / (1 + z * z / n)


def docs_for_half_width(half_width: float, accuracy: float = 0.5, z: float = Z_95) -> int:
    """The fewest documents whose 95% Wilson interval at ``accuracy`` is at most +-``half_width``
    (1,068 for +-0.03 at 0.5).

    Raises:
        ValueError: ``half_width`` not in (0, 0.5].
    """
    if not 0 < half_width <= 0.5:
        raise ValueError(f"half_width must be in (0, 0.5], got {half_width!r}")
    low, high = 1, 1
    while wilson_half_width(high, accuracy, z) > half_width:  # the half-width falls as n grows
        low, high = high, high * 2
    while low < high:  # the fewest n in (low, high] that reaches it
        mid = (low + high) // 2
        if wilson_half_width(mid, accuracy, z) <= half_width:
            high = mid
        else:
            low = mid + 1
    return high


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs.

    Raises:
        ValueError: a negative count.
    """
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_accuracy(reference: dict[int, bool], other: dict[int, bool]) -> dict:
    """Compare per-document correctness of a point against the reference (full cache) on shared documents.

    Args:
        reference: ``{doc_id: correct}`` of the full cache.
        other: ``{doc_id: correct}`` of the compressed point.

    Returns:
        ``{"docs_paired": n, "accuracy_diff": acc(other) - acc(reference) on those documents,
        "only_reference_right": b, "only_other_right": c, "mcnemar_p": float}``.

    Raises:
        ValueError: no document in common.
    """
    shared = sorted(set(reference) & set(other))
    if not shared:
        raise ValueError("paired_accuracy: the two points share no document")
    b = sum(1 for d in shared if reference[d] and not other[d])
    c = sum(1 for d in shared if other[d] and not reference[d])
    return {
        "docs_paired": len(shared),
        "accuracy_diff": (c - b) / len(shared),
        "only_reference_right": b,
        "only_other_right": c,
        "mcnemar_p": mcnemar_exact(b, c),
    }


def spread(values: list[float]) -> dict:
    """``{"mean", "std" (sample, n - 1; None for one value), "min", "max", "n"}`` of ``values``.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("spread: no values")
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}
