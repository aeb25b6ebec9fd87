"""The explicit registry of eviction policies: name -> policy dataclass.

The CLI, docs/library.md and the tests all read this dict. One policy per file.
"""

from __future__ import annotations

from .base import Policy
from .full import Full
from .h2o import H2O
from .knorm import Knorm
from .random import Random
from .scissorhands import Scissorhands
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM
from .tova import TOVA

POLICIES: dict[str, type[Policy]] = {
    "full": Full,
    "scissorhands": Scissorhands,
    "streaming_llm": StreamingLLM,
    "h2o": H2O,
    "tova": TOVA,
    "random": Random,
    "knorm": Knorm,
    "snapkv": SnapKV,
}

__all__ = ["POLICIES", "Policy", "get_policy"]


def get_policy(name: str, **params) -> Policy:
    """Instantiate policy ``name`` with ``params``.

    Raises:
        ValueError: unknown name (lists the valid ones) or unknown/invalid parameter (names it).
    """
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}")
    cls = POLICIES[name]
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for policy {name!r}; accepted: {sorted(fields)}")
    return cls(**params)
