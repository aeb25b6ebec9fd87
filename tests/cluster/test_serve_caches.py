"""`make serve`'s cache configurations (`cluster.serve_app.parse_cache`, `serve_engine_config`): by default every
cache runs on the paged layout under the KV limit, and a ratio gives each request its own budget, so a short request
is compressed as a long one is (a fixed budget sized for 2,048 tokens never evicts a 256 + 64 request)."""

from __future__ import annotations

import argparse
import math

import pytest

from cluster.serve_app import (
    DEFAULT_KV_MEMORY_LIMIT_BYTES,
    DEFAULT_MAX_LENGTH_TOKENS,
    build_serve_app,
    engine_knob_flags,
    parse_cache,
    serve_engine_config,
)
from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine

PAGED = {
    "kv_layout": "paged",
    "kv_memory_limit_bytes": DEFAULT_KV_MEMORY_LIMIT_BYTES,
    "scheduler": "mixed",
}


def test_a_ratio_gets_a_budget_per_request_on_the_paged_layout_by_default():
    label, cfg, budget = serve_engine_config("scissorhands:5")
    assert label == "scissorhands-x5" and budget is None  # no one B: each request its own
    assert cfg == {"policy": "scissorhands", "compression_ratio": 5.0, "budget": "per_request", **PAGED}
    assert serve_engine_config("full") == ("full", {"policy": "full", **PAGED}, None)
    # the older setting on request: one B sized for the longest request, every row reserving its final length
    label, cfg, budget = serve_engine_config("scissorhands:5", budget="fixed", kv_layout="preallocated")
    assert budget == math.ceil(DEFAULT_MAX_LENGTH_TOKENS / 5) == 410 and cfg["kv_layout"] == "preallocated"
    assert cfg["scheduler"] == "prefill_first"  # whole prompts first: mixed chunks take blocks of a paged pool
    assert "budget" not in cfg and cfg["max_length_tokens"] == DEFAULT_MAX_LENGTH_TOKENS
    # b<budget> asks for one fixed budget, whatever --budget says
    assert parse_cache("h2o:b256", 2048) == ("h2o-b256", {"policy": "h2o", "budget_tokens": 256})
    assert serve_engine_config("h2o:b256")[2] == 256


def test_a_bad_layout_budget_or_missing_limit_names_the_flag_or_field():
    with pytest.raises(ValueError, match="--kv-layout: expected one of preallocated, paged, got 'blocks'"):
        serve_engine_config("full", kv_layout="blocks")
    with pytest.raises(ValueError, match="--budget: expected one of fixed, per_request, got 'per_token'"):
        parse_cache("scissorhands:5", 2048, "per_token")
    with pytest.raises(ValueError, match="kv_memory_limit_bytes"):  # the paged pool is sized from the limit
        serve_engine_config("full", kv_memory_limit_bytes=None)
    assert serve_engine_config("full", kv_memory_limit_bytes=None, kv_layout="preallocated")[1]["kv_layout"]
    with pytest.raises(ValueError, match="scheduler: 'mixed' .* needs kv_layout: 'paged'"):
        serve_engine_config("full", kv_layout="preallocated", scheduler="mixed")
    with pytest.raises(ValueError, match="max_num_batched_tokens: 8 is below one block"):
        serve_engine_config("full", max_num_batched_tokens=8)


def test_kv_reuse_shared_prefix_turns_the_prefix_cache_on_unless_the_flag_says_false():
    parser = argparse.ArgumentParser()
    names = engine_knob_flags(parser)

    def knobs(*argv):
        args = parser.parse_args(list(argv))
        return {k: getattr(args, k) for k in names}

    _, cfg, _ = serve_engine_config("scissorhands:5", **knobs("--kv-reuse", "shared_prefix"))
    assert cfg["kv_reuse"] == "shared_prefix" and EngineConfig(**cfg).enable_prefix_caching is True
    assert "enable_prefix_caching" not in serve_engine_config("full", **knobs())[1]  # off: EngineConfig's default
    with pytest.raises(ValueError, match="enable_prefix_caching: kv_reuse 'shared_prefix' shares prompt blocks"):
        serve_engine_config(
            "scissorhands:5", **knobs("--kv-reuse", "shared_prefix", "--enable-prefix-caching", "false")
        )


def test_the_service_ships_per_request_budgets_and_lists_them():
    app = build_serve_app("tiny-llama", ["full", "scissorhands:5"], dtype="float32", tokenizer_spec=None)
    handles, metadata = app._bound_deployment.init_args[:2]
    sh = "tiny-llama:scissorhands-x5"
    engine_config = handles[sh]._bound_deployment.init_args[2]  # what the deployment's engine is built from
    assert isinstance(engine_config, EngineConfig)  # crosses Ray typed
    assert (engine_config.budget, engine_config.kv_layout) == ("per_request", "paged")
    assert metadata[sh]["budget"] == "per_request" and metadata[sh]["budget_tokens"] is None
    assert metadata[sh]["compression_ratio"] == 5.0 and metadata[sh]["kv_layout"] == "paged"
    assert metadata["tiny-llama:full"]["kv_layout"] == "paged" and metadata["tiny-llama:full"]["budget"] is None


def test_a_short_request_gets_a_smaller_budget_and_holds_fewer_blocks(model):
    """The serve cache of `scissorhands:5` on the tiny model (2 layers, blocks of 16 slots): a 256 + 64 request
    gets B = ceil(320 / 5) = 64, a 400 + 112 one B = 103; under the fixed budget (B = 410) the short request holds
    every token it sees, under its own budget it holds 64."""
    limit = 1 << 20
    _, per_request, _ = serve_engine_config("scissorhands:5", kv_memory_limit_bytes=limit)
    _, fixed, _ = serve_engine_config("scissorhands:5", kv_memory_limit_bytes=limit, budget="fixed")
    prompt = [1 + i % 127 for i in range(256)]
    engines = {
        name: ContinuousBatchingEngine(model, EngineConfig(**cfg))
        for name, cfg in [("per_request", per_request), ("fixed", fixed)]
    }
    assert engines["per_request"].budget_of(256, 64) == 64 < engines["per_request"].budget_of(400, 112) == 103
    assert engines["fixed"].budget_of(256, 64) == engines["fixed"].budget_of(400, 112) == 410
    outputs, peaks = {}, {}
    for name, engine in engines.items():
        done = []
        engine.submit(GenerationRequest("short", prompt, 64), done.append)
        engine.run_until_idle()
        assert done[0].error_kind is None and len(done[0].output_ids) == 64, done[0].error
        outputs[name], peaks[name] = done[0].output_ids, engine.stats()["peak_kv_blocks_in_use"]
    assert peaks["fixed"] == 2 * math.ceil((256 + 64 - 1) / 16)  # every token kept: nothing evicted
    assert peaks["per_request"] < peaks["fixed"]
