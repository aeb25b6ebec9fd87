"""The engine's request records and the view its scheduler plans from (values shared by the engine's parts).

`Sequence` is one request inside the engine (its result so far, its budget, the slots its row holds); `Prefill` is
a group of requests whose prompts are fed together; `EngineView` is what `Scheduler.plan` sees of the engine at
the start of a step; `StepPlan` is what it answers (`replica.engine.scheduler`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from replica.common.types import GenerationRequest, GenerationResult

__all__ = ["EngineView", "Prefill", "Sequence", "StepPlan", "decodes_after_prefill", "same_group", "steps_left"]


@dataclass
class Sequence:
    """One request inside the engine: its request, its result so far and the callbacks the core calls."""

    request: GenerationRequest
    result: GenerationResult
    on_done: Callable[[GenerationResult], None]
    final_slots: int
    budget_tokens: int | None  # this sequence's B (its own under `budget: per_request`), None for full
    held_slots: int = 0  # tokens the row holds in the cache now (for the prefill-time bound)
    on_token: Callable[[int, float], None] | None = None
    generator: torch.Generator | None = None  # this request's sampling draws (temperature > 0)
    preempted: bool = False  # paged layout: its row was freed; its next prefill recomputes prompt + output
    unfit: str | None = None  # why it can never run under the memory limit (`fits_alone`), checked at submit
    # prefix caching: the first tokens of its next prefill the cache holds (looked up at each plan), and the hashes
    # of the full blocks of `prefill_ids` (`replica.engine.prefix_cache.chain_hashes`), the hit's first
    cached_tokens: int = 0
    block_hashes: list = field(default_factory=list)
    from_session: bool = False  # kv_reuse: session_state: `cached_tokens` are its session's kept state's
    # kv_reuse: shared_prefix: its prompt's first tokens its budgeted row keeps uncompressed and shares (whole blocks,
    # `KVBudget.pinned_of`), held beside its budget; 0 otherwise
    pinned_tokens: int = 0

    @property
    def kept_tokens(self) -> int | None:
        """The most slots its row keeps per layer: its budget plus its pinned prefix (None: keeps every token)."""
        return None if self.budget_tokens is None else self.budget_tokens + self.pinned_tokens

    def prefill_ids(self) -> list[int]:
        """The tokens its next prefill feeds: the prompt, plus every output token after a preemption."""
        return self.request.prompt_ids + self.result.output_ids if self.preempted else self.request.prompt_ids

    sample_error: str | None = None  # why this row's last pick failed (pick_tokens): it fails alone
    token_logprob: float | None = None  # the last picked token's log-probability (request.logprobs)
    token_top_logprobs: list | None = None  # ... and its alternatives, [[token_id, logprob], ...]


class Prefill:
    """A group of requests whose prompts are being prefilled (equal lengths fed, one budget): under
    ``scheduler: mixed`` chunk by chunk across steps, under ``prefill_first`` in one chunk."""

    def __init__(self, group: list[Sequence]):
        self.group = group
        self.cache = None  # built at the first chunk (in the block pool on the paged layout)
        self.ids: torch.Tensor | None = None  # (n, L) the tokens to feed
        self.cached = group[0].cached_tokens  # tokens of each row taken from the prefix cache, not fed
        self.fed = self.cached  # tokens of each row fed so far (or cached)
        self.length = len(group[0].prefill_ids())

    @property
    def rows(self) -> int:
        return len(self.group)


def same_group(a: Sequence, b: Sequence) -> bool:
    """Whether two requests prefill in one call: the same length fed, the same budget and as many tokens cached (a
    request started from its session's kept state prefills alone: that cache is one row's)."""
    return (
        not (a.from_session or b.from_session)
        and len(a.prefill_ids()) == len(b.prefill_ids())
        and a.budget_tokens == b.budget_tokens
        and a.pinned_tokens == b.pinned_tokens
        and a.cached_tokens == b.cached_tokens
    )


def steps_left(seq: Sequence) -> int:
    """Decode steps a running row may still run (it writes one slot each): its new tokens not yet picked."""
    return seq.request.max_new_tokens - len(seq.result.output_ids)


def decodes_after_prefill(seqs: list[Sequence]) -> bool:
    """Whether a row of `seqs` runs a decode step after its prefill (its prefill picks one token, so a row
    with one new token left ends there and its first decode never takes a block)."""
    return any(s.request.max_new_tokens - len(s.result.output_ids) > 1 for s in seqs)


@dataclass
class EngineView:
    """What the scheduler sees at a step: the running rows (in the order of the running cache's rows) and that
    cache, the prompts part-way fed (oldest first), and the queue (head first; read under the engine's lock)."""

    running: list[Sequence]
    cache: Any
    prefilling: list[Prefill]
    queue: list[Sequence]

    @property
    def rows(self) -> int:
        """Requests admitted and not finished: decoding, or part-way prefilled."""
        return len(self.running) + sum(p.rows for p in self.prefilling)

    def other_caches(self) -> list:
        """The live caches besides the running batch's: those of the prompts part-way fed."""
        return [p.cache for p in self.prefilling if p.cache is not None]


@dataclass
class StepPlan:
    """One step's schedule (`Scheduler.plan`): the prompt chunks to feed, in order (``(group, tokens)``; tokens None:
    the whole prompt), the groups that start in this step and stay part-way fed (``scheduler: mixed``), how many
    requests it takes from the head of the queue (``consumed``: admitted or rejected), the requests rejected with
    why, and ``yield_newest``: the prompts part-way fed hold the pool with nothing running, so the newest goes back
    to the queue and the step is planned again."""

    chunks: list[tuple[Prefill, int | None]] = field(default_factory=list)
    started: list[Prefill] = field(default_factory=list)
    consumed: int = 0
    rejected: list[tuple[Sequence, str]] = field(default_factory=list)
    yield_newest: bool = False
