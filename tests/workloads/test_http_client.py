"""The load generator's HTTP client (workloads/load/http_client.py) against a fake SSE server on a free
loopback port: every reply is scripted, so the counts and timestamps are exact."""

from __future__ import annotations

import asyncio
import json

import pytest

from replica.common.types import GenerationRequest
from tests.http_fakes import ServerThread
from workloads.load.driver import run_load
from workloads.load.http_client import HTTPGenerationResult, OpenAIHTTPClient, _read_usage_and_times, _status_kind
from workloads.load.patterns import LoadConfig


def _chunk(text=None, ids=None, finish=None, **extra) -> dict:
    c = {"index": 0, "text": text if text is not None else "", "finish_reason": finish}
    if ids is not None:
        c["token_ids"] = ids
    return {"id": "x", "object": "text_completion", "choices": [c], **extra}


def fake_app(script: dict):
    """A FastAPI app whose POST /v1/completions replays `script[prompt[0]]`: a list of events (dicts,
    raw strings) or `("status", code, body)`; `sleep` entries pause between events."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    app.state.bodies = []

    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        events = script[body["prompt"][0]]
        if isinstance(events, tuple):
            return JSONResponse(events[2], status_code=events[1])

        async def gen():
            for ev in events:
                if isinstance(ev, float):
                    await asyncio.sleep(ev)
                elif isinstance(ev, str):
                    yield ev.encode()
                else:
                    yield b"data: " + json.dumps(ev).encode() + b"\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    completions.__annotations__["request"] = Request  # (postponed annotations: name the class itself)
    app.post("/v1/completions")(completions)
    return app


DONE = "data: [DONE]\n\n"
SCRIPT = {
    # our server's form: one id per chunk, usage last
    1: [
        _chunk("a", [5]),
        0.05,
        _chunk("b", [6]),
        0.05,
        _chunk("c", [7]),
        _chunk("", [], "length", scissorhands={"replica_ttft_s": 0.0125, "replica_id": "rep-a"}),
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
        DONE,
    ],
    # several tokens in one chunk: 4 ids in 2 chunks
    2: [_chunk("ab", [5, 6]), 0.05, _chunk("cd", [7, 8], "length"), DONE],
    # no token ids, usage says 4 over 2 chunks (a foreign server)
    3: [
        _chunk("ab"),
        0.05,
        _chunk("cd", finish="length"),
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
        DONE,
    ],
    # a reply with no chunks at all
    4: [DONE],
    # an empty chunk between tokens (no text, no ids) is not a token
    5: [_chunk("a", [5]), _chunk(""), _chunk("b", [6]), DONE],
    # an error event mid-stream (a replica that died)
    6: [_chunk("a", [5]), {"error": {"message": "replica died", "code": "replica_died"}}, DONE],
    # the server stops without [DONE]
    7: [_chunk("a", [5])],
    8: ("status", 429, {"error": {"message": "queue full", "code": "queue_full"}}),
    9: ("status", 404, {"error": {"message": "model: nope", "param": "model"}}),
    # neither ids nor usage: one token per chunk with text, said in the record
    10: [_chunk("a"), _chunk("b"), DONE],
    # our server when the replica died before the first token: 503 with code replica_died
    11: (
        "status",
        503,
        {
            "error": {
                "message": "the model's replica is unavailable (ActorDiedError)",
                "type": "server_error",
                "code": "replica_died",
            }
        },
    ),
    # any other error event mid-stream
    12: [_chunk("a", [5]), {"error": {"message": "RuntimeError: boom", "code": None}}, DONE],
    # a prefix cache's or a session's kept tokens in OpenAI's usage.prompt_tokens_details
    13: [
        _chunk("a", [5], "length"),
        {
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 2}},
        },
        DONE,
    ],
}


@pytest.fixture(scope="module")
def server():
    app = fake_app(SCRIPT)
    with ServerThread(app) as url:
        yield url + "/v1", app


def _gen(url, first_id, n=4, **kw):
    async def go():
        client = OpenAIHTTPClient(url, "m", **kw)
        try:
            return await client.generate(GenerationRequest(f"r{first_id}", [first_id, 2, 3], n))
        finally:
            await client.close()

    return asyncio.run(go())


def test_one_token_per_chunk_timestamped_at_arrival_and_replica_ttft_apart(server):
    url, app = server
    r = _gen(url, 1, n=3)
    assert r.error_kind is None and r.output_ids == [5, 6, 7] and r.output_tokens_source == "token_ids"
    gaps = [b - a for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    assert all(g > 0 for g in gaps)  # separate arrivals (the server pauses 50 ms; no timing bound)
    assert r.replica_ttft_s == 0.0125 and r.replica_id == "rep-a"  # the server's own TTFT, kept apart
    body = app.state.bodies[-1]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 3 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True


def test_several_tokens_in_one_chunk_share_its_arrival_time(server):
    url, _ = server
    r = _gen(url, 2)
    assert r.output_ids == [5, 6, 7, 8] and r.output_tokens == 4
    t = r.token_times_s
    assert len(t) == 4 and t[0] == t[1] and t[2] == t[3] and t[2] > t[1]


def test_usage_counts_tokens_when_the_server_sends_no_ids(server):
    url, _ = server
    r = _gen(url, 3)
    assert r.output_tokens == 4 and r.output_tokens_source == "usage" and r.output_ids == [-1] * 4
    assert r.token_times_s[1] > r.token_times_s[0] and r.token_times_s[1:] == [r.token_times_s[1]] * 3


def test_no_chunks_and_empty_chunks(server):
    url, _ = server
    none = _gen(url, 4)
    assert none.error_kind is None and none.output_ids == [] and none.token_times_s == []
    empty = _gen(url, 5)
    assert empty.output_ids == [5, 6] and len(empty.token_times_s) == 2
    guessed = _gen(url, 10)
    assert guessed.output_tokens == 2 and guessed.output_tokens_source == "chunks"


@pytest.mark.parametrize(
    "first_id, kind",
    [
        (6, "replica_died"),
        (7, "stream_truncated"),
        (8, "overloaded"),
        (9, "unknown_model"),
        (11, "replica_died"),
        (12, "server_error"),
    ],
)
def test_errors_are_named_kinds(server, first_id, kind):
    url, _ = server
    r = _gen(url, first_id)
    assert r.error_kind == kind and r.error


@pytest.mark.parametrize(
    "status, code, kind",
    [
        (503, "oom", "oom"),
        (503, "queue_full", "overloaded"),
        (429, "queue_full", "overloaded"),
        (503, None, "overloaded"),
    ],
)
def test_an_out_of_memory_503_is_oom_not_a_refusal_for_load(status, code, kind):
    """Our server answers 503 both when its queue is full and when the replica ran out of memory; only the first is a
    refusal for load (a point of attainment 0), the second is the point's `oom`."""
    assert _status_kind(status, code) == kind


def test_connection_refused_is_a_named_kind():
    from tests.waiting import free_port

    r = _gen(f"http://127.0.0.1:{free_port()}/v1", 1)
    assert r.error_kind == "connection_error"


def test_bad_target_names_the_field():
    with pytest.raises(ValueError, match="target"):
        OpenAIHTTPClient("127.0.0.1:8000", "m")


def test_the_load_generator_drives_the_http_client(server):
    url, _ = server
    reqs = [GenerationRequest(f"q{i}", [2, 9, 9], 4) for i in range(6)]

    async def go():
        client = OpenAIHTTPClient(url, "m")
        try:
            return await run_load(client, reqs, LoadConfig(mode="concurrency", concurrency=3, num_requests=6))
        finally:
            await client.close()

    res = asyncio.run(go())
    m = res.metrics
    assert m.completed_requests == 6 and m.output_tokens == 24 and m.ttft_s.n == 6
    assert all(r.output_tokens == 4 and len(r.token_times_s) == 4 for r in res.records)


def test_records_keep_client_and_replica_ttft_apart(server, model):
    """Over HTTP the record's ttft_s is the client's and replica_ttft_s the server's own figure; for an
    in-process replica replica_ttft_s is first token - received on the replica's clock."""
    from replica.continuous import ServingReplica

    url, _ = server
    reqs = [GenerationRequest(f"p{i}", [1, 2, 3], 3) for i in range(2)]

    async def go(client):
        return await run_load(client, reqs, LoadConfig(mode="concurrency", concurrency=1, num_requests=2))

    async def over_http():
        client = OpenAIHTTPClient(url, "m")
        try:
            return await go(client)
        finally:
            await client.close()

    res = asyncio.run(over_http())
    assert [r.replica_ttft_s for r in res.records] == [0.0125, 0.0125]
    assert all(r.output_tokens_source == "token_ids" and r.ttft_s > 0 for r in res.records)
    assert res.metrics.replica_ttft_s.n == 2 and res.metrics.replica_ttft_s.p50_s == 0.0125
    assert res.metrics.flat()["replica_ttft_p50_s"] == 0.0125

    replica = ServingReplica(model=model, replica_id="local", model_spec="tiny-llama", engine_config={})
    try:
        local = asyncio.run(go(replica))
    finally:
        replica.shutdown()
    assert all(r.replica_ttft_s is not None and 0 <= r.replica_ttft_s <= r.ttft_s + 1e-6 for r in local.records)


def test_the_servers_cached_prompt_tokens_are_read_from_usage_and_none_when_it_does_not_say(server):
    url, _ = server
    assert _gen(url, 13, n=1).cached_prompt_tokens == 2
    assert _gen(url, 1, n=3).cached_prompt_tokens is None  # usage without prompt_tokens_details: not reported
    assert _gen(url, 10).cached_prompt_tokens is None  # no usage at all


@pytest.mark.parametrize("cached", [True, False, -1, -40, 2.5, "3", None])
def test_a_boolean_negative_or_non_integer_cached_token_count_is_not_reported(cached):
    final = HTTPGenerationResult("r", 3)
    ev = {"usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached}}}
    _read_usage_and_times(ev, final, None)
    assert final.cached_prompt_tokens is None


@pytest.mark.parametrize("cached", [0, 2])
def test_a_non_negative_integer_cached_token_count_is_read(cached):
    final = HTTPGenerationResult("r", 3)
    ev = {"usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached}}}
    _read_usage_and_times(ev, final, None)
    assert final.cached_prompt_tokens == cached
