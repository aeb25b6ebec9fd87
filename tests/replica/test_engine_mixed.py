"""The mixed scheduler (`scheduler: mixed`): one token budget per step, running rows' decode tokens first,
prompts fed in chunks filling the rest; the same tokens as prefill-first for the full cache, a chunk as long as
the prompt equal to the whole-prompt prefill, the budget and the block pool held at every step."""

from __future__ import annotations

import pytest
import torch

from replica.common.types import ConfigError, EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine
from replica.engine.requests import StepPlan

SH = dict(policy="scissorhands", budget_tokens=16, policy_params=dict(history_window=20, count_chunk_steps=5))
PAGED = dict(kv_layout="paged", block_tokens=4)


def _requests(n: int, seed: int = 0, longest: int = 60) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(5, longest, (1,), generator=g))
        prompt = torch.randint(0, 128, (length,), generator=g).tolist()
        out.append(GenerationRequest(f"r{i}", prompt, int(torch.randint(1, 30, (1,), generator=g)), ignore_eos=True))
    return out


def _serve(model, cfg: EngineConfig, requests, after_step=None):
    engine = ContinuousBatchingEngine(model, cfg)
    results = {}
    for r in requests:
        engine.submit(r, lambda res: results.__setitem__(res.request_id, res))
    for _ in range(100_000):
        if not engine.step() and not engine.queued:
            break
        if after_step is not None:
            after_step(engine)
    return results, engine


@pytest.mark.parametrize("tokens", [8, 20, 64])
@pytest.mark.parametrize("limit", [10**7, 60_000], ids=["roomy", "preempting"])
def test_mixed_full_cache_gives_the_prefill_first_tokens_and_returns_every_block(model, tokens, limit):
    requests = _requests(10)
    want, _ = _serve(model, EngineConfig(**PAGED, kv_memory_limit_bytes=limit), requests)
    cfg = EngineConfig(**PAGED, kv_memory_limit_bytes=limit, scheduler="mixed", max_num_batched_tokens=tokens)
    got, engine = _serve(model, cfg, requests)
    assert all(r.error is None for r in got.values())
    assert {k: r.output_ids for k, r in got.items()} == {k: r.output_ids for k, r in want.items()}
    stats = engine.stats()
    assert engine.pool.blocks_in_use == 0 and stats["running_sequences"] == 0
    assert stats["scheduler"] == "mixed" and stats["max_num_batched_tokens"] == tokens
    if tokens < 60:  # prompts of up to 59 tokens: some were fed in several chunks
        assert stats["prefill_calls"] > 10
    if limit == 60_000:  # the pool was full: rows were preempted and every block was used
        assert stats["preemptions"] > 0 and stats["peak_kv_blocks_in_use"] > engine.pool.usable_blocks * 0.8


def test_a_new_prompt_waits_for_room_for_its_whole_prefill_rather_than_be_preempted_part_way(model):
    """A prompt started in the last free blocks would be the first preempted when a running row grows and fed
    again from its start: under the preempting pool mixed preempts about as often as prefill-first, not 8x."""
    requests = _requests(10)
    counts = {}
    for scheduler in ["prefill_first", "mixed"]:
        cfg = EngineConfig(**PAGED, kv_memory_limit_bytes=60_000, scheduler=scheduler, max_num_batched_tokens=20)
        _, engine = _serve(model, cfg, requests)
        counts[scheduler] = engine.stats()["preemptions"]
    assert counts["prefill_first"] > 0 and counts["mixed"] <= 2 * counts["prefill_first"]


@pytest.mark.parametrize("scheduler", ["prefill_first", "mixed"])
def test_a_pool_exactly_one_prompt_large_serves_a_one_token_request_and_the_next(model, scheduler):
    """A row that ends on its prefill's token never decodes, so it needs no block for a first decode step: a
    pool of exactly its prompt's blocks (2 layers x 4 blocks of 4 tokens, a 16-token prompt) serves it."""
    block_bytes = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7)).block_bytes
    cfg = dict(kv_memory_limit_bytes=8 * block_bytes, scheduler=scheduler, max_num_batched_tokens=8)
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, **cfg))
    assert engine.num_layers == 2 and engine.pool.usable_blocks == 8
    results = {}
    for i in range(2):
        request = GenerationRequest(f"r{i}", list(range(1, 17)), 1, ignore_eos=True)
        engine.submit(request, lambda r: results.update({r.request_id: r}))
    for _ in range(20):
        if not engine.step() and not engine.queued:
            break
    assert [len(results[f"r{i}"].output_ids) for i in range(2)] == [1, 1]
    assert engine.pool.blocks_in_use == 0


def test_stats_count_a_prompt_part_way_fed_as_running_and_its_cache_as_held(model):
    cfg = EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, scheduler="mixed", max_num_batched_tokens=8)
    engine = ContinuousBatchingEngine(model, cfg)
    engine.submit(GenerationRequest("long", list(range(1, 60)), 5, ignore_eos=True), lambda r: None)
    engine.step()
    stats = engine.stats()
    held = engine._prefilling[0].cache.kv_cache_bytes()
    assert stats["running_sequences"] == 1 and stats["peak_running_sequences"] == 1
    assert stats["kv_cache_bytes"] == held > 0 and stats["peak_kv_cache_bytes"] >= held


@pytest.mark.parametrize("policy", [{}, SH], ids=["full", "scissorhands-B16"])
def test_a_chunk_as_long_as_the_prompt_is_the_whole_prompt_prefill_bit_for_bit(model, policy):
    request = GenerationRequest("r", list(range(3, 50)), 12, ignore_eos=True, logprobs=0)
    want, _ = _serve(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, **policy), [request])
    cfg = EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, scheduler="mixed", max_num_batched_tokens=64, **policy)
    got, _ = _serve(model, cfg, [request])
    assert got["r"].output_ids == want["r"].output_ids
    assert got["r"].output_logprobs == want["r"].output_logprobs  # the same floats, not close ones


def test_each_step_spends_at_most_its_token_budget_decodes_first(model):
    """A step feeds its running rows one token each and prompt chunks of at most the rest of the budget."""
    cfg = EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, scheduler="mixed", max_num_batched_tokens=16)
    engine = ContinuousBatchingEngine(model, cfg)
    fed: list[int] = []
    prefill_chunk = engine._prefill_chunk

    def spy(p, chunk=None):
        fed.append(p.rows * chunk)
        prefill_chunk(p, chunk)

    engine._prefill_chunk = spy
    results = {}
    for r in _requests(8, seed=1):
        engine.submit(r, lambda res: results.__setitem__(res.request_id, res))
    chunked = steps = 0
    while engine.queued or engine.running:
        running, fed[:] = len(engine._running), []
        engine.step()
        steps += 1
        assert 0 < sum(fed) + running and sum(fed) <= 16 - running
        chunked += sum(fed) > 0 and running > 0
    assert all(r.error is None for r in results.values()) and len(results) == 8
    assert chunked > 0  # prompts were fed beside running rows


def test_a_running_row_decodes_every_step_while_a_long_prompt_is_fed_in_chunks(model):
    cfg = dict(**PAGED, kv_memory_limit_bytes=10**7)
    short = GenerationRequest("short", [5, 6, 7], 30, ignore_eos=True)
    long = GenerationRequest("long", list(range(1, 90)), 2, ignore_eos=True)

    def steps_while_long_prefills(scheduler: str) -> tuple[int, int]:
        engine = ContinuousBatchingEngine(model, EngineConfig(**cfg, scheduler=scheduler, max_num_batched_tokens=16))
        done = {}
        engine.submit(short, lambda r: done.__setitem__(r.request_id, r))
        engine.step()  # short runs
        engine.submit(long, lambda r: done.__setitem__(r.request_id, r))
        steps = 0
        while "long" not in done or not done["long"].output_ids:
            before = engine._running[0].result.output_ids.__len__() if engine._running else None
            engine.step()
            steps += 1
            assert engine._running and len(engine._running[0].result.output_ids) == before + 1  # short decoded
            if steps > 50:
                break
        engine.run_until_idle()
        return steps, len(done["short"].output_ids)

    assert steps_while_long_prefills("prefill_first") == (1, 30)  # the whole prompt in one step
    steps, short_tokens = steps_while_long_prefills("mixed")
    assert steps == -(-89 // 15) and short_tokens == 30  # 15 prompt tokens a step beside the short row's decode


def test_the_budget_and_the_block_pool_hold_after_every_step_with_chunked_prompts(model):
    """Scissorhands (B = 16) fed in chunks of up to 12 tokens: every row of every cache, running or part-way
    prefilled, holds at most B slots between steps, the pool never runs out, every block comes back."""
    cfg = EngineConfig(**PAGED, **SH, kv_memory_limit_bytes=40_000, scheduler="mixed", max_num_batched_tokens=12)
    seen = {"steps": 0, "partial": 0}

    def check(engine):
        caches = [engine._cache] + [p.cache for p in engine._prefilling]
        for cache in caches:
            if cache is None:
                continue
            for layer in cache.layers:
                assert int(layer.held.max()) <= 16
        seen["partial"] += any(0 < p.fed < p.length for p in engine._prefilling)
        seen["steps"] += 1
        assert engine.pool.blocks_in_use <= engine.pool.usable_blocks

    results, engine = _serve(model, cfg, _requests(12, seed=2), after_step=check)
    assert all(r.error is None for r in results.values()) and len(results) == 12
    assert seen["partial"] > 0 and engine.pool.blocks_in_use == 0


def test_aborting_a_prompt_part_way_fed_returns_its_blocks(model):
    cfg = EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, scheduler="mixed", max_num_batched_tokens=8)
    engine = ContinuousBatchingEngine(model, cfg)
    results = {}
    engine.submit(GenerationRequest("long", list(range(1, 60)), 5, ignore_eos=True), lambda r: results.update(long=r))
    engine.step()
    assert engine.running == 1 and engine.pool.blocks_in_use > 0 and engine._prefilling
    engine.abort("long")
    engine.step()
    assert results["long"].error_kind == "aborted" and engine.pool.blocks_in_use == 0 and engine.running == 0


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(scheduler="chunked"), "scheduler: expected one of prefill_first, mixed"),
        (dict(scheduler="mixed"), "scheduler: 'mixed' .* needs kv_layout: 'paged'"),
        (
            dict(**PAGED, kv_memory_limit_bytes=10**6, scheduler="mixed", max_num_batched_tokens=3),
            "max_num_batched_tokens: 3 is below one",
        ),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    ],
)
def test_scheduler_config_errors_name_the_field(kw, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kw)


def test_the_token_budget_binds_blocks_only_under_mixed():
    """prefill_first never reads max_num_batched_tokens: a block larger than its default is accepted."""
    cfg = EngineConfig(kv_layout="paged", kv_memory_limit_bytes=10**8, block_tokens=1024)
    assert cfg.scheduler == "prefill_first" and cfg.max_num_batched_tokens < cfg.block_tokens
    with pytest.raises(ConfigError, match="max_num_batched_tokens: 512 is below one block"):
        EngineConfig(kv_layout="paged", kv_memory_limit_bytes=10**8, block_tokens=1024, scheduler="mixed")


@pytest.mark.slow
def test_mixed_full_cache_gives_the_prefill_first_tokens_on_the_embedded_model():
    """Chunks of the real model's prompts attend through the masked path, not the fused causal kernel of a whole
    prompt: a claim of equal greedy tokens is checked where rounding and near-ties are real."""
    from replica.model_loading import load_replica_model
    from workloads.load.prompts import prompts_for

    torch.set_num_threads(2)
    model, tokenizer = load_replica_model("embedded", dtype="float32")
    model.generation_config.eos_token_id = None
    lengths = [300, 171, 96, 33]
    requests = [
        GenerationRequest(f"r{i}", prompts_for(tokenizer, model.config.vocab_size, 1, n, seed=i)[0], 16)
        for i, n in enumerate(lengths)
    ]
    paged = dict(kv_layout="paged", kv_memory_limit_bytes=200 * 2**20)
    want, _ = _serve(model, EngineConfig(**paged), requests)
    got, engine = _serve(model, EngineConfig(**paged, scheduler="mixed", max_num_batched_tokens=64), requests)
    assert engine.stats()["prefill_calls"] >= sum(-(-n // 64) for n in lengths) - len(lengths)  # chunked
    assert {k: r.output_ids for k, r in got.items()} == {k: r.output_ids for k, r in want.items()}


def test_per_request_budgets_hold_at_every_step_and_whole_prompts_give_the_prefill_first_tokens(model):
    """Under budget: per_request each row keeps at most its own B = ceil((prompt + max_new) / 2) between steps
    while its prompt is fed in chunks; with a token budget no prompt is cut by, mixed gives prefill-first's tokens."""
    per_request = dict(policy="scissorhands", compression_ratio=2, budget="per_request")
    per_request["policy_params"] = dict(history_window=4, count_chunk_steps=2, min_budget_tokens=0)  # no floor
    requests = _requests(8, seed=3)
    budgets = {r.request_id: -(-(len(r.prompt_ids) + r.max_new_tokens) // 2) for r in requests}
    checked = {"rows": 0}

    def check(engine):
        groups = [(engine._cache, engine._running)] + [(p.cache, p.group) for p in engine._prefilling]
        for cache, seqs in groups:
            if cache is None:
                continue
            held = cache.layers[0].held.tolist()
            assert all(h <= budgets[s.request.request_id] for h, s in zip(held, seqs))
            checked["rows"] += len(seqs)

    cfg = dict(**PAGED, **per_request, kv_memory_limit_bytes=10**7)
    got, _ = _serve(model, EngineConfig(**cfg, scheduler="mixed", max_num_batched_tokens=12), requests, check)
    assert all(r.error is None for r in got.values()) and len(got) == 8 and checked["rows"] > 0
    want, _ = _serve(model, EngineConfig(**cfg), requests)
    whole, _ = _serve(model, EngineConfig(**cfg, scheduler="mixed", max_num_batched_tokens=1024), requests)
    assert {k: r.output_ids for k, r in whole.items()} == {k: r.output_ids for k, r in want.items()}


def test_warm_up_requests_are_counted_apart_when_their_prompts_are_fed_in_chunks(model):
    cfg = EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, scheduler="mixed", max_num_batched_tokens=8)
    warm = [GenerationRequest(f"w{i}", list(range(1, 30)), 4, ignore_eos=True, warmup=True) for i in range(2)]
    measured = [GenerationRequest(f"m{i}", list(range(2, 25)), 3 + i, ignore_eos=True) for i in range(3)]
    results, engine = _serve(model, cfg, warm + measured)
    stats = engine.stats()
    assert (stats["warmup_completed_requests"], stats["warmup_generated_tokens"]) == (2, 8)
    assert (stats["completed_requests"], stats["generated_tokens"]) == (3, 3 + 4 + 5)
    assert all(r.error is None for r in results.values())


def test_max_batch_counts_prompts_part_way_fed(model):
    cfg = EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, scheduler="mixed", max_num_batched_tokens=8, max_batch=2)
    most = {"running": 0}

    def check(engine):
        assert engine.running <= 2
        most["running"] = max(most["running"], engine.running)

    results, engine = _serve(model, cfg, _requests(6, seed=4), check)
    assert all(r.error is None for r in results.values()) and len(results) == 6
    assert most["running"] == engine.stats()["peak_running_sequences"] == 2


def test_a_lone_prompt_part_way_fed_that_never_gets_a_chunk_is_rejected_not_left_waiting(model, monkeypatch):
    """The net under `fits_alone`: a prompt part-way fed that a plan gives no chunk with nothing else running (here
    a scheduler that plans nothing from its second step on) is answered as rejected and its blocks freed, so the
    engine goes idle with nothing held rather than step an empty plan forever; a later request still runs."""
    cfg = dict(**PAGED, scheduler="mixed", max_num_batched_tokens=4, kv_memory_limit_bytes=10**7)
    engine = ContinuousBatchingEngine(model, EngineConfig(**cfg))
    res = {}
    engine.submit(GenerationRequest("long", list(range(1, 30)), 3), lambda r: res.__setitem__(r.request_id, r))
    assert engine.step() and len(engine.flight.prefilling) == 1 and engine.pool.blocks_in_use > 0
    plan = engine.scheduler.plan
    monkeypatch.setattr(engine.scheduler, "plan", lambda view, kv: StepPlan())
    assert not engine.step()  # nothing to run after the refusal
    assert res["long"].error_kind == "rejected" and "gets no blocks for its next chunk" in res["long"].error
    assert not engine.flight.prefilling and engine.pool.blocks_in_use == 0
    monkeypatch.setattr(engine.scheduler, "plan", plan)
    engine.submit(GenerationRequest("next", list(range(1, 10)), 3), lambda r: res.__setitem__(r.request_id, r))
    engine.run_until_idle()
    assert res["next"].error is None and len(res["next"].output_ids) == 3
