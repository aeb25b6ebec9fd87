"""One-command GPU check (`make gpu-check`): the smoke suite on CUDA in bfloat16, then the largest
batch each cache fits in a GPU memory limit.

    python -m cluster.gpu_check [--suite workloads/suites/smoke.yaml] [--memory-limit-gib 8]
                                [--results-dir results] [--run-id ID] [--deadline-s 540]

1. Checks for a CUDA device first and stops with exit status 2 and a message that says what is
   missing (no CUDA build of torch, or no visible GPU), before anything else runs.
2. Runs the suite through the sweep (`python -m workloads.sweep`, one replica on one GPU,
   `device: cuda`, `dtype: bfloat16`), so its points land in `<results>/<run_id>/points.jsonl`
   like any sweep's; prints each point's decode throughput (tok/s) and peak KV bytes.
3. For `full` and every (policy, ratio) of the suite, finds the largest batch of the suite's
   longest prompt + new tokens that runs under a per-process GPU memory cap of
   `--memory-limit-gib` (`torch.cuda.set_per_process_memory_fraction`; weights, KV cache and
   activations all count): doubling, then bisection, each probe a real prefill + decode. Reports
   that batch, its decode throughput and its KV bytes, and writes `gpu_check.json` and
   `gpu_check.md` next to the points.

Exit status: 0 all points ok and every probe finished; 1 a point failed (the sweep's status);
2 no GPU or bad arguments. Stops probing at `--deadline-s` (whole run, default 540 s) and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
MIB = 1024**2


class NoGPU(RuntimeError):
    """No usable CUDA device; the message says what is missing."""


def require_cuda() -> dict:
    """{"name", "total_bytes", "torch", "cuda"} of GPU 0, or NoGPU naming what is missing."""
    import torch

    if torch.version.cuda is None:
        raise NoGPU(
            f"no CUDA GPU: torch {torch.__version__} is a CPU-only build; install a CUDA build "
            "(make install TORCH_SPEC=\"torch==<version> --index-url <your CUDA index>\") on a machine with an NVIDIA GPU"
        )
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise NoGPU(
            f"no CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}; is the NVIDIA driver loaded? try nvidia-smi)"
        )
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "total_bytes": int(props.total_memory), "torch": torch.__version__, "cuda": torch.version.cuda}


def gpu_suite(suite: dict) -> dict:
    """The suite on one GPU: device cuda, bfloat16, one replica holding one GPU."""
    out = dict(suite)
    out.update(device="cuda", dtype="bfloat16", replicas=1, name=f"{suite.get('name', 'suite')}-gpu")
    out["placement"] = {**(suite.get("placement") or {}), "num_gpus": 1}
    return out


def max_fitting_batch(fits: Callable[[int], bool], *, start: int = 1, limit: int = 4096,
                      deadline: float | None = None) -> tuple[int, int, bool]:
    """Largest batch b in [start, limit] with fits(b) True, assuming fits is monotone.

    Doubles from `start` until a batch does not fit (or `limit`), then bisects. Returns
    (best batch or 0 when `start` does not fit, probes run, finished before `deadline`).
    """
    probes = 0
    ok, bad = 0, None
    b = start
    while b <= limit:
        if deadline is not None and time.monotonic() > deadline:
            return ok, probes, False
        probes += 1
        if fits(b):
            ok = b
            b *= 2
        else:
            bad = b
            break
    if bad is None:
        if ok < limit:  # the last doubling jumped past the limit: try the limit itself
            if deadline is not None and time.monotonic() > deadline:
                return ok, probes, False
            probes += 1
            if fits(limit):
                return limit, probes, True
            bad = limit
        else:
            return ok, probes, True
    while bad - ok > 1:
        if deadline is not None and time.monotonic() > deadline:
            return ok, probes, False
        mid = (ok + bad) // 2
        probes += 1
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return ok, probes, True


class MemoryProbe:
    """Runs points on one CUDA replica under a per-process memory cap; keeps the last metrics."""

    def __init__(self, model_spec: str, memory_limit_bytes: int):
        import torch

        from cluster.replica import ModelReplica

        total = torch.cuda.get_device_properties(0).total_memory
        if memory_limit_bytes >= total:
            raise ValueError(f"--memory-limit-gib: {memory_limit_bytes / GIB:.1f} GiB is not below the GPU's "
                             f"{total / GIB:.1f} GiB")
        torch.cuda.set_per_process_memory_fraction(memory_limit_bytes / total, 0)
        self.limit_bytes = memory_limit_bytes
        self.replica = ModelReplica(model_spec, dtype="bfloat16", device="cuda", replica_id="gpu-check")
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.replica.model.parameters())
        self.last: dict | None = None

    def fits(self, point: dict) -> bool:
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(0)
        try:
            metrics = self.replica.run_batch(point)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return False
        except RuntimeError as e:  # some kernels report OOM as a plain RuntimeError
            if "out of memory" not in str(e).lower():
                raise
            torch.cuda.empty_cache()
            return False
        self.last = {**metrics, "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(0))}
        return True


def _points_table(records: list[dict]) -> str:
    lines = ["| policy | ratio | batch | decode (tok/s) | KV peak (MiB) | status |", "|---|---|---|---|---|---|"]
    for r in records:
        ratio = "-" if r.get("compression_ratio") is None else f"{r['compression_ratio']:g}"
        tok_s = r.get("decode_tokens_per_s")
        kv = r.get("kv_cache_bytes")
        lines.append(f"| {r['policy']} | {ratio} | {r['batch_size']} | {'-' if tok_s is None else f'{tok_s:,.0f}'} | "
                     f"{'-' if kv is None else f'{kv / MIB:.1f}'} | {r['status']} |")
    return "\n".join(lines) + "\n"


def _max_batch_table(rows: list[dict], limit_bytes: int) -> str:
    lines = [f"Largest batch under a {limit_bytes / GIB:g} GiB GPU memory cap (weights + KV + activations):", "",
             "| policy | ratio | max batch | decode at max (tok/s) | KV at max (MiB) | KV per sequence (MiB) | peak allocated (MiB) | probes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["compression_ratio"] is None else f"{r['compression_ratio']:g}"
        def f(key, scale=1.0, fmt=".1f"):
            v = r.get(key)
            return "-" if v is None else format(v / scale, fmt)
        lines.append(f"| {r['policy']} | {ratio} | {r['max_batch']}{'' if r['finished'] else ' (deadline)'} | "
                     f"{f('decode_tokens_per_s', 1, ',.0f')} | {f('kv_cache_bytes', MIB)} | {f('kv_bytes_per_sequence', MIB, '.2f')} | "
                     f"{f('peak_allocated_bytes', MIB, '.0f')} | {r['probes']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default=str(REPO_ROOT / "workloads" / "suites" / "smoke.yaml"))
    p.add_argument("--memory-limit-gib", type=float, default=8.0, help="GPU memory cap of the max-batch search (GiB)")
    p.add_argument("--max-batch", type=int, default=4096, help="largest batch tried")
    p.add_argument("--results-dir", default=str(REPO_ROOT / "results"))
    p.add_argument("--run-id", default=None)
    p.add_argument("--deadline-s", type=float, default=540.0, help="stop probing after this long (whole run)")
    args = p.parse_args(argv)
    if args.memory_limit_gib <= 0:
        p.error("--memory-limit-gib: must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.deadline_s
    try:
        gpu = require_cuda()
    except NoGPU as e:
        print(f"gpu-check: error: {e}", file=sys.stderr)
        return 2
    print(f"gpu-check: {gpu['name']} ({gpu['total_bytes'] / GIB:.0f} GiB), torch {gpu['torch']}, CUDA {gpu['cuda']}",
          file=sys.stderr)
    import yaml

    with open(args.suite, encoding="utf-8") as f:
        suite = gpu_suite(yaml.safe_load(f))
    run_id = args.run_id or f"gpu-check-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    results = Path(args.results_dir)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        suite_path = Path(tmp) / "suite.yaml"
        suite_path.write_text(yaml.safe_dump(suite, sort_keys=False))
        cmd = [sys.executable, "-m", "workloads.sweep", str(suite_path), "--results-dir", str(results), "--run-id", run_id]
        print("gpu-check: " + " ".join(cmd), file=sys.stderr)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        try:
            sweep_rc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, timeout=max(60.0, deadline - time.monotonic())).returncode
        except subprocess.TimeoutExpired:
            print(f"gpu-check: the sweep passed the {args.deadline_s:g} s deadline", file=sys.stderr)
            sweep_rc = 1
    run_dir = results / run_id
    points_file = run_dir / "points.jsonl"
    records = [json.loads(line) for line in points_file.read_text().splitlines()] if points_file.exists() else []
    print(_points_table(records), end="")

    prompt, new = max(suite["prompt_tokens"]), max(suite["new_tokens"])
    cases = [("full", None)] + [(p if isinstance(p, str) else p["name"], float(r))
                                for p in suite["policies"] if (p if isinstance(p, str) else p["name"]) != "full"
                                for r in suite.get("compression_ratios") or []]
    probe = MemoryProbe(suite.get("model", "embedded"), int(args.memory_limit_gib * GIB))
    rows, all_finished = [], True
    for policy, ratio in cases:
        def point(b: int) -> dict:
            return {"policy": policy, "compression_ratio": ratio, "batch_size": b, "prompt_tokens": prompt,
                    "new_tokens": new, "seed": 0, "policy_params": {}}

        best_metrics: dict = {}

        def fits(b: int) -> bool:
            ok = probe.fits(point(b))
            if ok:
                best_metrics[b] = probe.last
            return ok

        best, probes, finished = max_fitting_batch(fits, limit=args.max_batch, deadline=deadline)
        all_finished &= finished
        m = best_metrics.get(best) or {}
        rows.append({"policy": policy, "compression_ratio": ratio, "max_batch": best, "probes": probes,
                     "finished": finished, "prompt_tokens": prompt, "new_tokens": new,
                     "decode_tokens_per_s": m.get("decode_tokens_per_s"), "kv_cache_bytes": m.get("kv_cache_bytes"),
                     "kv_bytes_per_sequence": (m["kv_cache_bytes"] / best) if best and m.get("kv_cache_bytes") else None,
                     "peak_allocated_bytes": m.get("peak_allocated_bytes")})
        print(f"gpu-check: {policy} {'' if ratio is None else f'{ratio:g}x '}max batch {best} "
              f"({probes} probes{'' if finished else ', deadline reached'})", file=sys.stderr)
    table = _max_batch_table(rows, probe.limit_bytes)
    print(table, end="")
    run_dir.mkdir(parents=True, exist_ok=True)
    report = {"run_id": run_id, "gpu": gpu, "memory_limit_bytes": probe.limit_bytes, "weight_bytes": probe.weight_bytes,
              "sweep_exit_code": sweep_rc, "points": len(records), "max_batch": rows,
              "elapsed_s": time.monotonic() - t0}
    (run_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    (run_dir / "gpu_check.md").write_text(_points_table(records) + "\n" + table)
    print(f"gpu-check: {time.monotonic() - t0:.0f} s; wrote {run_dir}/gpu_check.json and gpu_check.md", file=sys.stderr)
    if sweep_rc != 0 or not records or any(r["status"] != "ok" for r in records):
        return 1
    return 0 if all_finished and all(r["max_batch"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
