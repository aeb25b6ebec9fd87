"""``snapkv``: observation window + pooled attention (Li et al., NeurIPS 2024, arXiv 2404.14469).

"SnapKV: LLM Knows What You are Looking for Before Generation": the attention the last
``window_size`` queries of the prompt (the *observation window*) give each earlier token is summed
(the "votes"; per KV head, the group's query heads averaged first), smoothed by average pooling over
``kernel_size`` neighbouring tokens (so a selected token brings its neighbours' context), and the
tokens with the most pooled votes are kept together with the observation window itself.

Choices this project makes (each a documented parameter, never a silent constant; docs/library.md):

* Pooling runs over the eviction candidates (the tokens a row and head still hold outside the recent window),
  in time order, zero-padded at both ends (``count_include_pad``), at eviction time: as the paper and kvpress's
  ``SnapKVPress`` pool the tokens before the observation window, so the window's own votes never raise its
  neighbour's score; real eviction and simulation mode, a row alone and in a left-padded batch all pool the
  same neighbours.
* The paper compresses the prompt only. To hold the budget while generating, every generated token
  votes too (one query per step) and its votes add to the prompt's; a prompt fed in several calls
  votes with the last ``window_size`` queries of each call.
* The observation window is the recent window (``recent_window`` defaults to
  ``min(window_size, budget_tokens // 2)``).
* While decoding, one token is evicted per step (``drop_tokens`` defaults to 1, as ``h2o``, ``tova`` and
  ``streaming_llm``), measured (docs/library.md, "Baselines at decode time"): with the shared default
  ``budget_tokens // 2`` a compression at B = 39 left one token outside the 19-token window, and the pooling
  ranks the first token (the attention sink, zero-padded on its left) below its neighbours, so the cache
  became a sliding window without its sink: perplexity 116 against full's 41 on 192 held-out tokens of the
  embedded model, 43 with one token per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..checks import check_int
from .base import Policy


@dataclass
class SnapKV(Policy):
    """Keeps the slots with the most pooled votes from the observation window (+ the window itself).

    State: the summed votes, float32 per slot and KV head.

    Attributes:
        window_size: queries of each call whose attention votes (the observation window); also the
            default recent window.
        kernel_size: tokens averaged by the pooling (odd; 1 = no pooling).
    """

    name: ClassVar[str] = "snapkv"
    merged_schedule_exact: ClassVar[bool] = True
    needs_attention: ClassVar[bool] = True
    state_width: ClassVar[int] = 1
    uses_query_time: ClassVar[bool] = False

    window_size: int = 32
    kernel_size: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("window_size", self.window_size, 1)
        k = self.kernel_size
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k % 2 == 0:
            raise ValueError(f"kernel_size must be an odd integer >= 1, got {k!r}")

    def default_recent_window(self, budget_tokens: int) -> int:
        return min(self.window_size, budget_tokens // 2)

    def default_drop_tokens(self, budget_tokens: int) -> int:
        return 1

    def observed_queries(self, first_query: int, q_len: int) -> int:
        """The observation window: the call's last ``window_size`` queries (every query of a decode step)."""
        return min(self.window_size, q_len)

    def observe(self, state, probs, visible, first_query) -> None:
        state[..., 0] += probs.sum(2)  # (b, h, q, S) -> (b, h, S)

    def keep_score(self, state, token_index, *, layer_idx, budget_tokens):
        """The votes averaged over ``kernel_size`` neighbouring candidates (held tokens outside the recent window,
        in time order, zero-padded at both ends; the paper's and kvpress's pooling of the tokens before the
        observation window); the recent window's own scores are pooled alike but never read (it is protected)."""
        held = token_index >= 0  # (b, h, S)
        r = self.resolve(budget_tokens)[0]
        newer = held.flip(-1).cumsum(-1).flip(-1)  # held tokens at or after the slot
        cand = held & (newer > r)  # (b, h, S) what the layer may evict
        order = torch.sort((~cand).to(torch.uint8), dim=-1, stable=True).indices  # candidates first, in time order
        votes = state[..., 0].to(torch.float64).masked_fill(~cand, 0.0).gather(-1, order)
        k = self.kernel_size
        pooled = torch.nn.functional.avg_pool1d(
            votes.flatten(0, 1)[:, None], k, stride=1, padding=k // 2, count_include_pad=True
        ).view_as(votes)
        return torch.empty_like(pooled).scatter_(-1, order, pooled)
