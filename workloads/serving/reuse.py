"""Whether a sessions point's engine reused what its workload says it could, turn by turn (a mismatch fails the point,
as Sparse-vLLM's benchmark does with its chain mode).

Each turn's record carries the workload's `expected_reuse_tokens` (`workloads.load.sessions.SessionSource`: the
prompt tokens it shares with what the point sent before it, token-level) and the engine's `cached_prompt_tokens` (the
prompt tokens its first admission did not prefill; None where the backend does not report it). Two faults:

* **Over-reuse** (any engine that reports): ``cached > min(expected, prompt - 1)``. The engine answered from KV
  computed for tokens this turn does not share with anything sent before it (another session's blocks, a stale
  state), or claimed its whole prompt (at least one token is always computed, for the first token's logits). Our
  engine keeping nothing may report no cached token, and under ``kv_reuse: session_state`` a session's first turn
  none (a state is its own session's; a hit there is another session's blocks). Never
  legitimate: always a fault, unless the engine's caches outlive the point (`caches_outlive_points`: a `target:`
  server, whose cache holds what earlier points sent; then a warning).
* **Under-reuse** (our engine keeping state: `kv_reuse: none` with prefix caching, `kv_reuse: shared_prefix`, or
  `kv_reuse: session_state`):
  a turn k > 0 (its previous turn was answered before it was sent, so what it reuses was computed) served by its
  session's replica (`session_affinity_hit` not False) that took fewer tokens than its way of reuse must:

  - prefix cache (the full cache with prefix caching, under `kv_reuse: none` or `shared_prefix`): the previous turn's
    prompt in whole blocks, ``floor(previous prompt / block) x block`` (the full cache registers every full block of
    a prompt, never of generated tokens), capped at ``cacheable_prefix_tokens(prompt, block)``,
    ``floor((prompt - 1) / block) x block``;
  - shared prefix (a budgeted policy under `kv_reuse: shared_prefix`): its rows register only their pinned blocks,
    ``cacheable_prefix_tokens(previous prompt, block)``, so ``min(cacheable(previous prompt), cacheable(prompt))``;
  - session state: the previous prompt and answer but the answer's last token (never fed), ``expected - 1``.

  A shortfall is legitimate when memory pressure took the state away, or a state was not kept: the replica that
  served the turn (the record's `replica_id` matched to a replica's stats; any replica of the point when the record
  or the stats name none) reported reclaimed prefix-cache blocks or session states, a session state it failed to
  keep (``session_state_keep_failures``), or a preemption (its recompute released blocks). Without any of these the
  cache failed to find what it holds: a fault. Turn 0's shared layers (system prompt, group context) are never
  demanded: whether an earlier session's prefill had finished when it was sent is a matter of timing. Another
  backend is checked for over-reuse only.

`check_reuse` returns the record's `REUSE_KEYS` and the error that fails the point (None when it passes).
"""

from __future__ import annotations

from collections.abc import Iterable

from replica.engine.prefix_cache import cacheable_prefix_tokens
from scissorhands import POLICIES
from workloads.load.metrics import RequestRecord

__all__ = ["REUSE_KEYS", "check_reuse", "demanded_reuse_tokens", "reuse_bound_tokens"]

#: The record keys of `check_reuse`: ``reuse_check`` (``passed``, ``failed``, ``not_checked``: no turn's backend
#: reports cached tokens, or the engine's caches outlive the point), the turns over the bound, the turns short of
#: what their way of reuse must take, and whether the shortfalls are explained by reclaims or preemptions.
REUSE_KEYS = ("reuse_check", "reuse_over_turns", "reuse_short_turns", "reuse_short_explained")


def reuse_bound_tokens(rec: RequestRecord, way: str | None = None) -> int:
    """The most prompt tokens turn `rec` may take from earlier KV: its expected reuse, at most its prompt - 1; 0 for
    our engine keeping nothing (`way` ``none``) and for a session state's first turn (a state is its session's own)."""
    if way == "none" or (way == "session_state" and not rec.turn):
        return 0
    return min(rec.expected_reuse_tokens or 0, max(0, rec.prompt_tokens - 1))


def demanded_reuse_tokens(
    rec: RequestRecord, previous: RequestRecord | None, way: str | None, block_tokens: int | None
) -> int:
    """The prompt tokens turn `rec` must take from earlier KV when nothing was reclaimed (the module docstring):
    0 for turn 0, a turn with no previous record, or a `way` other than ``prefix_cache`` / ``shared_prefix`` /
    ``session_state``."""
    if not rec.turn or previous is None or way is None:
        return 0
    if way == "session_state":
        return max(0, min((rec.expected_reuse_tokens or 0) - 1, rec.prompt_tokens - 1))
    if way == "prefix_cache" and block_tokens:  # the full cache registers every full block of the previous prompt
        whole = previous.prompt_tokens // block_tokens * block_tokens
        return min(whole, cacheable_prefix_tokens(rec.prompt_tokens, block_tokens))
    if way == "shared_prefix" and block_tokens:  # a budgeted row registers only its pinned blocks
        pinned = cacheable_prefix_tokens(previous.prompt_tokens, block_tokens)
        return min(pinned, cacheable_prefix_tokens(rec.prompt_tokens, block_tokens))
    return 0


def reuse_way(engine_config) -> str | None:
    """How the point's engine (ours) keeps KV for later turns: ``prefix_cache`` (the full cache with prefix caching,
    `kv_reuse` none or shared_prefix), ``shared_prefix`` (a budgeted policy sharing its pinned prompt blocks),
    ``session_state``, ``none`` (it keeps nothing: no turn may report a cached token), or None (another backend, or
    an unknown `kv_reuse`: the workload's bound only)."""
    if engine_config is None or getattr(engine_config, "engine", "ours") != "ours":
        return None
    reuse = getattr(engine_config, "kv_reuse", "none")
    if reuse == "session_state":
        return "session_state"
    if reuse == "shared_prefix":  # a full cache's rows are not pinned: it is the prefix-cached full cache
        policy = POLICIES.get(getattr(engine_config, "policy", "full"))
        return "shared_prefix" if policy is not None and policy.evicts else "prefix_cache"
    if reuse == "none":
        return "prefix_cache" if getattr(engine_config, "enable_prefix_caching", False) else "none"
    return None


#: The stats keys of a replica whose count > 0 explains a shortfall: reclaimed blocks or states, a session state not
#: kept, a preemption.
EXPLAINING_KEYS = (
    "prefix_cache_reclaimed_blocks",
    "session_states_reclaimed",
    "session_state_reclaimed_blocks",
    "session_state_keep_failures",
    "preemptions",
)


def _explained(stats: Iterable[dict]) -> bool:
    """Whether a replica of `stats` reported what makes a shortfall legitimate (`EXPLAINING_KEYS`)."""
    return any((s.get(k) or 0) > 0 for s in stats for k in EXPLAINING_KEYS)


def _explained_turns(short: list[RequestRecord], stats: list[dict]) -> bool:
    """Whether every short turn is explained by the replica that served it (its record's `replica_id` among the
    stats'), or by any replica of the point when the record or the stats do not say which."""
    by_replica = {s["replica_id"]: s for s in stats if s.get("replica_id") is not None}
    return all(
        _explained([by_replica[r.replica_id]]) if r.replica_id in by_replica else _explained(stats) for r in short
    )


def _where(series: str, rec: RequestRecord) -> str:
    return f"series {series}, session {rec.session_id} turn {rec.turn} (request {rec.request_id})"


def check_reuse(
    records: list[RequestRecord],
    stats: list[dict],
    engine_config,
    series: str,
    *,
    caches_outlive_points: bool = False,
) -> tuple[dict, str | None, list[str]]:
    """Check every completed session turn of a point (warm-up turns included: the engine answered them too).

    Args:
        records: the point's request records (turns carry `session_id`, `turn`, `expected_reuse_tokens`).
        stats: the replicas' `stats()` of the point (reclaims and preemptions explain a shortfall).
        engine_config: the point's `replica.common.types.EngineConfig` (its way of reuse; None: over-reuse only).
        series: the point's series, named in the error.
        caches_outlive_points: the engine's caches hold what earlier points sent (a `target:` server): over-reuse is
            a warning, not a fault, and no shortfall is demanded.

    Returns ``(fields, error, warnings)``: `REUSE_KEYS`, the message that fails the point (None: it passes; it names
    the series, the session and the turn of the first fault, and how many turns were at fault), and warnings.
    """
    turns = [r for r in records if r.session_id is not None and r.ok and r.cached_prompt_tokens is not None]
    if not turns:
        return {"reuse_check": "not_checked", **dict.fromkeys(REUSE_KEYS[1:])}, None, []
    way = None if caches_outlive_points else reuse_way(engine_config)
    over = [r for r in turns if r.cached_prompt_tokens > reuse_bound_tokens(r, way)]
    demands = way in ("prefix_cache", "shared_prefix", "session_state")
    block = next((s.get("block_tokens") for s in stats if s.get("block_tokens")), None)
    previous = {(r.session_id, r.turn): r for r in turns}
    short = [
        r
        for r in turns
        if r.session_affinity_hit is not False
        and r.cached_prompt_tokens < demanded_reuse_tokens(r, previous.get((r.session_id, r.turn - 1)), way, block)
    ]
    explained = _explained_turns(short, stats) if short else None
    fields = {
        "reuse_check": "passed",
        "reuse_over_turns": len(over),
        "reuse_short_turns": len(short) if demands else None,
        "reuse_short_explained": explained,
    }
    warnings: list[str] = []
    if caches_outlive_points:
        fields["reuse_check"] = "not_checked"
        if over:
            warnings.append(
                f"{len(over)} turn(s) reported more cached prompt tokens than they share with earlier requests of the "
                f"point (first: {_where(series, over[0])}, {over[0].cached_prompt_tokens} > "
                f"{reuse_bound_tokens(over[0], way)}); the server's cache holds what earlier points sent, so not a fault"
            )
        return fields, None, warnings
    if over:
        r = over[0]
        fields["reuse_check"] = "failed"
        return (
            fields,
            f"reuse mismatch: {_where(series, r)}: the engine reported {r.cached_prompt_tokens} cached prompt tokens, "
            f"more than the {reuse_bound_tokens(r, way)} it may reuse (expected reuse {r.expected_reuse_tokens} of a "
            f"{r.prompt_tokens}-token prompt; its engine's way of reuse: {way or 'unknown'}): it answered from KV it "
            f"should not have ({len(over)} turn(s) over)",
            warnings,
        )
    if short and not explained:
        r = short[0]
        need = demanded_reuse_tokens(r, previous.get((r.session_id, r.turn - 1)), way, block)
        fields["reuse_check"] = "failed"
        return (
            fields,
            f"reuse mismatch: {_where(series, r)}: the engine reported {r.cached_prompt_tokens} cached prompt tokens, "
            f"fewer than the {need} its {way.replace('_', ' ')} must reuse (expected reuse "
            f"{r.expected_reuse_tokens}), and the replica that served it reported no reclaimed block or state, no "
            f"state it failed to keep and no preemption "
            f"({len(short)} turn(s) short)",
            warnings,
        )
    if short:
        warnings.append(
            f"{len(short)} turn(s) reused less than their {way.replace('_', ' ')} holds when nothing is reclaimed "
            f"(first: {_where(series, short[0])}); the replicas reclaimed kept KV or preempted, which explains it"
        )
    return fields, None, warnings
