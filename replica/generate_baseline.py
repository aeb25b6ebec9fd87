"""Timed runs of our engine (`run_engines`) and of the transformers baselines it is measured against:
`run_generate` (transformers' own `generate`, sdpa attention + `DynamicCache`, static batches of left-padded
prompts, each batch run to its longest output) and `run_generate_batch` (transformers' continuous batching,
`model.generate_batch`'s engine: its own paged cache, sized to a KV memory limit with
`generate_batch_cache_blocks`).

Used by `bench/bench_serving.py`, `workloads/frontier/point.py` and `bench/gpu_check.py`, so every
one of them times the engine, and compares it with the same baselines, the same way. Imports torch,
transformers and tqdm only (never Ray); its bars are `replica.progress.MeasuredEtaBar`, whose ETA counts measured items only.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig

from replica.backends import make_engine
from replica.common.types import EngineConfig, GenerationRequest
from replica.progress import MeasuredEtaBar
from scissorhands import ATTN_IMPLEMENTATION
from scissorhands.checks import check_int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engines(
    model,
    runs: Sequence[tuple[EngineConfig, Sequence[GenerationRequest]]],
    *,
    max_steps: int = 10_000_000,
    deadline: float | None = None,
    desc: str | None = "engines",
    raise_on_failed: bool = True,
) -> list[dict]:
    """Run one engine per ``(config, requests)`` on ``model`` (the backend ``config.engine`` names,
    `replica.backends.make_engine`: ours, or OpenVINO GenAI's pipeline), each after a 2-token warm-up, interleaved: one
    `step()` of each busy engine in turn, each engine timed over its own steps (wall and CPU seconds; CUDA is
    synchronised around each step). A slower stretch of a shared machine thus slows every run alike instead
    of whichever happened to run then; an engine that finishes first leaves the others running alone.

    Args:
        max_steps: rounds (one step of each busy engine) before giving up.
        deadline: `time.time()` after which the runs stop: the requests still queued or running are aborted,
            `finished` is False, and the numbers cover the part that ran.
        desc: label of a progress bar (stderr) counting the output tokens generated of those planned (every
            request's ``max_new_tokens``), with the ETA; None: no bar.
        raise_on_failed: a failed request of a finished run raises (the default); False: it is counted in the run's
            `failed_requests` with its message in `errors` (a peer engine that fails a run must not end the others).

    Returns:
        One dict per run: `finished`; `wall_s`, `cpu_s` (its own steps); `output_tokens`, `output_tok_per_s`,
        `output_tok_per_cpu_s` (prefill included); `decode_tokens`, `decode_s`, `decode_tok_per_s` (tokens of
        decode steps / time in decode steps); `prefill_s`; `completed_requests`, `peak_running_sequences`,
        `peak_kv_cache_bytes`, `budget_tokens`, `slot_bytes`, `kv_layout`, `peak_kv_blocks_in_use`,
        `mean_kv_blocks_in_use`, `preemptions`, `recomputed_tokens` (the engine's `stats()`; None where the backend
        does not report one, listed in `not_reported`); `engine` and, on OpenVINO, its ``openvino_*`` settings;
        `scheduler`; `mean_running_sequences` (decode tokens / decode steps); `ttft_p50_s`, `ttft_p99_s`,
        `tpot_p50_s`, `tpot_p99_s`, `itl_p50_s`, `itl_p99_s` (seconds of the run's own steps, every request
        submitted at 0, so TTFT includes its wait in the queue; TPOT over requests of 2 or more tokens; ITL every
        gap between two tokens of a request, pooled; a preempted request's recompute falls in its TPOT and ITL);
        `peak_device_allocated_bytes` (CUDA, over all the runs; None elsewhere); `outputs` (request id ->
        generated ids).

    Raises:
        RuntimeError: a request of a finished run failed (its error), or an engine was still busy after
            ``max_steps`` rounds.
    """
    device = next(model.parameters()).device
    states = []
    for cfg, requests in runs:
        engine = make_engine(model, cfg)
        engine.submit(GenerationRequest("warmup", requests[0].prompt_ids[:32], 2), lambda r: None)
        for _ in range(max_steps):  # `EngineBackend` has step and queued, not ours' run_until_idle
            if not engine.step() and not engine.queued:
                break
        engine.reset_stats()
        done: dict = {}
        st = {"engine": engine, "done": done, "wall_s": 0.0, "cpu_s": 0.0, "busy": True, "t0": 0.0, "tokens": {}}
        for r in requests:
            engine.submit(
                r,
                lambda res, done=done: done.__setitem__(res.request_id, res),
                on_token=lambda _tok, _t, rid=r.request_id, st=st: _token_time(st, rid),
            )
        states.append(st)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    planned = sum(r.max_new_tokens for _, requests in runs for r in requests)
    finished = True
    with MeasuredEtaBar(
        total=planned, desc=desc, unit="tok", file=sys.stderr, dynamic_ncols=True, mininterval=1.0, disable=desc is None
    ) as bar:
        for _ in range(max_steps):
            busy = [st for st in states if st["busy"]]
            if not busy:
                break
            if deadline is not None and time.time() > deadline:
                finished = False
                break
            for st in busy:
                engine = st["engine"]
                _sync(device)
                st["t0"], c0 = time.perf_counter(), time.process_time()
                before = engine.generated_tokens
                st["busy"] = engine.step() or engine.queued > 0
                _sync(device)
                st["wall_s"] += time.perf_counter() - st["t0"]
                st["cpu_s"] += time.process_time() - c0
                bar.update(engine.generated_tokens - before)
        else:
            raise RuntimeError(f"engines still busy after {max_steps} steps")
    peak_device = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return [_engine_result(st, finished or not st["busy"], peak_device, raise_on_failed) for st in states]


def _throughput(finished: bool, wall: float, cpu: float, output_tokens: int) -> dict:
    """The figures every runner here reports: `finished`, `wall_s`, `cpu_s`, `output_tokens`, `output_tok_per_s`,
    `output_tok_per_cpu_s` (None where the time is 0)."""
    return {
        "finished": finished,
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / wall if wall else None,
        "output_tok_per_cpu_s": output_tokens / cpu if cpu else None,
    }


def _token_time(st: dict, request_id: str) -> None:
    """Note a token of `request_id` at the run's own clock (its steps' wall seconds so far, every request
    submitted at 0): [first token's time, last token's time, tokens], and the gap since its previous token."""
    now = st["wall_s"] + time.perf_counter() - st["t0"]
    times = st["tokens"].setdefault(request_id, [now, now, 0])
    if times[2]:
        st.setdefault("itl", []).append(now - times[1])
    times[1], times[2] = now, times[2] + 1


def _latency_percentiles(tokens: dict, itl: list[float]) -> dict:
    """TTFT (first token, queueing included), TPOT ((last - first) / (tokens - 1), requests of 2 or more
    tokens) and ITL (every gap between two tokens of one request, pooled) p50 and p99 in seconds of the run's
    own clock; None where no request qualifies."""
    ttft = [t[0] for t in tokens.values()]
    tpot = [(t[1] - t[0]) / (t[2] - 1) for t in tokens.values() if t[2] > 1]
    out = {}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 99):
            out[f"{name}_p{q}_s"] = float(np.percentile(xs, q)) if xs else None
    return out


def _engine_result(st: dict, finished: bool, peak_device: int | None, raise_on_failed: bool = True) -> dict:
    engine, done, wall, cpu = st["engine"], st["done"], st["wall_s"], st["cpu_s"]
    s = engine.stats()
    if not finished:
        engine.abort_all("the run's deadline passed")
    errors = [r.error for r in done.values() if r.error_kind and finished]
    if errors and raise_on_failed:
        raise RuntimeError(f"engine requests failed: {errors[:3]}")
    out_tok = sum(len(r.output_ids) for r in done.values())
    decode_tok = sum(max(0, len(r.output_ids) - 1) for r in done.values())
    return {
        **_throughput(finished, wall, cpu, out_tok),
        "engine": s.get("engine", "ours"),
        "not_reported": s.get("not_reported", []),
        **{k: v for k, v in s.items() if k.startswith("openvino_")},  # its version, KV precision, threads, blocks
        "decode_tokens": decode_tok,
        "decode_s": s["decode_s"],
        "prefill_s": s["prefill_s"],
        "decode_tok_per_s": decode_tok / s["decode_s"] if s["decode_s"] else None,
        "completed_requests": s["completed_requests"],
        "failed_requests": len(errors),
        "errors": sorted(set(errors))[:3],
        "peak_running_sequences": s["peak_running_sequences"],
        "peak_kv_cache_bytes": s["peak_kv_cache_bytes"],
        "budget_tokens": s["budget_tokens"],
        "slot_bytes": s["slot_bytes"],
        "mean_running_sequences": decode_tok / s["decode_steps"] if s["decode_steps"] else None,
        "kv_layout": s["kv_layout"],
        "peak_kv_blocks_in_use": s["peak_kv_blocks_in_use"],
        "mean_kv_blocks_in_use": s["mean_kv_blocks_in_use"],
        "preemptions": s["preemptions"],
        "recomputed_tokens": s["recomputed_tokens"],
        "peak_device_allocated_bytes": peak_device,
        "scheduler": s["scheduler"],
        **_latency_percentiles(st["tokens"], st.get("itl", [])),
        "outputs": {k: v.output_ids for k, v in done.items()},
    }


def run_generate(
    model,
    requests: Sequence[GenerationRequest],
    batch: int,
    *,
    device: str | torch.device = "cpu",
    deadline: float | None = None,
    on_batch: Callable[[], None] | None = None,
) -> dict:
    """Greedy `model.generate` over `requests`, `batch` at a time, after a 2-token warm-up.

    Args:
        model: a causal LM on `device`; its attention implementation is set to sdpa for the run and
            back to scissorhands' own afterwards.
        requests: prompts (token ids) and `max_new_tokens` each; EOS is ignored, so every batch runs
            to its longest `max_new_tokens`.
        batch: requests per `generate` call.
        device: where the model lives (CUDA is synchronised around the timed part).
        deadline: `time.time()` after which no further batch starts (`finished` is then False).
        on_batch: called after each batch (a progress bar's update).

    Returns:
        `wall_s` and `cpu_s` (this process) of the timed part; `output_tokens`, the useful tokens (what
        each finished request asked for); `output_tok_per_s`, `output_tok_per_cpu_s`;
        `completed_requests`; `finished`; `outputs` (request id -> generated ids, `max_new_tokens` long).
    """
    device = torch.device(device)
    model.set_attn_implementation("sdpa")
    try:
        warm = torch.tensor([requests[0].prompt_ids[:32]], device=device)
        model.generate(
            warm,
            attention_mask=torch.ones_like(warm),
            max_new_tokens=2,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outputs, finished, useful = {}, True, 0
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(requests), batch):
            if deadline is not None and time.time() > deadline:
                finished = False
                break
            chunk = requests[i : i + batch]
            width = max(len(r.prompt_ids) for r in chunk)
            # (b, width) left-padded prompts and their mask, as a transformers user batches them
            ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + r.prompt_ids for r in chunk], device=device)
            mask = torch.tensor(
                [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in chunk], device=device
            )
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    cache=DynamicCache(config=model.config),
                    max_new_tokens=max(r.max_new_tokens for r in chunk),
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            for r, row in zip(chunk, out[:, width:].tolist()):
                outputs[r.request_id] = row[: r.max_new_tokens]  # useful tokens: what the request asked for
                useful += r.max_new_tokens
            if on_batch is not None:
                on_batch()
        _sync(device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return {
        **_throughput(finished, wall, cpu, useful),
        "completed_requests": len(outputs),
        "outputs": outputs,
    }


def generate_batch_cache_blocks(model, kv_memory_limit_bytes: int, page_tokens: int) -> tuple[int, int]:
    """Blocks of transformers' continuous-batching cache that fit in `kv_memory_limit_bytes`, and the bytes of one.

    A block of that cache (`transformers.generation.continuous_batching.PagedAttentionCache`) holds the keys and
    values of `page_tokens` tokens in every layer: ``layers * 2 * kv_heads * head_dim * itemsize * page_tokens``
    bytes in the model's dtype, and nothing else (no per-slot bookkeeping). So the blocks are
    ``kv_memory_limit_bytes // block_bytes``: the limit's bytes, all keys and values. Our engine's pool charges each
    slot its bookkeeping too (`ContinuousBatchingEngine.block_bytes`), so under one limit the peer holds a few percent
    more tokens than our paged rows (SmolLM2-135M in float32: 46,440 B a slot against 46,080).

    Raises:
        ValueError: the limit holds no block, or `page_tokens` below 4 (transformers' own lower bound).
    """
    check_int("page_tokens", page_tokens, 4)
    text = model.config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    block_bytes = int(text.num_hidden_layers) * 2 * int(kv_heads) * int(head_dim) * model.dtype.itemsize * page_tokens
    blocks = kv_memory_limit_bytes // block_bytes
    if blocks < 1:
        raise ValueError(
            f"kv_memory_limit_bytes: {kv_memory_limit_bytes} bytes hold no block of transformers' paged cache "
            f"({page_tokens} tokens of every layer: {block_bytes} bytes)"
        )
    return blocks, block_bytes


def run_generate_batch(
    model,
    requests: Sequence[GenerationRequest],
    *,
    kv_memory_limit_bytes: int,
    page_tokens: int = 16,
    max_batch_tokens: int = EngineConfig.model_fields["max_prefill_tokens"].default,
    attn_implementation: str = "sdpa",
    deadline: float | None = None,
    desc: str | None = "generate_batch",
) -> dict:
    """Greedy generation of `requests` by transformers' continuous batching (the engine behind
    `model.generate_batch`: its paged cache, its scheduler, its preemption), after a 2-token warm-up request.

    Driven through its manager (`model.init_continuous_batching`), as `generate_batch` drives it, so each request
    keeps its own `max_new_tokens` (`generate_batch` takes one for all). All requests are submitted at once, EOS
    disabled, so each runs to its `max_new_tokens`. Its cache gets ``generate_batch_cache_blocks`` blocks of
    `page_tokens` tokens (`ContinuousBatchingConfig.num_blocks`, `page_size`); prefix sharing is off (our engine
    has none, and the prompts share no prefix); `max_batch_tokens` (tokens of one forward) defaults to our engine's
    `max_prefill_tokens`; its generation thread runs in inference mode, as our engine's steps do. Timed from the first submission to the last result (wall and this process's CPU
    seconds, its generation thread included); it runs in a thread of its own, so it cannot be interleaved step by
    step with `run_engines`.

    Args:
        model: a causal LM; its attention implementation is `attn_implementation` (``"sdpa"``, or transformers'
            ``"paged|eager"``) for the run and scissorhands' own afterwards.
        requests: prompts (token ids) and `max_new_tokens` each.
        deadline: `time.time()` after which the run stops (`finished` False; the numbers cover the requests done).
        desc: label of a progress bar (stderr) of output tokens done of those planned, updated as requests
            finish; None: no bar.

    Returns:
        `finished`, `wall_s`, `cpu_s`, `output_tokens`, `output_tok_per_s`, `output_tok_per_cpu_s`,
        `completed_requests`, `outputs` (request id -> generated ids), and the cache it built: `kv_cache_blocks`,
        `page_tokens`, `kv_cache_bytes` (its blocks' bytes; the cache tensor adds two never-allocated padding
        blocks, `kv_cache_tensor_bytes`), `max_batch_tokens`, `attn_implementation`.

    Raises:
        RuntimeError: a request failed, or transformers' generation loop stopped.
        ValueError: the limit holds no block (`generate_batch_cache_blocks`).
    """
    device = next(model.parameters()).device
    blocks, _ = generate_batch_cache_blocks(model, kv_memory_limit_bytes, page_tokens)
    gen_config = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(r.max_new_tokens for r in requests)
    )
    cb_config = ContinuousBatchingConfig(
        page_size=page_tokens,
        num_blocks=blocks,
        max_batch_tokens=max_batch_tokens,
        allow_block_sharing=False,
        auto_switch_to_flash=False,
        seed=0,
    )
    model.set_attn_implementation(attn_implementation)
    manager = None
    try:
        manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
        with torch.inference_mode():  # its generation thread takes the caller's mode, as our engine runs
            manager.start()
        manager.add_request(requests[0].prompt_ids[:32], request_id="warmup", max_new_tokens=2, eos_token_id=-1)
        _collect(manager, {"warmup"}, {}, None, None)
        cache = manager.batch_processor.cache  # built by the generation thread before the warm-up ran
        outputs: dict[str, list[int]] = {}
        planned = sum(r.max_new_tokens for r in requests)
        with MeasuredEtaBar(
            total=planned,
            desc=desc,
            unit="tok",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=1.0,
            disable=desc is None,
        ) as bar:
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            for r in requests:
                manager.add_request(
                    r.prompt_ids, request_id=r.request_id, max_new_tokens=r.max_new_tokens, eos_token_id=-1
                )
            finished = _collect(manager, {r.request_id for r in requests}, outputs, deadline, bar.update)
            _sync(device)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        if manager is not None:
            manager.stop(block=True, hard_stop=True)  # nothing left to flush: every request ended or is dropped
            manager.destroy()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    out_tok = sum(len(v) for v in outputs.values())
    return {
        **_throughput(finished, wall, cpu, out_tok),
        "completed_requests": len(outputs),
        "outputs": outputs,
        "kv_cache_blocks": int(cache.num_blocks),
        "page_tokens": page_tokens,
        "kv_cache_bytes": int(cache.num_sectors * cache.bytes_per_sector),
        "kv_cache_tensor_bytes": int(cache.cache_tensor.numel() * cache.cache_tensor.element_size()),
        "max_batch_tokens": int(cache.max_batch_tokens),
        "attn_implementation": attn_implementation,
    }


def _collect(manager, pending: set[str], outputs: dict, deadline: float | None, on_tokens) -> bool:
    """Wait for the finished results of `pending` (request ids) into `outputs`; False when `deadline` passed first.
    Raises RuntimeError for a failed request or a generation loop that stopped."""
    pending = set(pending)
    while pending:
        if deadline is not None and time.time() > deadline:
            return False
        res = manager.get_result(timeout=0.5)
        if res is None:
            if not manager.is_running():
                error = getattr(manager.background_thread_status, "fatal_error", None)
                raise RuntimeError(f"transformers' continuous batching loop stopped: {error}")
            continue
        if not res.is_finished() or res.request_id not in pending:
            continue
        if res.error is not None:
            raise RuntimeError(f"generate_batch request {res.request_id} failed: {res.error}")
        outputs[res.request_id] = list(res.generated_tokens)
        pending.discard(res.request_id)
        if on_tokens is not None:
            on_tokens(len(res.generated_tokens))
    return True
