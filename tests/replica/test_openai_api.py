"""The OpenAI-compatible API (replica.openai_api) over in-process replicas of the tiny model, through
real HTTP on a free loopback port (uvicorn in a thread)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import requests

from replica.common.types import GenerationRequest
from replica.continuous import ServingReplica
from replica.openai_api import ReplicaBackend, build_app, cache_metadata
from tests.http_fakes import ServerThread, char_tokenizer, sse_events
from tests.waiting import wait_for
from workloads import sweep
from workloads.load.http_client import OpenAIHTTPClient

FULL = "tiny:full"
SH = "tiny:scissorhands-b16"
SH_CFG = dict(policy="scissorhands", budget_tokens=16, policy_params=dict(history_window=20, count_chunk_steps=5))
CONTEXT = 256


@pytest.fixture(scope="module")
def service(model):
    tok = char_tokenizer()
    replicas = {}
    for name, cfg in ((FULL, dict(kv_memory_limit_bytes=None)), (SH, SH_CFG)):
        r = ServingReplica(model=model, replica_id=name, model_spec="tiny-llama")
        r.eos_token_id = tok.eos_token_id
        r.configure(cfg)
        replicas[name] = r
    # the full cache's KV limit: room for one sequence of 150 tokens, so 200 can never fit
    full = replicas[FULL]
    full.configure(dict(kv_memory_limit_bytes=150 * full.engine.slot_bytes))
    backends = {
        m: ReplicaBackend(r, cache_metadata({}, r.engine.budget_tokens, "tiny-llama")) for m, r in replicas.items()
    }
    app = build_app(backends, tok, context_tokens=CONTEXT, max_pending_requests=2)
    with ServerThread(app) as url:
        yield url, replicas, tok
    for r in replicas.values():
        r.shutdown()


def post(url, path, body, stream=False):
    return requests.post(url + path, json=body, stream=stream, timeout=60)


def sse(resp) -> list:
    """Every `data:` payload of an SSE reply."""
    return list(sse_events(resp))


def test_models_and_health_list_one_id_per_cache(service):
    url, replicas, _ = service
    data = requests.get(url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == [FULL, SH]
    assert data[1]["metadata"]["budget_tokens"] == 16 and data[0]["metadata"]["budget_tokens"] is None
    assert requests.get(url + "/health", timeout=10).json()["status"] == "ok"


@pytest.mark.parametrize("model_id", [FULL, SH])
def test_completion_not_streamed_usage_equals_ids_and_two_models_route_to_two_caches(service, model_id):
    url, replicas, tok = service
    before = {m: r.engine.stats()["completed_requests"] for m, r in replicas.items()}
    r = post(url, "/v1/completions", dict(model=model_id, prompt="Hello there, cache", max_tokens=7, ignore_eos=True))
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    # prefix caching off: no cached-token count, as vLLM answers then (prompt_tokens_details null)
    usage = dict(prompt_tokens=18, completion_tokens=7, total_tokens=25, prompt_tokens_details=None)
    assert len(ch["token_ids"]) == 7 and body["usage"] == usage
    assert ch["finish_reason"] == "length" and ch["text"] == tok.decode(ch["token_ids"], skip_special_tokens=True)
    after = {m: r.engine.stats()["completed_requests"] for m, r in replicas.items()}
    assert {m: after[m] - before[m] for m in after} == {m: int(m == model_id) for m in after}
    assert body["scissorhands"]["replica_id"] == model_id and body["scissorhands"]["replica_ttft_s"] >= 0


def test_streamed_completion_sends_one_event_per_token_then_usage_then_done(service):
    url, replicas, tok = service
    prompt = tok("Stream me")["input_ids"]
    r = post(
        url,
        "/v1/completions",
        dict(
            model=SH, prompt=prompt, max_tokens=9, ignore_eos=True, stream=True, stream_options={"include_usage": True}
        ),
        stream=True,
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9 and usage["usage"]["prompt_tokens"] == 9
    token_chunks = [e for e in events[:-2] if e["choices"][0]["token_ids"]]
    assert len(token_chunks) == 9 and all(len(e["choices"][0]["token_ids"]) == 1 for e in token_chunks)
    final = events[-3]
    assert final["choices"][0]["finish_reason"] == "length" and final["scissorhands"]["replica_ttft_s"] >= 0
    ids = [e["choices"][0]["token_ids"][0] for e in token_chunks]
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == tok.decode(ids, skip_special_tokens=True)
    # the same request not streamed gives the same ids (greedy)
    plain = post(url, "/v1/completions", dict(model=SH, prompt=prompt, max_tokens=9, ignore_eos=True)).json()
    assert plain["choices"][0]["token_ids"] == ids


def test_chat_uses_the_chat_template(service):
    url, replicas, tok = service
    msgs = [{"role": "user", "content": "yo"}]
    r = post(url, "/v1/chat/completions", dict(model=FULL, messages=msgs, max_tokens=3, ignore_eos=True))
    assert r.status_code == 200, r.text
    expected_prompt = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert r.json()["usage"]["prompt_tokens"] == expected_prompt == 21
    assert r.json()["object"] == "chat.completion" and r.json()["choices"][0]["message"]["role"] == "assistant"
    s = post(
        url,
        "/v1/chat/completions",
        dict(model=FULL, messages=msgs, max_tokens=3, ignore_eos=True, stream=True),
        stream=True,
    )
    events = sse(s)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[-1] == "[DONE]"
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[1:-1]) == 3
    assert (
        "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-1])
        == r.json()["choices"][0]["message"]["content"]
    )


def test_min_tokens_and_stop(service):
    url, replicas, tok = service
    base = post(url, "/v1/completions", dict(model=FULL, prompt="abc", max_tokens=12, ignore_eos=True)).json()
    text = base["choices"][0]["text"]
    stop = next((text[i : i + 1] for i in range(2, len(text)) if text[i : i + 1].strip()), None)
    if stop is None:
        pytest.skip("the tiny model's greedy text has no visible character to stop at")
    k = text.find(stop)
    r = post(url, "/v1/completions", dict(model=FULL, prompt="abc", max_tokens=12, ignore_eos=True, stop=[stop])).json()
    assert r["choices"][0]["text"] == text[:k] and r["choices"][0]["finish_reason"] == "stop"
    s = sse(
        post(
            url,
            "/v1/completions",
            dict(model=FULL, prompt="abc", max_tokens=12, ignore_eos=True, stop=stop, stream=True),
            stream=True,
        )
    )
    assert (
        "".join(e["choices"][0]["text"] for e in s[:-1]) == text[:k] and s[-2]["choices"][0]["finish_reason"] == "stop"
    )


@pytest.mark.parametrize(
    "body, status, param",
    [
        (dict(model=FULL, prompt="x", max_tokens="5"), 400, "max_tokens"),
        (dict(model=FULL, prompt="x", max_tokens=0), 400, "max_tokens"),
        (dict(model=FULL, prompt="x" * 200, max_tokens=100), 400, "max_tokens"),  # beyond the context (256)
        (dict(model=FULL, prompt="x" * 150, max_tokens=60), 400, "max_tokens"),  # never fits the KV limit
        (dict(model="nope", prompt="x", max_tokens=5), 404, "model"),
        (dict(model=FULL, prompt="x", max_tokens=5, n=2), 400, "n"),
        (dict(model=FULL, prompt=3, max_tokens=5), 400, "prompt"),
        (dict(model=FULL, prompt="x", max_tokens=5, temperature="hot"), 400, "temperature"),
        (dict(model=FULL, prompt="x", max_tokens=5, top_p=0), 400, "top_p"),
        (dict(model=FULL, prompt="x", max_tokens=5, stream="yes"), 400, "stream"),
        (dict(model=FULL, prompt="x", max_tokens=5, ignore_eos=1), 400, "ignore_eos"),
        (dict(model=FULL, prompt="x", max_tokens=5, stop=7), 400, "stop"),
        (dict(model=SH, messages="hi", max_tokens=5), 400, "messages"),
    ],
)
def test_errors_are_openai_error_json_naming_the_field(service, body, status, param):
    url, _, _ = service
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    for stream in (False, True):
        r = post(url, path, {**body, "stream": body.get("stream", stream)})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"]


def test_invalid_json_is_a_400(service):
    url, _, _ = service
    r = requests.post(url + "/v1/completions", data=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def _wait(pred, timeout_s=20.0):
    return wait_for(pred, timeout_s, "the engine to free the request's row", poll_s=0.02)


def test_client_disconnect_mid_stream_frees_the_slots(service):
    url, replicas, _ = service
    eng = replicas[SH].engine
    assert _wait(lambda: eng.running == 0)
    aborted0 = eng.stats()["failed_requests"]
    r = post(
        url,
        "/v1/completions",
        dict(model=SH, prompt="go on and on", max_tokens=200, ignore_eos=True, stream=True),
        stream=True,
    )
    lines = r.iter_lines()
    got = 0
    for line in lines:
        if line.startswith(b"data: "):
            got += 1
            if got == 3:
                break
    assert eng.running == 1
    r.close()  # the client goes away mid-stream
    assert _wait(lambda: eng.running == 0), "the aborted request still holds its row"
    assert eng.stats()["kv_cache_bytes"] == 0 and eng.stats()["failed_requests"] == aborted0 + 1
    assert eng.stats()["generated_tokens"] < 200 + 1000


def test_queue_bound_answers_429_with_retry_after(service):
    url, replicas, _ = service
    body = dict(model=SH, prompt="hold", max_tokens=150, ignore_eos=True, stream=True)
    held = [post(url, "/v1/completions", body, stream=True) for _ in range(2)]  # max_pending_requests=2
    try:
        assert all(h.status_code == 200 for h in held)
        r = post(url, "/v1/completions", {**body, "stream": False})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        for h in held:
            h.close()
    assert _wait(lambda: replicas[SH].engine.running == 0)


def test_a_suite_with_a_target_drives_the_server_over_http(model, tmp_path):
    """`target:` + `model:` in a serving suite: the sweep drives the named served model over HTTP."""
    import argparse

    from workloads.core import results as res
    from workloads.core.run import SweepError
    from workloads.core.template import run_suite
    from workloads.serving.runner import KIND as SERVING

    r = ServingReplica(model=model, replica_id="sh", model_spec="tiny-llama")
    r.configure(SH_CFG)
    app = build_app({SH: ReplicaBackend(r, cache_metadata(SH_CFG, 16, "tiny-llama"))}, None)  # ids only
    try:
        with ServerThread(app) as url:
            suite = tmp_path / "http.yaml"
            suite.write_text(
                f"kind: serving\nname: http\nmode: concurrency\ntarget: {url}/v1\nmodel: '{SH}'\ntokenizer: tiny-llama\n"
                "policies: [full]\nloads: [2]\nprompt_tokens: 12\nnew_tokens: 5\nnum_requests: 6\n"
                "warmup_requests: 0\n"
            )
            args = sweep.parse_args(
                [str(suite), "--results-dir", str(tmp_path / "r"), "--run-id", "run", "--pushgateway", "off"]
            )
            assert run_suite(args, SERVING) == 0
            bad = tmp_path / "bad.yaml"
            bad.write_text(suite.read_text().replace(f"'{SH}'", "nope"))
            with pytest.raises(SweepError, match="model: 'nope' is not served"):  # exit status 1
                run_suite(argparse.Namespace(**{**vars(args), "suite": str(bad), "run_id": "bad"}), SERVING)
    finally:
        r.shutdown()
    (rec,) = res.read_records(str(tmp_path / "r" / "run" / "points.jsonl"))
    assert rec["status"] == "ok" and rec["target"] == f"{url}/v1" and rec["model_id"] == SH
    assert rec["completed_requests"] == 6 and rec["output_tokens"] == 30 and rec["budget_tokens"] == 16


def test_pending_count_returns_to_zero_after_every_kind_of_ending(service):
    """Streams read to the end, cut by a stop string, dropped mid-way, refused: none leaks its place
    under the 429 bound (max_pending_requests=2): three more requests in a row still get 200."""
    url, replicas, _ = service
    post(url, "/v1/completions", dict(model=SH, prompt="a", max_tokens=3, ignore_eos=True, stream=True)).close()
    r = post(
        url, "/v1/completions", dict(model=SH, prompt="b", max_tokens=50, ignore_eos=True, stream=True), stream=True
    )
    r.close()
    post(url, "/v1/completions", dict(model=FULL, prompt="x" * 150, max_tokens=60))  # refused (400)
    assert _wait(lambda: replicas[SH].engine.running == 0)
    for _ in range(3):
        assert post(url, "/v1/completions", dict(model=SH, prompt="c", max_tokens=2)).status_code == 200


def test_warm_up_travels_over_http_so_server_and_client_count_the_same_requests(service):
    """Over HTTP: a rate-mode point with a time-based warm-up (`warmup_s`) sent by the
    HTTP client; the replica's measured counts equal the client's measured records (and its warm-up
    counts the client's warm-up records), because the client sends `X-Scissorhands-Phase: warmup`."""
    import asyncio

    from replica.openai_api import PHASE_HEADER
    from workloads.load.driver import run_load
    from workloads.load.patterns import LoadConfig

    url, replicas, _ = service
    eng = replicas[SH].engine
    assert _wait(lambda: eng.running == 0)
    eng.reset_stats()
    tokens0 = {
        ph: eng.metrics.snapshot(ph).get("scissorhands_generated_tokens_total", 0) for ph in ("measured", "warmup")
    }
    reqs = [GenerationRequest(f"w{i}", [5, 6, 7, 8], 3) for i in range(40)]
    cfg = LoadConfig(
        mode="rate", rate_req_per_s=20.0, num_requests=4, warmup_s=0.3, seed=3, max_concurrency=2
    )  # the fixture answers 429 past 2 in flight

    async def go():
        client = OpenAIHTTPClient(url + "/v1", SH)
        try:
            assert client.headers(reqs[0]) == {} and client.headers(replace(reqs[0], warmup=True)) == {
                PHASE_HEADER: "warmup"
            }
            return await run_load(client, reqs, cfg)
        finally:
            await client.close()

    res = asyncio.run(go())
    warm = [r for r in res.records if r.warmup]
    measured = [r for r in res.records if not r.warmup]
    assert len(measured) == 4 and len(warm) >= 1 and all(r.error_kind is None for r in res.records)
    assert _wait(lambda: eng.running == 0 and eng.queued == 0)
    s = eng.stats()
    assert (
        (s["received_requests"], s["completed_requests"], s["generated_tokens"])
        == (4, 4, 12)
        == (len(measured), res.metrics.completed_requests, res.metrics.output_tokens)
    )
    assert (s["warmup_received_requests"], s["warmup_generated_tokens"]) == (len(warm), 3 * len(warm))
    # the live metrics label the same split (in memory here: no Ray)
    tokens = {ph: eng.metrics.snapshot(ph)["scissorhands_generated_tokens_total"] - tokens0[ph] for ph in tokens0}
    assert tokens == {"measured": 12, "warmup": 3 * len(warm)}
    bad = post_headers(url, {PHASE_HEADER: "cooldown"}, dict(model=SH, prompt=[1, 2], max_tokens=1))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == PHASE_HEADER


def post_headers(url, headers, body):
    return requests.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


class _DyingBackend:
    """A backend whose replica process dies after `tokens` tokens: the stream raises Ray's actor-death
    error wrapped the way Serve's handle can hand it over (as the cause of another exception)."""

    metadata: dict = {}

    def __init__(self, tokens: int):
        self.tokens = tokens

    async def check(self, prompt_tokens, max_new_tokens, logprobs=False):
        return None

    async def stream(self, request):
        class ActorDiedError(Exception):  # Ray's class, matched by name (no Ray imported here)
            pass

        for i in range(self.tokens):
            yield {"token_id": 5 + i, "time_s": 0.0}
        try:
            raise ActorDiedError("The actor died unexpectedly before finishing this task.")
        except ActorDiedError as e:
            raise RuntimeError("the replica's stream failed") from e


@pytest.mark.parametrize("tokens", [0, 2])
def test_a_replica_that_dies_is_one_named_error_kind_before_and_after_the_first_token(tokens):
    """a replica that dies mid-stream (or before its first token) is recorded by the load
    generator as an error of the one kind `replica_died` (not `server_error`, not `overloaded`), and the
    point is still summarized."""
    import asyncio

    from workloads.load.driver import run_load
    from workloads.load.patterns import LoadConfig

    app = build_app({"m": _DyingBackend(tokens)}, None)
    with ServerThread(app) as url:
        if tokens == 0:
            r = post(url, "/v1/completions", dict(model="m", prompt=[1, 2], max_tokens=4, stream=True))
            assert r.status_code == 503 and r.json()["error"]["code"] == "replica_died"

        async def go():
            client = OpenAIHTTPClient(url + "/v1", "m")
            try:
                return await run_load(
                    client,
                    [GenerationRequest(f"d{i}", [1, 2], 4) for i in range(3)],
                    LoadConfig(mode="concurrency", concurrency=1, num_requests=3),
                )
            finally:
                await client.close()

        res = asyncio.run(go())
    assert res.metrics.errors_by_kind == {"replica_died": 3} and res.metrics.completed_requests == 0
    assert [r.output_tokens for r in res.records] == [tokens] * 3


def test_the_load_generator_names_a_wrapped_replica_death_the_same():
    from workloads.load.driver import error_kind

    class ActorDiedError(Exception):
        pass

    class RayTaskError(Exception):
        def __init__(self, cause):
            super().__init__("task failed")
            self.cause = cause

    assert error_kind(RayTaskError(ActorDiedError("x"))) == "replica_died"
    try:
        try:
            raise ActorDiedError("x")
        except ActorDiedError:
            raise RuntimeError("wrapped")  # implicit __context__
    except RuntimeError as e:
        assert error_kind(e) == "replica_died"
    assert error_kind(RuntimeError("boom")) == "error"


# ---------------------------------------------------------------- fields refused, sampling ranges, logprobs and echo
@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/completions", "best_of", 2),
        ("/v1/completions", "logit_bias", {"50": 100}),
        ("/v1/completions", "frequency_penalty", 0.5),
        ("/v1/completions", "suffix", "!"),
        ("/v1/completions", "top_logprobs", 2),  # chat's field
        ("/v1/chat/completions", "echo", True),  # completions' field
        ("/v1/chat/completions", "best_of", 2),
        ("/v1/chat/completions", "tools", [{"type": "function"}]),
        ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ],
)
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(service, path, field, value):
    url, _, _ = service
    body = dict(model=FULL, max_tokens=3, **{field: value})
    body.update(dict(messages=[{"role": "user", "content": "hi"}]) if "chat" in path else dict(prompt="hi"))
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"{field!r}" in err["message"]
    assert post(url, path, {**body, field: None}).status_code == 200  # null is the default: accepted


def test_accepted_field_lists_name_every_parsed_field_and_refuse_the_known_unimplemented_ones():
    from replica.openai_fields import CHAT_FIELDS, COMPLETIONS_FIELDS, REFUSED_FIELDS

    assert {"prompt", "echo", "logprobs", "seed", "temperature", "top_p", "stop", "n"} <= COMPLETIONS_FIELDS
    assert {"messages", "logprobs", "top_logprobs", "max_completion_tokens"} <= CHAT_FIELDS
    assert not set(REFUSED_FIELDS) & (COMPLETIONS_FIELDS | CHAT_FIELDS)


def test_a_temperature_too_small_to_divide_by_is_greedy_and_its_batch_neighbours_succeed(service):
    """Three completions at once, one at temperature 5e-324: all succeed; that one is greedy (vLLM's rule)."""
    from concurrent.futures import ThreadPoolExecutor

    _, replicas, tok = service
    app = build_app({FULL: ReplicaBackend(replicas[FULL], {})}, tok, context_tokens=CONTEXT, max_pending_requests=8)
    base = dict(model=FULL, prompt="Same prompt!", max_tokens=6, ignore_eos=True)
    bodies = [
        {**base, "temperature": 5e-324},
        {**base, "temperature": 1.0, "seed": 1},
        {**base, "temperature": 1.0, "seed": 2**63 + 7},  # unsigned 64-bit: sampled with, not refused
    ]
    with ServerThread(app) as url, ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda b: post(url, "/v1/completions", b), bodies))
        greedy = post(url, "/v1/completions", base).json()["choices"][0]["token_ids"]
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    assert replies[0].json()["choices"][0]["token_ids"] == greedy
    assert len(replies[2].json()["choices"][0]["token_ids"]) == 6


@pytest.mark.parametrize(
    "extra, param",
    [
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=True), "logprobs"),
        (dict(echo="yes"), "echo"),
        (dict(logprobs=1, stream=True), "stream"),
        (dict(logprobs=1, stop=["x"]), "stop"),
    ],
)
def test_sampling_and_logprobs_values_out_of_range_are_a_400_naming_the_field(service, extra, param):
    url, _, _ = service
    r = post(url, "/v1/completions", dict(model=FULL, prompt="hi", max_tokens=3, **extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_completion_logprobs_are_the_models_with_top_k_and_text_offsets(service, model):
    import torch

    url, _, tok = service
    r = post(url, "/v1/completions", dict(model=FULL, prompt="Hello there", max_tokens=4, ignore_eos=True, logprobs=2))
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    # ids 99..127 of the tiny model have no entry in the char tokenizer: named by id, without text
    assert lp["tokens"] == [tok.decode([i]) if i < len(tok) else f"token_id:{i}" for i in ch["token_ids"]]
    assert lp["text_offset"] == [len(tok.decode(ch["token_ids"][:i])) for i in range(4)]
    prompt = tok("Hello there", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + ch["token_ids"]])).logits[0].float(), -1)
    for i, t in enumerate(ch["token_ids"]):
        row = logp[len(prompt) - 1 + i]
        assert lp["token_logprobs"][i] == pytest.approx(float(row[t]), abs=1e-4)
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(float(row.max()), abs=1e-4)  # greedy: the best
        assert len(lp["top_logprobs"][i]) == 2  # greedy: the token is the best of its 2 alternatives


def test_echo_with_no_new_tokens_returns_the_prompts_own_logprobs(service, model):
    import torch

    url, _, tok = service
    body = dict(model=FULL, prompt="Echo me, please", max_tokens=0, echo=True, logprobs=1)
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    reply = r.json()
    ch = reply["choices"][0]
    prompt = tok("Echo me, please", add_special_tokens=False)["input_ids"]
    assert ch["text"] == "Echo me, please" and ch["token_ids"] == [] and reply["usage"]["completion_tokens"] == 0
    lp = ch["logprobs"]
    assert lp["tokens"] == list("Echo me, please") and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    want = [float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    # lm-evaluation-harness's request: max_tokens 1, the last entry is the generated token's
    one = post(url, "/v1/completions", {**body, "max_tokens": 1}).json()["choices"][0]
    assert len(one["logprobs"]["token_logprobs"]) == len(prompt) + 1
    assert one["logprobs"]["token_logprobs"][1:-1] == pytest.approx(want, abs=1e-4)


def test_chat_logprobs_list_each_generated_token_with_its_top_alternatives(service):
    url, _, tok = service
    body = dict(model=FULL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, ignore_eos=True)
    r = post(url, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    content = ch["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["logprob"] <= 0 for c in content)
    for c, i in zip(content, ch["token_ids"]):  # an id the char tokenizer lacks is named by id, without bytes
        assert (c["token"], c["bytes"]) == (
            (tok.decode([i]), list(tok.decode([i]).encode())) if i < len(tok) else (f"token_id:{i}", None)
        )
    r = post(url, "/v1/chat/completions", {**body, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_every_position_has_as_many_alternatives_as_asked_on_the_tiny_model(service):
    """logprobs 20 over a vocabulary where 29 ids have no text (the char tokenizer's 99 of the model's 128):
    20 distinct keys at every position, best first, the token itself among them (greedy)."""
    url, _, tok = service
    body = dict(model=FULL, prompt="Hello there, world", max_tokens=6, ignore_eos=True, logprobs=20, echo=True)
    lp = post(url, "/v1/completions", body).json()["choices"][0]["logprobs"]
    n_prompt = len(tok("Hello there, world", add_special_tokens=False)["input_ids"])
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"]) == n_prompt + 6
    for i, top in enumerate(lp["top_logprobs"][1:], 1):
        values = list(top.values())
        # the 20 best, and the token itself after them only when it is not among them
        assert len(top) == 20 + (lp["tokens"][i] not in list(top)[:20]), i
        assert values[:20] == sorted(values[:20], reverse=True), i
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]
    for top in lp["top_logprobs"][n_prompt:]:  # generated greedily: each token is the best, so exactly 20
        assert len(top) == 20


PREFIX = "tiny:full-prefix"


@pytest.mark.parametrize("chat", [False, True])
def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(model, chat):
    """With the prefix cache on, ``usage.prompt_tokens_details.cached_tokens`` is the request's cached prompt tokens:
    0 for the first request, the full blocks of the shared prompt for the same prompt again (streamed or not; 4-token
    blocks, so 4 * floor((n - 1) / 4): the last prompt token is always fed); off, the field is null."""
    tok = char_tokenizer()
    cfg = dict(kv_layout="paged", block_tokens=4, kv_memory_limit_bytes=200_000, enable_prefix_caching=True)
    r = ServingReplica(model=model, replica_id="p", model_spec="tiny-llama")
    r.eos_token_id = tok.eos_token_id
    r.configure(cfg)
    off = ServingReplica(model=model, replica_id="off", model_spec="tiny-llama")
    off.configure(dict(kv_layout="paged", block_tokens=4, kv_memory_limit_bytes=200_000))
    backends = {
        PREFIX: ReplicaBackend(r, cache_metadata(cfg, None, "tiny-llama")),
        FULL: ReplicaBackend(off, cache_metadata(dict(kv_layout="paged"), None, "tiny-llama")),
    }
    app = build_app(backends, tok, context_tokens=CONTEXT)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    text = "the same long prompt, shared by both requests"

    def body(model_id, stream=False):
        b = dict(model=model_id, max_tokens=3, ignore_eos=True, stream=stream)
        if stream:
            b["stream_options"] = {"include_usage": True}
        return {**b, "messages": [{"role": "user", "content": text}]} if chat else {**b, "prompt": text}

    try:
        with ServerThread(app) as url:
            first = post(url, path, body(PREFIX)).json()["usage"]
            n = first["prompt_tokens"]
            assert first["prompt_tokens_details"] == {"cached_tokens": 0} and n > 8
            again = post(url, path, body(PREFIX)).json()["usage"]
            assert again["prompt_tokens_details"] == {"cached_tokens": 4 * ((n - 1) // 4)}
            streamed = sse(post(url, path, body(PREFIX, stream=True), stream=True))[-2]["usage"]
            assert streamed["prompt_tokens_details"] == {"cached_tokens": 4 * ((n - 1) // 4)}
            assert streamed["completion_tokens"] == 3
            assert post(url, path, body(FULL)).json()["usage"]["prompt_tokens_details"] is None
            assert (
                sse(post(url, path, body(FULL, stream=True), stream=True))[-2]["usage"]["prompt_tokens_details"] is None
            )
            meta = {m["id"]: m["metadata"] for m in requests.get(url + "/v1/models", timeout=10).json()["data"]}
            assert meta[PREFIX]["enable_prefix_caching"] is True and meta[FULL]["enable_prefix_caching"] is False
    finally:
        r.shutdown()
        off.shutdown()
