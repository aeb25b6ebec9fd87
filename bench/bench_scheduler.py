"""`make bench-scheduler`: prefill-first against the mixed scheduler at several token budgets, under one KV limit.

The same requests for every row (`--workload mix`, the default: prompts uniform in [P/4, P], outputs log-uniform
in [16, N]; `equal`: every request P + N; `bench.bench_serving`'s workloads), all submitted at once on one replica
in process, the rows interleaved step by step (`replica.generate_baseline.run_engines`): the paged full cache and
Scissorhands x`--ratio` (per-request budgets), each under `scheduler: prefill_first` and under `scheduler: mixed`
with every `--budgets` token budget (`max_num_batched_tokens`). Per row: output tok/s, TTFT p50 / p99 (queueing
included), ITL p50 / p99 (every gap between two tokens of a request: a prompt prefilled whole stalls the running
rows' next token; a preempted request's gap holds its wait and recompute), preemptions; per budget the ratio
Scissorhands / full, both mixed; and whether the full cache's tokens under mixed equal prefill-first's. The default
budget of `EngineConfig` is the one this tool chose (docs/results/2026-12-04-mixed-scheduler.md).

    python -m bench.bench_scheduler [--prompt-tokens 512] [--new-tokens 256] [--full-batch 2] [--ratio 5]
                                    [--requests 24] [--budgets 128,256,512,1024] [--workload mix|equal]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from bench.bench_serving import _pair, workload_lengths
from bench.conditions import (
    DEFAULT_THREADS,
    THREADS_HELP,
    comma_list,
    conditions_line,
    contended_lines,
    git_commit,
    parser,
    require_positive,
)
from replica import cpu_share
from replica.common.types import EngineConfig, GenerationRequest
from replica.cpu_share import CpuMeter
from replica.engine import full_batch_kv_limit_bytes
from replica.generate_baseline import run_engines
from replica.model_loading import load_replica_model
from workloads.load.prompts import prompts_for


def parse_args(argv=None):
    p = parser("bench_scheduler", __doc__, "about 20 minutes with --threads 2 (make bench-scheduler passes it)")
    p.add_argument("--model", default="embedded", help="embedded, an HF id or a local folder (tiny-llama: test only)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="longest prompt (tokens)")
    p.add_argument("--new-tokens", type=int, default=256, help="longest output (tokens)")
    p.add_argument("--full-batch", type=int, default=2, help="preallocated full-cache sequences the KV limit holds")
    p.add_argument("--ratio", type=float, default=5.0, help="Scissorhands compression ratio")
    p.add_argument("--requests", type=int, default=24, help="requests (the same for every row)")
    p.add_argument("--block-tokens", type=int, default=16, help="slots per block")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths")
    p.add_argument("--out", default="results/bench-scheduler", help="folder for bench.json and bench.md")
    p.add_argument("--budgets", default="128,256,512,1024", help="the mixed rows' token budgets a step (comma list)")
    p.add_argument(
        "--workload",
        choices=["mix", "equal"],
        default="mix",
        help="mix: prompts uniform in [P/4, P], outputs log-uniform in [16, N]; equal: every request P + N",
    )
    args = p.parse_args(argv)
    args.budgets = comma_list(p, "--budgets", args.budgets, int)
    require_positive(p, args, "prompt_tokens", "new_tokens", "full_batch", "requests", "block_tokens")
    low = [b for b in args.budgets if b < args.block_tokens]
    if low:
        p.error(f"--budgets: {low} below one block (--block-tokens {args.block_tokens}); give at least that")
    return args


def rows(ratio: float, limit: int, block_tokens: int, budgets: list[int]) -> list[tuple[str, EngineConfig]]:
    """(label, engine config) of every row: full and Scissorhands x`ratio` paged, prefill-first, then mixed at
    each token budget; the first row is the denominator of "x of prefill-first full"."""
    paged = dict(kv_layout="paged", kv_memory_limit_bytes=limit, block_tokens=block_tokens)
    caches = [("full", {}), (f"scissorhands x{ratio:g}", dict(policy="scissorhands", compression_ratio=ratio))]
    caches[1][1]["budget"] = "per_request"
    out = [(f"{name}, prefill_first", EngineConfig(**paged, **kw)) for name, kw in caches]
    for t in budgets:
        out += [
            (f"{name}, mixed {t}", EngineConfig(**paged, **kw, scheduler="mixed", max_num_batched_tokens=t))
            for name, kw in caches
        ]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    model, tokenizer = load_replica_model(args.model, dtype=args.dtype)
    model.generation_config.eos_token_id = None
    dtype = str(model.dtype).removeprefix("torch.")
    P, N = args.prompt_tokens, args.new_tokens
    limit = full_batch_kv_limit_bytes(model, args.full_batch, P, N)
    print(f"bench-scheduler: model loaded in {time.perf_counter() - t_load:.1f} s", file=sys.stderr)
    p_lens, n_lens = workload_lengths(args.workload, P, N, args.requests, args.seed + 10)
    vocab = int(model.config.vocab_size)
    prompts = [prompts_for(tokenizer, vocab, 1, n, args.seed + i)[0] for i, n in enumerate(p_lens)]
    table = rows(args.ratio, limit, args.block_tokens, args.budgets)
    runs = [
        (cfg, [GenerationRequest(f"{label}-{i}", pr, n) for i, (pr, n) in enumerate(zip(prompts, n_lens))])
        for label, cfg in table
    ]
    with CpuMeter(args.threads) as meter:  # the rows interleave: the run's share is every row's
        measured = run_engines(model, runs, desc="bench-scheduler")
    base = measured[0]["output_tok_per_s"]
    lines = [
        conditions_line(model=args.model, dtype=f"{dtype} ({getattr(model, 'scissorhands_dtype_reason', '')})").rstrip(
            "."
        )
        + f"; KV memory limit {limit} B = {args.full_batch} preallocated full-cache sequences of {P} + {N} tokens; "
        f"{args.requests} requests (prompts {min(p_lens)}-{max(p_lens)}, outputs {min(n_lens)}-{max(n_lens)} tokens), "
        "the same for every row, all submitted at once; rows interleaved step by step; blocks of "
        f"{args.block_tokens} slots.",
        "",
        "| row | x of prefill-first full, output tok/s | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | "
        "peak running | preemptions | recomputed tokens | wall (s) | CPU share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    results = {"args": vars(args), "dtype": dtype, "kv_memory_limit_bytes": limit, "rows": {}}
    results["full_outputs_match_prefill_first"] = _full_outputs_match(table, measured)
    for (label, _), r in zip(table, measured):
        r.pop("outputs", None)
        r.update(cpu_share.row_fields(meter.fields, r["cpu_s"], r["wall_s"], args.threads))
        results["rows"][label] = r
        lines.append(
            f"| {label} | {r['output_tok_per_s'] / base:.2f}x | {r['output_tok_per_s']:.1f} | "
            f"{_pair(r['ttft_p50_s'], r['ttft_p99_s'], 1, '.1f')} | {_pair(r['itl_p50_s'], r['itl_p99_s'], 1000, '.0f')} "
            f"| {r['peak_running_sequences']} | {r['preemptions']} | {r['recomputed_tokens']} | {r['wall_s']:.1f} "
            f"| {cpu_share.mark(r)} |"
        )
    sh = f"scissorhands x{args.ratio:g}"
    lines += ["", f"| scheduler | {sh} / full, output tok/s | {sh} ITL p99 / full's |", "|---|---|---|"]
    for sched in ["prefill_first"] + [f"mixed {t}" for t in args.budgets]:
        f, s = results["rows"][f"full, {sched}"], results["rows"][f"{sh}, {sched}"]
        itl = f"{s['itl_p99_s'] / f['itl_p99_s']:.2f}x" if s["itl_p99_s"] and f["itl_p99_s"] else "-"
        lines.append(f"| {sched} | {s['output_tok_per_s'] / f['output_tok_per_s']:.2f}x | {itl} |")
    same = results["full_outputs_match_prefill_first"]
    lines += contended_lines("bench-scheduler", results["rows"])
    lines += [
        "",
        "Full cache, greedy tokens equal to prefill-first's: " + ", ".join(f"{k} {v}" for k, v in same.items()),
    ]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results["git_commit"] = git_commit()
    (out / "bench.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "bench.md").write_text(text)
    print(f"bench-scheduler: wrote {out / 'bench.json'} and {out / 'bench.md'}", file=sys.stderr)
    return 0


def _full_outputs_match(table: list[tuple[str, EngineConfig]], measured: list[dict]) -> dict[str, bool]:
    """Per mixed token budget, whether the full cache's greedy tokens equal prefill-first's on every request (the
    schedulers change when a token is computed, not which: a False is a finding, rounding of a chunked prefill)."""

    def tokens(label: str) -> list[list[int]]:
        out = next(r["outputs"] for (name, _), r in zip(table, measured) if name == label)
        return [out[k] for k in sorted(out, key=lambda k: int(k.rsplit("-", 1)[1]))]

    want = tokens("full, prefill_first")
    return {
        label.removeprefix("full, "): tokens(label) == want for label, _ in table if label.startswith("full, mixed")
    }


if __name__ == "__main__":
    sys.exit(main())
