"""`make roofline`: this machine's ceilings and how close decode gets to them, ours and transformers'.

1. Ceilings, measured here: memory bandwidth (GB/s: ``torch.sum`` over a float32 tensor far larger
   than the caches, best of ``--repeats``) and matmul throughput per dtype (GFLOP/s: ``F.linear`` of a
   ``(rows, k) @ (k, n)^T`` problem at the model's MLP width, best of ``--repeats``).
2. Decode, per dtype and batch size: our continuous-batching engine with the full cache
   (`cluster.engine.ContinuousBatchingEngine`: its own `decode_s` over the tokens of its decode
   steps) and transformers' `generate` (sdpa + `DynamicCache`; decode time = `generate` of
   ``1 + new`` tokens minus `generate` of 1 token, same prompts), interleaved round by round so
   the drift of a shared machine falls on both; median of ``--rounds``.
3. The roofline of one decode step at batch ``b`` (mean context ``c = prompt + new / 2``):
   bytes = every weight once (tied embeddings once) + the KV cache read
   (``b * layers * 2 * kv_heads * head_dim * c`` values), FLOPs = ``2 * b * (non-embedding params
   + vocab * hidden)`` + attention ``4 * b * layers * heads * head_dim * c``; the step cannot be
   faster than ``max(bytes / bandwidth, FLOPs / peak of the dtype)`` (whichever binds is printed),
   so roofline tok/s = ``b / that``; each measured tok/s is reported as a share of it.

Printed as one Markdown table with the conditions (CPU model and flags, torch threads, dtype) and
written to ``--out`` (roofline.md, roofline.json) as soon as each dtype is done.

    python bench/roofline.py [--batches 1 4 16 32] [--dtypes float32 bfloat16] [--prompt-tokens 128]
                             [--new-tokens 16] [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from cluster.engine import ContinuousBatchingEngine, EngineConfig, GenerationRequest
from scissorhands.models import DTYPE_CHOICES, cpu_flags, cpu_model_name, load_model, resolve_dtype


def memory_bandwidth_gb_s(mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth (GB/s): bytes of a float32 tensor of ``mib`` MiB over the best time of summing it."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def matmul_gflop_s(dtype: torch.dtype, rows: int = 512, k: int = 576, n: int = 1536, repeats: int = 5) -> float:
    """Matmul throughput (GFLOP/s) of ``F.linear`` ``(rows, k) @ (n, k)^T`` in ``dtype``, best of ``repeats``
    timings of 8 calls."""
    x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    f = lambda: [torch.nn.functional.linear(x, w) for _ in range(8)]  # noqa: E731
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
    params = sum(p.numel() for p in model.parameters())          # tied embeddings counted once
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
    return {"bytes_per_step": weight_bytes + kv_bytes, "flops_per_step": flops, "memory_s": t_mem,
            "compute_s": t_compute, "bound": "memory" if t_mem >= t_compute else "compute",
            "roofline_tok_per_s": batch / max(t_mem, t_compute)}


def engine_decode_tok_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tok/s of our engine (full cache, all rows together): decode tokens / the engine's decode time."""
    eng = ContinuousBatchingEngine(model, EngineConfig(max_length_tokens=len(prompts[0]) + new_tokens,
                                                       max_batch=len(prompts)))
    for i, p in enumerate(prompts):
        eng.submit(GenerationRequest(f"r{i}", p, new_tokens + 1), lambda r: None)
    eng.run_until_idle()
    s = eng.stats()
    return len(prompts) * new_tokens / s["decode_s"]


def generate_decode_tok_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tok/s of transformers' ``generate`` (sdpa + ``DynamicCache``): ``generate(1 + new)`` minus
    ``generate(1)`` on the same prompts."""
    from transformers import DynamicCache

    from scissorhands import ATTN_IMPLEMENTATION

    model.set_attn_implementation("sdpa")
    ids = torch.tensor(prompts)
    times = []
    try:
        for n in (1, 1 + new_tokens):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(config=model.config),
                               max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            times.append(time.perf_counter() - t0)
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return len(prompts) * new_tokens / max(times[1] - times[0], 1e-9)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python bench/roofline.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   help=f"each one of {', '.join(DTYPE_CHOICES)}")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/roofline")
    args = p.parse_args(argv)
    for d in args.dtypes:
        if d not in DTYPE_CHOICES:
            p.error(f"--dtypes: expected each one of {', '.join(DTYPE_CHOICES)}, got {d!r}")
    for name in ("prompt_tokens", "new_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if any(b < 1 for b in args.batches):
        p.error(f"--batches: expected integers >= 1, got {args.batches}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    flags = ", ".join(sorted(cpu_flags() & {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"})) or "none"
    conditions = (f"CPU {cpu_model_name()} (flags: {flags}), {args.threads} torch thread(s), model {args.model}, "
                  f"prompt {args.prompt_tokens} tokens, {args.new_tokens} decode steps, median of {args.rounds} "
                  f"interleaved rounds, date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"roofline: {conditions}", file=sys.stderr)
    bandwidth = memory_bandwidth_gb_s()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, peaks = [], {}
    from workloads.prompts import make_prompts

    for name in args.dtypes:
        dtype, reason = resolve_dtype(name)
        if name == "auto":
            print(f"roofline: auto -> {dtype} ({reason})", file=sys.stderr)
        peaks[str(dtype)] = matmul_gflop_s(dtype)
        model, tok = load_model(args.model, dtype=dtype)
        model.generation_config.eos_token_id = None
        prompts_all = [list(x) for x in make_prompts(tok, max(args.batches), args.prompt_tokens, seed=0)]
        engine_decode_tok_s(model, prompts_all[:1], 2)                             # warm-up
        bar = tqdm(total=len(args.batches) * args.rounds, desc=f"decode {name}", unit="run", file=sys.stderr)
        for b in args.batches:
            prompts = prompts_all[:b]
            ours, theirs = [], []
            for _ in range(args.rounds):
                ours.append(engine_decode_tok_s(model, prompts, args.new_tokens))
                theirs.append(generate_decode_tok_s(model, prompts, args.new_tokens))
                bar.update(1)
            roof = step_roofline(model, b, args.prompt_tokens + args.new_tokens / 2, bandwidth,
                                 peaks[str(dtype)])
            o, t = statistics.median(ours), statistics.median(theirs)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "batch": b, "engine_tok_per_s": o,
                         "generate_tok_per_s": t, "engine_over_generate": o / t, **roof,
                         "engine_share": o / roof["roofline_tok_per_s"], "generate_share": t / roof["roofline_tok_per_s"]})
        bar.close()
        _write(out, conditions, bandwidth, peaks, rows)
    print(Path(out / "roofline.md").read_text())
    return 0


def _write(out: Path, conditions: str, bandwidth: float, peaks: dict, rows: list[dict]) -> None:
    lines = [f"Conditions: {conditions}.", "",
             f"Ceilings measured: memory bandwidth {bandwidth:.1f} GB/s (sum of a 512 MiB float32 tensor); matmul "
             + ", ".join(f"{k.removeprefix('torch.')} {v:.0f} GFLOP/s" for k, v in peaks.items())
             + " (F.linear 512x576 @ 576x1536).", "",
             "| dtype | batch | ours (tok/s) | transformers (tok/s) | ours / transformers | roofline (tok/s) | bound "
             "| ours, share of roofline | transformers, share |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['engine_tok_per_s']:.1f} | {r['generate_tok_per_s']:.1f} | "
                     f"{r['engine_over_generate']:.2f}x | {r['roofline_tok_per_s']:.0f} | {r['bound']} | "
                     f"{r['engine_share']:.0%} | {r['generate_share']:.0%} |")
    (out / "roofline.md").write_text("\n".join(lines) + "\n")
    (out / "roofline.json").write_text(json.dumps({"conditions": conditions, "bandwidth_gb_s": bandwidth,
                                                   "matmul_gflop_s": peaks, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
