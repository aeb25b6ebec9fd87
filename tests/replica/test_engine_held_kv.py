"""The KV an engine keeps for later requests (`KVBudget.held_stats`): kept session states' pool blocks and bookkeeping
(`kv_reuse: session_state`) and idle prefix-cache entries' blocks (`enable_prefix_caching`), now and at their peak
since `reset_stats`, in bytes; none for an engine that keeps nothing."""

from __future__ import annotations

from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine

PAGED = dict(kv_layout="paged", block_tokens=4, kv_memory_limit_bytes=10**7)
KEYS = ("held_kv_bytes", "peak_held_kv_bytes", "held_bookkeeping_bytes", "peak_held_bookkeeping_bytes")


def _run(engine, requests: list[GenerationRequest]) -> None:
    done = []
    for r in requests:
        engine.submit(r, done.append)
    engine.run_until_idle()
    assert all(x.error is None for x in done)


def test_kept_session_states_report_their_pool_blocks_and_bookkeeping_in_bytes(model):
    cfg = EngineConfig(policy="scissorhands", budget_tokens=16, kv_reuse="session_state", **PAGED)
    engine = ContinuousBatchingEngine(model, cfg)
    assert [engine.stats()[k] for k in KEYS] == [0, 0, 0, 0]  # nothing kept yet
    prompts = [list(range(1, 21)), list(range(30, 45))]
    _run(engine, [GenerationRequest(f"r{i}", p, 4, session_id=f"s{i}") for i, p in enumerate(prompts)])
    stats = engine.stats()
    pool = engine.kv.sessions
    assert stats["session_states"] == 2
    assert stats["held_kv_bytes"] == pool.held_blocks * pool.block_nbytes() > 0
    assert stats["held_kv_bytes"] == stats["session_state_blocks"] * pool.block_nbytes()
    assert stats["held_bookkeeping_bytes"] == pool.bookkeeping_bytes() == stats["session_state_bookkeeping_bytes"] > 0
    assert stats["peak_held_kv_bytes"] == stats["held_kv_bytes"]
    # the held state is the budget's worth of slots per layer, not the whole conversation (20 + 4 - 1 tokens)
    assert pool.held_blocks == 2 * engine.kv.num_layers * (16 // 4)
    # session 1's state dropped (its session moved on): held falls, the peak stays; `reset_stats` starts it again
    peak = stats["peak_held_kv_bytes"]
    pool.drop("s1")
    engine._record_state()
    after = engine.stats()
    assert after["held_kv_bytes"] < peak and after["peak_held_kv_bytes"] == peak
    engine.reset_stats()
    assert engine.stats()["peak_held_kv_bytes"] == after["held_kv_bytes"]


def test_idle_prefix_cache_entries_report_their_blocks_and_no_bookkeeping(model):
    engine = ContinuousBatchingEngine(model, EngineConfig(policy="full", enable_prefix_caching=True, **PAGED))
    _run(engine, [GenerationRequest("a", list(range(1, 19)), 3)])  # 18 prompt tokens: 4 full blocks cached
    stats = engine.stats()
    prefix = engine.kv.prefix
    assert len(prefix.idle) == 4 and stats["prefix_cache_blocks"] == 4 * prefix.num_layers
    assert stats["held_kv_bytes"] == stats["prefix_cache_blocks"] * prefix.block_nbytes()
    assert stats["peak_held_kv_bytes"] == stats["held_kv_bytes"] and stats["held_bookkeeping_bytes"] == 0


def test_an_engine_keeping_nothing_reports_no_held_kv(model):
    engine = ContinuousBatchingEngine(model, EngineConfig(policy="full", **PAGED))
    _run(engine, [GenerationRequest("a", list(range(1, 19)), 3, session_id="s")])
    assert [engine.stats()[k] for k in KEYS] == [None] * 4
