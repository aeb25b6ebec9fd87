"""Validation rules every config of the project shares, written once: the field types, the
"give one of these" and "not both" rules, and one line per pydantic error naming the field.

It lives in `replica/` (the lowest layer with configs) so `replica.types.EngineConfig`,
`cluster.placement.PlacementConfig` and the workloads' configs all import the same rules.
"""
from __future__ import annotations

from typing import Annotated, Any, Iterable

from pydantic import Field, ValidationError

__all__ = ["PositiveInt", "NonNegativeInt", "PositiveFloat", "NonNegativeFloat", "need_one_of", "not_both",
           "one_line"]

PositiveInt = Annotated[int, Field(strict=True, ge=1)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
#: A finite number > 0 (an int is accepted, a bool is not).
PositiveFloat = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]


def need_one_of(obj: Any, *fields: str, what: str = "give at least one bound") -> None:
    """Raise ValueError naming `fields` when every one of them is None on `obj`."""
    if all(getattr(obj, f) is None for f in fields):
        raise ValueError(f"{', '.join(fields)}: {what}")


def not_both(obj: Any, a: str, b: str, what: str = "give one of them, not both") -> None:
    """Raise ValueError naming `a` and `b` when both are set on `obj` (a limit or a fraction, not both)."""
    if getattr(obj, a) is not None and getattr(obj, b) is not None:
        raise ValueError(f"{a}, {b}: {what}")


def _prefixed(names: str, prefix: str) -> str:
    """``"a, b"`` -> ``"<prefix>.a, <prefix>.b"`` (unchanged without a prefix or when already prefixed)."""
    if not prefix:
        return names
    return ", ".join(n if n == prefix or n.startswith(prefix + ".") else f"{prefix}.{n}" for n in names.split(", "))


def one_line(e: ValidationError, prefix: str = "", accepted: Iterable[str] = ()) -> str:
    """`e` as one line, its errors joined by ``"; "``, each ``<prefix>.<field>: <what is wrong>, got <input>``.

    A literal's accepted values are listed (``expected one of poisson, gamma``); an unknown key lists
    `accepted` (the model's field names) when given. Our own validators' messages (``value_error``)
    already start with the field(s) they name (``"a, b: give one of them"``); only `prefix` is added.
    """
    lines = []
    keys = ", ".join(accepted)
    for err in e.errors(include_url=False):
        where = ".".join([prefix] * bool(prefix) + [str(p) for p in err["loc"]])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "value_error":
            names, sep, rest = msg.partition(": ")
            lines.append(f"{_prefixed(names, prefix)}: {rest}" if sep else f"{where or prefix}: {msg}")
            continue
        if err["type"] == "literal_error":
            msg = f"expected one of {err['ctx']['expected'].replace(chr(39), '').replace(' or ', ', ')}, got {err['input']!r}"
        elif err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            msg = "unknown key" + (f" (accepted: {keys})" if keys else "")
        elif err["type"] == "missing":
            msg = "missing required key"
        elif "input" in err:
            msg += f", got {err['input']!r}"
        lines.append(f"{where}: {msg}" if where else msg)
    return "; ".join(lines)
