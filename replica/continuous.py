"""A replica that serves requests with continuous batching (plain class; Serve wrapper in `cluster.serve_app`).

`ServingReplica` owns a model and, once `configure`d, an engine (the backend ``EngineConfig.engine`` names,
`replica.backends.BACKENDS`: ours, `ContinuousBatchingEngine`, or OpenVINO GenAI's) stepping on its own thread
(`EngineLoop`). `generate(request)` is a coroutine: it queues the request and resolves
to its `GenerationResult` when the engine thread finishes it, so the caller's event loop never runs
model code and health calls (`health`, `stats`) are answered while a batch is generating.
`events(request)` streams the same request as typed `StreamChunk`s ended by its `GenerationResult`;
`stream(request)` is that stream in the OpenAI API's event form (`openai_event`, read by `replica.openai_api`).
"""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator

import torch

from replica.backends import EngineBackend, make_engine
from replica.common.types import EngineConfig, GenerationRequest, GenerationResult, Refusal
from replica.engine import EngineLoop
from replica.metrics import ReplicaMetrics
from replica.model_loading import load_replica_model
from scissorhands.models import cpu_model_name


@dataclass
class StreamChunk:
    """One streamed piece of a reply: the token ids it carries, when they arrived (seconds; None: the
    reader stamps them on arrival), and an error that ends the stream (`error_kind`, `error`)."""

    token_ids: list[int] = field(default_factory=list)
    time_s: float | None = None
    error_kind: str | None = None
    error: str | None = None
    replica_id: str | None = None


def openai_event(ev: StreamChunk | GenerationResult) -> dict:
    """A replica's event as `replica.openai_api` reads it: ``{"token_id", "time_s"}`` for a one-token
    chunk, ``{"result": GenerationResult fields}`` for the result that ends the stream."""
    if isinstance(ev, GenerationResult):
        return {"result": asdict(ev)}
    (token_id,) = ev.token_ids
    return {"token_id": token_id, "time_s": ev.time_s}


@dataclass
class ReplicaReply:
    """A whole reply and the replica's figures after it (`ServingReplica.stats` with `node_id` and
    `hostname`): how a Serve replica answers, so its caller learns every replica's figures from the
    replies it gets (`workloads.serving.pools.ServeClient`)."""

    result: GenerationResult
    replica_stats: dict


class ServingReplica:
    """One model replica serving requests.

    Args:
        model_spec: as `replica.model_loading.load_replica_model` (`"embedded"`, an HF id, a folder,
            `"tiny-llama"` for tests); ignored when `model` is given.
        dtype, device: of the weights.
        replica_id: recorded in every result.
        num_threads: torch intra-op threads of this process (None keeps torch's).
        engine_config: configure right away (a dict of `EngineConfig` fields or an `EngineConfig`).
        model: an already loaded model (tests).
        dtype_reason: why the run chose `dtype` (`cluster.dtype_probe.resolve_run_dtype`: `auto` resolved once
            for every replica of a run or service); recorded in `info()` instead of "forced".

    Raises:
        FileNotFoundError: the model path does not exist (the message names it).
    """

    def __init__(
        self,
        model_spec: str = "embedded",
        dtype: str = "auto",
        device: str = "cpu",
        replica_id: str = "replica-0",
        num_threads: int | None = None,
        engine_config: dict | EngineConfig | None = None,
        model=None,
        node_id: str | None = None,
        dtype_reason: str | None = None,
    ):
        if num_threads is not None:
            torch.set_num_threads(int(num_threads))
        self.replica_id = replica_id
        self.node_id = node_id
        self.model_spec = model_spec
        tokenizer = None
        if model is None:
            model, tokenizer = load_replica_model(model_spec, dtype=dtype, device=device)
            if dtype_reason is not None:  # the run resolved `auto` once (`cluster.dtype_probe.resolve_run_dtype`)
                model.scissorhands_dtype_reason = dtype_reason
        self.model = model
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.engine: EngineBackend | None = None
        self.loop: EngineLoop | None = None
        if engine_config is not None:
            self.configure(engine_config)

    def configure(self, engine_config: dict | EngineConfig, run_id: str | None = None) -> dict:
        """Replace the engine (policy, budget, memory limit); waits for the old one to stop.

        Live metrics (`replica.metrics.ReplicaMetrics`, labelled with the policy, ratio, `run_id` and engine)
        are recorded through Ray when it runs, in memory otherwise.

        Raises:
            ValueError: an invalid config (the message names the field).
            replica.backends.openvino.BackendUnavailable: ``engine: openvino`` without its runtime or export.
        """
        cfg = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig(**engine_config)
        self.shutdown()
        metrics = ReplicaMetrics(
            cfg.policy, cfg.compression_ratio, self.replica_id, self.model_spec, run_id or "adhoc", engine=cfg.engine
        )
        self.engine = make_engine(
            self.model, cfg, eos_token_id=self.eos_token_id, replica_id=self.replica_id, metrics=metrics
        )
        self.loop = EngineLoop(self.engine).start()
        return ServingReplica.info(self)  # the plain one (the Ray wrapper's `info` is async)

    def shutdown(self) -> None:
        """Stop the engine thread; requests still queued or running are answered with an error
        (`error_kind="error"`, `EngineLoop.stop`), never left waiting."""
        if self.loop is not None:
            self.loop.stop()
            self.loop = None

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        """Serve one request; its result has one wall-clock time per generated id. A replica not
        configured, or whose engine stopped, answers with `error_kind="error"`. A caller that gives up
        (cancels: a client's timeout, a cancelled Serve call) aborts the request, as `events` does."""
        if self.engine is None or self.loop is None or not self.loop.alive:
            err = (
                "replica not configured" if self.engine is None else f"engine stopped: {self.loop and self.loop.error}"
            )
            return GenerationResult(
                req.request_id,
                len(req.prompt_ids),
                error_kind="error",
                error=err,
                finish_reason="error",
                replica_id=self.replica_id,
            )
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(result: GenerationResult) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

        engine = self.engine
        engine.submit(req, done)
        try:
            return await fut
        except asyncio.CancelledError:  # nobody waits for the answer: free its slot, count it failed
            engine.abort(req.request_id)
            raise

    async def events(self, req: GenerationRequest) -> AsyncIterator[StreamChunk | GenerationResult]:
        """Serve one request token by token: one `StreamChunk` per token as it is decoded (its
        replica-clock time), then the `GenerationResult`. Closing the generator early (a client that
        went away) aborts the request: its row leaves the cache at the engine's next step."""
        if self.engine is None or self.loop is None or not self.loop.alive:
            yield await self.generate(req)
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_token(token_id: int, t: float) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, StreamChunk([token_id], t, replica_id=self.replica_id))

        def on_done(result: GenerationResult) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, result)

        engine = self.engine
        engine.submit(req, on_done, on_token)
        finished = False
        try:
            while True:
                ev = await queue.get()
                finished = isinstance(ev, GenerationResult)
                yield ev
                if finished:
                    return
        finally:
            if not finished:
                engine.abort(req.request_id)

    def finish(self, request_id: str) -> None:
        """The client has what it asked of `request_id` (a stop string in its text): the engine ends it as
        completed, ``finish_reason="stop"`` (`ContinuousBatchingEngine.finish`), before its stream is closed."""
        if self.engine is not None:
            self.engine.finish(request_id)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[dict]:
        """`events` in the OpenAI API's event form (`openai_event`; `replica.openai_api.Backend`).
        Closing it early aborts the request."""
        events = self.events(request)
        try:
            async for ev in events:
                yield openai_event(ev)
        finally:
            await events.aclose()

    def _context_tokens(self) -> int | None:
        cfg = (
            self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        )
        return getattr(cfg, "max_position_embeddings", None)

    async def check(self, prompt_tokens: int, max_new_tokens: int) -> Refusal | None:
        """Why a request of these lengths can never be served (None: it can): a `Refusal` of kind ``context``
        (past the model's context), ``kv_memory`` or ``policy`` (`ContinuousBatchingEngine.fits_alone`)."""
        context = self._context_tokens()
        if context is not None and prompt_tokens + max_new_tokens > context:
            return Refusal(
                "context",
                f"the prompt ({prompt_tokens} tokens) + max_tokens ({max_new_tokens}) exceeds the model's "
                f"context of {context} tokens",
            )
        if self.engine is None:
            return None
        why = self.engine.fits_alone(prompt_tokens, max_new_tokens)
        return (
            None if why is None else why.wrapped(f"a request of {prompt_tokens} prompt + {max_new_tokens} new tokens: ")
        )

    async def max_new_tokens_for(self, prompt_tokens: int, most: int) -> int:
        """The most new tokens (at most `most`) a request of `prompt_tokens` may ask and be served: within the
        model's context and what the KV memory limit holds for it alone (one call; 0: not one)."""
        context = self._context_tokens()
        if context is not None:
            most = min(most, context - prompt_tokens)
        if most < 1 or self.engine is None:
            return max(0, most)
        return self.engine.max_new_tokens_for(prompt_tokens, most)

    async def health(self) -> dict:
        """Liveness: answered from another thread than the one generating, never queued behind it."""
        return {
            "replica_id": self.replica_id,
            "configured": self.engine is not None,
            "engine_alive": bool(self.loop and self.loop.alive),
            "engine_fault": self.engine.fault if self.engine else None,  # why a dead engine stopped
            "running_sequences": self.engine.running if self.engine else 0,
            "queued_requests": self.engine.queued if self.engine else 0,
        }

    async def stats(self, reset: bool = False) -> dict:
        """The engine's counters and peaks (`ContinuousBatchingEngine.stats`); `reset` zeroes them after."""
        if self.engine is None:
            return {"replica_id": self.replica_id}
        s = {"engine": self.engine.config.engine, **self.engine.stats()}  # which backend gave these figures
        if reset:
            self.engine.reset_stats()
        return s

    def info(self) -> dict:
        e = self.engine
        return {
            "replica_id": self.replica_id,
            "node_id": self.node_id,
            "hostname": socket.gethostname(),
            "cpu_model": cpu_model_name(),
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "model_spec": self.model_spec,
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "dtype_reason": getattr(self.model, "scissorhands_dtype_reason", "given model"),
            "engine": e.config.engine if e else None,
            "policy": e.config.policy if e else None,
            "budget_tokens": e.budget_tokens if e else None,
            "slot_bytes": e.slot_bytes if e else None,
            "kv_memory_limit_bytes": e.kv_memory_limit_bytes if e else None,
        }

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The engine's largest batch of identical requests under its memory limit."""
        if self.engine is None:
            raise RuntimeError("replica not configured")
        return self.engine.max_batch_for(prompt_tokens, max_new_tokens)

    def crash(self) -> None:
        """Exit the process at once (tests of replica restarts)."""
        os._exit(1)
