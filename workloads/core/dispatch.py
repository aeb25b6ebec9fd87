"""Dispatch: the points of a run on model replicas, each handed back as it finishes (`Finished`).

`replica_points` is the one executor of the kinds whose points run where a model is loaded (batch, quality,
frontier): with ``--local`` one `replica.static_batch.ModelReplica` in this process; otherwise the run's replicas
as a Ray Serve deployment (`workloads.core.run.start_replicas`: `cluster.replica_set`, the one replica lifecycle: a
placement-group bundle per replica, Serve's restarts, GPU sharding) fed by `dispatch_points`, in which idle
replicas take the next point, a point whose replica died is queued again, and the nodes the replicas ran on are
watched. The caller (`workloads.core.template.run_suite`) builds and publishes each record.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from typing import Any, Callable, Iterator

from tqdm import tqdm

from cluster.connect import error_message, init_ray
from cluster.inventory import cluster_inventory
from replica import cpu_share
from replica.openai_api import replica_death
from replica.static_batch import ModelReplica
from workloads.core.run import SweepError, resolve_run_dtype, start_replicas
from workloads.core.template import Finished, Session

#: Seconds between checks, while points are in flight, that the replicas' nodes are still alive.
WATCH_POLL_S = 5.0


def replica_points(
    session: Session,
    pending: list,
    *,
    remote: Callable[[Any, Any], Any],
    local: Callable[[ModelReplica, Any], dict],
    replica_kwargs: dict,
    linger_s: Callable[[], float] = lambda: 0.0,
    replica_name: str = "replica",
) -> Iterator[Finished]:
    """Run `pending` where a model is loaded and yield each point as it finishes.

    Args:
        remote: ``remote(handle, point)`` starts the point through the Serve deployment handle and returns the
            `DeploymentResponse` of a `cluster.replica_set.PointReply`.
        local: ``local(replica, point)`` runs the point on the in-process replica (``--local``) and returns its metrics.
        replica_kwargs: keyword arguments of every replica (`cluster.placement.PlacedReplica`) besides the
            suite's model, dtype and device.
        linger_s: seconds to keep the replicas up after the last point (asked once the points are done).
        replica_name: the replicas' ids are ``<replica_name>-<n>`` (records name where each point ran).

    Raises:
        SweepError: as `workloads.core.run.start_replicas` and `dispatch_points`.
    """
    suite = session.suite
    if session.local:
        yield from _in_process(suite, pending, local, replica_kwargs, session.run_dir)
        return
    ray, started_here = init_ray(session.args.address)
    rset = None
    try:
        session.inventory = cluster_inventory()
        kwargs = dict(
            model_spec=suite.model, dtype=suite.dtype, device=suite.device, run_id=session.run_id, **replica_kwargs
        )
        rset, infos = start_replicas(
            ray,
            suite,
            session.replicas,
            kwargs,
            name=suite.kind,
            name_prefix=replica_name,
            run_id=session.run_id,
            run_dir=session.run_dir,
        )
        yield from dispatch_points(ray, rset, infos, pending, remote)
        wait_s = linger_s()
        if wait_s:
            tqdm.write(
                f"{suite.kind}: keeping the replicas up {wait_s:g} s more so Prometheus scrapes their last live values",
                file=sys.stderr,
            )
            time.sleep(wait_s)
    finally:
        if rset is not None:
            rset.shutdown()
        if started_here:
            ray.shutdown()


def _in_process(suite, pending: list, local, replica_kwargs: dict, run_dir) -> Iterator[Finished]:
    resolved = resolve_run_dtype(suite, run_dir=run_dir)
    replica = ModelReplica(suite.model, device=suite.device, replica_id="local", **resolved, **replica_kwargs)
    info = replica.info()
    for point in pending:
        t0 = time.time()
        try:
            yield Finished(point, "ok", cpu_share.measured(local, replica, point), None, info, t0, time.time())
        except Exception as e:  # noqa: BLE001 - the point failed; record it and go on
            yield Finished(point, "error", None, error_message(e), info, t0, time.time())


def dispatch_points(ray, rset, infos: list[dict], pending: list, remote) -> Iterator[Finished]:
    """Run `pending` on the replicas of the started `rset` (at most one point in flight per replica; idle
    replicas take the next point in order) and yield each point as it finishes.

    A point that raises is yielded as ``error`` and its replica goes on. A point whose replica died is queued
    again (at most ``placement.max_task_retries`` times, then yielded ``replica died: ...``); Serve replaces the
    replica.

    Raises:
        SweepError: (exit 1) replicas died more than ``n x (placement.max_restarts + 1)`` times; a node a
            replica ran on has left the cluster and no point finished for more than
            `placement.ready_timeout_s` (checked every `WATCH_POLL_S` s); or the cluster cannot be reached.
            The points yielded stay (--resume).
    """
    cfg = rset.placement
    name = rset.app_name
    nodes = {i.get("node_id") for i in infos} - {None}
    queue, tries = collections.deque(pending), collections.Counter()
    state = {"deaths": 0, "last_done": time.monotonic(), "lost_since": None}
    loop = asyncio.new_event_loop()
    inflight: dict = {}
    try:
        while queue or inflight:
            while queue and len(inflight) < rset.n:
                point = queue.popleft()
                inflight[loop.create_task(_awaited(remote(rset.handle, point)))] = (point, time.time())
            done, _ = loop.run_until_complete(
                asyncio.wait(list(inflight), timeout=WATCH_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            )
            if not done:
                _check_nodes(ray, nodes, state, cfg.ready_timeout_s, len(inflight) + len(queue))
                continue
            state["last_done"], state["lost_since"] = time.monotonic(), None
            for task in done:
                point, t0 = inflight.pop(task)
                try:
                    reply = task.result()
                except Exception as e:  # noqa: BLE001
                    if replica_death(e) is None:
                        yield Finished(point, "error", None, error_message(e), None, t0, time.time())
                        continue
                    state["deaths"] += 1
                    if state["deaths"] > rset.n * (cfg.max_restarts + 1):
                        raise SweepError(
                            f"replicas died {state['deaths']} times (more than {rset.n} x (placement."
                            f"max_restarts + 1)); {len(queue) + len(inflight) + 1} point(s) not run; the "
                            "points written stay (--resume)",
                            1,
                        ) from None
                    tries[point.point_id] += 1
                    if tries[point.point_id] <= cfg.max_task_retries:
                        queue.appendleft(point)
                        tqdm.write(f"{name}: a replica died running {point.point_id}; queued again", file=sys.stderr)
                        continue
                    yield Finished(point, "error", None, f"replica died: {error_message(e)}", None, t0, time.time())
                    continue
                nodes.add(reply.replica.get("node_id"))
                yield Finished(
                    point,
                    "ok" if reply.error is None else "error",
                    reply.result,
                    reply.error,
                    reply.replica,
                    t0,
                    time.time(),
                )
    finally:
        for task in inflight:
            task.cancel()
        loop.close()


async def _awaited(response):
    return await response


def _check_nodes(ray, nodes: set, state: dict, timeout_s: float, not_run: int) -> None:
    """Raise SweepError (exit 1) when a node a replica ran on has left the cluster and no point has finished
    for more than `timeout_s` since (Ray could not run the replica again), or the cluster cannot be asked.
    The points already written stay in points.jsonl (--resume runs the rest).
    """
    now = time.monotonic()
    try:
        alive = {n.get("NodeID") for n in ray.nodes() if n.get("Alive", n.get("alive", False))}
    except Exception as e:  # noqa: BLE001 - the cluster went away
        raise SweepError(
            f"the Ray cluster cannot be reached ({error_message(e)[:300]}); "
            f"{not_run} point(s) not run; the points written stay (--resume)",
            1,
        ) from None
    lost = sorted(nodes - alive)
    if not lost:
        state["lost_since"] = None
        return
    if state["lost_since"] is None:
        state["lost_since"] = now
    if now - max(state["lost_since"], state["last_done"]) > timeout_s:
        raise SweepError(
            f"a replica's node {lost[0]} left the cluster and Ray did not run the replica again within "
            f"{timeout_s:g} s (placement.ready_timeout_s); {not_run} point(s) not run; the points "
            "written stay (--resume runs the rest once the cluster has room)",
            1,
        )
