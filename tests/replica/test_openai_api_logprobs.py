"""The OpenAI API's log-probabilities by token bytes (replica.token_bytes, replica.openai_fields), its routes
and chat roles: scripted backends (exact alternatives) over small tokenizers of each kind (byte-level BPE,
SentencePiece-style byte fallback, the char tokenizer), and the embedded SmolLM2 (slow tier)."""

from __future__ import annotations

import asyncio
import time

import pytest
import requests
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from replica.continuous import ServingReplica
from replica.openai_api import OPEN_PATHS, ReplicaBackend, build_app, cache_metadata
from replica.token_bytes import TokenBytes
from scissorhands.models import load_model, load_tokenizer
from tests.http_fakes import CHAT_TEMPLATE, ServerThread, char_tokenizer

MSGS = [{"role": "user", "content": "yo"}]
KEY = "sk-test-logprobs-0123456789"


def byte_level_tokenizer():
    """A byte-level BPE (GPT-2's byte table, as SmolLM2's): the 256 single bytes, merges for é and for an
    emoji's first two bytes (b"\\xf0\\x9f"), `<|im_end|>` as EOS."""
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    merges = [(table[0xC3], table[0xA9]), (table[0xF0], table[0x9F])]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's decoder: `▁` -> space, `<0xNN>` bytes, the first space
    stripped): `▁true` and `true` both decode alone to "true"."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁", "t", "r", "u", "e", "tr", "tru", "true", "▁true"):
        vocab[piece] = len(vocab)
    merges = [("t", "r"), ("tr", "u"), ("tru", "e"), ("▁", "true")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


class LogprobsBackend:
    """Streams `token_ids`, then a result with log-probabilities: position i's alternatives are `tops[i]`
    (``[[id, logprob], ...]``, best first), the token's own logprob the first alternative's if it is among
    them, else -5; an echoed prompt gets alternatives ``[[its next token, -1.0]]``."""

    def __init__(self, token_ids, tops=None):
        self.token_ids, self.tops = list(token_ids), tops
        self.metadata: dict = {"policy": "full"}

    async def check(self, prompt_tokens, max_new_tokens, logprobs=False):
        return None

    async def stream(self, request):
        ids = self.token_ids[: request.max_new_tokens]
        for i in ids:
            yield {"token_id": i, "time_s": time.time()}
        tops = self.tops or [[[i, -0.5]] for i in ids]
        lps = [dict(map(tuple, t)).get(i, -5.0) for i, t in zip(ids, tops)]
        result = {"finish_reason": "length", "token_times_s": [], "output_ids": ids}
        result.update(output_logprobs=lps, output_top_logprobs=tops[: len(ids)])
        if request.prompt_logprobs is not None:
            p = request.prompt_ids
            result.update(prompt_logprobs=[None] + [-1.0] * (len(p) - 1))
            result.update(prompt_top_logprobs=[None] + [[[t, -1.0]] for t in p[1:]])
        await asyncio.sleep(0)
        yield {"result": result}


def post(url, path, body, headers=None):
    return requests.post(url + path, json=body, timeout=60, headers=headers)


def completion(tok, backend, **body):
    with ServerThread(build_app({"m": backend}, tok)) as url:
        r = post(url, "/v1/completions", dict(model="m", **body))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def chat(tok, backend, **body):
    with ServerThread(build_app({"m": backend}, tok)) as url:
        r = post(url, "/v1/chat/completions", dict(model="m", messages=MSGS, **body))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def byte_ids(tok, *values: int) -> list[int]:
    """The ids of single-byte tokens of a byte-level tokenizer."""
    table = bytes_to_unicode()
    return [tok.convert_tokens_to_ids(table[v]) for v in values]


# ---------------------------------------------------------------------------- alternatives that decode alike
def _alike_case(kind: str):
    """(tokenizer, 4 alternative ids that all decode alone to one text, their expected names)."""
    if kind == "byte-level partial bytes":  # one incomplete character's bytes and others, each U+FFFD alone
        tok = byte_level_tokenizer()
        return tok, byte_ids(tok, 0xE2, 0x80, 0xF0, 0x9C), ["bytes:\\xe2", "bytes:\\x80", "bytes:\\xf0", "bytes:\\x9c"]
    if kind == "byte-level merged partial":  # a 2-byte piece of an emoji among single bytes
        tok = byte_level_tokenizer()
        merged = tok.convert_tokens_to_ids("ðŁ")
        return (
            tok,
            [merged, *byte_ids(tok, 0xF0, 0x9F, 0xA9)],
            ["bytes:\\xf0\\x9f", "bytes:\\xf0", "bytes:\\x9f", "bytes:\\xa9"],
        )
    if kind == "ids without an entry":  # the tiny model's ids beyond the char tokenizer decode to ''
        return char_tokenizer(), [99, 120, 127, 100], ["token_id:99", "token_id:120", "token_id:127", "token_id:100"]
    tok = byte_fallback_tokenizer()  # SentencePiece: a leading space stripped from a lone token
    ids = tok.convert_tokens_to_ids(["▁true", "true", "<0xE2>", "<0x80>"])
    return tok, ids, [" true", "true", "bytes:\\xe2", "bytes:\\x80"]


KINDS = ["byte-level partial bytes", "byte-level merged partial", "ids without an entry", "sentencepiece spaces"]


@pytest.mark.parametrize("kind", KINDS)
def test_alternatives_that_decode_alike_keep_one_entry_each_best_first(kind):
    tok, alts, names = _alike_case(kind)
    decoded = {tok.decode([i]) for i in alts}
    assert len(decoded) < len(alts)  # the input: today's keys (decode alone) collide
    values = [-0.25, -0.5, -1.0, -2.0]
    backend = LogprobsBackend([alts[0], alts[1]], tops=[list(map(list, zip(alts, values)))] * 2)
    lp = completion(tok, backend, prompt="yo", max_tokens=2, logprobs=4)["logprobs"]
    for top in lp["top_logprobs"]:
        assert list(top.items()) == list(zip(names, values))  # 4 entries, each its own value, best first
    assert lp["tokens"] == names[:2] and lp["token_logprobs"] == values[:2]


def test_a_sampled_token_outside_the_alternatives_is_added_under_its_own_key():
    tok = byte_level_tokenizer()
    alts = byte_ids(tok, 0xE2, 0x80)
    (chosen,) = byte_ids(tok, 0x81)
    backend = LogprobsBackend([chosen], tops=[[[alts[0], -0.1], [alts[1], -0.2]]])
    lp = completion(tok, backend, prompt="yo", max_tokens=1, logprobs=2)["logprobs"]
    assert lp["top_logprobs"] == [{"bytes:\\xe2": -0.1, "bytes:\\x80": -0.2, "bytes:\\x81": -5.0}]


# ---------------------------------------------------------------------------- chat bytes
REPLIES = ["Café 😀 世界", "naïve — 日本語 👍🏽!", "é😀é"]


def check_chat_bytes(tok, reply: str):
    """Chat logprobs of `reply` (top 2 alternatives: a partial byte and the next token): every entry's bytes
    are its token's own, joined they are the content's UTF-8; a token not valid UTF-8 alone is bytes:\\xNN."""
    ids = tok.encode(reply, add_special_tokens=False)
    vocab = TokenBytes(tok)
    alt = tok.encode("\u00e9", add_special_tokens=False)[-1]  # é's last byte alone or é whole: a real token
    tops = [[[i, -0.1], [alt, -0.2]] if i != alt else [[i, -0.1]] for i in ids]
    ch = chat(tok, LogprobsBackend(ids, tops), max_tokens=len(ids), logprobs=True, top_logprobs=2)
    content = ch["logprobs"]["content"]
    assert ch["message"]["content"] == reply and len(content) == len(ids)
    assert b"".join(bytes(e["bytes"]) for e in content) == reply.encode()
    for e, i in zip(content, ids):
        own = vocab.of(i)
        assert e["bytes"] == list(own)
        assert e["token"] == (own.decode() if _valid(own) else "bytes:" + "".join(f"\\x{b:02x}" for b in own))
        assert [a["bytes"] for a in e["top_logprobs"]] == [list(vocab.of(j)) for j, _ in tops[ids.index(i)][:2]]
    return content


def _valid(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("reply", REPLIES)
def test_chat_logprob_bytes_are_each_tokens_own_and_rebuild_the_content(reply):
    content = check_chat_bytes(byte_level_tokenizer(), reply)
    assert [239, 191, 189] not in [e["bytes"] for e in content]  # never U+FFFD's bytes: no reply holds one


def test_chat_logprobs_of_an_id_without_an_entry_name_it_without_bytes():
    tok = char_tokenizer()
    ch = chat(tok, LogprobsBackend([33, 120], [[[33, -0.1], [121, -0.2]], [[120, -0.3]]]), max_tokens=2, logprobs=True)
    assert [(e["token"], e["bytes"]) for e in ch["logprobs"]["content"]] == [("A", [65]), ("token_id:120", None)]


# ---------------------------------------------------------------------------- text offsets
def check_offsets(tok, prompt: str, output: str, echo: bool):
    """Completion logprobs of `output` after `prompt`: every text_offset indexes the returned text; the slices
    between offsets rebuild it; each offset is the characters complete in the tokens' bytes before it."""
    ids = tok.encode(output, add_special_tokens=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ch = completion(tok, LogprobsBackend(ids), prompt=prompt, max_tokens=len(ids), logprobs=1, echo=echo)
    text, lp = ch["text"], ch["logprobs"]
    assert text == (prompt if echo else "") + output
    all_ids = (prompt_ids if echo else []) + ids
    offsets = lp["text_offset"]
    assert len(offsets) == len(all_ids) and offsets == sorted(offsets) and 0 <= offsets[0]
    assert "".join(text[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])) == text[offsets[0] :]
    vocab = TokenBytes(tok)
    before = b""
    for i, t in enumerate(all_ids):  # the reference: characters complete in the bytes before the token
        start = 0 if not echo or i < len(prompt_ids) else len(prompt)
        part = before if not echo or i < len(prompt_ids) else before[len(prompt.encode()) :]
        assert offsets[i] == start + len(part.decode("utf-8", errors="ignore")), (i, offsets)
        before += vocab.of(t)
    return offsets


@pytest.mark.parametrize("prompt, output", [("Café 😀 世界 ", "日本 é😀!"), ("x", "👍🏽é—"), ("naïve ", "plain ascii")])
@pytest.mark.parametrize("echo", [True, False])
def test_text_offsets_index_the_returned_text_whatever_characters_split_across_tokens(prompt, output, echo):
    offsets = check_offsets(byte_level_tokenizer(), prompt, output, echo)
    assert offsets[0] == 0


def test_text_offsets_index_the_text_when_a_character_splits_across_prompt_and_output():
    tok = byte_level_tokenizer()
    emoji = tok.encode("😀", add_special_tokens=False)  # b"\xf0\x9f" (merged), b"\x98", b"\x80"
    prompt_ids, out_ids = tok.encode("hi ", add_special_tokens=False) + emoji[:1], emoji[1:] + [tok.encode("!")[0]]
    ch = completion(tok, LogprobsBackend(out_ids), prompt=prompt_ids, max_tokens=3, logprobs=0, echo=True)
    text, offsets = ch["text"], ch["logprobs"]["text_offset"]
    # each half decodes on its own (the prompt is echoed as sent): U+FFFD for each incomplete part
    assert text == "hi \ufffd" + "\ufffd\ufffd!"
    assert offsets == [0, 1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------------- routes and roles
def test_with_an_api_key_only_health_is_reachable_without_it():
    backend = LogprobsBackend([5])
    auth = {"Authorization": f"Bearer {KEY}"}
    with ServerThread(build_app({"m": backend}, char_tokenizer(), api_key=KEY)) as url:
        for path in ["/docs", "/redoc", "/openapi.json", "/docs/", "//openapi.json", "/OPENAPI.JSON", "/nope", "/"]:
            r = requests.get(url + path, timeout=10, allow_redirects=False)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert requests.get(url + "/health", timeout=10).status_code == 200
        assert OPEN_PATHS == {"/health"}
        schema = requests.get(url + "/openapi.json", headers=auth, timeout=10)
        assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
        for path in ["/docs", "/redoc"]:  # their pages could not send the key: off
            assert requests.get(url + path, headers=auth, timeout=10).status_code == 404
    with ServerThread(build_app({"m": backend}, char_tokenizer())) as url:  # no key: all open
        assert [requests.get(url + p, timeout=10).status_code for p in ["/docs", "/redoc", "/openapi.json"]] == [
            200
        ] * 3


@pytest.mark.parametrize(
    "method, path, status",
    [("post", "/v1/nope", 404), ("get", "/nope", 404), ("get", "/v1/completions", 405), ("put", "/v1/models", 405)],
)
@pytest.mark.parametrize("key", [None, KEY])
def test_unknown_paths_and_methods_are_openai_error_json(method, path, status, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with ServerThread(build_app({"m": LogprobsBackend([5])}, char_tokenizer(), api_key=key)) as url:
        r = requests.request(method, url + path, timeout=10, headers=headers)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert path in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
    if status == 405:
        assert r.headers["allow"] in ("POST", "GET")


@pytest.mark.parametrize(
    "messages, index",
    [
        ([{"role": "bot", "content": "hi"}], 0),
        ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}], 1),
        ([{"role": "User", "content": "hi"}], 0),
        ([{"role": "system", "content": "be brief"}, {"role": "", "content": "hi"}], 1),
    ],
)
def test_an_unknown_chat_role_is_a_400_naming_the_field_and_the_accepted_roles(messages, index):
    with ServerThread(build_app({"m": LogprobsBackend([5])}, char_tokenizer())) as url:
        r = post(url, "/v1/chat/completions", dict(model="m", messages=messages, max_tokens=1))
        ok = post(
            url,
            "/v1/chat/completions",
            dict(
                model="m",
                max_tokens=1,
                messages=[
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                    {"role": "user", "content": "again"},
                ],
            ),
        )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"messages.[{index}].role"
    assert all(role in err["message"] for role in ("system", "user", "assistant"))
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------------------- the embedded SmolLM2 (slow)
@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer("embedded")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["partial bytes", "merged partial"])
def test_smollm2_alternatives_of_one_incomplete_character_keep_4_entries(smollm2_tokenizer, kind):
    tok = smollm2_tokenizer
    if kind == "partial bytes":  # "—" is b"\xe2\x80\x94": its bytes and another lead byte, each U+FFFD alone
        alts, names = (
            byte_ids(tok, 0xE2, 0x80, 0x94, 0xF0),
            ["bytes:\\xe2", "bytes:\\x80", "bytes:\\x94", "bytes:\\xf0"],
        )
    else:  # SmolLM2's " " + an emoji's first 3 bytes, and single bytes
        alts = [tok.convert_tokens_to_ids("ĠðŁĺ"), *byte_ids(tok, 0x80, 0x98, 0xE4)]
        names = ["bytes:\\x20\\xf0\\x9f\\x98", "bytes:\\x80", "bytes:\\x98", "bytes:\\xe4"]
    assert {tok.decode([i]) for i in alts} <= {"\ufffd", " \ufffd"}
    values = [-0.25, -0.5, -1.0, -2.0]
    lp = completion(
        tok, LogprobsBackend([alts[0]], [list(map(list, zip(alts, values)))]), prompt="yo", max_tokens=1, logprobs=4
    )
    assert list(lp["logprobs"]["top_logprobs"][0].items()) == list(zip(names, values))


@pytest.mark.slow
@pytest.mark.parametrize("reply", REPLIES)
def test_smollm2_chat_logprob_bytes_rebuild_the_content(smollm2_tokenizer, reply):
    content = check_chat_bytes(smollm2_tokenizer, reply)
    if reply == "Café 😀 世界":  # 11 tokens, 7 of them parts of a character: each its own bytes
        assert len(content) == 11 and sum(e["token"].startswith("bytes:") for e in content) == 7
        assert content[3]["token"] == "bytes:\\x20\\xf0\\x9f\\x98" and content[3]["bytes"] == [32, 240, 159, 152]


@pytest.mark.slow
@pytest.mark.parametrize("prompt, output", [("Café 😀 世界 ", "日本 é😀!"), ("Привет, ", "мир — 👍🏽")])
def test_smollm2_text_offsets_index_the_returned_text(smollm2_tokenizer, prompt, output):
    check_offsets(smollm2_tokenizer, prompt, output, echo=True)
    check_offsets(smollm2_tokenizer, prompt, output, echo=False)


@pytest.mark.slow
def test_smollm2_model_logprobs_keep_every_alternative_and_offsets_index_the_text():
    """The embedded model itself, greedy: echo + logprobs 20 over a prompt of split characters; chat with
    top_logprobs 20. Every position has 20 distinct alternatives (21 where the prompt's token is not among
    them), offsets index the text, chat bytes rebuild the content."""
    torch.set_num_threads(1)
    model, tok = load_model("embedded", dtype=torch.float32, device="cpu")
    replica = ServingReplica(model=model, replica_id="smollm2", model_spec="embedded")
    replica.eos_token_id = tok.eos_token_id
    replica.configure(dict(kv_memory_limit_bytes=None))
    app = build_app({"m": ReplicaBackend(replica, cache_metadata({}, None, "embedded"))}, tok, context_tokens=8192)
    prompt = "Emoji: 😀😀 — 世界, café"
    try:
        with ServerThread(app) as url:
            r = post(url, "/v1/completions", dict(model="m", prompt=prompt, max_tokens=8, logprobs=20, echo=True))
            c = post(
                url,
                "/v1/chat/completions",
                dict(
                    model="m",
                    max_tokens=12,
                    ignore_eos=True,
                    logprobs=True,
                    top_logprobs=20,
                    messages=[{"role": "user", "content": "Say 😀 and 世界 twice."}],
                ),
            )
    finally:
        replica.shutdown()
    assert r.status_code == 200 and c.status_code == 200, (r.text, c.text)
    ch = r.json()["choices"][0]
    lp, text = ch["logprobs"], ch["text"]
    n_prompt = len(tok.encode(prompt, add_special_tokens=False))
    assert text.startswith(prompt) and len(lp["tokens"]) == n_prompt + 8
    for i, top in enumerate(lp["top_logprobs"][1:], 1):
        assert len(top) == (20 if i >= n_prompt else len(top)) and 20 <= len(top) <= 21, i
        values = list(top.values())[:20]
        assert values == sorted(values, reverse=True)
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    assert "".join(text[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])) == text
    content = c.json()["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 20 for e in content)
    joined = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", errors="replace")
    special = {t.content for t in tok.added_tokens_decoder.values()}
    for s in special:  # a special token (EOS) is listed with its own text; the content skips it
        joined = joined.replace(s, "")
    assert joined == c.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("prompt, output", [("true é", " true 😀 true"), ("é true", "true")])
def test_text_offsets_index_the_text_of_a_decoder_that_strips_the_first_space(prompt, output):
    """SentencePiece's decoder strips a text's first space, so the tokens' bytes are not the text: the offsets
    then follow the reply's own detokenizer, token by token, and still index the returned text."""
    tok = byte_fallback_tokenizer()
    ids, prompt_ids = tok.encode(output, add_special_tokens=False), tok.encode(prompt, add_special_tokens=False)
    ch = completion(tok, LogprobsBackend(ids), prompt=prompt, max_tokens=len(ids), logprobs=1, echo=True)
    text, offsets = ch["text"], ch["logprobs"]["text_offset"]
    assert text == tok.decode(prompt_ids) + tok.decode(ids) and len(offsets) == len(prompt_ids) + len(ids)
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[len(prompt_ids)] == len(tok.decode(prompt_ids))
    for i in range(len(offsets)):  # each offset is the text decoded before the token (its prompt or output part)
        part = prompt_ids[:i] if i < len(prompt_ids) else ids[: i - len(prompt_ids)]
        base = 0 if i < len(prompt_ids) else len(tok.decode(prompt_ids))
        assert offsets[i] == base + len(tok.decode(part).rstrip("\ufffd")), (i, offsets)


def test_special_tokens_in_an_echoed_prompt_add_no_text_and_their_neighbours_keep_their_offsets():
    tok = byte_level_tokenizer()
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    prompt = [start, *tok.encode("é😀", add_special_tokens=False), end]
    out = tok.encode("世!", add_special_tokens=False)
    ch = completion(tok, LogprobsBackend(out), prompt=prompt, max_tokens=len(out), logprobs=1, echo=True)
    lp = ch["logprobs"]
    assert ch["text"] == "é😀世!" and lp["tokens"][0] == "<|im_start|>" and lp["tokens"][-len(out) - 1] == "<|im_end|>"
    # <|im_start|> é(1 token) ðŁ \x98 \x80 <|im_end|> | \xe4 \xb8 \x96 !
    assert lp["text_offset"] == [0, 0, 1, 1, 1, 2, 2, 2, 2, 3]
