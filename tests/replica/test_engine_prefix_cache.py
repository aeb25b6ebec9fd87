"""Prefix caching in the paged engine (`EngineConfig.enable_prefix_caching`, `replica.engine.prefix_cache`): the
full cache gives the same greedy tokens with and without it under both schedulers, across preemption and
reclaimed blocks; a request skips the prefill of its cached blocks and always computes one token; two prompts
share blocks only as far as their tokens are equal; a shared block is counted once; the counts are reported."""

from __future__ import annotations

import pytest
import torch

from replica.common.types import ConfigError, EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine
from replica.engine.prefix_cache import PrefixCachingPool, cacheable_prefix_tokens, chain_hashes
from scissorhands.paged import PoolExhausted

PAGED = dict(kv_layout="paged", block_tokens=4)
ON = dict(enable_prefix_caching=True)


def _shared_prefix_requests(n: int = 8, seed: int = 0, prefix_tokens: int = 37) -> list[GenerationRequest]:
    """`n` requests whose prompts start with one system prompt of `prefix_tokens` (not a whole number of blocks)
    and go on with 1-19 tokens of their own."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 128, (prefix_tokens,), generator=g).tolist()
    out = []
    for i in range(n):
        own = torch.randint(0, 128, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        out.append(
            GenerationRequest(f"r{i}", system + own, int(torch.randint(2, 16, (1,), generator=g)), ignore_eos=True)
        )
    return out


def _serve(model, cfg: EngineConfig, requests, together: bool = True, after_step=None):
    """Serve `requests` submitted together, or each after the previous one finished; results by id and the engine."""
    engine = ContinuousBatchingEngine(model, cfg)
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


SCHEDULERS = [
    pytest.param(dict(scheduler="prefill_first"), id="prefill_first"),
    pytest.param(dict(scheduler="mixed", max_num_batched_tokens=8), id="mixed-chunks-of-8"),
    pytest.param(dict(scheduler="mixed", max_num_batched_tokens=24), id="mixed-chunks-of-24"),
]


@pytest.mark.parametrize("sched", SCHEDULERS)
@pytest.mark.parametrize("together", [True, False], ids=["together", "one-after-another"])
@pytest.mark.parametrize("limit", [10**7, 40_000], ids=["roomy", "tight"])
def test_the_prefix_cached_full_cache_gives_the_uncached_tokens_and_returns_every_block(model, sched, together, limit):
    requests = _shared_prefix_requests()
    cfg = dict(**PAGED, **sched, kv_memory_limit_bytes=limit)
    want, _ = _serve(model, EngineConfig(**cfg), requests, together)
    got, engine = _serve(model, EngineConfig(**cfg, **ON), requests, together)
    assert all(r.error is None for r in got.values())
    assert _outputs(got) == _outputs(want)
    stats = engine.stats()
    assert engine.pool.blocks_in_use == 0 and stats["running_sequences"] == 0  # cached blocks are idle, not held
    assert stats["prefix_cache_blocks"] > 0
    if not together or "max_num_batched_tokens" in sched:  # prefill-first admits the 8 at once: none was cached
        assert stats["prefix_cache_hit_tokens"] > 0
    prompts = sum(len(r.prompt_ids) for r in requests)
    # every prompt token of every prefill is a hit or a miss; a request's cached prompt tokens are those of its first
    # admission (never above its prompt), so they add up to the engine's hits unless a preemption recomputed some
    cached = sum(r.cached_prompt_tokens for r in got.values())
    assert all(got[r.request_id].cached_prompt_tokens <= len(r.prompt_ids) for r in requests)
    if stats["preemptions"] == 0:
        assert stats["prefix_cache_hit_tokens"] == cached
    else:
        assert 0 <= cached <= stats["prefix_cache_hit_tokens"]
    assert stats["prefix_cache_miss_tokens"] == sum(r.prefilled_prompt_tokens for r in got.values())
    if stats["preemptions"] == 0:
        assert stats["prefix_cache_hit_tokens"] + stats["prefix_cache_miss_tokens"] == prompts
    if not together:  # each request after the first finds the system prompt's 9 whole blocks
        assert [got[r.request_id].cached_prompt_tokens for r in requests][1:] == [36] * 7
    if limit == 40_000:  # the pool (38 blocks) cannot keep every prompt's blocks: idle ones were reclaimed
        assert stats["prefix_cache_reclaimed_blocks"] > 0
        assert stats["peak_kv_cache_bytes"] <= limit  # shared blocks counted once, bookkeeping included


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_a_preempted_request_whose_blocks_were_reclaimed_recomputes_the_uncached_tokens(model, sched):
    """Long outputs in a pool of 38 blocks: rows are preempted, their blocks go idle and are reclaimed for the
    rows that stay, and the preempted ones come back through the cache or recompute what it lost."""
    requests = _shared_prefix_requests(6, seed=3, prefix_tokens=20)
    requests = [GenerationRequest(r.request_id, r.prompt_ids, 40, ignore_eos=True) for r in requests]
    cfg = dict(**PAGED, **sched, kv_memory_limit_bytes=40_000)
    want, base = _serve(model, EngineConfig(**cfg), requests)
    assert all(r.error is None for r in want.values())
    got, engine = _serve(model, EngineConfig(**cfg, **ON), requests)
    stats = engine.stats()
    assert base.stats()["preemptions"] > 0 and stats["preemptions"] > 0
    assert stats["prefix_cache_reclaimed_blocks"] > 0 and stats["peak_kv_cache_bytes"] <= 40_000
    assert all(r.error is None for r in got.values())
    assert _outputs(got) == _outputs(want)
    assert engine.pool.blocks_in_use == 0


def test_a_request_skips_its_cached_blocks_and_always_computes_one_token(model):
    prompt = list(range(1, 17))  # 4 whole blocks of 4
    requests = [
        GenerationRequest("first", prompt, 3, ignore_eos=True),
        GenerationRequest("same", prompt, 3, ignore_eos=True),  # every block cached: the last one is computed
        GenerationRequest("longer", prompt + [40, 41, 42, 43, 44], 3, ignore_eos=True),
    ]
    cfg = EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, **ON)
    got, engine = _serve(model, cfg, requests, together=False)
    want, _ = _serve(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7), requests, together=False)
    assert _outputs(got) == _outputs(want) and got["same"].output_ids == got["first"].output_ids
    cached = {k: (r.cached_prompt_tokens, r.prefilled_prompt_tokens) for k, r in got.items()}
    assert cached == {"first": (0, 16), "same": (12, 4), "longer": (16, 5)}
    stats = engine.stats()
    assert (stats["prefix_cache_hit_tokens"], stats["prefix_cache_miss_tokens"]) == (28, 25)
    # blocks: the first prompt's 4 and the longer one's fifth, one per layer; the same prompt's last block is its
    # own copy of a cached block (not cached twice)
    assert stats["prefix_cache_blocks"] == 2 * 5 and stats["prefix_cache_reclaimed_blocks"] == 0


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_equal_prefixes_with_different_continuations_share_only_the_equal_blocks(model, sched):
    """Two sessions planted with one 8-token prefix (2 blocks) and different continuations, the second differing
    inside its third block: neither is answered from the other's blocks past the shared part."""
    prefix = [5, 9, 17, 33, 65, 3, 7, 11]
    a = GenerationRequest("a", prefix + [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], 8, ignore_eos=True)
    b = GenerationRequest("b", prefix + [90, 91, 92, 93, 94, 95, 96, 97, 98, 99], 8, ignore_eos=True)
    c = GenerationRequest("c", prefix + [20, 21, 100, 101, 102, 103, 104, 105, 106, 107], 8, ignore_eos=True)
    repeat = GenerationRequest("a-again", a.prompt_ids, 8, ignore_eos=True)
    requests = [a, b, c, repeat]
    cfg = dict(**PAGED, **sched, kv_memory_limit_bytes=10**7)
    want, _ = _serve(model, EngineConfig(**cfg), requests, together=False)
    assert len({tuple(want[k].output_ids) for k in "abc"}) == 3  # each continuation answers differently
    got, engine = _serve(model, EngineConfig(**cfg, **ON), requests, together=False)
    assert _outputs(got) == _outputs(want)
    # b and c find the shared 2 blocks only (c's third block holds 20, 21 like a's, then differs); a's own
    # request again finds its 4 whole blocks (18 tokens: 16 cached, 2 computed)
    assert {k: r.cached_prompt_tokens for k, r in got.items()} == {"a": 0, "b": 8, "c": 8, "a-again": 16}


def test_requests_sharing_a_prefix_run_on_one_copy_of_its_blocks(model):
    """Two rows running at once on one cached 16-token prefix hold its 4 blocks a layer once: the pool's blocks in
    use (what the KV memory limit counts) are fewer than the rows' own block tables add up to."""
    prefix = list(range(1, 17))
    first = GenerationRequest("first", prefix + [50], 1, ignore_eos=True)
    pair = [GenerationRequest(f"p{i}", prefix + [60 + i, 70 + i], 6, ignore_eos=True) for i in range(2)]
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, **ON))
    results = {}
    engine.submit(first, lambda r: results.__setitem__(r.request_id, r))
    engine.run_until_idle()
    for r in pair:
        engine.submit(r, lambda res: results.__setitem__(res.request_id, res))
    engine.step()
    store_blocks = [layer.store.blocks for layer in engine._cache.layers]
    held = sum(len(row) for table in store_blocks for row in table)
    assert len(engine._running) == 2 and held == 2 * 2 * 5  # 2 layers x 2 rows x 5 blocks (19 slots)
    assert engine.pool.blocks_in_use == 2 * (4 + 2 * 1)  # the 4 shared blocks once, each row's own fifth
    assert all(table[0][:4] == table[1][:4] for table in store_blocks)
    bookkeeping = engine._cache.bookkeeping_bytes()
    assert engine.stats()["kv_cache_bytes"] == engine.pool.blocks_in_use * engine.pool.block_nbytes() + bookkeeping
    assert engine.stats()["kv_cache_bytes"] < engine._cache.kv_cache_bytes()  # the rows' own sum counts them twice
    engine.run_until_idle()
    assert [results[r.request_id].cached_prompt_tokens for r in pair] == [16, 16]
    assert engine.pool.blocks_in_use == 0


def test_a_fault_starting_a_group_from_the_cache_fails_that_group_alone_and_returns_its_blocks(model):
    prompt = list(range(1, 17))
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, **ON))
    results = {}
    engine.submit(GenerationRequest("first", prompt, 2), lambda r: results.__setitem__(r.request_id, r))
    engine.run_until_idle()
    build = engine.runner.new_cache

    def broken(group=None, paged=True):
        if group and group[0].request.request_id == "hit":
            raise RuntimeError("cache build failed")
        return build(group, paged)

    engine.runner.new_cache = broken
    engine.submit(GenerationRequest("hit", prompt + [3], 2), lambda r: results.__setitem__(r.request_id, r))
    engine.submit(GenerationRequest("other", [9] * 10, 2), lambda r: results.__setitem__(r.request_id, r))
    engine.run_until_idle()
    assert results["hit"].error_kind == "error" and "cache build failed" in results["hit"].error
    assert results["other"].error is None and len(results["other"].output_ids) == 2
    assert engine.pool.blocks_in_use == 0 and engine.stats()["prefix_cache_blocks"] == 2 * (4 + 2)  # still cached
    engine.runner.new_cache = build
    engine.submit(GenerationRequest("again", prompt + [3], 2), lambda r: results.__setitem__(r.request_id, r))
    engine.run_until_idle()
    assert results["again"].cached_prompt_tokens == 16 and results["again"].error is None


def test_a_prompt_logprobs_request_scores_every_token_and_takes_nothing_from_the_cache(model):
    prompt = list(range(1, 17))
    warm = GenerationRequest("warm", prompt, 2, ignore_eos=True)
    scored = GenerationRequest("scored", prompt + [3], 2, ignore_eos=True, prompt_logprobs=0)
    cfg = dict(**PAGED, kv_memory_limit_bytes=10**7)
    want, _ = _serve(model, EngineConfig(**cfg), [warm, scored], together=False)
    got, _ = _serve(model, EngineConfig(**cfg, **ON), [warm, scored], together=False)
    assert got["scored"].cached_prompt_tokens == 0 and got["scored"].prefilled_prompt_tokens == 17
    assert got["scored"].prompt_logprobs == want["scored"].prompt_logprobs
    assert _outputs(got) == _outputs(want)


def test_without_the_knob_nothing_is_cached_and_the_counts_say_off(model):
    requests = _shared_prefix_requests(3)
    got, engine = _serve(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7), requests, together=False)
    stats = engine.stats()
    assert stats["prefix_caching"] is False
    assert [stats[k] for k in ("prefix_cache_hit_tokens", "prefix_cache_miss_tokens", "prefix_cache_blocks")] == [
        None
    ] * 3
    assert [(r.cached_prompt_tokens, r.prefilled_prompt_tokens) for r in got.values()] == [
        (0, len(r.prompt_ids)) for r in requests
    ]


def test_reset_stats_zeroes_the_prefix_cache_counts_and_keeps_the_cache(model):
    requests = _shared_prefix_requests(2)
    _, engine = _serve(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, **ON), requests, together=False)
    assert engine.stats()["prefix_cache_hit_tokens"] == 36
    engine.reset_stats()
    stats = engine.stats()
    assert (stats["prefix_cache_hit_tokens"], stats["prefix_cache_miss_tokens"]) == (0, 0)
    assert stats["prefix_cache_blocks"] > 0  # a gauge: the cache is kept
    results = {}
    engine.submit(GenerationRequest("again", requests[0].prompt_ids, 2), lambda r: results.__setitem__("x", r))
    engine.run_until_idle()
    assert results["x"].cached_prompt_tokens == 4 * ((len(requests[0].prompt_ids) - 1) // 4)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(policy="scissorhands", budget_tokens=16, **PAGED, kv_memory_limit_bytes=10**6), "policy 'scissorhands'"),
        (dict(policy="full", kv_memory_limit_bytes=10**6), "kv_layout 'preallocated'"),
    ],
)
def test_prefix_caching_is_refused_where_blocks_cannot_be_shared_naming_the_field(kw, message):
    with pytest.raises(ConfigError, match=r"enable_prefix_caching: .*accepted: false") as e:
        EngineConfig(**kw, **ON)
    assert message in str(e.value)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_prefix_caching_takes_a_bool_only(value):
    with pytest.raises(ConfigError, match=r"enable_prefix_caching: expected true or false, got"):
        EngineConfig(**PAGED, kv_memory_limit_bytes=10**6, enable_prefix_caching=value)


# ----------------------------------------------------------------------------------------------- the pool
def test_block_hashes_chain_the_prefix_so_equal_blocks_after_different_prefixes_differ():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [])
    b = chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, [])
    assert len(a) == 2 and len(b) == 2  # whole blocks only
    assert a[0] != b[0] and a[1] != b[1]  # block 1's tokens are equal, its prefix is not
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, list(a[:1]))[:2] == a  # extends what it knew


def test_the_pool_reclaims_idle_cached_blocks_least_recently_released_first():
    pool = PrefixCachingPool(num_blocks=7, block_tokens=4, num_layers=2)  # 6 usable: 3 entries of 2 layers
    rows = [pool.allocate(2) for _ in range(3)]
    for i, blocks in enumerate(rows):
        assert pool.register(bytes([i]), tuple(blocks))
    assert pool.free_blocks == 0 and pool.blocks_in_use == 6
    for i in (1, 0, 2):  # released in this order: entry 1 is the least recently used
        pool.release(rows[i])
    assert pool.free_blocks == 6 and pool.blocks_in_use == 0 and pool.cached_blocks == 6
    assert pool.claim(bytes([0])) == tuple(rows[0])  # a hit leaves the idle queue
    taken = pool.allocate(2)
    assert sorted(taken) == sorted(rows[1]) and bytes([1]) not in pool.entries  # the oldest idle entry went
    assert pool.reclaimed_blocks == 2 and bytes([2]) in pool.entries
    with pytest.raises(PoolExhausted):
        pool.allocate(3)  # 2 free (entry 2's), nothing taken
    assert pool.free_blocks == 2


def test_the_pool_counts_a_shared_block_once_and_refuses_a_double_release():
    pool = PrefixCachingPool(num_blocks=5, block_tokens=4, num_layers=2)
    blocks = pool.allocate(2)
    pool.register(b"h", tuple(blocks))
    assert pool.referenced(b"h")
    pool.claim(b"h")  # a second row on the same blocks
    assert pool.blocks_in_use == 2
    pool.release(blocks)
    assert pool.blocks_in_use == 2 and pool.referenced(b"h")  # the other row still holds them
    pool.release(blocks)
    assert pool.blocks_in_use == 0 and not pool.referenced(b"h") and pool.cached_blocks == 2
    with pytest.raises(ValueError, match="no row references"):
        pool.release(blocks)
    assert pool.free_blocks == 4  # nothing changed


@pytest.mark.slow
def test_the_prefix_cached_full_cache_gives_the_uncached_tokens_on_the_embedded_model():
    """A shared system prompt on the real model: requests one after another under prefill-first (each finds the
    system prompt's blocks) and submitted together under mixed chunks give the greedy tokens of the engine without the cache, where rounding
    and near-ties are real."""
    from replica.static_batch import load_replica_model
    from workloads.load.prompts import prompts_for

    torch.set_num_threads(2)
    model, tokenizer = load_replica_model("embedded", dtype="float32")
    model.generation_config.eos_token_id = None
    system = prompts_for(tokenizer, model.config.vocab_size, 1, 150, seed=7)[0]
    requests = [
        GenerationRequest(f"r{i}", system + prompts_for(tokenizer, model.config.vocab_size, 1, n, seed=i)[0], 16)
        for i, n in enumerate([40, 9, 77, 23])
    ]
    paged = dict(kv_layout="paged", kv_memory_limit_bytes=200 * 2**20)
    runs = [(dict(), False), (dict(scheduler="mixed", max_num_batched_tokens=64), True)]
    for sched, together in runs:
        want, _ = _serve(model, EngineConfig(**paged, **sched), requests, together)
        got, engine = _serve(model, EngineConfig(**paged, **sched, **ON), requests, together)
        assert _outputs(got) == _outputs(want), (sched, together)
        cached = [got[r.request_id].cached_prompt_tokens for r in requests]
        if not together:
            assert cached == [0] + [144] * 3  # 9 blocks of 16
        else:  # fed in chunks: a request admitted once the system prompt's chunks were computed finds them
            assert engine.stats()["prefix_cache_hit_tokens"] == sum(cached) > 0


def test_the_cacheable_prefix_is_the_prompts_whole_blocks_but_its_last_token():
    assert [cacheable_prefix_tokens(n, 4) for n in (0, 1, 4, 5, 8, 9, 17)] == [0, 0, 0, 4, 4, 8, 16]
    with pytest.raises(ValueError, match="block_tokens"):
        cacheable_prefix_tokens(10, 0)
