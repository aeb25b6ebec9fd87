"""4-bit KV layouts: measured bytes against a 16-bit full cache, and measured perplexity cost.

Each layout is a comma-separated list of ``key=value`` (defaults in brackets): ``kg`` key group size
[32], ``vg`` value group size [kg], ``sb`` scale bits 16 or 8 [16], ``zp`` zero point 1 or 0 [1],
``c`` Scissorhands' ``count_chunk_steps`` [50], ``rot`` Hadamard rotation 1 or 0 [0]. For each, the Scissorhands cache at ``--ratio`` with
``kv_bits=4`` scores ``--windows`` held-out windows of ``--tokens`` tokens (``workloads.quality
.perplexity``, the same calls as decoding token by token), next to the full cache and Scissorhands
without quantization at each ``c`` used (same windows). Bytes: ``compression_report()`` of a cache
that has seen one whole window: every buffer it holds (keys, values, scales, zeros, slot times, the
policy's counters) over a 16-bit cache of every token seen. The table is printed and written to
``--out`` after every row.

    python -m bench.bench_quant [--layouts kg=32 kg=64,sb=8,zp=0,c=200 ...] [--tokens 512] [--windows 3]

``--layouts`` is the one list flag of the bench tools that is space-separated: each layout is itself
comma-separated.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.conditions import EMBEDDED_MODEL, add_threads, conditions_line, parser
from scissorhands import make_cache
from scissorhands.models import load_model
from workloads.quality import perplexity as ppl

DEFAULT_LAYOUTS = [
    "kg=32",
    "kg=32,vg=64",
    "kg=64,sb=8",
    "kg=64,sb=8,c=200",
    "kg=32,vg=64,sb=8,c=200",
    "kg=32,vg=64,sb=8,zp=0,c=200",
    "kg=64,sb=8,zp=0,c=200",
    "kg=64,sb=8,zp=0,c=200,rot=1",
]
FIELDS = {
    "kg": "kv_group_size",
    "vg": "kv_value_group_size",
    "sb": "kv_scale_bits",
    "zp": "kv_zero_point",
    "c": "count_chunk_steps",
    "rot": "kv_rotate",
}


def parse_layout(text: str) -> dict:
    """``"kg=64,sb=8,zp=0,c=200"`` -> make_cache keyword arguments. Raises ValueError naming the bad part."""
    out = {
        "kv_group_size": 32,
        "kv_value_group_size": None,
        "kv_scale_bits": 16,
        "kv_zero_point": True,
        "count_chunk_steps": 50,
        "kv_rotate": False,
    }
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in FIELDS or not value.lstrip("-").isdigit():
            raise ValueError(
                f"--layouts: bad part {part!r} of {text!r}; expected key=integer with key in {sorted(FIELDS)}"
            )
        out[FIELDS[key]] = bool(int(value)) if key in ("zp", "rot") else int(value)
    if out["kv_value_group_size"] is None:
        out["kv_value_group_size"] = out["kv_group_size"]
    return out


def main(argv=None) -> int:
    ap = parser(
        "bench_quant",
        __doc__,
        "about 10 minutes idle (11 perplexity runs of 3 x 512 tokens; 20-35 minutes measured under load)",
    )
    ap.add_argument(
        "--layouts",
        nargs="+",
        default=DEFAULT_LAYOUTS,
        help="space-separated layouts, each comma-separated key=value (see the module docstring)",
    )
    ap.add_argument("--tokens", type=int, default=512, help="tokens per held-out window")
    ap.add_argument("--windows", type=int, default=3, help="held-out windows scored (seed 0)")
    ap.add_argument("--ratio", type=float, default=5.0, help="Scissorhands' compression ratio")
    add_threads(ap)
    ap.add_argument("--out", default="results/bench-quant.md", help="the table, rewritten after every row")
    args = ap.parse_args(argv)
    try:
        layouts = [parse_layout(s) for s in args.layouts]
    except ValueError as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)

    model, tok = load_model("embedded", dtype=torch.float32)
    windows = ppl.heldout_windows(tok, args.tokens, args.windows, seed=0)
    conditions = conditions_line(
        model=EMBEDDED_MODEL,
        dtype="float32 (perplexity's reference: no 16-bit rounding on the unquantized side)",
    )
    head = (
        f"{conditions[:-1]}; "
        f"{args.windows} held-out windows of {args.tokens} tokens (seed 0); Scissorhands x{args.ratio:g}; "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}. Bytes per slot: one token of one KV head in one layer, "
        f"every buffer (keys, values, scales, zeros, slot time, counters).\n\n"
        "| cache | key group | value group | scale bits | zero point | count_chunk_steps | bytes per slot "
        "| bytes vs 16-bit full cache | perplexity | vs unquantized (same c) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    chunks = sorted({lay["count_chunk_steps"] for lay in layouts})
    bar = tqdm(total=1 + len(chunks) + len(layouts), desc="perplexity runs", unit="run", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def emit(row: str) -> None:
        rows.append(row)
        out.write_text(head + "\n".join(rows) + "\n")
        bar.update(1)

    def measure_bytes(**kw) -> tuple[float, float]:
        cache = make_cache("scissorhands", model, compression_ratio=args.ratio, max_length=args.tokens, **kw)
        with torch.inference_mode():
            model(torch.tensor([windows[0][: args.tokens]]), cache=cache)
        per_slot = sum(layer.slot_nbytes() for layer in cache.layers) / (
            model.config.num_hidden_layers * model.config.num_key_value_heads
        )
        return per_slot, cache.compression_report()["ratio_vs_16bit"]

    full = ppl.perplexity(model, windows, "full")["perplexity"]
    emit(f"| full | - | - | - | - | - | 256 (16-bit) | 1.0x | {full:.3f} | - |")
    dense = {}
    for c in chunks:
        dense[c] = ppl.perplexity(model, windows, "scissorhands", args.ratio, policy_params={"count_chunk_steps": c})[
            "perplexity"
        ]
        per_slot, x = measure_bytes(count_chunk_steps=c)
        emit(
            f"| scissorhands x{args.ratio:g} | - | - | - | - | {c} | {per_slot:g} (float32) | "
            f"{x:.2f}x | {dense[c]:.3f} | - |"
        )
    for lay in layouts:
        p = ppl.perplexity(model, windows, "scissorhands", args.ratio, kv_bits=4, policy_params=lay)["perplexity"]
        per_slot, x = measure_bytes(kv_bits=4, **lay)
        c = lay["count_chunk_steps"]
        emit(
            f"| scissorhands x{args.ratio:g} 4-bit | {lay['kv_group_size']} | {lay['kv_value_group_size']} | "
            f"{lay['kv_scale_bits']} | {'yes' if lay['kv_zero_point'] else 'no'}{' + Hadamard' if lay['kv_rotate'] else ''} | {c} | {per_slot:g} | {x:.2f}x | "
            f"{p:.3f} | {p / dense[c] - 1:+.1%} |"
        )
    bar.close()
    print(head + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
