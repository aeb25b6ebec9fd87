"""The one integer check of the project: an argument that must be a whole number in range.

Used by the library (policies, `make_cache`), the engine and the load generator alike, so every such
error reads the same: ``<field>: expected an integer >= <minimum>[ or null], got <value>``. A bool is
not an integer here (``True`` is refused where a count is expected).
"""

from __future__ import annotations


def check_int(name: str, value, minimum: int, *, optional: bool = False) -> None:
    """Raise ValueError naming `name` unless `value` is an int >= `minimum` (or None, when `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}{' or null' if optional else ''}, got {value!r}")
