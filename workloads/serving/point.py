"""One serving point: configure the replicas, drive them with the point's load pattern, summarize.

`run_point(pool, suite, point)` returns the point's metrics, with its ``status`` (``ok``, ``oom`` or ``error``),
``stop_reason`` and ``error``; a load error never raises. Requests that timed out or were refused for load
(`workloads.load.slo.SLO_MISS_ERROR_KINDS`) are measurements that miss the SLO: a point where every request ended so
is ``ok`` with attainment 0 (a capacity probe then fails and the search moves down); ``error`` is kept for a replica
that died, a configuration that failed, and a point whose requests all failed otherwise. The suite's `slo` judges every request of the point
(`slo_attainment`, `goodput_req_per_s`, `goodput_tok_per_s`, with the limits as `slo_ttft_s`, ...).
"""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.connect import error_message
from replica import cpu_share
from replica.engine.scheduler import SCHEDULE_KEYS
from replica.openvino_settings import eviction_reach
from workloads.load.driver import run_load
from workloads.load.metrics import summarize
from workloads.load.sessions import SessionSource, session_metrics
from workloads.load.slo import SLO_MISS_ERROR_KINDS
from workloads.serving.pools import ReplicaPool
from workloads.serving.reuse import check_reuse
from workloads.serving.suite import ServingPoint, ServingSuite


def _requests_for(suite: ServingSuite, point: ServingPoint, cfg, tokenizer, vocab_size: int | None):
    """The point's requests, drawn on demand as its load pattern builds them (drawn lengths, or a trace's
    rows), from the seed of its load: every series at one load gets the same requests in the same order."""
    return cfg.pattern.request_source(
        suite.prompt_tokens,
        suite.new_tokens,
        seed=suite.workload_seed(point),
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        prefix=point.point_id,
    )


def cpu_fields(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """The point's `replica.cpu_share` fields from each replica's samples before and after its load (replicas in
    both: one Serve replaced during the point is left out); every value None when no replica was sampled."""
    both = sorted(set(before) & set(after))
    strip = lambda s: {k: v for k, v in s.items() if k != "replica_id"}  # noqa: E731
    return cpu_share.combine(cpu_share.measure(strip(before[k]), strip(after[k])) for k in both)


def _cpu_samples(pool: ReplicaPool) -> tuple[dict | None, str | None]:
    """Each replica's CPU sample, best effort: (samples, None), or (None, the error) when sampling failed (a
    replica replaced mid-point makes the pool's broadcast wait and raise; the point's load numbers still hold)."""
    try:
        return pool.cpu_samples(), None
    except Exception as e:  # noqa: BLE001 - a measurement aid never fails the point
        return None, error_message(e)


def run_point(
    pool: ReplicaPool,
    suite: ServingSuite,
    point: ServingPoint,
    *,
    tokenizer=None,
    vocab_size: int | None = None,
    run_id: str | None = None,
) -> dict:
    """Run one point on `pool`; return the metrics part of its record (never raises for load errors)."""
    out: dict[str, Any] = {}
    try:
        pool.configure(suite.engine_config(point), run_id)
    except Exception as e:  # noqa: BLE001 - an invalid config / model error ends this point only
        return {"status": "error", "stop_reason": "configure failed", "error": error_message(e)}
    max_batch = None
    if suite.sized_by_memory:
        max_batch = pool.max_batch_for(suite.prompt_tokens.upper, suite.new_tokens.upper)
        out["max_batch_size"] = max_batch
        if max_batch < 1:
            return {
                **out,
                "status": "error",
                "stop_reason": "does not fit",
                "error": "not even one sequence fits the KV memory limit",
            }
    cfg = suite.load_config(point, max_batch=max_batch)
    reuse_error = None
    reqs = _requests_for(suite, point, cfg, tokenizer, vocab_size)
    if hasattr(reqs, "prepare"):  # drawn before the clock starts: a count-bound point's all, else the first 256
        reqs.prepare((cfg.num_requests or 256) + cfg.warmup_requests)
    pool.stats(reset=True)
    before, cpu_error = _cpu_samples(pool)
    result = asyncio.run(run_load(pool.client(), reqs, cfg, slo=suite.slo))
    stats = pool.stats(reset=True)
    after, after_error = _cpu_samples(pool) if cpu_error is None else (None, None)
    cpu_error = cpu_error or after_error
    out.update(cpu_share.empty() if cpu_error else cpu_fields(before, after))
    m = result.metrics
    peak_running = [s.get("peak_running_sequences") for s in stats]
    peak_kv = [s.get("peak_kv_cache_bytes") for s in stats]
    live = [x for x in peak_running if x is not None]
    if live and cfg.target_concurrency is not None:
        m = summarize(
            result.records,
            mode=cfg.mode,
            window_start_s=m.window_start_s,
            window_end_s=m.window_end_s,
            stop_reason=m.stop_reason,
            target_rate_req_per_s=m.target_rate_req_per_s,
            target_concurrency=m.target_concurrency,
            replica_peak_running_sequences=sum(live),
            slo=suite.slo,
        )
    flat = m.flat()
    flat["load_mode"] = flat.pop("mode")  # the record's `mode` is the suite's
    out.update(flat)
    if isinstance(reqs, SessionSource):  # per turn and per session (workloads.load.sessions.session_metrics)
        out.update(session_metrics(result.records, suite.slo, m.window_s))
        fields, reuse_error, notes = check_reuse(
            result.records,
            stats,
            suite.engine_config(point),
            point.series,
            caches_outlive_points=getattr(pool, "caches_outlive_points", False),
        )
        out.update(fields)
        if notes:
            out["warnings"] = list(out.get("warnings") or []) + notes
    if cpu_error:
        out["warnings"] = list(out.get("warnings") or []) + [
            f"CPU share not measured: sampling the replicas' CPU time failed ({cpu_error}); cpu_share fields are None"
        ]
    out.update(
        {
            "load": point.load,
            "load_config": cfg.model_dump(),
            "replica_stats": stats,
            "replica_ids": [s.get("replica_id") for s in stats],
            "peak_running_sequences_per_replica": peak_running,
            "peak_kv_cache_bytes_per_replica": peak_kv,
            "kv_cache_bytes": max([x for x in peak_kv if x is not None], default=None),
            "budget_tokens": next((s.get("budget_tokens") for s in stats if "budget_tokens" in s), None),
            "kv_memory_limit_bytes": next((s.get("kv_memory_limit_bytes") for s in stats if "slot_bytes" in s), None),
            "slot_bytes": next((s.get("slot_bytes") for s in stats if "slot_bytes" in s), None),
            "replicas": getattr(pool, "n", len(stats)),
            # paged KV layout: sequences preempted when the block pool ran out, and the tokens prefilled again
            "kv_layout": next((s.get("kv_layout") for s in stats if "kv_layout" in s), None),
            # a step's work: whole prompts then a decode, or one token budget (mixed: decodes first, prompt chunks)
            **{k: next((s.get(k) for s in stats if "scheduler" in s), None) for k in SCHEDULE_KEYS},
            # the backend that served the point (replica.backends: ours or openvino)
            "engine": next((s.get("engine") for s in stats if "engine" in s), None),
            # None when no replica's backend counts them (OpenVINO's pipeline does not: its `not_reported`)
            "preemptions": _sum_reported(stats, "preemptions"),
            "recomputed_tokens": _sum_reported(stats, "recomputed_tokens"),
            # our budgeted engine: tokens its policy evicted (None: a policy keeping every token, or another backend)
            **eviction_count_fields(stats),
            **prefix_cache_fields(stats, result.records),
            **session_state_fields(stats, result.records),
            **held_kv_fields(stats),
            "peak_kv_blocks_in_use_per_replica": [s.get("peak_kv_blocks_in_use") for s in stats],
            # OpenVINO's eviction whose max_cache_size holds the longest sequence runs the full cache: said here
            **eviction_reach(
                next((s["openvino_eviction"] for s in stats if s.get("openvino_eviction")), None),
                suite.longest_sequence_tokens,
            ),
            # requests whose prompt an earlier one of the point already had (0 unless the prompt space is tiny)
            "repeated_prompts": getattr(reqs, "repeats_sent", 0),
        }
    )
    over = held_bookkeeping_over_limit(stats)
    if over:
        out["warnings"] = list(out.get("warnings") or []) + [over]
    if out["repeated_prompts"]:
        out["warnings"] = list(out.get("warnings") or []) + [
            f"{out['repeated_prompts']} request(s) repeated an earlier prompt of the point (warm-up included): "
            "too few distinct prompts of these lengths; a server with a prefix cache answers them faster"
        ]
    if max_batch is not None:
        out["max_batch_verified"] = (
            bool(live)
            and max(live) >= max_batch
            and all(x is None or x <= (out["kv_memory_limit_bytes"] or x) for x in peak_kv)
        )
    outcome, warning = point_outcome(m.sent_requests, m.completed_requests, m.errors_by_kind, pool.restart_dead())
    if warning:
        out["warnings"] = list(out.get("warnings") or []) + [warning]
    out.update({"stop_reason": m.stop_reason, **outcome})  # ok: `count` or `duration` (the load generator's)
    if reuse_error is not None and out["status"] == "ok":  # a correctness fault: the point's numbers do not stand
        out.update(status="error", stop_reason="reuse mismatch", error=reuse_error)
    return out


def prefix_cache_fields(stats: list[dict], records) -> dict:
    """The point's prefix cache figures (all None when no replica's engine has the prefix cache on:
    `EngineConfig.enable_prefix_caching`, reported by ``prefix_caching`` in its stats; OpenVINO's reports none):

    * ``prefix_cache_hit_tokens``, ``prefix_cache_miss_tokens``: the replicas' counts over the point's measured
      requests, at admission (a preempted request's recompute counts again), and ``prefix_cache_hit_rate`` =
      hit / (hit + miss), in 0..1 (None when nothing was admitted);
    * ``cached_prompt_tokens_sum``: the tokens each completed measured request's prefills took from the cache
      (`GenerationResult.cached_prompt_tokens`, summed), and ``cached_prompt_share``: that sum over those
      requests' prompt tokens (it can pass 1 only when a preempted request's recompute hits again)."""
    keys = ("prefix_cache_hit_tokens", "prefix_cache_miss_tokens", "prefix_cache_hit_rate")
    out = dict.fromkeys(keys + ("cached_prompt_tokens_sum", "cached_prompt_share"))
    on = [s for s in stats if s.get("prefix_caching")]
    if not on:
        return out
    hit = sum(s.get("prefix_cache_hit_tokens") or 0 for s in on)
    miss = sum(s.get("prefix_cache_miss_tokens") or 0 for s in on)
    out.update(prefix_cache_hit_tokens=hit, prefix_cache_miss_tokens=miss)
    out["prefix_cache_hit_rate"] = hit / (hit + miss) if hit + miss else None
    done = [r for r in records if r.ok and not r.warmup and r.cached_prompt_tokens is not None]
    prompt = sum(r.prompt_tokens for r in done)
    out["cached_prompt_tokens_sum"] = sum(r.cached_prompt_tokens for r in done)
    out["cached_prompt_share"] = out["cached_prompt_tokens_sum"] / prompt if prompt else None
    return out


#: The engine's counts under ``kv_reuse: session_state`` (`replica.engine.core`'s stats; absent otherwise).
SESSION_STATE_KEYS = (
    "session_reused_tokens",
    "session_recomputed_tokens",
    "session_state_hits",
    "session_state_misses",
)


def session_state_fields(stats: list[dict], records) -> dict:
    """The point's session reuse figures (all None when no replica keeps session state, `EngineConfig.kv_reuse`):
    `SESSION_STATE_KEYS` summed over the replicas (their measured requests), ``session_reused_tokens_sum`` (each
    completed measured request's own `GenerationResult.session_reused_tokens`, summed; None when no record has it,
    as over HTTP), and ``session_affinity_hits`` / ``session_affinity_turns``: the turns served by their session's
    replica, of those whose record says (several replicas keeping state; None when none says)."""
    out = dict.fromkeys(SESSION_STATE_KEYS + ("session_reused_tokens_sum",))
    on = [s for s in stats if "session_state_hits" in s]
    if on:
        out.update({k: sum(s.get(k) or 0 for s in on) for k in SESSION_STATE_KEYS})
        done = [r for r in records if r.ok and not r.warmup and r.session_reused_tokens is not None]
        out["session_reused_tokens_sum"] = sum(r.session_reused_tokens for r in done) if done else None
    said = [r for r in records if not r.warmup and r.session_affinity_hit is not None]
    out["session_affinity_turns"] = len(said) if said else None
    out["session_affinity_hits"] = sum(r.session_affinity_hit for r in said) if said else None
    return out


def held_kv_fields(stats: list[dict]) -> dict:
    """The KV kept for later requests, beside the live caches' peaks (bytes; None when no replica's engine keeps any:
    no prefix cache, no `kv_reuse: session_state`; `replica.engine.kv_base.KVBudget.held_stats`):

    * ``peak_held_kv_bytes``: the most pool bytes kept session states or idle prefix-cache entries held on a
      replica (its peak since the point started; the max over replicas, as ``kv_cache_bytes``), and
      ``peak_held_kv_bytes_per_replica``. Inside the KV memory limit (the pool is the limit; reclaimed on demand).
    * ``peak_held_bookkeeping_bytes``: the most bytes the kept session states' bookkeeping (slot times, policy
      statistics) held on a replica: outside the pool and not charged against the limit, so reported here."""
    per = [s.get("peak_held_kv_bytes") for s in stats]
    book = [s["peak_held_bookkeeping_bytes"] for s in stats if s.get("peak_held_bookkeeping_bytes") is not None]
    return {
        "peak_held_kv_bytes": max([x for x in per if x is not None], default=None),
        "peak_held_kv_bytes_per_replica": per,
        "peak_held_bookkeeping_bytes": max(book, default=None),
    }


def held_bookkeeping_over_limit(stats: list[dict]) -> str | None:
    """A warning when a replica's peak live KV bytes plus its kept states' peak bookkeeping (not charged against the
    limit) pass its KV memory limit (an upper bound: the two peaks may fall at different times); else None."""
    for s in stats:
        book, peak, limit = (
            s.get("peak_held_bookkeeping_bytes"),
            s.get("peak_kv_cache_bytes"),
            s.get("kv_memory_limit_bytes"),
        )
        if book and peak is not None and limit is not None and peak + book > limit:
            return (
                f"replica {s.get('replica_id')}: its peak KV bytes ({peak}) plus the kept session states' peak "
                f"bookkeeping ({book}, outside the pool and not charged against the limit) pass its KV memory limit "
                f"({limit}) by up to {peak + book - limit} bytes"
            )
    return None


def eviction_count_fields(stats: list[dict]) -> dict:
    """A point record's ``evicted_tokens`` (summed over the replicas that count them: our engine with a policy that
    evicts; None when none does) and, when that is 0, ``evicts: false`` with its reason, the flag the
    tables already read for an eviction row that ran the full cache (`replica.openvino_settings.evicts_nothing`):
    a budget (raised to the policy's floor, ``min_budget_tokens``) that held every token says so. {} when no
    replica counts evictions (the OpenVINO backend: `eviction_reach` says it)."""
    counts = [s["evicted_tokens"] for s in stats if s.get("evicted_tokens") is not None]
    if not counts:
        return {}
    out = {"evicted_tokens": sum(counts)}
    if out["evicted_tokens"] == 0:
        out["evicts"] = False
        out["evicts_reason"] = "evicts nothing: its budget held every token of this point (0 tokens evicted)"
    return out


def _sum_reported(stats: list[dict], key: str) -> int | None:
    """`key` summed over the replicas (0 for one without it), or None when every replica's backend says it does not
    count it (``not_reported``: OpenVINO's pipeline keeps no preemption count)."""
    if stats and all(key in (s.get("not_reported") or ()) for s in stats):
        return None
    return sum(s.get(key) or 0 for s in stats)


def point_outcome(
    sent_requests: int, completed_requests: int, errors_by_kind: dict[str, int], replaced: list[str]
) -> tuple[dict, str | None]:
    """A point's ``status``, ``stop_reason`` and ``error`` from its request counts, its errors by kind and the
    replicas restarted after it, with a warning (or None) for the record. A point whose sent requests all ended
    in `SLO_MISS_ERROR_KINDS` (timeouts, refusals for load) is ``ok`` with attainment 0; one where none completed
    and no error kind was counted at all is ``error``: there is nothing to call a miss of the SLO."""
    errors = errors_by_kind
    if replaced or errors.get("replica_died"):
        return {
            "status": "error",
            "stop_reason": "replica died",
            "error": f"replica(s) died during the point and were restarted: {', '.join(replaced) or '?'}",
        }, None
    if errors.get("oom"):
        return {
            "status": "oom",
            "stop_reason": "out of memory",
            "error": f"{errors['oom']} request(s) ran out of memory",
        }, None
    listed = ", ".join(f"{k}: {v}" for k, v in sorted(errors.items()))
    if sent_requests and not completed_requests:
        if not errors:
            return {
                "status": "error",
                "stop_reason": "every request failed",
                "error": f"{sent_requests} request(s) sent, none completed and no error recorded",
            }, None
        if not set(errors) <= set(SLO_MISS_ERROR_KINDS):
            return {"status": "error", "stop_reason": "every request failed", "error": listed}, None
        return {"status": "ok", "error": None}, (
            f"every request missed the SLO by timing out or being refused for load ({listed}): "
            "a result of attainment 0, not an error"
        )
    return {"status": "ok", "error": None}, None
