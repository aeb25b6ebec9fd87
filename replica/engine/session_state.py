"""A session's KV cache carried to its next request (`EngineConfig.kv_reuse: session_state`), after Sparse-vLLM's
"chain" mode: a request of a conversation resends the whole conversation so far, so the cache its previous request
left (compressed, for a budgeted policy) is the state the next one starts from.

* When a request with a `GenerationRequest.session_id` completes, its row leaves its batch as a cache of its own
  (`split_row`): its blocks stay in the pool, its bookkeeping (slot times, policy statistics, counters) is copied;
  a fault part-way keeps nothing and returns the row's blocks (`SessionStatePool.keep_row`).
  The cache has fed the request's prompt and every generated token but the last (the last was picked, never fed).
* `SessionStatePool` is the engine's `BlockPool` holding those caches, one per session (a later request of the
  session replaces it), least recently kept first. A held state's blocks are in the pool, which is sized to the KV
  memory limit; they count as free (`free_blocks`) the way vLLM counts idle cached blocks: `allocate` reclaims
  whole states, oldest first, when the free stack runs short, so a held session never blocks a running request.
  A step's plan counts them as in use instead (`plan_free_blocks`), and a session's state for one request of the
  step at most (`promise`: only one row can take it; another request of the session is prefilled from text).
* The session's next request whose prompt starts with the previous request's prompt + generated tokens starts
  from the state: its prefill feeds only the tokens past what the state has seen (the last generated token and the
  new ones, at least one). Its row is alone in its prefill group (`replica.engine.requests.same_group`), so the
  cache keeps one clock (``tokens_seen``: the positions continue from the state's).
* Only a request's own session's state is ever used (states are keyed by the session id and its tokens checked);
  when the state was reclaimed, or the prompt does not extend it, the prompt is prefilled from text and the
  previous request's tokens it starts with are counted as recomputed (`GenerationResult.session_recomputed_tokens`).

For the full cache the state is exactly the row's cache, so the tokens are those of a fresh prefill (greedy, up to
the order of floating-point sums); for a budgeted policy the next request attends to what the previous one kept.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass

import torch

from scissorhands.batching import select_rows
from scissorhands.paged import BlockPool, PoolExhausted, cache_blocks, release_cache

__all__ = ["SessionState", "SessionStatePool", "common_prefix_tokens", "split_row"]

#: Sessions whose last tokens are remembered after their state is gone (to count a recompute), least recent dropped.
MAX_REMEMBERED_SESSIONS = 65536


@dataclass
class SessionState:
    """One session's kept cache: ``history`` the previous request's prompt + generated tokens, of which the cache
    has fed all but the last (``fed_tokens``); ``blocks`` the pool blocks it holds, all layers."""

    session_id: str
    history: list[int]
    cache: object
    blocks: int

    @property
    def fed_tokens(self) -> int:
        return len(self.history) - 1

    def extended_by(self, prompt: list[int]) -> bool:
        """Whether `prompt` starts with this state's whole history (the previous prompt + generated tokens)."""
        return len(prompt) >= len(self.history) and prompt[: len(self.history)] == self.history


def common_prefix_tokens(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.inference_mode()  # the cache's tensors are inference tensors
def split_row(cache, i: int):
    """Take row `i` of `cache` (a paged cache of one or more rows) out as a cache of its own, one clock: its blocks
    move to the new cache (row `i` of `cache` holds none after, so dropping it frees nothing), its bookkeeping is
    copied. `cache` must drop row `i` next (its count still says it holds slots)."""
    layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]
    pool = layers[0].store.pool
    row = copy.deepcopy(cache, {id(pool): pool})  # the pool is shared, never copied
    for mine, theirs in zip((x for x in row.layers if x.is_initialized), layers):
        mine.store.blocks = [b if j == i else [] for j, b in enumerate(theirs.store.blocks)]
        theirs.store.blocks[i] = []
        theirs.store._changed()
    select_rows(row, [i])  # the other rows hold no block here: nothing goes back to the pool
    for layer in row.layers:
        if layer.is_initialized and layer.row_time is not None:  # one row: its clock is the cache's
            layer.tokens_seen = int(layer.row_time[0])
            layer.row_time = None
    row._peak_bytes = row.kv_cache_bytes()
    return row


def _row_blocks(cache, i: int) -> list[int]:
    """The pool blocks row `i` of `cache` holds, all layers."""
    return [b for layer in cache.layers if getattr(layer, "is_initialized", False) for b in layer.store.blocks[i]]


class SessionStatePool(BlockPool):
    """A `BlockPool` that holds sessions' kept caches (module docstring), reclaimed least recently kept first.

    Args: as `BlockPool`.
    """

    def __init__(self, num_blocks: int, block_tokens: int = 16):
        super().__init__(num_blocks, block_tokens)
        self.states: collections.OrderedDict[str, SessionState] = collections.OrderedDict()  # oldest first
        # each session's last history, kept after its state is gone, so a recompute is counted
        self.histories: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self.reclaimed_states = self.reclaimed_blocks = 0  # since `reset_counts`
        # the step being planned (`begin_plan`; the engine's thread only, so `free_blocks` never depends on it)
        self.promised: set[str] = set()
        self.states_free_in_plan = False

    @property
    def held_blocks(self) -> int:
        """Pool blocks the kept states hold, all layers."""
        return sum(s.blocks for s in list(self.states.values()))  # a copy: `stats()` reads from any thread

    @property
    def free_blocks(self) -> int:
        """Blocks a row can take now: the free stack and every kept state's (reclaimed on demand). The same figure
        from any thread at any time (`stats()`, `reset_stats()`): a step's plan counts with `plan_free_blocks`."""
        return len(self._free) + self.held_blocks

    def begin_plan(self, states_free: bool = False) -> None:
        """Start planning a step (the engine's thread, under its queue lock): no session's state promised to a
        request yet (`promise`); `states_free`: the plan counts the kept states' blocks as free (only to ask
        whether reclaiming states would admit a request)."""
        self.promised = set()
        self.states_free_in_plan = states_free

    def plan_free_blocks(self) -> int:
        """Blocks the step being planned may promise: the free stack only, unless `begin_plan` said the states are
        free. A request admitted in the step may take a kept state (its blocks held from the plan on, beside every
        other group's prefill), so admission must not promise them too; `reclaim_oldest` frees a state's blocks
        when nothing else fits."""
        return len(self._free) + (self.held_blocks if self.states_free_in_plan else 0)

    def promise(self, session_id: str) -> bool:
        """Whether a request of the step being planned may start from `session_id`'s state: True for the first
        that asks (its blocks are then counted as that request's), False for every later one of the step (only one
        row can take a state, so a second request of the session is planned as a prefill from text)."""
        if session_id in self.promised:
            return False
        self.promised.add(session_id)
        return True

    @property
    def blocks_in_use(self) -> int:
        """Blocks running or part-way fed rows hold (kept states are free: reclaimed on demand)."""
        return self.usable_blocks - self.free_blocks

    def reset_counts(self) -> None:
        self.reclaimed_states = self.reclaimed_blocks = 0

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, reclaiming kept states (least recently kept first) when the free stack is short.
        Raises ``PoolExhausted`` (nothing taken) when fewer are free, kept states included."""
        if n > self.free_blocks:
            raise PoolExhausted(f"{n} KV blocks needed, {self.free_blocks} free of {self.usable_blocks}")
        while len(self._free) < n:
            self.reclaim_oldest()
        taken = [self._free.pop() for _ in range(n)]
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use)
        return taken

    def reclaim_oldest(self) -> None:
        """Free the least recently kept state's blocks (its session's next request recomputes from text)."""
        _, state = self.states.popitem(last=False)
        self.reclaimed_states += 1
        self.reclaimed_blocks += state.blocks
        release_cache(state.cache)

    def keep(self, session_id: str, history: list[int], cache) -> None:
        """Hold `cache` (one row, fed ``history[:-1]``) as `session_id`'s state, replacing any it held."""
        self.drop(session_id)
        self.states[session_id] = SessionState(session_id, list(history), cache, cache_blocks(cache))
        self.remember(session_id, history)

    def keep_row(self, session_id: str, history: list[int], cache, i: int) -> bool:
        """Take row `i` of `cache` out (`split_row`) and keep it as `session_id`'s state when it has fed
        ``history[:-1]`` (else free it); True when kept. The caller drops row `i` of `cache` next.

        Raises: whatever failed part-way (in `split_row` or `keep`), after keeping nothing and returning to the pool
        every block row `i` held that neither the pool's free stack nor row `i` of `cache` holds now (the caller's
        drop frees those), so no block is lost. The session's earlier state may be gone (this request replaces it)."""
        before = _row_blocks(cache, i)
        row = None
        try:
            row = split_row(cache, i)
            if row.layers[0].tokens_seen != len(history) - 1:  # not the row of these tokens: keep nothing
                release_cache(row)
                return False
            self.keep(session_id, history, row)
            return True
        except BaseException:
            kept = self.states.get(session_id)
            if kept is not None and row is not None and kept.cache is row:
                del self.states[session_id]  # its blocks are freed below: no state may name them
            free = set(self._free)
            still = set(_row_blocks(cache, i))
            self.release([b for b in before if b not in free and b not in still])
            raise

    def remember(self, session_id: str, history: list[int]) -> None:
        self.histories[session_id] = list(history)
        self.histories.move_to_end(session_id)
        while len(self.histories) > MAX_REMEMBERED_SESSIONS:
            self.histories.popitem(last=False)

    def drop(self, session_id: str) -> None:
        """Free `session_id`'s kept state, if any (the session moved on)."""
        state = self.states.pop(session_id, None)
        if state is not None:
            release_cache(state.cache)

    def take(self, session_id: str) -> SessionState:
        """`session_id`'s kept state, out of the pool's hold: its blocks are a row's from now on."""
        return self.states.pop(session_id)

    def bookkeeping_bytes(self) -> int:
        """Bytes of the kept states' bookkeeping (slot times, policy statistics), which lies outside the pool."""
        return sum(
            getattr(x, "bookkeeping_nbytes", lambda: 0)() for s in list(self.states.values()) for x in s.cache.layers
        )
