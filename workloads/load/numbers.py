"""Numbers as tables, progress lines and SLO descriptions print them: plain decimals, never scientific notation.
Here, below `workloads.core.results` (which re-exports `significant`), so `workloads.load` formats without importing
the suite machinery."""

from __future__ import annotations

import math


def significant(value: float | None, digits: int = 3) -> str:
    """`value` to `digits` significant digits in plain decimal notation, never scientific, trailing zeros dropped as
    ``g`` drops them: 42612.3 -> ``42600``, 0.001234 -> ``0.00123``, 12.34 -> ``12.3``, 0.5 -> ``0.5``; ``-`` for None, ``nan``/``inf`` as Python writes them. For table
    cells and progress lines, where ``4.26e+04`` reads as a misprint."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    rounded = round(value, decimals)
    if rounded != 0 and math.floor(math.log10(abs(rounded))) > math.floor(math.log10(abs(value))):
        decimals -= 1  # rounding carried into one more digit (999.6 -> 1000)
    text = f"{rounded:.{max(0, decimals)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text  # as `g` writes it: 0.5, not 0.500
