"""Multi-turn sessions (`workloads.load.sessions`, mode ``sessions``): turn k's prompt is turn k-1's prompt, its answer
and a new message; every series at one load gets the same sessions; a session meets the SLO only when every turn does;
bad sessions exit 2 naming the field."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import pytest
import yaml

from replica.common.types import GenerationResult
from replica.continuous import StreamChunk
from tests.serving_fakes import OneReplicaPool, run_virtual, virtual_clock
from tests.suite_helpers import serving_suite
from workloads import sweep
from workloads.core.run import SweepError, check_model_context
from workloads.core.suite import SuiteError
from workloads.core.template import run_suite
from workloads.kinds import parse_suite
from workloads.load.driver import run_load
from workloads.load.lengths import LengthDist
from workloads.load.metrics import RequestRecord
from workloads.load.patterns import LoadConfig
from workloads.load.sessions import SessionSource, read_session_trace, session_metrics
from workloads.load.slo import SLO
from workloads.serving.runner import ServingKind

TRACE = Path(__file__).parent / "data" / "sessions_trace.jsonl"
SPEC = dict(
    users=3, turns=3, message_tokens=4, think_time_s=0.5, system_prompt_tokens=3, group_context_tokens=2, group_size=2
)


class Answering:
    """A client that answers request `j` (in arrival order) with `max_new_tokens` copies of `1000 + j` after 0.1 s,
    one token every 10 ms; `cached`: what it reports as the engine's cached prompt tokens (None: not reported)."""

    def __init__(self, cached=None):
        self.got, self.cached = [], cached

    async def generate(self, req):
        now = asyncio.get_running_loop().time
        self.got.append(req)
        j = len(self.got)
        await asyncio.sleep(0.1)
        n = req.max_new_tokens
        res = GenerationResult(
            req.request_id, len(req.prompt_ids), output_ids=[1000 + j] * n, token_times_s=[now()] * n
        )
        if self.cached is not None:
            res.cached_prompt_tokens = self.cached(req)
        return res


def _run(cfg: LoadConfig, client, new_tokens: int = 2, seed: int = 1):
    src = cfg.pattern.request_source(None, LengthDist("fixed", value=new_tokens), seed=seed, vocab_size=50)

    async def go():
        return await run_load(client, src, cfg, clock=virtual_clock())

    return run_virtual(go()), src


def _config(**spec) -> LoadConfig:
    return LoadConfig(mode="sessions", session_rate_per_s=2.0, sessions={**SPEC, **spec}, seed=1)


def test_turn_k_sends_turn_k_minus_1s_prompt_its_answer_and_a_new_message_after_the_answer_and_think_time():
    client = Answering()
    result, src = _run(_config(), client)
    sent = {r.request_id: r for r in client.got}
    recs = {r.request_id: r for r in result.records}
    assert len(sent) == 9  # 3 users x 3 turns
    for s in src.sessions:
        opening = src.opening(s)
        first = sent[f"req-s{s.index}-t0"].prompt_ids
        assert first == opening + src.message(s, 0) and len(first) == 3 + 2 + 4
        for k in (1, 2):
            prev = f"req-s{s.index}-t{k - 1}"
            answer = recs[prev].output_ids
            assert len(answer) == 2 and answer[0] >= 1001
            assert sent[f"req-s{s.index}-t{k}"].prompt_ids == sent[prev].prompt_ids + answer + src.message(s, k)
            # sent once the answer came back and the user thought 0.5 s
            this = recs[f"req-s{s.index}-t{k}"]
            assert this.send_time_s == pytest.approx(recs[prev].finish_time_s + 0.5)
            assert this.expected_reuse_tokens == len(sent[prev].prompt_ids) + 2
    # the system prompt is every user's; the group context is shared by users 0 and 1 only (group_size 2)
    o0, o1, o2 = (src.opening(s) for s in src.sessions)
    assert o0 == o1 and o0[:3] == o2[:3] and o0[3:] != o2[3:]
    assert [recs[f"req-s{i}-t0"].expected_reuse_tokens for i in range(3)] == [0, 5, 3]
    assert [len(sent[f"req-s0-t{k}"].prompt_ids) for k in range(3)] == [9, 15, 21]


def test_a_failed_turn_ends_its_session_and_the_session_misses_the_slo():
    class FailSecondTurn(Answering):
        async def generate(self, req):
            if req.request_id == "req-s1-t1":
                self.got.append(req)
                return GenerationResult(req.request_id, len(req.prompt_ids), error_kind="error", error="boom")
            return await super().generate(req)

    client = FailSecondTurn()
    result, _ = _run(_config(), client)
    assert sorted(r.request_id for r in client.got if "-s1-" in r.request_id) == ["req-s1-t0", "req-s1-t1"]
    m = session_metrics(result.records, SLO(ttft_s=1.0, tpot_s=1.0), window_s=10.0)
    assert (m["sessions"], m["sessions_slo_met"], m["session_slo_attainment"]) == (3, 2, pytest.approx(2 / 3))
    assert m["session_goodput_per_s"] == pytest.approx(0.2)
    assert [t["n"] for t in m["turns"]] == [3, 3, 2]


def _turn(session: int, turn: int, ttft_s: float, *, turns: int = 2, warmup: bool = False) -> RequestRecord:
    rec = RequestRecord(f"s{session}t{turn}", 10, 2, send_time_s=0.0, warmup=warmup)
    rec.output_tokens, rec.token_times_s, rec.output_ids = 2, [ttft_s, ttft_s + 0.05], [5, 5]
    rec.session_id, rec.turn, rec.session_turns, rec.expected_reuse_tokens = session, turn, turns, 4 * turn
    return rec


def test_a_session_meets_the_slo_only_when_every_turn_does():
    records = [
        _turn(0, 0, 0.1), _turn(0, 1, 0.2),  # every turn within 0.5 s: met
        _turn(1, 0, 0.1), _turn(1, 1, 0.9),  # turn 1 misses TTFT: the session misses
        _turn(2, 0, 0.1),                    # its turn 1 never sent: misses
        _turn(3, 0, 0.1, warmup=True), _turn(3, 1, 0.1),  # a warm-up turn: left out
    ]  # fmt: skip
    m = session_metrics(records, SLO(ttft_s=0.5, tpot_s=0.1), window_s=4.0)
    assert (m["sessions"], m["sessions_slo_met"]) == (3, 1)
    assert m["session_slo_attainment"] == pytest.approx(1 / 3)
    assert m["session_goodput_per_s"] == pytest.approx(0.25)
    t0, t1 = m["turns"]
    assert (t0["turn"], t0["n"], t0["slo_attainment"]) == (0, 3, 1.0)
    assert (t1["turn"], t1["n"], t1["slo_attainment"]) == (1, 2, 0.5)
    assert t1["ttft_p50_s"] == pytest.approx(0.55) and t1["tpot_p50_s"] == pytest.approx(0.05)
    assert t1["expected_reuse_tokens_mean"] == 4.0
    assert t1["cached_prompt_tokens_mean"] is None and m["cached_prompt_tokens"] is None  # not reported


def test_the_engines_cached_prompt_tokens_are_recorded_beside_the_expected_reuse_when_reported():
    client = Answering(cached=lambda req: len(req.prompt_ids) // 2)
    result, _ = _run(_config(users=1), client)
    m = session_metrics(result.records, SLO(), window_s=1.0)
    assert [r.cached_prompt_tokens for r in result.records] == [4, 7, 10]  # prompts of 9, 15 and 21 tokens
    assert m["cached_prompt_tokens"] == 21
    assert m["expected_reuse_tokens"] == 0 + 11 + 17
    assert [t["cached_prompt_tokens_mean"] for t in m["turns"]] == [4.0, 7.0, 10.0]


def test_a_session_trace_replays_its_starts_think_times_and_lengths():
    sessions = read_session_trace(TRACE)
    assert [s.start_s for s in sessions] == [0.0, 0.5]
    assert [(t.message_tokens, t.output_tokens, t.think_s) for t in sessions[0].turns] == [
        (6, 3, 0.0),
        (5, 2, 0.2),
        (2, 1, 1.0),
    ]
    cfg = LoadConfig(mode="sessions", session_rate_per_s=1.0, sessions={"trace_path": str(TRACE)}, seed=0)
    client = Answering()
    result, _ = _run(cfg, client)
    lengths = {r.request_id: len(r.prompt_ids) for r in client.got}
    assert lengths == {
        "req-s0-t0": 6, "req-s0-t1": 6 + 3 + 5, "req-s0-t2": 14 + 2 + 2,
        "req-s1-t0": 4, "req-s1-t1": 4 + 2 + 3,
    }  # fmt: skip
    recs = {r.request_id: r for r in result.records}
    assert recs["req-s1-t0"].send_time_s - recs["req-s0-t0"].send_time_s == pytest.approx(0.5)
    assert recs["req-s0-t2"].send_time_s == pytest.approx(recs["req-s0-t1"].finish_time_s + 1.0)


def _sessions_suite(**kw) -> dict:
    fields = dict(
        name="s", mode="sessions", loads=[1.0], new_tokens=2, sessions=dict(SPEC), compression_ratios=[2],
        saturation={"max_error_rate": None, "min_achieved_rate_fraction": None},
    )  # fmt: skip
    return serving_suite(**{**fields, **kw})


class RecordingPool(OneReplicaPool):
    """One fake replica per point whose answers depend on the prompt alone; keeps what each point sent."""

    def __init__(self):
        self.sent: list[dict] = []

    def configure(self, cfg, run_id=None):
        got: dict = {}
        self.sent.append(got)
        pool = self

        class Replica:
            peak_running = 1

            async def generate(self, req):
                got["-".join(req.request_id.rsplit("-", 2)[-2:])] = tuple(req.prompt_ids)  # s<i>-t<k>
                n = req.max_new_tokens
                return GenerationResult(
                    req.request_id, len(req.prompt_ids), output_ids=[len(req.prompt_ids)] * n,
                    token_times_s=[time.time()] * n,
                )  # fmt: skip

        pool.replica = Replica()


def test_every_series_at_one_load_gets_the_same_sessions_messages_and_think_times(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_sessions_suite(sessions={**SPEC, "think_time_s": 0.01})))
    args = argparse.Namespace(
        suite=str(path), replicas=None, results_dir=str(tmp_path / "r"), run_id="run", resume=None, address=None,
        pushgateway="off",
    )  # fmt: skip
    pool = RecordingPool()
    assert run_suite(args, ServingKind(pool)) == 0
    full, scissorhands = pool.sent
    assert len(full) == 9 and full == scissorhands  # the same prompts, turn by turn
    records = [json.loads(x) for x in (tmp_path / "r" / "run" / "points.jsonl").read_text().splitlines()]
    assert [r["series"].split("-")[1] for r in records] == ["full", "scissorhands"]
    for r in records:
        assert r["status"] == "ok" and r["sessions"] == 3 and r["session_rate"] == 1.0
        assert [t["turn"] for t in r["turns"]] == [0, 1, 2] and r[
            "cached_prompt_tokens"
        ] == 0  # prefix caching off: none cached
        assert r["expected_reuse_tokens"] == (0 + 5 + 3) + 3 * 11 + 3 * 17
    table = (tmp_path / "r" / "run" / "table.md").read_text()
    sessions_part = table[table.index("Sessions\n") :]
    assert "| session SLO attainment |" in sessions_part
    turn_rows = [x for x in sessions_part.splitlines() if x.startswith("| sessions-")]
    assert len(turn_rows) == 2 + 6  # a row per point, then a row per turn index of each point
    assert (tmp_path / "r" / "run" / "ttft_per_turn.png").stat().st_size > 0
    cfgs = [r["load_config"] for r in records]
    assert cfgs[0]["seed"] == cfgs[1]["seed"] and cfgs[0]["sessions"]["think_time_s"]["value"] == 0.01


def test_a_session_trace_turn_of_a_missing_session_is_refused_naming_the_field(tmp_path, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text(
        '{"session_id": "a", "timestamp": 0, "input_length": 4, "output_length": 2}\n'
        '{"session_id": "zz", "delay": 100, "input_length": 4, "output_length": 2}\n'
    )
    with pytest.raises(SuiteError, match=r"row 2, session_id: turn refers to session 'zz'"):
        parse_suite(_sessions_suite(sessions={"trace_path": str(bad)}, new_tokens=None))
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump(_sessions_suite(sessions={"trace_path": str(bad)}, new_tokens=None)))
    results = tmp_path / "r"
    assert sweep.main([str(suite), "--local", "--results-dir", str(results), "--pushgateway", "off"]) == 2
    assert "session_id: turn refers to session 'zz'" in capsys.readouterr().err
    assert not results.exists() or not any(results.iterdir())  # nothing recorded
    bad.write_text(
        '{"session_id": "a", "timestamp": 0, "input_length": 4, "output_length": 2}\n'
        '{"session_id": "a", "delay": -5, "input_length": 4, "output_length": 2}\n'
    )
    with pytest.raises(SuiteError, match=r"row 2, delay: a think time must be milliseconds >= 0, got -5"):
        parse_suite(_sessions_suite(sessions={"trace_path": str(bad)}, new_tokens=None))


def test_a_negative_think_time_is_refused_naming_the_field():
    with pytest.raises(SuiteError, match=r"sessions\.think_time_s\.value"):
        parse_suite(_sessions_suite(sessions={**SPEC, "think_time_s": -0.5}))
    with pytest.raises(
        SuiteError, match=r"sessions\.think_time_s: mean: Input should be greater than or equal to 0, got -1"
    ):
        parse_suite(_sessions_suite(sessions={**SPEC, "think_time_s": {"dist": "exponential", "mean": -1}}))


def test_a_prefix_layer_longer_than_a_turns_prompt_budget_is_refused_naming_the_layer():
    with pytest.raises(SuiteError, match=r"sessions\.group_context_tokens: 40 tokens is longer than a turn's prompt"):
        parse_suite(_sessions_suite(sessions={**SPEC, "group_context_tokens": 40, "max_prompt_tokens": 30}))
    with pytest.raises(SuiteError, match=r"sessions\.max_prompt_tokens: the last turn's prompt reaches 21 tokens"):
        parse_suite(_sessions_suite(sessions={**SPEC, "max_prompt_tokens": 20}))  # 3 + 2 + 3 x 4 + 2 x 2 = 21
    parse_suite(_sessions_suite(sessions={**SPEC, "max_prompt_tokens": 21}))  # exactly the budget


def test_a_session_longer_than_the_models_context_exits_2_naming_the_field(tmp_path, capsys):
    # tiny-llama's context is 512 tokens; 8 turns x (60 + 4) + 3 + 2 = 517 > 512
    long = parse_suite(_sessions_suite(sessions={**SPEC, "turns": 8, "message_tokens": 60}, new_tokens=4))
    with pytest.raises(SweepError, match=r"sessions\.turns: the last turn's prompt \(at most 513 tokens\)") as e:
        check_model_context(long)
    assert e.value.code == 2
    fits = parse_suite(_sessions_suite(sessions={**SPEC, "turns": 8, "message_tokens": 59}, new_tokens=4))
    check_model_context(fits)  # 8 x 63 + 5 = 509
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(_sessions_suite(sessions={**SPEC, "turns": 8, "message_tokens": 60}, new_tokens=4)))
    assert sweep.main([str(path), "--local", "--results-dir", str(tmp_path / "r"), "--pushgateway", "off"]) == 2
    assert "sessions.turns" in capsys.readouterr().err


def test_a_session_source_builds_the_same_messages_for_the_same_seed_whatever_the_order():
    cfg = _config()
    a = cfg.pattern.request_source(None, LengthDist("fixed", value=2), seed=9, vocab_size=50)
    b = cfg.pattern.request_source(None, LengthDist("fixed", value=2), seed=9, vocab_size=50)
    assert isinstance(a, SessionSource)
    later = [b.message(s, k) for s in reversed(b.sessions) for k in (2, 1, 0)]
    assert [a.message(s, k) for s in reversed(a.sessions) for k in (2, 1, 0)] == later
    assert a.opening(a.sessions[2]) == b.opening(b.sessions[2])
    assert a.message(a.sessions[0], 0) != a.message(a.sessions[0], 1)


def test_a_session_trace_suite_records_its_prompt_and_answer_ranges_and_longest_conversation():
    suite = parse_suite(
        _sessions_suite(sessions={"trace_path": str(TRACE), "system_prompt_tokens": 2}, new_tokens=None)
    )
    # session a: 2 + 6 + 3 + 5 + 2 + 2 = 20 tokens before its last answer (1), session b: 2 + 4 + 2 + 3 = 11
    assert (suite.prompt_tokens.min, suite.prompt_tokens.max) == (2 + 4, 20)
    assert (suite.new_tokens.min, suite.new_tokens.max, suite.session_tokens) == (1, 4, 21)
    assert suite.context_lengths()[0][1] == 21


def test_a_streamed_answer_is_the_next_turns_history_and_one_without_token_ids_ends_its_session():
    class Streaming:
        def __init__(self, ids):
            self.got, self.ids = [], ids

        async def events(self, req):
            self.got.append(req)
            await asyncio.sleep(0.1)
            yield StreamChunk(self.ids[:1])
            yield StreamChunk(self.ids[1:])
            yield GenerationResult(req.request_id, len(req.prompt_ids))

    client = Streaming([41, 42])
    _run(_config(users=1), client)
    first, second, _ = (r.prompt_ids for r in client.got)
    assert second[len(first) : len(first) + 2] == [41, 42]
    client = Streaming([-1, -1])  # what the HTTP client streams for text without ids
    result, _ = _run(_config(users=1), client)
    assert len(client.got) == 1 and result.records[0].error_kind == "missing_token_ids"


@pytest.mark.parametrize(
    "row, field",
    [
        ("[1, 2, 3]", "expected a JSON object"),
        ("null", "expected a JSON object"),
        ('"a turn"', "expected a JSON object"),
        ('{"session_id": "a", "timestamp": 0, "input_length": Infinity, "output_length": 2}', "input_length"),
        ('{"session_id": "a", "timestamp": 0, "input_length": 4, "output_length": NaN}', "output_length"),
        ('{"session_id": "a", "timestamp": true, "input_length": 4, "output_length": 2}', "timestamp"),
        ('{"session_id": "a", "timestamp": NaN, "input_length": 4, "output_length": 2}', "timestamp"),
    ],
)
def test_a_session_trace_row_that_is_not_a_turn_or_a_number_that_is_not_finite_exits_2_naming_the_field(
    tmp_path, capsys, row, field
):
    bad = tmp_path / "t.jsonl"
    bad.write_text(row + "\n")
    with pytest.raises(SuiteError, match=rf"^sessions\.trace_path: t\.jsonl, row 1(, |: ){field}"):
        parse_suite(_sessions_suite(sessions={"trace_path": str(bad)}, new_tokens=None))
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump(_sessions_suite(sessions={"trace_path": str(bad)}, new_tokens=None)))
    results = tmp_path / "r"
    assert sweep.main([str(suite), "--local", "--results-dir", str(results), "--pushgateway", "off"]) == 2
    assert "sweep: error: sessions.trace_path: t.jsonl, row 1" in capsys.readouterr().err
    assert not results.exists() or not any(results.iterdir())  # nothing recorded


def test_a_boolean_delay_in_a_session_trace_is_refused_not_read_as_one_millisecond(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text(
        '{"session_id": "a", "timestamp": 0, "input_length": 4, "output_length": 2}\n'
        '{"session_id": "a", "delay": true, "input_length": 4, "output_length": 2}\n'
    )
    with pytest.raises(ValueError, match=r"row 2, delay: a think time must be milliseconds >= 0, got True"):
        read_session_trace(bad)


@pytest.mark.parametrize(
    "think, message",
    [
        (
            {"dist": "fixed", "value": 1, "mean": 3},
            r"sessions\.think_time_s: mean: not used by think time dist 'fixed'",
        ),
        (
            {"dist": "exponential", "mean": 1, "min": 0, "max": 2},
            r"sessions\.think_time_s: max: not used by think time dist 'exponential' \(it takes mean\)",
        ),
        ({"dist": "uniform", "min": 0, "max": 2, "value": 1}, r"value: not used by think time dist 'uniform'"),
        ("0.5s", r"sessions\.think_time_s: expected seconds >= 0 \(a number\) or a mapping \{dist: fixed \| uniform"),
    ],
)
def test_a_think_time_parameter_its_distribution_does_not_take_is_refused_naming_it(think, message):
    with pytest.raises(SuiteError, match=message):
        parse_suite(_sessions_suite(sessions={**SPEC, "think_time_s": think}))


def test_a_session_field_that_would_be_ignored_is_refused_naming_it_and_its_accepted_values():
    with pytest.raises(SuiteError, match=r"sessions\.trace_time_scale: only used with trace_path"):
        parse_suite(_sessions_suite(sessions={**SPEC, "trace_time_scale": 2.0}))
    parse_suite(_sessions_suite(sessions={**SPEC, "trace_time_scale": 2.0, "users": None, "turns": None,
                                          "message_tokens": None, "trace_path": str(TRACE)}, new_tokens=None))  # fmt: skip
    # a group larger than the users is one partial group, as the last group of 5 users in pairs: accepted
    suite = parse_suite(_sessions_suite(sessions={**SPEC, "group_size": 4}))
    assert suite.sessions.group_size == 4


def test_a_session_trace_longer_than_the_models_context_exits_2_naming_the_trace_not_turns(tmp_path):
    trace = tmp_path / "long.jsonl"  # tiny-llama's context is 512 tokens; 300 + 4 + 200 + 10 = 514 > 512
    trace.write_text(
        '{"session_id": "a", "timestamp": 0, "input_length": 300, "output_length": 4}\n'
        '{"session_id": "a", "delay": 10, "input_length": 200, "output_length": 10}\n'
    )
    long = parse_suite(_sessions_suite(sessions={"trace_path": str(trace)}, new_tokens=None))
    with pytest.raises(SweepError, match=r"^sessions\.trace_path: the last turn's prompt \(at most 504 tokens\)") as e:
        check_model_context(long)
    assert e.value.code == 2
