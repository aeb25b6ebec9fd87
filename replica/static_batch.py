"""One model replica: a model + tokenizer that runs static batches with a budgeted KV cache.

`ModelReplica` is a plain class (no Ray here) so it can be unit-tested directly; the Ray actor
`cluster.placement.PlacedReplica` is a thin wrapper around it.

A *point* (one static batch) is a frozen `BatchSpec` (units in the field names): `policy`,
`policy_params`, `compression_ratio`, `budget_tokens`, `batch_size`, `prompt_tokens`, `new_tokens`,
`seed`, `prompt_ids` and `random_ids` (see `BatchSpec`). `workloads.core.suite.Point.spec()` builds it;
it crosses Ray (the Serve handle) as this dataclass, never as a dict.

`run_batch(point)` runs two named phases under `torch.inference_mode()`:
`prefill` (one forward over the prompts, first token = argmax of the last logits) and
`decode_step` (one forward per further token), timing each with a wall clock, and returns
a flat dict of metrics (see `run_batch`).

Live metrics: the replica records into a `replica.metrics.ReplicaMetrics` (through
`ray.util.metrics` inside a Ray actor, in memory otherwise; labels policy, ratio, replica, model
spec, run id): the model load time; per point the running sequences (the batch, then 0), queued
sequences (0: a point is only sent to an idle replica), the prefill forward and one TTFT per
sequence, every decode step (seconds, batch size), the generated tokens and the KV cache's bytes
and slots (layer 0: slots per KV head summed over sequences) after every forward, the evictions
(layer 0, summed over sequences) as they happen, and one TPOT per sequence at the end. That is a
handful of in-memory records per forward, nothing that waits on the device beyond the timer's
own synchronisation. The warm-up and `generate_ids` record nothing.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import psutil
import torch

from replica.metrics import NullMetrics, ReplicaMetrics
from replica.model_loading import TEST_MODEL_NAMES, load_replica_model
from scissorhands import make_cache
from scissorhands.models import EMBEDDED, cpu_model_name, model_id_of


@dataclass(frozen=True)
class BatchSpec:
    """What one static batch run needs (`ModelReplica.run_batch`); units in the names.

    Attributes:
        policy: a key of `scissorhands.POLICIES` (`"full"`, `"scissorhands"`, ...).
        policy_params: keyword arguments of the policy (`recent_window`, `history_window`, ...).
        compression_ratio: budget B = ceil((prompt + new) / ratio); None for `full` or an absolute budget.
        budget_tokens: absolute budget B (slots per KV head); wins over the ratio; None otherwise.
        batch_size: sequences in the batch.
        prompt_tokens: exact prompt length of every sequence (no padding).
        new_tokens: tokens generated greedily per sequence (>= 1).
        seed: prompt selection seed.
        prompt_ids: the prompts, `batch_size` rows of exactly `prompt_tokens` ids; None: built by the
            replica's prompt source (or random ids with `seed` when it has none).
        random_ids: draw random ids with `seed` even when the replica has a prompt source (the warm-up).
    """

    policy: str
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    seed: int = 0
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    compression_ratio: float | None = None
    budget_tokens: int | None = None
    prompt_ids: Sequence[Sequence[int]] | None = None
    random_ids: bool = False


PromptFn = Callable[[Any, int, int, int], list]  # (tokenizer, n, prompt_tokens, seed) -> ids


def _peak_rss_bytes(current_peak: int) -> int:
    return max(current_peak, psutil.Process().memory_info().rss)


@dataclass
class _Timer:
    """Wall-clock timer that waits for queued accelerator work before reading the clock."""

    device: torch.device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class ModelReplica:
    """A model replica that runs static batches with a given KV-cache policy and budget.

    Args:
        model_spec: `"embedded"`, an HF id, a local folder, or a test-only name
            (`TEST_MODEL_NAMES`); ignored when `model` is given.
        dtype: the weights' dtype, one of `scissorhands.models.DTYPE_CHOICES` (default `"auto"`:
            bfloat16 where the device runs it faster, see `resolve_dtype`).
        device: torch device string (`"cpu"`, `"cuda"`).
        replica_id: label recorded with every result.
        num_threads: torch intra-op threads for this process (`torch.set_num_threads`), so that
            several replicas on one machine don't oversubscribe the cores. None keeps torch's.
        model, tokenizer: an already loaded model (injection for tests); tokenizer may be None.
        prompt_fn: `(tokenizer, n, prompt_tokens, seed) -> list[list[int]]` building prompts
            when a point carries no `prompt_ids` and the replica has a tokenizer.
        node_id: the cluster node id to record (the Ray wrapper fills it in).
        warmup: run one tiny prefill + decode at construction so one-time costs don't land in
            the first point.
        run_id: the run whose points this replica serves (label `run_id` of its live metrics).
        metrics: the live-metrics recorder (injection for tests); default a `ReplicaMetrics`
            with this replica's labels (Ray metrics inside an actor, in memory without Ray).
        dtype_reason: why the run chose `dtype` (`cluster.dtype_probe.resolve_run_dtype`, which resolves `auto` once for all
            replicas of a run); recorded in `info()` instead of "forced".

    Raises:
        FileNotFoundError: `model_spec` is a path that does not exist (the message names it).
    """

    def __init__(
        self,
        model_spec: str = "embedded",
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        replica_id: str = "replica-0",
        num_threads: int | None = None,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        prompt_fn: PromptFn | None = None,
        node_id: str | None = None,
        warmup: bool = True,
        run_id: str = "adhoc",
        metrics: ReplicaMetrics | None = None,
        dtype_reason: str | None = None,
    ):
        if num_threads is not None:
            torch.set_num_threads(int(num_threads))
        self.replica_id = replica_id
        self.node_id = node_id
        self.hostname = socket.gethostname()
        self.model_spec = model_spec
        self.device = torch.device(device)
        self.live_metrics = (
            metrics if metrics is not None else ReplicaMetrics("full", None, replica_id, model_spec, run_id)
        )
        if model is None:
            t0 = time.perf_counter()
            model, tokenizer = load_replica_model(model_spec, dtype=dtype, device=device)
            self.live_metrics.observe_model_load(time.perf_counter() - t0)
        if dtype_reason is not None:  # the run resolved `auto` once and says why
            model.scissorhands_dtype_reason = dtype_reason
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_fn = prompt_fn
        self.model_id = self._model_id()
        self.load_peak_rss_bytes = _peak_rss_bytes(0)
        if warmup:
            self._warmup()

    def _model_id(self) -> str:
        if self.model_spec in TEST_MODEL_NAMES:
            return self.model_spec
        name = getattr(self.model.config, "name_or_path", None) or getattr(self.model, "name_or_path", None)
        if self.model_spec == EMBEDDED:
            return model_id_of(EMBEDDED)
        return str(name or self.model_spec)

    def info(self) -> dict:
        """Who this replica is: ids, host and its CPU model, torch threads, model id, peak RSS after loading (bytes)."""
        return {
            "replica_id": self.replica_id,
            "node_id": self.node_id,
            "hostname": self.hostname,
            "cpu_model": cpu_model_name(),
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "model_id": self.model_id,
            "model_spec": self.model_spec,
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "dtype_reason": getattr(self.model, "scissorhands_dtype_reason", "given model"),
            "load_peak_rss_bytes": self.load_peak_rss_bytes,
        }

    def _warmup(self) -> None:
        self.run_batch(BatchSpec(policy="full", batch_size=1, prompt_tokens=8, new_tokens=2, seed=0), _warmup=True)

    # -- prompts --------------------------------------------------------------------------
    def _prompt_ids(self, point: BatchSpec) -> torch.Tensor:
        """Return the prompts as a LongTensor of shape [batch_size, prompt_tokens]."""
        batch, prompt_tokens, seed = int(point.batch_size), int(point.prompt_tokens), int(point.seed)
        ids = point.prompt_ids
        if ids is None and self.tokenizer is not None and self.prompt_fn is not None and not point.random_ids:
            ids = self.prompt_fn(self.tokenizer, batch, prompt_tokens, seed)
        if ids is None:
            # Tokenizer-free path (tiny test models, warm-up): random ids with the point's seed.
            gen = torch.Generator().manual_seed(seed)
            vocab = int(self.model.config.vocab_size)
            return torch.randint(0, vocab, (batch, prompt_tokens), generator=gen).to(self.device)
        if len(ids) != batch or any(len(row) != prompt_tokens for row in ids):
            raise ValueError(
                f"prompt_ids: expected {batch} prompts of exactly {prompt_tokens} tokens, "
                f"got lengths {[len(row) for row in ids]}"
            )
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    # -- cache ----------------------------------------------------------------------------
    def _make_cache(self, point: BatchSpec, max_length: int):
        policy = point.policy
        params = dict(point.policy_params or {})
        if policy == "full":
            return make_cache("full", self.model, **params)
        if point.budget_tokens is not None:
            return make_cache(policy, self.model, budget_tokens=int(point.budget_tokens), **params)
        return make_cache(
            policy, self.model, compression_ratio=point.compression_ratio, max_length=max_length, **params
        )

    # -- the two phases -------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache) -> torch.Tensor:
        """Forward the prompts [batch, prompt] into `cache`; return the first tokens [batch, 1]."""
        return self._greedy_forward(input_ids, attention_mask, cache)

    def decode_step(self, tokens: torch.Tensor, attention_mask: torch.Tensor, cache) -> torch.Tensor:
        """Forward one token per sequence ([batch, 1]); return the next greedy tokens [batch, 1]."""
        return self._greedy_forward(tokens, attention_mask, cache)

    def _greedy_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache) -> torch.Tensor:
        """Forward `input_ids` [batch, n] at absolute positions seen .. seen + n - 1, `seen` being the tokens
        the cache has seen (not the slots it keeps); return the greedy next tokens [batch, 1]."""
        seen = cache.get_seq_length()
        position_ids = torch.arange(seen, seen + input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # [1, n]
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].argmax(dim=-1, keepdim=True)  # [batch, vocab] -> [batch, 1]

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(model, tokenizer, *args, **kwargs)` on this replica's loaded model; return its result.

        A generic hook for work other than timed batches (e.g. the quality evaluation in
        `workloads.quality`), so `cluster` never imports `workloads`. Runs under
        `torch.inference_mode()`; exceptions propagate unchanged.
        """
        with torch.inference_mode():
            return fn(self.model, self.tokenizer, *args, **kwargs)

    def generate_ids(self, point: BatchSpec) -> torch.Tensor:
        """Greedy output ids [batch, new_tokens] of a point (no timing); for checks and tests."""
        return self._run(point)[0]

    def run_batch(self, point: BatchSpec, _warmup: bool = False) -> dict:
        """Run one static batch `point` and return its metrics.

        Returns a dict with: `prefill_s`, `ttft_s` (= prefill; the first token comes from the
        prefill logits), `decode_s` (sum of decode steps), `decode_step_s` (list, one per
        decode step, s), `tpot_s`, `e2e_latency_s`, `decode_tokens_per_s`
        (batch * (new_tokens - 1) / decode_s; None when new_tokens == 1),
        `output_throughput_tok_per_s` (output tokens / e2e), `total_throughput_tok_per_s`
        ((input + output) / e2e), `input_tokens` / `output_tokens` (counted from the id
        tensors actually sent / generated), `kv_cache_bytes` (peak, bookkeeping included),
        `kv_cache_bytes_final`, `budget_tokens` (slots per KV head used; None for `full`),
        `process_cpu_s` (CPU seconds of the process, all threads, over prefill + decode),
        `peak_rss_bytes` (max process RSS sampled during the point), `process_max_rss_bytes`
        (process lifetime max), and the replica's identity (`replica_id`, `node_id`,
        `hostname`, `torch_threads`, `model_id`).

        Raises TypeError when `point` is not a `BatchSpec`; ValueError for a batch, prompt or new-token
        count below 1, `prompt_ids` of the wrong shape, or (from `make_cache`) an invalid policy / budget,
        naming the field.
        """
        _check_spec(point)
        if _warmup:
            point = replace(point, random_ids=True)
        live = NullMetrics() if _warmup else self.live_metrics.for_point(point.policy, point.compression_ratio)
        _, metrics = self._run(point, live)
        return metrics

    def _run(self, point: BatchSpec, live: ReplicaMetrics | NullMetrics = NullMetrics()) -> tuple[torch.Tensor, dict]:
        _check_spec(point)
        batch, prompt_tokens, new_tokens = int(point.batch_size), int(point.prompt_tokens), int(point.new_tokens)
        if batch < 1 or prompt_tokens < 1 or new_tokens < 1:
            raise ValueError("batch_size, prompt_tokens and new_tokens must all be >= 1")
        timer = _Timer(self.device)
        peak_rss = _peak_rss_bytes(0)
        with torch.inference_mode():
            input_ids = self._prompt_ids(point)  # [batch, prompt]
            cache = self._make_cache(point, max_length=prompt_tokens + new_tokens)
            mask = torch.ones(batch, prompt_tokens + new_tokens, dtype=torch.long, device=self.device)
            generated = torch.empty(batch, new_tokens, dtype=torch.long, device=self.device)

            live.set_running(batch)
            live.set_queued(0)
            try:
                cpu0 = time.process_time()
                t0 = timer.now()
                token = self.prefill(input_ids, mask[:, :prompt_tokens], cache)
                t1 = timer.now()
                generated[:, 0:1] = token
                peak_rss = _peak_rss_bytes(peak_rss)
                live.observe_prefill(t1 - t0, tokens=input_ids.numel())
                for _ in range(batch):  # every sequence's first token comes from the prefill
                    live.observe_ttft(t1 - t0)
                evicted = _record_forward(live, cache, batch, 0)

                step_s: list[float] = []
                for i in range(1, new_tokens):
                    ts = timer.now()
                    token = self.decode_step(token, mask[:, : prompt_tokens + i], cache)
                    step_s.append(timer.now() - ts)
                    generated[:, i : i + 1] = token
                    peak_rss = _peak_rss_bytes(peak_rss)
                    live.observe_decode_step(step_s[-1], batch_size=batch)
                    evicted = _record_forward(live, cache, batch, evicted)
                cpu_s = time.process_time() - cpu0
                if new_tokens > 1:
                    tpot_s = sum(step_s) / (new_tokens - 1)
                    for _ in range(batch):  # a static batch: every sequence has the same TPOT
                        live.observe_tpot(tpot_s)
            finally:
                live.set_running(0)
                live.set_kv_cache(0, 0)

        prefill_s = t1 - t0
        decode_s = float(sum(step_s))
        e2e_s = prefill_s + decode_s
        input_count = int(input_ids.numel())
        output_count = int(generated.numel())
        decode_count = batch * (new_tokens - 1)
        metrics = {
            "prefill_s": prefill_s,
            "ttft_s": prefill_s,
            "decode_s": decode_s,
            "decode_step_s": step_s,
            "tpot_s": decode_s / (new_tokens - 1) if new_tokens > 1 else None,
            "e2e_latency_s": e2e_s,
            # CPU seconds of this process (all threads) over prefill + decode; cpu_s / e2e_s well
            # below torch_threads means the replica waited for cores (contention)
            "process_cpu_s": cpu_s,
            "decode_tokens_per_s": decode_count / decode_s if decode_count and decode_s > 0 else None,
            "output_throughput_tok_per_s": output_count / e2e_s if e2e_s > 0 else None,
            "total_throughput_tok_per_s": (input_count + output_count) / e2e_s if e2e_s > 0 else None,
            "input_tokens": input_count,
            "output_tokens": output_count,
            "kv_cache_bytes": int(cache.peak_kv_cache_bytes),
            "kv_cache_bytes_final": int(cache.kv_cache_bytes()),
            "budget_tokens": cache.budget_tokens,
            "cache_seq_length": int(cache.get_seq_length()),
            "peak_rss_bytes": int(peak_rss),
            # ru_maxrss is KiB on Linux
            "process_max_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
            "replica_id": self.replica_id,
            "node_id": self.node_id,
            "hostname": self.hostname,
            "torch_threads": torch.get_num_threads(),
            "model_id": self.model_id,
        }
        return generated, metrics


def _check_spec(point: Any) -> None:
    """Raise TypeError unless `point` is a `BatchSpec` (a dict is no longer accepted)."""
    if not isinstance(point, BatchSpec):
        raise TypeError(f"point: expected a replica.static_batch.BatchSpec, got {type(point).__name__}")


def _record_forward(live: ReplicaMetrics | NullMetrics, cache, batch: int, evicted_before: int) -> int:
    """After one forward: `batch` tokens generated, the cache's bytes and slots, the new evictions.

    Returns the cache's eviction count now (the next call's `evicted_before`).
    """
    live.add_generated_tokens(batch)
    live.set_kv_cache(cache.kv_cache_bytes(), cache.held_tokens())
    evicted = cache.layers[0].evicted_tokens  # layer 0, summed over sequences
    live.add_evictions(evicted - evicted_before)
    return evicted
