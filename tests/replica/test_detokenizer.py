"""The streaming detokenizer (`replica.openai_api.IncrementalDetokenizer`): the deltas of ids added one at a
time add up to decoding the whole output, whatever the ids (multi-byte characters split over byte-level
tokens, special tokens, garbage), each step decodes a bounded window, and stop strings cut streamed and
whole text alike."""

from __future__ import annotations

import random

import pytest

from replica.openai_api import IncrementalDetokenizer
from scissorhands.models import load_tokenizer

TEXTS = [
    "Tokyo is 日本の首都; Paris, la capitale de la France.",
    "café ☃ 😀 done, naïve 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and Ελληνικά",
    "word, more words and more: 1234 5678!\n\nNext line\tTab",
    "한국어 텍스트와 emoji 🎉🎉 together, then العربية",
]


def whole(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def streamed(tok, ids: list[int], stop: list[str] | None = None) -> tuple[list[str], IncrementalDetokenizer]:
    """The deltas of `ids` added one at a time, then the final flush (as the API's stream does)."""
    d = IncrementalDetokenizer(tok, stop or [])
    out = []
    for i in ids:
        out.append(d.add([i]))
        if d.stopped:
            return out, d
    out.append(d.add([], final=True))
    return out, d


@pytest.fixture(scope="module")
def byte_level():
    """The embedded model's tokenizer (byte-level BPE: a CJK character or an emoji spans several tokens)."""
    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Llama-style tokenizer: `▁` for spaces, byte fallback (`<0x..>` tokens), the leading space stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁the", "▁word", "word", ",", ".", "▁more", "s", "▁a", "b", "c", "▁日本", "é", "▁x"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _with_specials(tok, rng: random.Random, ids: list[int]) -> list[int]:
    ids = list(ids)
    for _ in range(rng.randrange(0, 4)):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(tok.all_special_ids))
    return ids


def _garbage(tok, rng: random.Random, n: int) -> list[list[int]]:
    """Real text cut anywhere (mid-character too), special tokens and random ids: a random model's output."""
    base = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    out = []
    for _ in range(n):
        ids = list(rng.choice(base))
        start = rng.randrange(len(ids))
        ids = _with_specials(tok, rng, ids[start : start + rng.randrange(1, 40)])
        ids.insert(rng.randrange(len(ids) + 1), rng.randrange(len(tok)))
        out.append(ids)
    return out


def _texts(tok, rng: random.Random, n: int) -> list[list[int]]:
    """Random valid text (words, spaces, characters of two to four UTF-8 bytes) with special tokens inserted."""
    pieces = ["the", " word", " more", ",", "é", "日本", "😀", " ", "x", "ñ", "s", "\n", "𝔘"]
    return [
        _with_specials(
            tok, rng, tok.encode("".join(rng.choices(pieces, k=rng.randrange(1, 30))), add_special_tokens=False)
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("which", ["byte_level", "sentencepiece_like"])
def test_deltas_add_up_to_decoding_the_whole_output(which, request):
    """Byte-level BPE decodes each character from its own bytes, so any ids agree, garbage included; a
    byte-fallback decoder replaces a whole run of byte tokens when any of them is invalid, so there the
    outputs are valid text (with special tokens anywhere), as a model's are."""
    tok = request.getfixturevalue(which)
    rng = random.Random(0)
    seqs = [tok.encode(t, add_special_tokens=False) for t in TEXTS] + _texts(tok, rng, 300)
    if which == "byte_level":
        seqs += _garbage(tok, rng, 300)
    for ids in seqs:
        deltas, d = streamed(tok, ids)
        assert "".join(deltas) == d.text == whole(tok, ids), ids


def test_an_incomplete_character_is_held_back_until_its_last_byte(byte_level):
    ids = byte_level.encode("is 日本", add_special_tokens=False)
    deltas, _ = streamed(byte_level, ids)
    assert "\ufffd" not in "".join(deltas) and "".join(deltas) == "is 日本"
    assert [d for d in deltas if d] == ["is", " 日", "本"]


def test_each_step_decodes_a_bounded_window_however_long_the_output(byte_level):
    """Constant cost per token: the longest id list decoded at any step stays under a bound at 4,000 tokens."""
    lengths: list[int] = []

    class Counting:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return byte_level.decode(ids, **kw)

    ids = (byte_level.encode(" ".join(TEXTS), add_special_tokens=False) * 200)[:4000]
    d = IncrementalDetokenizer(Counting(), ["never in this text"])
    text = "".join(d.add([i]) for i in ids) + d.add([], final=True)
    assert text == whole(byte_level, ids)
    bound = 2 * IncrementalDetokenizer.MAX_PENDING_TOKENS + 1
    assert max(lengths) <= bound and len(lengths) <= 4 * len(ids)


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("word, more", ["d,"], "wor"),
        ("Tokyo is 日本の首都 ok", ["首都"], "Tokyo is 日本の"),  # each of the stop's characters spans 3 tokens
        ("café ☃ 😀 done", ["☃ 😀"], "café "),
        ("Tokyo is 日本の首都 ok", ["本の"], "Tokyo is 日"),
        ("Tokyo is 日本の首都 ok", ["日本"], "Tokyo is "),
        ("café ☃ 😀 done", ["😀 d"], "café ☃ "),
        ("word, more", ["more", "d, m", "x"], "wor"),  # the earliest occurrence wins, whichever stop it is
        ("word, more", ["zzz"], "word, more"),
    ],
)
def test_stop_strings_cut_streamed_and_whole_text_alike(byte_level, text, stop, expected):
    ids = byte_level.encode(text, add_special_tokens=False)
    deltas, d = streamed(byte_level, ids, stop)
    assert "".join(deltas) == d.text == expected
    assert d.stopped == (expected != text)


def test_every_stop_string_in_many_outputs_cuts_at_its_first_occurrence(byte_level):
    """Stops drawn from the outputs themselves (one to four characters, multi-byte ones included): the
    streamed text equals the whole text cut before the stop's first occurrence."""
    rng = random.Random(1)
    for text in TEXTS:
        ids = byte_level.encode(text, add_special_tokens=False)
        full = whole(byte_level, ids)
        for _ in range(60):
            k = rng.randrange(len(full))
            stop = full[k : k + rng.randrange(1, 5)]
            deltas, d = streamed(byte_level, ids, [stop])
            assert "".join(deltas) == d.text == full[: full.find(stop)], (text, stop)
            assert d.stopped
