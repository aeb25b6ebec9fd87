"""Per-token cost of the API's streaming detokenizer at short and long outputs (constant, not growing).

``replica.openai_api.IncrementalDetokenizer`` turns each generated id into the text it adds, as the
service streams it. The cost of one ``add`` is timed when the output already holds ``L`` tokens (the mean of
the ``--window`` adds that end at ``L``, median of ``--repeats``), for each ``L`` of ``--lengths``, on held-out
State of the Union text tokenized by the embedded model's tokenizer (byte-level BPE), with one stop string
that never matches (so the hold-back of a possible stop is timed too). Beside it: decoding the whole output
again at ``L`` (what the detokenizer did before), and the ratio of the longest to the shortest length.

    python -m bench.bench_detokenizer [--lengths 100,4000] [--window 50] [--repeats 5]
"""

from __future__ import annotations

import statistics
import time

from bench.conditions import add_threads, comma_list, conditions_line, contended_lines, parser
from replica import cpu_share
from replica.cpu_share import CpuMeter
from replica.openai_api import IncrementalDetokenizer
from scissorhands.models import load_tokenizer
from workloads.load.prompts import heldout_text_ids

STOP = ["\x00never\x00"]


def add_cost_s(tokenizer, ids: list[int], length: int, window: int) -> float:
    """Mean seconds of one `add` over the `window` adds that bring the output to `length` tokens."""
    d = IncrementalDetokenizer(tokenizer, STOP)
    for i in ids[: length - window]:
        d.add([i])
    t0 = time.perf_counter()
    for i in ids[length - window : length]:
        d.add([i])
    return (time.perf_counter() - t0) / window


def whole_decode_cost_s(tokenizer, ids: list[int], length: int, window: int) -> float:
    """Mean seconds of decoding the whole output again at each of the `window` lengths ending at `length`."""
    t0 = time.perf_counter()
    for n in range(length - window + 1, length + 1):
        tokenizer.decode(ids[:n], skip_special_tokens=True)
    return (time.perf_counter() - t0) / window


def main(argv: list[str] | None = None) -> int:
    ap = parser("bench_detokenizer", __doc__, "about 20 s")
    ap.add_argument("--lengths", default="100,4000", help="output lengths (tokens) at which one add is timed")
    ap.add_argument("--window", type=int, default=50, help="adds timed per length (their mean)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per length (their median)")
    add_threads(ap)
    args = ap.parse_args(argv)
    lengths = comma_list(ap, "--lengths", args.lengths, int)
    if args.window < 1 or any(n < args.window for n in lengths):
        ap.error(f"--window: expected 1 <= window <= every length, got {args.window} with --lengths {args.lengths}")
    import torch

    torch.set_num_threads(args.threads)  # the tokenizer is Rust; set for the conditions line's honesty
    tok = load_tokenizer("embedded")
    ids = heldout_text_ids(tok, max(lengths), seed=0)
    print(conditions_line(model="embedded tokenizer (SmolLM2-135M-Instruct, byte-level BPE)", dtype="n/a (text)"))
    print(f"Held-out text, seed 0; one stop string; mean of {args.window} adds, median of {args.repeats} repeats.")
    print("| output tokens | add (us/token) | whole decode again (us/token) | CPU share |")
    print("|---:|---:|---:|---:|")
    rows, cpu = {}, {}
    for n in lengths:
        with CpuMeter(threads=1) as meter:  # the tokenizer runs on one thread
            inc = statistics.median(add_cost_s(tok, ids, n, args.window) for _ in range(args.repeats))
            whole = statistics.median(whole_decode_cost_s(tok, ids, n, args.window) for _ in range(args.repeats))
        rows[n], cpu[f"{n:,} tokens"] = (inc, whole), meter.fields
        print(f"| {n:,} | {inc * 1e6:.1f} | {whole * 1e6:.1f} | {cpu_share.mark(meter.fields)} |", flush=True)
    for line in contended_lines("bench-detokenizer", cpu):
        print(line)
    lo, hi = min(lengths), max(lengths)
    print(
        f"Ratio {hi:,} / {lo:,} tokens: add {rows[hi][0] / rows[lo][0]:.2f}x (constant is 1x); "
        f"whole decode {rows[hi][1] / rows[lo][1]:.1f}x."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
