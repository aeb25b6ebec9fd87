"""`make bench-peers`: OpenVINO GenAI, the production engine for this job on a CPU, beside ours on the same requests.

    python -m bench.bench_peers [--requests 32] [--prompt-tokens 64,256] [--new-tokens 16,256] [--kv-limit-slots 1024]
                                [--threads 2] [--dtype bfloat16] [--rows ...] [--limits none,limit]

One request set (the project's load-test text, `workloads.load.prompts`; prompts uniform in ``--prompt-tokens``,
outputs log-uniform in ``--new-tokens``, drawn from ``--seed``; greedy, EOS ignored, all submitted at once), the same
token ids on both sides, run under two KV limits: ``none`` (room for every request's prompt + output at once) and
``limit`` (``--kv-limit-slots`` full-cache token slots in the model's dtype, as bytes). Rows (``--rows``):

* ours (in process, one row at a time; `replica.engine.ContinuousBatchingEngine`, paged KV, mixed scheduler with
  ``--step-tokens`` a step): ``ours-full`` the full cache; ``ours-sh`` Scissorhands x``--ratio`` with per-request
  budgets (``B_i = budget_from_ratio(prompt_i + output_i, ratio, policy)``: ``ceil(L / ratio)`` at least the
  policy's floor, 32 tokens, and at most ``L``); ``ours-sh4`` the same stored in 4 bits;
* the peer (``bench/peer_openvino.py`` in its own virtualenv, one row after another, `ContinuousBatchingPipeline`
  with split-fuse and ``--step-tokens`` as ``max_num_batched_tokens``, prefix caching off): ``ov-u8`` its full cache
  with its default u8 KV, ``ov-bf16`` with bf16 KV (the denominator of every ratio), ``ov-evict`` its own cache
  eviction (``CacheEvictionConfig``, bf16 KV, split-fuse off: with it on, a probe of 2026.4.1 saw whole runs fail with
  "Total number of aggregated SnapKV scores ..."; ``--eviction-split-fuse`` turns it on) at the ``max_cache_size``
  nearest our per-request budgets (:func:`eviction_cache_tokens`).

Both sides get the same threads (``INFERENCE_NUM_THREADS``) and dtype (``INFERENCE_PRECISION_HINT``); the peer's KV
limit is ``num_kv_blocks = bytes // its block's bytes``, measured at its KV precision (32-token blocks on this CPU
plugin; a u8 block holds its scales too, so about 1.7x the tokens of bf16 for the same bytes, not 2x). The table:
output tok/s, the ratio to OpenVINO full (bf16 KV) at the same limit, and for the full rows their greedy tokens
against our paged full's (whole requests identical; the mean share of positions before the first difference).

Exit 0; 1 when a row failed (its message under the table; the other rows still measured); 2 on bad flags, or when the
peer's virtualenv or export is missing or broken: then our rows still print, and the message names the step and the
make target that redoes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
import transformers

from bench.conditions import REPO_ROOT, add_threads, comma_list, conditions_line, git_commit, parser
from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine, full_rows_kv_bytes
from scissorhands import Policy, budget_from_ratio, cache_policy
from scissorhands.models import BF16_CPU_FLAGS, EMBEDDED, cpu_flags, load_model
from scissorhands.testing import tiny_llama
from workloads.load.prompts import prompts_for

PEER_SCRIPT = Path(__file__).with_name("peer_openvino.py")
DEFAULT_PEER_PYTHON = REPO_ROOT / ".cache" / "venv-openvino" / "bin" / "python"
DEFAULT_PEER_MODEL = REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct-openvino-fp32"
REDO = "make openvino-peer"
OURS = ("ours-full", "ours-sh", "ours-sh4")
#: The policy of the ``ours-sh`` rows (its default parameters; ``ours-sh4`` adds only storage bits): their budgets
#: and the peer's ``max_cache_size`` nearest them come from it.
OURS_SH_POLICY = "scissorhands"
PEERS = ("ov-u8", "ov-bf16", "ov-evict")
ROW_KEYS = OURS + PEERS
LIMITS = ("none", "limit")
MAX_STEPS = 1_000_000  # a row still stepping after these is stuck (`run_until_idle`'s bound)
DENOMINATOR = "ov-bf16"
REFERENCE = "ours-full"
FULL_ROWS = ("ours-full", "ov-u8", "ov-bf16")
OV_PRECISION = {"float32": "f32", "bfloat16": "bf16"}


class PeerUnavailable(Exception):
    """The peer cannot run: the message names the step that failed and how to redo it."""


def default_dtype() -> str:
    """``bfloat16`` where the CPU has AMX or AVX512-BF16 (both engines compute in it there), else ``float32``."""
    return "bfloat16" if cpu_flags() & set(BF16_CPU_FLAGS) else "float32"


def lengths(n: int, prompt_range: tuple[int, int], new_range: tuple[int, int], seed: int) -> list[tuple[int, int]]:
    """``n`` (prompt tokens, output tokens): prompts uniform in ``prompt_range``, outputs log-uniform in ``new_range``
    (both inclusive, rounded), drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt_range[0], prompt_range[1] + 1, size=n)
    lo, hi = new_range
    outputs = np.exp(rng.uniform(np.log(lo), np.log(hi), size=n)).round().clip(lo, hi)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def request_set(tokenizer, vocab: int, shape: list[tuple[int, int]], seed: int) -> list[dict]:
    """``[{"id", "prompt_ids", "max_new_tokens"}]``, the one list both sides run: request ``i``'s prompt is load-test
    text of its length from seed ``seed + 1 + i`` (random ids below ``vocab`` without a tokenizer)."""
    return [
        {"id": str(i), "prompt_ids": prompts_for(tokenizer, vocab, 1, p, seed + 1 + i)[0], "max_new_tokens": n}
        for i, (p, n) in enumerate(shape)
    ]


def our_requests(requests: list[dict]) -> list[GenerationRequest]:
    """The request set as our engine takes it (greedy; ``request_id`` = the set's id)."""
    return [GenerationRequest(r["id"], list(r["prompt_ids"]), r["max_new_tokens"]) for r in requests]


def budgets(requests: list[dict], ratio: float, policy: Policy) -> list[int]:
    """Our per-request budgets (tokens per KV head) as our engine runs them (`EngineConfig.budget` per_request):
    ``budget_from_ratio(prompt + output, ratio, policy)``, ``ceil(L / ratio)`` raised to the policy's floor and needs
    (`scissorhands.budget_from_ratio`); `policy` is the ``ours-sh`` row's (`OURS_SH_POLICY`, `scissorhands.cache_policy`).
    """
    return [budget_from_ratio(len(r["prompt_ids"]) + r["max_new_tokens"], ratio, policy) for r in requests]


def eviction_cache_tokens(totals: list[int], our_budgets: list[int], block_tokens: int, smallest: int) -> int:
    """The peer's ``max_cache_size`` nearest our per-request budgets: the multiple of ``block_tokens`` (at least
    ``smallest``) whose tokens held at the end over the request set, ``sum(min(total_i, cap))``, is nearest ours,
    ``sum(B_i)`` (the smaller cap on a tie). One cap serves every sequence there; ours is per request.

    Args:
        totals: each request's prompt + output tokens. our_budgets: each request's B_i.
    """
    want = sum(our_budgets)
    top = max(smallest, -(-max(totals) // block_tokens) * block_tokens)
    caps = range(smallest, top + 1, block_tokens)
    return min(caps, key=lambda c: (abs(sum(min(t, c) for t in totals) - want), c))


def compare_tokens(reference: dict[str, list[int]], other: dict[str, list[int]]) -> dict:
    """Greedy tokens of ``other`` against ``reference`` (request id -> output ids), over the requests both have.

    Returns:
        ``{"compared", "identical", "first_token_agreed", "mean_prefix_share"}``: requests compared, those identical
        to the end, those whose first output token agrees, and the mean over them of (positions before the first
        difference) / (reference length); 1.0 for an identical request, 0.0 for one that differs at its first token.
        ``mean_prefix_share`` is None with nothing compared.
    """
    ids = [k for k in reference if k in other and reference[k]]
    shares = []
    for k in ids:
        a, b = reference[k], other[k]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(1.0 if a == b else first / len(a))
    return {
        "compared": len(ids),
        "identical": sum(reference[k] == other[k] for k in ids),
        "first_token_agreed": sum(other[k][:1] == reference[k][:1] for k in ids),
        "mean_prefix_share": sum(shares) / len(shares) if shares else None,
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Each measured row with ``ratio`` (its output tok/s over OpenVINO full bf16 KV's at the same limit; None when
    either failed or is absent) and, for the full rows, ``tokens`` (:func:`compare_tokens` against our paged full at
    the same limit; ``"reference"`` for that row itself)."""
    by = {(r["key"], r["limit"]): r for r in rows}
    out = []
    for r in rows:
        den = by.get((DENOMINATOR, r["limit"]))
        ratio = None
        if r["ok"] and den is not None and den["ok"] and den["output_tok_per_s"]:
            ratio = r["output_tok_per_s"] / den["output_tok_per_s"]
        tokens = None
        ref = by.get((REFERENCE, r["limit"]))
        if r["key"] == REFERENCE:
            tokens = "reference"
        elif r["key"] in FULL_ROWS and ref is not None and ref.get("outputs") and r.get("outputs"):
            tokens = compare_tokens(ref["outputs"], r["outputs"])
        out.append({**r, "ratio": ratio, "tokens": tokens})
    return out


def _limit_text(r: dict) -> str:
    name = "none" if r["limit"] == "none" else "limit"
    return f"{name}: {r['kv_limit_bytes']:,} B"


def format_table(rows: list[dict]) -> str:
    """The markdown table of :func:`summarize`'s rows (failed rows say so; their messages go under the table)."""
    lines = [
        "| row | KV limit | token slots held | output tok/s | x OpenVINO full (bf16 KV), same limit | "
        "identical requests vs ours paged full | mean share before the first difference |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        slots = f"{r['kv_token_slots']:,}" if r.get("kv_token_slots") else "-"
        speed = f"{r['output_tok_per_s']:.1f}" if r["ok"] else ("not run" if r.get("not_run") else "FAILED")
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        t = r["tokens"]
        if t == "reference":
            same, share = "(reference)", "(reference)"
        elif t and t["compared"]:
            same, share = f"{t['identical']}/{t['compared']}", f"{t['mean_prefix_share']:.1%}"
        else:
            same = share = "-"
        lines.append(f"| {r['label']} | {_limit_text(r)} | {slots} | {speed} | {ratio} | {same} | {share} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(
        "bench_peers",
        __doc__,
        "an estimated 10 minutes with --threads 2 on an idle machine (from the rates measured before; the peer's venv "
        "and export made: making them adds about 3 minutes)",
    )
    p.add_argument("--model", default=EMBEDDED, help="ours: embedded, a local folder (tiny-llama: test only)")
    p.add_argument("--requests", type=int, default=32, help="requests (the same ids for every row)")
    p.add_argument("--prompt-tokens", default="64,256", help="lo,hi: prompt lengths uniform in [lo, hi]")
    p.add_argument("--new-tokens", default="16,256", help="lo,hi: output lengths log-uniform in [lo, hi]")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths and the prompts")
    p.add_argument("--kv-limit-slots", type=int, default=1024, help="the limit: full-cache token slots (model dtype)")
    p.add_argument("--ratio", type=float, default=5.0, help="Scissorhands compression ratio (>= 1)")
    p.add_argument("--block-tokens", type=int, default=16, help="ours: slots per KV block")
    p.add_argument("--step-tokens", type=int, default=512, help="both: tokens a step (max_num_batched_tokens)")
    p.add_argument("--peer-block-tokens", type=int, default=32, help="the peer's KV block (its CPU plugin's)")
    p.add_argument("--dtype", choices=list(OV_PRECISION), default=default_dtype(), help="both sides (CPU-dependent)")
    add_threads(p)
    p.add_argument("--rows", default=",".join(ROW_KEYS), help="rows to run (comma list)")
    p.add_argument("--limits", default=",".join(LIMITS), help="none: all requests fit at once; limit: the slots")
    p.add_argument("--eviction-start-tokens", type=int, default=32, help="ov-evict: start_size (tokens)")
    p.add_argument("--eviction-recent-tokens", type=int, default=32, help="ov-evict: recent_size (tokens)")
    p.add_argument("--eviction-cache-tokens", type=int, default=0, help="ov-evict: max_cache_size; 0: nearest ours")
    p.add_argument(
        "--eviction-split-fuse", action="store_true", help="ov-evict: split-fuse on (off by default, see above)"
    )
    p.add_argument("--eviction-aggregation", choices=["SUM", "NORM_SUM"], default="NORM_SUM", help="ov-evict")
    p.add_argument("--peer-python", default=str(DEFAULT_PEER_PYTHON), help="python of the peer's virtualenv")
    p.add_argument("--peer-model", default=str(DEFAULT_PEER_MODEL), help="the exported OpenVINO model folder")
    p.add_argument("--peer-timeout-s", type=float, default=3600.0, help="the peer's rows together, at most")
    p.add_argument("--out", default="results/bench-peers", help="folder for requests.json, bench.json and bench.md")
    args = p.parse_args(argv)
    for flag in ("prompt_tokens", "new_tokens"):
        pair = comma_list(p, f"--{flag.replace('_', '-')}", getattr(args, flag), int)
        if len(pair) != 2 or not 1 <= pair[0] <= pair[1]:
            p.error(f"--{flag.replace('_', '-')}: expected lo,hi with 1 <= lo <= hi, got {getattr(args, flag)!r}")
        setattr(args, flag, tuple(pair))
    args.rows = comma_list(p, "--rows", args.rows, valid=ROW_KEYS)
    args.limits = comma_list(p, "--limits", args.limits, valid=LIMITS)
    for name in ("requests", "kv_limit_slots", "block_tokens", "step_tokens", "peer_block_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if not args.ratio >= 1:
        p.error(f"--ratio: expected a number >= 1, got {args.ratio}")
    for name in ("eviction_start_tokens", "eviction_recent_tokens", "eviction_cache_tokens"):
        v = getattr(args, name)
        if v < 0 or v % args.peer_block_tokens or (v == 0 and name != "eviction_cache_tokens"):
            p.error(
                f"--{name.replace('_', '-')}: expected a positive multiple of --peer-block-tokens "
                f"({args.peer_block_tokens}){' or 0' if name == 'eviction_cache_tokens' else ''}, got {v}"
            )
    smallest = args.eviction_start_tokens + args.eviction_recent_tokens + args.peer_block_tokens
    if 0 < args.eviction_cache_tokens < smallest:
        p.error(
            f"--eviction-cache-tokens: expected 0 or at least start + recent + one block ({smallest}), got "
            f"{args.eviction_cache_tokens}"
        )
    return args


def check_peer(peer_python: str, peer_model: str) -> dict:
    """The peer's versions (``--probe``), or PeerUnavailable naming the step that failed and the command that
    redoes it: the virtualenv (absent, not a virtualenv, its build unfinished, or openvino_genai not importable) or
    the export (a file missing). The redo never deletes a folder: it removes the make target's stamp (``.installed``
    of the venv, ``.exported`` of the export), so ``make openvino-peer`` runs that step again over what is there."""
    py = Path(peer_python)
    venv = py.parent.parent
    where = f"(make openvino-peer makes {DEFAULT_PEER_PYTHON.relative_to(REPO_ROOT)})"
    if not py.exists():
        raise PeerUnavailable(f"step 'venv': {py} does not exist; redo: {REDO} {where}")
    if not venv.joinpath("pyvenv.cfg").exists():
        raise PeerUnavailable(f"step 'venv': {py} is not the python of a virtualenv; redo: {REDO} {where}")
    if not venv.joinpath(".installed").exists():
        raise PeerUnavailable(f"step 'venv': the build of {venv} did not finish (no .installed); redo: {REDO}")
    rebuild = f"rm -f {venv / '.installed'} && {REDO}"
    try:
        done = subprocess.run(
            [str(py), str(PEER_SCRIPT), "--probe", str(peer_model)],
            capture_output=True,
            text=True,
            timeout=300,
            env=_peer_env(),
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise PeerUnavailable(f"step 'venv': {py} does not run ({e}); redo: {rebuild}") from e
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        if "model folder" in said:
            export = DEFAULT_PEER_MODEL.relative_to(REPO_ROOT)
            redo = f"rm -f {Path(peer_model) / '.exported'} && {REDO} (it exports to {export})"
            raise PeerUnavailable(f"step 'export': {said}; redo: {redo}")
        raise PeerUnavailable(f"step 'venv': {said}; redo: {rebuild}")
    return json.loads(done.stdout)["versions"]


def _peer_env() -> dict:
    """Our environment without PYTHONPATH: the peer imports nothing of ours."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def our_configs(args, limit_bytes: int, head_dim: int) -> dict[str, tuple[str, dict]]:
    """key -> (label, EngineConfig fields) of our rows under ``limit_bytes``."""
    paged = dict(
        kv_layout="paged",
        kv_memory_limit_bytes=limit_bytes,
        block_tokens=args.block_tokens,
        scheduler="mixed",
        max_num_batched_tokens=args.step_tokens,
    )
    sh = dict(policy=OURS_SH_POLICY, compression_ratio=args.ratio, budget="per_request", **paged)
    int4 = {"kv_bits": 4, "kv_group_size": min(32, head_dim)}
    r = f"{args.ratio:g}"
    return {
        "ours-full": ("ours, paged full, mixed scheduler", paged),
        "ours-sh": (f"ours, Scissorhands x{r}, per-request budgets", sh),
        "ours-sh4": (f"ours, Scissorhands x{r} 4-bit, per-request budgets", {**sh, "policy_params": int4}),
    }


def peer_runs(args, limit_bytes: int, eviction: dict) -> dict[str, dict]:
    """key -> the peer's run (``bench/peer_openvino.py``'s job entry) under ``limit_bytes``."""
    base = dict(kv_limit_bytes=limit_bytes, max_num_batched_tokens=args.step_tokens, max_num_seqs=256)
    ev = eviction
    return {
        "ov-u8": dict(label="OpenVINO GenAI, full, u8 KV (its default)", kv_precision="u8", **base),
        "ov-bf16": dict(label="OpenVINO GenAI, full, bf16 KV", kv_precision="bf16", **base),
        "ov-evict": dict(
            label=f"OpenVINO GenAI, its eviction (max_cache_size {ev['max_cache_size']}, start {ev['start_size']}, "
            f"recent {ev['recent_size']}, {ev['aggregation_mode']}, "
            f"{'split-fuse' if args.eviction_split_fuse else 'no split-fuse'}), bf16 KV",
            kv_precision="bf16",
            dynamic_split_fuse=args.eviction_split_fuse,
            eviction=ev,
            **base,
        ),
    }


def peer_job(args, requests: list[dict], runs: list[dict]) -> dict:
    """The job ``bench/peer_openvino.py`` runs: the same request set, threads and dtype as ours, and ``runs``."""
    return {
        "model_dir": str(args.peer_model),
        "threads": args.threads,
        "inference_precision": OV_PRECISION[args.dtype],
        "block_tokens": args.peer_block_tokens,
        "requests": requests,
        "runs": runs,
    }


def schedule(stats: dict, steps: int, rows: int) -> dict:
    """A row's schedule, from the engine's `stats()` after the run and the `steps` it took with `rows` in flight summed
    over them: the same at every run of a commit (greedy, EOS ignored: no count depends on timing or on the tokens), so
    a tok/s change with the same schedule is the step's time, not admission (tok/s = output tokens a step / seconds a
    step). Keys: ``steps``, ``decode_steps``, ``prefill_calls``, ``output_tokens_per_step``, ``mean_rows_in_flight``
    (running or part-way prefilled, counted after each step: rows that finished in it are not), ``peak_rows_in_flight``,
    ``preemptions``, ``recomputed_tokens``, ``peak_kv_blocks_in_use`` and ``kv_pool_blocks`` (None: no pool)."""
    return {
        "steps": steps,
        "decode_steps": stats["decode_steps"],
        "prefill_calls": stats["prefill_calls"],
        "output_tokens_per_step": stats["generated_tokens"] / steps if steps else None,
        "mean_rows_in_flight": rows / steps if steps else None,
        "peak_rows_in_flight": stats["peak_running_sequences"],
        "preemptions": stats["preemptions"],
        "recomputed_tokens": stats["recomputed_tokens"],
        "peak_kv_blocks_in_use": stats.get("peak_kv_blocks_in_use"),
        "kv_pool_blocks": stats.get("kv_pool_blocks"),
    }


def format_schedule(rows: list[dict]) -> str:
    """The schedule of our measured rows (`schedule`) as a markdown table; empty when none has one."""
    ours = [r for r in rows if r.get("schedule")]
    if not ours:
        return ""
    lines = [
        "| our row | KV limit | steps | decode steps | prefill calls | output tokens a step | mean rows in flight after "
        "a step | peak rows | preemptions | recomputed tokens | peak KV blocks / pool |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ours:
        s = r["schedule"]
        per_step = f"{s['output_tokens_per_step']:.2f}" if s["output_tokens_per_step"] is not None else "-"
        mean = f"{s['mean_rows_in_flight']:.2f}" if s["mean_rows_in_flight"] is not None else "-"
        blocks = f"{s['peak_kv_blocks_in_use']:,} / {s['kv_pool_blocks']:,}" if s["kv_pool_blocks"] else "-"
        lines.append(
            f"| {r['label']} | {r['limit']} | {s['steps']:,} | {s['decode_steps']:,} | {s['prefill_calls']:,} | "
            f"{per_step} | {mean} | {s['peak_rows_in_flight']} | {s['preemptions']} | {s['recomputed_tokens']:,} | {blocks} |"
        )
    return "\n".join(lines)


def run_ours(model, fields: dict, requests: list[GenerationRequest]) -> dict:
    """One of our rows alone: a 2-token warm-up, then every request submitted at once and stepped until idle.
    Never raises: a failure is the row's ``error``; a failed request fails only itself."""
    try:
        engine = ContinuousBatchingEngine(model, EngineConfig(**fields))
        engine.submit(GenerationRequest("warmup", requests[0].prompt_ids[:32], 2, warmup=True), lambda r: None)
        engine.run_until_idle()  # a warm-up request: counted apart in stats()' warmup_* keys
        engine.reset_stats()  # its step is not the row's schedule
        done: dict = {}
        t0, c0 = time.perf_counter(), time.process_time()
        for r in requests:
            engine.submit(r, lambda res: done.__setitem__(res.request_id, res))
        steps = rows = 0
        while engine.step() or len(engine.queue):  # `run_until_idle`, counting the rows in flight after each step
            steps, rows = steps + 1, rows + engine.running
            if steps > MAX_STEPS:
                raise RuntimeError(f"engine still busy after {MAX_STEPS} steps")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = engine.stats()
    except Exception as e:  # noqa: BLE001 - a row's failure is recorded; the next rows still run
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    failed = [res for res in done.values() if res.error_kind]
    tokens = sum(len(res.output_ids) for res in done.values())
    return {
        "ok": not failed and len(done) == len(requests),
        "error": f"{len(failed)} of {len(requests)} requests failed: {failed[0].error}" if failed else None,
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / wall if wall > 0 else None,
        "kv_token_slots": stats["kv_memory_limit_bytes"] // stats["slot_bytes"],
        "schedule": schedule(stats, steps, rows),
        "preemptions": stats["preemptions"],
        "peak_running_sequences": stats["peak_running_sequences"],
        "outputs": {k: list(v.output_ids) for k, v in done.items() if not v.error_kind},
    }


def run_peer(args, job: dict) -> dict[str, dict]:
    """Every peer run of ``job`` in one process of the peer's virtualenv, at most ``--peer-timeout-s``; label -> its
    result. Its stderr is passed through; a run the process never reported (it crashed, or was killed at the
    timeout) comes back failed with the process's last words."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        tail: deque[str] = deque(maxlen=5)
        cmd = [args.peer_python, str(PEER_SCRIPT), str(job_path), str(out_path)]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=_peer_env())
        reader = threading.Thread(target=_echo, args=(proc.stderr, tail), daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=args.peer_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            tail.append(f"killed after --peer-timeout-s {args.peer_timeout_s:g}")
        reader.join(timeout=5)
        doc = json.loads(out_path.read_text()) if out_path.exists() else {"runs": {}}
    runs = doc["runs"]
    why = f"the peer process exited {rc} before this run: {' | '.join(tail) or 'no message'}"
    for run in job["runs"]:
        runs.setdefault(run["label"], {"ok": False, "error": why, "requests": {}})
    return {"versions": doc.get("versions", {}), "runs": runs}


def _echo(stream, tail: deque) -> None:
    """Copy the peer's stderr to ours line by line, keeping the last lines in ``tail``."""
    for line in stream:
        sys.stderr.write(line)
        tail.append(line.rstrip())


def _peer_row(result: dict) -> dict:
    return {
        "ok": bool(result.get("ok")),
        "error": result.get("error"),
        "wall_s": result.get("wall_s"),
        "cpu_s": result.get("cpu_s"),
        "output_tokens": result.get("output_tokens"),
        "output_tok_per_s": result.get("output_tok_per_s"),
        "kv_token_slots": result.get("kv_token_slots"),
        "num_kv_blocks": result.get("num_kv_blocks"),
        "max_cache_usage": result.get("max_cache_usage"),
        "outputs": {k: v["output_ids"] for k, v in result.get("requests", {}).items() if v.get("error") is None},
    }


def load_ours(args):
    """(model, tokenizer) of ours in ``--dtype``; the tiny random model has no tokenizer."""
    dtype = getattr(torch, args.dtype)
    if args.model == "tiny-llama":
        return tiny_llama(0).to(dtype).eval(), None
    return load_model(args.model, dtype=dtype)


def plan(args, model, tokenizer) -> dict:
    """What every row runs: ``requests`` (the one set), ``shape`` (their lengths), ``slot_bytes`` (a full-cache slot
    of ours), ``limit_bytes`` (``none`` and ``limit``) and the peer's ``eviction`` (its ``max_cache_size`` nearest
    our budgets unless ``--eviction-cache-tokens``)."""
    shape = lengths(args.requests, args.prompt_tokens, args.new_tokens, args.seed)
    requests = request_set(tokenizer, int(model.config.vocab_size), shape, args.seed)
    slot_bytes = full_rows_kv_bytes(model, 1, 1)
    blk = args.peer_block_tokens
    room = sum(-(-(p + n) // blk) * blk for p, n in shape)  # every request whole, in the peer's blocks
    smallest = args.eviction_start_tokens + args.eviction_recent_tokens + blk
    cap = args.eviction_cache_tokens or eviction_cache_tokens(
        [p + n for p, n in shape], budgets(requests, args.ratio, cache_policy(OURS_SH_POLICY)), blk, smallest
    )
    return {
        "requests": requests,
        "shape": shape,
        "slot_bytes": slot_bytes,
        "limit_bytes": {"none": room * slot_bytes, "limit": args.kv_limit_slots * slot_bytes},
        "eviction": {
            "start_size": args.eviction_start_tokens,
            "recent_size": args.eviction_recent_tokens,
            "max_cache_size": cap,
            "aggregation_mode": args.eviction_aggregation,
        },
    }


def measure_ours(args, model, the: dict) -> list[dict]:
    """Our rows, each limit in turn, one row at a time."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    ours, rows = our_requests(the["requests"]), []
    for limit in args.limits:
        limit_bytes = the["limit_bytes"][limit]
        configs = our_configs(args, limit_bytes, head_dim)
        for key in [k for k in OURS if k in args.rows]:
            label, fields = configs[key]
            r = run_ours(model, fields, ours)
            rows.append({"key": key, "label": label, "limit": limit, "kv_limit_bytes": limit_bytes, **r})
            said = f"{r['output_tok_per_s']:.1f} output tok/s" if r["ok"] else f"FAILED: {r['error']}"
            print(f"bench-peers: {label} (KV limit {limit}): {said}", file=sys.stderr, flush=True)
    return rows


def measure_peer(args, the: dict, peer_error: str | None) -> tuple[list[dict], dict]:
    """The peer's rows (all in one process of its venv) and its versions; rows marked ``not_run`` with
    ``peer_error`` when the peer cannot run."""
    planned = []
    for limit in args.limits:
        runs = peer_runs(args, the["limit_bytes"][limit], the["eviction"])
        for key in [k for k in PEERS if k in args.rows]:
            row = {"key": key, "label": runs[key]["label"], "limit": limit, "kv_limit_bytes": the["limit_bytes"][limit]}
            planned.append((row, {**runs[key], "label": f"{runs[key]['label']} [{limit}]"}))
    if not planned:
        return [], {}
    if peer_error is not None:
        return [
            {**row, "ok": False, "not_run": True, "error": peer_error, "output_tok_per_s": None} for row, _ in planned
        ], {}
    peer = run_peer(args, peer_job(args, the["requests"], [run for _, run in planned]))
    return [{**row, **_peer_row(peer["runs"][run["label"]])} for row, run in planned], peer["versions"]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    peer_error, versions = None, {}
    if any(k in PEERS for k in args.rows):
        try:
            versions = check_peer(args.peer_python, args.peer_model)
        except PeerUnavailable as e:
            peer_error = str(e)
            print(f"bench-peers: the peer cannot run: {peer_error}", file=sys.stderr)
    model, tokenizer = load_ours(args)
    model.generation_config.eos_token_id = None  # EOS ignored: every request runs to its max_new_tokens
    the = plan(args, model, tokenizer)
    rows = measure_ours(args, model, the)
    peer_rows, ran_versions = measure_peer(args, the, peer_error)
    rows.extend(peer_rows)
    rows.sort(key=lambda r: (args.limits.index(r["limit"]), ROW_KEYS.index(r["key"])))
    summary = summarize(rows)
    text = report(args, summary, the, ran_versions or versions, peer_error)
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.json").write_text(json.dumps(the["requests"]) + "\n")
    doc = {"args": vars(args), "git_commit": git_commit(), "peer_versions": ran_versions or versions, "rows": summary}
    (out / "bench.json").write_text(json.dumps(doc, default=str) + "\n")
    (out / "bench.md").write_text(text)
    print(f"bench-peers: wrote {out}/bench.md, bench.json and requests.json", file=sys.stderr)
    if peer_error is not None:
        print(f"bench-peers: the peer's rows did not run: {peer_error}", file=sys.stderr)
        return 2
    return 0 if all(r["ok"] for r in summary) else 1


def export_command(peer_model: str) -> str:
    """The export command ``make openvino-peer`` recorded beside the model (``export_command.txt``), else a note."""
    path = Path(peer_model) / "export_command.txt"
    return path.read_text().strip() if path.exists() else f"not recorded in {path}"


def report(args, rows: list[dict], the: dict, versions: dict, peer_error: str | None) -> str:
    """Conditions line, what ran (``the``: `plan`'s), the table and the failed rows' messages (markdown)."""
    shape, limit_bytes, slot_bytes = the["shape"], the["limit_bytes"], the["slot_bytes"]
    peer_v = ", ".join(f"{k} {v}" for k, v in versions.items()) or "not run"
    (p_lo, p_hi), (n_lo, n_hi) = args.prompt_tokens, args.new_tokens
    ps, ns = [p for p, _ in shape], [n for _, n in shape]
    lines = [
        conditions_line(
            model=args.model,
            dtype=f"{args.dtype} (--dtype; the peer's INFERENCE_PRECISION_HINT {OV_PRECISION[args.dtype]})",
            extra=f"transformers {transformers.__version__}; the peer: {peer_v}; its export: "
            f"`{export_command(args.peer_model)}`; both sides {args.threads} thread(s) (the peer's INFERENCE_NUM_THREADS)",
        ),
        "",
        f"{args.requests} requests, the same token ids on both sides (load-test text; prompts uniform in "
        f"[{p_lo}, {p_hi}]: {min(ps)}-{max(ps)} tokens; outputs log-uniform in [{n_lo}, {n_hi}]: {min(ns)}-{max(ns)}; "
        f"seed {args.seed}), greedy, EOS ignored, all submitted at once. Ours in process, one row at a time (paged, "
        f"{args.block_tokens}-token blocks, mixed scheduler, {args.step_tokens} tokens a step); then the peer's rows, "
        f"one at a time in its own venv (ContinuousBatchingPipeline, {args.peer_block_tokens}-token blocks, "
        f"max_num_batched_tokens {args.step_tokens}, split-fuse on unless said, prefix caching off). KV limits: none = "
        f"every request's prompt + output at once ({limit_bytes['none'] // slot_bytes:,} full-cache slots of "
        f"{slot_bytes} B in {args.dtype}); limit = {args.kv_limit_slots:,} such slots. The peer's pool: the limit's "
        "bytes // its block's measured bytes at its KV precision.",
        "",
        format_table(rows),
    ]
    sched = format_schedule(rows)
    if sched:
        lines += [
            "",
            "Our rows' schedule (the same at every run of a commit: a tok/s change with the same schedule is the "
            "step's time, not admission):",
            "",
            sched,
        ]
    failed = [r for r in rows if not r["ok"] and not r.get("not_run")]
    if failed:
        lines += ["", "Failed rows:"] + [f"- {r['label']} ({r['limit']}): {r['error']}" for r in failed]
    if peer_error is not None:
        lines += ["", f"The peer's rows did not run: {peer_error}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
