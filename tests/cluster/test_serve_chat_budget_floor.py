"""The served engine config of `--cache scissorhands:5` (`cluster.serve_app.serve_engine_config`) answers the chat of
docs/serving-http.md as the full cache does with the default budget floor, and without the floor keeps ceil(L / 5)
slots (its answer is in docs/serving-http.md)."""

from __future__ import annotations

import pytest
import torch

from cluster.serve_app import serve_engine_config
from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine
from scissorhands import DEFAULT_MIN_BUDGET_TOKENS
from scissorhands.models.loading import load_model


def _serve(model, cfg: EngineConfig, requests, eos_token_id=None):
    engine = ContinuousBatchingEngine(model, cfg, eos_token_id=eos_token_id)
    done = {}
    for r in requests:
        engine.submit(r, lambda res: done.__setitem__(res.request_id, res))
    engine.run_until_idle()
    return done, engine


# ------------------------------------------------------------------------------ the embedded model, served
CHAT = [{"role": "user", "content": "What is the capital of France?"}]  # docs/serving-http.md's curl example


@pytest.fixture(scope="module")
def embedded():
    torch.set_num_threads(1)
    return load_model("embedded", dtype=torch.float32)


def _chat(model, tokenizer, cache: str, min_budget_tokens: int | None = None):
    _, cfg, _ = serve_engine_config(cache, kv_memory_limit_bytes=64 << 20)
    if min_budget_tokens is not None:
        cfg["policy_params"] = {"min_budget_tokens": min_budget_tokens}
    ids = list(
        tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )
    request = GenerationRequest("chat", ids, 32, ignore_eos=False)
    done, engine = _serve(model, EngineConfig(**cfg), [request], eos_token_id=tokenizer.eos_token_id)
    res = done["chat"]
    assert res.error_kind is None, res.error
    budget = engine.budget_of(len(ids), 32) if engine.kv.per_request else None
    return tokenizer.decode(res.output_ids, skip_special_tokens=True), budget, len(ids)


@pytest.mark.slow
def test_served_scissorhands_x5_answers_the_docs_chat_as_the_full_cache_with_the_default_floor(embedded):
    model, tokenizer = embedded
    full, _, prompt = _chat(model, tokenizer, "full")
    floored, budget, _ = _chat(model, tokenizer, "scissorhands:5")
    assert "Paris" in full and "Paris" in floored, (full, floored)
    assert budget == min(prompt + 32, DEFAULT_MIN_BUDGET_TOKENS) > -(-(prompt + 32) // 5)
    _, bare, _ = _chat(model, tokenizer, "scissorhands:5", min_budget_tokens=0)
    assert bare == -(-(prompt + 32) // 5) == 14  # without the floor: ceil(L / 5) (its answer: docs/serving-http.md)
