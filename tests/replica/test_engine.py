"""The continuous-batching engine (replica.engine), without Ray, on a tiny random-weight model."""

from __future__ import annotations

import threading

import pytest
import torch

from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine, EngineLoop
from scissorhands import make_cache

SH = dict(policy="scissorhands", budget_tokens=16, policy_params=dict(history_window=20, count_chunk_steps=5))


def _requests(n: int, seed: int, prompt=(5, 40), new=(1, 25)) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        out.append(
            GenerationRequest(
                f"r{i}",
                torch.randint(0, 128, (length,), generator=g).tolist(),
                int(torch.randint(new[0], new[1] + 1, (1,), generator=g)),
            )
        )
    return out


def _alone(model, req: GenerationRequest, cfg: EngineConfig) -> list[int]:
    kwargs = dict(cfg.policy_params)
    if cfg.budget_tokens is not None:
        kwargs["budget_tokens"] = cfg.budget_tokens
    cache = make_cache(cfg.policy, model, **kwargs)
    ids = torch.tensor([req.prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=req.max_new_tokens, do_sample=False
    )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("cfg", [EngineConfig(), EngineConfig(**SH)], ids=["full", "scissorhands-B16"])
def test_requests_joining_a_running_batch_get_their_batch_of_one_tokens(model, cfg):
    engine = ContinuousBatchingEngine(model, cfg)
    reqs = _requests(8, seed=1)
    done = {}
    for r in reqs[:3]:
        engine.submit(r, lambda res: done.__setitem__(res.request_id, res))
    for _ in range(4):  # a batch is running when the others arrive
        engine.step()
    assert engine.running > 0
    for r in reqs[3:]:
        engine.submit(r, lambda res: done.__setitem__(res.request_id, res))
    engine.run_until_idle()
    assert engine.stats()["peak_running_sequences"] >= 4  # they really shared batches
    for r in reqs:
        res = done[r.request_id]
        assert res.error_kind is None and res.finish_reason == "length"
        assert res.output_ids == _alone(model, r, cfg), r.request_id
        assert len(res.token_times_s) == r.max_new_tokens
        assert res.token_times_s == sorted(res.token_times_s)
        assert res.received_time_s <= res.admitted_time_s <= res.token_times_s[0]


@pytest.mark.parametrize(
    "cfg_kw", [dict(), dict(max_length_tokens=50), SH], ids=["full", "full-preallocated", "scissorhands-B16"]
)
def test_admission_never_exceeds_the_kv_memory_limit(model, cfg_kw):
    probe = ContinuousBatchingEngine(model, EngineConfig(**cfg_kw))
    reqs = _requests(12, seed=2, prompt=(20, 30), new=(10, 20))
    # room for about three of these sequences at their final length
    limit = 3 * probe.final_slots(30, 20) * probe.slot_bytes
    engine = ContinuousBatchingEngine(model, EngineConfig(kv_memory_limit_bytes=limit, **cfg_kw))
    done = {}
    for r in reqs:
        engine.submit(r, lambda res: done.__setitem__(res.request_id, res))
    steps = 0
    while engine.step():
        steps += 1
        held = engine._cache.kv_cache_bytes() if engine._cache is not None else 0
        assert held <= limit
    stats = engine.stats()
    assert len(done) == 12 and all(r.error_kind is None for r in done.values())
    assert stats["peak_kv_cache_bytes"] <= limit  # prefill caches included
    assert 2 <= stats["peak_running_sequences"] < 12  # requests queued behind the limit
    # waiting requests were admitted later than received
    assert max(r.admitted_time_s - r.received_time_s for r in done.values()) > 0


def test_budget_admits_about_ratio_times_more_sequences(model):
    full = ContinuousBatchingEngine(model, EngineConfig(kv_memory_limit_bytes=400_000))
    sh = ContinuousBatchingEngine(
        model,
        EngineConfig(policy="scissorhands", compression_ratio=5, max_length_tokens=300, kv_memory_limit_bytes=400_000),
    )
    b_full, b_sh = full.max_batch_for(256, 44), sh.max_batch_for(256, 44)
    assert b_full == 400_000 // (299 * full.slot_bytes)
    assert b_sh >= 4 * b_full


def test_a_request_too_large_for_the_limit_is_rejected_not_queued_forever(model):
    engine = ContinuousBatchingEngine(model, EngineConfig(kv_memory_limit_bytes=10_000))
    done = []
    engine.submit(GenerationRequest("big", list(range(60)), 10), done.append)
    engine.submit(GenerationRequest("small", list(range(4)), 2), done.append)
    engine.run_until_idle()
    assert [(r.request_id, r.error_kind) for r in done] == [("big", "rejected"), ("small", None)]
    assert "KV memory limit" in done[0].error


def test_engine_loop_serves_requests_from_other_threads(model):
    engine = ContinuousBatchingEngine(model, EngineConfig(max_batch=3))
    loop = EngineLoop(engine).start()
    try:
        results, events = {}, {}
        for r in _requests(6, seed=3, new=(2, 6)):
            events[r.request_id] = threading.Event()

            def cb(res, ev=events[r.request_id]):
                results[res.request_id] = res
                ev.set()

            engine.submit(r, cb)
        assert all(ev.wait(60) for ev in events.values())
        assert engine.stats()["peak_running_sequences"] <= 3
        assert all(len(r.output_ids) >= 2 for r in results.values())
    finally:
        loop.stop()
    assert not loop.alive and loop.error is None


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(policy="nope"), "policy"),
        (dict(policy="scissorhands"), "budget_tokens, compression_ratio"),
        (dict(policy="scissorhands", compression_ratio=5), "max_length_tokens"),
        (dict(kv_memory_limit_bytes=0), "kv_memory_limit_bytes"),
        (dict(kv_memory_fraction=1.5), "kv_memory_fraction"),
        (dict(compression_ratio=0.5), "compression_ratio"),
        (dict(max_batch=True), "max_batch"),
        (dict(kv_memory_limit_bytes=10, kv_memory_fraction=0.5), "kv_memory_limit_bytes, kv_memory_fraction: give one"),
        (dict(max_prefill_tokens=None), "max_prefill_tokens: expected an integer >= 1, got None"),
        (dict(batch=2), r"batch: unknown key \(accepted: policy, "),
    ],
)
def test_engine_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field.replace(",", ",")):
        EngineConfig(**kw)


def test_engine_feeds_the_live_replica_metrics(model):
    from replica.metrics import ReplicaMetrics

    rm = ReplicaMetrics("scissorhands", None, "r0", "tiny-llama", "run", use_ray=False)
    engine = ContinuousBatchingEngine(model, EngineConfig(policy="scissorhands", budget_tokens=16), metrics=rm)
    for i in range(3):
        engine.submit(GenerationRequest(f"r{i}", list(range(1, 30)), 5), lambda r: None)
    engine.run_until_idle()
    snap = rm.snapshot()
    assert snap["scissorhands_generated_tokens_total"] == 15  # 3 requests x 5 ids
    assert snap["scissorhands_prefill_tokens_total"] == 3 * 29
    # layer 0: each prompt compressed to B (29 - 16), then one decode eviction of m = B // 2 = 8 per row
    assert snap["scissorhands_evicted_tokens_total"] == 3 * (29 - 16) + 3 * 8
    assert snap["scissorhands_ttft_seconds"][0] == 3 and snap["scissorhands_tpot_seconds"][0] == 3
    assert list(snap["scissorhands_decode_batch_size"]) == [4, 12.0]  # 4 steps of 3 sequences
    assert snap["scissorhands_running_sequences"] == 0


def test_the_live_recorder_overrides_the_null_recorder_method_for_method():
    """The engine calls its recorder's methods directly; with live metrics off it gets `NullMetrics`, the
    base class of `ReplicaMetrics`: every public method the live class defines overrides a no-op of the base
    with the same parameters (a live metric without its no-op would fail an engine without metrics)."""
    import inspect

    from replica.metrics import NullMetrics, ReplicaMetrics

    assert issubclass(ReplicaMetrics, NullMetrics)
    live = {n for n, f in vars(ReplicaMetrics).items() if inspect.isfunction(f) and not n.startswith("_")}
    null = {n for n, f in vars(NullMetrics).items() if inspect.isfunction(f) and not n.startswith("_")}
    assert live == null
    for name in live:
        assert (
            inspect.signature(getattr(NullMetrics, name)).parameters.keys()
            == inspect.signature(getattr(ReplicaMetrics, name)).parameters.keys()
        ), name
    recorder = NullMetrics()
    assert recorder.for_point("scissorhands", 5) is recorder and recorder.snapshot() == {}
    for name in null - {"for_point", "snapshot"}:  # every no-op returns None, whatever it is given
        params = [p for p in inspect.signature(getattr(NullMetrics, name)).parameters.values() if p.name != "self"]
        assert getattr(recorder, name)(*[1] * sum(p.default is p.empty for p in params)) is None, name
    child = ReplicaMetrics("full", None, "replica-0", "embedded", "run", use_ray=False).for_point("h2o", 5)
    assert type(child) is ReplicaMetrics and child.tags["policy"] == "h2o"


def test_an_engine_without_metrics_records_nothing_and_serves(model):
    from replica.metrics import NullMetrics

    engine = ContinuousBatchingEngine(model, EngineConfig(**SH))
    assert type(engine.metrics) is NullMetrics
    done = []
    engine.submit(GenerationRequest("r0", list(range(1, 30)), 5), done.append)
    engine.run_until_idle()
    assert [r.output_tokens for r in done] == [5] and engine.generated_tokens == 5


def test_a_failing_recorder_never_stops_the_engine(model):
    """Recorder errors are dropped (metrics never stop serving): the results and stats are unchanged."""

    class Failing:
        def __getattr__(self, name):
            def fail(*args, **kwargs):
                raise RuntimeError(f"recorder {name} is down")

            return fail

    cfg = EngineConfig(**SH)
    reqs = [GenerationRequest(f"r{i}", list(range(1 + i, 30)), 5) for i in range(3)]
    runs = []
    for metrics in (None, Failing()):
        engine = ContinuousBatchingEngine(model, cfg, metrics=metrics)
        done = {}
        for r in reqs:
            engine.submit(r, lambda res: done.__setitem__(res.request_id, res))
        engine.run_until_idle()
        runs.append(({k: (v.output_ids, v.error_kind) for k, v in done.items()}, engine.stats()["generated_tokens"]))
    assert runs[0] == runs[1] and runs[1][1] == 15


def test_stopping_the_loop_answers_the_requests_it_still_holds(model):
    engine = ContinuousBatchingEngine(model, EngineConfig(max_batch=1))
    done = []
    for i in range(3):
        engine.submit(GenerationRequest(f"r{i}", [1, 2, 3], 50), done.append)
    engine.step()  # r0 running, r1 and r2 queued
    loop = EngineLoop(engine)
    loop.stop()  # never started: nothing to join
    assert sorted((r.request_id, r.error_kind) for r in done) == [("r0", "error"), ("r1", "error"), ("r2", "error")]
    assert "stopped" in done[0].error and engine.running == 0 and engine.queued == 0


def test_a_step_prefills_at_most_max_prefill_tokens_and_a_longer_prompt_alone(model):
    assert EngineConfig().max_prefill_tokens == 4096
    engine = ContinuousBatchingEngine(model, EngineConfig(max_prefill_tokens=64))
    done = {}
    prompts = [[1 + i] * 30 for i in range(5)] + [[7] * 100]
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(f"r{i}", p, 50), lambda res: done.__setitem__(res.request_id, res))
    admitted = []
    for _ in range(4):
        before = engine.queued
        engine.step()
        admitted.append(before - engine.queued)
    # 30 + 30 <= 64 < 30 + 30 + 30; the 100-token prompt waits for a step of its own
    assert admitted == [2, 2, 1, 1] and engine.running == 6


# ---------------------------------------------------------------- sampling, streaming callbacks, aborts
def _run_one(model, req: GenerationRequest, eos_token_id=None, neighbours=()) -> object:
    engine = ContinuousBatchingEngine(model, EngineConfig(), eos_token_id=eos_token_id)
    done = {}
    for r in (req, *neighbours):
        engine.submit(r, lambda res: done.__setitem__(res.request_id, res))
    engine.run_until_idle()
    return done[req.request_id]


def test_sampling_with_a_seed_repeats_and_does_not_depend_on_batch_neighbours(model):
    prompt = list(range(3, 15))
    req = lambda rid, seed: GenerationRequest(rid, prompt, 12, temperature=1.5, seed=seed)  # noqa: E731
    a = _run_one(model, req("a", 7)).output_ids
    b = _run_one(model, req("a", 7), neighbours=[req("n1", 1), GenerationRequest("n2", prompt[:5], 8)]).output_ids
    c = _run_one(model, req("a", 8)).output_ids
    greedy = _run_one(model, GenerationRequest("g", prompt, 12)).output_ids
    assert a == b and len(a) == 12
    assert a != c  # another seed draws other tokens (tiny model: flat logits)
    assert a != greedy


def test_top_p_that_keeps_one_token_is_greedy(model):
    prompt = list(range(20, 40))
    greedy = _run_one(model, GenerationRequest("g", prompt, 10)).output_ids
    nucleus = _run_one(model, GenerationRequest("s", prompt, 10, temperature=1.0, top_p=1e-6, seed=3)).output_ids
    assert nucleus == greedy


def test_min_new_tokens_masks_eos_until_reached(model):
    prompt = list(range(5, 17))
    greedy = _run_one(model, GenerationRequest("g", prompt, 6)).output_ids
    eos = greedy[1]  # pretend the 2nd greedy token is EOS: it stops there ...
    stopped = _run_one(model, GenerationRequest("e", prompt, 6, ignore_eos=False), eos_token_id=eos)
    assert stopped.output_ids == greedy[:2] and stopped.finish_reason == "eos"
    held = _run_one(model, GenerationRequest("m", prompt, 6, ignore_eos=False, min_new_tokens=4), eos_token_id=eos)
    assert eos not in held.output_ids[:4] and held.output_ids[0] == greedy[0]  # ... unless min_new_tokens says not yet


def test_on_token_streams_each_token_before_on_done(model):
    engine = ContinuousBatchingEngine(model, EngineConfig(**SH))
    events = []
    engine.submit(
        GenerationRequest("r", list(range(30)), 5),
        lambda res: events.append(("done", res.output_ids)),
        on_token=lambda tok, t: events.append(("tok", tok)),
    )
    engine.step()
    assert [e[0] for e in events] == ["tok", "tok"]  # prefill's token and one decode token, not held back
    engine.run_until_idle()
    toks = [e[1] for e in events if e[0] == "tok"]
    assert events[-1] == ("done", toks) and len(toks) == 5


@pytest.mark.parametrize("cfg", [EngineConfig(), EngineConfig(**SH)], ids=["full", "scissorhands-B16"])
def test_abort_frees_the_row_at_the_next_step_and_others_go_on(model, cfg):
    engine = ContinuousBatchingEngine(model, cfg)
    done = {}
    reqs = [GenerationRequest(f"r{i}", list(range(10 + i, 30 + i)), 12) for i in range(3)]
    for r in reqs[:2]:
        engine.submit(r, lambda res: done.__setitem__(res.request_id, res))
    engine.step()
    before = engine.stats()["kv_cache_bytes"]
    rows_before = engine.running
    engine.submit(reqs[2], lambda res: done.__setitem__(res.request_id, res))
    engine.step()
    engine.step()
    assert engine.running == rows_before + 1
    engine.abort("r2")
    engine.abort("queued-never")  # an unknown id is ignored
    engine.step()
    assert engine.running == rows_before
    assert done["r2"].error_kind == "aborted" and 0 < len(done["r2"].output_ids) < 12
    if cfg.policy != "full":  # budgeted rows hold B slots: bytes back exactly
        assert engine.stats()["kv_cache_bytes"] == before
    engine.run_until_idle()
    alone = _run_one(model, GenerationRequest("x", reqs[0].prompt_ids, 12))
    if cfg.policy == "full":
        assert done["r0"].output_ids == alone.output_ids
    assert done["r0"].error_kind is None and len(done["r1"].output_ids) == 12


def test_abort_of_a_queued_request(model):
    engine = ContinuousBatchingEngine(model, EngineConfig())
    done = {}
    engine.submit(GenerationRequest("q", [1, 2, 3], 4), lambda res: done.__setitem__(res.request_id, res))
    engine.abort("q")
    assert engine.step() is False
    assert done["q"].error_kind == "aborted" and done["q"].output_ids == [] and engine.queued == 0


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(seed="x"), "seed"),
        (dict(min_new_tokens=-1), "min_new_tokens"),
    ],
)
def test_sampling_fields_are_validated(kw, field):
    with pytest.raises(ValueError, match=field):
        GenerationRequest("r", [1], 2, **kw)


def test_engine_counts_warm_up_requests_apart(model):
    """On the server side: the measured counters and live series cover measured requests only."""
    from replica.metrics import ReplicaMetrics

    rm = ReplicaMetrics("full", None, "r0", "tiny-llama", "run", use_ray=False)
    engine = ContinuousBatchingEngine(model, EngineConfig(policy="full"), metrics=rm)
    for i in range(3):
        engine.submit(GenerationRequest(f"w{i}", list(range(1, 9)), 3, warmup=True), lambda r: None)
    for i in range(4):
        engine.submit(GenerationRequest(f"m{i}", list(range(1, 9)), 5), lambda r: None)
    engine.run_until_idle()
    s = engine.stats()
    assert (s["received_requests"], s["completed_requests"], s["generated_tokens"]) == (4, 4, 20)
    assert (s["warmup_received_requests"], s["warmup_completed_requests"], s["warmup_generated_tokens"]) == (3, 3, 9)
    assert engine.generated_tokens == 20  # the public read: measured tokens only
    assert rm.snapshot()["scissorhands_generated_tokens_total"] == 20
    assert rm.snapshot()["scissorhands_prefill_tokens_total"] == 4 * 8
    assert rm.snapshot()["scissorhands_ttft_seconds"][0] == 4
    assert rm.snapshot("warmup")["scissorhands_generated_tokens_total"] == 9


@pytest.mark.parametrize("full_batch, prompt, new", [(1, 8, 1), (3, 20, 12), (4, 64, 64)])
def test_full_batch_kv_limit_holds_exactly_that_many_full_cache_sequences(model, full_batch, prompt, new):
    """One KV-limit formula for bench-serving and gpu-check (bytes): a full-cache engine fits `full_batch`
    sequences under it, and one fewer a byte below it."""
    from replica.engine import full_batch_kv_limit_bytes
    from scissorhands.batching import sequence_slot_bytes

    limit = full_batch_kv_limit_bytes(model, full_batch, prompt, new)
    # tiny-llama, float32: 2 layers x 2 KV heads x (K + V: 2 x head_dim 16 x 4 bytes + an int16 slot time)
    assert sequence_slot_bytes(model, "full", max_length=prompt + new) == 2 * 2 * (2 * 16 * 4 + 2) == 520
    assert limit == full_batch * (prompt + new) * 520
    cfg = dict(policy="full", max_length_tokens=prompt + new)
    assert (
        ContinuousBatchingEngine(model, EngineConfig(kv_memory_limit_bytes=limit, **cfg)).max_batch_for(prompt, new)
        == full_batch
    )
    assert (
        ContinuousBatchingEngine(model, EngineConfig(kv_memory_limit_bytes=limit - 1, **cfg)).max_batch_for(prompt, new)
        == full_batch - 1
    )


@pytest.mark.parametrize("field", ["full_batch", "prompt_tokens", "new_tokens"])
def test_full_batch_kv_limit_names_a_bad_argument(model, field):
    from replica.engine import full_batch_kv_limit_bytes

    kw = {**dict(full_batch=2, prompt_tokens=8, new_tokens=4), field: 0}
    with pytest.raises(ValueError, match=f"{field}: expected an integer >= 1, got 0"):
        full_batch_kv_limit_bytes(model, **kw)


def test_shutting_a_serving_replica_down_answers_the_requests_it_holds(model):
    """ServingReplica.shutdown (a reconfigure, a stop): the running and the queued request both get an error."""
    import asyncio

    from replica.continuous import ServingReplica

    replica = ServingReplica(model=model, model_spec="tiny-llama", engine_config={"policy": "full", "max_batch": 1})

    async def serve_then_stop():
        tasks = [asyncio.create_task(replica.generate(GenerationRequest(f"r{i}", [1, 2, 3], 500))) for i in range(2)]
        while replica.engine.running == 0:  # r0 running, r1 queued behind max_batch 1
            await asyncio.sleep(0.01)
        await asyncio.to_thread(replica.shutdown)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    results = asyncio.run(serve_then_stop())
    assert [(r.request_id, r.error_kind) for r in results] == [("r0", "error"), ("r1", "error")]
    assert all("stopped" in r.error for r in results) and len(results[0].output_ids) < 500


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_pick_is_argmax_with_the_first_of_tied_maxima(dtype):
    from types import SimpleNamespace

    from replica.sampling import pick_tokens

    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.5, -1.0, 0.25, 0.5], [-2.0, -3.0, -1.0, -1.5]], dtype=dtype)
    seqs = [SimpleNamespace(request=GenerationRequest(f"r{i}", [1], 4)) for i in range(3)]
    picked = pick_tokens(logits, seqs, eos_token_id=None)
    assert picked.shape == (3, 1) and picked.dtype == torch.long
    assert picked[:, 0].tolist() == [1, 0, 2] == logits.argmax(-1).tolist()
    wide = torch.randn(5, 49152).to(dtype)
    assert torch.equal(pick_tokens(wide, seqs[:1] * 5, None)[:, 0], wide.argmax(-1))


# ---------------------------------------------------------------- one row's sampling failure, log-probabilities
def test_a_temperature_too_small_to_divide_by_is_greedy_and_its_neighbours_go_on(model):
    prompt = list(range(3, 15))
    greedy = _run_one(model, GenerationRequest("g", prompt, 8)).output_ids
    tiny = GenerationRequest("t", prompt, 8, temperature=5e-324)
    neighbours = [GenerationRequest(f"n{i}", prompt, 8, temperature=1.0, seed=i) for i in range(2)]
    res = _run_one(model, tiny, neighbours=neighbours)
    assert tiny.greedy and res.error_kind is None and res.output_ids == greedy


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=99), "prompt_logprobs"),
    ],
)
def test_values_no_sampler_can_use_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        GenerationRequest("r", [1], 2, **kw)


def test_64_bit_seeds_sample_repeatably_beside_neighbours_and_zero_new_tokens_only_when_scoring_the_prompt(model):
    """A seed above 2**63 (unsigned 64-bit) is sampled with, repeatably, next to other sampled rows."""
    prompt = list(range(3, 15))
    for seed in (2**63, 2**63 + 7, 2**64 - 1, -(2**63)):
        runs = [
            _run_one(
                model,
                GenerationRequest("r", prompt, 8, temperature=1.0, seed=seed),
                neighbours=[GenerationRequest(f"n{i}", prompt, 8, temperature=1.0, seed=i) for i in range(2)],
            )
            for _ in range(2)
        ]
        assert all(r.error_kind is None and len(r.output_ids) == 8 for r in runs)
        assert runs[0].output_ids == runs[1].output_ids
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationRequest("r", [1], 0)
    assert GenerationRequest("r", [1, 2], 0, prompt_logprobs=0).max_new_tokens == 0


@pytest.mark.parametrize("cfg", [EngineConfig(), EngineConfig(**SH)], ids=["full", "scissorhands-B16"])
def test_a_row_whose_sampling_fails_fails_alone_at_prefill_and_at_decode(model, cfg):
    """Three prompts prefilled in one step; one row's sampler fails (a seed torch refuses, set past the
    request's checks) at prefill, another at a later decode step: each fails alone, the others' tokens are
    their batch-of-one tokens."""
    prompt = list(range(30, 50))
    engine = ContinuousBatchingEngine(model, cfg)
    done = {}
    reqs = [GenerationRequest(f"r{i}", prompt, 10, temperature=1.0, seed=i) for i in range(4)]
    reqs[1].seed = 2**70  # torch.Generator.manual_seed raises for it
    for r in reqs:
        engine.submit(r, lambda res: done.__setitem__(res.request_id, res))
    engine.step()  # prefill (one group: equal prompts) and one decode step
    assert done["r1"].error_kind == "error" and "sampling failed" in done["r1"].error and done["r1"].output_ids == []
    assert engine.running == 3
    row = next(s for s in engine._running if s.request.request_id == "r2")
    row.generator, row.request.seed = None, 2**70  # its next draw fails
    engine.run_until_idle()
    assert done["r2"].error_kind == "error" and "sampling failed" in done["r2"].error
    assert 0 < len(done["r2"].output_ids) < 10
    for rid in ("r0", "r3"):
        alone = _run_one(model, GenerationRequest("x", prompt, 10, temperature=1.0, seed=int(rid[1])))
        if cfg.policy == "full":
            assert done[rid].output_ids == alone.output_ids
        assert done[rid].error_kind is None and len(done[rid].output_ids) == 10
    assert engine.stats()["failed_requests"] == 2 and engine.stats()["completed_requests"] == 2


def test_logprobs_of_generated_tokens_are_the_model_distribution_and_top_k(model):
    prompt = list(range(5, 25))
    res = _run_one(model, GenerationRequest("l", prompt, 4, logprobs=3))
    assert res.output_ids == _run_one(model, GenerationRequest("g", prompt, 4)).output_ids
    with torch.inference_mode():
        ids = torch.tensor([prompt + res.output_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # (n, vocab)
    for i, tok in enumerate(res.output_ids):
        row = logp[len(prompt) - 1 + i]
        assert res.output_logprobs[i] == pytest.approx(float(row[tok]), abs=1e-4)
        top = res.output_top_logprobs[i]
        assert [t for t, _ in top] == row.topk(3).indices.tolist() and top[0][0] == tok  # greedy: the best


@pytest.mark.parametrize("cfg", [EngineConfig(), EngineConfig(**SH)], ids=["full", "scissorhands-B16"])
def test_prompt_logprobs_with_no_new_tokens_score_the_prompt_as_decoding_would(model, cfg):
    """A score-only request (max_new_tokens 0): each prompt token's log-probability equals feeding the
    prompt one token per call into the engine's cache (evictions included), within float32 noise."""
    prompt = list(range(2, 42))
    res = _run_one_cfg(model, cfg, GenerationRequest("p", prompt, 0, prompt_logprobs=2))
    assert res.error_kind is None and res.output_ids == [] and res.finish_reason == "length"
    engine = ContinuousBatchingEngine(model, cfg)
    cache = engine._new_cache()
    want = []
    with torch.inference_mode():
        for i, tok in enumerate(prompt[:-1]):
            logits = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1].float()
            want.append(float(torch.log_softmax(logits, -1)[prompt[i + 1]]))
    assert res.prompt_logprobs[0] is None and res.prompt_top_logprobs[0] is None
    assert res.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(len(t) == 2 for t in res.prompt_top_logprobs[1:])


def _run_one_cfg(model, cfg, req):
    engine = ContinuousBatchingEngine(model, cfg)
    done = {}
    engine.submit(req, lambda res: done.__setitem__(res.request_id, res))
    engine.run_until_idle()
    return done[req.request_id]


@pytest.mark.parametrize(
    "policy, kw",
    [
        ("full", {}),
        ("scissorhands", dict(budget_tokens=16, history_window=20, count_chunk_steps=5)),
        ("h2o", dict(budget_tokens=12)),
        ("knorm", dict(budget_tokens=12)),  # outside the merged schedule: one token per call
        ("scissorhands", dict(budget_tokens=16, kv_bits=4, kv_group_size=16)),  # quantized: one token per call
    ],
)
def test_prompt_scoring_calls_are_the_quality_runners(model, policy, kw):
    """The engine scores an echoed prompt with the quality runner's calls (replica may not import workloads)."""
    from replica.sampling import prompt_call_lengths
    from workloads.quality import chunks

    for n in (1, 12, 16, 17, 40):
        cache = make_cache(policy, model, **kw)
        assert prompt_call_lengths(cache, n) == chunks.evaluation_call_lengths(cache, n), n
