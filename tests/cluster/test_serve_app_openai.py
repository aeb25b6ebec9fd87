"""The Python `openai` client (pinned in the `test` extra) against the real Ray Serve app on the tiny
model: the example of docs/serving-http.md run as written (only the URL and model id changed), and the
client's streamed and non-streamed completions and chat agreeing with each other and with `usage`.

The tiny model has no tokenizer of its own; the ingress gets the character tokenizer of
`tests.http_fakes.char_tokenizer` (98 ids, within the tiny model's 128) from a folder, so text prompts
and the chat template work as they do with `make serve`'s embedded model.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from cluster.serve_app import APP_NAME
from tests.http_fakes import char_tokenizer
from tests.ray_helpers import local_serve_app
from tests.waiting import wait_for

pytestmark = [pytest.mark.ray]
openai = pytest.importorskip("openai", reason="the openai client is in the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[2]
SH = "tiny-llama:scissorhands-x5"
FULL = "tiny-llama:full"
KEY = "sk-serve-test-5f1c0ffee"  # the app below requires it (--api-key)
CONTEXT = 512  # the tiny model's positions


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    import ray
    import requests

    tok_dir = tmp_path_factory.mktemp("char-tokenizer")
    char_tokenizer().save_pretrained(str(tok_dir))
    if ray.is_initialized():
        ray.shutdown()
    with local_serve_app(
        "tiny-llama",
        ["full", "scissorhands:5"],
        kv_memory_limit_bytes=16 << 20,  # the paged pool is committed at the first request: a small one
        replica_cpus=0.5,
        num_replicas=2,  # a stop string's `finish` must reach the replica that streams the request
        tokenizer_spec=str(tok_dir),
        api_key=KEY,
    ) as port:
        url = f"http://127.0.0.1:{port}/v1"
        auth = {"Authorization": f"Bearer {KEY}"}
        wait_for(
            lambda: requests.get(url + "/models", headers=auth, timeout=5).status_code == 200, 120, "the Serve app"
        )
        yield url


def _docs_example() -> str:
    """The Python block under "The Python `openai` client" in docs/serving-http.md."""
    text = (ROOT / "docs" / "serving-http.md").read_text()
    section = text[text.index("## The Python `openai` client") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_example_runs_as_written(base_url):
    code = _docs_example()
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and '"smollm2-135m-instruct:scissorhands-x5"' in code
    code = code.replace("http://127.0.0.1:8000/v1", base_url).replace("smollm2-135m-instruct:scissorhands-x5", SH)
    code = code.replace('api_key="unused"', f'api_key="{KEY}"')  # this app requires its key
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/serving-http.md", "exec"), {})
    # the example streams max_tokens=32 with ignore_eos: the printed text is the non-streamed reply's
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    whole = client.completions.create(
        model=SH, prompt="The capital of France is", max_tokens=32, extra_body={"ignore_eos": True}
    )
    assert whole.usage.completion_tokens == 32 and len(whole.choices[0].model_extra["token_ids"]) == 32
    assert out.getvalue() == whole.choices[0].text and out.getvalue()


@pytest.mark.parametrize("model", [FULL, SH])
def test_streamed_and_not_agree_with_usage(base_url, model):
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    whole = client.completions.create(model=model, prompt="Hello there", max_tokens=12, extra_body={"ignore_eos": True})
    assert whole.usage.prompt_tokens == len("Hello there") and whole.usage.completion_tokens == 12
    assert whole.choices[0].finish_reason == "length"
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Hello there",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    ids = [i for c in chunks if c.choices for i in c.choices[0].model_extra["token_ids"]]
    assert "".join(texts) == whole.choices[0].text  # greedy: the same tokens
    assert ids == whole.choices[0].model_extra["token_ids"] and len(ids) == 12
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices  # the usage chunk last
    assert sum(1 for c in chunks if c.choices and c.choices[0].model_extra["token_ids"]) == 12  # one event per token


def test_chat_streamed_and_not(base_url):
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    msgs = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=SH, messages=msgs, max_tokens=8, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 8 and whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=SH, messages=msgs, max_tokens=8, stream=True, extra_body={"ignore_eos": True}
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def test_errors_reach_the_client_as_openai_exceptions(base_url):
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model" or e.value.body.get("error", {}).get("param") == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=SH, prompt="x", max_tokens=0)
    assert "max_tokens" in str(e.value)
    assert [m.id for m in client.models.list()] == [FULL, SH]


def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context(base_url):
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    r = client.chat.completions.create(
        model=FULL, messages=[{"role": "user", "content": "Hi"}], extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == CONTEXT - r.usage.prompt_tokens and r.choices[0].finish_reason == "length"
    assert {m.id: m.model_extra["max_model_len"] for m in client.models.list()} == {FULL: CONTEXT, SH: CONTEXT}


def test_requests_without_the_key_get_401_and_the_key_is_in_no_log(base_url):
    import ray

    for key in ("wrong", KEY[:-1]):
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            client.completions.create(model=SH, prompt="x", max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    import requests

    assert requests.get(base_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
    models = requests.get(base_url + "/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert models.status_code == 200 and KEY not in models.text
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    leaked = [p.name for p in logs.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert not leaked and any(logs.rglob("*serve*"))  # Serve's logs were read, and none holds the key


def test_through_serve_only_health_answers_without_the_key(base_url):
    import requests

    root = base_url.removesuffix("/v1")
    for path in ["/openapi.json", "/docs", "/redoc", "/nope", "/v1/models"]:
        r = requests.get(root + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    auth = {"Authorization": f"Bearer {KEY}"}
    assert requests.get(root + "/openapi.json", headers=auth, timeout=10).status_code == 200
    missing = requests.get(root + "/nope", headers=auth, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Invalid URL (GET /nope)"
    assert requests.get(root + "/health", timeout=10).status_code == 200


def _full_engine_counts() -> tuple[int, int]:
    """(completed, failed) requests summed over both replicas of the full cache's deployment."""
    from ray import serve

    handle = serve.get_deployment_handle("engine-full", APP_NAME)
    seen: dict = {}
    for _ in range(100):  # the handle picks a replica: ask until both answered
        s = handle.stats.remote().result()
        seen[s["replica_id"]] = (s["completed_requests"], s["failed_requests"])
        if len(seen) == 2:
            return tuple(map(sum, zip(*seen.values())))
    raise AssertionError(f"only {sorted(seen)} of the 2 replicas answered")


def test_completions_cut_by_a_stop_string_count_completed_on_the_replica_that_streamed_them(base_url):
    client = openai.OpenAI(base_url=base_url, api_key=KEY)
    body = dict(model=FULL, prompt="abc", max_tokens=12, extra_body={"ignore_eos": True})
    text = client.completions.create(**body).choices[0].text
    stop = text[2]  # the greedy text hits it at its third character (or earlier)
    k = text.find(stop)
    assert 0 <= k <= 2 and len(text) > 3
    before = _full_engine_counts()
    for _ in range(2):
        r = client.completions.create(**body, stop=[stop])
        assert (r.choices[0].finish_reason, r.choices[0].text) == ("stop", text[:k])
    chunks = [c for c in client.completions.create(**body, stop=stop, stream=True) if c.choices]
    assert chunks[-1].choices[0].finish_reason == "stop" and "".join(c.choices[0].text for c in chunks) == text[:k]
    after = wait_for(
        lambda: (c := _full_engine_counts())[0] - before[0] >= 3 and c, 30, "the replicas counting 3 completions"
    )
    assert (after[0] - before[0], after[1] - before[1]) == (3, 0)
