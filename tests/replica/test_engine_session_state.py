"""A session's KV cache carried to its next request (`EngineConfig.kv_reuse: session_state`,
`replica.engine.session_state`, after Sparse-vLLM's "chain" mode): the full cache gives the same greedy tokens as
prefilling every turn from text under both schedulers and under memory pressure; a turn that extends the previous
one's prompt + output prefills only the new tokens; a reclaimed state or a prompt that does not extend it is
recomputed from text and counted; a request is never started from another session's state; a budgeted policy's
counts are pinned and its tokens deterministic."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from replica.common.types import ConfigError, EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine, session_state
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


def _planted_failure(*args, **kwargs):
    raise RuntimeError("planted failure")


@pytest.mark.parametrize("sched", SCHEDULERS)
@pytest.mark.parametrize(
    "where",
    [
        pytest.param("deepcopy", id="before-the-row-moves"),
        pytest.param("select_rows", id="after-its-blocks-moved"),
        pytest.param("cache_blocks", id="in-keep-after-the-split"),
    ],
)
def test_a_failure_keeping_a_sessions_state_returns_the_rows_blocks_and_answers_the_request(
    model, monkeypatch, caplog, sched, where
):
    """A fault planted where a finished row is split off and kept: the request is answered as without the knob, no
    state is kept, every block is back in the free stack, and the failure is counted; the session's next request
    is prefilled from text. Both places a row finishes are hit: a one-token request ends at its prefill, in a group
    with one that ends at a decode step beside a row without a session that runs on."""
    cfg = dict(**PAGED, **sched, kv_memory_limit_bytes=10**7)
    prompt = list(range(1, 20))
    out = {}
    for name, kw in (("off", {}), ("on", ON)):
        engine = ContinuousBatchingEngine(model, EngineConfig(**cfg, **kw))
        if name == "on":
            broken = types.SimpleNamespace(deepcopy=_planted_failure) if where == "deepcopy" else _planted_failure
            monkeypatch.setattr(session_state, "copy" if where == "deepcopy" else where, broken)
        res = {}
        for rid, new, sid in (("a", 1, "a"), ("b", 4, "b"), ("c", 9, None)):
            engine.submit(
                GenerationRequest(rid, prompt, new, session_id=sid), lambda r: res.__setitem__(r.request_id, r)
            )
        engine.run_until_idle()
        engine.submit(
            GenerationRequest("b2", prompt + res["b"].output_ids + [5], 3, session_id="b"),
            lambda r: res.__setitem__(r.request_id, r),
        )
        engine.run_until_idle()
        monkeypatch.undo()
        assert all(r.error is None for r in res.values()), {k: r.error for k, r in res.items()}
        out[name] = res
    assert _outputs(out["on"]) == _outputs(out["off"])
    pool, stats = engine.pool, engine.stats()
    assert not pool.states and pool.held_blocks == 0
    assert len(pool._free) == pool.free_blocks == pool.usable_blocks  # no block lost
    assert stats["session_state_keep_failures"] == 3  # a, b, then b2 (c has no session)
    assert "session 'b': the state of request 'b2' was not kept (RuntimeError: planted failure)" in caplog.text
    assert out["on"]["b2"].session_reused_tokens == 0
    assert out["on"]["b2"].session_recomputed_tokens == len(prompt) + 3


def _two_of_one_session(model, cfg: dict, second_head) -> dict:
    """Per run (``off``: without the knob, ``on``: with it) the results of a session's first turn and then two
    requests of the session submitted together: the first's prompt `second_head(history)` (history: the first
    turn's prompt + outputs), the second's the history + 2 tokens. Every request is answered without error."""
    first = list(range(3, 40))
    out = {}
    for name, kw in (("off", {}), ("on", ON)):
        engine = ContinuousBatchingEngine(model, EngineConfig(**cfg, **kw))
        res = {}
        engine.submit(GenerationRequest("t0", first, 3, session_id="s"), lambda r: res.__setitem__(r.request_id, r))
        engine.run_until_idle()
        history = first + res["t0"].output_ids
        for rid, prompt in (("t1-0", second_head(history)), ("t1-1", history + [4, 5])):
            engine.submit(GenerationRequest(rid, prompt, 4, session_id="s"), lambda r: res.__setitem__(r.request_id, r))
        engine.run_until_idle()
        assert sorted(res) == ["t0", "t1-0", "t1-1"]  # every request answered
        assert all(r.error is None for r in res.values()), {k: r.error for k, r in res.items()}
        out[name] = (res, engine)
    assert _outputs(out["on"][0]) == _outputs(out["off"][0])
    return out["on"]


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_two_requests_of_one_session_in_one_step_under_a_tight_pool_are_both_answered_exactly(model, sched):
    """A session's state is counted for one request of a step at most: two requests that both extend it, submitted
    together into a pool of 32 blocks (a prefill from text of either takes 22 at its peak, the state holds 20), are
    both answered with the greedy tokens of a run without the knob; the first (arrival order) starts from the
    state, the other is prefilled from text. Counting the state for both admitted them together: the second's
    prefill from text ran out of blocks (`PoolExhausted`), or under mixed chunks stalled part-way, unanswered."""
    cfg = dict(**PAGED, **sched, kv_memory_limit_bytes=34_000)
    res, engine = _two_of_one_session(model, cfg, lambda history: history + [1, 2])
    assert engine.pool.usable_blocks == 32
    assert [res[k].session_reused_tokens for k in ("t1-0", "t1-1")] == [39, 0]  # 37 + 3 - 1
    assert engine.stats()["session_state_hits"] == 1


@pytest.mark.parametrize(
    "sched",
    [
        pytest.param(dict(scheduler="prefill_first"), id="prefill_first"),
        pytest.param(dict(scheduler="mixed", max_num_batched_tokens=64), id="mixed-chunks-of-64"),  # both in a step
    ],
)
def test_a_request_that_does_not_extend_its_sessions_state_leaves_it_to_a_later_one_of_its_step(model, sched):
    """The first of two requests of a step edits the session's history, the second extends it: the second starts
    from the state (the first, prefilled from text, does not drop a state promised to a request of its step), both
    with the tokens of a run without the knob."""
    cfg = dict(**PAGED, **sched, kv_memory_limit_bytes=10**7)
    res, engine = _two_of_one_session(model, cfg, lambda history: [*history[:-1], 9, 1, 2])
    assert [res[k].session_reused_tokens for k in ("t1-0", "t1-1")] == [0, 39]
    assert res["t1-0"].session_recomputed_tokens == 39  # the history but its last token, which it edits
    assert engine.stats()["session_state_hits"] == 1


def test_the_pools_block_figures_read_from_another_thread_while_a_step_is_planned_count_kept_states_free(model):
    """`stats()` and `reset_stats()` run on other threads than the engine's steps: a thread reading the pool while
    a step is planned (the plan counts kept states as in use, `SessionStatePool.plan_free_blocks`) sees the figures
    of any other moment, kept states free, and the peak it resets starts from them; the plan still counts the
    state its request takes as that request's."""
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, kv_memory_limit_bytes=10**7, **ON))
    res = {}
    prompt = list(range(1, 30))
    engine.submit(GenerationRequest("t0", prompt, 3, session_id="s"), lambda r: res.__setitem__(r.request_id, r))
    engine.run_until_idle()
    pool = engine.pool
    assert pool.held_blocks > 0 and pool.blocks_in_use == 0
    seen = []
    plan = engine.scheduler.plan

    def planned_beside_a_reader(view, kv):
        def read():
            engine.reset_stats()
            seen.append((pool.blocks_in_use, pool.free_blocks, pool.peak_blocks_in_use))

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(timeout=60)
        return plan(view, kv)

    engine.scheduler.plan = planned_beside_a_reader
    engine.submit(
        GenerationRequest("t1", prompt + res["t0"].output_ids + [7], 2, session_id="s"),
        lambda r: res.__setitem__(r.request_id, r),
    )
    engine.run_until_idle()
    assert seen and all(s == (0, pool.usable_blocks, 0) for s in seen), seen
    assert res["t1"].error is None and res["t1"].session_reused_tokens == len(prompt) + 2


def test_a_finished_row_that_has_not_fed_its_history_keeps_nothing_and_is_counted_not_silent(
    model, monkeypatch, caplog
):
    """`SessionStatePool.keep_row` keeps nothing of a row whose clock is not its history's (``tokens_seen``): that
    keep is counted in ``session_state_keep_failures`` and logged, as a failed keep is, so a reuse check reads it as
    what explains the next turn's recompute; no block is lost."""
    real = session_state.split_row

    def off_by_one(cache, i):
        row = real(cache, i)
        row.layers[0].tokens_seen += 1  # a row of other tokens than the request's history
        return row

    monkeypatch.setattr(session_state, "split_row", off_by_one)
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, **ON, kv_memory_limit_bytes=10**7))
    res = {}
    engine.submit(GenerationRequest("a", list(range(1, 20)), 3, session_id="s"), lambda r: res.__setitem__("a", r))
    engine.run_until_idle()
    assert res["a"].error is None
    pool, stats = engine.pool, engine.stats()
    assert not pool.states and pool.held_blocks == 0
    assert len(pool._free) == pool.free_blocks == pool.usable_blocks
    assert stats["session_state_keep_failures"] == 1
    assert "session 's': the state of request 'a' was not kept (its row had not fed its history" in caplog.text


def _kept_state_then_long_prompts(model, cfg: dict, long_prompts: int) -> dict:
    """A short request of session "a" decoding while `long_prompts` long prompts of other sessions are admitted
    under a pool of 17 blocks: with `ON`, "a" finishes part-way through their prefill, its state keeps its 4 blocks
    and the long prompts' next chunks need them. Results by request id; the engine is left with nothing in flight."""
    engine = ContinuousBatchingEngine(model, EngineConfig(**PAGED, **cfg, kv_memory_limit_bytes=18_000))
    assert engine.pool.usable_blocks == 17
    res = {}
    engine.submit(GenerationRequest("a", [7, 8, 9], 4, session_id="a"), lambda r: res.__setitem__(r.request_id, r))
    for i in range(long_prompts):
        prompt = [11 + i] + list(range(20, 45))  # 26 tokens
        req = GenerationRequest(f"b{i}", prompt, 7, session_id=f"b{i}")
        engine.submit(req, lambda r: res.__setitem__(r.request_id, r))
    engine.run_until_idle(10_000)
    assert not engine.flight.prefilling and not engine.flight.running and not len(engine.queue)
    return res


@pytest.mark.parametrize(
    "sched",
    [
        pytest.param(dict(scheduler="mixed", max_num_batched_tokens=4), id="mixed-chunks-of-4"),
        pytest.param(dict(scheduler="mixed", max_num_batched_tokens=8), id="mixed-chunks-of-8"),
        pytest.param(dict(scheduler="prefill_first"), id="prefill_first"),
    ],
)
@pytest.mark.parametrize("long_prompts", [1, 2])
def test_a_prompt_part_way_fed_takes_the_blocks_of_a_kept_state_rather_than_wait_forever(model, sched, long_prompts):
    got = _kept_state_then_long_prompts(model, {**sched, **ON}, long_prompts)
    names = ["a"] + [f"b{i}" for i in range(long_prompts)]
    assert sorted(got) == names  # every request answered: none left part-way fed with the engine idle
    assert all(r.error is None for r in got.values()), {k: r.error for k, r in got.items()}
    want = _kept_state_then_long_prompts(model, sched, long_prompts)  # no state kept: the same tokens
    assert {k: r.output_ids for k, r in got.items()} == {k: r.output_ids for k, r in want.items()}
    assert [len(got[k].output_ids) for k in names] == [4] + [7] * long_prompts
