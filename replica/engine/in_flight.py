"""The requests an engine has admitted and not finished (part of the core): the running rows, in the order of the
runner's batch rows, and the prompts part-way fed (oldest first), kept in step with the runner's caches."""

from __future__ import annotations

from replica.engine.requests import EngineView, Prefill, Sequence
from replica.engine.runner import ModelRunner

__all__ = ["InFlight"]


class InFlight:
    """Admitted requests and their rows; every change to the rows goes through the runner (`ModelRunner.keep`,
    `join`, `release_group`), so a request and its row leave together."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.running: list[Sequence] = []
        self.prefilling: list[Prefill] = []
        # this step's groups fed whole (prefill_first), from admission until they join the running batch or leave
        self.feeding: list[Prefill] = []
        # every request taken from the queue and not finished, whichever list holds it now (or none: a fault
        # between two lists), so `clear` answers it; keyed by id() (held here, so no id is reused meanwhile)
        self.held: dict[int, Sequence] = {}

    @property
    def rows(self) -> int:
        """Requests admitted and not finished: decoding, or part-way prefilled."""
        return len(self.running) + sum(p.rows for p in self.prefilling)

    def view(self, queue) -> EngineView:
        return EngineView(self.running, self.runner.cache, self.prefilling, queue)

    def caches(self) -> list:
        return self.runner.caches(self.prefilling + self.feeding)

    def kv_cache_bytes(self) -> int:
        """Bytes of every live cache; with prefix caching, a block rows share counted once (the pool's blocks in
        use) beside each cache's bookkeeping."""
        pool = self.runner.pool
        if getattr(pool, "cached_blocks", None) is None:
            return sum(c.kv_cache_bytes() for c in self.caches())
        return pool.blocks_in_use * pool.block_nbytes() + sum(c.bookkeeping_bytes() for c in self.caches())

    def admit(self, chunks: list[tuple[Prefill, int | None]], started: list[Prefill]) -> None:
        """Hold a plan's groups from the moment they leave the queue: `started` ones stay part-way fed
        (``scheduler: mixed``), the other new ones are fed whole in this step; every request is held until it
        finishes. Finished requests leave `held` here (once a step)."""
        self.prefilling.extend(started)
        self.feeding.extend(p for p, _ in chunks if p not in self.prefilling)
        self.held = {k: s for k, s in self.held.items() if s.result.finish_reason is None}
        self.held.update((id(s), s) for p, _ in chunks for s in p.group)

    def drop(self, p: Prefill) -> None:
        """`p` is no longer being fed (it joined the running batch, or it failed)."""
        for groups in (self.prefilling, self.feeding):
            if p in groups:
                groups.remove(p)

    def join(self, p: Prefill, picked, keep: list[int]) -> None:
        """The rows `keep` of `p` (prefilled; first tokens `picked`) join the running batch; the rest leave. `p`
        is held until its rows are in the batch, so a fault in the merge leaves its requests and cache to `clear`."""
        self.runner.join(p, picked, keep)
        self.running.extend(p.group[i] for i in keep)
        self.drop(p)

    def keep_running(self, keep: list[int]) -> None:
        """Only the running rows `keep` stay (finished ones leave)."""
        if len(keep) < len(self.running):
            self.running = [self.running[i] for i in keep]
            self.runner.keep(keep)

    def remove(self, ids) -> list[Sequence]:
        """Take the requests whose ids are in `ids` out of the prompts part-way fed and the running rows (their
        slots and blocks freed); return them."""
        gone: list[Sequence] = []
        for p in list(self.prefilling):
            rows = [i for i, s in enumerate(p.group) if s.request.request_id not in ids]
            if len(rows) < p.rows:
                gone += [s for s in p.group if s.request.request_id in ids]
                if not rows:
                    self.runner.release_group(p)
                    self.prefilling.remove(p)
                    continue
                self.runner.keep_prefill_rows(p, rows)
        keep = [i for i, s in enumerate(self.running) if s.request.request_id not in ids]
        if len(keep) < len(self.running):
            gone += [s for s in self.running if s.request.request_id in ids]
            self.keep_running(keep)
        return gone

    def preempt(self, victim: Prefill | Sequence) -> list[tuple[Sequence, int]]:
        """Take out `victim`, the newest prompt part-way fed (its blocks back to the pool) or the newest running row
        (it leaves the batch), and mark its requests preempted: they are returned in order, each with the tokens
        its next prefill computes again (a row: its prompt and the outputs fed so far; a prompt: its chunks fed)."""
        if isinstance(victim, Prefill):
            assert victim is self.prefilling[-1], "only the newest prompt part-way fed is preempted"
            p = self.prefilling.pop()
            self.runner.release_group(p)
            # scored already (prompt_logprobs): the next prefill only feeds; its cached tokens were never computed
            taken = [(seq, p.fed - p.cached) for seq in p.group]
        else:
            assert victim is self.running[-1], "only the newest running row is preempted"
            seq = self.running.pop()
            self.runner.keep(list(range(len(self.running))))
            taken = [(seq, len(seq.request.prompt_ids) + len(seq.result.output_ids) - 1)]
        for seq, _ in taken:
            seq.preempted = True
        return taken

    def clear(self) -> list[Sequence]:
        """Every admitted request leaves, every cache freed (a cache a fault broke is dropped all the same);
        returns the requests not finished yet (each once), wherever a fault left them."""
        groups = self.prefilling + self.feeding
        seqs = [*self.held.values(), *(s for p in groups for s in p.group), *self.running]
        try:
            self.runner.release(groups)
        except Exception:  # noqa: BLE001 - a cache broken by a fault must not keep its requests waiting
            pass
        self.running, self.prefilling, self.feeding, self.held = [], [], [], {}
        return list({id(s): s for s in seqs if s.result.finish_reason is None}.values())
