"""Prompts and held-out text from the State of the Union corpus, with the embedded model's tokenizer.

The first run tokenizes the corpus (several seconds) and caches the ids under .cache/tokens.
"""

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from scissorhands.models import load_tokenizer
from workloads.load import prompts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


def _found_in(window: list[int], tokenized: prompts.TokenizedSpeeches) -> list[str]:
    """The speech ids whose token ids contain ``window`` as a consecutive run."""
    needle = np.asarray(window, dtype=np.int32)
    hits = []
    for k, speech_id in enumerate(tokenized.speech_ids):
        ids = tokenized.speech(k)
        if len(ids) >= len(needle) and (sliding_window_view(ids, len(needle)) == needle).all(axis=1).any():
            hits.append(speech_id)
    return hits


def test_split_is_every_tenth_speech_and_disjoint():
    corpus = prompts.load_corpus()
    load_test, heldout = prompts.split_corpus(corpus)
    assert len(corpus) == 237 and corpus[0].speech_id == "1790-Washington-1"
    assert [s.speech_id for s in heldout] == [s.speech_id for s in corpus[9::10]]
    assert len(heldout) == 23 and len(load_test) == 214
    assert {s.speech_id for s in load_test}.isdisjoint({s.speech_id for s in heldout})
    assert {s.speech_id for s in load_test} | {s.speech_id for s in heldout} == {s.speech_id for s in corpus}
    assert all(len(s.text) > 1000 and s.year >= 1790 for s in corpus)


def test_prompts_have_exact_length_and_no_special_tokens(tokenizer):
    result = prompts.make_prompts(tokenizer, n=6, prompt_tokens=37, seed=0)
    assert len(result) == 6
    assert all(len(p) == 37 for p in result)
    special = set(tokenizer.all_special_ids)
    assert all(isinstance(t, int) and 0 <= t < len(tokenizer) and t not in special for p in result for t in p)
    assert all(p[0] != tokenizer.bos_token_id for p in result)


def test_prompts_are_deterministic_per_seed(tokenizer):
    first = prompts.make_prompts(tokenizer, n=5, prompt_tokens=64, seed=7)
    again = prompts.make_prompts(tokenizer, n=5, prompt_tokens=64, seed=7)
    other = prompts.make_prompts(tokenizer, n=5, prompt_tokens=64, seed=8)
    assert first == again
    assert first != other
    assert len({tuple(p) for p in first}) == 5  # distinct windows within one draw


def test_prompts_come_from_load_test_speeches_only(tokenizer):
    load_test = prompts.tokenize_split(tokenizer, "load_test")
    heldout = prompts.tokenize_split(tokenizer, "heldout")
    for prompt in prompts.make_prompts(tokenizer, n=3, prompt_tokens=48, seed=1):
        assert _found_in(prompt, load_test)
        assert not _found_in(prompt, heldout)


def test_heldout_text_comes_from_heldout_speeches(tokenizer):
    ids = prompts.heldout_text_ids(tokenizer, n_tokens=256, seed=0)
    assert len(ids) == 256
    assert ids == prompts.heldout_text_ids(tokenizer, n_tokens=256, seed=0)
    assert ids != prompts.heldout_text_ids(tokenizer, n_tokens=256, seed=1)
    heldout_ids = {s.speech_id for s in prompts.split_corpus()[1]}
    assert set(_found_in(ids, prompts.tokenize_split(tokenizer, "heldout"))) <= heldout_ids
    assert _found_in(ids, prompts.tokenize_split(tokenizer, "heldout"))
    assert not _found_in(ids, prompts.tokenize_split(tokenizer, "load_test"))


def test_tokenized_speeches_match_the_tokenizer(tokenizer):
    tokenized = prompts.tokenize_split(tokenizer, "heldout")
    speech = prompts.split_corpus()[1][0]
    assert tokenized.speech_ids[0] == speech.speech_id
    assert tokenized.speech(0).tolist() == tokenizer(speech.text, add_special_tokens=False).input_ids


def test_too_long_prompt_names_the_field(tokenizer):
    longest = int(prompts.tokenize_split(tokenizer, "load_test").lengths().max())
    assert len(prompts.make_prompts(tokenizer, n=1, prompt_tokens=longest, seed=0)[0]) == longest
    with pytest.raises(ValueError, match=rf"prompt_tokens={longest + 1} is larger than any load-test speech"):
        prompts.make_prompts(tokenizer, n=1, prompt_tokens=longest + 1, seed=0)
    with pytest.raises(ValueError, match="n_tokens"):
        prompts.heldout_text_ids(tokenizer, n_tokens=10**7)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0, "prompt_tokens": 8}, "n"),
        ({"n": 2, "prompt_tokens": 0}, "prompt_tokens"),
        ({"n": 2, "prompt_tokens": 8.5}, "prompt_tokens"),
    ],
)
def test_invalid_arguments_name_the_field(tokenizer, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: expected an integer >= 1"):
        prompts.make_prompts(tokenizer, seed=0, **kwargs)
