"""`python -m cluster.serve_app` before any Ray starts: who may be served (the API key, loopback binding),
and what the ingress is given (the model's context, the key as a digest only, the body limit)."""

from __future__ import annotations

import pytest
from ray import cloudpickle

from cluster import serve_app
from cluster.serve_app import API_KEY_ENV, build_serve_app, check_exposure, is_loopback, main
from replica.model_loading import model_context_tokens
from replica.openai_api import DEFAULT_MAX_BODY_BYTES, ApiKey

KEY = "sk-serve-0123456789abcdef"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts_need_no_key(host):
    assert is_loopback(host)
    check_exposure(host, None, False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "node-7.example"])
def test_binding_beyond_loopback_without_a_key_refuses_to_start(host, monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert not is_loopback(host)
    started = []
    monkeypatch.setattr(serve_app, "build_serve_app", lambda *a, **k: started.append(1))
    assert main(["--host", host]) == 2 and not started  # refused before anything loads
    err = capsys.readouterr().err
    assert f"--host {host}" in err and "--api-key" in err and API_KEY_ENV in err and "--allow-unauthenticated" in err


def _stops_after_the_check(monkeypatch) -> dict:
    """Replace `build_serve_app` by one that records its arguments and stops `main` (exit 2)."""
    seen: dict = {}

    def fake(model, caches, **kw):
        seen.update(kw)
        raise ValueError("--cache: stopped here by the test")

    monkeypatch.setattr(serve_app, "build_serve_app", fake)
    return seen


@pytest.mark.parametrize(
    "argv, env, key",
    [
        (["--host", "0.0.0.0", "--api-key", KEY], None, KEY),
        (["--host", "0.0.0.0"], KEY, KEY),  # $SCISSORHANDS_API_KEY, as vLLM's VLLM_API_KEY
        (["--host", "0.0.0.0", "--allow-unauthenticated"], None, None),
    ],
)
def test_a_key_or_an_explicit_flag_lets_the_service_bind_beyond_loopback(argv, env, key, monkeypatch, capsys):
    if env is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, env)
    seen = _stops_after_the_check(monkeypatch)
    assert main(argv) == 2 and "stopped here by the test" in capsys.readouterr().err
    assert seen["api_key"] == key and seen["max_body_bytes"] == DEFAULT_MAX_BODY_BYTES


def test_the_body_limit_flag_reaches_the_app_and_is_checked(monkeypatch, capsys):
    seen = _stops_after_the_check(monkeypatch)
    assert main(["--max-body-bytes", "4096"]) == 2 and seen["max_body_bytes"] == 4096
    assert main(["--max-body-bytes", "0"]) == 2 and "--max-body-bytes" in capsys.readouterr().err


def test_max_length_tokens_is_refused_unless_the_budget_is_fixed(monkeypatch, capsys):
    seen = _stops_after_the_check(monkeypatch)
    assert main(["--max-length-tokens", "512"]) == 2
    assert "--max-length-tokens: sizes the one budget of --budget fixed" in capsys.readouterr().err
    assert main(["--max-length-tokens", "512", "--budget", "fixed"]) == 2 and seen["max_length_tokens"] == 512


def test_the_ingress_gets_the_models_context_and_only_the_keys_digest():
    app = build_serve_app("tiny-llama", ["full"], api_key=KEY, dtype="float32", max_body_bytes=5000)
    handles, metadata, tokenizer_spec, pending, context, key, body_limit = app._bound_deployment.init_args
    assert context == model_context_tokens("tiny-llama") == 512 and body_limit == 5000  # the tiny model's positions
    assert isinstance(key, ApiKey) and key.matches(KEY)
    assert KEY.encode() not in cloudpickle.dumps(app._bound_deployment.init_args)  # what Serve ships and may show
    assert KEY not in repr(app._bound_deployment.init_args) and KEY not in repr(metadata)
