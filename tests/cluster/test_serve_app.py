"""The OpenAI-compatible service through a real Ray Serve app on the embedded model (slow: one Serve
start, two engine deployments): routing, streaming, a disconnect that frees the row, and a replica
killed mid-stream (its open stream ends with an error event; Serve replaces the replica)."""

from __future__ import annotations

import asyncio
import time

import pytest
import requests

from replica.common.types import GenerationRequest, GenerationResult
from tests.http_fakes import sse_events
from tests.ray_helpers import local_serve_app

pytestmark = [pytest.mark.slow, pytest.mark.ray]

FULL = "smollm2-135m-instruct:full"
SH = "smollm2-135m-instruct:scissorhands-x5"


@pytest.fixture(scope="module")
def app_url():
    with local_serve_app(
        "embedded", ["full", "scissorhands:5"], replica_cpus=0.5, kv_memory_limit_bytes=64 << 20
    ) as port:
        yield f"http://127.0.0.1:{port}"


def _engine(label: str):
    from ray import serve

    from cluster.serve_app import APP_NAME

    return serve.get_deployment_handle(f"engine-{label}", app_name=APP_NAME)


def _wait(pred, timeout_s):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if pred():
                return True
        except Exception:  # noqa: BLE001 - a replica being replaced
            pass
        time.sleep(0.5)
    return False


def test_models_routing_and_exact_lengths(app_url):
    data = requests.get(app_url + "/v1/models", timeout=30).json()["data"]
    meta = {m["id"]: m["metadata"] for m in data}
    assert set(meta) == {FULL, SH}
    assert meta[SH]["budget"] == "per_request" and meta[SH]["budget_tokens"] is None  # B_i = ceil((p + n) / 5)
    assert meta[SH]["compression_ratio"] == 5 and meta[SH]["kv_layout"] == meta[FULL]["kv_layout"] == "paged"
    assert {m["max_model_len"] for m in data} == {8192}  # the embedded SmolLM2's context, from its config
    replicas = set()
    for model in (FULL, SH):
        r = requests.post(
            app_url + "/v1/completions",
            json=dict(model=model, prompt="The capital of France is", max_tokens=16, ignore_eos=True),
            timeout=300,
        ).json()
        assert r["usage"]["completion_tokens"] == len(r["choices"][0]["token_ids"]) == 16
        replicas.add(r["scissorhands"]["replica_id"].split("#")[0])
    assert replicas == {FULL, SH}
    too_long = requests.post(app_url + "/v1/completions", json=dict(model=SH, prompt="x", max_tokens=9000), timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"


def test_streamed_chat_one_event_per_token(app_url):
    # the full cache: this test checks the stream, not compression (what x5 answers to this chat, under its budget
    # floor: tests/replica/test_request_budgets.py)
    r = requests.post(
        app_url + "/v1/chat/completions",
        stream=True,
        timeout=300,
        json=dict(
            model=FULL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        ),
    )
    assert r.status_code == 200
    events = list(sse_events(r))
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    ids = [i for e in events[1:-2] for i in e["choices"][0]["token_ids"]]
    assert len(ids) == events[-2]["usage"]["completion_tokens"] >= 1
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-2])
    assert "Paris" in text


def test_disconnect_frees_the_row(app_url):
    eng = _engine("scissorhands-x5")
    before = eng.stats.remote().result()
    r = requests.post(
        app_url + "/v1/completions",
        stream=True,
        timeout=300,
        json=dict(model=SH, prompt="Tell me a long story.", max_tokens=400, ignore_eos=True, stream=True),
    )
    it = sse_events(r)
    for _ in range(3):
        next(it)
    assert eng.stats.remote().result()["running_sequences"] == 1
    r.close()
    assert _wait(lambda: eng.stats.remote().result()["running_sequences"] == 0, 60)
    after = eng.stats.remote().result()
    assert after["failed_requests"] == before["failed_requests"] + 1 and after["kv_cache_bytes"] == 0
    assert after["generated_tokens"] - before["generated_tokens"] < 400


def test_replica_killed_mid_stream_ends_with_an_error_and_is_replaced(app_url):
    from workloads.load.http_client import OpenAIHTTPClient

    eng = _engine("full")

    async def go():
        client = OpenAIHTTPClient(app_url + "/v1", FULL)
        got = []
        try:
            async for chunk in client.events(GenerationRequest("k", list(range(100, 140)), 400)):
                got.append(chunk)
                if len(got) == 3:
                    try:
                        eng.crash.remote()
                    except Exception:  # noqa: BLE001
                        pass
        finally:
            await client.close()
        return got

    chunks = asyncio.run(asyncio.wait_for(go(), 300))
    assert chunks[-1].error_kind == "replica_died", chunks[-1]  # one named kind (ActorDiedError seen here)
    assert sum(len(c.output_ids if isinstance(c, GenerationResult) else c.token_ids) for c in chunks) < 400

    def ok() -> bool:
        body = dict(model=FULL, prompt=[1, 2, 3], max_tokens=2, ignore_eos=True)
        return requests.post(app_url + "/v1/completions", timeout=60, json=body).status_code == 200

    assert _wait(ok, 240), "Serve did not replace the killed replica"
