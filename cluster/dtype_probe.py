"""The run's dtype probe on the cluster: `replica.model_loading.resolve_dtype_here` as one small Ray task with a
replica's resources, so that ``dtype: auto``'s bfloat16 probe measures the node a replica will run on, once for
every replica of the run (docs/sweep.md). Ray stays in cluster/: the replica only resolves in its own process.
"""

from __future__ import annotations

import socket

from replica.model_loading import resolve_dtype_here


def probe_on_node(model_spec: str, dtype: str, device: str, num_threads: int | None) -> dict:
    """The probe's Ray task: `resolve_dtype_here` on the worker, its reason naming the node (first 12 characters
    of Ray's node id) and host it ran on."""
    import ray  # on the worker: the task's body runs there

    node = ray.get_runtime_context().get_node_id()[:12]
    return resolve_dtype_here(model_spec, dtype, device, num_threads, f"node {node} (host {socket.gethostname()})")


def resolve_run_dtype(
    model_spec: str,
    dtype: str,
    device: str = "cpu",
    *,
    ray=None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    num_threads: int | None = None,
    timeout_s: float | None = None,
) -> dict:
    """`resolve_dtype_here` for a whole run: in this process when `ray` (the connected Ray module) is None (local
    runs, `make serve`), else as one small Ray task (`probe_on_node`) with a replica's resources (`num_cpus`,
    `num_gpus`, `num_threads` torch threads) on a node of the cluster, so the probe measures what a replica will
    run on. Forced dtypes need no task.

    Returns:
        as `resolve_dtype_here`: ``{"dtype": name}`` plus, for ``auto``, ``"dtype_reason"``.
    Raises:
        ValueError: as `resolve_dtype_here` (a bad ``dtype`` or ``device``, named; the task's error as raised in it).
        ray.exceptions.GetTimeoutError: the task has not run within `timeout_s` (no node had its resources free);
            the task is cancelled first.
    """
    if dtype != "auto" or ray is None:
        return resolve_dtype_here(model_spec, dtype, device, num_threads)
    remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=1)(probe_on_node)
    ref = remote.remote(model_spec, dtype, device, num_threads)
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise
