"""`make bench-serving`: the paper's throughput claim on one replica, against the engine people serve with.

1. Under one KV memory limit (`--full-batch` preallocated full-cache sequences of `--prompt-tokens` +
   `--new-tokens`), the same requests for every row, on two workloads: (a) every request of those lengths;
   (b) a length mix (prompts uniform in [P/4, P], outputs log-uniform in [16, N]: most requests end far before
   the longest, as serving traffic does; a synthetic spread, not a trace). Rows: the paged full cache (the
   denominator of the headline), the preallocated full cache (the paper's setting and the older
   denominator), Scissorhands x`--ratio` paged with per-request budgets, the same with 4-bit storage,
   Scissorhands x1 on the paged engine (what the engine alone changes), Scissorhands x`--ratio`
   preallocated with one budget (the older row), and, under the mixed scheduler (`--mixed`, on by default: one
   token budget of `--max-num-batched-tokens` a step, decodes first, then prompt chunks), the paged full cache and
   Scissorhands x`--ratio` paged again. Every other row prefills first. Output tokens/s, each row over its own
   steps; TTFT, TPOT and ITL percentiles on each row's own clock. Then, on the same
   requests, an outside peer: transformers' continuous batching (`generate_batch`'s engine, its paged cache sized to
   the same KV bytes; `replica.generate_baseline.run_generate_batch`), after every workload's rows (it runs in a
   thread of its own, so it cannot be interleaved step by step; `--no-peer-generate-batch` leaves it out).
2. Our engine against transformers' `generate`, both with the full cache, on one serving mix (goal >= 1.3x).

Engines (`--engines`, default ``ours``; e.g. ``ours,openvino``): each engine's rows run on the same requests, all
submitted at 0 (the same arrivals), interleaved step by step with every other row. ``openvino`` adds OpenVINO
GenAI's ``ContinuousBatchingPipeline`` (`replica.backends.openvino`) under the same KV bytes: its full cache and its
eviction at x`--ratio` (``max_cache_size`` from ``P + N`` as ours' budget, rounded up to its 32-token block), both
paged with one token budget of `--max-num-batched-tokens` a step, at `--openvino-kv-precision`. Every row names its
engine (a column, and ``engine`` in bench.json), and the conditions name each engine's version and KV precision.
What OpenVINO does not report (preemptions, decode time) is "n/r" in the table and null in bench.json. Without
its runtime or export the tool exits 2 naming ``make openvino-runtime openvino-peer``. Part 2 and transformers'
``generate_batch`` compare ours only: they run when ``ours`` is among the engines.

Why interleaved step by step: the drift of a shared machine's speed over minutes falls on every run alike. What
each part runs and how its tokens/s are counted: docs/performance.md, "How the bench tools measure". Each
workload's table is written to `--out` (bench.md, bench.json) as soon as it ends.

    python -m bench.bench_serving [--prompt-tokens 1024] [--new-tokens 1024] [--full-batch 4] [--ratio 5]
                                  [--requests 24] [--workloads equal,mix] [--generate-new-tokens 512]
                                  [--no-peer-generate-batch] [--engines ours,openvino]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.conditions import (
    DEFAULT_THREADS,
    THREADS_HELP,
    conditions_line,
    contended_lines,
    git_commit,
    parser,
    require_positive,
)
from replica import cpu_share
from replica.backends.openvino import BackendUnavailable, check_available
from replica.common.types import ENGINES, EngineConfig, GenerationRequest
from replica.cpu_share import CpuMeter
from replica.engine import ContinuousBatchingEngine, full_batch_kv_limit_bytes
from replica.generate_baseline import run_engines, run_generate, run_generate_batch
from replica.model_loading import load_replica_model
from replica.openvino_settings import BACKEND_KV_PRECISIONS
from replica.progress import MeasuredEtaBar
from scissorhands.models import DTYPE_CHOICES, cpu_flags, cpu_model_name
from workloads.load.prompts import prompts_for


def _ratio(value: float | None, base: float | None) -> str:
    """`value / base` as ``1.23x``; ``n/a`` when the first row produced nothing (all its requests failed)."""
    return f"{value / base:.2f}x" if value is not None and base else "n/a"


def parse_args(argv=None):
    p = parser("bench_serving", __doc__, "about 25 minutes with --threads 2 (make bench-serving passes it)")
    p.add_argument("--model", default="embedded", help="embedded, an HF id or a local folder (tiny-llama: test only)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=1024, help="output tokens per request of part 1")
    p.add_argument("--full-batch", type=int, default=4, help="full-cache sequences the KV limit holds")
    p.add_argument("--ratio", type=float, default=5.0, help="Scissorhands compression ratio")
    p.add_argument("--requests", type=int, default=None, help="requests of each part 1 workload (None: 6 x full batch)")
    p.add_argument("--workloads", default="equal,mix", help="part 1 workloads, comma-separated: equal, mix")
    p.add_argument("--block-tokens", type=int, default=16, help="slots per block of the paged rows (and the peer's)")
    p.add_argument(
        "--mixed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add the paged full and Scissorhands rows under the mixed scheduler (scheduler: mixed)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineConfig.model_fields["max_num_batched_tokens"].default,
        help="the mixed rows' token budget a step",
    )
    p.add_argument(
        "--peer-generate-batch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after each workload's interleaved rows, run its requests through transformers' continuous batching "
        "(generate_batch's paged cache, sized to the same KV bytes)",
    )
    p.add_argument(
        "--engines",
        default="ours",
        help=f"comma-separated engines whose rows run on the same requests ({', '.join(ENGINES)}); openvino adds "
        "OpenVINO GenAI's full cache and its eviction (make openvino-runtime openvino-peer first)",
    )
    p.add_argument(
        "--openvino-kv-precision",
        default="u8",
        choices=list(BACKEND_KV_PRECISIONS),
        help="the OpenVINO rows' KV cache precision (u8: its default, per-block scales; bf16: twice the bytes a token)",
    )
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
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workloads or any(w not in WORKLOADS for w in args.workloads):
        p.error(
            f"--workloads: expected a comma-separated list of {', '.join(WORKLOADS)}, got {','.join(args.workloads)!r}"
        )
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not args.engines or any(e not in ENGINES for e in args.engines) or len(set(args.engines)) < len(args.engines):
        p.error(f"--engines: expected a comma-separated list of {', '.join(ENGINES)}, got {','.join(args.engines)!r}")
    if "openvino" in args.engines:
        try:
            check_available(args.model)
        except BackendUnavailable as e:
            p.error(f"--engines openvino: {e}; `make openvino-runtime openvino-peer` makes both")
    if "ours" not in args.engines:  # both compare our engine: nothing to compare without its rows
        args.skip_generate, args.peer_generate_batch = True, False
    if args.requests is None:
        args.requests = 6 * args.full_batch
    require_positive(
        p, args, "prompt_tokens", "new_tokens", "full_batch", "generate_new_tokens", "requests", "block_tokens"
    )
    if args.mixed and args.max_num_batched_tokens < args.block_tokens:
        p.error(
            f"--max-num-batched-tokens {args.max_num_batched_tokens} is below one block (--block-tokens "
            f"{args.block_tokens}); give at least {args.block_tokens}"
        )

    if args.peer_generate_batch and args.block_tokens < 4:
        p.error(
            f"--block-tokens {args.block_tokens}: transformers' paged cache (--peer-generate-batch) takes pages of "
            "4 tokens or more; give --block-tokens >= 4 or --no-peer-generate-batch"
        )
    if args.dtype not in DTYPE_CHOICES:
        p.error(f"--dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {args.dtype!r}")
    if not args.skip_generate and args.generate_new_tokens > args.new_tokens:
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
    with MeasuredEtaBar(
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


WORKLOADS = ("equal", "mix")


def part1_rows(
    P: int, N: int, ratio: float, limit: int, block_tokens: int, head_dim: int, mixed_tokens: int | None = None
) -> list[tuple[str, EngineConfig]]:
    """(label, engine config) of every part 1 row, all under the KV memory `limit`; the first is the denominator.
    The 4-bit row quantizes groups of 32 values (or the whole head, `head_dim`, when smaller). `mixed_tokens`:
    the paged full and Scissorhands rows again, under the mixed scheduler with this token budget a step."""
    int4 = {"kv_bits": 4, "kv_group_size": min(32, head_dim)}
    paged = dict(kv_layout="paged", kv_memory_limit_bytes=limit, block_tokens=block_tokens)
    sh = dict(policy="scissorhands", budget="per_request", **paged)
    return [
        ("full, paged", EngineConfig(**paged)),
        ("full, preallocated", EngineConfig(kv_memory_limit_bytes=limit, max_length_tokens=P + N)),
        (f"scissorhands x{ratio:g}, paged", EngineConfig(compression_ratio=ratio, **sh)),
        (
            f"scissorhands x{ratio:g} 4-bit, paged",
            EngineConfig(compression_ratio=ratio, policy_params=int4, **sh),
        ),
        ("scissorhands x1, paged", EngineConfig(compression_ratio=1, **sh)),
        (
            f"scissorhands x{ratio:g}, preallocated",
            EngineConfig(
                policy="scissorhands", compression_ratio=ratio, max_length_tokens=P + N, kv_memory_limit_bytes=limit
            ),
        ),
    ] + (
        []
        if mixed_tokens is None
        else [
            ("full, paged, mixed", EngineConfig(**paged, scheduler="mixed", max_num_batched_tokens=mixed_tokens)),
            (
                f"scissorhands x{ratio:g}, paged, mixed",
                EngineConfig(compression_ratio=ratio, scheduler="mixed", max_num_batched_tokens=mixed_tokens, **sh),
            ),
        ]
    )


def openvino_rows(
    P: int, N: int, ratio: float, limit: int, max_num_batched_tokens: int, kv_precision: str = "u8"
) -> list[tuple[str, EngineConfig]]:
    """(label, engine config) of OpenVINO GenAI's rows under the KV memory `limit`: its full cache, and its eviction
    at x`ratio` (``max_cache_size`` from ``P + N`` tokens, `replica.openvino_settings.max_cache_size_for`); both paged
    with one token budget a step, at `kv_precision`."""
    ov = dict(
        engine="openvino",
        kv_layout="paged",
        scheduler="mixed",
        kv_memory_limit_bytes=limit,
        max_num_batched_tokens=max_num_batched_tokens,
        openvino_kv_precision=kv_precision,
    )
    return [
        ("openvino full, paged, mixed", EngineConfig(**ov)),
        (
            f"openvino_eviction x{ratio:g}, paged, mixed",
            EngineConfig(policy="openvino_eviction", compression_ratio=ratio, max_length_tokens=P + N, **ov),
        ),
    ]


def engine_rows(args, P: int, N: int, limit: int, head_dim: int) -> list[tuple[str, EngineConfig]]:
    """Every part 1 row of `args.engines`, in that order (ours: `part1_rows`; openvino: `openvino_rows`)."""
    rows = []
    for engine in args.engines:
        if engine == "ours":
            mixed = args.max_num_batched_tokens if args.mixed else None
            rows += part1_rows(P, N, args.ratio, limit, args.block_tokens, head_dim, mixed)
        else:
            rows += openvino_rows(P, N, args.ratio, limit, args.max_num_batched_tokens, args.openvino_kv_precision)
    return rows


def engines_line(table: dict) -> str:
    """The engines of the rows in words, each with its version and KV settings (from the rows' results)."""
    parts = []
    for engine in dict.fromkeys(r["engine"] for r in table.values()):
        r = next(r for r in table.values() if r["engine"] == engine)
        if engine == "ours":
            parts.append(f"ours (this repository's engine at commit {git_commit()}, KV in the model's dtype)")
        else:
            parts.append(
                f"openvino (OpenVINO GenAI {r.get('openvino_genai_version')}, KV precision "
                f"{r.get('openvino_kv_precision')}, inference precision {r.get('openvino_inference_precision')}, "
                f"{r.get('openvino_threads')} thread(s), {r.get('openvino_block_bytes')} B a 32-token block; it reports "
                f"no {', '.join(r.get('not_reported') or [])}: n/r below)"
            )
    return "Engines: " + "; ".join(parts) + "."


def _reported(value, fmt: str = "") -> str:
    """A figure the engine reports, or ``n/r`` (not reported: OpenVINO's pipeline counts no preemptions)."""
    return "n/r" if value is None else f"{value:{fmt}}"


PEER_LABEL = "transformers generate_batch (after the rows, not interleaved)"


def _pair(p50: float | None, p99: float | None, scale: float, fmt: str) -> str:
    """'p50 / p99' scaled (seconds to the column's unit), '-' where a request count gave none."""
    return "-" if p50 is None else f"{p50 * scale:{fmt}} / {p99 * scale:{fmt}}"


def _peer_lines(peer: dict, base: dict, requests: int) -> list[str]:
    """The peer's table row (its ratios over the paged full row `base`) and the note under the table."""
    per_cpu = (
        peer["output_tok_per_cpu_s"] / base["output_tok_per_cpu_s"]
        if peer["output_tok_per_cpu_s"] and base["output_tok_per_cpu_s"]
        else None
    )
    return [
        f"| {PEER_LABEL} | transformers | {peer['output_tok_per_s'] / base['output_tok_per_s']:.2f}x | "
        f"{peer['output_tok_per_s']:.1f} | - | - | - | - | - | - | - | {peer['kv_cache_bytes'] / 2**20:.1f} | {peer['wall_s']:.1f} "
        f"| {peer['cpu_s']:.1f} |",
        "",
        f"transformers `generate_batch`: its continuous batching and paged cache ({peer['kv_cache_blocks']} blocks of "
        f"{peer['page_tokens']} tokens of every layer, the KV limit's bytes; {peer['attn_implementation']} attention, "
        f"at most {peer['max_batch_tokens']} tokens a forward, prefix sharing off), greedy, EOS off, the same requests "
        f"submitted at once. It runs in a thread of its own, so it ran after the interleaved rows, not step by step "
        f"with them: the machine's drift between the two falls on its ratio (output tokens per CPU-second: "
        f"{f'{per_cpu:.2f}x' if per_cpu else '-'} of paged full's). Its peak KV is its whole pool, allocated at the "
        f"start. Identical tokens vs paged full: {peer['identical_tokens']}/{requests} requests.",
    ]


def workload_lengths(name: str, P: int, N: int, n: int, seed: int) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of `n` requests: `equal` (all P and N) or `mix` (prompts uniform in
    [P/4, P], outputs log-uniform in [min(16, N), N]), drawn from `seed`."""
    if name == "equal":
        return [P] * n, [N] * n
    rng = np.random.default_rng(seed)
    prompts = rng.integers(max(1, P // 4), P + 1, size=n)
    low = min(16, N)
    outputs = np.exp(rng.uniform(np.log(low), np.log(N), size=n)).round().clip(low, N)
    return [int(x) for x in prompts], [int(x) for x in outputs]


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
        f"(= {args.full_batch} preallocated full-cache sequences)",
        file=sys.stderr,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text_config = model.config.get_text_config()
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    rows = engine_rows(args, P, N, limit, head_dim)
    results: dict = {"args": vars(args), "dtype": dtype, "dtype_reason": dtype_reason, "cpu": cpu}
    results.update(torch_threads=torch.get_num_threads(), kv_memory_limit_bytes=limit, workloads={})
    lines = [
        conditions_line(model=args.model, dtype=f"{dtype} ({dtype_reason})").rstrip(".") + "; one replica in "
        f"process; prompts of {'real text' if tokenizer is not None else 'random ids'}; KV memory limit {limit} B "
        f"({limit / 2**20:.1f} MiB) = {args.full_batch} preallocated full-cache sequences of {P} + {N} tokens; "
        f"paged rows: blocks of {args.block_tokens} slots; every row of a workload gets the same {args.requests} "
        f"requests, all submitted at once, runs interleaved step by step; engines {', '.join(args.engines)}"
        + (", then transformers' `generate_batch` on them." if args.peer_generate_batch else "."),
    ]

    def write() -> None:
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        results["git_commit"] = git_commit()
        (out / "bench.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        (out / "bench.md").write_text(text)
        print(f"bench-serving: wrote {out / 'bench.json'} and {out / 'bench.md'}", file=sys.stderr)

    # -- part 1: every row on the same requests, per workload
    peers = []  # what the outside peer runs after the rows: (workload, prompts, outputs, ours, paged full, line)
    for w, name in enumerate(args.workloads):
        p_lens, n_lens = workload_lengths(name, P, N, args.requests, args.seed + 10 + w)
        prompts = [prompts_for(tokenizer, vocab, 1, p, args.seed + 100 * w + i)[0] for i, p in enumerate(p_lens)]
        runs = [
            (cfg, [GenerationRequest(f"{label}-{i}", pr, n) for i, (pr, n) in enumerate(zip(prompts, n_lens))])
            for label, cfg in rows
        ]
        print(f"bench-serving: workload {name}, {len(rows)} rows interleaved ...", file=sys.stderr)
        with CpuMeter(args.threads) as meter:  # the rows interleave: the run's share is every row's
            # a peer engine's failed requests are its row's (counted, named below the table), never the others' end
            measured = run_engines(model, runs, desc=f"part 1, {name}", raise_on_failed=False)
        ours_failed = [
            f"{label}: {r['errors']}"
            for (label, cfg), r in zip(rows, measured)
            if r["failed_requests"] and cfg.engine == "ours"
        ]
        if ours_failed:  # our engine failing a request is a bug, as before the engine axis
            raise RuntimeError(f"engine requests failed: {ours_failed[:3]}")
        ours = measured[0]["outputs"]  # the paged full cache's, compared with the peer's
        base = measured[0]["output_tok_per_s"]
        table = {}
        lines += [
            "",
            f"**Workload {name}**: {args.requests} requests, prompts {min(p_lens)}-{max(p_lens)} tokens, outputs "
            f"{min(n_lens)}-{max(n_lens)} tokens ({sum(n_lens)} in all).",
            "",
            f"| row | engine | x of {rows[0][0]}, output tok/s | output tok/s | decode tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 "
            "(ms) | ITL p50 / p99 (ms) | peak / mean running | preemptions | recomputed tokens | peak KV (MiB) | "
            "wall (s) | CPU (s) | CPU share |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for (label, _), r in zip(rows, measured):
            r.pop("outputs", None)
            r.update(cpu_share.row_fields(meter.fields, r["cpu_s"], r["wall_s"], args.threads))
            table[label] = r
            mean = f"{r['mean_running_sequences']:.1f}" if r["mean_running_sequences"] else "-"
            dec = f"{r['decode_tok_per_s']:.1f}" if r["decode_tok_per_s"] else "-"
            lines.append(
                f"| {label} | {r['engine']} | {_ratio(r['output_tok_per_s'], base)} | {r['output_tok_per_s']:.1f} | {dec} | "
                f"{_pair(r['ttft_p50_s'], r['ttft_p99_s'], 1, '.1f')} | {_pair(r['tpot_p50_s'], r['tpot_p99_s'], 1000, '.0f')} | "
                f"{_pair(r['itl_p50_s'], r['itl_p99_s'], 1000, '.0f')} | "
                f"{r['peak_running_sequences']} / {mean} | {_reported(r['preemptions'])} | "
                f"{_reported(r['recomputed_tokens'])} | "
                f"{r['peak_kv_cache_bytes'] / 2**20:.1f} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {cpu_share.mark(r)} |"
            )
        lines += contended_lines("bench-serving", table)
        for label, r in table.items():
            if r["failed_requests"]:
                lines.append(
                    f"\n{label} ({r['engine']}): {r['failed_requests']} of {args.requests} requests failed "
                    f"({'; '.join(r['errors'])}); its figures cover the tokens made before."
                )
        if w == 0:
            lines.insert(1, engines_line(table))
        if (
            args.mixed and "ours" in args.engines
        ):  # the mixed rows' own ratio: Scissorhands over the full cache, both under the mixed scheduler
            full_m, sh_m = table["full, paged, mixed"], table[f"scissorhands x{args.ratio:g}, paged, mixed"]
            lines += [
                "",
                f"Mixed scheduler ({args.max_num_batched_tokens} tokens a step): Scissorhands x{args.ratio:g} / full, "
                f"output tok/s **{sh_m['output_tok_per_s'] / full_m['output_tok_per_s']:.2f}x** (prefill-first: "
                f"{table[f'scissorhands x{args.ratio:g}, paged']['output_tok_per_s'] / base:.2f}x).",
            ]
        results["workloads"][name] = {"prompt_tokens": p_lens, "new_tokens": n_lens, "rows": table}
        results["workloads"][name]["peer_generate_batch"] = None
        peers.append((name, prompts, n_lens, ours, measured[0], len(lines)))
        write()  # each workload's table is kept even if a later part is stopped
    # -- part 2: our engine vs transformers' generate, full cache, the preallocated full cache's batch
    if not args.skip_generate:
        b = ContinuousBatchingEngine(
            model, EngineConfig(kv_memory_limit_bytes=limit, max_length_tokens=P + N)
        ).max_batch_for(P, N)
        gen, eng, same, ratio_engine, m, lengths, p_lengths = _part2(model, tokenizer, vocab, args, b, limit)
        for r in (gen, eng):
            r.pop("outputs", None)
        results.update(generate=gen, engine=eng, identical_tokens=same, ratio_engine_vs_generate=ratio_engine[0])
        results["ratio_engine_vs_generate_per_cpu_s"] = ratio_engine[1]
        lines += [
            "",
            f"**Engine vs transformers generate** (full cache, batch {b}, {m} requests, prompts "
            f"{min(p_lengths)}-{max(p_lengths)} tokens, outputs {min(lengths)}-{max(lengths)} tokens; generate runs "
            f"static batches; identical tokens {same}/{m}):",
            "",
            "| ratio | measured | goal |",
            "|---|---|---|",
            f"| our engine / transformers generate, output tok/s | {ratio_engine[0]:.2f}x | >= 1.3x |",
            f"| same, output tokens per CPU-second | {ratio_engine[1]:.2f}x | - |",
        ]
        write()
    # -- the outside peer, last (after every workload's rows and part 2, so its run cannot touch theirs), its row
    # under each workload's table
    added = 0
    for name, prompts, n_lens, ours, base_row, at in peers if args.peer_generate_batch else []:
        print(f"bench-serving: workload {name}, transformers generate_batch ...", file=sys.stderr)
        peer_reqs = [GenerationRequest(f"peer-{i}", pr, n) for i, (pr, n) in enumerate(zip(prompts, n_lens))]
        peer = run_generate_batch(
            model, peer_reqs, kv_memory_limit_bytes=limit, page_tokens=args.block_tokens, desc=f"generate_batch, {name}"
        )
        theirs = peer.pop("outputs")
        peer["identical_tokens"] = sum(
            theirs.get(f"peer-{i}") == ours.get(f"{rows[0][0]}-{i}") for i in range(len(peer_reqs))
        )
        new = _peer_lines(peer, base_row, args.requests)
        lines[at + added : at + added] = new
        added += len(new)
        results["workloads"][name]["peer_generate_batch"] = peer
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
