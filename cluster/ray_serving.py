"""Thin Ray actor around `cluster.serving_replica.ServingReplica`, with separate concurrency groups.

* `generate`: many requests at once (each awaits its result; the engine runs on its own thread),
* `health`: `health`, `stats`, `info` on their own event loop, so they never wait behind generation,
* `control`: `configure` / `max_batch_for` one at a time.

Resources are set with `.options()` at creation (`create_serving_replicas`).
"""
from __future__ import annotations

from typing import Any

import ray

from cluster.serving_replica import ServingReplica

GENERATE_CONCURRENCY = 100_000


@ray.remote(concurrency_groups={"generate": GENERATE_CONCURRENCY, "health": 4, "control": 1})
class ServingReplicaActor(ServingReplica):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("node_id", ray.get_runtime_context().get_node_id())
        super().__init__(*args, **kwargs)

    @ray.method(concurrency_group="generate")
    async def generate(self, request: dict) -> dict:
        return await super().generate(request)

    @ray.method(concurrency_group="health")
    async def health(self) -> dict:
        return await super().health()

    @ray.method(concurrency_group="health")
    async def stats(self, reset: bool = False) -> dict:
        return await super().stats(reset)

    @ray.method(concurrency_group="health")
    async def info(self) -> dict:
        return super().info()

    @ray.method(concurrency_group="control")
    async def configure(self, engine_config: dict, run_id: str | None = None) -> dict:
        return super().configure(engine_config, run_id)

    @ray.method(concurrency_group="control")
    async def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return super().max_batch_for(prompt_tokens, max_new_tokens)

    @ray.method(concurrency_group="control")
    async def crash(self) -> None:
        super().crash()


def create_serving_replicas(n: int, *, num_cpus: float, num_gpus: float = 0.0, name_prefix: str = "serving",
                            first_index: int = 0, **replica_kwargs: Any) -> list:
    """Start `n` serving actors (`replica_kwargs` go to `ServingReplica`); they load in the background."""
    return [ServingReplicaActor.options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0).remote(
                replica_id=f"{name_prefix}-{first_index + i}", **replica_kwargs) for i in range(n)]


class RayReplicaClient:
    """The router's view of one actor: `await generate(request)` -> `GenerationResult` fields."""

    def __init__(self, handle, replica_id: str):
        self.handle = handle
        self.replica_id = replica_id

    async def generate(self, request) -> dict:
        payload = request if isinstance(request, dict) else {
            "request_id": request.request_id, "prompt_ids": list(request.prompt_ids),
            "max_new_tokens": request.max_new_tokens, "ignore_eos": request.ignore_eos,
            "warmup": request.warmup}
        return await self.handle.generate.remote(payload)
