"""A budgeted policy's uncompressed prompt prefix shared through the prefix cache (`EngineConfig.kv_reuse:
shared_prefix`, TensorRT-LLM's TriAttention way): a row keeps its prompt's whole blocks uncompressed (pinned, never
evicted) and compresses only what follows, holding at most P + B slots; the pinned blocks are registered in the
prefix cache, shared read-only by every row with the same prefix and never written after; a request skips the
prefill of its cached prefix; greedy tokens are deterministic and, when nothing past the prefix exceeds the budget,
those of the prefix-cached full cache, under both schedulers and across preemption."""

from __future__ import annotations

import pytest
import torch

from replica.common.session_affinity import keeps_session_state
from replica.common.types import ConfigError, EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine
from replica.metrics import NullMetrics
from replica.openai_api import reports_cached_tokens

PAGED = dict(kv_layout="paged", block_tokens=4)
SHARED = dict(kv_reuse="shared_prefix")
PARAMS = dict(history_window=8, count_chunk_steps=2)


def _sh(budget: int) -> dict:
    return dict(policy="scissorhands", budget_tokens=budget, policy_params=PARAMS)


SCHEDULERS = [
    pytest.param(dict(scheduler="prefill_first"), id="prefill_first"),
    pytest.param(dict(scheduler="mixed", max_num_batched_tokens=8), id="mixed-chunks-of-8"),
]


def _shared_prefix_requests(n: int = 6, seed: int = 0, prefix_tokens: int = 37, new=(2, 16)) -> list:
    """`n` requests whose prompts start with one system prompt of `prefix_tokens` and go on with 1-19 own tokens."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 128, (prefix_tokens,), generator=g).tolist()
    out = []
    for i in range(n):
        own = torch.randint(0, 128, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        k = int(torch.randint(*new, (1,), generator=g))
        out.append(GenerationRequest(f"r{i}", system + own, k, ignore_eos=True))
    return out


class _Evictions(NullMetrics):
    """A recorder that counts the tokens the policy evicted (the engine's live counter)."""

    def __init__(self):
        self.evicted_tokens = 0

    def add_evictions(self, n: int) -> None:
        self.evicted_tokens += n


def _serve(model, cfg: EngineConfig, requests, together: bool = True, after_step=None):
    """Serve `requests` submitted together, or each after the previous one finished; results by id and the engine
    (its recorder, `engine.metrics`, counts evicted tokens)."""
    engine = ContinuousBatchingEngine(model, cfg, metrics=_Evictions())
    results = {}

    def run():
        for _ in range(100_000):
            if not engine.step() and not engine.queued:
                return
            if after_step is not None:
                after_step(engine)

    for r in requests:
        engine.submit(r, lambda res: results.__setitem__(res.request_id, res))
        if not together:
            run()
    run()
    return results, engine


def _outputs(results) -> dict:
    return {k: r.output_ids for k, r in results.items()}


def _pinned(prompt_tokens: int, block_tokens: int = 4) -> int:
    return (prompt_tokens - 1) // block_tokens * block_tokens


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_a_budgeted_row_keeps_its_pinned_prefix_and_at_most_its_budget_past_it(model, sched):
    budget = 12
    requests = _shared_prefix_requests(4, new=(20, 30))
    pinned = {r.request_id: _pinned(len(r.prompt_ids)) for r in requests}
    seen = []

    def check(engine):
        if engine._cache is None:
            return
        for i, seq in enumerate(engine._running):
            p = pinned[seq.request.request_id]
            assert seq.pinned_tokens == p
            for layer in engine._cache.layers:
                st = layer.slot_time[i].to(torch.int64)  # (heads, slots), this row's own clock
                assert torch.equal(st[:, :p], torch.arange(p).expand(st.shape[0], p))
                assert int(layer.held[i]) <= p + budget
            seen.append(int(engine._cache.layers[0].held[i]) - p)

    cfg = EngineConfig(**PAGED, **_sh(budget), **sched, kv_memory_limit_bytes=10**7, **SHARED)
    got, engine = _serve(model, cfg, requests, after_step=check)
    assert all(r.error is None for r in got.values())
    assert max(seen) == budget  # rows filled their budget past the prefix, and evicted there
    assert engine.metrics.evicted_tokens > 0
    assert engine.pool.blocks_in_use == 0


def test_requests_with_one_system_prompt_share_its_blocks_once_and_skip_its_prefill(model):
    system = list(range(1, 17))  # 4 whole blocks of 4
    first = GenerationRequest("first", system + [50], 1, ignore_eos=True)
    pair = [GenerationRequest(f"p{i}", system + [60 + i, 70 + i], 6, ignore_eos=True) for i in range(2)]
    cfg = EngineConfig(**PAGED, **_sh(8), kv_memory_limit_bytes=10**7, **SHARED)
    engine = ContinuousBatchingEngine(model, cfg)
    results = {}
    engine.submit(first, lambda r: results.__setitem__(r.request_id, r))
    engine.run_until_idle()
    assert (results["first"].cached_prompt_tokens, results["first"].prefilled_prompt_tokens) == (0, 17)
    for r in pair:
        engine.submit(r, lambda res: results.__setitem__(res.request_id, res))
    engine.step()
    tables = [layer.store.blocks for layer in engine._cache.layers]
    assert len(engine._running) == 2 and all(table[0][:4] == table[1][:4] for table in tables)
    # 2 layers: the 4 shared blocks once, each row's own fifth (18 + 1 slots: P = 16 pinned, 3 past it)
    assert engine.pool.blocks_in_use == 2 * (4 + 2 * 1)
    assert sum(len(row) for table in tables for row in table) == 2 * 2 * 5
    engine.run_until_idle()
    assert [
        (results[r.request_id].cached_prompt_tokens, results[r.request_id].prefilled_prompt_tokens) for r in pair
    ] == [
        (16, 2),
        (16, 2),
    ]
    stats = engine.stats()
    assert stats["prefix_caching"] is True and stats["prefix_cache_hit_tokens"] == 32
    assert stats["prefix_cache_blocks"] == 2 * 4  # the pinned blocks only: a budgeted row's others are its own
    assert engine.pool.blocks_in_use == 0


@pytest.mark.parametrize("sched", SCHEDULERS)
@pytest.mark.parametrize("limit", [10**7, 60_000], ids=["roomy", "tight"])
def test_with_nothing_past_the_prefix_over_budget_the_tokens_are_the_prefix_cached_full_caches(model, sched, limit):
    """Budget 40 holds every token past the pinned prefix (prompt tail + new tokens, a recompute's included), so
    Scissorhands never evicts: its greedy tokens are the full cache's with prefix caching, and a second run gives
    the same; the tight limit preempts rows, which recompute (their pinned prefix again: the prompt's blocks)."""
    requests = _shared_prefix_requests(8, seed=1, new=(2, 16))
    base = dict(**PAGED, **sched, kv_memory_limit_bytes=limit)
    want, full = _serve(model, EngineConfig(**base, enable_prefix_caching=True), requests)
    got, engine = _serve(model, EngineConfig(**base, **_sh(40), **SHARED), requests)
    again, _ = _serve(model, EngineConfig(**base, **_sh(40), **SHARED), requests)
    assert all(r.error is None for r in got.values())
    assert _outputs(got) == _outputs(want) == _outputs(again)
    stats = engine.stats()
    assert engine.metrics.evicted_tokens == 0 and engine.pool.blocks_in_use == 0
    assert stats["prefix_cache_miss_tokens"] == sum(r.prefilled_prompt_tokens for r in got.values())
    if limit != 10**7:
        assert stats["preemptions"] > 0
        assert stats["peak_kv_cache_bytes"] <= limit  # P + B per row counted, shared blocks once


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_scissorhands_under_shared_prefix_is_deterministic_across_preemption_and_evicts(model, sched):
    requests = _shared_prefix_requests(8, seed=2, new=(20, 40))
    cfg = EngineConfig(**PAGED, **_sh(8), **sched, kv_memory_limit_bytes=40_000, **SHARED)
    runs = [_serve(model, cfg, requests) for _ in range(2)]
    (got, engine), (again, _) = runs
    assert all(r.error is None for r in got.values())
    assert _outputs(got) == _outputs(again)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and engine.metrics.evicted_tokens > 0
    assert stats["peak_kv_cache_bytes"] <= 40_000
    assert stats["prefix_cache_hit_tokens"] > 0
    # compressing what follows the prefix changes the tokens (the prefix-cached full cache's differ)
    full, _ = _serve(
        model, EngineConfig(**PAGED, **sched, kv_memory_limit_bytes=10**7, enable_prefix_caching=True), requests
    )
    assert _outputs(full) != _outputs(got)


def test_a_registered_block_is_never_written_after_registration(model, monkeypatch):
    """Every write into the pool (prefill chunks, decode appends, compactions at each eviction) checks that the block
    it reaches is not a cached entry's."""
    requests = _shared_prefix_requests(6, seed=3, new=(20, 30))
    cfg = EngineConfig(
        **PAGED, **_sh(8), scheduler="mixed", max_num_batched_tokens=8, kv_memory_limit_bytes=10**7, **SHARED
    )
    engine = ContinuousBatchingEngine(model, cfg, metrics=_Evictions())
    writes = []
    index_copy = torch.Tensor.index_copy_

    def spy(self, dim, index, source):
        buffers = engine.pool.buffers
        if buffers and any(self.data_ptr() == b.data_ptr() for b in buffers.values()):
            slots = next(iter(buffers.values())).shape[1]
            blocks = set(((index % slots) // engine.pool.block_tokens).tolist())
            writes.append(len(blocks))
            assert not blocks & set(engine.pool.hash_of), "a registered block was written"
        return index_copy(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", spy)
    results = {}
    for r in requests:
        engine.submit(r, lambda res: results.__setitem__(res.request_id, res))
    engine.run_until_idle()
    assert all(r.error is None for r in results.values())
    stats = engine.stats()
    assert writes and engine.metrics.evicted_tokens > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_a_reclaimed_prefix_is_recomputed_to_the_same_tokens(model):
    """A tight pool: other prompts reclaim the first prefix's idle blocks; its request again is recomputed from text
    (nothing cached) and answers as the first time."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (30,), generator=g).tolist() for _ in range(5)]
    requests = [GenerationRequest(f"r{i}", p, 6, ignore_eos=True) for i, p in enumerate(prompts)]
    again = GenerationRequest("r0-again", prompts[0], 6, ignore_eos=True)
    cfg = EngineConfig(**PAGED, **_sh(8), kv_memory_limit_bytes=40_000, **SHARED)
    got, engine = _serve(model, cfg, [*requests, again], together=False)
    stats = engine.stats()
    assert stats["prefix_cache_reclaimed_blocks"] > 0
    assert got["r0-again"].cached_prompt_tokens == 0 and got["r0-again"].prefilled_prompt_tokens == 30
    assert got["r0-again"].output_ids == got["r0"].output_ids


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_sessions_with_equal_prefixes_and_different_histories_share_only_their_equal_blocks(model, sched):
    """Two sessions planted with one 8-token prefix (2 blocks) and different histories, a third differing inside its
    third block: each answers as it does alone in a fresh engine (never from another's blocks past the shared
    part), and takes only the equal blocks from the cache."""
    prefix = [5, 9, 17, 33, 65, 3, 7, 11]
    a = GenerationRequest("a", prefix + [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], 8, ignore_eos=True, session_id="a")
    b = GenerationRequest("b", prefix + [90, 91, 92, 93, 94, 95, 96, 97, 98, 99], 8, ignore_eos=True, session_id="b")
    c = GenerationRequest("c", prefix + [20, 21, 100, 101, 102, 103, 104, 105, 106, 107], 8, ignore_eos=True)
    repeat = GenerationRequest("a-again", a.prompt_ids, 8, ignore_eos=True, session_id="a")
    cfg = EngineConfig(**PAGED, **_sh(6), **sched, kv_memory_limit_bytes=10**7, **SHARED)
    got, _ = _serve(model, cfg, [a, b, c, repeat], together=False)
    alone = {r.request_id: _serve(model, cfg, [r])[0][r.request_id].output_ids for r in (a, b, c)}
    assert len({tuple(v) for v in alone.values()}) == 3
    assert {k: got[k].output_ids for k in "abc"} == alone and got["a-again"].output_ids == alone["a"]
    assert {k: r.cached_prompt_tokens for k, r in got.items()} == {"a": 0, "b": 8, "c": 8, "a-again": 16}


def test_the_kv_accounting_counts_the_pinned_prefix_beside_the_budget(model):
    cfg = EngineConfig(**PAGED, **_sh(8), kv_memory_limit_bytes=10**7, **SHARED)
    engine = ContinuousBatchingEngine(model, cfg)
    kv = engine.kv
    assert kv.pinned_of(30) == 28 and kv.pinned_of(29) == 28 and kv.pinned_of(28) == 24 and kv.pinned_of(1) == 0
    assert kv.kept_of(30, 10) == 28 + 8
    # 2 layers x ceil((28 + 8) / 4) blocks at its end; without sharing its prefix, ceil(8 / 4)
    assert kv.final_blocks(30, 10) == 2 * 9
    plain = ContinuousBatchingEngine(model, EngineConfig(**PAGED, **_sh(8), kv_memory_limit_bytes=10**7))
    assert plain.kv.final_blocks(30, 10) == 2 * 2 and plain.kv.pinned_of(30) == 0
    # the full cache under shared_prefix pins nothing: it is the prefix-cached full cache
    full = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, **SHARED))
    assert full.kv.pinned_of(30) == 0 and full.kv.prefix is not None


def test_shared_prefix_turns_the_prefix_cache_on_and_keeps_session_affinity():
    cfg = EngineConfig(**PAGED, **_sh(8), kv_memory_limit_bytes=10**6, **SHARED)
    assert cfg.enable_prefix_caching is True
    assert EngineConfig(**PAGED, **_sh(8), kv_memory_limit_bytes=10**6, enable_prefix_caching=True, **SHARED) == cfg
    assert keeps_session_state("shared_prefix", None) and keeps_session_state("shared_prefix", False)
    assert reports_cached_tokens({"kv_reuse": "shared_prefix", "engine": "ours"})


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(kv_layout="preallocated"),
            r"kv_reuse: 'shared_prefix'.*kv_layout: 'paged'; accepted: none, session_state, shared_prefix",
        ),
        (
            dict(**PAGED, enable_prefix_caching=False),
            r"enable_prefix_caching: kv_reuse 'shared_prefix' .*accepted: true or left out \(got False\)",
        ),
        (dict(**PAGED, enable_prefix_caching="yes"), r"enable_prefix_caching: .*got 'yes'"),
    ],
)
def test_shared_prefix_is_refused_where_it_cannot_share_naming_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**{"kv_memory_limit_bytes": 10**6, **_sh(8), **kw, **SHARED})


def test_a_budgeted_prefix_cache_without_shared_prefix_is_refused_naming_the_way():
    with pytest.raises(ConfigError, match=r"enable_prefix_caching: .*kv_reuse: shared_prefix.*accepted: false"):
        EngineConfig(**PAGED, **_sh(8), kv_memory_limit_bytes=10**6, enable_prefix_caching=True)


@pytest.mark.parametrize("value", ["shared", "prefix", True])
def test_kv_reuse_names_its_three_ways(value):
    with pytest.raises(ConfigError, match=r"kv_reuse.*none.*session_state.*shared_prefix"):
        EngineConfig(**PAGED, kv_memory_limit_bytes=10**6, kv_reuse=value)
