"""`make serve` with OpenVINO GenAI as the engine of a served model (`cluster.serve_app`, ``--cache openvino/...`` or
``--engine openvino``): the cache specs and their model ids, exit 2 naming the make targets when its runtime or
export is absent, and the wiring from a spec to the OpenAI API (a stub backend in place of the pipeline, in this
process); in the slow tier the real pipeline on the embedded model's export behind real Ray Serve on loopback."""

from __future__ import annotations

import json
import sys

import pytest
import requests
import torch
from fastapi.testclient import TestClient

from cluster import serve_app
from cluster.serve_app import DEFAULT_CACHES, OPENVINO_TARGETS, build_serve_app, main, parse_cache, serve_engine_config
from replica.backends import BACKENDS
from replica.backends import openvino as ovb
from replica.common.types import EngineConfig
from replica.continuous import ServingReplica
from replica.openai_api import ReplicaBackend, build_app
from scissorhands.testing import tiny_llama
from tests.http_fakes import char_tokenizer, sse_events
from tests.ray_helpers import local_serve_app
from tests.replica.test_engine_backends import ScriptedBackend
from tests.waiting import wait_for

KV_LIMIT = 4_000_000


class LetterBackend(ScriptedBackend):
    """The scripted stub, answering ``A``, ``B``, ... (ids 33, 34, ... of the character tokenizer)."""

    FIRST_TOKEN = 33


def test_an_openvino_cache_is_named_by_its_engine_and_runs_only_its_policies():
    label, cfg, budget = serve_engine_config("openvino/full")
    assert (label, cfg["engine"], cfg["policy"], budget) == ("openvino-full", "openvino", "full", None)
    assert (cfg["kv_layout"], cfg["scheduler"]) == ("paged", "mixed")  # both engines configured alike
    # OpenVINO has one max_cache_size for every sequence: a ratio is always fixed, from max_length_tokens
    label, cfg, _ = serve_engine_config("openvino/openvino_eviction:5", max_length_tokens=544)
    assert label == "openvino_eviction-x5" and cfg["budget"] == "fixed" and cfg["max_length_tokens"] == 544
    assert cfg["compression_ratio"] == 5.0 and EngineConfig(**cfg).engine == "openvino"
    assert parse_cache("openvino/openvino_eviction:b256", 2048)[1]["policy_params"] == {"max_cache_size": 256}
    # --engine openvino: a spec without a prefix is OpenVINO's; one with `ours/` stays ours
    assert serve_engine_config("full", engine="openvino")[1]["engine"] == "openvino"
    assert "engine" not in serve_engine_config("ours/scissorhands:5", engine="openvino")[1]
    assert DEFAULT_CACHES["openvino"] == ["full", "openvino_eviction:5"]


def test_models_list_an_openvino_eviction_cache_with_its_max_cache_size_and_window_sizes(monkeypatch):
    """`/v1/models` metadata as the pipeline runs it and as sweep records have it: ratio 5 at 512 tokens is
    ``ceil(512 / 5) = 103`` rounded up to 128 (32-token blocks); ``b256`` is 256 as given."""
    monkeypatch.setattr(serve_app, "check_available", lambda model_spec: None)
    app = build_serve_app(
        "tiny-llama",
        ["openvino/openvino_eviction:5", "openvino/openvino_eviction:b256", "openvino/full"],
        dtype="float32",
        tokenizer_spec=None,
        kv_memory_limit_bytes=KV_LIMIT,
        max_length_tokens=512,
    )
    metadata = app._bound_deployment.init_args[1]
    x5 = metadata["tiny-llama:openvino_eviction-x5"]
    assert x5["budget_tokens"] == 128 and x5["engine"] == "openvino" and x5["compression_ratio"] == 5.0
    assert x5["policy_params"] == {
        "start_size": 32,
        "recent_size": 32,
        "max_cache_size": 128,
        "aggregation_mode": "SUM",
    }
    assert x5["openvino_max_cache_size_rounding"] == "ceil(512 / 5) = 103 -> 128 (32-token blocks)"
    b256 = metadata["tiny-llama:openvino_eviction-b256"]
    assert b256["budget_tokens"] == 256 and b256["policy_params"]["max_cache_size"] == 256
    assert b256["openvino_max_cache_size_rounding"] is None
    full = metadata["tiny-llama:openvino-full"]
    assert (full["budget_tokens"], full["policy_params"]) == (None, {})
    assert "openvino_max_cache_size_rounding" not in full


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "openvino/scissorhands:5",
            "--cache: engine 'openvino' has no policy 'scissorhands' .*full, openvino_eviction",
        ),
        ("openvino_eviction:5", "--cache: engine 'ours' has no policy 'openvino_eviction'"),
        ("vllm/full", r"--cache: unknown engine 'vllm' in 'vllm/full' \(accepted: ours, openvino\)"),
        (
            "openvino/openvino_eviction:b100",
            r"^--cache: 'openvino/openvino_eviction:b100': policy_params.max_cache_size: 100 is not a multiple of the "
            r"KV block .*accepted: openvino_eviction:<ratio> \(a number >= 1, e.g. openvino_eviction:5\) or "
            r"openvino_eviction:b<tokens>",
        ),
        (
            "openvino/openvino_eviction:0",
            r"^--cache: 'openvino/openvino_eviction:0': compression_ratio: expected a number >= 1 .*got 0.0; "
            r"accepted: openvino_eviction:<ratio>",
        ),
        ("openvino/openvino_eviction:b64", r"^--cache: 'openvino/openvino_eviction:b64': .*must exceed start_size"),
        ("openvino/openvino_eviction:b0", r"^--cache: 'openvino/openvino_eviction:b0': .*got 0"),
        ("scissorhands:0.5", r"^--cache: 'scissorhands:0.5': compression_ratio: .*accepted: scissorhands:<ratio>"),
        ("scissorhands:b0", r"^--cache: 'scissorhands:b0': budget_tokens: expected an integer >= 1"),
        ("openvino/openvino_eviction:five", "expected openvino_eviction:<ratio>"),
    ],
)
def test_a_cache_the_engine_cannot_run_names_the_flag_and_the_accepted_values(spec, message):
    with pytest.raises(ValueError, match=message):
        serve_engine_config(spec)


def test_without_the_runtime_serve_exits_2_naming_both_make_targets_before_anything_loads(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # `import openvino_genai` raises ImportError
    loaded = []
    monkeypatch.setattr(serve_app, "resolve_run_dtype", lambda *a, **k: loaded.append(1))
    assert main(["--engine", "openvino"]) == 2 and not loaded
    err = capsys.readouterr().err
    assert "openvino-genai runtime in this Python (make openvino-runtime)" in err and OPENVINO_TARGETS in err
    assert main(["--cache", "full", "--cache", "openvino/full"]) == 2 and not loaded  # one OpenVINO cache is enough
    assert "make openvino-runtime openvino-peer" in capsys.readouterr().err


def test_without_the_export_serve_exits_2_naming_the_export_target(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ovb, "runtime", lambda: (None, None, None))  # the runtime imports
    monkeypatch.setattr(ovb, "EXPORT_DIR", tmp_path)  # but nothing was exported there
    assert main(["--cache", "openvino/openvino_eviction:5", "--max-length-tokens", "544"]) == 2
    err = capsys.readouterr().err
    assert "(make openvino-peer); it lacks openvino_model.xml, openvino_model.bin" in err and OPENVINO_TARGETS in err
    # a model other than the embedded one has no export: the field is named
    assert main(["--model", "tiny-llama", "--cache", "openvino/full"]) == 2
    assert "model: engine 'openvino' runs the embedded model's export" in capsys.readouterr().err


def test_a_served_openvino_cache_answers_the_openai_api_through_its_backend_beside_ours(monkeypatch):
    """The app `make serve --cache full --cache openvino/full` deploys, each deployment's config run by a replica in
    this process (`ReplicaBackend`, the body of a Serve replica) with the stub in place of OpenVINO's pipeline."""
    monkeypatch.setattr(serve_app, "check_available", lambda model_spec: None)
    monkeypatch.setitem(BACKENDS, "openvino", LetterBackend)
    app = build_serve_app(
        "tiny-llama", ["full", "openvino/full"], dtype="float32", tokenizer_spec=None, kv_memory_limit_bytes=KV_LIMIT
    )
    handles, metadata = app._bound_deployment.init_args[:2]
    assert list(handles) == ["tiny-llama:full", "tiny-llama:openvino-full"]
    configs = {m: h._bound_deployment.init_args[2] for m, h in handles.items()}
    assert configs["tiny-llama:openvino-full"].engine == "openvino" and configs["tiny-llama:full"].engine == "ours"
    assert handles["tiny-llama:openvino-full"]._bound_deployment.name == "engine-openvino-full"
    torch.set_num_threads(1)
    model = tiny_llama(0)
    replicas = {m: ServingReplica(model=model, engine_config=cfg) for m, cfg in configs.items()}
    try:
        api = build_app({m: ReplicaBackend(r, metadata[m]) for m, r in replicas.items()}, char_tokenizer())
        client = TestClient(api)
        listed = {m["id"]: m["metadata"] for m in client.get("/v1/models").json()["data"]}
        assert (
            listed["tiny-llama:openvino-full"]["engine"] == "openvino" and listed["tiny-llama:full"]["engine"] == "ours"
        )
        body = {"model": "tiny-llama:openvino-full", "prompt": "Hi there", "max_tokens": 4, "ignore_eos": True}
        with client.stream(
            "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        ) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        text = "".join(c["text"] for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert text == "ABCD" and finish == ["length"]  # the stub's tokens, decoded by the service's tokenizer
        assert events[-1]["usage"] == {  # no cached-token count from OpenVINO's backend: null, as vLLM without it
            "prompt_tokens": 8,
            "completion_tokens": 4,
            "total_tokens": 12,
            "prompt_tokens_details": None,
        }
        chat = client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-llama:openvino-full",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3,
            },
        ).json()
        assert chat["choices"][0]["message"]["content"] == "ABC" and chat["choices"][0]["finish_reason"] == "length"
        assert chat["usage"]["completion_tokens"] == 3
        assert isinstance(replicas["tiny-llama:openvino-full"].engine, LetterBackend)
        ours = client.post("/v1/completions", json={**body, "model": "tiny-llama:full"}).json()
        assert ours["usage"]["completion_tokens"] == 4 and ours["choices"][0]["text"] != "ABCD"  # the tiny model's own
    finally:
        for r in replicas.values():
            r.shutdown()


@pytest.mark.slow
@pytest.mark.ray
def test_the_real_pipeline_serves_completions_and_chat_over_ray_serve_with_its_finish_reasons_and_usage():
    """`make serve --cache openvino/full --cache openvino/openvino_eviction:b96` on the embedded model's export,
    through real Ray Serve on loopback: a streamed completion and a chat each answer with the finish reason and
    the token counts the request implies."""
    try:
        ovb.check_available("embedded")
    except ovb.BackendUnavailable as e:
        pytest.skip(str(e))
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with local_serve_app(
        "embedded",
        ["openvino/full", "openvino/openvino_eviction:b96"],
        kv_memory_limit_bytes=32 << 20,  # OpenVINO allocates its pool at the first request: a small one
        replica_cpus=0.5,
        dtype="float32",
    ) as port:
        url = f"http://127.0.0.1:{port}/v1"
        wait_for(lambda: requests.get(url + "/models", timeout=5).status_code == 200, 300, "the Serve app")
        models = {m["id"]: m["metadata"] for m in requests.get(url + "/models", timeout=10).json()["data"]}
        assert {m["engine"] for m in models.values()} == {"openvino"} and len(models) == 2
        for model in models:
            body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True}
            body.update(stream=True, stream_options={"include_usage": True})
            with requests.post(url + "/completions", json=body, stream=True, timeout=300) as r:
                assert r.status_code == 200, r.text
                events = [e for e in sse_events(r) if e != "[DONE]"]
            tokens = [c for e in events for c in e["choices"] if c["text"]]
            finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
            assert finish == ["length"] and 1 <= len(tokens) <= 8, events
            usage = events[-1]["usage"]
            assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] == 5  # SmolLM2's 5 ids of the prompt
            chat = requests.post(
                url + "/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6},
                timeout=300,
            )
            assert chat.status_code == 200, chat.text
            reply = chat.json()
            done, used = reply["choices"][0]["finish_reason"], reply["usage"]["completion_tokens"]
            # length exactly at max_tokens, stop (EOS) before it: the engine's end, not a fixed guess
            assert (done, used) == ("length", 6) or (done == "stop" and 1 <= used < 6), reply
            assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] + used
            assert reply["choices"][0]["message"]["content"]


@pytest.mark.parametrize("spec", ["openvino/openvino_eviction:0", "openvino/openvino_eviction:b100", "scissorhands:0"])
def test_serve_exits_2_naming_the_cache_flag_and_spec_for_a_bad_ratio_or_size(spec, monkeypatch, capsys):
    loaded = []
    monkeypatch.setattr(serve_app, "resolve_run_dtype", lambda *a, **k: loaded.append(1))
    assert main(["--cache", spec]) == 2 and not loaded
    assert f"--cache: {spec!r}: " in capsys.readouterr().err
