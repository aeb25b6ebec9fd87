"""The engine answers the longest request it serves in one call (`max_new_tokens_for`) and says why it refuses one
with a typed reason (`replica.common.types.Refusal`: context, KV memory, policy), so the OpenAI API needs neither a bisection
over `check` nor a search of the message (replica/engine/kv_base.py, replica/continuous.py)."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import requests

from replica.common.types import REFUSAL_KINDS, EngineConfig, Refusal
from replica.continuous import ServingReplica
from replica.engine import ContinuousBatchingEngine
from replica.openai_api import ReplicaBackend, build_app, cache_metadata
from tests.http_fakes import ServerThread, char_tokenizer

SH = dict(policy="scissorhands", budget_tokens=16, policy_params=dict(history_window=20, count_chunk_steps=5))
CONFIGS = {
    "preallocated-full": dict(kv_memory_limit_bytes=40_000),
    "preallocated-sh": dict(kv_memory_limit_bytes=12_000, **SH),
    "paged-full": dict(kv_layout="paged", block_tokens=4, kv_memory_limit_bytes=40_000),
    "paged-mixed-sh": dict(
        kv_layout="paged",
        block_tokens=4,
        kv_memory_limit_bytes=6_000,
        scheduler="mixed",
        max_num_batched_tokens=8,
        **SH,
    ),
}


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_max_new_tokens_for_is_the_longest_request_fits_alone_accepts(model, cfg):
    engine = ContinuousBatchingEngine(model, EngineConfig(**cfg))
    for prompt in (1, 7, 40, 90, 400):
        want = max((n for n in range(0, 301) if n == 0 or engine.fits_alone(prompt, n) is None), default=0)
        assert engine.max_new_tokens_for(prompt, 300) == want, prompt
    assert engine.max_new_tokens_for(5, 0) == 0


def test_refusals_are_typed_and_keep_their_kind_across_processes(model):
    engine = ContinuousBatchingEngine(model, EngineConfig(**CONFIGS["paged-full"]))
    why = engine.fits_alone(400, 10)
    assert isinstance(why, Refusal) and why.kind == "kv_memory" and "KV blocks alone" in why
    back = pickle.loads(pickle.dumps(why))
    assert back == why and back.kind == "kv_memory" and type(back) is Refusal
    per_request = dict(policy="scissorhands", budget="per_request", compression_ratio=5)
    policy = ContinuousBatchingEngine(model, EngineConfig(**per_request, policy_params=dict(recent_window=8)))
    # ceil(15 / 5) = 3 slots could not hold a recent window of 8: the budget is raised to what the policy needs
    # (and to its floor, at most L), so the policy's rule never refuses the request
    assert policy.fits_alone(10, 5) is None and policy.kv.budget_of(10, 5) == 15
    refused = pickle.loads(pickle.dumps(Refusal("policy", "its budget does not suit the policy")))
    assert type(refused) is Refusal and refused.kind == "policy" and "does not suit the policy" in refused
    with pytest.raises(ValueError, match="kind: expected one of context, kv_memory, policy"):
        Refusal("memory", "x")
    assert REFUSAL_KINDS == ("context", "kv_memory", "policy")


def test_the_replica_check_names_the_context_and_the_kv_memory_by_kind(model):
    replica = ServingReplica(model=model, replica_id="r", model_spec="tiny-llama")
    replica.configure(CONFIGS["paged-full"])
    try:
        context = model.config.max_position_embeddings
        over = asyncio.run(replica.check(10, context))
        assert over.kind == "context" and f"context of {context} tokens" in over
        memory = asyncio.run(replica.check(400, 10))
        assert memory.kind == "kv_memory" and memory.startswith("a request of 400 prompt + 10 new tokens: it needs")
        assert asyncio.run(replica.check(10, 10)) is None
        longest = asyncio.run(replica.max_new_tokens_for(10, 10_000))
        assert asyncio.run(replica.check(10, longest)) is None and asyncio.run(replica.check(10, longest + 1))
        assert asyncio.run(replica.max_new_tokens_for(context, 50)) == 0  # no room left in the context
    finally:
        replica.shutdown()


class _CountingBackend(ReplicaBackend):
    def __init__(self, *args):
        super().__init__(*args)
        self.checks = self.answers = 0

    async def check(self, prompt_tokens, max_new_tokens):
        self.checks += 1
        return await super().check(prompt_tokens, max_new_tokens)

    async def max_new_tokens_for(self, prompt_tokens, most):
        self.answers += 1
        return await super().max_new_tokens_for(prompt_tokens, most)


def test_a_chat_without_max_tokens_asks_the_replica_once(model):
    tok = char_tokenizer()
    replica = ServingReplica(model=model, replica_id="r", model_spec="tiny-llama")
    replica.eos_token_id = tok.eos_token_id
    replica.configure(CONFIGS["paged-full"])
    backend = _CountingBackend(replica, cache_metadata({}, None, "tiny-llama"))
    want = asyncio.run(replica.max_new_tokens_for(12, 256 - 12))
    try:
        with ServerThread(build_app({"m": backend}, tok, context_tokens=256)) as url:
            body = dict(model="m", messages=[{"role": "user", "content": "hi"}], ignore_eos=True)
            r = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            prompt = r.json()["usage"]["prompt_tokens"]
            assert r.json()["usage"]["completion_tokens"] == asyncio.run(
                replica.max_new_tokens_for(prompt, 256 - prompt)
            )
            assert backend.answers == 1 and backend.checks == 1  # the answer, then the request's own check
            over_kv = requests.post(url + "/v1/chat/completions", json=dict(body, max_tokens=want + 1), timeout=60)
            assert over_kv.status_code == 400 and over_kv.json()["error"]["code"] == "kv_memory_limit"
        # without a context of its own the API learns the model's from the replica's refusal, by its kind
        with ServerThread(build_app({"m": backend}, tok, context_tokens=None)) as url:
            over = requests.post(url + "/v1/chat/completions", json=dict(body, max_tokens=600), timeout=60)
            assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
            assert "exceeds the model's context of 512 tokens" in over.json()["error"]["message"]
    finally:
        replica.shutdown()
    assert 0 < want < 256 - 12  # the KV memory, not the context, bounds it
