"""A completion cut by a stop string ended as its client asked: the client, the replica's counters and the live
metrics classify it alike (replica/openai_api.py `_Stoppable`, `ContinuousBatchingEngine.finish`)."""

from __future__ import annotations

import pytest
import requests

from replica.common.types import OUTCOMES, GenerationResult
from replica.continuous import ServingReplica
from replica.openai_api import ReplicaBackend, build_app, cache_metadata
from tests.http_fakes import ServerThread, char_tokenizer, sse_events
from tests.waiting import wait_for

MODEL = "tiny:full"


@pytest.fixture(scope="module")
def service(model):
    tok = char_tokenizer()
    replica = ServingReplica(model=model, replica_id=MODEL, model_spec="tiny-llama")
    replica.eos_token_id = tok.eos_token_id
    replica.configure(dict(kv_memory_limit_bytes=None))
    app = build_app({MODEL: ReplicaBackend(replica, cache_metadata({}, None, "tiny-llama"))}, tok, context_tokens=256)
    with ServerThread(app) as url:
        yield url, replica
    replica.shutdown()


def _post(url, body, stream=False):
    return requests.post(url + "/v1/completions", json=body, stream=stream, timeout=60)


def _counts(replica) -> tuple[int, int, int]:
    """(completed, failed, TTFT observations) of measured requests since the replica's engine was built."""
    s = replica.engine.stats()
    ttft = replica.engine.metrics.snapshot().get("scissorhands_ttft_seconds", (0, 0.0))
    return s["completed_requests"], s["failed_requests"], ttft[0]


def test_completions_stopped_by_a_stop_string_are_completed_with_their_ttft_observed(service):
    url, replica = service
    body = dict(model=MODEL, prompt="abc", max_tokens=12, ignore_eos=True)
    text = _post(url, body).json()["choices"][0]["text"]
    stop = text[2]  # the greedy text hits it at its third character (or earlier)
    k = text.find(stop)
    assert 0 <= k <= 2 and len(text) > 3
    before = _counts(replica)
    for i in range(2):
        r = _post(url, dict(body, stop=[stop])).json()
        assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == text[:k]
    events = list(sse_events(_post(url, dict(body, stop=stop, stream=True), stream=True)))
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[:k]
    after = wait_for(
        lambda: (c := _counts(replica))[0] - before[0] == 3 and c,
        10,
        "the replica counting the 3 stopped completions",
        poll_s=0.05,
    )
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (3, 0, 3)


def test_a_client_that_goes_away_mid_stream_is_an_abort_and_its_ttft_is_still_observed(service):
    url, replica = service
    before = _counts(replica)
    with _post(url, dict(model=MODEL, prompt="abc", max_tokens=200, ignore_eos=True, stream=True), stream=True) as r:
        next(r.iter_lines())  # the first token's event arrived: the client leaves
    after = wait_for(lambda: (c := _counts(replica))[1] > before[1] and c, 10, "the replica counting the abort")
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (0, 1, 1)


@pytest.mark.parametrize(
    "fields, outcome",
    [
        (dict(finish_reason="stop"), "stop"),
        (dict(finish_reason="eos"), "stop"),
        (dict(finish_reason="length"), "length"),
        (dict(finish_reason="error", error_kind="aborted"), "abort"),
        (dict(finish_reason="error", error_kind="rejected"), "error"),
        (dict(finish_reason="error", error_kind="oom"), "error"),
        (dict(), None),
    ],
)
def test_every_result_has_one_outcome(fields, outcome):
    result = GenerationResult("r", 3, **fields)
    assert result.outcome == outcome and (outcome is None or outcome in OUTCOMES)
