"""4-bit KV layouts: measured bytes against a 16-bit full cache, and measured perplexity cost.

For each layout (key group size, value group size) the Scissorhands cache at ``--ratio`` with
``kv_bits=4`` scores ``--windows`` held-out windows of ``--tokens`` tokens (``workloads.quality
.perplexity``, the same calls as decoding token by token), next to the full cache and Scissorhands
without quantization (same windows). Bytes: ``compression_report()['ratio_vs_16bit']`` of a cache
that has seen one whole window (bookkeeping included: slot times and the policy's counters).
The table is printed and written to ``--out`` after every layout.

    python bench/bench_quant.py [--layouts 32:32 32:64 64:64 16:64] [--tokens 512] [--windows 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from scissorhands import make_cache
from scissorhands.models import cpu_model_name, load_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["32:32", "32:64", "64:64", "16:64"],
                    help="key_group:value_group pairs")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--ratio", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/bench-quant.md")
    args = ap.parse_args(argv)
    try:
        layouts = [tuple(int(x) for x in s.split(":")) for s in args.layouts]
    except ValueError:
        ap.error(f"--layouts: expected key_group:value_group pairs such as 32:64, got {args.layouts}")
    torch.set_num_threads(args.threads)
    from workloads.quality import perplexity as ppl

    model, tok = load_model("embedded", dtype=torch.float32)
    windows = ppl.heldout_windows(tok, args.tokens, args.windows, seed=0)
    head = (f"Conditions: SmolLM2-135M-Instruct float32, CPU {cpu_model_name()}, {args.threads} thread(s); "
            f"{args.windows} held-out windows of {args.tokens} tokens (seed 0); Scissorhands x{args.ratio:g}; "
            f"{time.strftime('%Y-%m-%d', time.gmtime())}.\n\n"
            "| cache | key group | value group | bytes vs 16-bit full cache | perplexity | vs unquantized |\n"
            "|---|---|---|---|---|---|\n")
    rows = []
    bar = tqdm(total=2 + len(layouts), desc="layouts", unit="run", file=sys.stderr)
    full = ppl.perplexity(model, windows, "full")["perplexity"]
    bar.update(1)
    dense = ppl.perplexity(model, windows, "scissorhands", args.ratio)["perplexity"]
    bar.update(1)
    rows.append(f"| full | - | - | 1.0x | {full:.3f} | - |")
    rows.append(f"| scissorhands x{args.ratio:g} | - | - | {args.ratio:g}x nominal | {dense:.3f} | - |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for kg, vg in layouts:
        import scissorhands

        real = scissorhands.make_cache

        def patched(*a, kg=kg, vg=vg, **kw):
            if kw.get("kv_bits") == 4:
                kw.update(kv_group_size=kg, kv_value_group_size=vg)
            return real(*a, **kw)

        scissorhands.make_cache = patched              # workloads.quality.perplexity builds its caches through it
        try:
            p = ppl.perplexity(model, windows, "scissorhands", args.ratio, kv_bits=4)["perplexity"]
        finally:
            scissorhands.make_cache = real
        cache = make_cache("scissorhands", model, compression_ratio=args.ratio, max_length=args.tokens, kv_bits=4,
                           kv_group_size=kg, kv_value_group_size=vg)
        with torch.inference_mode():
            model(torch.tensor([windows[0][:args.tokens]]), cache=cache)
        x = cache.compression_report()["ratio_vs_16bit"]
        rows.append(f"| scissorhands x{args.ratio:g} 4-bit | {kg} | {vg} | {x:.2f}x | {p:.3f} | {p / dense - 1:+.1%} |")
        out.write_text(head + "\n".join(rows) + "\n")
        bar.update(1)
    bar.close()
    print(head + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
