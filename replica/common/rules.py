"""Validation rules every config of the project shares, written once: the base of a config model,
the field types, the number checks, the "give one of these" and "not both" rules, and one line per
pydantic error naming the field.

It lives in `replica/` (the lowest layer with configs) so `replica.common.types.EngineConfig`,
`cluster.placement.PlacementConfig` and the workloads' configs all import the same rules.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Callable, ClassVar, Iterable, Mapping

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "FrozenConfig",
    "Section",
    "PositiveInt",
    "NonNegativeInt",
    "PositiveFloat",
    "NonNegativeFloat",
    "checked",
    "check_number",
    "check_fraction",
    "check_choice",
    "need_one_of",
    "at_most_one",
    "one_line",
]

PositiveInt = Annotated[int, Field(strict=True, ge=1)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
#: A finite number > 0 (an int is accepted, a bool is not).
PositiveFloat = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]


def check_number(name: str, value: Any, minimum: float, *, optional: bool = False) -> None:
    """Raise ValueError naming `name` unless `value` is a finite int or float >= `minimum` (or None, when
    `optional`); reads as `scissorhands.checks.check_int` does: ``<name>: expected a number >= 0, got -1``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name}: expected a number >= {minimum:g}{' or null' if optional else ''}, got {value!r}")


def check_fraction(name: str, value: Any, *, optional: bool = False) -> None:
    """Raise ValueError naming `name` unless `value` is a number in (0, 1] (or None, when `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name}: expected a number in (0, 1]{' or null' if optional else ''}, got {value!r}")


def check_choice(name: str, value: Any, accepted: Iterable[str]) -> None:
    """Raise ValueError naming `name` unless `value` is one of `accepted` (``<name>: expected one of a, b, got 'c'``,
    the form of a pydantic literal's error through `one_line`)."""
    accepted = tuple(accepted)
    if not isinstance(value, str) or value not in accepted:
        raise ValueError(f"{name}: expected one of {', '.join(accepted)}, got {value!r}")


def checked(check: Callable[..., None], *args: Any, **kwargs: Any) -> BeforeValidator:
    """A field's check written in its type (``x: Annotated[int, checked(check_int, 1)]``): ``check(<the field's
    name>, value, *args, **kwargs)`` runs before pydantic's own validation, so every config reads the same
    (``max_restarts: expected an integer >= 0, got -1``)."""

    def validate(value: Any, info) -> Any:
        check(info.field_name, value, *args, **kwargs)
        return value

    return BeforeValidator(validate)


def need_one_of(obj: Any, *fields: str, what: str = "give at least one bound") -> None:
    """Raise ValueError naming `fields` when every one of them is None on `obj`."""
    if all(getattr(obj, f) is None for f in fields):
        raise ValueError(f"{', '.join(fields)}: {what}")


def at_most_one(obj: Any, *fields: str, what: str = "give one of them, not several") -> None:
    """Raise ValueError naming the fields given when more than one of `fields` is set on `obj` (one KV memory
    limit: bytes, a fraction of device memory, or full-cache sequences)."""
    given = [f for f in fields if getattr(obj, f) is not None]
    if len(given) > 1:
        raise ValueError(f"{', '.join(given)}: {what}")


def _prefixed(names: str, prefix: str) -> str:
    """``"a, b"`` -> ``"<prefix>.a, <prefix>.b"`` (unchanged without a prefix or when already prefixed)."""
    if not prefix:
        return names
    return ", ".join(n if n == prefix or n.startswith(prefix + ".") else f"{prefix}.{n}" for n in names.split(", "))


_FIELDS = re.compile(r"[\w.\[\]]+(, [\w.\[\]]+)*")  # "a, b.c, d[0]": a message's leading field names


def _where(loc: tuple) -> str:
    """A pydantic error location as a field path: ``policies[1].name`` (pydantic's own validator steps left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "json-or-python", "lax-or-strict")):
            out += ("." if out else "") + str(part)
    return out


def one_line(e: ValidationError, prefix: str = "", accepted: Iterable[str] = (), default: str = "") -> str:
    """`e` as one line, its errors joined by ``"; "``, each ``<prefix>.<field>: <what is wrong>, got <input>``
    (``<default>: ...`` for an error of the whole model that names no field).

    A literal's accepted values are listed (``expected one of poisson, gamma``); an unknown top-level key lists
    `accepted` (the model's field names) when given. Our own validators' messages may start with the field(s) they
    name (``"a, b: give one of them"``, a model's rule; ``"placement.strategy: unknown ..."``, a field's own): then
    only `prefix` is added.
    """
    lines = []
    keys = ", ".join(accepted)
    for err in e.errors(include_url=False):
        loc = _where(err["loc"])
        where = ".".join(p for p in (prefix, loc) if p)
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if err["type"] in ("value_error", "assertion_error"):
            names, sep, rest = msg.partition(": ")
            if sep and _FIELDS.fullmatch(names) and (not loc or names.startswith(loc.split("[")[0].split(".")[0])):
                lines.append(f"{_prefixed(names, prefix)}: {rest}")
            else:
                lines.append(f"{where or default}: {msg}" if where or default else msg)
            continue
        if err["type"] == "literal_error":
            msg = f"expected one of {err['ctx']['expected'].replace(chr(39), '').replace(' or ', ', ')}, got {err['input']!r}"
        elif err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            msg = "unknown key" + (f" (accepted: {keys})" if keys and len(err["loc"]) == 1 else "")
        elif err["type"] == "missing":
            msg = "missing required key"
        elif "input" in err:
            msg += f", got {err['input']!r}"
        lines.append(f"{where or default}: {msg}" if where or default else msg)
    return "; ".join(lines)


class FrozenConfig(BaseModel):
    """The base of a config model: frozen, unknown keys refused, and every construction error raised
    as one `error` line (a ValueError subclass) naming each field, ``<prefix>.`` first, and what it accepts.

    ``Model(**fields)`` and ``Model.parse(mapping_or_none)`` validate; `model_dump()` gives the mapping back;
    ``cfg.model_copy(update=...)`` does not validate again (``Model(**{**cfg.model_dump(), ...})`` does).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    #: The exception raised for invalid input (a ValueError subclass).
    error: ClassVar[type[ValueError]] = ValueError
    #: The key the config sits under in a suite (``placement``), prefixed to every field it names.
    prefix: ClassVar[str] = ""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise self.error(one_line(e, self.prefix, accepted=type(self).model_fields)) from None

    @classmethod
    def parse(cls, data: Any):
        """`data` validated: a mapping of fields, None (the defaults), or an instance (returned as is).

        Raises:
            `cls.error`: not a mapping, an unknown key, or a field out of range (the message names it).
        """
        if data is None:
            return cls()
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping):
            raise cls.error(f"{cls.prefix or cls.__name__}: expected a mapping, got {data!r} ({type(data).__name__})")
        return cls(**{str(k): v for k, v in data.items()})


class Section(BaseModel):
    """A suite section written as a mapping (``slo: {ttft_s: 2.0}``): frozen, unknown keys refused, and a value
    that is not a mapping refused as ``<section>: expected <form>, got <value>``, where a subclass sets `section`
    (its key in the suite; "" when the suite's field error already names it) and `form` (what it accepts).
    A section is validated inside its suite, whose loader formats every error; a `FrozenConfig` is also built
    from code, so it raises its own error class, already one line."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    section: ClassVar[str] = ""
    form: ClassVar[str] = "a mapping"

    @model_validator(mode="before")
    @classmethod
    def _a_mapping(cls, value: Any) -> Any:
        if not isinstance(value, (dict, cls)):
            raise ValueError(f"{cls.section + ': ' if cls.section else ''}expected {cls.form}, got {value!r}")
        return value
