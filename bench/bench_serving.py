"""`make bench-serving`: the paper's throughput claim on one replica, measured side by side in one run.

1. Max batch under one KV memory limit that fits `--full-batch` full-cache sequences: Scissorhands at `--ratio`
   against the full cache, each at its own largest batch, output tokens/s (goal >= 3x).
2. Our engine against transformers' `generate`, both with the full cache, on one serving mix (goal >= 1.3x).

Why interleaved step by step: the drift of a shared machine's speed over minutes falls on both runs alike. What
each part runs and how its tokens/s are counted: docs/performance.md, "How the bench tools measure". Part 1's
table is written to `--out` (bench.md, bench.json) as soon as it ends; part 2 rewrites both with every row.

    python -m bench.bench_serving [--prompt-tokens 1024] [--new-tokens 1024] [--full-batch 4] [--ratio 5]
                                  [--generate-new-tokens 512]
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench.conditions import DEFAULT_THREADS, THREADS_HELP, conditions_line, git_commit, parser
from replica.engine import ContinuousBatchingEngine, full_batch_kv_limit_bytes
from replica.generate_baseline import run_engines, run_generate
from replica.static_batch import load_replica_model
from replica.types import EngineConfig, GenerationRequest
from scissorhands.models import DTYPE_CHOICES, cpu_flags, cpu_model_name
from workloads.load.prompts import prompts_for


def parse_args(argv=None):
    p = parser("bench_serving", __doc__, "about 25 minutes with --threads 2 (make bench-serving passes it)")
    p.add_argument("--model", default="embedded", help="embedded, an HF id or a local folder (tiny-llama: test only)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=1024, help="output tokens per request of part 1")
    p.add_argument("--full-batch", type=int, default=4, help="full-cache sequences the KV limit holds")
    p.add_argument("--ratio", type=float, default=5.0, help="Scissorhands compression ratio")
    p.add_argument("--generate-requests", type=int, default=None, help="requests of part 2 (None: 4 x full batch)")
    p.add_argument("--generate-new-tokens", type=int, default=512, help="longest output of part 2's serving mix")
    p.add_argument("--skip-generate", action="store_true", help="run part 1 only (no engine vs generate)")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 where this machine runs it faster, see "
        "scissorhands.models.resolve_dtype) | float32 | bfloat16 | float16",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths")
    p.add_argument("--out", default="results/bench-serving", help="folder for bench.json and bench.md")
    args = p.parse_args(argv)
    for name in ("prompt_tokens", "new_tokens", "full_batch", "generate_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    if args.dtype not in DTYPE_CHOICES:
        p.error(f"--dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {args.dtype!r}")
    if args.generate_new_tokens > args.new_tokens:
        p.error(
            f"--generate-new-tokens ({args.generate_new_tokens}) must be <= --new-tokens ({args.new_tokens}): "
            f"part 2 runs full's max batch under the KV limit sized for --new-tokens"
        )
    return args


def _part2(model, tokenizer, vocab, args, b, limit):
    P, N = args.prompt_tokens, args.generate_new_tokens
    m = args.generate_requests or 4 * b
    rng = np.random.default_rng(args.seed + 1)
    lengths = rng.integers(max(1, N // 4), N + 1, size=m).tolist()
    p_lengths = rng.integers(max(1, P // 4), P + 1, size=m).tolist()
    prompts = [prompts_for(tokenizer, vocab, 1, int(n), args.seed + 1 + i)[0] for i, n in enumerate(p_lengths)]
    reqs = [GenerationRequest(f"g-{i}", p, int(n)) for i, (p, n) in enumerate(zip(prompts, lengths))]
    print(f"bench-serving: engine vs generate, full cache, batch {b}, {m} requests ...", file=sys.stderr)
    with tqdm(
        total=math.ceil(len(reqs) / b), desc="generate", unit="batch", file=sys.stderr, dynamic_ncols=True
    ) as bar:
        gen = run_generate(model, reqs, b, on_batch=lambda: bar.update(1))
    (eng,) = run_engines(
        model,
        [(EngineConfig(max_batch=b, kv_memory_limit_bytes=limit, max_length_tokens=P + N), reqs)],
        desc="engine (part 2)",
    )
    same = sum(eng["outputs"][r.request_id] == gen["outputs"][r.request_id] for r in reqs)
    ratio_engine = (
        eng["output_tok_per_s"] / gen["output_tok_per_s"],
        eng["output_tok_per_cpu_s"] / gen["output_tok_per_cpu_s"],
    )
    return gen, eng, same, ratio_engine, m, lengths, p_lengths


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    t_load = time.perf_counter()
    model, tokenizer = load_replica_model(args.model, dtype=args.dtype)

    dtype = str(model.dtype).removeprefix("torch.")
    dtype_reason = getattr(model, "scissorhands_dtype_reason", "")
    cpu = f"{cpu_model_name()} ({', '.join(sorted(cpu_flags() & {'amx_bf16', 'avx512_bf16', 'avx512f', 'avx2'})) or 'no AVX flags'})"
    model.generation_config.eos_token_id = None
    vocab = int(model.config.vocab_size)
    P, N = args.prompt_tokens, args.new_tokens
    limit = full_batch_kv_limit_bytes(model, args.full_batch, P, N)
    print(
        f"bench-serving: model {args.model} loaded in {time.perf_counter() - t_load:.1f} s; {torch.get_num_threads()} "
        f"torch thread(s); prompt {P} tok, {N} new tok; KV limit {limit / 2**20:.1f} MiB "
        f"(= {args.full_batch} full-cache sequences)",
        file=sys.stderr,
    )

    # -- part 1: each policy at its own max batch under the limit, both runs interleaved step by step
    policies, runs = [], []
    for policy, ratio in (("full", None), ("scissorhands", args.ratio)):
        kw = dict(policy=policy, kv_memory_limit_bytes=limit, max_length_tokens=P + N)
        if ratio is not None:
            kw.update(compression_ratio=ratio)
        cfg = EngineConfig(**kw)
        b = ContinuousBatchingEngine(model, cfg).max_batch_for(P, N)
        prompts = prompts_for(tokenizer, vocab, b, P, args.seed)
        policies.append((policy, ratio, b))
        runs.append((cfg, [GenerationRequest(f"{policy}-{i}", p, N) for i, p in enumerate(prompts)]))
    print(
        "bench-serving: "
        + ", ".join(f"{p}{f' x{r:g}' if r else ''} at max batch {b}" for p, r, b in policies)
        + ": running them interleaved ...",
        file=sys.stderr,
    )
    rows = run_engines(model, runs, desc="part 1 (both, interleaved)")
    for r, (policy, ratio, b) in zip(rows, policies):
        r.update(
            policy=policy,
            ratio=ratio,
            max_batch=b,
            verified=r["peak_running_sequences"] == b and r["peak_kv_cache_bytes"] <= limit,
        )
    full, sh = rows
    ratio_max_batch = sh["output_tok_per_s"] / full["output_tok_per_s"]
    ratio_decode = (sh["decode_tok_per_s"] / full["decode_tok_per_s"]) if full["decode_tok_per_s"] else None
    ratio_cpu = sh["output_tok_per_cpu_s"] / full["output_tok_per_cpu_s"]
    # what the end-to-end ratio could reach at these sizes if Scissorhands' decode cost nothing: prefill
    # (the same work per prompt for every policy) alone bounds it
    ratio_ceiling = sh["output_tokens"] / sh["prefill_s"] / full["output_tok_per_s"] if sh["prefill_s"] else None

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    b = full["max_batch"]

    def report(gen, eng, same, ratio_engine, m=None, lengths=None, p_lengths=None) -> None:
        """Print the table of what is measured so far and write bench.md / bench.json (after each part)."""

        def row(name, batch, r, extra=""):
            dec = f"{r['decode_tok_per_s']:.1f}" if r.get("decode_tok_per_s") else "-"
            kv = f"{r['peak_kv_cache_bytes'] / 2**20:.1f}" if r.get("peak_kv_cache_bytes") is not None else "-"
            return (
                f"| {name} | {batch} | {r['output_tokens']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                f"{r['output_tok_per_s']:.1f} | {r['output_tok_per_cpu_s']:.2f} | {dec} | {kv} | {extra} |"
            )

        commit = git_commit()
        lines = [
            conditions_line(model=args.model, dtype=f"{dtype} ({dtype_reason})").rstrip(".") + "; one replica in "
            f"process; prompts {P} tokens of {'real text' if tokenizer is not None else 'random ids'}; KV memory limit {limit} B ({limit / 2**20:.1f} MiB) = "
            f"{args.full_batch} full-cache sequences of {P} + {N} tokens.",
            "",
            "| run | batch | output tokens | wall (s) | CPU (s) | output (tok/s) | output (tok/CPU-s) | decode (tok/s) "
            "| peak KV (MiB) | note |",
            "|---|---|---|---|---|---|---|---|---|---|",
            row("full, max batch", full["max_batch"], full, f"verified {full['verified']}"),
            row(
                f"scissorhands x{args.ratio:g}, max batch",
                sh["max_batch"],
                sh,
                f"B = {sh['budget_tokens']} slots; verified {sh['verified']}",
            ),
        ]
        if gen is not None:
            lines += [
                row(
                    "transformers generate, full",
                    b,
                    gen,
                    f"{m} requests, prompts {min(p_lengths)}-{max(p_lengths)} tok, "
                    f"outputs {min(lengths)}-{max(lengths)} tok, static batches",
                ),
                row("our engine, full", b, eng, f"same requests, continuous batching; identical tokens {same}/{m}"),
            ]
        lines += [
            "",
            "| ratio | measured | goal |",
            "|---|---|---|",
            f"| Scissorhands x{args.ratio:g} / full, output tok/s at own max batch | {ratio_max_batch:.2f}x | >= 3x |",
            f"| same, decode tok/s only | {ratio_decode:.2f}x | - |" if ratio_decode else "",
            f"| same, output tokens per CPU-second (insensitive to other jobs on shared cores) | {ratio_cpu:.2f}x | - |",
            f"| ceiling of the first ratio at these sizes (Scissorhands' decode free: its output tokens / its prefill "
            f"time, over full's output tok/s) | {ratio_ceiling:.2f}x | - |"
            if ratio_ceiling
            else "",
            f"| our engine / transformers generate, full cache, batch {b} | {ratio_engine[0]:.2f}x | >= 1.3x |"
            if ratio_engine is not None
            else "",
            f"| same, output tokens per CPU-second | {ratio_engine[1]:.2f}x | - |" if ratio_engine is not None else "",
        ]
        text = "\n".join(x for x in lines if x is not None) + "\n"
        print(text, flush=True)
        for r in (full, sh, gen, eng):
            if r is not None:
                r.pop("outputs", None)
        (out / "bench.json").write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "git_commit": commit,
                    "dtype": dtype,
                    "dtype_reason": dtype_reason,
                    "cpu": cpu,
                    "torch_threads": torch.get_num_threads(),
                    "kv_memory_limit_bytes": limit,
                    "max_batch": {"full": full, "scissorhands": sh},
                    "generate": gen,
                    "engine": eng,
                    "identical_tokens": same,
                    "ratio_max_batch_output": ratio_max_batch,
                    "ratio_max_batch_decode": ratio_decode,
                    "ratio_max_batch_output_per_cpu_s": ratio_cpu,
                    "ratio_max_batch_output_ceiling": ratio_ceiling,
                    "ratio_engine_vs_generate": ratio_engine[0] if ratio_engine else None,
                    "ratio_engine_vs_generate_per_cpu_s": ratio_engine[1] if ratio_engine else None,
                },
                indent=2,
                default=str,
            )
            + "\n"
        )
        (out / "bench.md").write_text(text)
        print(f"bench-serving: wrote {out / 'bench.json'} and {out / 'bench.md'}", file=sys.stderr)

    for r in (full, sh):
        r.pop("outputs", None)
    report(None, None, None, None)  # part 1 is kept even if part 2 is stopped
    # -- part 2: our engine vs transformers' generate, full cache, same batch
    if not args.skip_generate:
        gen, eng, same, ratio_engine, m, lengths, p_lengths = _part2(model, tokenizer, vocab, args, b, limit)
        report(gen, eng, same, ratio_engine, m, lengths, p_lengths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
