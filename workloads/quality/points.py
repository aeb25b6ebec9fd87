"""One quality point, run where the model is: ``run_point(model, tokenizer, point) -> metrics``.

The runner sends it to a replica with ``ModelReplica.apply(run_point, point)`` (or calls it
in-process with ``--local``). ``point`` is the :class:`workloads.quality.suite.QualityPoint` itself.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

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


def run_point(model, tokenizer, point: QualityPoint) -> dict:
    """Evaluate one point; return its metrics (kind-specific, units in the names).

    Raises:
        ValueError: an unknown kind, or an invalid policy / parameter (from ``make_cache``).
    """
    device = next(model.parameters()).device
    kind, s, seed = point.kind, point.settings or {}, int(point.seed)
    vocab = int(model.config.vocab_size)
    if kind == "perplexity":
        from .perplexity import heldout_windows, perplexity

        windows = heldout_windows(tokenizer, int(s["tokens"]), int(s["windows"]), seed, vocab_size=vocab)
        out = perplexity(model, windows, point.policy, point.compression_ratio, point.kv_bits,
                         point.policy_params, device=device)
    elif kind == "fewshot":
        from .fewshot import evaluate_task

        out = evaluate_task(model, tokenizer, point.task, point.policy, point.compression_ratio,
                            point.kv_bits, point.policy_params, docs=s.get("docs"), seed=seed,
                            device=device)
    elif kind == "persistence":
        from .perplexity import heldout_windows
        from .persistence import persistence_ratio

        windows = heldout_windows(tokenizer, int(s["tokens"]) - 1, int(s["windows"]), seed, vocab_size=vocab)
        out = persistence_ratio(model, windows, float(s["split_fraction"]), device=device)
    elif kind == "passkey":
        from .passkey import evaluate_passkey

        out = evaluate_passkey(model, tokenizer, point.policy, int(s["length"]), list(s["depths"]),
                               int(s["trials"]), int(s["digits"]), point.compression_ratio, point.kv_bits,
                               point.policy_params, seed=seed, device=device)
    else:
        raise ValueError(f"kind: unknown point kind {kind!r} (valid: perplexity, fewshot, persistence, passkey)")
    out["torch_threads"] = torch.get_num_threads()
    return _clean(out)
