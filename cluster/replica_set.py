"""The one replica lifecycle: every runner's replicas are one Ray Serve deployment.

The batch sweep, the serving sweep, the quality runner and the HTTP service (`cluster.serve_app`)
all run their replicas as Serve deployment replicas; this module deploys them for the runners:

* **Placement**: each replica gets a placement group of its own with one bundle holding every
  resource it asks for (``placement_group_bundles=[bundle]``, ``placement_group_strategy=STRICT_PACK``),
  so a replica with several GPUs always gets them on one node; the actor asks for the same amounts
  (``ray_actor_options``: ``num_cpus``, ``num_gpus``, ``resources``), so Ray sets
  ``CUDA_VISIBLE_DEVICES`` to exactly its GPUs and the replica shards its model over them
  (`cluster.placement.PlacedReplica`). Across replicas Serve spreads them over the nodes
  (``SPREAD``); ``STRICT_SPREAD`` becomes ``max_replicas_per_node=1`` (without the bundle, which Serve
  does not allow beside it; the actor's own resources still keep a replica on one node); ``PACK``/``STRICT_PACK`` are
  left to Serve's scheduler (it spreads unless the cluster sets
  ``RAY_SERVE_USE_COMPACT_SCHEDULING_STRATEGY=1``).
* **Restarts**: Serve health-checks each replica and replaces one whose process died (reloading the
  model); a serving point's engine configuration is `broadcast` to every running replica before
  the point, so a replaced replica is configured again at the next point.
* **Calls**: deployment handles, in this process (no HTTP proxy); a handle call goes to the replica
  with the fewest of this handle's calls in flight (`LeastOutstandingRouter`, plugged into Serve's
  router; Serve's default power-of-two router can send a whole burst to one of several idle replicas:
  docs/performance.md, "Measurements behind the library and cluster code") among those with room (``max_ongoing_requests``: 1 for exclusive batch and
  quality points), and every reply names the replica and node that produced it.
* **Bounded time**: `check_fits` refuses at once a replica no node can hold;
  a deployment not running within ``placement.ready_timeout_s`` fails with what the cluster has free
  and its alive nodes (`cluster.placement.not_ready_message`); a replica whose constructor fails
  fails the start with the replica's own error (e.g. the missing model path).
* **Isolation**: each run deploys an application of its own, named uniquely per run and without a
  route, so a `make serve` application on the same cluster is never touched; `shutdown` deletes
  only that application (a resumed run first deletes what a killed attempt of it left deployed).

Runners import this module (and with it Ray Serve) only when they start replicas.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray import serve
from ray.serve.api import _run
from ray.serve.request_router import FIFOMixin, RequestRouter

from cluster import loopback
from cluster.placement import (
    PlacedReplica,
    PlacementConfig,
    PlacementError,
    _alive_nodes,
    check_fits,
    not_ready_message,
    replica_bundle,
)
from cluster.serve_routing import session_first, session_key_of
from replica import cpu_share
from replica.openai_api import replica_death


class LeastOutstandingRouter(FIFOMixin, RequestRouter):
    """Serve request router: candidates ranked by this handle's calls in flight on each, fewest first
    (ties: the one picked longest ago), so a burst spreads over idle replicas and a slow replica gets
    fewer; a call naming its session (``session_key``, `cluster.serve_routing.session_key_of`) ranks its
    session's replica first. Serve falls through the ranks when a replica has no room (``max_ongoing_requests``)."""

    def initialize_state(self, **kwargs) -> None:
        self.outstanding: dict = {}  # replica id -> calls routed (or about to be) and not completed
        self.last_pick: dict = {}
        self.expected: dict = {}  # request id -> the replica its routing ranked first
        self.picks = 0

    def _count(self, replica_id, delta: int) -> None:
        self.outstanding[replica_id] = max(0, self.outstanding.get(replica_id, 0) + delta)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        # Serve routes a burst concurrently and reports a routed call only once the replica accepted it,
        # so the first-ranked replica is counted now (and corrected in `on_request_routed`)
        rid = pending_request.metadata.internal_request_id if pending_request is not None else None
        if rid in self.expected:
            self._count(self.expected.pop(rid), -1)
        ranked = sorted(
            candidate_replicas,
            key=lambda r: (self.outstanding.get(r.replica_id, 0), self.last_pick.get(r.replica_id, -1)),
        )
        key = session_key_of(pending_request)
        if key is not None and ranked:  # a session's turn: its replica first (it holds the session's state)
            ranked = session_first(ranked, key)
        if rid is not None and ranked:
            self.expected[rid] = ranked[0].replica_id
            self._count(ranked[0].replica_id, +1)
            self.picks += 1
            self.last_pick[ranked[0].replica_id] = self.picks
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        expected = self.expected.pop(pending_request.metadata.internal_request_id, None)
        if expected != replica_id:
            if expected is not None:
                self._count(expected, -1)
            self._count(replica_id, +1)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._count(replica_id, -1)


#: Seconds between checks of a deploying application's status.
STATUS_POLL_S = 0.25


def delete_leftover_apps(app_name: str) -> None:
    """Delete the Serve applications of an earlier attempt of this run (``<kind>-<run id>-<hex>``: this
    name with another suffix). A runner killed before its shutdown leaves its replicas deployed (Serve
    applications outlive the driver on a cluster joined with ``--address``), holding their CPUs; a resume
    frees them before anything of its own asks for resources. Nothing to do without a Serve controller."""
    prefix = app_name[:-8]
    if prefix.endswith("-adhoc-"):  # no run id: nothing to tell its own apps apart by
        return
    try:
        serve.context._connect(raise_if_no_controller_running=True)
    except Exception:  # noqa: BLE001 - no Serve on this cluster: no earlier application
        return
    for name in list(serve.status().applications):
        if name.startswith(prefix) and name != app_name and re.fullmatch(r"[0-9a-f]{8}", name[len(prefix) :]):
            serve.delete(name, _blocking=True)


def app_name_for(kind: str, run_id: str | None) -> str:
    """A Serve application name unique to this run: ``<kind>-<run id>-<8 hex>`` (characters Serve accepts)."""
    return f"{_app_prefix(kind, run_id)}{uuid.uuid4().hex[:8]}"


def _app_prefix(kind: str, run_id: str | None) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", f"{kind}-{run_id or 'adhoc'}")[:80] + "-"


def replica_failure(message: str) -> str:
    """The replica's own error line (``FileNotFoundError: ...``) out of a Serve status message with a
    traceback; the whole message (shortened) when no such line is there."""
    lines = [ln.strip() for ln in (message or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b.*:", ln)]
    return (errors[-1] if errors else " ".join(lines))[:2000]


class ServeReplicaSet:
    """`n` replicas of one deployment class, deployed as a Serve application of their own.

    Args:
        deployment: a `ray.serve.Deployment` (``@serve.deployment`` class).
        init_kwargs: the replica constructor's keyword arguments (each replica loads its model there);
            ``num_threads`` (torch threads) is added: the runner's `num_threads` when the placement names
            no CPUs, else the replica's whole CPUs (at least 1).
        n: number of replicas (>= 1).
        placement: the suite's `PlacementConfig` (resources, strategy, ready timeout).
        num_cpus, num_gpus: the runner's default resources per replica; the placement's values win.
        app_name: the Serve application name (`app_name_for`).
        max_ongoing_requests: per replica (1: one point at a time).
        what: how messages name the replicas ("replica(s)", "serving replica(s)").

    Raises:
        PlacementError: ``n`` < 1.
    """

    def __init__(
        self,
        deployment,
        init_kwargs: dict,
        n: int,
        placement: PlacementConfig | None = None,
        *,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        num_threads: int | None = None,
        app_name: str,
        max_ongoing_requests: int = 1,
        max_queued_requests: int = -1,
        what: str = "replica(s)",
    ):
        if n < 1:
            raise PlacementError(f"replicas: must be >= 1, got {n}")
        self.deployment, self.init_kwargs, self.n = deployment, dict(init_kwargs), n
        self.placement = placement or PlacementConfig()
        cfg = self.placement
        self.num_cpus = float(cfg.num_cpus if cfg.num_cpus is not None else num_cpus)
        self.num_gpus = float(cfg.num_gpus if cfg.num_gpus is not None else num_gpus)
        self.resources = dict(cfg.resources)
        self.num_threads = num_threads if cfg.num_cpus is None and num_threads else max(1, int(self.num_cpus))
        self.bundle = replica_bundle(self.num_cpus, self.num_gpus, self.resources)
        self.app_name, self.what = app_name, what
        self.max_ongoing_requests, self.max_queued_requests = max_ongoing_requests, max_queued_requests
        self.handle = None

    # -- deployment options ---------------------------------------------------------------
    def options(self) -> dict:
        """The deployment options that place and size each replica (see the module docstring)."""
        opts: dict[str, Any] = dict(
            name="replica",
            num_replicas=self.n,
            ray_actor_options={
                "num_cpus": self.num_cpus,
                "num_gpus": self.num_gpus,
                **({"resources": dict(self.resources)} if self.resources else {}),
            },
            placement_group_bundles=[dict(self.bundle)],
            placement_group_strategy="STRICT_PACK",
            max_ongoing_requests=self.max_ongoing_requests,
            max_queued_requests=self.max_queued_requests,
            max_constructor_retry_count=self.n,
            request_router_config={"request_router_class": f"{__name__}:LeastOutstandingRouter"},
            logging_config={"enable_access_log": False},
        )  # one log line per request or point otherwise
        if self.placement.strategy == "STRICT_SPREAD":  # Serve refuses it beside placement_group_bundles; the
            opts["max_replicas_per_node"] = 1  # actor alone still never spans nodes
            del opts["placement_group_bundles"], opts["placement_group_strategy"]
        return opts

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self):
        """Check that a replica fits a node, deploy, and wait (at most ``placement.ready_timeout_s``) until
        every replica has loaded its model. Returns the deployment handle.

        Raises:
            PlacementError: no node can hold a replica, or the replicas were not placed and loaded in
                time (the message gives what is free and the alive nodes); the application is deleted.
            RuntimeError: a replica's constructor failed (its own error line, e.g. the missing path).
        """
        self.check_fits()
        try:
            serve.context._connect(raise_if_no_controller_running=True)
        except Exception:  # noqa: BLE001 - no Serve on this cluster yet: start one without HTTP
            serve.start(proxy_location="Disabled")
        delete_leftover_apps(self.app_name)
        try:
            self.deploy()
        except BaseException:
            self.shutdown()
            raise
        return self.handle

    def check_fits(self) -> None:
        """Refuse at once a replica that no alive node can hold (`cluster.placement.check_fits`), after capping
        a default CPU share at the most CPUs one node has. Raises PlacementError naming the resource."""
        nodes = _alive_nodes(ray)
        if self.placement.num_cpus is None:
            self._cap_cpus_to_one_node(nodes)
        check_fits(self.bundle, self.n, self.placement.strategy, nodes)

    def _cap_cpus_to_one_node(self, nodes: list[dict]) -> None:
        """A default CPU share (cluster CPUs / replicas) can exceed every node; cap it at the most CPUs
        one node that holds the replica's other resources has."""
        others = {k: v for k, v in self.bundle.items() if k != "CPU"}
        cpus = [
            n.get("Resources", {}).get("CPU", 0.0)
            for n in nodes
            if all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in others.items())
        ]
        most = max(cpus, default=0.0)
        if 0 < most < self.num_cpus:
            self.num_cpus = float(most)
            self.num_threads = max(1, int(most))
            self.bundle = replica_bundle(self.num_cpus, self.num_gpus, self.resources)

    def deploy(self) -> None:
        """Deploy and wait until the application runs and this process's handle reaches every replica.
        (A redeploy with a new ``user_config`` is too slow per point, docs/performance.md, "Measurements
        behind the library and cluster code": configurations are `broadcast` instead.)

        Raises:
            PlacementError, RuntimeError: as `start`.
        """
        app = self.deployment.options(**self.options()).bind(**self.init_kwargs, num_threads=self.num_threads)
        self.handle = _run(app, _blocking=False, name=self.app_name, route_prefix=None)
        self.wait_running(self.placement.ready_timeout_s)
        self.wait_routable(self.placement.ready_timeout_s)

    def wait_routable(self, timeout_s: float) -> None:
        """Wait until this process's handle routes to every replica (it learns the running replicas
        asynchronously, and until then sends every call to the ones it knows): `broadcast` of ``info``."""
        self.broadcast("info", timeout_s=timeout_s)

    def broadcast(self, method: str, *args: Any, timeout_s: float | None = None) -> dict[str, Any]:
        """Call ``method(*args)`` on every running replica through the handle: rounds of `n` concurrent
        calls until `n` distinct replicas answered (the method returns a dict with ``replica_id``, or
        None on a replica that has no id yet). Returns {replica id: answer}.

        Raises:
            PlacementError: not every replica answered within `timeout_s` (default ``ready_timeout_s``).
        """
        timeout_s = self.placement.ready_timeout_s if timeout_s is None else timeout_s
        deadline, seen = time.monotonic() + timeout_s, {}
        while True:
            for call in [getattr(self.handle, method).remote(*args) for _ in range(self.n)]:
                try:
                    answer = call.result()
                except Exception as e:  # noqa: BLE001 - a replica that died since: Serve replaces it, ask again
                    if replica_death(e) is None:
                        raise
                    continue
                seen.setdefault(answer["replica_id"], answer)
            if len(seen) >= self.n:
                return seen
            if time.monotonic() > deadline:
                raise PlacementError(not_ready_message(ray, self.n - len(seen), self.what, timeout_s))
            time.sleep(STATUS_POLL_S)

    def status(self) -> tuple[str, str]:
        """(application status, its message and its deployment's), e.g. ``("RUNNING", "")``."""
        app = serve.status().applications.get(self.app_name)
        if app is None:
            return "NOT_STARTED", ""
        messages = [app.message] + [d.message for d in app.deployments.values()]
        return str(app.status.value if hasattr(app.status, "value") else app.status), "\n".join(
            m for m in messages if m
        )

    def wait_running(self, timeout_s: float) -> None:
        """Wait until the application runs (every replica constructed and healthy).

        Raises:
            PlacementError: not running within `timeout_s` seconds (`not_ready_message`).
            RuntimeError: the deployment failed (a replica's constructor raised).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            status, message = self.status()
            if status == "RUNNING":
                return
            if status == "DEPLOY_FAILED":
                raise RuntimeError(replica_failure(message))
            if time.monotonic() > deadline:
                raise PlacementError(not_ready_message(ray, self.n, self.what, timeout_s))
            time.sleep(STATUS_POLL_S)

    def shutdown(self) -> None:
        """Delete this set's application, and nothing else (safe to call twice). Serve's controller stays
        (no CPU; a cluster started by the runner goes with it, on a shared one other apps may use it)."""
        try:
            serve.delete(self.app_name, _blocking=True)
        except Exception:  # noqa: BLE001 - Serve or the cluster is gone already
            pass
        self.handle = None


# -- replicas of batch and quality points ------------------------------------------------------
@dataclass
class PointReply:
    """What a point's call returns: the replica's `info()` (where it ran: ``replica_id``, ``node_id``,
    ``devices``, ...), the point's result (None when it raised) and the error (``Type: message``)."""

    replica: dict
    result: Any = None
    error: str | None = None


@serve.deployment(health_check_period_s=5, health_check_timeout_s=60, graceful_shutdown_timeout_s=5)
class PointReplica:
    """One Serve replica running whole points, one at a time: a `cluster.placement.PlacedReplica`
    (the model loaded once, sharded over the replica's GPUs when it has several)."""

    def __init__(self, name_prefix: str = "replica", **replica_kwargs: Any):
        loopback.setup_worker()  # before Serve starts this replica's gRPC server
        ctx = serve.get_replica_context()
        self.replica = PlacedReplica(replica_id=f"{name_prefix}-{ctx.replica_tag}", **replica_kwargs)
        self.replica._raise_load_error()  # Serve fails the deployment with the replica's own error

    def info(self) -> dict:
        return self.replica.info()

    def run_batch(self, spec: dict) -> PointReply:
        """``replica.run_batch(spec)`` (one batch point), with the replica's `info()` and any error."""
        return self._reply(self.replica.run_batch, spec)

    def apply(self, fn: Callable[..., Any], point: Any) -> PointReply:
        """``replica.apply(fn, point)`` (a quality or frontier point), with the replica's `info()` and any error."""
        return self._reply(self.replica.apply, fn, point)

    def _reply(self, call: Callable[..., Any], *args: Any) -> PointReply:
        info = self.replica.info()
        try:
            return PointReply(info, cpu_share.measured(call, *args))  # the CPU it got, measured where it ran
        except Exception as e:  # noqa: BLE001 - the point failed, the replica goes on
            text = " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
            return PointReply(info, None, f"{type(e).__name__}: {text[:2000]}")


def point_replicas(
    n: int,
    placement: PlacementConfig | None,
    replica_kwargs: dict,
    *,
    num_cpus: float,
    num_gpus: float,
    num_threads: int | None,
    app_name: str,
    name_prefix: str = "replica",
) -> ServeReplicaSet:
    """A `ServeReplicaSet` of `n` point replicas (`PlacedReplica` with `replica_kwargs`: model_spec, dtype,
    device, ...; ``max_ongoing_requests=1``: a replica runs one point at a time), not started yet."""
    cfg = placement or PlacementConfig()
    kwargs = dict(
        replica_kwargs,
        name_prefix=name_prefix,
        gpu_memory_fraction=cfg.gpu_memory_fraction,
        max_memory_per_gpu_bytes=cfg.max_memory_per_gpu_bytes,
    )
    return ServeReplicaSet(
        PointReplica,
        kwargs,
        n,
        placement,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        num_threads=num_threads,
        app_name=app_name,
        max_ongoing_requests=1,
    )
