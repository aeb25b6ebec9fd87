"""How the OpenAI API (replica.openai_api) treats a request before and around generation, over real HTTP
(uvicorn in a thread) with scripted backends: the default `max_tokens` of chat and completions, stop strings
against the stream, the body-size limit and tokenization off the event loop, and the API key."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time

import pytest
import requests

from replica import openai_api
from replica.common.types import GenerationRequest
from replica.openai_api import ApiKey, build_app
from scissorhands.models import load_tokenizer
from tests.http_fakes import ServerThread, char_tokenizer, sse_events
from workloads.load.http_client import API_KEY_ENVS, OpenAIHTTPClient

CONTEXT = 256
MSGS = [{"role": "user", "content": "yo"}]
CHAT_PROMPT_TOKENS = 21  # "yo" through tests.http_fakes.CHAT_TEMPLATE


class ScriptedBackend:
    """A backend that streams `token_ids` (one every `gap_s`), then ends with `finish` ("eos" or "length");
    `fits_tokens`: prompt + max_tokens it accepts (its `check`, like a KV memory limit); records requests."""

    def __init__(self, token_ids=(), *, gap_s: float = 0.0, finish: str = "length", fits_tokens: int | None = None):
        self.token_ids, self.gap_s, self.finish, self.fits_tokens = list(token_ids), gap_s, finish, fits_tokens
        self.metadata: dict = {"policy": "full"}
        self.requests: list[GenerationRequest] = []
        self.checks = 0

    async def check(self, prompt_tokens, max_new_tokens):
        self.checks += 1
        if self.fits_tokens is not None and prompt_tokens + max_new_tokens > self.fits_tokens:
            return f"a request of {prompt_tokens} + {max_new_tokens} tokens needs more than the KV memory limit"
        return None

    async def stream(self, request):
        self.requests.append(request)
        ids = self.token_ids[: request.max_new_tokens]
        for i in ids:
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
            yield {"token_id": i, "time_s": time.time()}
        finish = self.finish if len(ids) < request.max_new_tokens else "length"
        yield {"result": {"finish_reason": finish, "token_times_s": [], "output_ids": ids}}


def serve(backend, tokenizer=None, **kw) -> ServerThread:
    return ServerThread(build_app({"m": backend}, tokenizer or char_tokenizer(), **kw))


def post(url, path, body, stream=False, headers=None):
    return requests.post(url + path, json=body, stream=stream, timeout=60, headers=headers)


# ---------------------------------------------------------------------------- max_tokens defaults
def test_a_chat_without_max_tokens_runs_to_eos_and_a_completion_keeps_16():
    tok = char_tokenizer()
    backend = ScriptedBackend(tok("a long answer, " * 10)["input_ids"], finish="eos")  # 150 tokens, then EOS
    with serve(backend, tok, context_tokens=CONTEXT) as url:
        chat = post(url, "/v1/chat/completions", dict(model="m", messages=MSGS)).json()
        assert chat["choices"][0]["finish_reason"] == "stop" and chat["usage"]["completion_tokens"] == 150
        assert backend.requests[-1].max_new_tokens == CONTEXT - CHAT_PROMPT_TOKENS
        capped = post(url, "/v1/chat/completions", dict(model="m", messages=MSGS, max_completion_tokens=7)).json()
        assert capped["usage"]["completion_tokens"] == 7 and capped["choices"][0]["finish_reason"] == "length"
        plain = post(url, "/v1/completions", dict(model="m", prompt="yo")).json()
        assert plain["usage"]["completion_tokens"] == 16 and backend.requests[-1].max_new_tokens == 16


def test_a_chat_without_max_tokens_is_capped_at_what_the_kv_memory_holds_alone():
    backend = ScriptedBackend([5] * 300, fits_tokens=150)  # the KV limit holds 150 tokens of one request
    with serve(backend, context_tokens=CONTEXT) as url:
        r = post(url, "/v1/chat/completions", dict(model="m", messages=MSGS))
        assert r.status_code == 200, r.text
        assert backend.requests[-1].max_new_tokens == 150 - CHAT_PROMPT_TOKENS
        assert r.json()["usage"]["completion_tokens"] == 150 - CHAT_PROMPT_TOKENS
        assert backend.checks <= 12  # a binary search, not one check per length
        # a max_tokens the client gives is never lowered: refused, naming it
        r = post(url, "/v1/chat/completions", dict(model="m", messages=MSGS, max_tokens=200))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_models_list_the_context_as_max_model_len():
    with serve(ScriptedBackend(), context_tokens=CONTEXT) as url:
        (card,) = requests.get(url + "/v1/models", timeout=10).json()["data"]
    assert card["max_model_len"] == CONTEXT and card["id"] == "m"


# ---------------------------------------------------------------------------- stop strings and the stream
def _streamed(url, path, body):
    events = list(sse_events(post(url, path, {**body, "stream": True, "stream_options": {"include_usage": True}})))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    key = "delta" in chunks[0]["choices"][0]
    text = "".join((c["choices"][0]["delta"].get("content") or "") if key else c["choices"][0]["text"] for c in chunks)
    ids = [i for c in chunks for i in c["choices"][0].get("token_ids", [])]
    return text, ids, events[-2]["usage"]["completion_tokens"], chunks[-1]["choices"][0]["finish_reason"]


def _whole(url, path, body):
    r = post(url, path, body).json()
    ch = r["choices"][0]
    return ch["message"]["content"] if "message" in ch else ch["text"], ch["token_ids"], r["usage"], ch["finish_reason"]


@pytest.fixture(scope="module")
def byte_level():
    return load_tokenizer("embedded")


@pytest.mark.parametrize(
    "output, stop, expected",
    [
        ("word, more", ["d,"], "wor"),  # the token that completes the stop has no text of its own
        ("Tokyo is 日本の首都 ok", ["首都"], "Tokyo is 日本の"),  # each stop character spans 3 byte-level tokens
        ("café ☃ 😀 done", ["☃ 😀"], "café "),
        ("Tokyo is 日本の首都 ok", ["本", "is 日"], "Tokyo "),
        ("café ☃ 😀 done", None, "café ☃ 😀 done"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_text_and_ids_equal_the_whole_reply_for_every_stop_string(byte_level, output, stop, expected, path):
    ids = byte_level.encode(output, add_special_tokens=False)
    tok = char_tokenizer()
    tok.decode = byte_level.decode  # prompts through the char template, output through the byte-level decoder
    with serve(ScriptedBackend(ids), tok) as url:
        body = dict(model="m", max_tokens=len(ids), stop=stop)
        body.update(messages=MSGS) if "chat" in path else body.update(prompt="yo")
        text, whole_ids, usage, finish = _whole(url, path, body)
        s_text, s_ids, s_usage, s_finish = _streamed(url, path, body)
    assert text == s_text == expected
    assert s_ids == whole_ids and len(s_ids) == s_usage == usage["completion_tokens"]
    assert finish == s_finish == ("stop" if stop else "length")


def test_our_http_client_counts_the_token_that_completes_a_stop_string():
    tok = char_tokenizer()
    ids = tok("word, more")["input_ids"]
    with serve(ScriptedBackend(ids), tok) as url:
        whole = post(url, "/v1/completions", dict(model="m", prompt=[1, 2], max_tokens=10, stop=["d,"])).json()

        async def go():
            client = OpenAIHTTPClient(url + "/v1", "m", extra_body={"stop": ["d,"]})
            try:
                return await client.generate(GenerationRequest("s", [1, 2], 10))
            finally:
                await client.close()

        result = asyncio.run(go())
    assert whole["usage"]["completion_tokens"] == 5 and whole["choices"][0]["text"] == "wor"
    assert result.output_tokens_source == "token_ids" and result.error_kind is None
    assert len(result.output_ids) == result.usage_completion_tokens == 5  # the load generator's count is usage's


# ---------------------------------------------------------------------------- big bodies, off-loop tokenization
class SlowChatTemplate:
    """The char tokenizer whose chat template takes `delay_s` (as a long prompt's tokenization does)."""

    def __init__(self, delay_s: float):
        self.tok, self.delay_s = char_tokenizer(), delay_s

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __len__(self):
        return len(self.tok)

    def __call__(self, *a, **kw):
        return self.tok(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        time.sleep(self.delay_s)
        return self.tok.apply_chat_template(*a, **kw)


def _max_gap_while(url: str, action) -> tuple[float, object]:
    """The longest gap (s) between a 10-ms token stream's events while `action()` runs in another thread."""
    arrivals: list[float] = []
    resp = post(url, "/v1/completions", dict(model="m", prompt="go", max_tokens=250, stream=True), stream=True)

    def read():
        for _ in sse_events(resp):
            arrivals.append(time.monotonic())

    assert resp.status_code == 200, resp.text
    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    while len(arrivals) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    out = action()
    reader.join(30)
    return max(b - a for a, b in zip(arrivals, arrivals[1:])), out


def test_a_slow_tokenization_does_not_stall_another_clients_stream():
    backend = ScriptedBackend([5] * 250, gap_s=0.012)  # a 3-s stream, one token every 12 ms
    with serve(backend, SlowChatTemplate(1.5), context_tokens=CONTEXT) as url:
        gap, r = _max_gap_while(url, lambda: post(url, "/v1/chat/completions", dict(model="m", messages=MSGS)))
    assert r.status_code == 200
    assert gap < 0.5, f"the stream stalled {gap:.2f} s while another request was tokenized"


def test_a_2m_character_body_is_refused_413_without_stalling_a_stream():
    huge = dict(model="m", messages=[{"role": "user", "content": "x" * 2_000_000}])
    with serve(ScriptedBackend([5] * 250, gap_s=0.012), context_tokens=CONTEXT) as url:
        gap, r = _max_gap_while(url, lambda: post(url, "/v1/chat/completions", huge))
        err = r.json()["error"]
        assert r.status_code == 413 and err["code"] == "request_too_large" and "1048576" in err["message"]
        chunked = requests.post(  # no Content-Length: counted while it arrives
            url + "/v1/completions",
            data=(b"x" * 65536 for _ in range(20)),
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert chunked.status_code == 413
    assert gap < 0.5, f"the stream stalled {gap:.2f} s while a 2 M-character body was refused"


def test_the_body_limit_is_the_apps_own():
    body = dict(model="m", prompt="x" * 2000, max_tokens=1)
    with serve(ScriptedBackend([5]), max_body_bytes=1000) as url:
        assert post(url, "/v1/completions", body).status_code == 413
        assert post(url, "/v1/completions", dict(body, prompt="x" * 100)).status_code == 200


# ---------------------------------------------------------------------------- the API key
KEY = "sk-test-0123456789abcdef"


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}],
)
def test_every_v1_request_without_the_key_gets_401_in_openai_error_json(headers):
    with serve(ScriptedBackend([5, 6]), api_key=KEY) as url:
        for method, path, body in [
            ("get", "/v1/models", None),
            ("post", "/v1/completions", dict(model="m", prompt="yo", max_tokens=2)),
            ("post", "/v1/chat/completions", dict(model="m", messages=MSGS, max_tokens=2)),
        ]:
            r = requests.request(method, url + path, json=body, headers=headers, timeout=10)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and KEY not in r.text
        assert requests.get(url + "/health", timeout=10).status_code == 200  # liveness stays open


def test_the_right_key_is_served_and_never_echoed():
    with serve(ScriptedBackend([5, 6]), api_key=KEY) as url:
        auth = {"Authorization": f"Bearer {KEY}"}
        models = requests.get(url + "/v1/models", headers=auth, timeout=10)
        assert models.status_code == 200 and KEY not in models.text
        r = post(url, "/v1/completions", dict(model="m", prompt="yo", max_tokens=2), headers=auth)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2

        async def go(key):
            client = OpenAIHTTPClient(url + "/v1", "m", api_key=key)
            try:
                return await client.generate(GenerationRequest("k", [1, 2], 2))
            finally:
                await client.close()

        assert asyncio.run(go(KEY)).error_kind is None  # our HTTP client's bearer token
        assert asyncio.run(go("wrong")).error_kind == "http_401"


def test_a_target_sweep_and_our_client_find_the_key_in_the_environment(monkeypatch):
    """A sweep's `target:` pool and our client (also make crosscheck's) send $SCISSORHANDS_API_KEY, else
    $OPENAI_API_KEY; without one, the pool's refusal says which variables to set."""
    from workloads.serving.pools import HTTPTargetPool

    for env in API_KEY_ENVS:
        monkeypatch.delenv(env, raising=False)
    with serve(ScriptedBackend([5, 6]), api_key=KEY) as url:
        with pytest.raises(
            RuntimeError, match=r"wants an API key \(none given\): set \$SCISSORHANDS_API_KEY or \$OPENAI_API"
        ):
            HTTPTargetPool(url + "/v1", "m").start()
        for env in ({"OPENAI_API_KEY": KEY}, {"SCISSORHANDS_API_KEY": KEY, "OPENAI_API_KEY": "wrong"}):  # ours first
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            pool = HTTPTargetPool(url + "/v1", "m")
            assert pool.start()[0]["served_model"] == "m"

            async def go():
                client = pool.client()
                try:
                    return await client.generate(GenerationRequest("k", [1, 2], 2))
                finally:
                    await client.close()

            assert asyncio.run(go()).error_kind is None
        monkeypatch.setenv("SCISSORHANDS_API_KEY", "wrong")
        with pytest.raises(RuntimeError, match="the one given was refused"):
            HTTPTargetPool(url + "/v1", "m").start()
    assert OpenAIHTTPClient("http://x/v1", "m", api_key="given").api_key == "given"  # an explicit key wins


def test_the_key_is_kept_as_a_digest_and_compared_in_constant_time(monkeypatch):
    key = ApiKey(KEY)
    assert KEY.encode() not in pickle.dumps(key) and KEY not in repr(key)  # what travels to a Serve replica
    calls = []
    real = openai_api.hmac.compare_digest
    monkeypatch.setattr(openai_api.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert key.matches(KEY) and not key.matches(KEY[:-1]) and len(calls) == 2
    with pytest.raises(ValueError, match="api_key"):
        ApiKey("")
