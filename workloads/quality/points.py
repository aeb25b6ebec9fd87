"""One quality point, run where the model is: ``run_point(model, tokenizer, point) -> metrics``.

The runner sends it to a replica with ``ModelReplica.apply(run_point, point)`` (or calls it
in-process with ``--local``). ``point`` is the :class:`workloads.quality.suite.QualityPoint` itself;
its evaluation (``point.kind``) is looked up in `workloads.quality.evaluations.EVALUATIONS`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .evaluations import EVALUATIONS, Evaluation

if TYPE_CHECKING:
    from .suite import QualityPoint


def _clean(value):
    """JSON-safe copy: NaN/inf become None (results lines are strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def evaluation_of(kind: str, field: str = "kind") -> Evaluation:
    """The registry entry of evaluation ``kind``.

    Raises:
        ValueError: ``kind`` is not a key of ``EVALUATIONS`` (the message names ``field`` and the valid kinds).
    """
    try:
        return EVALUATIONS[kind]
    except KeyError:
        raise ValueError(f"{field}: unknown evaluation {kind!r} (valid: {', '.join(EVALUATIONS)})") from None


def run_point(model, tokenizer, point: QualityPoint) -> dict:
    """Evaluate one point; return its metrics (kind-specific, units in the names) and ``torch_threads``.

    Raises:
        ValueError: an unknown kind, or an invalid policy / parameter (from ``make_cache``).
    """
    evaluation = evaluation_of(point.kind)
    out = evaluation.run(model, tokenizer, point, next(model.parameters()).device)
    out["torch_threads"] = torch.get_num_threads()  # CPU timings depend on it; the conditions line shows it
    return _clean(out)


def ok_line(rec: dict) -> str:
    """What an ``ok`` record of this evaluation measured, for its progress line.

    Raises:
        ValueError: the record's ``evaluation`` is not a registered evaluation.
    """
    return evaluation_of(rec["evaluation"], "evaluation").ok_line(rec)
