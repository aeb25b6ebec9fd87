"""The persistence ratio per layer (the Scissorhands paper's figure), measured on real text.

Definition (the paper, arXiv 2305.17118; docs/quality.md, "Persistence ratio"): for a text of ``T`` tokens and a split point ``t``, a token
``j`` is *pivotal* for query ``i`` when its attention is above the average, ``p[i, j] > 1 / n_i``
with ``n_i = i + 1`` keys visible to ``i`` (causal, no padding).

* ``S_before`` = tokens pivotal for some query in ``[0, t)``;
* ``S_after`` = tokens before ``t`` pivotal for some query in ``[t, T)``;
* persistence ratio = ``|S_after ∩ S_before| / |S_after|``; pivotal share = ``|S_before| / t``.

Both are computed per attention (query) head and averaged over the heads of a layer (a head
with an empty ``S_after`` is left out of the mean). The attention probabilities come from one
uncompressed forward pass through an attention function registered with transformers'
``AttentionInterface`` under :data:`ATTN_IMPLEMENTATION`; it computes ordinary causal attention with
the library's own explicit attention (``scissorhands.attention.explicit_attention``, the one the
budgeted cache hands its policies; the model's outputs are unchanged) and folds each query chunk into :class:`PivotalSets`, so
the ``T x T`` maps of all layers are never held at once.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from scissorhands.attention import explicit_attention

ATTN_IMPLEMENTATION = "quality_persistence"
_ACTIVE = threading.local()


class PivotalSets:
    """Accumulates ``S_before`` and ``S_after`` per layer and head.

    Args:
        split_token: ``t``, the split point (``1 <= t``).
    """

    def __init__(self, split_token: int):
        if split_token < 1:
            raise ValueError(f"split_token must be >= 1, got {split_token}")
        self.split_token = split_token
        self.before: dict[int, torch.Tensor] = {}  # layer -> (heads, t) bool
        self.after: dict[int, torch.Tensor] = {}  # layer -> (heads, t) bool

    def update(self, layer: int, probs: torch.Tensor, query_positions: torch.Tensor) -> None:
        """Fold one chunk of attention into the sets.

        Args:
            layer: layer index.
            probs: ``(heads, q, keys)`` attention probabilities of ``q`` queries over keys ``0..keys-1``.
            query_positions: ``(q,)`` int64 token index of each query (keys visible: ``position + 1``).
        """
        t = self.split_token
        h, _, k = probs.shape
        if layer not in self.before:
            self.before[layer] = torch.zeros(h, t, dtype=torch.bool)
            self.after[layer] = torch.zeros(h, t, dtype=torch.bool)
        width = min(t, k)
        n_visible = (query_positions + 1).to(probs.dtype)  # (q,)
        pivotal = probs[:, :, :width] * n_visible[None, :, None] > 1.0  # (h, q, width): p > 1/n
        early = query_positions < t
        if bool(early.any()):
            self.before[layer][:, :width] |= pivotal[:, early].any(1).cpu()
        if bool((~early).any()):
            self.after[layer][:, :width] |= pivotal[:, ~early].any(1).cpu()

    def result(self) -> dict:
        """``{"persistence_ratio": [per layer], "pivotal_share": [per layer]}`` (means over heads)."""
        ratios, shares = [], []
        for layer in sorted(self.before):
            before, after = self.before[layer], self.after[layer]
            n_after = after.sum(-1).double()  # (h,)
            kept = (after & before).sum(-1).double()
            ok = n_after > 0
            ratios.append(float((kept[ok] / n_after[ok]).mean()) if bool(ok.any()) else math.nan)
            shares.append(float(before.sum(-1).double().mean() / self.split_token))
        return {"persistence_ratio": ratios, "pivotal_share": shares}


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, query_chunk=256, **kwargs):
    """Causal attention (``scissorhands.attention.explicit_attention``, in query chunks) that also feeds
    the active :class:`PivotalSets`. query ``(b, hq, q, d)``, key/value ``(b, hkv, S, d)``; returns
    ``((b, q, hq, d_v), None)``."""
    b, hq, q_len, d = query.shape
    if scaling is None:
        scaling = d**-0.5
    s_len = key.shape[2]
    q_pos = torch.arange(s_len - q_len, s_len, device=query.device)
    out = query.new_empty(b, hq, q_len, value.shape[-1])
    sets = getattr(_ACTIVE, "sets", None)
    for s in range(0, q_len, query_chunk):
        e = min(q_len, s + query_chunk)
        causal = torch.arange(s_len, device=query.device)[None, :] <= q_pos[s:e, None]  # (q_c, S)
        o, probs = explicit_attention(
            query[:, :, s:e], key, value, causal.expand(b, key.shape[1], e - s, s_len), scaling
        )  # probs (b, hkv, g, q_c, S)
        out[:, :, s:e] = o
        if sets is not None:  # query head h = kv * g + j
            sets.update(module.layer_idx, probs[0].flatten(0, 1), q_pos[s:e])
    return out.transpose(1, 2).contiguous(), None


def _no_mask(batch_size, q_length, kv_length, attention_mask=None, **kwargs):
    return None  # the attention function builds its own causal mask (single unpadded sequence)


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


@contextlib.contextmanager
def _collecting(model, sets: PivotalSets):
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    _ACTIVE.sets = sets
    try:
        yield
    finally:
        _ACTIVE.sets = None
        model.set_attn_implementation(previous)


@torch.inference_mode()
def persistence_ratio(
    model, windows: list[list[int]], split_fraction: float = 0.5, device: str | torch.device = "cpu"
) -> dict:
    """Persistence ratio and pivotal share per layer, averaged over text windows.

    Args:
        windows: token-id windows of equal length ``T`` (one sequence each, no padding).
        split_fraction: ``t = round(T * split_fraction)``, in ``(0, 1)``.

    Returns:
        ``{"persistence_ratio": [per layer], "pivotal_share": [per layer], "persistence_ratio_mean",
        "pivotal_share_mean", "split_token", "tokens_per_window", "windows", "eval_s"}``.
    """
    if not windows:
        raise ValueError("windows: need at least one window of token ids")
    if not 0 < split_fraction < 1:
        raise ValueError(f"split_fraction must be in (0, 1), got {split_fraction}")
    t0 = time.perf_counter()
    length = len(windows[0])
    split = max(1, min(length - 1, round(length * split_fraction)))
    per_window = []
    for w in windows:
        if len(w) != length:
            raise ValueError(f"windows must have equal lengths, got {len(w)} and {length}")
        sets = PivotalSets(split)
        with _collecting(model, sets):
            model(input_ids=torch.tensor([w], dtype=torch.long, device=device), use_cache=False, logits_to_keep=1)
        per_window.append(sets.result())
    layers = len(per_window[0]["persistence_ratio"])

    def mean_over_windows(key):
        return [_nanmean([r[key][i] for r in per_window]) for i in range(layers)]

    ratio, share = mean_over_windows("persistence_ratio"), mean_over_windows("pivotal_share")
    return {
        "persistence_ratio": ratio,
        "pivotal_share": share,
        "persistence_ratio_mean": _nanmean(ratio),
        "pivotal_share_mean": _nanmean(share),
        "split_token": split,
        "tokens_per_window": length,
        "windows": len(windows),
        "eval_s": time.perf_counter() - t0,
    }


def _nanmean(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan
