"""`make roofline`: this machine's limits and how close our engine gets to them, in one run.

    make roofline                                        # 2 threads (the Makefile's ROOFLINE_ARGS), both dtypes
    python -m bench.roofline --batches 1,32 --dtypes bfloat16 --threads 2

Measures the ceilings (memory bandwidth, matmul GFLOP/s per dtype), Scissorhands' prefill against the full
cache's, and our full-cache decode step against transformers' ``generate`` per batch and dtype, each as a share of
the roofline of one decode step, with the same code, threads and machine state. Why side by side: so the shares
are comparable; the roofline's formula and each step of the method are in docs/performance.md, "How the bench
tools measure". Written to ``--out`` (roofline.md, roofline.json) as soon as each dtype is done.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from bench import bench_decode, bench_prefill
from bench.conditions import EMBEDDED_MODEL, add_threads, comma_list, conditions_line, parser, require_positive
from replica import cpu_share
from replica.cpu_share import CpuMeter
from scissorhands.models import DTYPE_CHOICES, PackedLinear, load_model, resolve_dtype


def memory_bandwidth_gb_s(mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth (GB/s): bytes of a float32 tensor of ``mib`` MiB over the best time of summing it."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def matmul_gflop_s(
    dtype: torch.dtype, rows: int = 512, k: int = 576, n: int = 1536, repeats: int = 5, packed: bool = False
) -> float:
    """Matmul throughput (GFLOP/s) of ``F.linear`` ``(rows, k) @ (n, k)^T`` in ``dtype``, best of ``repeats``
    timings of 8 calls; ``packed``: as a loaded model runs it (``scissorhands.models.PackedLinear``)."""
    x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    if packed:
        linear = torch.nn.Linear(k, n, bias=False, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
        layer = PackedLinear(linear)
        f = lambda: [layer(x) for _ in range(8)]  # noqa: E731
    else:
        f = lambda: [torch.nn.functional.linear(x, w) for _ in range(8)]  # noqa: E731
    with torch.inference_mode():
        f()
        best = min(_timed(f) for _ in range(repeats))
    return 8 * 2 * rows * k * n / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_roofline(model, batch: int, context: float, bandwidth_gb_s: float, peak_gflop_s: float) -> dict:
    """The fastest a decode step at ``batch`` rows and mean ``context`` tokens can be on this machine."""
    cfg = model.config
    elem = next(model.parameters()).element_size()
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    hidden, vocab, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv_bytes = batch * layers * 2 * kv_heads * head_dim * context * elem
    weight_bytes = params * elem
    # the input embedding is a lookup (no FLOPs); the LM head is a (vocab, hidden) matmul
    matmul_params = params if cfg.tie_word_embeddings else params - vocab * hidden
    flops = 2 * batch * matmul_params + 4 * batch * layers * heads * head_dim * context
    t_mem = (weight_bytes + kv_bytes) / (bandwidth_gb_s * 1e9)
    t_compute = flops / (peak_gflop_s * 1e9)
    return {
        "bytes_per_step": weight_bytes + kv_bytes,
        "flops_per_step": flops,
        "memory_s": t_mem,
        "compute_s": t_compute,
        "bound": "memory" if t_mem >= t_compute else "compute",
        "roofline_tok_per_s": batch / max(t_mem, t_compute),
    }


def parse_args(argv=None):
    p = parser(
        "roofline",
        __doc__,
        "about 10 minutes idle with --threads 2 on a CPU with bfloat16 support "
        "(hours in bfloat16 without it: pass --dtypes float32 there)",
    )
    p.add_argument("--batches", default="1,4,16,32", help="comma-separated decode batch sizes")
    p.add_argument(
        "--dtypes", default="float32,bfloat16", help=f"comma-separated, each one of {', '.join(DTYPE_CHOICES)}"
    )
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens per decode prompt")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    p.add_argument("--prefill-batch", type=int, default=8, help="prompts in one prefill forward")
    p.add_argument("--prefill-tokens", type=int, default=512, help="tokens per prefill prompt")
    p.add_argument("--ratio", type=float, default=5.0, help="Scissorhands' compression ratio in the prefill rows")
    add_threads(p)
    p.add_argument("--out", default="results/roofline", help="folder for roofline.md and roofline.json (overwritten)")
    args = p.parse_args(argv)
    args.dtypes = comma_list(p, "--dtypes", args.dtypes, valid=list(DTYPE_CHOICES))
    args.batches = comma_list(p, "--batches", args.batches, cast=int)
    require_positive(p, args, "prompt_tokens", "new_tokens", "rounds", "threads", "prefill_batch", "prefill_tokens")
    if any(b < 1 for b in args.batches):
        p.error(f"--batches: expected integers >= 1, got {args.batches}")
    if not (math.isfinite(args.ratio) and args.ratio >= 1):
        p.error(f"--ratio: expected a number >= 1, got {args.ratio}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    why = {d: resolve_dtype(d) for d in args.dtypes}
    dtypes = [str(t).removeprefix("torch.") + (f" (auto: {r})" if d == "auto" else "") for d, (t, r) in why.items()]
    conditions = conditions_line(
        model=EMBEDDED_MODEL,
        dtype=dtypes,
        extra=(
            f"decode: prompt {args.prompt_tokens} tokens, {args.new_tokens} steps, median of {args.rounds} "
            f"paired rounds; prefill: {args.prefill_batch} x {args.prefill_tokens} tokens, ratio {args.ratio:g}, "
            f"median of {args.rounds} paired rounds; load average before {os.getloadavg()[0]:.1f}"
        ),
    ).rstrip(".")
    print(f"roofline: {conditions}", file=sys.stderr)
    bandwidth = memory_bandwidth_gb_s()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefill = SimpleNamespace(
        batch=args.prefill_batch, prompt_tokens=args.prefill_tokens, new_tokens=64, ratio=args.ratio, rounds=args.rounds
    )
    bar = tqdm(
        total=len(args.dtypes) * args.rounds * (1 + len(args.batches)), desc="roofline", unit="round", file=sys.stderr
    )
    peaks, prefill_rows, rows = {}, [], []
    for name in args.dtypes:
        dtype, reason = resolve_dtype(name)
        label = str(dtype).removeprefix("torch.")
        if name == "auto":
            print(f"roofline: auto -> {label} ({reason})", file=sys.stderr)
        # the peak: the faster of F.linear and the packed layer at 512 rows (packed float32 measured 2.3-2.6x F.linear's)
        peaks[label] = max(matmul_gflop_s(dtype), matmul_gflop_s(dtype, packed=True))
        prefill_rows += bench_prefill.run(label, prefill, ["scissorhands"])
        bar.update(args.rounds)
        model, tok = load_model("embedded", dtype=dtype)
        model.generation_config.eos_token_id = None
        all_rows = bench_decode.prompts(tok, max(args.batches), args.prompt_tokens)
        bench_decode.warm_up(model, all_rows)
        for b in args.batches:
            with CpuMeter(args.threads) as meter:  # the CPU this row's rounds got (replica.cpu_share)
                step = bench_decode.paired_steps(model, all_rows, b, args.new_tokens, args.rounds)
            bar.update(args.rounds)
            context = args.prompt_tokens + args.new_tokens / 2
            roof = step_roofline(model, b, context, bandwidth, peaks[label])
            at_rows = matmul_gflop_s(dtype, rows=b, packed=True)  # what the model's matmuls reach at b rows
            roof_b = step_roofline(model, b, context, bandwidth, at_rows)["roofline_tok_per_s"]
            ours, theirs = b / (step["ours_wall_ms"] / 1e3), b / (step["theirs_wall_ms"] / 1e3)
            rows.append(
                {
                    "dtype": label,
                    **step,
                    "engine_tok_per_s": ours,
                    "generate_tok_per_s": theirs,
                    **roof,
                    "engine_share": ours / roof["roofline_tok_per_s"],
                    "generate_share": theirs / roof["roofline_tok_per_s"],
                    "matmul_gflop_s_at_batch": at_rows,
                    "roofline_at_batch_tok_per_s": roof_b,
                    "engine_share_at_batch": ours / roof_b,
                    **meter.fields,
                }
            )
        _write(out, f"{conditions}; load average after {os.getloadavg()[0]:.1f}", bandwidth, peaks, prefill_rows, rows)
    bar.close()
    print((out / "roofline.md").read_text())
    return 0


def _write(
    out: Path, conditions: str, bandwidth: float, peaks: dict, prefill_rows: list[dict], rows: list[dict]
) -> None:
    full = {r["dtype"]: r for r in prefill_rows if r["policy"] == "full"}
    lines = [
        f"{conditions}.",
        "",
        f"Ceilings measured: memory bandwidth {bandwidth:.1f} GB/s (sum of a 512 MiB float32 tensor); matmul "
        + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peaks.items())
        + " (512x576 @ 576x1536, the faster of F.linear and the packed layer).",
        "",
        "Prefill (one forward, fresh cache): Scissorhands / full time, median of paired rounds (min-max).",
        "",
        "| dtype | full: prompt tok/s (wall) | Scissorhands / full, wall | Scissorhands / full, CPU | CPU share |",
        "|---|---|---|---|---|",
    ]
    for r in prefill_rows:
        if r["policy"] != "full":
            lines.append(
                f"| {r['dtype']} | {full[r['dtype']]['tok_s']:,.0f} | {r['wall_ratio']:.2f}x "
                f"({r['wall_ratio_min']:.2f}-{r['wall_ratio_max']:.2f}) | {r['cpu_ratio']:.2f}x "
                f"({r['cpu_ratio_min']:.2f}-{r['cpu_ratio_max']:.2f}) | {cpu_share.mark(r)} |"
            )
    lines += [
        "",
        "Decode (full cache): tok/s = rows / median wall time of a step; ours / transformers per paired "
        "round, median (min-max); both run the same model with packed weights (the ratio compares engines "
        "and caches); share = tok/s over the roofline. The last three columns: the same "
        "matmul as the model runs it (packed) at the batch's row count, and the roofline with that as the "
        "compute peak: how much of the gap to the 512-row peak is the matmul at few rows itself (one 576x1536 "
        "matrix, which fits in the CPU's caches, stands in for every weight shape; 'bound' is the 512-row "
        "roofline's).",
        "",
        "| dtype | batch | ours (tok/s) | transformers (tok/s) | ours / transformers, wall | ours / transformers, "
        "CPU | roofline (tok/s) | bound | ours, share of roofline | transformers, share | matmul at batch rows "
        "(GFLOP/s) | roofline at batch rows (tok/s) | ours, share of it | CPU share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {r['engine_tok_per_s']:.1f} | {r['generate_tok_per_s']:.1f} | "
            f"{r['wall_ratio']:.2f}x ({r['wall_min']:.2f}-{r['wall_max']:.2f}) | {r['cpu_ratio']:.2f}x "
            f"({r['cpu_min']:.2f}-{r['cpu_max']:.2f}) | {r['roofline_tok_per_s']:.0f} | {r['bound']} | "
            f"{r['engine_share']:.0%} | {r['generate_share']:.0%} | {r['matmul_gflop_s_at_batch']:.0f} | "
            f"{r['roofline_at_batch_tok_per_s']:.0f} | {r['engine_share_at_batch']:.0%} | {cpu_share.mark(r)} |"
        )
    measured = {f"prefill {r['dtype']}, {r['policy']}": r for r in prefill_rows}
    measured.update({f"decode {r['dtype']}, batch {r['batch']}": r for r in rows})
    notes = cpu_share.contended_lines([{"point_id": k, **v} for k, v in measured.items()])
    lines += ["", *notes] if notes else []
    (out / "roofline.md").write_text("\n".join(lines) + "\n")
    (out / "roofline.json").write_text(
        json.dumps(
            {
                "conditions": conditions,
                "bandwidth_gb_s": bandwidth,
                "matmul_gflop_s": peaks,
                "prefill": prefill_rows,
                "decode": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    sys.exit(main())
