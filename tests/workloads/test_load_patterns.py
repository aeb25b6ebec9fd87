"""What a load pattern declares for the suites that sweep it (`workloads.load.patterns`), the configs'
validation, and the typed replies a Serve deployment hands the load generator (`ServeClient`)."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from replica.common.types import GenerationRequest, GenerationResult
from replica.continuous import ReplicaReply
from workloads.core.suite import SuiteError
from workloads.kinds import load_suite
from workloads.load.lengths import LengthDist
from workloads.load.patterns import ALIAS_ONLY, LOAD_PATTERNS, MODE_ALIASES, MODES, RECORD_COLUMNS, LoadConfig
from workloads.serving.pools import ServeClient

BASE = dict(kind="serving", model="tiny-llama", policies=["full"], prompt_tokens=8, new_tokens=4, num_requests=4)


def _suite(tmp_path, **kw):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", **BASE, **kw}))
    return load_suite(str(path))


def test_every_pattern_is_a_suite_mode_and_fills_its_own_record_column():
    assert {p for p, _ in MODES.values()} == set(LOAD_PATTERNS.values())
    assert set(MODES) == (set(LOAD_PATTERNS) - ALIAS_ONLY) | set(MODE_ALIASES)
    assert "batch" not in MODES and {"rate", "capacity"} <= set(MODES)  # capacity: the rate pattern, searched
    assert MODES["capacity"] == (LOAD_PATTERNS["rate"], {"capacity_search": True})
    assert set(RECORD_COLUMNS) == {p.record_column for p in LOAD_PATTERNS.values()} - {None}
    assert {"batch_size", "concurrency", "request_rate"} <= set(RECORD_COLUMNS)


@pytest.mark.parametrize(
    "mode, extra, max_batch_size, columns",
    [
        ("serving-batch", dict(loads=[2, 4]), None, dict(batch_size=2)),
        ("concurrency", dict(loads=[3]), None, dict(concurrency=3)),
        ("rate", dict(loads=[0.5, 2]), None, dict(request_rate=0.5)),
        ("max_batch", dict(kv_memory_limit_bytes=10**6), 7, dict(batch_size=7)),
    ],
)
def test_a_suite_point_gets_its_patterns_config_and_record_columns(tmp_path, mode, extra, max_batch_size, columns):
    suite = _suite(tmp_path, mode=mode, **extra)
    point = suite.points()[0]
    assert suite.record_columns(point, max_batch_size) == {**dict.fromkeys(RECORD_COLUMNS), **columns}
    cfg = suite.load_config(point, max_batch=max_batch_size)
    assert cfg.mode == suite.pattern.name and cfg.seed == suite.seed + point.index
    if mode == "max_batch":  # rounds (2) batches of the batch the replicas sized
        assert (cfg.batch_size, cfg.num_requests, cfg.duration_s) == (7, 14, None)
    else:
        assert getattr(cfg, suite.pattern.load_field) == point.load and cfg.num_requests == 4


def test_a_trace_suite_takes_its_lengths_and_its_one_load_from_the_trace(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n0,5,2\n0.5,9,3\n")
    suite = _suite(
        tmp_path, mode="trace", trace_path=str(trace), trace_time_scale=0.5, prompt_tokens=None, new_tokens=None
    )
    (point,) = suite.points()
    assert (suite.prompt_tokens.min, suite.prompt_tokens.max, suite.new_tokens.max) == (5, 9, 3)
    assert point.load == 0.5 and suite.record_columns(point) == dict.fromkeys(RECORD_COLUMNS)
    cfg = suite.load_config(point)
    assert (cfg.trace_path, cfg.trace_time_scale, cfg.target_rate_req_per_s) == (str(trace), 0.5, 4.0)
    with pytest.raises(SuiteError, match="loads: not used in mode trace"):
        _suite(tmp_path, mode="trace", trace_path=str(trace), loads=[1], prompt_tokens=None, new_tokens=None)


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(mode="rate", rate_req_per_s=1, num_requests=1, arrival="uniform"),
            "arrival: expected one of poisson, gamma, got 'uniform'",
        ),
        (
            dict(mode="burst", num_requests=1),
            f"mode: unknown load pattern 'burst' (accepted: {', '.join(LOAD_PATTERNS)})",
        ),
        (dict(mode="rate", rate_req_per_s=0, num_requests=1), "rate_req_per_s: Input should be greater than 0, got 0"),
        (
            dict(mode="batch", batch_size=2, num_requests=True),
            "num_requests: Input should be a valid integer, got True",
        ),
        (dict(mode="batch", batch_size=2, num_requests=1, rounds=2), "rounds: unknown key"),
    ],
)
def test_load_config_errors_are_one_line_naming_the_field_and_what_it_accepts(kw, message):
    with pytest.raises(ValueError) as e:
        LoadConfig(**kw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_load_config_round_trips_through_its_record_form():
    cfg = LoadConfig(mode="rate", rate_req_per_s=2.5, duration_s=3, arrival="gamma", burstiness=0.5, seed=4)
    assert LoadConfig(**cfg.model_dump()) == cfg and cfg.model_dump()["duration_s"] == 3.0
    assert cfg.pattern is cfg.pattern  # one pattern per config (a trace is read once)


def test_length_dist_takes_its_distribution_first_and_names_the_suite_field():
    assert LengthDist("uniform", min=2, max=9) == LengthDist(dist="uniform", min=2, max=9)
    assert LengthDist.parse("new_tokens", 5).model_dump()["value"] == 5
    with pytest.raises(ValueError, match=r"^new_tokens.max: 2 is below min \(5\)$"):
        LengthDist.parse("new_tokens", {"dist": "uniform", "min": 5, "max": 2})
    with pytest.raises(ValueError, match=r"^new_tokens.sigma: required for dist 'lognormal'"):
        LengthDist.parse("new_tokens", {"dist": "lognormal", "mean": 5})


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _FakeHandle:
    """A deployment handle whose replicas answer `ReplicaReply`s (or die), as `EngineDeployment.generate` does."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.generate = _Remote(self._generate)

    async def _generate(self, request: GenerationRequest):
        replica, answered = self.answers.pop(0)
        if replica is None:

            class ActorDiedError(Exception):  # Ray's class, matched by name
                pass

            raise ActorDiedError("the replica died")
        result = GenerationResult(
            request.request_id, len(request.prompt_ids), output_ids=[1], token_times_s=[0.0], replica_id=replica
        )
        return ReplicaReply(result, {"replica_id": replica, "completed_requests": answered})


def test_serve_client_hands_the_result_on_and_keeps_each_replicas_latest_figures():
    client = ServeClient(_FakeHandle([("a", 1), ("b", 1), ("a", 3), ("a", 2), (None, 0)]))

    async def go():
        out = [await client.generate(GenerationRequest(f"r{i}", [1, 2], 1)) for i in range(4)]
        with pytest.raises(Exception, match="the replica died"):
            await client.generate(GenerationRequest("r4", [1, 2], 1))
        return out

    results = asyncio.run(go())
    assert all(type(r) is GenerationResult for r in results) and [r.replica_id for r in results] == ["a", "b", "a", "a"]
    # the latest figures of each replica by requests answered (a reply overtaken in flight does not go back)
    assert client.stats == {
        "a": {"replica_id": "a", "completed_requests": 3},
        "b": {"replica_id": "b", "completed_requests": 1},
    }
    assert client.died == 1


def test_a_replica_streams_typed_chunks_then_its_result_and_the_same_as_openai_events(model):
    from replica.continuous import ServingReplica, StreamChunk

    replica = ServingReplica(model=model, replica_id="r0", model_spec="tiny-llama", engine_config={"policy": "full"})

    async def go():
        typed = [ev async for ev in replica.events(GenerationRequest("a", [1, 2, 3], 4))]
        wire = [ev async for ev in replica.stream(GenerationRequest("b", [1, 2, 3], 4))]
        return typed, wire

    try:
        typed, wire = asyncio.run(go())
    finally:
        replica.shutdown()
    *chunks, result = typed
    assert all(type(c) is StreamChunk and len(c.token_ids) == 1 and c.replica_id == "r0" for c in chunks)
    assert type(result) is GenerationResult and result.error_kind is None
    assert [c.token_ids[0] for c in chunks] == result.output_ids and [c.time_s for c in chunks] == result.token_times_s
    assert [ev["token_id"] for ev in wire[:-1]] == result.output_ids  # greedy: the same ids
    assert wire[-1]["result"]["output_ids"] == result.output_ids and set(wire[-1]) == {"result"}


def test_only_the_max_batch_mode_is_sized_by_memory(tmp_path):
    assert _suite(tmp_path, mode="max_batch", kv_memory_limit_bytes=10**6).sized_by_memory
    assert not _suite(tmp_path, mode="serving-batch", loads=[2]).sized_by_memory
