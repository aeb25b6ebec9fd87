"""Thin Ray wrapper around `cluster.replica.ModelReplica`.

All logic lives in the plain class; this module only adds the node id and creates actors with
their resources set through `.options()` at creation.
"""

from __future__ import annotations

from typing import Any

import ray

from cluster.replica import ModelReplica


class _RayModelReplica(ModelReplica):
    """`ModelReplica` that records the Ray node it runs on."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("node_id", ray.get_runtime_context().get_node_id())
        super().__init__(*args, **kwargs)


ReplicaActor = ray.remote(_RayModelReplica)


def create_replicas(
    n: int,
    *,
    num_cpus: float,
    num_gpus: float = 0.0,
    num_threads: int | None = None,
    name_prefix: str = "replica",
    **replica_kwargs: Any,
) -> list:
    """Start `n` replica actors, each reserving `num_cpus` / `num_gpus` of the cluster.

    `replica_kwargs` go to `ModelReplica` (model_spec, dtype, device, prompt_fn, ...). Actors
    load their model in the background; call `wait_ready` to surface load errors.
    Returns the actor handles.
    """
    return [
        ReplicaActor.options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0).remote(
            replica_id=f"{name_prefix}-{i}", num_threads=num_threads, **replica_kwargs
        )
        for i in range(n)
    ]


def wait_ready(actors: list, timeout_s: float | None = None) -> list[dict]:
    """Wait until every actor has loaded its model; return their `info()` dicts.

    Waits at most `timeout_s` seconds (None: `cluster.placement.default_ready_timeout_s()`,
    ``$SCISSORHANDS_READY_TIMEOUT_S`` else 600). Raises the first load error (e.g.
    FileNotFoundError naming a missing model path) as raised in the actor (Ray re-raises the
    original exception type where it can), or PlacementError when the actors were not placed and
    loaded in time (the message gives what is free and the alive nodes).
    """
    from cluster.placement import default_ready_timeout_s, wait_placed

    return wait_placed(actors, default_ready_timeout_s() if timeout_s is None else timeout_s)


def cluster_inventory() -> list[dict]:
    """The Ray node inventory: one dict per alive node (id, address, resources)."""
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive", node.get("alive", False)):
            continue
        nodes.append(
            {
                "node_id": node.get("NodeID"),
                "address": node.get("NodeManagerAddress"),
                "hostname": node.get("NodeManagerHostname"),
                "resources": {k: v for k, v in node.get("Resources", {}).items() if not k.startswith("node:")},
            }
        )
    return nodes
