"""The engine's model runner: prefill and decode forwards of a plan, and the running batch's cache (no requests'
lifecycle: it returns what it picked, or the fault, and the core answers the requests).

The running batch is one cache whose rows are the running requests (in the core's order) and the last token of
each row; a prompt group's cache joins it after its last chunk (`scissorhands.batching.merge_rows`) and rows leave
it by `keep` (`select_rows`: a paged row's blocks go back to the pool).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from replica.common.types import EngineConfig
from replica.engine.requests import Prefill, Sequence
from replica.sampling import pick_tokens, score_prompt
from scissorhands import make_cache
from scissorhands.batching import cache_slot_bytes, measured_cache, merge_rows, row_positions, select_rows
from scissorhands.paged import BlockPool, bookkeeping_slot_bytes, release_cache

__all__ = ["PROBE_BUDGET_TOKENS", "Forward", "ModelRunner"]

# The budget of the cache an engine under `budget: per_request` builds once, only to validate its policy parameters
# and measure the bytes of one slot (which do not depend on B); every request's cache gets the request's own B.
PROBE_BUDGET_TOKENS = 1024


@dataclass
class Forward:
    """What one forward returned: the tokens picked (one per row; none for a prompt chunk before the last), as
    ``picked`` ``(rows, 1)`` too, the tokens the policy evicted, its wall seconds, or the fault that stopped it."""

    tokens: list[int]
    picked: torch.Tensor | None = None
    evicted_tokens: int = 0
    seconds: float = 0.0
    error: BaseException | None = None


class ModelRunner:
    """Runs the model for the engine.

    Args:
        model: a transformers causal LM (its attention implementation becomes ``"scissorhands"``).
        config: `EngineConfig` (policy, its parameters, budget, ``max_length_tokens``).
        eos_token_id: the EOS id `pick_tokens` reports (None: never).

    Raises:
        ValueError: from `make_cache` for an invalid policy parameter or budget (the probe cache, built now).
    """

    def __init__(self, model, config: EngineConfig, eos_token_id: int | None):
        self.model, self.config, self.eos_token_id = model, config, eos_token_id
        self.device = next(model.parameters()).device
        self.per_request = config.budget == "per_request"
        budget = config.resolved_budget_tokens()
        self.cache_kwargs: dict[str, Any] = dict(config.policy_params)
        if budget is None and config.max_length_tokens is not None:
            self.cache_kwargs["max_length"] = config.max_length_tokens
        if budget is not None:
            # max_length = B: every layer preallocates B slots per row, so decode tokens are written in
            # place; a sequence then holds B slots from its prefill on (its bytes, known in advance)
            # capped at the workload's longest sequence: a budget above it (a floor, a window >= L) reserves nothing used
            cap = budget if config.max_length_tokens is None else min(budget, config.max_length_tokens)
            self.cache_kwargs.update(budget_tokens=budget, max_length=cap)
        elif self.per_request:  # each group's cache gets its requests' B; this one only validates and measures
            self.cache_kwargs.update(budget_tokens=PROBE_BUDGET_TOKENS, max_length=PROBE_BUDGET_TOKENS)
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(text_config.num_hidden_layers)
        probe = measured_cache(model, config.policy, **self.cache_kwargs)  # validates now, not at the first request
        self.slot_bytes = cache_slot_bytes(probe)
        # one row's slot of slot times and policy statistics, all layers: dense on the paged layout, padded
        self.bookkeeping_slot_bytes = bookkeeping_slot_bytes(probe)
        self.pool: BlockPool | None = None  # the paged layout's, set by the engine once its KV budget made it
        self.cache = None  # the running batch's
        self.next_tokens: torch.Tensor | None = None  # (rows, 1) last token of each running row

    def check_budget(self, budget: int) -> None:
        """Raise ValueError when the policy refuses `budget` (a per-request B: `Policy.resolve`)."""
        make_cache(self.config.policy, self.model, **{**self.cache_kwargs, "budget_tokens": budget})

    def new_cache(self, group: list[Sequence] | None = None, paged: bool = True):
        """A cache for `group`'s rows (one budget; needed under `budget: per_request`), in the block pool (paged
        layout) unless `paged` is False."""
        pool = self.pool if paged else None
        if not self.per_request:
            cache = make_cache(self.config.policy, self.model, pool=pool, **self.cache_kwargs)
        else:
            budget = group[0].budget_tokens
            kwargs = {**self.cache_kwargs, "budget_tokens": budget, "max_length": budget}
            cache = make_cache(self.config.policy, self.model, pool=pool, **kwargs)
            # rows of other budgets merge into one batch; each reserves at most the slots its sequence can hold
            cache.set_row_budgets([budget] * len(group), [s.final_slots for s in group])
        if group and any(s.pinned_tokens for s in group):  # kv_reuse: shared_prefix: the prompt's blocks stay whole
            cache.set_pinned_tokens([s.pinned_tokens for s in group])
        return cache

    def score_prompt(self, seq: Sequence) -> tuple[list, list, int]:
        """The prompt's log-probabilities (`replica.sampling.score_prompt`: a cache of its own, fed as decoding
        would) and that cache's peak bytes. The cache is built as the request's prefill cache is (in the block pool
        on the paged layout) and freed before its prefill starts, so it holds at most one row of what admission
        reserved for that prefill, inside the KV memory limit. Raises what the forward raises."""
        req = seq.request
        cache = self.new_cache([seq])
        try:
            lps, tops = score_prompt(self.model, cache, req.prompt_ids, req.prompt_logprobs, self.device)
            return lps, tops, cache.peak_kv_cache_bytes
        finally:
            release_cache(cache)  # its blocks back in the pool before the prefill takes them

    def prefill(self, p: Prefill, chunk: int) -> Forward:
        """Forward the next `chunk` tokens of `p`'s prompts (equal lengths) into its cache, a fresh one at the first
        chunk; after the last, pick each row's first token. A policy that evicts compresses to its budget after
        every chunk (its layer's `attend`), so a chunk as long as the prompt is the whole-prompt prefill. On a
        fault the group's cache is released."""
        last = p.fed + chunk == p.length
        t0 = time.perf_counter()
        try:
            if p.ids is None:  # (n, L); its copy to the device may fail too (out of memory): the group's failure
                p.ids = torch.tensor([s.prefill_ids() for s in p.group], dtype=torch.long, device=self.device)
            if p.cache is None:
                p.cache = self.new_cache(p.group)
            evicted0 = p.cache.layers[0].evicted_tokens
            with torch.inference_mode():
                out = self.model(
                    input_ids=p.ids[:, p.fed : p.fed + chunk], cache=p.cache, use_cache=True, logits_to_keep=1
                )  # positions follow the tokens the cache has seen
                first = pick_tokens(out.logits[:, -1, :], p.group, self.eos_token_id) if last else None  # (n, 1)
            tokens = first[:, 0].tolist() if last else []
        except Exception as e:  # noqa: BLE001 - every failure is reported per request, by the core
            release_cache(p.cache)
            return Forward([], error=e)
        p.fed += chunk
        evicted = int(p.cache.layers[0].evicted_tokens - evicted0)
        return Forward(tokens, first, evicted, time.perf_counter() - t0)

    def join(self, p: Prefill, picked: torch.Tensor, keep: list[int]) -> None:
        """Merge the rows `keep` of `p`'s cache (prefilled, first tokens `picked` ``(n, 1)``) into the running
        batch; the rest leave (none kept: its blocks go back to the pool)."""
        cache = p.cache
        if not keep:
            release_cache(cache)
            return
        if len(keep) < p.rows:
            cache, picked = select_rows(cache, keep), picked[keep]
        self.cache = merge_rows(self.cache, cache)
        self.next_tokens = picked if self.next_tokens is None else torch.cat([self.next_tokens, picked], dim=0)

    def decode(self, rows: list[Sequence]) -> Forward:
        """One token for every running row (`rows`, in the batch's order), each at its own position. On a fault the
        batch's cache is released (every row leaves)."""
        t0 = time.perf_counter()
        evicted0 = self.cache.layers[0].evicted_tokens
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=self.next_tokens,
                    position_ids=row_positions(self.cache),
                    cache=self.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                nxt = pick_tokens(out.logits[:, -1, :], rows, self.eos_token_id)  # (rows, 1)
            tokens = nxt[:, 0].tolist()
        except Exception as e:  # noqa: BLE001 - every failure is reported per request, by the core
            release_cache(self.cache)
            self.cache, self.next_tokens = None, None
            return Forward([], error=e)
        self.next_tokens = nxt
        return Forward(tokens, nxt, int(self.cache.layers[0].evicted_tokens - evicted0), time.perf_counter() - t0)

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows of the running batch (in this order); the others' slots and blocks are freed."""
        self.cache = select_cache_rows(self.cache, rows)
        self.next_tokens = self.next_tokens[rows] if rows else None

    @staticmethod
    def keep_prefill_rows(p: Prefill, rows: list[int]) -> None:
        """Keep only these rows (at least one) of a group part-way fed."""
        p.group = [p.group[i] for i in rows]
        p.cache = select_rows(p.cache, rows) if p.cache is not None else None
        p.ids = p.ids[rows] if p.ids is not None else None

    @staticmethod
    def release_group(p: Prefill) -> None:
        """Return the blocks of a group part-way fed to the pool (it leaves, or goes back to the queue)."""
        release_cache(p.cache)

    def release(self, prefilling: list[Prefill]) -> None:
        """Free every cache: the groups' part-way fed and the running batch's."""
        for p in prefilling:
            release_cache(p.cache)
        release_cache(self.cache)
        self.cache, self.next_tokens = None, None

    def caches(self, prefilling: list[Prefill]) -> list:
        """Every live cache: the running batch's and those of the prompts part-way fed."""
        return [c for c in [self.cache, *(p.cache for p in prefilling)] if c is not None]


def select_cache_rows(cache, keep: list[int]):
    """`select_rows`, or None with every block returned when no row stays."""
    if keep:
        return select_rows(cache, keep)
    release_cache(cache)
    return None
