"""Turn-k recall (workloads.quality.turn_recall): the chat prompt of turn k, scoring per k with Wilson intervals,
bad input at suite load, the suite's points run on a tiny model, and the report's per-k table."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
import yaml

from scissorhands.models import load_model, load_tokenizer
from scissorhands.testing import tiny_llama
from tests.suite_helpers import tiny_suite
from workloads import sweep
from workloads.core.run import SweepError, check_model_context
from workloads.core.suite import SuiteError
from workloads.kinds import parse_suite
from workloads.quality import points as quality_points
from workloads.quality import turn_recall as tr
from workloads.quality.report import markdown
from workloads.quality.stats import wilson_interval

Z2 = 1.959963984540054**2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def session(tokenizer):
    return tr.make_session(tokenizer, 6, 32, 5, random.Random("test-session"))


@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_turn_k_prompt_holds_the_fact_once_and_the_fillers_in_order(tokenizer, session, k):
    p = tr.build_turn_prompt(tokenizer, session, k)
    text, name, code = p["text"], session["name"], session["code"]
    assert text.count(code) == 1 and text.count(tr.PLANT.format(name=name, code=code)) == 1
    assert text.endswith("<|im_start|>assistant\n" + tr.ANSWER_PREFIX.format(name=name))
    assert text.count("<|im_start|>user\n") == k and text.count("<|im_start|>assistant\n") == k  # k-1 + the answer
    assert text.count(tr.FILLER_REPLY) == k - 2
    where = [text.index(f) for f in session["fillers"][: k - 2]]
    assert where == sorted(where) and all(text.index(tr.PLANT_REPLY) < w for w in where)
    assert all(f not in text for f in session["fillers"][k - 2 :])
    assert text.index(tr.QUESTION.format(name=name)) > max(where, default=0)
    assert p["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert [m["role"] for m in p["messages"]] == ["user", "assistant"] * (k - 1) + ["user"]
    assert len(p["input_ids"]) <= tr.prompt_tokens_bound(k, 32)
    if k > 2:  # the conversation of turn k extends that of turn k - 1 (the question replaced by the next turn)
        before = tr.build_turn_prompt(tokenizer, session, k - 1)["text"]
        history = before[: before.rindex("<|im_start|>user\n")]
        assert text.startswith(history) and len(history) > 0


def test_fillers_are_heldout_text_drawn_from_the_seed(tokenizer, session):
    again = tr.make_session(tokenizer, 6, 32, 5, random.Random("test-session"))
    assert again == session and len(session["fillers"]) == 6 and len(set(session["fillers"])) == 6
    assert re.fullmatch(r"[1-9]\d{4}", session["code"]) and session["name"] in tr.NAMES
    other = tr.make_session(tokenizer, 6, 32, 5, random.Random("another"))
    assert other["fillers"] != session["fillers"]


def test_prompt_bound_covers_real_sessions(tokenizer):
    for s in range(4):
        drawn = tr.make_session(tokenizer, 10, 48, 5, random.Random(f"bound-{s}"))
        for k in (2, 6, 12):
            assert len(tr.build_turn_prompt(tokenizer, drawn, k)["input_ids"]) <= tr.prompt_tokens_bound(k, 48)
    assert tr.prompt_tokens_bound(2, 48) == 128 and tr.prompt_tokens_bound(8, 48) == 128 + 6 * 72


def test_scoring_is_exact_match_per_turn_with_wilson_intervals(tokenizer, monkeypatch):
    """Right at turn 2, one digit off at turn 4, right at turn 6 only for the first session: 3/3, 0/3, 1/3."""
    calls = []

    def fake_answer(model, cache, prompt_ids, new_tokens, device="cpu"):
        text = tokenizer.decode(prompt_ids)
        code = re.search(r"The code for \w+ is (\d{5})\.", text).group(1)
        turn = text.count("<|im_start|>user\n")
        calls.append(turn)
        said = {2: code, 4: code[:4] + str((int(code[4]) + 1) % 10)}.get(turn, code if len(calls) == 7 else "0")
        return tokenizer(" " + said + ".", add_special_tokens=False)["input_ids"]

    monkeypatch.setattr(tr, "greedy_answer", fake_answer)
    out = tr.evaluate_turn_recall(tiny_llama(seed=0), tokenizer, "full", [2, 4, 6], sessions=3, filler_tokens=16)
    assert calls == [2, 2, 2, 4, 4, 4, 6, 6, 6]
    assert out["correct_by_turn"] == [3, 0, 1] and out["correct_trials"] == [1, 1, 1, 0, 0, 0, 1, 0, 0]
    assert out["accuracy_by_turn"] == [1.0, 0.0, pytest.approx(1 / 3)]
    assert out["accuracy_ci95_low_by_turn"][:2] == [pytest.approx(3 / (3 + Z2)), 0.0]  # all right: low = n / (n + z^2)
    assert out["accuracy_ci95_high_by_turn"][:2] == [1.0, pytest.approx(Z2 / (3 + Z2))]  # none: high = z^2/(n+z^2)
    assert out["accuracy_ci95_low_by_turn"][2] == pytest.approx(0.0615, abs=1e-4)
    assert out["accuracy_ci95_high_by_turn"][2] == pytest.approx(0.7923, abs=1e-4)
    assert out["correct"] == 4 and out["accuracy"] == pytest.approx(4 / 9) and out["reuse"] == "none"
    assert out["answers"][1][0].strip()[:4] == out["codes"][0][:4] and len(out["answers"]) == 3
    assert [len(x) for x in out["prompt_tokens_by_turn"]] == [3, 3, 3]
    assert out["budget_tokens_by_turn"] == [[None] * 3] * 3


def test_every_policy_sees_the_same_prompts_and_its_budget_follows_each_prompt(tokenizer, monkeypatch):
    seen = []

    def record(model, cache, prompt_ids, new_tokens, device="cpu"):
        seen.append(prompt_ids)
        return [0] * new_tokens

    monkeypatch.setattr(tr, "greedy_answer", record)
    model = tiny_llama(seed=0, vocab_size=len(tokenizer), max_position_embeddings=2048)
    a = tr.evaluate_turn_recall(model, tokenizer, "full", [2, 5], sessions=2, filler_tokens=16, seed=3)
    b = tr.evaluate_turn_recall(
        model, tokenizer, "scissorhands", [2, 5], sessions=2, filler_tokens=16, seed=3, compression_ratio=4
    )
    assert seen[:4] == seen[4:] and len(seen) == 8 and len(seen[2]) > len(seen[0])  # turn-major: k = 5 after k = 2
    assert a["codes"] == b["codes"] and a["prompt_tokens_by_turn"] == b["prompt_tokens_by_turn"]
    n_new = b["answer_tokens"]
    assert b["budget_tokens_by_turn"] == [
        [max(32, math.ceil((n + n_new) / 4)) for n in row] for row in b["prompt_tokens_by_turn"]
    ]  # B = ceil(L / r) of each turn's own prompt + answer, the budget floor at least


@pytest.mark.parametrize("k", [2, 3, 6])
def test_session_state_calls_feed_the_turn_k_prompt_once_split_at_its_turns(tokenizer, session, k):
    """Turn 1's prompt in one call, each fixed answer one token per call but its EOS, which opens the next turn's call
    with the next user message; together exactly the turn-k prompt's ids."""
    calls = tr.session_state_calls(tokenizer, session, k)
    ids = tr.build_turn_prompt(tokenizer, session, k)["input_ids"]
    assert [t for call in calls for t in call] == ids
    prefills = [tokenizer.decode(c) for c in calls if len(c) > 1]
    assert len(prefills) == k and prefills[0].endswith(
        tr.PLANT.format(**session) + "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert all(p.startswith("<|im_end|>\n<|im_start|>user\n") for p in prefills[1:])
    assert all(f in prefills[j + 1] for j, f in enumerate(session["fillers"][: k - 2]))
    assert prefills[-1].endswith(tr.ANSWER_PREFIX.format(name=session["name"]))
    answers = tokenizer.decode([t for c in calls if len(c) == 1 for t in c])
    assert answers == tr.PLANT_REPLY + tr.FILLER_REPLY * (k - 2)  # the answers' EOS went with the next call


@pytest.mark.parametrize("policy, ratio", [("full", 1.0), ("scissorhands", 3.0)])
def test_session_state_cache_has_fed_the_conversation_once_under_one_budget(tokenizer, monkeypatch, policy, ratio):
    """One cache per session: the forward calls are `session_state_calls` then the answer's decode steps, so the cache
    has fed the turn-k prompt + the answer but its last token, each once; its budget is the turn-k length's."""
    model = tiny_llama(seed=0, vocab_size=len(tokenizer), max_position_embeddings=2048)
    fed, caches = [], []
    model.register_forward_pre_hook(lambda m, args, kw: fed.append(kw["input_ids"][0].tolist()), with_kwargs=True)
    real = tr.greedy_answer

    def keep_cache(model, cache, prompt_ids, new_tokens, device="cpu"):
        caches.append(cache)
        return real(model, cache, prompt_ids, new_tokens, device=device)

    monkeypatch.setattr(tr, "greedy_answer", keep_cache)
    out = tr.evaluate_turn_recall(
        model, tokenizer, policy, [5], sessions=1, filler_tokens=16, compression_ratio=ratio, reuse="session_state"
    )
    session = tr.make_session(tokenizer, 3, 16, 5, random.Random("turn-recall-0-0"))
    calls, n_new = tr.session_state_calls(tokenizer, session, 5), out["answer_tokens"]
    prompt = out["prompt_tokens_by_turn"][0][0]
    assert fed[: len(calls)] == calls and len(fed) == len(calls) + n_new - 1
    assert all(len(step) == 1 for step in fed[len(calls) :])
    (cache,) = caches
    assert all(layer.tokens_seen == prompt + n_new - 1 for layer in cache.layers)
    assert out["held_tokens_by_turn"] == [[cache.held_tokens()]] and out["pinned_tokens_by_turn"] == [[0]]
    if policy == "full":
        assert cache.held_tokens() == prompt + n_new - 1
    else:
        budget = max(32, math.ceil((prompt + n_new) / ratio))
        assert out["budget_tokens_by_turn"] == [[budget]] and cache.held_tokens() <= budget < prompt
        assert cache.evicted_tokens > 0


def test_shared_prefix_keeps_the_prompts_whole_blocks_and_compresses_only_what_follows(tokenizer, monkeypatch):
    """Under a budget too small for what follows the pinned prefix, the turn-k prompt's whole 16-token blocks stay
    the row's first slots in every layer and head (never evicted), and the rest is compressed to its budget B."""
    model = tiny_llama(seed=0, vocab_size=len(tokenizer), max_position_embeddings=2048)
    caches = []
    real = tr.greedy_answer

    def keep_cache(model, cache, prompt_ids, new_tokens, device="cpu"):
        caches.append(cache)
        return real(model, cache, prompt_ids, new_tokens, device=device)

    monkeypatch.setattr(tr, "greedy_answer", keep_cache)
    out = tr.evaluate_turn_recall(
        model, tokenizer, "scissorhands", [2, 4], sessions=2, filler_tokens=16, compression_ratio=40,
        policy_params={"min_budget_tokens": 0}, reuse="shared_prefix",
    )  # fmt: skip
    n_new = out["answer_tokens"]
    for j, cache in enumerate(caches):
        prompt = out["prompt_tokens_by_turn"][j // 2][j % 2]
        pinned = (prompt - 1) // 16 * 16
        budget = out["budget_tokens_by_turn"][j // 2][j % 2]
        assert out["pinned_tokens_by_turn"][j // 2][j % 2] == pinned == tr.pinned_prefix_tokens(prompt) > 0
        assert budget < prompt + n_new - 1 - pinned  # what follows the prefix does not fit: the policy evicts
        assert cache.evicted_tokens > 0 and cache.pinned_tokens() == [pinned]
        assert cache.held_tokens() == out["held_tokens_by_turn"][j // 2][j % 2] <= pinned + budget
        for layer in cache.layers:
            times = layer.slot_time[0]  # (kv_heads, slots)
            assert (times[:, :pinned] == torch.arange(pinned)).all()
            assert (times[:, pinned:] >= pinned).all() and int(layer.held[0]) <= pinned + budget
    assert [tr.pinned_prefix_tokens(n) for n in (1, 16, 17, 33)] == [0, 0, 16, 32]


def test_full_cache_answers_are_the_same_under_every_reuse_way(tokenizer):
    """The full cache evicts nothing, so carrying it through the turns (or pinning a prefix) changes no answer."""
    model = tiny_llama(seed=1, vocab_size=len(tokenizer), max_position_embeddings=2048)
    runs = {
        way: tr.evaluate_turn_recall(model, tokenizer, "full", [2, 4, 6], sessions=2, filler_tokens=16, reuse=way)
        for way in tr.REUSE_WAYS
    }
    assert len(runs) == len(tr.REUSE_WAYS) >= 2
    for way, out in runs.items():
        assert out["answers"] == runs["none"]["answers"], way
        assert out["held_tokens_by_turn"] == [
            [n + out["answer_tokens"] - 1 for n in row] for row in out["prompt_tokens_by_turn"]
        ]


def test_a_bad_reuse_way_exits_2_naming_the_field(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**SUITE, "replicas": 1, "turn_recall": {"turns": [2], "reuse": ["none", "chain"]}}))
    results = tmp_path / "r"
    assert sweep.main([str(path), "--local", "--results-dir", str(results), "--pushgateway", "off"]) == 2
    err = capsys.readouterr().err
    assert f"turn_recall.reuse: expected one of {', '.join(tr.REUSE_WAYS)}, got 'chain'" in err
    assert not results.exists() or not any(results.iterdir())


def test_evaluation_refuses_bad_input(tokenizer):
    model = tiny_llama(seed=0)
    with pytest.raises(ValueError, match=rf"^reuse: expected one of {', '.join(tr.REUSE_WAYS)}, got 'carry'$"):
        tr.evaluate_turn_recall(model, tokenizer, "full", [2], reuse="carry")
    with pytest.raises(ValueError, match="turns"):
        tr.evaluate_turn_recall(model, tokenizer, "full", [1])
    with pytest.raises(ValueError, match="turns"):
        tr.evaluate_turn_recall(model, tokenizer, "full", [])
    with pytest.raises(ValueError, match="tokenizer"):
        tr.evaluate_turn_recall(model, None, "full", [2])
    with pytest.raises(ValueError, match=r"turns: turn 12 is \d+ prompt \+ 8 answer tokens, beyond .*\(512 tokens\)"):
        tr.evaluate_turn_recall(model, tokenizer, "full", [12], sessions=1, filler_tokens=48)  # tiny: 512 tokens


SUITE = tiny_suite(
    "quality",
    name="recall",
    compression_ratios=[2, 5],
    turn_recall={"turns": [2, 3], "sessions": 2, "filler_tokens": 16},
)


@pytest.mark.parametrize(
    "section, field",
    [
        ({"turns": [1, 4]}, r"turn_recall\.turns\[0\].*greater than or equal to 2"),
        ({"turns": []}, r"turn_recall\.turns"),
        ({"turns": [4, 4]}, r"turn_recall\.turns: each k once"),
        ({"reuse": "carry"}, rf"^turn_recall\.reuse: expected one of {', '.join(tr.REUSE_WAYS)}, got 'carry'$"),
        (
            {"reuse": ["none", "prefix"]},
            rf"^turn_recall\.reuse: expected one of {', '.join(tr.REUSE_WAYS)}, got 'prefix'$",
        ),
        ({"reuse": []}, r"^turn_recall\.reuse: expected one of .* or a list of them, got \[\]$"),
        ({"reuse": ["none", "none"]}, r"^turn_recall\.reuse: each way once"),
        ({"sessions": 0}, r"turn_recall\.sessions"),
        ({"filler_tokens": 4}, r"turn_recall\.filler_tokens"),
        ({"turn": [2]}, r"turn_recall"),
    ],
)
def test_bad_turn_recall_sections_name_the_field(section, field):
    with pytest.raises(SuiteError, match=field):
        parse_suite({**SUITE, "turn_recall": section})


def test_a_turn_beyond_the_models_context_exits_2_at_load(tmp_path, capsys):
    fits = parse_suite({**SUITE, "turn_recall": {"turns": [2, 6], "filler_tokens": 48}})
    check_model_context(fits)  # 128 + 4 x 72 + 8 = 424 <= 512
    long = {**SUITE, "turn_recall": {"turns": [2, 7], "filler_tokens": 48}}  # 128 + 5 x 72 + 8 = 496
    check_model_context(parse_suite(long))
    longer = {**SUITE, "turn_recall": {"turns": [8], "filler_tokens": 48}}  # 568 > 512
    with pytest.raises(SweepError, match=r"turn_recall\.turns .* = 568 tokens exceeds .*\(512 tokens\)") as e:
        check_model_context(parse_suite(longer))
    assert e.value.code == 2
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump({**longer, "replicas": 1}))
    results = tmp_path / "r"
    assert sweep.main([str(path), "--local", "--results-dir", str(results), "--pushgateway", "off"]) == 2
    assert "turn_recall.turns" in capsys.readouterr().err
    assert not results.exists() or not any(results.iterdir())


def test_the_suites_points_run_on_a_tiny_model_and_fill_the_report(tokenizer):
    """Every point of the suite (full; scissorhands at 2x and 5x; each under every reuse way), run as the runner runs
    it, on a tiny random model that shares the embedded tokenizer: the records carry per-k counts, intervals and
    budgets, and the report's table has a row per policy, ratio and way and a column per k."""
    suite = {**SUITE, "turn_recall": {**SUITE["turn_recall"], "reuse": list(tr.REUSE_WAYS)}}
    points = [p for p in parse_suite(suite).points() if p.kind == "turn_recall"]
    configs = [("full", 1.0), ("scissorhands", 2.0), ("scissorhands", 5.0)]
    assert [(p.policy, p.compression_ratio, p.settings["reuse"]) for p in points] == [
        (*c, way) for c in configs for way in tr.REUSE_WAYS
    ]
    assert len({p.point_id for p in points}) == len(points) and all(
        p.point_id.startswith("turnrecall-") for p in points
    )
    model = tiny_llama(seed=0, vocab_size=len(tokenizer), max_position_embeddings=1024)
    torch.set_num_threads(1)
    records = []
    for p in points:
        out = quality_points.run_point(model, tokenizer, p)
        assert out["turns"] == [2, 3] and out["sessions"] == 2 and len(out["correct_trials"]) == 4
        assert out["reuse"] == p.settings["reuse"] and all(0 <= c <= 2 for c in out["correct_by_turn"])
        for lo, acc, hi in zip(
            out["accuracy_ci95_low_by_turn"], out["accuracy_by_turn"], out["accuracy_ci95_high_by_turn"]
        ):
            assert 0 <= lo <= acc <= hi <= 1
        if p.policy == "scissorhands":  # B of the turn-k conversation + its answer; under shared_prefix of the
            n_new = out["answer_tokens"]  # tokens past the pinned prefix (what it compresses), capped at their count
            pinned = tr.pinned_prefix_tokens if p.settings["reuse"] == "shared_prefix" else lambda n: 0
            assert out["budget_tokens_by_turn"] == [
                [
                    min(n + n_new - pinned(n), max(32, math.ceil((n + n_new - pinned(n)) / p.compression_ratio)))
                    for n in row
                ]
                for row in out["prompt_tokens_by_turn"]
            ]
        records.append(
            {**out, "status": "ok", "evaluation": "turn_recall", "point_id": p.point_id, "policy": p.policy,
             "compression_ratio": p.compression_ratio, "kv_bits": None, "model_id": "tiny"}
        )  # fmt: skip
    full = [r["answers"] for r in records if r["policy"] == "full"]
    assert all(a == full[0] for a in full)  # the full cache evicts nothing: every way answers alike
    md = "\n".join(" ".join(line.split()) for line in markdown(records).splitlines())
    assert "### Turn-k recall: a 5-digit code" in md and "| policy, compression | reuse | k=2 | k=3 |" in md
    rows = [line for line in md.splitlines() if line.startswith(("| full 1x |", "| scissorhands "))]
    assert [tuple(c.strip() for c in row.split("|")[1:3]) for row in rows] == [
        (f"{pol} {r:g}x", way) for pol, r in configs for way in tr.REUSE_WAYS
    ]


def _record(policy, ratio, correct_by_turn, turns=(2, 4, 8), sessions=4, reuse="none"):
    ci = [wilson_interval(c, sessions) for c in correct_by_turn]
    return {
        "status": "ok",
        "evaluation": "turn_recall",
        "point_id": f"tr-{policy}-{ratio}-{reuse}",
        "policy": policy,
        "compression_ratio": ratio,
        "kv_bits": None,
        "turns": list(turns),
        "sessions": sessions,
        "digits": 5,
        "filler_tokens": 48,
        "reuse": reuse,
        "correct_by_turn": list(correct_by_turn),
        "accuracy_by_turn": [c / sessions for c in correct_by_turn],
        "accuracy_ci95_low_by_turn": [lo for lo, _ in ci],
        "accuracy_ci95_high_by_turn": [hi for _, hi in ci],
        "model_id": "m",
    }


def test_report_writes_one_row_per_point_and_reuse_way_and_a_column_per_turn():
    md = markdown(
        [
            _record("scissorhands", 5.0, [0, 0, 1], reuse="session_state"),
            _record("scissorhands", 5.0, [2, 1, 0]),
            _record("full", 1.0, [4, 4, 3]),
        ]
    )
    md = "\n".join(" ".join(line.split()) for line in md.splitlines())
    assert "a 5-digit code planted in turn 1, asked in turn k" in md and "4 sessions per k" in md
    assert "| policy, compression | reuse | k=2 | k=4 | k=8 |" in md and "way (none, session_state:" in md
    assert "| full 1x | none | 1.00 [0.51, 1.00] | 1.00 [0.51, 1.00] | 0.75 [0.30, 0.95] |" in md
    assert "| scissorhands 5x | none | 0.50 [0.15, 0.85] | 0.25 [0.05, 0.70] | 0.00 [0.00, 0.49] |" in md
    assert "| scissorhands 5x | session_state | 0.00 [0.00, 0.49] | 0.00 [0.00, 0.49] | 0.25 [0.05, 0.70] |" in md
    assert md.index("| full 1x |") < md.index("| scissorhands 5x | none |") < md.index("| scissorhands 5x | session")


@pytest.mark.slow
def test_embedded_full_cache_recalls_the_code_at_turns_2_and_4():
    """SmolLM2-135M-Instruct with the full cache answers the planted code at turns 2 and 4 (measured: 2/2 at k = 2,
    4 and 8 on sessions of 48-token fillers, seed 0; Scissorhands at 5x: 0/2 at each)."""
    torch.set_num_threads(1)
    model, tok = load_model("embedded", dtype=torch.float32, device="cpu")
    out = tr.evaluate_turn_recall(model, tok, "full", [2, 4], sessions=2)
    assert out["correct_by_turn"] == [2, 2], out["answers"]
    assert all(a.strip().startswith(c) for row in out["answers"] for a, c in zip(row, out["codes"]))


@pytest.mark.slow
def test_embedded_full_cache_answers_the_same_under_every_reuse_way():
    """SmolLM2-135M-Instruct with the full cache: the session's cache carried through its turns and the pinned
    prefix answer exactly as a fresh prefill of the conversation (the code, at turns 2 and 4)."""
    torch.set_num_threads(1)
    model, tok = load_model("embedded", dtype=torch.float32, device="cpu")
    runs = [tr.evaluate_turn_recall(model, tok, "full", [2, 4], sessions=1, reuse=way) for way in tr.REUSE_WAYS]
    assert runs[0]["correct_by_turn"] == [1, 1], runs[0]["answers"]
    assert all(run["answers"] == runs[0]["answers"] for run in runs[1:]), [run["answers"] for run in runs]
