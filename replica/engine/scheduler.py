"""The engine's schedulers: which prompts a step feeds, which requests it admits or rejects, which rows leave.

A scheduler is a value function, ``plan(view, kv) -> StepPlan``: it reads the engine (`EngineView`: running rows,
prompts part-way fed, the queue) and asks the KV budget (`replica.engine.kv_budget`) what fits; the core applies
the plan (`replica.engine.core`). One class per `EngineConfig.scheduler` (`SCHEDULERS`):

* `PrefillFirst`: a step admits queued requests in arrival order (first come, first served; the head of the
  queue is never skipped) while the batch stays within `max_batch`, `max_prefill_tokens` and the KV budget
  (`KVBudget.admission`, for either layout), and prefills each admitted group whole (requests of equal prompt
  length together); then every running row decodes.
* `Mixed` (paged layout): a step spends one token budget, `max_num_batched_tokens`, as vLLM V1 does: every running
  row's decode token first, then chunks of the prompts part-way fed (oldest first) and of queued requests.

With prefix caching (`EngineConfig.enable_prefix_caching`) both look up each queued request's cached blocks
(`KVBudget.look_up_prefix`): its prefill starts after them, and a cached block running rows hold already takes no
free block (`KVBudget.shared_blocks`).

Before each decode step, `preemption` names the row that must leave while the running rows' next blocks are not
free (`KVBudget.must_preempt`): a prompt part-way fed first, else the most recently admitted row (vLLM's rule).
"""

from __future__ import annotations

from replica.common.types import EngineConfig
from replica.engine.kv_base import KVBudget
from replica.engine.requests import EngineView, Prefill, Sequence, StepPlan, decodes_after_prefill, same_group

__all__ = ["SCHEDULERS", "SCHEDULE_KEYS", "Mixed", "PrefillFirst", "Scheduler"]

#: The knobs that say how a step is scheduled, as the engine's `stats()` reports them (`Scheduler.stats`): the
#: scheduler's name and its token budget a step (None: whole prompts). A serving record's columns, and under
#: ``mixed`` part of a serving point's id (`workloads.serving.suite`), so these names live here once.
SCHEDULE_KEYS = ("scheduler", "max_num_batched_tokens")


class Scheduler:
    """The part every scheduler shares: the config, and who leaves when the next decode step does not fit."""

    #: whether prompts are fed in chunks of at most `max_num_batched_tokens` (what `fits_alone` bounds by)
    chunked = False

    def __init__(self, config: EngineConfig):
        self.config = config
        self.cap = config.max_batch or 1 << 30

    def chunk_tokens(self) -> int | None:
        """The most prompt tokens one forward of a prompt feeds (None: the whole prompt)."""
        return self.config.max_num_batched_tokens if self.chunked else None

    def stats(self) -> dict:
        """`SCHEDULE_KEYS` for the engine's `stats()`: this scheduler's name and `chunk_tokens`."""
        return dict(zip(SCHEDULE_KEYS, (self.config.scheduler, self.chunk_tokens())))

    def plan(self, view: EngineView, kv: KVBudget) -> StepPlan:
        raise NotImplementedError

    @staticmethod
    def preemption(view: EngineView, kv: KVBudget) -> Prefill | Sequence | None:
        """The next to leave before the decode step (None: it fits): the newest prompt part-way fed (newer than
        every running row), else the newest running row, while `kv.must_preempt(view)`."""
        if not kv.must_preempt(view):
            return None
        return view.prefilling[-1] if view.prefilling else view.running[-1]


class PrefillFirst(Scheduler):
    """Whole prompts first, then one decode step (see the module docstring); one loop for both KV layouts."""

    def plan(self, view: EngineView, kv: KVBudget) -> StepPlan:
        admission = kv.admission(view)
        groups: list[list[Sequence]] = []
        out = StepPlan()
        prefill_tokens = 0
        for seq in view.queue:
            if len(view.running) + sum(map(len, groups)) >= self.cap:
                break
            if seq.unfit is not None:  # never a preempted one: fits_alone counted its recompute
                out.consumed += 1
                out.rejected.append((seq, seq.unfit))
                continue
            kv.look_up_prefix(seq)  # its cached blocks now (the cache changes between steps)
            n = len(seq.prefill_ids())
            if groups and prefill_tokens + n - seq.cached_tokens > self.config.max_prefill_tokens:
                break  # enough prefill for this step; running rows decode first
            where = admission.admits(seq, n, bool(groups) and same_group(groups[-1][0], seq))
            if where is None:
                break  # wait for memory: rows finish or are preempted
            if where == "join":
                groups[-1].append(seq)
            else:
                groups.append([seq])
            out.consumed += 1
            prefill_tokens += n - seq.cached_tokens
        out.chunks = [(Prefill(g), None) for g in groups]
        return out


class Mixed(Scheduler):
    """`scheduler: mixed`: this step's prompt chunks, as vLLM V1 spends a step's token budget. Every running
    row's decode token comes first; the rest of `max_num_batched_tokens` goes to the prompts part-way fed
    (oldest first), then to queued requests (first come, first served; equal lengths fed join one chunk),
    each chunk as long as the tokens left and the free blocks allow (the running rows' next blocks kept).

    Blocks are taken chunk by chunk, but a queued request starts only when its whole prefill (its last
    chunk's peak) fits beside the rest of the prompts part-way fed and the blocks the running rows take while
    they are all fed (vLLM V0's whole-prompt admission, with the running rows' growth as its watermark): a
    prompt that took the last free blocks would be the first preempted when a running row grows, and fed
    again from its start."""

    chunked = True

    def plan(self, view: EngineView, kv) -> StepPlan:
        out = StepPlan()
        tokens = self.config.max_num_batched_tokens - len(view.running)
        growth = kv.growth(view, 1)
        # the bookkeeping the running rows and the prompts part-way fed pad to once all are merged
        widths = kv.running_widths(view) + [kv.width(s, p.length + 1) for p in view.prefilling for s in p.group]
        free = kv.pool.free_blocks - growth - kv.padding_blocks(view, widths) - kv.shared_charge()
        committed = 0  # blocks the planned chunks add, once fed
        per_step = max(1, tokens)  # prompt tokens a step feeds while these rows run

        def held(p: Prefill) -> int:
            return kv.num_layers * kv.blocks(kv.kept_slots(p.fed, p.group[0].kept_tokens))

        def after(p: Prefill, chunk: int, seqs: list[Sequence]) -> int:
            """Blocks one row of `p` holds after `chunk` more tokens."""
            end = p.fed + chunk == p.length
            return kv.chunk_blocks(p.fed, chunk, p.group[0].kept_tokens, end and decodes_after_prefill(seqs))[1]

        def whole(p: Prefill, seqs: list[Sequence]) -> int:
            """Blocks one row of `p` holds at its last chunk's peak (a budgeted row holds B + chunk in the layer
            being computed) or after it, whichever is more: what it takes by the end of its prefill."""
            last = min(p.length - p.fed, per_step)
            return kv.chunk_blocks(p.length - last, last, p.group[0].kept_tokens, decodes_after_prefill(seqs))[0]

        def longest(p: Prefill, seqs: list[Sequence], most: int, base: int, was: int | None = None) -> int:
            """The longest chunk <= `most` tokens whose peak fits beside `base` committed blocks (0: none); `was`:
            the blocks a row holds already (default `held`; a new row: only its cached blocks rows hold)."""
            budget, was = p.group[0].kept_tokens, held(p) if was is None else was
            lo, hi = 0, most
            while lo < hi:  # blocks grow with the chunk: bisect
                mid = (lo + hi + 1) // 2
                end = p.fed + mid == p.length
                peak, _ = kv.chunk_blocks(p.fed, mid, budget, end and decodes_after_prefill(seqs))
                lo, hi = (mid, hi) if base + len(seqs) * (peak - was) <= free else (lo, mid - 1)
            return lo

        for p in view.prefilling:
            chunk = longest(p, p.group, min(p.length - p.fed, tokens // p.rows), committed)
            if chunk == 0:
                break  # the older prompt waits for blocks or tokens: so do the newer ones
            out.chunks.append((p, chunk))
            tokens -= p.rows * chunk
            committed += p.rows * (after(p, chunk, p.group) - held(p))
        if len(out.chunks) < len(view.prefilling):
            return self._stalled(out, view)
        # blocks the prompts part-way fed still take before they run, kept for them
        reserved = sum(p.rows * (whole(p, p.group) - held(p)) for p, _ in out.chunks)
        feeding = sum(p.rows * (p.length - p.fed) for p in view.prefilling)  # prompt tokens still to feed

        def fits(extra_blocks: int, extra_tokens: int) -> bool:
            """Whether the reserve plus `extra_blocks` fits beside the running rows' growth until every prompt
            admitted so far, plus `extra_tokens` more, is fed."""
            steps = -(-(feeding + extra_tokens) // per_step)
            return reserved + extra_blocks + kv.growth(view, steps) - growth <= free

        last: Prefill | None = None  # the newest group of this step, which an equal request may join
        before_last = committed
        rows = view.rows
        for seq in view.queue:
            if tokens <= 0 or rows >= self.cap:
                break
            if seq.unfit is not None:  # never a preempted one: fits_alone counted its recompute
                out.consumed += 1
                out.rejected.append((seq, seq.unfit))
                continue
            kv.look_up_prefix(seq)  # its cached blocks now (the cache changes between steps)
            shared = kv.shared_blocks(seq)  # cached blocks rows hold already: no free block taken for them
            chunk = out.chunks[-1][1] if last is not None else 0
            joined = last.group + [seq] if last is not None else []
            width = kv.width(seq, len(seq.prefill_ids()) + 1)
            pad = kv.added_padding_blocks(view, widths, width)
            if (
                last is not None
                and same_group(last.group[0], seq)
                and tokens >= chunk
                and fits(whole(last, [seq]) + pad - shared, last.length - last.fed)
                and longest(last, joined, chunk, before_last, min(map(kv.shared_blocks, joined))) == chunk
            ):
                last.group.append(seq)  # fed with the newest group: its rows peak together
                committed = before_last + sum(after(last, chunk, last.group) - kv.shared_blocks(s) for s in joined)
                reserved += whole(last, [seq]) + pad - shared
            else:
                p = Prefill([seq])
                need = whole(p, p.group) + pad - shared
                left = p.length - p.fed  # tokens to feed: past its cached blocks
                chunk = longest(p, p.group, min(left, tokens), committed, shared) if fits(need, left) else 0
                if chunk == 0:
                    break  # wait for blocks: rows finish or are preempted
                out.chunks.append((p, chunk))
                out.started.append(p)
                last, before_last = p, committed
                committed += after(p, chunk, p.group) - shared
                reserved += need
            out.consumed += 1
            rows += 1
            widths.append(width)
            feeding += len(seq.prefill_ids()) - seq.cached_tokens
            tokens -= chunk
        return self._stalled(out, view)

    @staticmethod
    def _stalled(out: StepPlan, view: EngineView) -> StepPlan:
        """`out`, told to yield the newest prompt part-way fed when nothing runs and those prompts hold the pool."""
        out.yield_newest = not out.chunks and not view.running and len(view.prefilling) > 1
        return out


#: The scheduler of each `EngineConfig.scheduler`.
SCHEDULERS: dict[str, type[Scheduler]] = {"prefill_first": PrefillFirst, "mixed": Mixed}
