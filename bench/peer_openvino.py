"""The peer side of ``bench.bench_peers``: OpenVINO GenAI's ``ContinuousBatchingPipeline`` runs the same requests.

    <openvino venv>/bin/python bench/peer_openvino.py job.json out.json
    <openvino venv>/bin/python bench/peer_openvino.py --probe <exported model folder>

Runs as a plain script under the interpreter of the virtualenv ``make openvino-peer`` builds (``.cache/venv-openvino``:
openvino-genai, and optimum-intel for the one-time export, which pins an older transformers than ours), so it imports
the standard library, numpy, openvino and openvino_genai only, no package of this repository (one standard-library file of it, below); ``parse_job`` and
``blocks_for`` import nothing outside the standard library (the eviction check and block arithmetic are
``replica/openvino_settings.py``'s, loaded by its path, shared with the replica's OpenVINO backend), so our tests call them from our venv.

Job (JSON), checked by :func:`parse_job`:

* ``model_dir``: the exported OpenVINO model (``openvino_model.xml``, from ``optimum-cli export openvino``);
* ``threads`` (``INFERENCE_NUM_THREADS``), ``inference_precision`` (``INFERENCE_PRECISION_HINT``: ``f32``, ``bf16``,
  ``f16``), ``block_tokens`` (the plugin's KV block: 32 tokens on this CPU plugin);
* ``requests``: ``[{"id": str, "prompt_ids": [int, ...], "max_new_tokens": int}]``, greedy, EOS ignored, all added
  at once (``add_request``) and stepped (``step()``) until none is left;
* ``runs``: ``[{"label", "kv_precision" (KV_CACHE_PRECISION: u8, bf16, f16, f32), "kv_limit_bytes",
  "max_num_batched_tokens", "dynamic_split_fuse", "max_num_seqs", "eviction"}]``; ``eviction`` is null (full cache)
  or ``{"start_size", "recent_size", "max_cache_size", "aggregation_mode" (SUM, NORM_SUM)}`` in tokens
  (``CacheEvictionConfig``; each a multiple of ``block_tokens``, ``max_cache_size > start_size + recent_size``).

The KV limit in bytes becomes ``num_kv_blocks = kv_limit_bytes // block_bytes`` (:func:`blocks_for`), where
``block_bytes`` is measured, not assumed: a pipeline of 2 blocks at that KV precision runs one token and reports its
pool's bytes (``PipelineMetrics.kv_cache_size_in_bytes``; u8 blocks carry their scales and zero points).

Output (JSON): ``versions`` and, per run label, ``ok``, ``error`` (the peer's message), ``num_kv_blocks``,
``block_bytes``, ``kv_cache_bytes``, ``kv_token_slots``, ``wall_s``, ``cpu_s`` (this process, every thread),
``output_tokens``, ``output_tok_per_s``, ``max_cache_usage`` (percent of the pool), and per request id
``output_ids``, ``ttft_s`` (from the first ``add_request``), ``done_s``, ``error``. A run that raises (a bad setting,
or the pipeline failing mid-run, e.g. "Total number of aggregated SnapKV scores ...") is a failed run whose
unfinished requests carry the peer's message; the next run still runs. Exit 2: bad usage or job.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version


def _load_settings():
    """``replica/openvino_settings.py`` loaded by its path: the one copy of the eviction check and the block
    arithmetic, without running ``replica/__init__`` (this script imports no package of ours, whose imports need
    torch)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "replica", "openvino_settings.py")
    spec = importlib.util.spec_from_file_location("openvino_settings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_settings = _load_settings()
KV_PRECISIONS = _settings.KV_PRECISIONS
AGGREGATION_MODES = _settings.AGGREGATION_MODES
blocks_for = _settings.blocks_for
_choice = _settings.check_choice
_eviction = _settings.check_eviction
INFERENCE_PRECISIONS = ("f32", "bf16", "f16")
PROBE_BLOCKS = 2
VERSION_PACKAGES = ("openvino-genai", "openvino", "optimum-intel", "transformers")


def _int(where: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: expected an integer >= {low}, got {value!r}")
    return value


def parse_job(doc: dict) -> dict:
    """The job with every field checked and normalised (the module docstring lists them).

    Raises:
        ValueError: a missing or bad field; the message names it (``runs[1].kv_precision``) and what it accepts.
    """
    if not isinstance(doc, dict):
        raise ValueError(f"job: expected a mapping, got {type(doc).__name__}")
    for key in ("model_dir", "threads", "inference_precision", "block_tokens", "requests", "runs"):
        if key not in doc:
            raise ValueError(f"job: missing {key!r}")
    block = _int("block_tokens", doc["block_tokens"], 1)
    job = {
        "model_dir": str(doc["model_dir"]),
        "threads": _int("threads", doc["threads"], 1),
        "inference_precision": _choice("inference_precision", doc["inference_precision"], INFERENCE_PRECISIONS),
        "block_tokens": block,
        "requests": [],
        "runs": [],
    }
    if not isinstance(doc["requests"], list) or not doc["requests"]:
        raise ValueError("requests: expected a non-empty list")
    for i, r in enumerate(doc["requests"]):
        ids = r.get("prompt_ids") if isinstance(r, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"requests[{i}].prompt_ids: expected a non-empty list of token ids (integers >= 0)")
        job["requests"].append(
            {
                "id": str(r.get("id", i)),
                "prompt_ids": ids,
                "max_new_tokens": _int(f"requests[{i}].max_new_tokens", r.get("max_new_tokens"), 1),
            }
        )
    if len({r["id"] for r in job["requests"]}) != len(job["requests"]):
        raise ValueError("requests: the ids repeat; each request needs its own")
    if not isinstance(doc["runs"], list) or not doc["runs"]:
        raise ValueError("runs: expected a non-empty list")
    for i, run in enumerate(doc["runs"]):
        w = f"runs[{i}]"
        if not isinstance(run, dict) or not isinstance(run.get("label"), str) or not run["label"]:
            raise ValueError(f"{w}.label: expected a non-empty string")
        if not isinstance(run.get("dynamic_split_fuse", True), bool):
            raise ValueError(f"{w}.dynamic_split_fuse: expected true or false, got {run['dynamic_split_fuse']!r}")
        job["runs"].append(
            {
                "label": run["label"],
                "kv_precision": _choice(f"{w}.kv_precision", run.get("kv_precision"), KV_PRECISIONS),
                "kv_limit_bytes": _int(f"{w}.kv_limit_bytes", run.get("kv_limit_bytes"), 1),
                "max_num_batched_tokens": _int(f"{w}.max_num_batched_tokens", run.get("max_num_batched_tokens"), 1),
                "dynamic_split_fuse": run.get("dynamic_split_fuse", True),
                "max_num_seqs": _int(f"{w}.max_num_seqs", run.get("max_num_seqs", 256), 1),
                "eviction": _eviction(f"{w}.eviction", run.get("eviction"), block),
            }
        )
    if len({r["label"] for r in job["runs"]}) != len(job["runs"]):
        raise ValueError("runs: the labels repeat; each run needs its own")
    return job


def versions() -> dict:
    """Installed versions of the peer's packages (None where one is absent)."""
    out = {}
    for name in VERSION_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


class Peer:
    """One model folder, threads and inference precision; builds a pipeline per run (``ov_genai`` the module)."""

    def __init__(self, job: dict, ov_genai, ov, np):
        self.job, self.g, self.ov, self.np = job, ov_genai, ov, np
        self._block_bytes: dict[str, int] = {}

    def pipeline(self, kv_precision: str, num_kv_blocks: int, run: dict | None = None):
        run = run or {}
        sc = self.g.SchedulerConfig()
        sc.num_kv_blocks = num_kv_blocks
        sc.cache_size = 0
        sc.enable_prefix_caching = False  # ours has no prefix cache in these rows
        sc.max_num_batched_tokens = run.get("max_num_batched_tokens", 256)
        sc.dynamic_split_fuse = run.get("dynamic_split_fuse", True)
        sc.max_num_seqs = run.get("max_num_seqs", 256)
        ev = run.get("eviction")
        if ev is not None:
            sc.use_cache_eviction = True
            sc.cache_eviction_config = self.g.CacheEvictionConfig(
                ev["start_size"],
                ev["recent_size"],
                ev["max_cache_size"],
                getattr(self.g.AggregationMode, ev["aggregation_mode"]),
            )
        props = {
            "INFERENCE_NUM_THREADS": self.job["threads"],
            "INFERENCE_PRECISION_HINT": self.job["inference_precision"],
            "KV_CACHE_PRECISION": kv_precision,
        }
        return self.g.ContinuousBatchingPipeline(self.job["model_dir"], sc, "CPU", props)

    def config(self, max_new_tokens: int):
        gc = self.g.GenerationConfig()
        gc.max_new_tokens = max_new_tokens
        gc.ignore_eos = True
        gc.do_sample = False
        return gc

    def ids(self, prompt_ids: list[int]):
        return self.ov.Tensor(self.np.array([prompt_ids], dtype=self.np.int64))

    def block_bytes(self, kv_precision: str) -> int:
        """Bytes of one KV block (all layers) at ``kv_precision``, measured on a pool of ``PROBE_BLOCKS``."""
        if kv_precision not in self._block_bytes:
            pipe = self.pipeline(kv_precision, PROBE_BLOCKS)
            pipe.add_request(0, self.ids(self.job["requests"][0]["prompt_ids"][:4]), self.config(1))
            while pipe.has_non_finished_requests():
                pipe.step()
            total = int(pipe.get_metrics().kv_cache_size_in_bytes)
            if total <= 0:
                raise RuntimeError(f"the pipeline reported {total} KV cache bytes for {PROBE_BLOCKS} blocks")
            self._block_bytes[kv_precision] = total // PROBE_BLOCKS
        return self._block_bytes[kv_precision]

    def run(self, run: dict) -> dict:
        """One run over every request of the job (all added at once); never raises: a failure is recorded."""
        out = {"label": run["label"], "ok": False, "error": None, "requests": {}}
        reqs = self.job["requests"]
        state = {r["id"]: {"output_ids": [], "ttft_s": None, "done_s": None, "error": None} for r in reqs}
        out["requests"] = state
        try:
            block_bytes = self.block_bytes(run["kv_precision"])
            blocks = blocks_for(run["kv_limit_bytes"], block_bytes)
            out.update(
                block_bytes=block_bytes,
                num_kv_blocks=blocks,
                kv_cache_bytes=blocks * block_bytes,
                kv_token_slots=blocks * self.job["block_tokens"],
            )
            pipe = self.pipeline(run["kv_precision"], blocks, run)
            warm = pipe.add_request(0, self.ids(reqs[0]["prompt_ids"][:32]), self.config(2))
            while pipe.has_non_finished_requests():
                pipe.step()
            warm.read_all()
            self._measure(pipe, reqs, state, out)
        except Exception as e:  # noqa: BLE001 - the peer's own message becomes the run's and its unfinished requests' error
            out["error"] = f"{type(e).__name__}: {e}"
            for s in state.values():
                if s["done_s"] is None and s["error"] is None:
                    s["error"] = out["error"]
        return out

    def _measure(self, pipe, reqs: list[dict], state: dict, out: dict) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        handles = {
            r["id"]: pipe.add_request(i + 1, self.ids(r["prompt_ids"]), self.config(r["max_new_tokens"]))
            for i, r in enumerate(reqs)
        }
        max_usage = 0.0
        finished = self.g.GenerationStatus.FINISHED
        running = self.g.GenerationStatus.RUNNING
        while pipe.has_non_finished_requests():
            pipe.step()
            now = time.perf_counter() - t0
            max_usage = max(max_usage, float(pipe.get_metrics().cache_usage))
            for rid, h in handles.items():
                s = state[rid]
                if s["done_s"] is not None or s["error"] is not None:
                    continue
                if h.can_read():
                    for seq in h.read().values():
                        s["output_ids"] += list(seq.generated_ids)
                    if s["output_ids"] and s["ttft_s"] is None:
                        s["ttft_s"] = now
                status = h.get_status()
                if status == finished:
                    s["done_s"] = now
                elif status != running:
                    s["error"] = f"the pipeline ended the request with status {status.name}"
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        for rid, s in state.items():
            if s["done_s"] is None and s["error"] is None:
                s["error"] = "the pipeline had no unfinished requests left, but this one never finished"
        tokens = sum(len(s["output_ids"]) for s in state.values())
        failed = [rid for rid, s in state.items() if s["error"] is not None]
        out.update(
            ok=not failed,
            error=f"{len(failed)} of {len(state)} requests failed: {state[failed[0]]['error']}" if failed else None,
            wall_s=wall,
            cpu_s=cpu,
            output_tokens=tokens,
            output_tok_per_s=tokens / wall if wall > 0 else None,
            max_cache_usage=max_usage,
        )


def probe(model_dir: str) -> int:
    """``--probe``: the runtime imports and the export is complete; prints versions as JSON. Exit 3 otherwise."""
    try:
        import openvino_genai  # noqa: F401  (third-party, present only in the peer's virtualenv)
    except Exception as e:  # noqa: BLE001 - whatever the import raises, the probe reports it (exit 3)
        print(f"cannot import openvino_genai: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    missing = [
        f
        for f in ("openvino_model.xml", "openvino_model.bin", "config.json")
        if not os.path.isfile(os.path.join(model_dir, f))
    ]
    if missing:
        print(f"the exported model folder {model_dir} lacks {', '.join(missing)}", file=sys.stderr)
        return 3
    print(json.dumps({"versions": versions()}))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--probe":
        return probe(argv[1])
    if len(argv) != 2:
        print("usage: peer_openvino.py job.json out.json | --probe <exported model folder>", file=sys.stderr)
        return 2
    try:
        with open(argv[0], encoding="utf-8") as f:
            job = parse_job(json.load(f))
    except (OSError, ValueError) as e:
        print(f"peer_openvino: bad job {argv[0]}: {e}", file=sys.stderr)
        return 2
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    peer = Peer(job, ov_genai, ov, np)
    out = {"versions": versions(), "runs": {}}
    for run in job["runs"]:
        result = peer.run(run)
        out["runs"][run["label"]] = result
        print(
            f"peer_openvino: {run['label']}: "
            + (f"{result['output_tok_per_s']:.1f} output tok/s" if result["ok"] else f"FAILED: {result['error']}"),
            file=sys.stderr,
            flush=True,
        )
        with open(argv[1], "w", encoding="utf-8") as f:  # after every run: a later crash keeps the runs before it
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
