"""OpenVINO GenAI as an engine backend: its ``ContinuousBatchingPipeline`` in this process, behind the replica's
engine protocol (`replica.backends.EngineBackend`), on the same requests as ours.

``add_request(request_id, input_ids, generation_config)`` returns a handle whose ``read()`` gives the new tokens
after each ``step()``; ``cancel()`` aborts (frees its KV blocks; 2026.4.1's handle has no ``drop``); ``get_metrics()`` gives the pool's usage (percent) and the running
requests. The requests, their answers and their counters are ours (`replica.engine.request_queue.RequestQueue`,
`replica.engine.lifecycle.Lifecycle`), so a reply, a stream and ``stats()`` read as ours do.

Settings (`replica.common.types.EngineConfig`, ``engine: openvino``): policy ``full`` or ``openvino_eviction``
(``CacheEvictionConfig``; its parameters and the ratio's rounding to a 32-token block:
`replica.openvino_settings.eviction_from_policy`); the KV memory limit in the same bytes as ours, as
``num_kv_blocks = limit // block_bytes`` (`replica.openvino_settings.blocks_for`), ``block_bytes`` measured on a
pool of `PROBE_BLOCKS` blocks at ``openvino_kv_precision`` (u8 blocks carry their scales and zero points) as
``bench/peer_openvino.py`` measures it; ``max_num_batched_tokens`` and ``max_batch`` (its ``max_num_seqs``) as ours;
prefix caching off (ours has none in these rows); split-fuse on for the full cache, off under eviction (on, the
2026.4.1 pipeline fails whole batches: "Total number of aggregated SnapKV scores ..."). Threads: this process's
torch threads (``INFERENCE_NUM_THREADS``); compute precision: the replica model's dtype (f32 or bf16).

Its figures, from ``get_metrics()`` (``PipelineMetrics`` of 2026.4.1) after every step, as ours records them (the same
``stats()`` keys and live metrics, `replica.metrics`, labelled ``engine="openvino"``): running sequences are the
requests the step scheduled (``scheduled_requests``); queued ones are ours' queue plus the requests the pipeline holds
unscheduled (``len(handles) - scheduled_requests``: its own waiting queue and the sequences it preempted); KV bytes,
slots and used blocks are ``cache_usage`` (percent of the pool) times the pool. Its ``max_cache_usage`` and
``avg_cache_usage`` span the pipeline's life, not a point, so peaks are ours, over the steps of the point.

What it does not report is None in ``stats()`` and named in ``not_reported`` (and absent from the live metrics,
never zero): ``preemptions`` and ``recomputed_tokens`` (the pipeline keeps no count), ``slot_bytes`` (its blocks
are per layer, all heads), ``prefill_s`` / ``decode_s`` (one fused step does both); evicted tokens are not counted
either.

A pipeline that raises, in ``step()``, while its output is read (``read()``, ``get_status()``, ``get_metrics()``)
or while it is rebuilt, fails every request it still holds with the pipeline's message (``error_kind`` "error") and
a new pipeline serves the requests that come after: one point's failure never ends a sweep. A request the pipeline
ends itself finishes as "length" at its ``max_new_tokens``, else "eos" (its stop condition; outcome "stop").
"""

from __future__ import annotations

import functools
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable

import torch

from replica.common.types import EngineConfig, GenerationRequest, GenerationResult, Refusal
from replica.engine.lifecycle import Lifecycle, recording
from replica.engine.request_queue import RequestQueue
from replica.engine.requests import Sequence
from replica.metrics import NullMetrics
from replica.openvino_settings import BLOCK_TOKENS, blocks_for, eviction_from_policy

__all__ = [
    "BackendUnavailable",
    "EXPORT_DIR",
    "check_available",
    "OpenVINOEngine",
    "PROBE_BLOCKS",
    "RUNTIME_TARGET",
    "runtime",
]

ROOT = Path(__file__).resolve().parents[2]
#: The embedded model's OpenVINO export (``make openvino-peer``; the Makefile's ``OPENVINO_MODEL``).
EXPORT_DIR = ROOT / ".cache" / "models" / "smollm2-135m-instruct-openvino-fp32"
EXPORT_TARGET = "make openvino-peer"
#: Installs ``openvino-genai`` (no torch) into the replica's virtualenv (the ``openvino`` extra of pyproject.toml).
RUNTIME_TARGET = "make openvino-runtime"
PROBE_BLOCKS = 2
_INFERENCE_PRECISION = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
#: `stats()` keys the pipeline does not report (None there).
NOT_REPORTED = ("preemptions", "recomputed_tokens", "slot_bytes", "prefill_s", "decode_s")


def _cancel(handle) -> None:
    """Stop the pipeline's work on `handle` (2026.4.1's `GenerationHandle.cancel`); a handle that cannot be
    cancelled still has its request answered by the caller, and never stops the other requests."""
    try:
        handle.cancel()
    except Exception:  # noqa: BLE001 - its request is answered anyway; the pipeline drops a finished handle
        pass


class BackendUnavailable(RuntimeError):
    """``engine: openvino`` without its runtime or its model export; the message names the make target."""


def runtime():
    """``(openvino_genai, openvino, numpy)``, imported on first use (third-party, absent from a default install).

    Raises:
        BackendUnavailable: ``openvino_genai`` does not import (the message names `RUNTIME_TARGET`).
    """
    try:
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai
    except ImportError as e:
        raise BackendUnavailable(
            f"engine: 'openvino' needs the openvino-genai runtime in this Python ({RUNTIME_TARGET}): {e}"
        ) from None
    return ov_genai, ov, np


def check_export(model_dir: Path) -> None:
    """Raises BackendUnavailable (naming `EXPORT_TARGET`) when `model_dir` lacks the exported model."""
    missing = [f for f in ("openvino_model.xml", "openvino_model.bin") if not (model_dir / f).is_file()]
    if missing:
        raise BackendUnavailable(
            f"engine: 'openvino' needs the model exported to {model_dir} ({EXPORT_TARGET}); it lacks {', '.join(missing)}"
        )


def check_available(model_spec: str = "embedded") -> None:
    """``engine: openvino`` can run here on `model_spec`: the runtime imports and the embedded model's export exists.

    Raises:
        BackendUnavailable: the runtime or the export is absent, or `model_spec` is not the embedded model (the only
            one exported); the message names the field or the make target.
    """
    if model_spec != "embedded":
        raise BackendUnavailable(
            f"model: engine 'openvino' runs the embedded model's export ({EXPORT_TARGET}); accepted: embedded, "
            f"got {model_spec!r}"
        )
    runtime()
    check_export(EXPORT_DIR)


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=8)
def measured_block_bytes(model_dir: str, kv_precision: str, inference_precision: str, threads: int) -> int:
    """Bytes of one KV block (all layers) at `kv_precision`: a pipeline of `PROBE_BLOCKS` blocks runs one token and
    reports its pool (``PipelineMetrics.kv_cache_size_in_bytes``), as ``bench/peer_openvino.py`` measures it."""
    g, ov, np = runtime()
    sc = g.SchedulerConfig()
    sc.num_kv_blocks, sc.cache_size, sc.enable_prefix_caching = PROBE_BLOCKS, 0, False
    props = {
        "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": inference_precision,
        "KV_CACHE_PRECISION": kv_precision,
    }
    pipe = g.ContinuousBatchingPipeline(model_dir, sc, "CPU", props)
    gc = g.GenerationConfig()
    gc.max_new_tokens, gc.ignore_eos, gc.do_sample = 1, True, False
    pipe.add_request(0, ov.Tensor(np.array([[1, 2, 3, 4]], dtype=np.int64)), gc)
    while pipe.has_non_finished_requests():
        pipe.step()
    total = int(pipe.get_metrics().kv_cache_size_in_bytes)
    if total <= 0:
        raise RuntimeError(f"the pipeline reported {total} KV cache bytes for {PROBE_BLOCKS} blocks")
    return total // PROBE_BLOCKS


class OpenVINOEngine:
    """OpenVINO GenAI's continuous batching behind the replica's engine protocol (see the module docstring).

    Args:
        model: the replica's torch model: its dtype is the compute precision, and a ``kv_limit_full_sequences``
            limit resolves on it (the same bytes as ours).
        config: an `EngineConfig` with ``engine: openvino`` (checked there: policy, parameters, layout, limit).
        eos_token_id, clock, replica_id, metrics: as `ContinuousBatchingEngine`.
        model_dir: the exported OpenVINO model (default `EXPORT_DIR`, the embedded model's).

    Raises:
        BackendUnavailable: the runtime or the export is absent (the message names the make target).
        ValueError: a config this backend cannot run (no KV memory limit, a limit under one block).
    """

    #: No log-probabilities: `ServingReplica.check` refuses a request asking them (kind ``unsupported``).
    gives_logprobs = False

    def __init__(
        self,
        model,
        config: EngineConfig,
        *,
        eos_token_id: int | None = None,
        clock: Callable[[], float] = time.time,
        replica_id: str = "replica-0",
        metrics=None,
        model_dir: str | Path | None = None,
    ):
        if config.engine != "openvino":
            raise ValueError(f"engine: OpenVINOEngine runs engine 'openvino', got {config.engine!r}")
        self.g, self.ov, self.np = runtime()
        self.model_dir = Path(model_dir) if model_dir is not None else EXPORT_DIR
        check_export(self.model_dir)
        self.config, self.eos_token_id, self.clock, self.replica_id = config, eos_token_id, clock, replica_id
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.kv_memory_limit_bytes = config.kv_memory_limit_bytes_on(model, torch.device("cpu"))
        if self.kv_memory_limit_bytes is None:
            raise ValueError("kv_memory_limit: engine 'openvino' sizes its block pool from a KV memory limit; give one")
        dtype = next(model.parameters()).dtype
        self.inference_precision = _INFERENCE_PRECISION.get(dtype, "f32")
        self.threads = torch.get_num_threads()
        self.eviction, self.budget_rounding = (
            eviction_from_policy(config.policy_params, config.compression_ratio, config.max_length_tokens)
            if config.policy == "openvino_eviction"
            else (None, None)
        )
        self.budget_tokens = self.eviction["max_cache_size"] if self.eviction else None
        self.slot_bytes = None
        self.block_bytes = measured_block_bytes(
            str(self.model_dir), config.openvino_kv_precision, self.inference_precision, self.threads
        )
        self.num_kv_blocks = blocks_for(self.kv_memory_limit_bytes, self.block_bytes)
        self.queue = RequestQueue()
        self.life = Lifecycle(clock, self.metrics, eos_token_id, torch.device("cpu"))
        self.handles: dict[str, tuple[Sequence, object]] = {}  # request id -> (its record, the pipeline's handle)
        self._next_id, self._scheduled = 0, 0  # requests the last step ran (state, not a counter: kept by reset)
        self.pipe = self._pipeline()
        self.reset_stats()

    # ------------------------------------------------------------------ the pipeline
    def _pipeline(self):
        g = self.g
        sc = g.SchedulerConfig()
        sc.num_kv_blocks, sc.cache_size = self.num_kv_blocks, 0
        sc.enable_prefix_caching = False  # ours has no prefix cache in these rows
        sc.max_num_batched_tokens = self.config.max_num_batched_tokens
        sc.dynamic_split_fuse = self.eviction is None
        sc.max_num_seqs = self.config.max_batch or 256
        if self.eviction is not None:
            ev = self.eviction
            sc.use_cache_eviction = True
            sc.cache_eviction_config = g.CacheEvictionConfig(
                ev["start_size"],
                ev["recent_size"],
                ev["max_cache_size"],
                getattr(g.AggregationMode, ev["aggregation_mode"]),
            )
        props = {
            "INFERENCE_NUM_THREADS": self.threads,
            "INFERENCE_PRECISION_HINT": self.inference_precision,
            "KV_CACHE_PRECISION": self.config.openvino_kv_precision,
        }
        return g.ContinuousBatchingPipeline(str(self.model_dir), sc, "CPU", props)

    def _generation_config(self, req: GenerationRequest):
        gc = self.g.GenerationConfig()
        gc.max_new_tokens = req.max_new_tokens
        gc.min_new_tokens = req.min_new_tokens
        gc.ignore_eos = req.ignore_eos
        if self.eos_token_id is not None:
            gc.eos_token_id = self.eos_token_id
        gc.do_sample = not req.greedy
        if not req.greedy:
            gc.temperature, gc.top_p = float(req.temperature), float(req.top_p)
            if req.seed is not None:
                gc.rng_seed = int(req.seed) % 2**64
        return gc

    # ------------------------------------------------------------------ the KV limit's answers
    def _blocks(self, tokens: int) -> int:
        return -(-tokens // BLOCK_TOKENS)

    def _final_blocks(self, prompt_tokens: int, max_new_tokens: int) -> int:
        total = prompt_tokens + max_new_tokens
        if self.eviction is None:
            return self._blocks(total)
        # the whole prompt is prefilled before eviction (split-fuse off), then it holds max_cache_size + one block
        return self._blocks(max(prompt_tokens + 1, min(total, self.eviction["max_cache_size"] + BLOCK_TOKENS)))

    def fits_alone(self, prompt_tokens: int, max_new_tokens: int) -> Refusal | None:
        """Why a request of these lengths can never run in the pool, even alone (None: it can): a `Refusal` of kind
        ``kv_memory`` naming the blocks it needs and the pool's (the model's context is `ServingReplica.check`'s)."""
        need = self._final_blocks(prompt_tokens, max_new_tokens)
        if need <= self.num_kv_blocks:
            return None
        return Refusal(
            "kv_memory",
            f"it needs {need} KV blocks of {BLOCK_TOKENS} tokens, the OpenVINO pool holds {self.num_kv_blocks} "
            f"({self.kv_memory_limit_bytes} B at {self.block_bytes} B a block, {self.config.openvino_kv_precision})",
        )

    def max_new_tokens_for(self, prompt_tokens: int, most: int) -> int:
        """The most new tokens (at most `most`) a request of `prompt_tokens` may ask and still run alone in the pool
        (`fits_alone` None); 0: not one. From `_final_blocks`: a request that does not fit at `most` is bounded by
        its whole sequence, ``num_kv_blocks * BLOCK_TOKENS - prompt_tokens`` (under eviction too: it did not fit
        because ``max_cache_size`` plus a block exceeds the pool)."""
        if most < 1 or self.fits_alone(prompt_tokens, most) is None:
            return max(0, most)
        return max(0, min(most, self.num_kv_blocks * BLOCK_TOKENS - prompt_tokens))

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Identical requests whose final blocks the pool holds together (and ``max_batch``)."""
        cap = self.config.max_batch or 1 << 30
        return max(1, min(cap, self.num_kv_blocks // self._final_blocks(prompt_tokens, max_new_tokens)))

    # ------------------------------------------------------------------ submission (any thread)
    def submit(
        self,
        request: GenerationRequest,
        on_done: Callable[[GenerationResult], None],
        on_token: Callable[[int, float], None] | None = None,
    ) -> None:
        """Queue `request` (as `ContinuousBatchingEngine.submit`)."""
        prompt = len(request.prompt_ids)
        result = GenerationResult(request.request_id, prompt, received_time_s=self.clock(), replica_id=self.replica_id)
        unfit = self.fits_alone(prompt, request.max_new_tokens)
        seq = Sequence(request, result, on_done, 0, self.budget_tokens, on_token=on_token, unfit=unfit)
        fault = self.queue.put(seq, lambda: self.life.count(seq, "received"))
        if fault is not None:
            self.life.fail(seq, "error", fault)

    def abort(self, request_id: str) -> None:
        self.queue.end(request_id, "aborted")

    def finish(self, request_id: str) -> None:
        self.queue.end(request_id, "stop")

    @property
    def fault(self) -> str | None:
        return self.queue.fault

    @property
    def healthy(self) -> bool:
        return self.queue.fault is None

    @property
    def running(self) -> int:
        """Sequences the pipeline ran in its last step and still holds (its ``scheduled_requests``)."""
        return min(self._scheduled, len(self.handles))

    @property
    def generated_tokens(self) -> int:
        """Output tokens of measured requests since `reset_stats` (as `ContinuousBatchingEngine.generated_tokens`)."""
        return self.life.counts["tokens"]

    @property
    def queued(self) -> int:
        """Requests waiting: ours not yet handed over, and those the pipeline holds but did not schedule."""
        return len(self.queue) + len(self.handles) - self.running

    def wait_for_work(self, timeout_s: float) -> bool:
        return self.queue.wait_for(lambda: bool(self.handles), timeout_s)

    # ------------------------------------------------------------------ one step (the loop's thread)
    def _apply_ends(self) -> None:
        ends, gone = self.queue.take_ends()
        for rid in ends:
            if rid in self.handles:
                seq, handle = self.handles.pop(rid)
                _cancel(handle)
                gone.append(seq)
        t = self.clock()
        for seq in gone:
            if ends[seq.request.request_id] == "stop":
                self.life.complete(seq, "stop", t)
            else:
                self.life.fail(seq, "aborted", "the client aborted the request")

    def _admit(self) -> None:
        """Hand every waiting request to the pipeline (its scheduler admits them); refuse the unfit and those asking
        what the pipeline cannot give."""
        waiting = self.queue.drain()
        broken = self._ensure_pipeline() if waiting else None
        now = self.clock()
        for seq in waiting:
            req = seq.request
            if seq.unfit is not None:
                self.life.fail(seq, "rejected", f"request cannot run under the KV memory limit: {seq.unfit}")
                continue
            if broken is not None:
                self.life.fail(seq, "error", broken)
                continue
            if req.prompt_logprobs is not None or req.logprobs is not None:
                self.life.fail(seq, "error", "engine 'openvino' gives no log-probabilities (logprobs, prompt_logprobs)")
                continue
            try:
                ids = self.ov.Tensor(self.np.array([req.prompt_ids], dtype=self.np.int64))
                handle = self.pipe.add_request(self._next_id, ids, self._generation_config(req))
            except Exception as e:  # noqa: BLE001 - the pipeline refused this request: it fails alone
                self.life.fail(seq, "error", f"OpenVINO GenAI refused the request: {type(e).__name__}: {e}")
                continue
            self._next_id += 1
            seq.result.admitted_time_s = now
            self.handles[req.request_id] = (seq, handle)

    def step(self) -> bool:
        """Ends asked, admissions, one ``pipeline.step()``, the new tokens answered; False when idle. A pipeline that
        raises, in its step or while its output is read (``read``, ``get_status``, ``get_metrics``), fails the
        requests it still held with its message and is replaced (the engine stays healthy)."""
        self._apply_ends()
        self._admit()
        if not self.handles:
            self._record_state(0.0)
            return False
        t0 = time.perf_counter()
        try:
            self.pipe.step()
        except Exception as e:  # noqa: BLE001 - the peer's failure: its requests fail with its message
            self._replace_pipeline(f"OpenVINO GenAI failed the step: {type(e).__name__}: {e}")
            return True
        self.life.add("steps_s", time.perf_counter() - t0)
        self.life.add("decode_steps")
        try:
            cache_usage, scheduled = self._read_out()
        except Exception as e:  # noqa: BLE001 - as a failed step: only the requests it still held fail
            self._replace_pipeline(f"OpenVINO GenAI failed reading its output: {type(e).__name__}: {e}")
            return True
        self._record_state(cache_usage, scheduled)
        return True

    def _read_out(self) -> tuple[float, int]:
        """Answer the new tokens and the ends of one step; the pool's usage (percent) and the requests the step
        scheduled (``get_metrics()``). A request leaves `handles` as it is answered, so a raise here leaves there
        only the requests not yet answered."""
        t = self.clock()
        finished = self.g.GenerationStatus.FINISHED
        running = self.g.GenerationStatus.RUNNING
        new_tokens = {"measured": 0, "warmup": 0}  # the load generator's warm-up tokens are a series of their own
        for rid, (seq, handle) in list(self.handles.items()):
            done = False
            if handle.can_read():
                for out in handle.read().values():
                    for tok in out.generated_ids:
                        new_tokens["warmup" if seq.request.warmup else "measured"] += 1
                        if self.life.emit(seq, int(tok), t):
                            done = True
                            break
                    if done:
                        break
            if done:  # answered by `emit` (its EOS or its length): only the pipeline's copy is left to cancel
                del self.handles[rid]
                if handle.get_status() == running:
                    handle.cancel()
                continue
            status = handle.get_status()
            if status == finished:  # an end the pipeline saw first: its length, else its stop condition (EOS)
                del self.handles[rid]
                at_length = len(seq.result.output_ids) >= seq.request.max_new_tokens
                self.life.complete(seq, "length" if at_length else "eos", t)
            elif status != running:
                del self.handles[rid]
                self.life.fail(seq, "error", f"OpenVINO GenAI ended the request with status {status.name}")
        with recording():
            for phase, n in new_tokens.items():
                self.metrics.add_generated_tokens(n, phase)
        pm = self.pipe.get_metrics()
        return float(pm.cache_usage), int(pm.scheduled_requests)

    def _replace_pipeline(self, message: str) -> None:
        """Fail every request the pipeline holds with `message` and build a new one for the requests after them (a
        build that raises leaves none: `_admit` tries again and fails only the requests it would have held)."""
        held, self.handles = list(self.handles.values()), {}
        for seq, _ in held:
            self.life.fail(seq, "error", message)
        self.pipe = None
        self._ensure_pipeline()
        self._record_state(0.0)

    def _ensure_pipeline(self) -> str | None:
        """Build the pipeline if there is none; why it could not be built (None: there is one)."""
        if self.pipe is None:
            try:
                self.pipe = self._pipeline()
            except Exception as e:  # noqa: BLE001 - the peer's failure: the next requests fail with its message
                return f"OpenVINO GenAI could not rebuild its pipeline: {type(e).__name__}: {e}"
        return None

    def _record_state(self, cache_usage_percent: float, scheduled: int = 0) -> None:
        """After a step: the pool's usage (percent) and the requests the step ran (`scheduled`, its peak batch)."""
        kv_bytes = int(cache_usage_percent / 100 * self.num_kv_blocks * self.block_bytes)
        blocks = round(cache_usage_percent / 100 * self.num_kv_blocks)
        self._kv_bytes, self._blocks_in_use, self._scheduled = kv_bytes, blocks, scheduled
        self.life.track_bytes(kv_bytes)
        self.life.track_running(scheduled)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, blocks)
        self.block_steps += blocks
        with recording():
            self.metrics.set_running(self.running)
            self.metrics.set_queued(self.queued)
            self.metrics.set_kv_cache(kv_bytes, blocks * BLOCK_TOKENS)
            self.metrics.set_kv_blocks(used=blocks, free=self.num_kv_blocks - blocks)

    # ------------------------------------------------------------------ counters
    def reset_stats(self) -> None:
        self.life.reset()
        self.peak_blocks_in_use, self.block_steps = 0, 0
        self._kv_bytes = 0

    def stats(self) -> dict:
        """Counters since `reset_stats`, under `ContinuousBatchingEngine.stats`'s keys (`NOT_REPORTED` None), and the
        pipeline's settings: its version, KV precision, compute precision, threads, blocks and eviction."""
        s = self.life.snapshot()
        queued = self.queued
        steps = s.get("decode_steps", 0)
        return {
            "replica_id": self.replica_id,
            "engine": "openvino",
            "policy": self.config.policy,
            "budget_tokens": self.budget_tokens,
            "budget": self.config.budget,
            "slot_bytes": None,
            "kv_memory_limit_bytes": self.kv_memory_limit_bytes,
            "running_sequences": self.running,
            "queued_requests": queued,
            "peak_running_sequences": self.life.peak_running,
            "peak_kv_cache_bytes": self.life.peak_bytes,
            "kv_cache_bytes": self._kv_bytes,
            **Lifecycle.request_stats(s),
            "prefill_s": None,
            "decode_s": None,
            "kv_layout": "paged",
            "scheduler": "mixed",
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "block_tokens": BLOCK_TOKENS,
            "kv_pool_blocks": self.num_kv_blocks,
            "peak_kv_blocks_in_use": self.peak_blocks_in_use,
            "mean_kv_blocks_in_use": self.block_steps / steps if steps else None,
            "preemptions": None,
            "recomputed_tokens": None,
            "not_reported": list(NOT_REPORTED),
            "openvino_genai_version": _version("openvino-genai"),
            "openvino_kv_precision": self.config.openvino_kv_precision,
            "openvino_inference_precision": self.inference_precision,
            "openvino_threads": self.threads,
            "openvino_block_bytes": self.block_bytes,
            "openvino_eviction": self.eviction,
            "openvino_max_cache_size_rounding": self.budget_rounding,
            "openvino_dynamic_split_fuse": self.eviction is None,
            "openvino_model_dir": str(self.model_dir),
        }

    def abort_all(self, message: str, fault: bool = False) -> int:
        """Fail every queued and running request (`error_kind="error"`); `fault`: refuse every later one."""
        seqs = self.queue.drain(message if fault else None)
        for seq, handle in self.handles.values():
            _cancel(handle)
            seqs.append(seq)
        self.handles = {}
        for seq in seqs:
            self.life.fail(seq, "error", message)
        return len(seqs)

    def stop_on_fault(self, message: str) -> int:
        return self.abort_all(message, fault=True)
