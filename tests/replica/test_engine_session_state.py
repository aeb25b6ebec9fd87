"""A session's KV cache carried to its next request (`EngineConfig.kv_reuse: session_state`,
`replica.engine.session_state`, after Sparse-vLLM's "chain" mode): the full cache gives the same greedy tokens as
prefilling every turn from text under both schedulers and under memory pressure; a turn that extends the previous
one's prompt + output prefills only the new tokens; a reclaimed state or a prompt that does not extend it is
recomputed from text and counted; a request is never started from another session's state; a budgeted policy's
counts are pinned and its tokens deterministic."""

from __future__ import annotations

import pytest
import torch

from replica.common.types import ConfigError, EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine
from replica.engine.session_state import SessionStatePool, common_prefix_tokens
from scissorhands.paged import PoolExhausted

PAGED = dict(kv_layout="paged", block_tokens=4)
ON = dict(kv_reuse="session_state")
SH = dict(policy="scissorhands", budget_tokens=16, policy_params=dict(history_window=20, count_chunk_steps=5))

SCHEDULERS = [
    pytest.param(dict(scheduler="prefill_first"), id="prefill_first"),
    pytest.param(dict(scheduler="mixed", max_num_batched_tokens=8), id="mixed-chunks-of-8"),
]


def _tokens(g: torch.Generator, lo: int, hi: int) -> list[int]:
    return torch.randint(0, 128, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()


def _converse(engine, sessions: int = 3, turns: int = 4, seed: int = 0, system_tokens: int = 9, edit=None):
    """`sessions` conversations of `turns` turns run turn by turn (every session's turn t together, then turn t + 1):
    each turn's prompt is the previous turn's prompt + its output + a new user message of 2-9 tokens, every session
    starting with one system prompt. `edit(session, turn, prompt)` may change a prompt. Results per (session, turn)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 128, (system_tokens,), generator=g).tolist()
    history = {s: list(system) for s in range(sessions)}
    results = {}
    for t in range(turns):
        for s in range(sessions):
            prompt = history[s] + _tokens(g, 2, 10)
            if edit is not None:
                prompt = edit(s, t, prompt)
            new = int(torch.randint(2, 8, (1,), generator=g))
            req = GenerationRequest(f"s{s}-t{t}", prompt, new, session_id=f"session-{s}")
            engine.submit(req, lambda res, k=(s, t), p=prompt: results.__setitem__(k, _with_prompt(res, p)))
        engine.run_until_idle()
        for s in range(sessions):
            r = results[(s, t)]
            assert r.error is None, r.error
            history[s] = r.prompt_ids_seen + r.output_ids
    return results


def _with_prompt(res, prompt: list[int]):
    """`res` remembering its request's prompt (the next turn starts with it and the output)."""
    res.prompt_ids_seen = list(prompt)
    return res


def _outputs(results) -> dict:
    return {k: r.output_ids for k, r in results.items()}


@pytest.mark.parametrize("sched", SCHEDULERS)
@pytest.mark.parametrize("limit", [10**7, 30_000], ids=["roomy", "tight"])
def test_the_full_cache_from_session_state_gives_the_tokens_of_a_prefill_from_text(model, sched, limit):
    cfg = dict(**PAGED, **sched, kv_memory_limit_bytes=limit)
    want = _converse(ContinuousBatchingEngine(model, EngineConfig(**cfg)))
    engine = ContinuousBatchingEngine(model, EngineConfig(**cfg, **ON))
    got = _converse(engine)
    assert _outputs(got) == _outputs(want)
    stats = engine.stats()
    assert engine.pool.blocks_in_use == 0 and stats["running_sequences"] == 0  # kept states count as free
    assert 1 <= stats["session_states"] <= 3 and stats["session_state_blocks"] > 0
    for (s, t), r in got.items():
        prev = got.get((s, t - 1))
        if prev is None:
            assert r.session_reused_tokens == r.session_recomputed_tokens == 0
            continue
        fed = len(prev.prompt_ids_seen) + len(prev.output_ids) - 1  # the previous turn's cache: all but its last
        # reused or recomputed, never both, never another count
        assert (r.session_reused_tokens, r.session_recomputed_tokens) in ((fed, 0), (0, fed))
        assert r.cached_prompt_tokens == r.session_reused_tokens
        assert r.prefilled_prompt_tokens >= r.prompt_tokens - r.session_reused_tokens
    reused = sum(r.session_reused_tokens for r in got.values())
    recomputed = sum(r.session_recomputed_tokens for r in got.values())
    assert stats["session_reused_tokens"] == reused and stats["session_recomputed_tokens"] == recomputed
    if limit == 10**7:  # room for every state: every later turn starts from its session's
        assert recomputed == 0 and stats["session_state_hits"] == 9 and stats["session_states_reclaimed"] == 0
        assert stats["session_states"] == 3
    else:  # the tight pool reclaims kept states for running rows: those turns recompute
        assert stats["session_states_reclaimed"] > 0 and recomputed > 0


def test_a_turn_prefills_only_the_tokens_past_its_sessions_state(model):
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, **ON))
    got = _converse(engine, sessions=1, turns=3)
    for t in (1, 2):
        prev, r = got[(0, t - 1)], got[(0, t)]
        fed = len(prev.prompt_ids_seen) + len(prev.output_ids) - 1
        assert r.session_reused_tokens == fed
        assert r.prefilled_prompt_tokens == r.prompt_tokens - fed  # its last output token and the new message


def test_a_prompt_that_does_not_extend_the_state_is_recomputed_and_counted(model):
    def rewrite_turn_2(s, t, prompt):
        return [prompt[0], (prompt[1] + 1) % 128, *prompt[2:]] if t == 2 else prompt  # its second token changed

    want = _converse(
        ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7)), edit=rewrite_turn_2
    )
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, **ON))
    got = _converse(engine, edit=rewrite_turn_2)
    assert _outputs(got) == _outputs(want)
    for s in range(3):
        assert got[(s, 2)].session_reused_tokens == 0
        assert got[(s, 2)].session_recomputed_tokens == 1  # only its first token equals the state's
        assert got[(s, 2)].prefilled_prompt_tokens == got[(s, 2)].prompt_tokens
        assert got[(s, 3)].session_reused_tokens > 0  # turn 2's own state serves turn 3
    assert engine.stats()["session_state_misses"] == 3


def test_a_request_never_starts_from_another_sessions_state(model):
    """Two sessions with equal first turns and different second turns: each third turn extends its own session's
    history only, so it must be served from its own state (a state of the other session would give other tokens)."""
    cfg = dict(**PAGED, kv_memory_limit_bytes=10**7)
    first = list(range(20, 40))
    engines = {k: ContinuousBatchingEngine(model, EngineConfig(**cfg, **kw)) for k, kw in (("off", {}), ("on", ON))}
    out = {}
    for name, engine in engines.items():
        res = {}
        hist = {}
        for s in ("a", "b"):  # equal first turns
            engine.submit(GenerationRequest(f"{s}0", first, 4, session_id=s), lambda r, s=s: res.__setitem__(s, r))
        engine.run_until_idle()
        assert res["a"].output_ids == res["b"].output_ids  # equal prefixes: equal states
        for s, own in (("a", [1, 2, 3]), ("b", [7, 7, 7, 7, 7])):  # different histories
            hist[s] = first + res[s].output_ids + own
            engine.submit(GenerationRequest(f"{s}1", hist[s], 4, session_id=s), lambda r, s=s: res.__setitem__(s, r))
            engine.run_until_idle()
            hist[s] = hist[s] + res[s].output_ids
        for s in ("a", "b"):
            engine.submit(
                GenerationRequest(f"{s}2", hist[s] + [5], 6, session_id=s), lambda r, s=s: res.__setitem__(s, r)
            )
        engine.run_until_idle()
        out[name] = {s: (res[s].output_ids, res[s].session_reused_tokens) for s in ("a", "b")}
    assert {s: o for s, (o, _) in out["on"].items()} == {s: o for s, (o, _) in out["off"].items()}
    assert out["on"]["a"][1] == len(hist["a"]) - 1 and out["on"]["b"][1] == len(hist["b"]) - 1
    # a request without the session id, or of another session, with the same prompt takes nothing
    engine = engines["on"]
    res = {}
    engine.submit(GenerationRequest("c", hist["a"] + [5], 2, session_id="c"), lambda r: res.__setitem__("c", r))
    engine.submit(GenerationRequest("x", hist["a"] + [5], 2), lambda r: res.__setitem__("x", r))
    engine.run_until_idle()
    assert res["c"].session_reused_tokens == 0 == res["x"].session_reused_tokens
    assert res["c"].cached_prompt_tokens == 0 == res["x"].cached_prompt_tokens


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_scissorhands_from_session_state_is_deterministic_and_counts_its_reuse(model, sched):
    cfg = EngineConfig(**PAGED, **SH, **sched, kv_memory_limit_bytes=10**7, **ON)
    runs = [_converse(ContinuousBatchingEngine(model, cfg), system_tokens=30) for _ in range(2)]
    assert _outputs(runs[0]) == _outputs(runs[1])
    got = runs[0]
    for (s, t), r in got.items():
        assert r.session_recomputed_tokens == 0
        if t:
            prev = got[(s, t - 1)]
            fed = len(prev.prompt_ids_seen) + len(prev.output_ids) - 1
            assert r.session_reused_tokens == fed == r.cached_prompt_tokens
            assert r.prefilled_prompt_tokens == r.prompt_tokens - fed
    # the compressed state is not the prefill from text: later turns attend to what the previous turn kept
    text = _converse(
        ContinuousBatchingEngine(model, EngineConfig(**PAGED, **SH, **sched, kv_memory_limit_bytes=10**7)),
        system_tokens=30,
    )
    assert _outputs(text) != _outputs(got)
    assert {k: v for k, v in _outputs(text).items() if k[1] == 0} == {
        k: v for k, v in _outputs(got).items() if k[1] == 0
    }


def test_scissorhands_under_a_tight_pool_recomputes_reclaimed_states_deterministically(model):
    cfg = EngineConfig(**PAGED, **SH, kv_memory_limit_bytes=36_000, **ON)  # 33 blocks: some states kept, some reclaimed
    runs = []
    for _ in range(2):
        engine = ContinuousBatchingEngine(model, cfg)
        runs.append((_converse(engine, system_tokens=30), engine.stats()))
    (got, stats), (again, _) = runs
    assert _outputs(got) == _outputs(again)
    assert [(r.session_reused_tokens, r.session_recomputed_tokens) for r in got.values()] == [
        (r.session_reused_tokens, r.session_recomputed_tokens) for r in again.values()
    ]
    for (s, t), r in got.items():
        if t:
            prev = got[(s, t - 1)]
            fed = len(prev.prompt_ids_seen) + len(prev.output_ids) - 1
            assert (r.session_reused_tokens, r.session_recomputed_tokens) in ((fed, 0), (0, fed))
    assert stats["session_states_reclaimed"] > 0 and stats["session_recomputed_tokens"] > 0
    assert stats["session_state_hits"] > 0  # the pool still holds some states


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_rows_started_from_session_state_and_preempted_give_the_tokens_of_a_prefill_from_text(model, sched):
    """Three sessions' second turns, started from their states, decode 24 tokens in a pool too small for all three:
    rows are preempted and recomputed from text (the reclaimed states beside them), the tokens unchanged."""

    def run(kw):
        engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, **sched, kv_memory_limit_bytes=50_000, **kw))
        res = {}
        first = list(range(5, 25))
        for s in range(3):
            engine.submit(
                GenerationRequest(f"a{s}", first + [s], 3, session_id=f"s{s}"),
                lambda r: res.__setitem__(r.request_id, r),
            )
        engine.run_until_idle()
        for s in range(3):
            prompt = first + [s] + res[f"a{s}"].output_ids + [7, s]
            engine.submit(
                GenerationRequest(f"b{s}", prompt, 24, session_id=f"s{s}"), lambda r: res.__setitem__(r.request_id, r)
            )
        engine.run_until_idle()
        return res, engine.stats()

    (got, stats), (want, _) = run(ON), run({})
    assert all(r.error is None for r in got.values())
    assert _outputs(got) == _outputs(want)
    assert stats["preemptions"] > 0 and stats["session_state_hits"] == 3
    assert [got[f"b{s}"].session_reused_tokens for s in range(3)] == [23] * 3  # 21 + 3 - 1 each


def test_a_kept_state_holds_its_blocks_until_reclaimed_least_recently_kept_first(model):
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, **ON))
    res = {}
    for s in ("a", "b"):
        engine.submit(
            GenerationRequest(s, list(range(1, 30)), 3, session_id=s), lambda r: res.__setitem__(r.request_id, r)
        )
        engine.run_until_idle()
    pool = engine.pool
    assert isinstance(pool, SessionStatePool) and list(pool.states) == ["a", "b"]
    held = pool.held_blocks
    assert held == 2 * engine.num_layers * 8  # 29 + 3 - 1 = 31 slots: 8 blocks of 4 in each layer
    assert pool.free_blocks == pool.usable_blocks and pool.blocks_in_use == 0
    free_stack = len(pool._free)
    taken = pool.allocate(free_stack + 1)  # one block past the free stack: the oldest state goes
    assert list(pool.states) == ["b"] and pool.reclaimed_states == 1
    with pytest.raises(PoolExhausted):
        pool.allocate(pool.free_blocks + 1)
    pool.release(taken)
    engine.submit(
        GenerationRequest("a2", list(range(1, 30)) + res["a"].output_ids + [9], 2, session_id="a"),
        lambda r: res.__setitem__("a2", r),
    )
    engine.run_until_idle()
    assert res["a2"].session_reused_tokens == 0 and res["a2"].session_recomputed_tokens == 31
    assert engine.stats()["session_states_reclaimed"] == 1


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(kv_layout="preallocated"), "kv_layout"),
        (dict(**PAGED, enable_prefix_caching=True), "enable_prefix_caching"),
        (dict(**PAGED, policy="scissorhands", budget="per_request", compression_ratio=5), "budget"),
    ],
)
def test_session_state_is_refused_where_a_row_cannot_be_kept_naming_the_field(kw, message):
    with pytest.raises(ConfigError, match=rf"kv_reuse: 'session_state'.*{message}"):
        EngineConfig(**{"kv_memory_limit_bytes": 10**6, **kw, **ON})


@pytest.mark.parametrize("value", ["chain", "shared", True, None])
def test_kv_reuse_takes_its_named_ways_only(value):
    with pytest.raises(ConfigError, match=r"kv_reuse.*none.*session_state"):
        EngineConfig(**PAGED, kv_memory_limit_bytes=10**6, kv_reuse=value)


def test_without_the_knob_no_state_is_kept_and_the_counts_are_absent(model):
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7))
    got = _converse(engine, sessions=2, turns=2)
    assert all(r.session_reused_tokens == 0 == r.cached_prompt_tokens for r in got.values())
    assert "session_states" not in engine.stats() and engine.pool.blocks_in_use == 0


def test_common_prefix_tokens_counts_equal_first_tokens():
    assert common_prefix_tokens([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_tokens([1, 2], [1, 2, 3]) == 2
    assert common_prefix_tokens([], [1]) == 0


@pytest.mark.slow
def test_the_full_cache_from_session_state_gives_the_tokens_of_a_prefill_from_text_on_the_embedded_model():
    """Three sessions of four turns behind a 150-token system prompt on the real model, where rounding and near-ties
    are real: the full cache started from each session's state gives the greedy tokens of prefilling every turn from
    text under prefill-first and mixed chunks, every later turn reusing its whole previous turn."""
    from replica.static_batch import load_replica_model

    torch.set_num_threads(2)
    model, _ = load_replica_model("embedded", dtype="float32")
    model.generation_config.eos_token_id = None
    paged = dict(kv_layout="paged", kv_memory_limit_bytes=200 * 2**20)
    for sched in (dict(), dict(scheduler="mixed", max_num_batched_tokens=64)):
        want = _converse(ContinuousBatchingEngine(model, EngineConfig(**paged, **sched)), system_tokens=150)
        engine = ContinuousBatchingEngine(model, EngineConfig(**paged, **sched, **ON))
        got = _converse(engine, system_tokens=150)
        assert _outputs(got) == _outputs(want), sched
        assert engine.stats()["session_state_hits"] == 9 and engine.stats()["session_recomputed_tokens"] == 0


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_two_requests_of_one_session_admitted_together_share_its_state_with_neither(model, sched):
    """Both extend the session's state; the first admitted starts from it, the other from text, and both give the
    tokens of a prefill from text."""
    cfg = dict(**PAGED, **sched, kv_memory_limit_bytes=10**7)
    first = list(range(3, 30))
    out = {}
    for name, kw in (("off", {}), ("on", ON)):
        engine = ContinuousBatchingEngine(model, EngineConfig(**cfg, **kw))
        res = {}
        engine.submit(GenerationRequest("t0", first, 3, session_id="s"), lambda r: res.__setitem__(r.request_id, r))
        engine.run_until_idle()
        history = first + res["t0"].output_ids
        for i, extra in enumerate(([1, 2], [4, 5, 6])):
            req = GenerationRequest(f"t1-{i}", history + extra, 4, session_id="s")
            engine.submit(req, lambda r: res.__setitem__(r.request_id, r))
        engine.run_until_idle()
        out[name] = res
        assert all(r.error is None for r in res.values())
    assert _outputs(out["on"]) == _outputs(out["off"])
    reused = sorted(out["on"][k].session_reused_tokens for k in ("t1-0", "t1-1"))
    recomputed = sorted(out["on"][k].session_recomputed_tokens for k in ("t1-0", "t1-1"))
    assert reused == [0, len(first) + 2] and recomputed == [0, len(first) + 2]
