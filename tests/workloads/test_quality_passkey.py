"""Passkey retrieval (workloads.quality.passkey): the prompt, greedy decoding through the cache, scoring, suites."""

from __future__ import annotations

import math
import random

import pytest
import torch

from scissorhands import make_cache
from scissorhands.models import load_tokenizer
from scissorhands.testing import tiny_llama
from tests.suite_helpers import tiny_suite
from workloads.core.suite import SuiteError
from workloads.kinds import parse_suite
from workloads.quality import passkey as pk


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def hay(tokenizer):
    from workloads.load.prompts import heldout_text_ids

    return heldout_text_ids(tokenizer, 400, seed=5)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_has_the_length_and_the_needle_at_the_depth(tokenizer, hay, depth):
    p = pk.build_prompt(tokenizer, 300, depth, "48213", haystack_ids=hay)
    ids = p["input_ids"]
    head, tail = _ids(tokenizer, pk.INSTRUCTION), _ids(tokenizer, pk.QUESTION)
    needle = _ids(tokenizer, pk.NEEDLE.format(passkey="48213"))
    assert len(ids) == 300
    assert ids[: len(head)] == head and ids[-len(tail) :] == tail
    assert ids[p["needle_start"] : p["needle_end"]] == needle
    hay_n = p["haystack_tokens"]
    assert hay_n == 300 - len(head) - len(needle) - len(tail)
    before = p["needle_start"] - len(head)  # haystack tokens before the needle
    target = round(depth * hay_n)
    assert target - pk.SNAP_TOKENS <= before <= target
    if 0 < before < hay_n and before != target:  # moved back: it sits after a sentence end
        assert tokenizer.decode([hay[before - 1]]).rstrip().endswith(".")
    # the rest is the real text, in order, without the needle
    assert ids[len(head) : p["needle_start"]] + ids[p["needle_end"] : -len(tail)] == hay[:hay_n]
    assert tokenizer.decode(ids).count("48213") == 2  # stated twice in the needle, nowhere else


def test_depth_zero_and_one_are_the_ends(tokenizer, hay):
    head, tail = _ids(tokenizer, pk.INSTRUCTION), _ids(tokenizer, pk.QUESTION)
    assert pk.build_prompt(tokenizer, 200, 0, "11111", haystack_ids=hay)["needle_start"] == len(head)
    assert pk.build_prompt(tokenizer, 200, 1, "11111", haystack_ids=hay)["needle_end"] == 200 - len(tail)


def test_prompt_rejects_bad_input(tokenizer, hay):
    with pytest.raises(ValueError, match="depth"):
        pk.build_prompt(tokenizer, 200, 1.5, "1", haystack_ids=hay)
    with pytest.raises(ValueError, match="length must exceed"):
        pk.build_prompt(tokenizer, 20, 0.5, "1", haystack_ids=hay)


def test_prompt_from_heldout_text_is_seeded(tokenizer):
    a = pk.build_prompt(tokenizer, 128, 0.5, "12345", seed=3)
    b = pk.build_prompt(tokenizer, 128, 0.5, "12345", seed=3)
    c = pk.build_prompt(tokenizer, 128, 0.5, "12345", seed=4)
    assert a == b and a["input_ids"] != c["input_ids"]


def test_passkeys_have_their_digits():
    rng = random.Random(0)
    keys = [pk.make_passkey(rng, 5) for _ in range(50)]
    assert all(len(k) == 5 and k[0] != "0" and k.isdigit() for k in keys)
    assert len(set(keys)) > 45
    with pytest.raises(ValueError, match="digits"):
        pk.make_passkey(rng, 0)


@pytest.mark.parametrize(
    "text, answer",
    [(" 53719.\n", "53719"), ("53719", "53719"), (" is 5371 9", "5371"), (" unknown.", None), (" 053719", "053719")],
)
def test_answer_is_the_first_run_of_digits(text, answer):
    assert pk.extract_answer(text) == answer


def test_scoring_is_exact_match(tokenizer, monkeypatch):
    """Right at depth 0, one digit off at depth 1: accuracy per depth 1 and 0, over all 0.5."""

    def fake_answer(model, cache, prompt_ids, new_tokens, device="cpu"):
        key = tokenizer.decode(prompt_ids).split("The pass key is ")[1][:5]
        start = _ids(tokenizer, " The pass key is")
        head = len(_ids(tokenizer, pk.INSTRUCTION))
        depth0 = prompt_ids[head : head + len(start)] == start
        said = key if depth0 else key[:4] + str((int(key[4]) + 1) % 10)
        return _ids(tokenizer, " " + said + ".")

    monkeypatch.setattr(pk, "greedy_answer", fake_answer)
    out = pk.evaluate_passkey(tiny_llama(seed=0), tokenizer, "full", 128, [0.0, 1.0], trials=2)
    assert out["correct_by_depth"] == [2, 0] and out["accuracy_by_depth"] == [1.0, 0.0]
    assert out["accuracy"] == 0.5 and out["correct"] == 2
    assert [len(k) for k in out["passkeys"]] == [2, 2]


def test_greedy_answer_decodes_through_the_evicting_cache():
    """Prefill then one token per call; every layer stays within B; the ids match a no-cache greedy reference
    when nothing is evicted (ratio 1)."""
    model = tiny_llama(seed=0)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 128, (40,), generator=g).tolist()
    cache = make_cache("scissorhands", model, compression_ratio=4, max_length=48, min_budget_tokens=0)  # B = 12
    out = pk.greedy_answer(model, cache, prompt, 8)
    assert len(out) == 8 and cache.evicted_tokens > 0
    assert all(layer.keys.shape[-2] <= math.ceil(48 / 4) for layer in cache.layers)
    assert cache.get_seq_length() == 40 + 7
    same = pk.greedy_answer(model, make_cache("scissorhands", model, compression_ratio=1, max_length=48), prompt, 8)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert same == ids[40:]


def test_the_same_prompts_for_every_policy(tokenizer, monkeypatch):
    seen = {}

    def record(model, cache, prompt_ids, new_tokens, device="cpu"):
        seen.setdefault(type(cache.policy).__name__ if hasattr(cache, "policy") else "full", []).append(prompt_ids)
        return [0] * new_tokens

    monkeypatch.setattr(pk, "greedy_answer", record)
    model = tiny_llama(seed=0)
    a = pk.evaluate_passkey(model, tokenizer, "full", 100, [0.5], trials=2, seed=1)
    b = pk.evaluate_passkey(
        model,
        tokenizer,
        "scissorhands",
        100,
        [0.5],
        trials=2,
        seed=1,
        compression_ratio=4,
        policy_params={"min_budget_tokens": 0},
    )
    assert a["passkeys"] == b["passkeys"] and a["needle_positions"] == b["needle_positions"]
    assert b["budget_tokens"] == math.ceil((100 + b["answer_tokens"]) / 4) and a["budget_tokens"] is None
    lists = list(seen.values())
    assert len(lists) == 2 and lists[0] == lists[1]


def test_passkey_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        pk.evaluate_passkey(tiny_llama(seed=0), None, "full", 100, [0.5])


SUITE = tiny_suite(
    "quality",
    name="pk",
    compression_ratios=[2, 4],
    quantized=[{"compression_ratio": 4, "kv_bits": 4}],
    passkey={"lengths": [128, 256], "depths": [0, 0.5, 1], "trials": 3, "compression_ratios": [4]},
)


def test_suite_passkey_points():
    points = [p for p in parse_suite(SUITE).points() if p.kind == "passkey"]
    got = {(p.policy, p.compression_ratio, p.kv_bits, p.settings["length"]) for p in points}
    assert got == {
        (pol, r, b, n)
        for n in (128, 256)
        for pol, r, b in [("full", 1.0, None), ("full", 1.0, 4), ("scissorhands", 4.0, None), ("scissorhands", 4.0, 4)]
    }
    assert all(
        p.settings["depths"] == [0.0, 0.5, 1.0] and p.settings["trials"] == 3 and p.settings["digits"] == 5
        for p in points
    )
    assert len({p.point_id for p in points}) == len(points)


@pytest.mark.parametrize(
    "section, field",
    [
        ({"lengths": [32]}, r"passkey.lengths\[0\]"),
        ({"lengths": []}, "passkey.lengths"),
        ({"depths": [1.2]}, r"passkey.depths\[0\]"),
        ({"trials": 0}, "passkey.trials"),
        ({"digits": 20}, "passkey.digits"),
        ({"compression_ratios": [0.5]}, r"passkey.compression_ratios\[0\]"),
        ({"length": [128]}, "passkey"),
    ],
)
def test_invalid_passkey_sections_name_the_field(section, field):
    with pytest.raises(SuiteError, match=field):
        parse_suite({**SUITE, "passkey": section})


@pytest.mark.slow
def test_embedded_full_cache_retrieves_the_passkey():
    """SmolLM2-135M-Instruct with the full cache finds a 5-digit passkey in 256 tokens at every depth
    (measured: 9/9 at 128 and 256 tokens, depths 0, 0.5, 1, 3 trials each)."""
    from scissorhands.models import load_model

    torch.set_num_threads(1)
    model, tok = load_model("embedded", dtype=torch.float32, device="cpu")
    out = pk.evaluate_passkey(model, tok, "full", 256, [0.0, 0.5, 1.0], trials=1, digits=5)
    assert out["accuracy_by_depth"] == [1.0, 1.0, 1.0], out["answers"]


def _pk_record(policy, ratio, length, by_depth, trials=2, bits=None):
    depths = [0.0, 0.5, 1.0]
    right = [int(t < round(a * trials)) for a in by_depth for t in range(trials)]
    return {
        "status": "ok",
        "evaluation": "passkey",
        "point_id": f"pk-{policy}-{ratio}-{length}-{bits}",
        "policy": policy,
        "policy_label": policy,
        "compression_ratio": ratio,
        "kv_bits": bits,
        "length_tokens": length,
        "depths": depths,
        "trials": trials,
        "digits": 5,
        "accuracy_by_depth": by_depth,
        "accuracy": sum(right) / len(right),
        "correct_trials": right,
        "model_id": "m",
        "accuracy_ci95_low": 0.0,
        "accuracy_ci95_high": 1.0,
    }


def test_report_writes_the_passkey_table_and_heatmap(tmp_path):
    from PIL import Image

    from workloads.quality.report import markdown, write_report

    records = (
        [_pk_record("full", 1.0, n, [1.0, 1.0, 1.0]) for n in (128, 256)]
        + [_pk_record("scissorhands", 4.0, n, [0.0, 0.5, 1.0]) for n in (128, 256)]
        + [_pk_record("scissorhands", 4.0, 128, [0.0, 0.0, 1.0], bits=4)]
    )
    md = " ".join(markdown(records).split(" "))
    md = "\n".join(" ".join(line.split()) for line in md.splitlines())  # cells without their padding
    assert "### Passkey retrieval at 128 tokens" in md and "### Passkey retrieval at 256 tokens" in md
    assert "| scissorhands 4x | 0.00 | 0.50 | 1.00 |" in md
    assert "-0.500 (p=0.25, 3/0)" in md  # 3 trials right only with full: 2 / 2^3
    report = write_report(tmp_path, records)
    assert report.files == (tmp_path / "table.md", tmp_path / "passkey.png")
    png = Image.open(report.files[1])
    assert png.size[0] > 300 and png.size[1] > 200
