"""lm-evaluation-harness's own `local-completions` client (`LocalCompletionsAPI`) against our OpenAI API on
the embedded model: its log-likelihoods (echo + logprobs) equal the quality runner's (`score_doc`).

The server is the in-process ASGI app that the Serve app wraps (`build_app` over a `ServingReplica`,
uvicorn on loopback): starting Ray Serve on the test machine's two cores would add a minute and test
nothing this check is about. Nothing is downloaded: the tokenizer is the embedded model's converted folder.

The rule (docs/serving-http.md, "Log-likelihoods: echo"): an echoed prompt is scored as decoding would
feed it into an empty cache (`replica.sampling.score_prompt`, the quality runner's call schedule). The
few-shot scorer prefills the context in one call and then decodes the continuation; the two are the
same calls whenever the context fits the budget (``len(context) <= B``), as here, where the continuation
crosses ``B`` so Scissorhands evicts while it is scored.
"""

from __future__ import annotations

import pytest
import torch

from replica.continuous import ServingReplica
from replica.openai_api import ReplicaBackend, build_app, cache_metadata
from scissorhands.models import load_model
from scissorhands.models.embedded import embedded_cache_dir
from tests.http_fakes import ServerThread
from workloads.quality.fewshot import Doc, encode_request, score_doc

CONTEXT = (
    "The old harbour town wakes early. Fishermen carry their nets down to the boats while the bakers"
    " open their doors, and the smell of bread drifts along the"
)
CONTINUATIONS = (
    " quay where the gulls wait for scraps. By noon the market is full of voices, the boats are back"
    " with their catch, and children run between the stalls until their parents call them home for lunch.",
    " river, past the church and the school, up to the hill where the old lighthouse keeper still lives"
    " alone with his dog, his books and a radio that only plays songs from another century.",
)
BUDGET = 48  # >= the context (so the few-shot scorer keeps it whole), < context + continuation: evictions
CONFIGS = {
    "full": dict(policy="full"),
    "scissorhands": dict(
        policy="scissorhands", budget_tokens=BUDGET, policy_params=dict(history_window=20, count_chunk_steps=5)
    ),
}


@pytest.fixture(scope="module")
def embedded():
    torch.set_num_threads(1)
    return load_model("embedded", dtype=torch.float32, device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_lm_eval_local_completions_loglikelihoods_equal_the_quality_runners(embedded, name, monkeypatch):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = embedded
    cfg = CONFIGS[name]
    for cont in CONTINUATIONS:
        ctx, cont_ids = encode_request(tok, CONTEXT, cont)
        assert len(ctx) <= BUDGET < len(ctx) + len(cont_ids) - 20  # several evictions inside the continuation
    replica = ServingReplica(model=model, replica_id=name, model_spec="embedded")
    replica.eos_token_id = tok.eos_token_id
    replica.configure(cfg)
    model_id = f"embedded:{name}"
    app = build_app(
        {model_id: ReplicaBackend(replica, cache_metadata(cfg, replica.engine.budget_tokens, "embedded"))},
        tok,
        context_tokens=8192,
    )
    try:
        with ServerThread(app) as url:
            lm = LocalCompletionsAPI(
                base_url=f"{url}/v1/completions",
                model=model_id,
                tokenizer_backend="huggingface",
                tokenizer=str(embedded_cache_dir()),
                max_retries=1,
            )
            reqs = [
                Instance("loglikelihood", doc={}, arguments=(CONTEXT, cont), idx=i)
                for i, cont in enumerate(CONTINUATIONS)
            ]
            got = lm.loglikelihood(reqs, disable_tqdm=True)
    finally:
        replica.shutdown()
    doc = Doc(0, tuple((CONTEXT, c) for c in CONTINUATIONS), 0)
    want = score_doc(
        model,
        tok,
        doc,
        cfg["policy"],
        budget_tokens=cfg.get("budget_tokens"),
        policy_params=cfg.get("policy_params"),
    )
    # float32, 1e-4 per continuation token (the per-token bound of tests/workloads/test_quality_chunks.py): the
    # server feeds context + continuation in one call where the scorer makes two, so the matmuls' last bits
    # differ (measured: at most 1.3e-4 on a sum of 45 tokens, 3e-6 a token)
    for (score, _), ref, n in zip(got, want["logprob_sums"], want["continuation_tokens"]):
        assert score == pytest.approx(ref, abs=1e-4 * n)
    if name == "scissorhands":  # the budget bites: the scores are not the full cache's
        full = score_doc(model, tok, doc, "full")["logprob_sums"]
        assert all(abs(a - b) > 1e-3 for a, b in zip(want["logprob_sums"], full))
