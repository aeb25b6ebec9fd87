"""One-command GPU check (`make gpu-check`): the library on CUDA, then the serving claim on an
8B-class model with dummy weights; no Ray needed, nothing downloaded.

    python -m bench.gpu_check [--out DIR] [--model llama-3.1-8b] [--full-batch 32 | --kv-limit-gib G]
                                [--prompt-tokens 1024] [--new-tokens 1024] [--ratios 5,2] [--kv4-ratio 5]
                                [--budget-s 460] [--phases library,paged,max_batch,engine_vs_generate,ray]
                                [--device cuda] [--dtype bfloat16] [--tiny]

It checks for a CUDA device first and stops with exit status 2 and a message naming what is missing
(a CPU-only torch build, or no visible GPU), before anything runs or is written. `--device cpu` runs
the same phases on the CPU (with `--tiny`: a 2-layer copy of the model, seconds; what the tests do).

Phases, each in its own Python process with its own time box (a crash, a CUDA OOM or a hang costs
that phase only); the report (`gpu_check.json`, `gpu_check.md` under `--out`, default `$OUT` when
set) is rewritten after every phase, so a run cut short still brings back what finished:

1. `library` (tiny copies of Llama-3.1-8B and OPT-125m, in `--dtype` on the device): for every
   evicting policy, with keys/values in the model dtype and in 4 bits, simulation mode (evicted slots
   masked, nothing removed), teacher-forced on the greedy tokens of real eviction (`generate`), gives
   logits within 5% of their largest magnitude at every step (`_compare`; greedy token flips are
   counted); the `scissorhands` explicit attention with the full cache, forced likewise on the tokens
   of transformers' `sdpa` with its `DynamicCache`, the same.
2. `paged` (a tiny Llama-3.1-8B copy in float32 on the device): the paged KV layout gives every policy's
   greedy tokens of the preallocated layout, keys/values in float32 and in 4 bits, with a roomy pool and a
   small one that preempts the full cache's rows; the mixed scheduler gives the full cache's prefill-first
   tokens (`phase_paged`).
3. `max_batch` (`--model` with dummy weights, `scissorhands.models.load_dummy_model`): one KV memory
   limit (`--full-batch` full-cache sequences of `--prompt-tokens` + `--new-tokens`, or
   `--kv-limit-gib`); the paged full cache (the denominator), Scissorhands at the first of `--ratios`
   (paged, per-request budgets), the preallocated full cache (the paper's setting), Scissorhands at the
   other ratios, then at `--kv4-ratio` with 4-bit keys/values, each at the largest batch the engine admits
   under that limit (`ContinuousBatchingEngine.max_batch_for`), run through the continuous-batching engine
   (`replica/engine/`) and verified (peak running sequences = that batch, peak KV bytes <= the
   limit). Output tok/s (output tokens / wall time of the run's engine steps, first to last token, prefill
   included; `replica.generate_baseline.run_engines`), decode tok/s (decode-step tokens / decode-step time),
   and their ratios to the paged full cache.
4. `engine_vs_generate`: our engine against transformers' `generate` (sdpa, `DynamicCache`, static
   left-padded batches), full cache, at full's max batch, on the same serving mix (prompt lengths
   uniform in [P/4, P], output lengths in [`--generate-new-tokens`/4, `--generate-new-tokens`]).
5. `ray` (only where `import ray` works; never on a bare accelerator machine): the suite `--suite`
   through the sweep (`python -m workloads.sweep`) on the device, one replica.

Every record says `weights: dummy` (speed and memory only, never quality) and carries the GPU (name,
memory, driver), torch, CUDA, transformers, dtype and the commit. Nothing here imports Ray: the Ray
phase is a subprocess.

Exit status: 0 every phase ran whole and every check passed; 1 a check failed, or a phase failed,
timed out, was cut short or not run for want of time (`--budget-s`); 2 no GPU or bad arguments.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.conditions import git_commit, parser, require_positive
from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine, full_batch_kv_limit_bytes
from replica.generate_baseline import run_engines, run_generate
from scissorhands import ATTN_IMPLEMENTATION, POLICIES, make_cache
from scissorhands.models import DUMMY_MODEL_IDS, dummy_config, load_dummy_model, tiny_overrides

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
MIB = 1024**2
SCHEMA_VERSION = 1
BUNDLE_DIR = REPO_ROOT / ".gpu-bundle"
"""Where `make gpu-bundle` puts the wheels a bare accelerator machine lacks, and the commit (COMMIT)."""

PHASES = ("library", "paged", "max_batch", "engine_vs_generate", "ray")
PHASE_BOX_S = {"library": 60.0, "paged": 45.0, "max_batch": 240.0, "engine_vs_generate": 120.0, "ray": 120.0}
"""Most seconds each phase may take (its process is killed after that); all are capped by `--budget-s`."""
PHASE_MARGIN_S = 10.0
"""A phase stops starting new work this long before its box ends, so it can write what it measured."""
LIBRARY_MODELS = ("llama-3.1-8b", "opt-125m")
"""Architectures of the library phase (grouped-query attention with RoPE; multi-head with learned positions)."""


class NoGPU(RuntimeError):
    """No usable CUDA device; the message says what is missing."""


def require_cuda() -> dict:
    """{"name", "total_bytes", "torch", "cuda", "capability", "driver"} of GPU 0, or NoGPU naming what is missing."""
    import torch

    if torch.version.cuda is None:
        raise NoGPU(
            f"no CUDA GPU: torch {torch.__version__} is a CPU-only build; install a CUDA build "
            '(make install TORCH_SPEC="torch==<version> --index-url <your CUDA index>") on a machine with an NVIDIA GPU'
        )
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise NoGPU(
            f"no CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}; is the NVIDIA driver loaded? try nvidia-smi)"
        )
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "total_bytes": int(props.total_memory),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "capability": f"{props.major}.{props.minor}",
        "driver": _nvidia_driver(),
    }


def _nvidia_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def commit() -> str | None:
    """The checkout's commit (`+dirty` when files differ), else the one `make gpu-bundle` recorded, else None."""
    recorded = BUNDLE_DIR / "COMMIT"
    return git_commit(short=False, fallback="") or (
        recorded.read_text().strip() or None if recorded.is_file() else None
    )


def ray_importable() -> bool:
    """Whether `import ray` works, asked of a subprocess so this process never imports Ray."""
    try:
        return subprocess.run([sys.executable, "-c", "import ray"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def environment(device: str) -> dict:
    """What the numbers were measured on: device (GPU or CPU), software versions, commit."""
    import importlib.metadata

    import torch
    import transformers

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "tokenizers": version("tokenizers"),
        "commit": commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
    }
    if device == "cuda":
        env["gpu"] = require_cuda()
    else:
        cpu = None
        try:
            cpu = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")
                ),
                None,
            )
        except OSError:
            pass
        env["cpu"] = {"name": cpu or platform.processor(), "torch_threads": torch.get_num_threads()}
    return env


def gpu_suite(suite: dict, device: str = "cuda", dtype: str = "bfloat16") -> dict:
    """The suite on one device: `device`, `dtype`, one replica (holding one GPU on CUDA)."""
    out = dict(suite)
    out.update(device=device, dtype=dtype, replicas=1, name=f"{suite.get('name', 'suite')}-gpu")
    if device == "cuda":
        out["placement"] = {**(suite.get("placement") or {}), "num_gpus": 1}
    return out


# ----------------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(
        "gpu_check",
        __doc__,
        "at most --budget-s (460 s); with --device cpu --tiny on 2 CPU cores, about a minute",
        "on one GPU",
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder of gpu_check.json and gpu_check.md (default $OUT, else results/gpu-check-<UTC time>)",
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--model", default="llama-3.1-8b", help="a shipped dummy-weights config (scissorhands/configs)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide copy of --model (tests, CPU)")
    p.add_argument("--full-batch", type=int, default=32, help="the KV limit holds this many full-cache sequences")
    p.add_argument("--kv-limit-gib", type=float, default=None, help="the KV limit in GiB (instead of --full-batch)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--ratios", default="5,2", help="Scissorhands compression ratios of the max-batch phase, in order")
    p.add_argument("--kv4-ratio", type=float, default=5.0, help="ratio of the 4-bit run (0: none); runs last")
    p.add_argument("--generate-new-tokens", type=int, default=512, help="longest output of the engine-vs-generate mix")
    p.add_argument("--generate-requests", type=int, default=None, help="requests of that phase (default 2 x batch)")
    p.add_argument(
        "--suite", default=str(REPO_ROOT / "workloads" / "suites" / "smoke.yaml"), help="suite of the Ray phase"
    )
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {', '.join(PHASES)}")
    p.add_argument(
        "--budget-s", type=float, default=460.0, help="the whole check's time (s); phases past it are skipped"
    )
    p.add_argument(
        "--box-scale",
        type=float,
        default=1.0,
        help="multiplies every phase's time box (a slow or shared machine; the CPU tests)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads of each phase (default: 1 on the CPU)")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # internal: run one phase
    p.add_argument("--phase-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase is not None:
        return args
    try:
        args.ratio_list = [float(r) for r in args.ratios.split(",") if r.strip()]
    except ValueError:
        p.error(f"--ratios: expected comma-separated numbers >= 1, got {args.ratios!r}")
    if any(r < 1 for r in args.ratio_list) or (args.kv4_ratio and args.kv4_ratio < 1):
        p.error(f"--ratios, --kv4-ratio: compression ratios must be >= 1 (got {args.ratios!r}, {args.kv4_ratio})")
    args.phase_list = [x.strip() for x in args.phases.split(",") if x.strip()]
    bad = [x for x in args.phase_list if x not in PHASES]
    if bad:
        p.error(f"--phases: unknown phase(s) {', '.join(bad)}; valid: {', '.join(PHASES)}")
    require_positive(p, args, "full_batch", "prompt_tokens", "new_tokens", "generate_new_tokens")
    if args.kv_limit_gib is not None and args.kv_limit_gib <= 0:
        p.error(f"--kv-limit-gib: must be > 0, got {args.kv_limit_gib}")
    if args.generate_new_tokens > args.new_tokens:
        p.error(f"--generate-new-tokens ({args.generate_new_tokens}) must be <= --new-tokens ({args.new_tokens})")
    if args.budget_s <= 0:
        p.error(f"--budget-s: must be > 0, got {args.budget_s}")
    if args.box_scale <= 0:
        p.error(f"--box-scale: must be > 0, got {args.box_scale}")

    if args.model not in DUMMY_MODEL_IDS:
        p.error(f"--model: unknown dummy-weights config {args.model!r}; shipped: {', '.join(DUMMY_MODEL_IDS)}")
    return args


# ----------------------------------------------------------------------------------------------- phases
def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _free_device_memory(device) -> None:
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _load(a: dict, name: str | None = None, tiny: bool | None = None):
    """The dummy-weights model `name` (default `--model`) on the run's device and dtype, frozen."""

    name = name or a["model"]
    tiny = a["tiny"] if tiny is None else tiny
    overrides = tiny_overrides(name) if tiny else {}
    config = dummy_config(name, **overrides)
    longest = a["prompt_tokens"] + a["new_tokens"]
    if config.model_type == "mistral" and getattr(config, "sliding_window", None):
        if longest > config.sliding_window:
            raise ValueError(
                f"--prompt-tokens + --new-tokens ({longest}) exceed {name}'s sliding window "
                f"({config.sliding_window}), which the budgeted cache does not apply"
            )
        overrides["sliding_window"] = None  # every sequence stays inside the window: same attention
    if longest > getattr(config, "max_position_embeddings", longest):
        raise ValueError(
            f"--prompt-tokens + --new-tokens ({longest}) exceed {name}'s max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    model = load_dummy_model(name, dtype=_torch_dtype(a["dtype"]), device=a["device"], seed=a["seed"], **overrides)
    model.requires_grad_(False)
    model.generation_config.eos_token_id = None
    return model


def _greedy(model, ids, cache, new_tokens: int):
    import torch

    with torch.inference_mode():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )


def _forced_logits(model, ids, cache, tokens) -> list:
    """Teacher forcing: prefill `ids` (batch, prompt) into `cache`, then feed `tokens` (batch, steps) one
    per call, as decoding does. Returns the logits that predict each of `tokens`: `steps` tensors of
    (batch, vocab), last position only as `generate` computes them."""
    import torch

    with torch.inference_mode():
        logits = [model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]]
        for t in range(tokens.shape[1] - 1):
            logits.append(model(tokens[:, t : t + 1], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1])
    return logits


def _compare(ours: list, ref, prompt: int) -> dict:
    """Teacher-forced logits `ours` (`_forced_logits` on the reference's greedy tokens) against the greedy
    run `ref` (`_greedy`, prompt of `prompt` tokens), step by step. Passes when every logit is within 5% of
    the reference's largest magnitude. Forced on the same tokens, one rounding-level flip cannot send the
    two down different continuations (free-running greedy runs did: dummy weights in bfloat16 give exact
    ties). `token_flips` counts the positions whose greedy token differs from the reference's; it is
    reported, not judged: with every logit within `d` of the reference, a flip can only land on a token the
    reference ranked within `2 d` of its top, so the logit bound already decides."""
    tokens = ref.sequences[:, prompt:]  # (batch, new_tokens)
    diff = scale = 0.0
    flips = 0
    for t, (x, y) in enumerate(zip(ours, ref.logits, strict=True)):  # each (batch, vocab)
        x, y = x.float(), y.float()
        diff, scale = max(diff, float((x - y).abs().max())), max(scale, float(y.abs().max()))
        flips += int((x.argmax(-1) != tokens[:, t]).sum())
    return {"token_flips": flips, "max_abs_logit_diff": diff, "max_abs_logit": scale, "passed": diff <= 0.05 * scale}


def phase_library(a: dict, deadline: float, save) -> dict:
    """Real eviction = simulation for every evicting policy (model dtype and 4-bit KV), explicit attention = sdpa."""
    import torch
    from transformers import DynamicCache

    budget, prompt, new = 8, 24, 8
    result = {
        "checks": [],
        "weights": "dummy",
        "dtype": a["dtype"],
        "budget_tokens": budget,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "batch": 2,
    }
    for name in LIBRARY_MODELS:
        model = _load(a, name, tiny=True)
        vocab = int(model.config.vocab_size)
        gen = torch.Generator().manual_seed(a["seed"])
        ids = torch.randint(1, vocab, (2, prompt), generator=gen).to(a["device"])  # (batch, prompt)
        for policy in (p for p, cls in POLICIES.items() if cls.evicts):
            for kv_bits in (None, 4):
                if time.time() > deadline:
                    result["cut_short"] = True
                    return result
                kw = dict(budget_tokens=budget, kv_bits=kv_bits, kv_group_size=16)  # head_dim 16
                real_cache = make_cache(policy, model, **kw)
                real = _greedy(model, ids, real_cache, new)
                sim = _forced_logits(
                    model, ids, make_cache(policy, model, simulate=True, **kw), real.sequences[:, prompt:]
                )
                row = {
                    "check": "real eviction = simulation",
                    "model": f"{name} (tiny)",
                    "policy": policy,
                    "kv_bits": kv_bits,
                    **_compare(sim, real, prompt),
                    "max_slots": max(real_cache.num_slots()),
                }
                row["passed"] = row["passed"] and row["max_slots"] <= budget
                result["checks"].append(row)
                save(result)
        model.set_attn_implementation("sdpa")
        ref = _greedy(model, ids, DynamicCache(config=model.config), new)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        ours = _forced_logits(model, ids, make_cache("full", model), ref.sequences[:, prompt:])
        result["checks"].append(
            {
                "check": "explicit attention = sdpa",
                "model": f"{name} (tiny)",
                "policy": "full",
                "kv_bits": None,
                **_compare(ours, ref, prompt),
            }
        )
        save(result)
    return result


PAGED_BLOCK_TOKENS = 4
"""Slots per block of the paged phase: small, so requests of a few dozen tokens cross many block boundaries."""
SMALL_POOL_BLOCKS = 16
"""Blocks a layer of the paged phase's small pool: the longest request (40 + 24 tokens, 16 blocks) just fits alone
and the full cache's rows are preempted (at 18 admission, which charges the bookkeeping padded to the widest row,
runs them without preempting); budgeted rows (3 blocks each) fit, since a budgeted row recomputed after a
preemption compresses its prompt and outputs at once and may keep other tokens by design (docs/serving.md)."""


def _greedy_runs(model, runs: list[tuple[str, EngineConfig]], requests: list[GenerationRequest]) -> dict:
    """Each labelled config serves `requests` alone (`run_engines`): label -> its outputs and KV layout stats, or
    the error that stopped it (one run's failure leaves the others their chance)."""
    out = {}
    for label, cfg in runs:
        try:
            (run,) = run_engines(model, [(cfg, requests)], desc=None)
            out[label] = {k: run[k] for k in ("outputs", "preemptions", "recomputed_tokens", "peak_kv_blocks_in_use")}
        except Exception as e:  # noqa: BLE001 - reported as that run's failure
            out[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def phase_paged(a: dict, deadline: float, save) -> dict:
    """The paged KV layout on the device: every policy's greedy tokens equal the preallocated layout's, and the
    mixed scheduler's equal prefill-first's.

    A tiny Llama-3.1-8B copy (grouped-query attention, RoPE) in float32, whatever `--dtype` says: the check is
    exactness, and in bfloat16 a chunked prefill rounds differently from a whole one. Eight requests of 5-40
    prompt tokens and 1-24 new tokens (ignore EOS), served by the continuous-batching engine:

    * every registered policy (budget 12 slots where it evicts), keys/values in float32 and in 4 bits: the paged
      layout (blocks of `PAGED_BLOCK_TOKENS` slots) with a roomy pool, and with a small pool of
      `SMALL_POOL_BLOCKS` blocks a layer (the full cache's rows are preempted and recomputed), against the
      preallocated layout;
    * the full cache (float32 and 4-bit keys/values) under `scheduler: mixed`, 16 tokens a step (prompts fed in
      chunks), against prefill-first, both on the small pool. Budgeted policies are left out here: a prompt fed in
      chunks is compressed after every chunk, so what it keeps differs from a whole prefill's by design.

    A check passes when every request's tokens are equal and no run failed, and the full cache's small-pool runs
    preempted (the recompute path is checked)."""
    import torch

    model = _load({**a, "dtype": "float32"}, "llama-3.1-8b", tiny=True)
    gen = torch.Generator().manual_seed(a["seed"])
    requests = []
    for i in range(8):
        prompt = torch.randint(1, int(model.config.vocab_size), (int(torch.randint(5, 41, (1,), generator=gen)),))
        requests.append(GenerationRequest(f"p{i}", prompt.tolist(), int(torch.randint(1, 25, (1,), generator=gen))))
    result = {"checks": [], "weights": "dummy", "dtype": "float32", "requests": len(requests)}
    result.update(block_tokens=PAGED_BLOCK_TOKENS, small_pool_blocks_per_layer=SMALL_POOL_BLOCKS)

    def paged(kw: dict, pool_blocks: int | None = None, **extra) -> EngineConfig:
        """`kw` on the paged layout; with `pool_blocks`, a KV limit of that many of its blocks a layer."""
        cfg = EngineConfig(**kw, kv_layout="paged", block_tokens=PAGED_BLOCK_TOKENS, kv_memory_limit_bytes=10**9)
        if pool_blocks is None:
            return cfg.model_copy(update=extra)
        engine = ContinuousBatchingEngine(model, cfg)
        limit = engine.block_bytes * engine.num_layers * pool_blocks
        return cfg.model_copy(update={"kv_memory_limit_bytes": limit, **extra})

    def check(name: str, policy: str, kv_bits, runs: list[tuple[str, EngineConfig]]) -> None:
        got = _greedy_runs(model, runs, requests)
        want = runs[0][0]
        ref = got[want]
        for label, run in list(got.items())[1:]:
            row = {"check": name, "policy": policy, "kv_bits": kv_bits, "run": label, "against": want}
            if "error" in run or "error" in ref:
                row.update(passed=False, error=run.get("error") or ref["error"])
            else:
                equal = sum(run["outputs"][r.request_id] == ref["outputs"][r.request_id] for r in requests)
                must_preempt = policy == "full" and "small pool" in label
                passed = equal == len(requests) and (run["preemptions"] > 0 or not must_preempt)
                row.update(equal_requests=equal, preemptions=run["preemptions"], passed=passed)
                row.update(recomputed_tokens=run["recomputed_tokens"], peak_kv_blocks=run["peak_kv_blocks_in_use"])
            result["checks"].append(row)
        save(result)

    plan = [("paged = preallocated", p, bits) for p in POLICIES for bits in (None, 4)]
    plan += [("mixed = prefill-first", "full", bits) for bits in (None, 4)]
    for name, policy, kv_bits in plan:
        if time.time() > deadline:
            result["cut_short"] = True
            break
        kw = {"policy": policy, "budget_tokens": None if policy == "full" else 12}
        if kv_bits:
            kw["policy_params"] = {"kv_bits": kv_bits, "kv_group_size": 16}  # head_dim 16
        if name == "paged = preallocated":
            runs = [
                ("preallocated", EngineConfig(**kw)),
                ("paged, roomy pool", paged(kw)),
                ("paged, small pool", paged(kw, SMALL_POOL_BLOCKS)),
            ]
        else:
            runs = [
                ("prefill-first", paged(kw, SMALL_POOL_BLOCKS)),
                ("mixed, 16 tokens a step", paged(kw, SMALL_POOL_BLOCKS, scheduler="mixed", max_num_batched_tokens=16)),
            ]
        check(name, policy, kv_bits, runs)
    return result


def _head_dim(model) -> int:
    c = model.config
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def _kv_limit(a: dict, model) -> int:
    """The run's KV memory limit (bytes): `--kv-limit-gib`, else `--full-batch` full-cache sequences."""

    if a["kv_limit_gib"] is not None:
        return int(a["kv_limit_gib"] * GIB)
    return full_batch_kv_limit_bytes(model, a["full_batch"], a["prompt_tokens"], a["new_tokens"])


def _random_prompts(vocab: int, n: int, lengths, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        rng.integers(1, vocab, size=int(length)).tolist()
        for length in (lengths if not isinstance(lengths, int) else [lengths] * n)
    ]


def phase_max_batch(a: dict, deadline: float, save) -> dict:
    """Each cache at its own max batch under one KV limit, run and verified; tok/s and ratios to full."""

    model = _load(a)
    P, N = a["prompt_tokens"], a["new_tokens"]
    limit = _kv_limit(a, model)
    result = {
        "model": a["model"],
        "tiny": a["tiny"],
        "weights": "dummy",
        "dtype": a["dtype"],
        "kv_memory_limit_bytes": limit,
        "prompt_tokens": P,
        "new_tokens": N,
        "runs": [],
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    # the paged full cache is the denominator (what serving engines run); the preallocated one is the paper's setting
    ratios = [("scissorhands", r, None, "paged") for r in a["ratio_list"]]
    plan = [("full", None, None, "paged"), *ratios[:1], ("full", None, None, "preallocated"), *ratios[1:]]
    if a["kv4_ratio"]:
        plan.append(("scissorhands", a["kv4_ratio"], 4, "paged"))
    vocab = int(model.config.vocab_size)
    for policy, ratio, kv_bits, layout in plan:
        if time.time() > deadline:
            result["cut_short"] = True
            break
        kw = dict(policy=policy, kv_memory_limit_bytes=limit, kv_layout=layout)
        if layout == "preallocated":
            kw["max_length_tokens"] = P + N
        if ratio is not None:  # the ratio's own budgets: no floor (it binds only below 32 x ratio tokens: --tiny)
            kw.update(compression_ratio=ratio, budget="per_request", policy_params={"min_budget_tokens": 0})
        if kv_bits is not None:  # groups of 32 values along head_dim (or the whole head when smaller)
            kw["policy_params"] = {
                **kw.get("policy_params", {}),
                "kv_bits": kv_bits,
                "kv_group_size": min(32, _head_dim(model)),
            }
        cfg = EngineConfig(**kw)
        b = ContinuousBatchingEngine(model, cfg).max_batch_for(P, N)
        label = "full" if ratio is None else f"scissorhands x{ratio:g}" + (f", {kv_bits}-bit KV" if kv_bits else "")
        label += f" ({layout})"
        print(f"gpu-check: max_batch: {label} at batch {b} ...", file=sys.stderr, flush=True)
        requests = [
            GenerationRequest(f"{policy}-{i}", p, N) for i, p in enumerate(_random_prompts(vocab, b, P, a["seed"]))
        ]
        try:
            (run,) = run_engines(model, [(cfg, requests)], deadline=deadline, desc=None)
            run.pop("outputs")
            run["verified"] = run["peak_running_sequences"] == b and run["peak_kv_cache_bytes"] <= limit
        except Exception as e:  # noqa: BLE001 - one run's failure (an OOM, say) leaves the next runs their chance
            run = {"error": f"{type(e).__name__}: {e}"[:500], "verified": False, "finished": False}
            _free_device_memory(a["device"])
        run.update(label=label, policy=policy, compression_ratio=ratio, kv_bits=kv_bits, kv_layout=layout, max_batch=b)
        result["runs"].append(run)
        full = result["runs"][0]
        for r in result["runs"]:
            ok = "error" not in r and "error" not in full
            r["output_ratio_to_full"] = r["output_tok_per_s"] / full["output_tok_per_s"] if ok else None
            r["decode_ratio_to_full"] = (
                r["decode_tok_per_s"] / full["decode_tok_per_s"]
                if ok and r["decode_tok_per_s"] and full["decode_tok_per_s"]
                else None
            )
        save(result)
    return result


def phase_engine_vs_generate(a: dict, deadline: float, save) -> dict:
    """Our engine vs transformers' generate, full cache, at full's max batch, on one serving mix."""
    import numpy as np

    model = _load(a)
    P, N, G = a["prompt_tokens"], a["new_tokens"], a["generate_new_tokens"]
    limit = _kv_limit(a, model)
    cfg = EngineConfig(kv_memory_limit_bytes=limit, max_length_tokens=P + N)
    b = ContinuousBatchingEngine(model, cfg).max_batch_for(P, N)
    m = a["generate_requests"] or 2 * b
    rng = np.random.default_rng(a["seed"] + 1)
    out_lengths = rng.integers(max(1, G // 4), G + 1, size=m).tolist()
    p_lengths = rng.integers(max(1, P // 4), P + 1, size=m).tolist()
    prompts = _random_prompts(int(model.config.vocab_size), m, p_lengths, a["seed"] + 1)
    reqs = [GenerationRequest(f"g-{i}", p, int(n)) for i, (p, n) in enumerate(zip(prompts, out_lengths))]
    result = {
        "model": a["model"],
        "tiny": a["tiny"],
        "weights": "dummy",
        "dtype": a["dtype"],
        "batch": b,
        "requests": m,
        "kv_memory_limit_bytes": limit,
        "prompt_tokens_range": [min(p_lengths), max(p_lengths)],
        "output_tokens_range": [min(out_lengths), max(out_lengths)],
    }
    print(f"gpu-check: engine_vs_generate: batch {b}, {m} requests: generate ...", file=sys.stderr, flush=True)

    gen = run_generate(model, reqs, b, device=a["device"], deadline=deadline)
    result["generate"] = {k: v for k, v in gen.items() if k != "outputs"}
    save(result)
    print("gpu-check: engine_vs_generate: our engine ...", file=sys.stderr, flush=True)
    (eng,) = run_engines(
        model,
        [(EngineConfig(max_batch=b, kv_memory_limit_bytes=limit, max_length_tokens=P + N), reqs)],
        deadline=deadline,
        desc=None,
    )
    result["engine"] = {k: v for k, v in eng.items() if k != "outputs"}
    # with dummy weights the logits are near ties, so tokens may differ between the two attention paths
    result["identical_outputs"] = sum(
        eng["outputs"].get(r.request_id) == gen["outputs"].get(r.request_id) for r in reqs
    )
    result["ratio_engine_to_generate"] = eng["output_tok_per_s"] / gen["output_tok_per_s"]
    save(result)
    return result


PHASE_FUNCTIONS = {
    "library": phase_library,
    "paged": phase_paged,
    "max_batch": phase_max_batch,
    "engine_vs_generate": phase_engine_vs_generate,
}


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def run_phase(args: argparse.Namespace) -> int:
    """The child process of one phase: reads the run's arguments, writes `<phase>.json` after each step."""
    import torch

    phase_dir = Path(args.phase_dir)
    a = json.loads((phase_dir / "args.json").read_text())
    out = phase_dir / f"{args.phase}.json"
    torch.manual_seed(a["seed"])
    if a["threads"]:
        torch.set_num_threads(a["threads"])
    elif a["device"] == "cpu":
        torch.set_num_threads(1)  # a CPU run is a functional check: one thread, no oversubscription

    def save(result: dict) -> None:
        _write_json(out, result)

    result = PHASE_FUNCTIONS[args.phase](a, a["phase_deadline_unix"], save)
    save(result)
    return 0


def _phase_subprocess(phase: str, phase_dir: Path, a: dict, box_s: float) -> dict:
    """Run one phase in a child process with a hard time box; return its record (status, result, seconds)."""
    a = {**a, "phase_deadline_unix": time.time() + max(1.0, box_s - PHASE_MARGIN_S)}
    _write_json(phase_dir / "args.json", a)
    out = phase_dir / f"{phase}.json"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--phase", phase, "--phase-dir", str(phase_dir)]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    t0 = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=12)
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )

    def relay() -> None:  # the child's output, live (a device run returns only what was printed)
        for line in proc.stdout:
            sys.stderr.write(line)
            sys.stderr.flush()
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        rc, timed_out = proc.wait(timeout=box_s), False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc, timed_out = None, True
    reader.join(timeout=10)
    log = "\n".join(tail)
    result = json.loads(out.read_text()) if out.exists() else None
    if timed_out:
        status = "timed out"
    elif rc != 0:
        status = "failed"
    elif result and result.get("cut_short"):
        status = "cut short"
    else:
        status = "ok"
    record = {"status": status, "elapsed_s": time.monotonic() - t0, "box_s": box_s, "result": result}
    if status == "failed":
        record["error"] = log
    return record


def _ray_phase(args: argparse.Namespace, run_dir: Path, box_s: float) -> dict:
    """The suite through the sweep (Ray) on the device, as a subprocess; the points it wrote."""
    import yaml

    t0 = time.monotonic()
    with open(args.suite, encoding="utf-8") as f:
        suite = gpu_suite(yaml.safe_load(f), args.device, args.dtype)
    suite_path = run_dir / "suite.yaml"
    suite_path.write_text(yaml.safe_dump(suite, sort_keys=False))
    cmd = [sys.executable, "-m", "workloads.sweep", str(suite_path), "--results-dir", str(run_dir), "--run-id", "sweep"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    try:
        rc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, timeout=box_s).returncode
        status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        status = "timed out"
    points_file = run_dir / "sweep" / "points.jsonl"
    records = [json.loads(line) for line in points_file.read_text().splitlines()] if points_file.exists() else []
    points = [
        {
            "policy": r["policy"],
            "compression_ratio": r.get("compression_ratio"),
            "batch_size": r["batch_size"],
            "decode_tokens_per_s": r.get("decode_tokens_per_s"),
            "kv_cache_bytes": r.get("kv_cache_bytes"),
            "status": r["status"],
        }
        for r in records
    ]
    if status == "ok" and (not points or any(p["status"] != "ok" for p in points)):
        status = "failed"
    return {
        "status": status,
        "elapsed_s": time.monotonic() - t0,
        "box_s": box_s,
        "result": {"suite": suite["name"], "model": suite.get("model"), "points": points},
    }


# ----------------------------------------------------------------------------------------------- report
def _fmt(v, spec: str = ",.1f", scale: float = 1.0) -> str:
    return "-" if v is None else format(v / scale, spec)


def _table(caption: str, header: str, rows: list[list]) -> list[str]:
    """`caption`, then a markdown table (`header`: its column names as the table writes them, ``a | b``; a cell
    shown with str), then a blank line, as lines."""
    cells = ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return [caption, "", f"| {header} |", "|" + "---|" * len(header.split(" | ")), *cells, ""]


def _kv(check: dict, dense: str) -> str:
    return f"{check['kv_bits']}-bit" if check["kv_bits"] else dense


def _max_batch_row(r: dict) -> list:
    if "error" in r:
        return [r["label"], r["max_batch"], False, False, f"error: {r['error'][:200]}"] + ["-"] * 7
    return [r["label"], r["max_batch"], r["verified"], r["finished"], r["output_tokens"], f"{r['wall_s']:.1f}"] + [
        _fmt(r["output_tok_per_s"]),
        _fmt(r["decode_tok_per_s"]),
        _fmt(r["peak_kv_cache_bytes"], ".1f", MIB),
        _fmt(r["peak_device_allocated_bytes"], ".1f", MIB),
        f"{_fmt(r['output_ratio_to_full'], '.2f')}x",
        f"{_fmt(r['decode_ratio_to_full'], '.2f')}x",
    ]


def render_markdown(report: dict) -> str:
    """The report as Markdown (conditions, then one section per phase), ready for docs/results/."""
    env, a = report["environment"], report["args"]
    dev = env.get("gpu") or env.get("cpu") or {}
    where = (
        f"{dev['name']} ({dev['total_bytes'] / GIB:.0f} GiB, driver {dev.get('driver') or '?'}, "
        f"compute capability {dev.get('capability')})"
        if "gpu" in env
        else f"CPU {dev.get('name')} ({dev.get('torch_threads')} torch threads)"
    )
    model = f"{a['model']}{' (tiny copy: 2 layers, width 64)' if a['tiny'] else ''}"
    lines = [
        f"# GPU check: {model}, dummy weights, {a['dtype']}, {where.split(' (')[0]}",
        "",
        f"- device: {where}",
        f"- software: torch {env['torch']} (CUDA {env.get('cuda')}), transformers {env['transformers']}, "
        f"tokenizers {env.get('tokenizers')}, Python {env['python']}",
        f"- commit: {env.get('commit') or 'unknown'}; run at {env['time_utc']}; total {report.get('elapsed_s', 0):.0f} s",
        f"- weights: {report['weights']} (the published config of {report['model_id']}, random weights: "
        "speed and memory only, never quality); prompts are random token ids",
        "",
    ]
    phases = report["phases"]
    for phase in PHASES:
        rec = phases.get(phase)
        if rec is None:
            continue
        lines.append(
            f"## {phase}: {rec['status']}"
            + (
                f" ({rec['elapsed_s']:.0f} s of a {rec['box_s']:.0f} s box)"
                if rec.get("box_s")
                else f" ({rec.get('reason', '')})"
            )
        )
        lines.append("")
        res = rec.get("result") or {}
        if rec.get("error"):
            lines += ["```", rec["error"], "```", ""]
        if phase == "library" and res.get("checks"):
            lines += _table(
                f"Tiny copies in {a['dtype']} on {a['device']}: batch {res['batch']}, {res['prompt_tokens']}-token "
                f"prompts, {res['new_tokens']} greedy tokens, budget {res['budget_tokens']} slots.",
                "check | model | policy | KV | token flips | max abs logit diff | max abs logit | passed",
                [
                    [c["check"], c["model"], c["policy"], _kv(c, a["dtype"]), c["token_flips"]]
                    + [f"{c['max_abs_logit_diff']:.4g}", f"{c['max_abs_logit']:.4g}", c["passed"]]
                    for c in res["checks"]
                ],
            )
        if phase == "paged" and res.get("checks"):
            lines += _table(
                f"Tiny Llama-3.1-8B copy in float32 on {a['device']}: {res['requests']} requests of 5-40 + 1-24 tokens, "
                f"blocks of {res['block_tokens']} slots, small pool {res['small_pool_blocks_per_layer']} blocks a "
                "layer; budget 12 slots where the policy evicts.",
                "check | policy | KV | run | against | equal requests | preemptions | passed",
                [
                    [c["check"], c["policy"], _kv(c, "float32"), c["run"], c["against"]]
                    + [c.get("equal_requests", f"error: {c.get('error', '')[:120]}"), c.get("preemptions", "-")]
                    + [c["passed"]]
                    for c in res["checks"]
                ],
            )
        if phase == "max_batch" and res.get("runs"):
            sized = "" if a["kv_limit_gib"] else f" = {a['full_batch']} full-cache sequences"
            lines += _table(
                f"KV memory limit {res['kv_memory_limit_bytes'] / GIB:.2f} GiB "
                f"({res['kv_memory_limit_bytes']} B{sized}); "
                f"{res['prompt_tokens']} + {res['new_tokens']} tokens per request; weights "
                f"{res['weight_bytes'] / GIB:.2f} GiB.",
                "run | max batch | verified | finished | output tokens | wall (s) | output (tok/s) | decode (tok/s) "
                "| peak KV (MiB) | peak allocated (MiB) | output / full | decode / full",
                [_max_batch_row(r) for r in res["runs"]],
            )
        if phase == "engine_vs_generate" and res.get("generate"):
            runs = (
                ("transformers generate (sdpa, static batches)", res.get("generate")),
                ("our engine (continuous batching)", res.get("engine")),
            )
            lines += _table(
                f"Full cache, batch {res['batch']}, {res['requests']} requests: prompts "
                f"{res['prompt_tokens_range'][0]}-{res['prompt_tokens_range'][1]} tokens, outputs "
                f"{res['output_tokens_range'][0]}-{res['output_tokens_range'][1]} tokens.",
                "run | finished | requests done | output tokens | wall (s) | output (tok/s)",
                [
                    [label, r["finished"], r["completed_requests"], r["output_tokens"]]
                    + [f"{r['wall_s']:.1f}", _fmt(r["output_tok_per_s"])]
                    for label, r in runs
                    if r
                ],
            )
            if res.get("ratio_engine_to_generate") is not None:
                lines += [
                    f"Our engine / generate: {res['ratio_engine_to_generate']:.2f}x output tok/s; identical "
                    f"outputs {res['identical_outputs']}/{res['requests']} (dummy weights: near-tie logits).",
                    "",
                ]
        if phase == "ray" and res.get("points"):
            lines += _table(
                f"Suite {res['suite']} (model {res['model']}) through the sweep:",
                "policy | ratio | batch | decode (tok/s) | KV (MiB) | status",
                [
                    [p["policy"], _fmt(p["compression_ratio"], "g"), p["batch_size"], _fmt(p["decode_tokens_per_s"])]
                    + [_fmt(p["kv_cache_bytes"], ".1f", MIB), p["status"]]
                    for p in res["points"]
                ],
            )
    return "\n".join(lines) + "\n"


def checks_passed(report: dict) -> bool:
    """Every phase ran whole (or was skipped: Ray absent), every library and paged check passed, every max-batch
    run was verified and finished."""
    for name, rec in report["phases"].items():
        if rec["status"] not in ("ok", "skipped"):
            return False
        res = rec.get("result") or {}
        if name in ("library", "paged") and not all(c["passed"] for c in res.get("checks", [])):
            return False
        if name == "max_batch" and not all(r["verified"] and r["finished"] for r in res.get("runs", [])):
            return False
        if name == "engine_vs_generate" and not (res.get("engine") or {}).get("finished"):
            return False
    return True


def write_report(out: Path, report: dict) -> None:
    _write_json(out / "gpu_check.json", report)
    (out / "gpu_check.md").write_text(render_markdown(report))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase is not None:
        return run_phase(args)
    t0 = time.monotonic()
    try:
        env = environment(args.device)
    except NoGPU as e:
        print(f"gpu-check: error: {e}", file=sys.stderr)
        return 2
    if "gpu" in env:
        g = env["gpu"]
        print(
            f"gpu-check: {g['name']} ({g['total_bytes'] / GIB:.0f} GiB, driver {g['driver']}), torch {g['torch']}, "
            f"CUDA {g['cuda']}",
            file=sys.stderr,
        )
    out = Path(
        args.out
        or os.environ.get("OUT")
        or REPO_ROOT / "results" / f"gpu-check-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    )
    out.mkdir(parents=True, exist_ok=True)

    a = {k: v for k, v in vars(args).items() if k not in ("phase", "phase_dir")}
    report = {
        "schema_version": SCHEMA_VERSION,
        "weights": "dummy",
        "model": args.model,
        "model_id": DUMMY_MODEL_IDS[args.model],
        "args": a,
        "environment": env,
        "phases": {},
    }
    write_report(out, report)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        tmp_dir = Path(tmp)
        for phase in args.phase_list:
            box = min(PHASE_BOX_S[phase] * args.box_scale, args.budget_s - (time.monotonic() - t0))
            if phase == "ray" and not ray_importable():
                report["phases"][phase] = {"status": "skipped", "reason": "Ray is not importable here"}
            elif box < 2 * PHASE_MARGIN_S:
                report["phases"][phase] = {"status": "not run", "reason": f"the {args.budget_s:g} s budget is spent"}
            else:
                print(f"gpu-check: phase {phase} (box {box:.0f} s) ...", file=sys.stderr, flush=True)
                if phase == "ray":
                    report["phases"][phase] = _ray_phase(args, tmp_dir, box)
                else:
                    report["phases"][phase] = _phase_subprocess(phase, tmp_dir, a, box)
            report["elapsed_s"] = time.monotonic() - t0
            write_report(out, report)
            print(f"gpu-check: phase {phase}: {report['phases'][phase]['status']}", file=sys.stderr, flush=True)
    report["passed"] = checks_passed(report)
    report["elapsed_s"] = time.monotonic() - t0
    write_report(out, report)
    print(render_markdown(report), end="")
    print(
        f"gpu-check: {report['elapsed_s']:.0f} s; {'passed' if report['passed'] else 'NOT passed'}; wrote "
        f"{out / 'gpu_check.json'} and {out / 'gpu_check.md'}",
        file=sys.stderr,
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
