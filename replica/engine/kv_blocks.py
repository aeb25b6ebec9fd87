"""The KV budget of the paged layout, in blocks of one pool (`replica.engine.kv_budget` describes the bound)."""

from __future__ import annotations

import math

from replica.engine.kv_base import KVBudget
from replica.engine.prefix_cache import PrefixCachingPool, chain_hashes, seed_rows
from replica.engine.requests import EngineView, Prefill, Sequence, decodes_after_prefill, steps_left
from replica.engine.session_state import SessionStatePool, common_prefix_tokens, split_row
from scissorhands.paged import BlockPool, paged_rows, release_cache

__all__ = ["PagedBudget"]


class PagedBudget(KVBudget):
    """Blocks of ``block_tokens`` slots of one layer (all KV heads) in a pool sized to the KV memory limit; the
    running rows are read through `scissorhands.paged.paged_rows`.

    Raises:
        ValueError: the limit holds fewer blocks than the model has layers (the message gives both).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a block holds block_tokens slots of one layer (all KV heads): slot_bytes covers every layer
        self.block_bytes = math.ceil(self.config.block_tokens * self.slot_bytes / self.num_layers)
        usable = self.limit_bytes // self.block_bytes
        if usable < self.num_layers:
            raise ValueError(
                f"kv_memory_limit_bytes: {self.limit_bytes} bytes hold {usable} KV blocks of "
                f"{self.block_bytes} bytes; a paged pool needs at least one block per layer ({self.num_layers})"
            )
        if self.config.enable_prefix_caching:  # + the zero block
            self.pool = PrefixCachingPool(usable + 1, self.config.block_tokens, self.num_layers)
        elif self.config.kv_reuse == "session_state":
            self.pool = SessionStatePool(usable + 1, self.config.block_tokens)
        else:
            self.pool = BlockPool(usable + 1, self.config.block_tokens)
        self.prefix: PrefixCachingPool | None = self.pool if self.config.enable_prefix_caching else None
        self.sessions: SessionStatePool | None = self.pool if self.config.kv_reuse == "session_state" else None

    # ------------------------------------------------------------------ one row
    def blocks(self, slots: int) -> int:
        return -(-slots // self.config.block_tokens)

    @staticmethod
    def kept_slots(tokens: int, budget: int | None) -> int:
        return tokens if budget is None else min(tokens, budget)

    def prefill_peak_blocks(self, prompt_tokens: int, budget: int | None, chunk_tokens: int | None = None) -> int:
        """Blocks one row's prefill of `prompt_tokens` holds at its peak, all layers: the layers before the
        current one their kept slots, the current one what it holds before it compresses: the whole prompt when
        fed at once (`chunk_tokens` None), at most its budget plus one chunk when fed in chunks of at most
        `chunk_tokens` (a budgeted layer compresses back to its budget after every chunk, `chunk_blocks`; a full
        cache keeps every token, so its chunked peak is its whole-prompt peak)."""
        kept = self.kept_slots(prompt_tokens, budget)
        current = prompt_tokens if chunk_tokens is None or budget is None else min(prompt_tokens, budget + chunk_tokens)
        return (self.num_layers - 1) * self.blocks(kept) + self.blocks(current)

    def final_blocks(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Blocks a row holds at its end, all layers: what it needs to finish alone."""
        kept = self.kept_of(prompt_tokens, max_new_tokens)  # B + its pinned prefix (kv_reuse: shared_prefix)
        return self.num_layers * self.blocks(self.kept_slots(prompt_tokens + max_new_tokens - 1, kept))

    footprint = final_blocks

    def chunk_blocks(self, fed: int, chunk: int, budget: int | None, grows: bool) -> tuple[int, int]:
        """``(max(peak, after), after)``: blocks one row holds, all layers, while `chunk` tokens after the `fed` it
        holds are prefilled (the layers before the current one compressed, the current one its kept slots plus the
        chunk), and after it; `grows` adds the slot its first decode step writes (after the prompt's last chunk of
        a row that decodes again, `decodes_after_prefill`)."""
        after = self.num_layers * self.blocks(self.kept_slots(fed + chunk + grows, budget))
        peak = (self.num_layers - 1) * self.blocks(self.kept_slots(fed + chunk, budget)) + self.blocks(
            self.kept_slots(fed, budget) + chunk
        )
        return max(peak, after), after

    def memory_refusal(self, prompt_tokens, max_new_tokens, budget, chunk):
        """Its final blocks, and the peak of a prefill of its prompt plus every output but the last (what a
        recompute after a preemption feeds), fed as the scheduler feeds it (whole, or in chunks of at most
        `chunk`), so an admitted request is never refused later. The refusal gives both."""
        usable = self.pool.usable_blocks
        fed = prompt_tokens + max(0, max_new_tokens - 1)
        final = self.final_blocks(prompt_tokens, max_new_tokens)
        peak = self.prefill_peak_blocks(fed, budget, chunk)
        if max(final, peak) <= usable:
            return None
        how = "at once" if chunk is None else f"in chunks of at most {chunk} tokens"
        what = f"a prefill of up to {fed} tokens (a recompute: prompt + outputs but the last) fed {how} peaks at {peak}"
        return f"it needs {max(final, peak)} KV blocks alone ({what}, its row ends at {final}), more than the pool's {usable}"

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int, cap: int, chunk: int | None = None) -> int:
        """As many identical requests (at most `cap`) as hold their final blocks together (so none is preempted),
        the last one's prefill (whole, or in chunks of at most `chunk` tokens) peaking beside the others' final
        blocks."""
        final = self.final_blocks(prompt_tokens, max_new_tokens)
        peak = self.prefill_peak_blocks(prompt_tokens, self.kept_of(prompt_tokens, max_new_tokens), chunk)
        usable = self.pool.usable_blocks
        return max(0, min(cap, usable // final, 1 + (usable - peak) // final if peak <= usable else 0))

    # ------------------------------------------------------------------ prefix caching
    def hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of the full blocks of `seq`'s next prefill (`chain_hashes`, extended as it grows)."""
        return chain_hashes(seq.prefill_ids(), self.config.block_tokens, seq.block_hashes)

    def look_up_prefix(self, seq: Sequence) -> None:
        """Set ``seq.cached_tokens`` to the whole cached blocks its next prefill starts with, at most ``prefill - 1``
        tokens (one is always computed, so its first token has logits). None for a request that scores its prompt
        (`prompt_logprobs`: its first prefill computes every token's log-probabilities)."""
        seq.cached_tokens = 0
        if self.sessions is not None:
            self._look_up_session(seq)
            return
        if self.prefix is None or (seq.request.prompt_logprobs is not None and not seq.preempted):
            return
        n = len(seq.prefill_ids())
        most = (n - 1) // self.config.block_tokens
        if seq.budget_tokens is not None:  # kv_reuse: shared_prefix: only its pinned prompt blocks are whole
            most = seq.pinned_tokens // self.config.block_tokens
        if most:
            seq.cached_tokens = self.prefix.hit(self.hashes(seq), most) * self.config.block_tokens

    def shared_blocks(self, seq: Sequence) -> int:
        """Blocks of `seq`'s cache hit that rows hold already, all layers: its prefill takes no free block for
        them (an idle cached block it claims is taken from the free ones, so it counts as new)."""
        if self.sessions is not None:  # a state's blocks are held from the plan on (`SessionStatePool.planning`)
            state = self.sessions.states.get(seq.request.session_id) if seq.from_session else None
            return state.blocks if state is not None else 0
        if self.prefix is None or not seq.cached_tokens:
            return 0
        hashes = seq.block_hashes[: seq.cached_tokens // self.config.block_tokens]
        n = self.num_layers * sum(self.prefix.referenced(h) for h in hashes)
        return n - self.shared_bookkeeping_blocks(n)  # its own bookkeeping of those slots it does take

    def shared_bookkeeping_blocks(self, refs: int) -> int:
        """Blocks' worth of the bookkeeping (slot times, policy statistics: dense per row) of `refs` more references to
        shared blocks: the pool counts a shared block, and its share of the limit, once, but each row sharing it keeps
        its own bookkeeping of its slots."""
        per_layer_slot = self.bookkeeping_slot_bytes * self.config.block_tokens
        return -(-refs * per_layer_slot // (self.num_layers * self.block_bytes))

    def shared_charge(self) -> int:
        """`shared_bookkeeping_blocks` of every reference to a shared block beyond its first, held now (0 without the
        prefix cache): what the pool's free blocks do not say is taken."""
        if self.prefix is None:
            return 0
        return self.shared_bookkeeping_blocks(sum(r - 1 for r in list(self.prefix.refs.values())))

    def attach_prefix(self, p: Prefill, new_cache) -> int:
        """Start `p` (admitted, not fed yet) from its rows' cached blocks: each row claims its hit and `p.cache`
        (from ``new_cache(group)``) starts with them (`seed_rows`). Returns the tokens each row takes from the cache
        (0: none, `p` untouched)."""
        if self.sessions is not None:
            return self._attach_session(p)
        if self.prefix is None or not p.cached:
            return 0
        n = p.cached // self.config.block_tokens
        rows: list[list] = []
        try:
            for seq in p.group:  # claimed one by one, so a failure releases exactly what was claimed
                rows.append([])
                for h in seq.block_hashes[:n]:
                    rows[-1].append(self.prefix.claim(h))
            p.cache = new_cache(p.group)
            seed_rows(p.cache, self.prefix, rows)
        except BaseException:
            for row in rows:  # nothing holds them: their references go back (the group fails in its prefill)
                for entry in row:
                    self.prefix.release(list(entry))
            p.cache = None
            raise
        return p.cached

    def register_prefix(self, p: Prefill, chunk: int) -> None:
        """Cache the full blocks of `p`'s rows its last `chunk` tokens completed (each row's block of every layer,
        keyed by the hash of its tokens and prefix); a block another row cached first stays this row's own. A
        budgeted row (``kv_reuse: shared_prefix``) caches only its pinned prompt blocks: they are never compressed
        nor written again (`scissorhands.paged.PagedStore.compact`), the rest of its cache depends on the policy."""
        if self.prefix is None or p.cache is None:
            return
        bt = self.config.block_tokens
        first, end = (p.fed - chunk) // bt, p.fed // bt
        if first >= end:
            return
        self.prefix.learn_shapes(p.cache)
        tables = [layer.store.blocks for layer in p.cache.layers]
        for i, seq in enumerate(p.group):
            hashes = self.hashes(seq)
            last = end if seq.budget_tokens is None else min(end, seq.pinned_tokens // bt)
            for j in range(first, last):
                self.prefix.register(hashes[j], tuple(t[i][j] for t in tables))

    # ------------------------------------------------------------------ session state (kv_reuse: session_state)
    def _look_up_session(self, seq: Sequence) -> None:
        """Set ``seq.cached_tokens`` to the tokens its session's kept state has fed when its prompt starts with
        that state's history (none for a recompute after a preemption, or a request that scores its prompt)."""
        seq.from_session = False
        sid = seq.request.session_id
        if sid is None or seq.preempted or seq.request.prompt_logprobs is not None:
            return
        state = self.sessions.states.get(sid)
        if state is not None and state.extended_by(seq.request.prompt_ids):
            seq.cached_tokens, seq.from_session = state.fed_tokens, True

    def _attach_session(self, p: Prefill) -> int:
        """Start `p` (one row) from its session's kept state when `look_up_prefix` found it (`p.cache` is that
        state's cache, out of the pool's hold); else drop the session's stale state (its request moved on) and
        count the previous request's tokens the prompt starts with as recomputed. Returns the tokens taken."""
        for seq in p.group:
            sid = seq.request.session_id
            if sid is None or seq.preempted:
                continue
            if p.cached and seq.from_session:
                state = self.sessions.states.get(sid)
                if state is not None and state.fed_tokens == p.cached and p.rows == 1:
                    p.cache = self.sessions.take(sid).cache
                    seq.result.session_reused_tokens += p.cached
                    continue
                # another request of the session admitted in this step took the state: this one starts from text
                p.cached = p.fed = seq.cached_tokens = 0
                seq.from_session = False
            self.sessions.drop(sid)
            history = self.sessions.histories.get(sid)
            if history is not None:
                prompt = seq.request.prompt_ids
                seq.result.session_recomputed_tokens += min(common_prefix_tokens(prompt, history[:-1]), len(prompt) - 1)
        return p.cached if p.cache is not None else 0

    def keep_session(self, cache, i: int, seq: Sequence) -> None:
        """Keep row `i` of `cache` as `seq`'s session's state when `seq` (a request with a session, completed)
        has just finished there; the caller drops that row next (it holds no block after this)."""
        if self.sessions is None or seq.request.session_id is None or seq.result.error_kind is not None:
            return
        history = seq.request.prompt_ids + seq.result.output_ids
        self.sessions.remember(seq.request.session_id, history)
        row = split_row(cache, i)
        if row.layers[0].tokens_seen != len(history) - 1:  # not the row of these tokens: keep nothing
            release_cache(row)
            return
        self.sessions.keep(seq.request.session_id, history, row)

    def session_stats(self) -> dict:
        """`stats()`'s session state gauges: states kept now, their pool blocks and bookkeeping bytes, and the
        states (and their blocks) reclaimed for other rows since `reset_stats`; None when off."""
        s = self.sessions
        return {
            "session_states": len(s.states) if s is not None else None,
            "session_state_blocks": s.held_blocks if s is not None else None,
            "session_state_bookkeeping_bytes": s.bookkeeping_bytes() if s is not None else None,
            "session_states_reclaimed": s.reclaimed_states if s is not None else None,
            "session_state_reclaimed_blocks": s.reclaimed_blocks if s is not None else None,
        }

    def prefix_stats(self) -> dict:
        if self.sessions is not None:
            return {**super().prefix_stats(), **self.session_stats()}
        if self.prefix is None:
            return super().prefix_stats()
        return {
            "prefix_cache_blocks": self.prefix.cached_blocks,
            "prefix_cache_reclaimed_blocks": self.prefix.reclaimed_blocks,
        }

    # ------------------------------------------------------------------ the running rows
    def growth(self, view: EngineView, steps: int = 1) -> int:
        """Blocks the running rows take, all layers, over their next `steps` decode steps (each row at most until
        its last token; a budgeted row at its budget evicts before it writes, so it never grows past its budget's
        blocks): at 1 step what the next decode step needs; at more, what a prompt fed over that many steps must
        leave free, or it is the first preempted when they grow."""
        if view.cache is None:
            return 0
        rows = paged_rows(view.cache)
        return self.num_layers * sum(
            max(0, self.blocks(self.kept_slots(n + min(steps, steps_left(seq)), seq.kept_tokens)) - held)
            for seq, n, held in zip(view.running, rows.row_slots, rows.row_blocks)
        )

    # Dense bookkeeping (slot times, policy statistics) is padded to a batch's widest row, outside the pool; a
    # block's share of the limit pays only its own slots' bookkeeping, so the padding is charged as blocks.
    def width(self, seq: Sequence, tokens: int) -> int:
        """Slots of a row of `seq` after it has seen `tokens`: what it keeps (its budget at most) rounded up to
        whole blocks. Its blocks pay for that much bookkeeping; the paged layout grows the bookkeeping a block at
        a time to the widest row (`scissorhands.paged.PagedStore.append`)."""
        return self.blocks(self.kept_slots(tokens, seq.kept_tokens)) * self.config.block_tokens

    def padding_blocks(self, view: EngineView, widths: list[int]) -> int:
        """Blocks' worth of the bookkeeping padding of one batch of rows of these widths (slots), padded to the
        widest or to what the running batch's bookkeeping already holds: ``ceil(bookkeeping_slot_bytes *
        sum(padded - w) / block_bytes)``."""
        padded = max([paged_rows(view.cache).bookkeeping_slots, *widths])
        return -(-sum(padded - w for w in widths) * self.bookkeeping_slot_bytes // self.block_bytes)

    def added_padding_blocks(self, view: EngineView, widths: list[int], width: int) -> int:
        """The padding blocks a row of `width` slots adds once merged with rows of `widths`."""
        return self.padding_blocks(view, widths + [width]) - self.padding_blocks(view, widths)

    def running_widths(self, view: EngineView) -> list[int]:
        """Each running row's width after the next decode step (the one it writes, when it decodes again): what
        admission and the decode step's byte check both charge."""
        if view.cache is None:
            return []
        rows = zip(view.running, paged_rows(view.cache).row_slots)
        return [self.width(s, n + (steps_left(s) > 0)) for s, n in rows]

    def over_limit_after_decode(self, view: EngineView) -> bool:
        """Whether the next decode step would take the live caches past the KV memory limit, in the bytes they
        will measure: every block in use and the blocks the step takes, the running batch's bookkeeping at the
        slots it will hold (`PagedStore.append`: grown to whole blocks once its widest row outgrows it), and the
        bookkeeping of the prompts part-way fed."""
        slots = max(paged_rows(view.cache).bookkeeping_slots, *self.running_widths(view))
        dense = len(view.running) * slots * self.bookkeeping_slot_bytes
        dense += sum(c.bookkeeping_bytes() for c in view.other_caches())
        blocks = self.pool.blocks_in_use + self.growth(view, 1)
        return blocks * self.pool.block_nbytes() + dense > self.limit_bytes

    def must_preempt(self, view: EngineView) -> bool:
        """Whether a row must leave before the next decode step: its blocks are not free, or the live caches would
        pass the limit. A lone row is never preempted for bytes: `fits_alone` bounds it (bookkeeping a left row's
        width kept included: that row fit alone too), and its recompute would hold as much."""
        return bool(view.running) and (
            self.growth(view, 1) > self.pool.free_blocks
            or ((len(view.running) > 1 or bool(view.prefilling)) and self.over_limit_after_decode(view))
        )

    def admission(self, view: EngineView) -> "_BlockAdmission":
        return _BlockAdmission(self, view)


class _BlockAdmission:
    """One step's block account (`PagedBudget.admission`): a request is admitted when the blocks its prefill
    takes now are free (next to the blocks the running rows take at their next step), not what it holds at its
    end."""

    def __init__(self, kv: PagedBudget, view: EngineView):
        self.kv, self.view = kv, view
        self.widths = kv.running_widths(view)  # the running batch's bookkeeping, with the rows admitted in this step
        self.free = kv.pool.free_blocks - kv.growth(view, 1) - kv.padding_blocks(view, self.widths) - kv.shared_charge()
        self.committed = 0  # blocks the rows admitted in this step hold after their prefill
        self.before_last = 0  # ... before the last group
        self.last_peak = 0  # blocks the last group's rows hold at their prefill's peak (they peak together)

    def admits(self, seq: Sequence, tokens: int, joinable: bool) -> str | None:
        """``"join"``, ``"new"`` or None (wait for blocks: rows finish or are preempted)."""
        kv = self.kv
        shared = kv.shared_blocks(seq)  # cached blocks rows hold already: counted once, in the pool's blocks in use
        peak = kv.prefill_peak_blocks(tokens, seq.kept_tokens) - shared
        # what it holds once merged, with the block its first decode step may take
        steady = kv.num_layers * kv.blocks(kv.kept_slots(tokens + decodes_after_prefill([seq]), seq.kept_tokens))
        steady -= shared
        width = kv.width(seq, tokens + 1)
        pad = kv.added_padding_blocks(self.view, self.widths, width)
        peak = max(peak, steady + pad)
        steady += pad
        if joinable and self.before_last + self.last_peak + peak <= self.free:
            where = "join"  # prefilled with the last group: its rows peak together
            self.last_peak += peak
        elif self.committed + peak <= self.free:
            where = "new"
            self.before_last, self.last_peak = self.committed, peak
        else:
            return None
        self.committed += steady
        self.widths.append(width)
        return where
