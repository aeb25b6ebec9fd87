"""Connect this process to Ray: join a cluster, or start an embedded one on loopback, and size replicas to it.

* `init_ray`: join `--address` / `$RAY_ADDRESS`, or start an embedded Ray on loopback; a watch
  (`cluster.supervise`) then ends the run with its own message should the cluster go away.
* `replica_resources`: torch threads, Ray CPUs and GPUs per replica, so that the replicas fit the nodes.
* `ClusterError`: the cluster cannot be used; its `code` is the exit status a runner ends with.
"""

from __future__ import annotations

import os
import socket
import sys

from cluster import submit, supervise
from cluster.placement import fit_share


class ClusterError(Exception):
    """The cluster cannot be used (joined, started, sized); `code` is the exit status (1, or 2 for bad input)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def error_message(exc: BaseException) -> str:
    """`Type: message` of the original exception (Ray wraps it; `.cause` holds it)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return f"{type(exc).__name__}: {text[:2000]}"


#: Ray's metrics export interval (ms) for the embedded Ray: the scrape interval of dashboards/prometheus.yml.
EMBEDDED_METRICS_REPORT_INTERVAL_MS = "5000"
#: Ray's default dashboard port; the embedded Ray takes another free one when it is in use.
RAY_DASHBOARD_PORT = 8265
#: Root folder of the embedded Ray (sessions, logs, its service-discovery file) unless $RAY_TMPDIR
#: names one. Not /tmp/ray: every Ray head with a dashboard points /tmp/ray's service-discovery link
#: at its own session and re-points it every 5 s, so with another head on the machine Prometheus would
#: flip between the two. dashboards/prometheus.yml reads both (`dashboards.serve.EMBEDDED_RAY_SD_FILE`).
EMBEDDED_RAY_TEMP_DIR = "/tmp/scissorhands-ray"


def free_local_port(preferred: int) -> int:
    """`preferred` when nothing listens on 127.0.0.1:`preferred`, else a free port the OS picks."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


def init_ray(address: str | None):
    """Join a cluster or start an embedded local one on loopback; return (ray, started_here).

    Joining (`address`, else ``$RAY_ADDRESS``): token authentication is followed as `ray start
    --head` sets it (`cluster.submit.follow_token_auth`); a cluster that cannot be reached raises
    SweepError (exit 1) naming the address and what to check. Once connected (joined or embedded), a
    watch (`cluster.supervise`) ends the run with exit 1 and a message naming the cluster, the points
    kept and ``--resume`` when the GCS is unreachable for ``$SCISSORHANDS_CLUSTER_GONE_S`` (15 s).

    The embedded Ray runs its dashboard on 127.0.0.1 (port 8265, or a free one when another Ray
    holds it) with its files under `EMBEDDED_RAY_TEMP_DIR` (``$RAY_TMPDIR`` wins): its metrics head
    writes the Prometheus service-discovery file
    (``/tmp/scissorhands-ray/prom_metrics_service_discovery.json`` links to this session's) listing
    the node's metrics export port (a free port Ray picks), so a Prometheus started by
    ``make dashboards-up`` scrapes the replicas' live metrics. Metrics are exported every 5 s (the scrape interval;
    ``$RAY_metrics_report_interval_ms`` wins). Should the dashboard fail to start (a Ray without
    its dashboard dependencies), Ray starts again without it, after a one-line notice.
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return ray, False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        submit.follow_token_auth()  # a head from `ray start` (make cluster-up) runs with token auth
        try:
            ray.init(address=address)
        except ConnectionError as e:
            raise ClusterError(
                f"--address: cannot join the Ray cluster at {address!r} ({error_message(e)[:300]}); is it running "
                "(`make cluster-up`, `ray status --address ...`)? When its log says InvalidAuthToken, give this "
                "process the cluster's token: RAY_AUTH_TOKEN=... or RAY_AUTH_TOKEN_PATH=... (a head of this "
                "machine keeps it in ~/.ray/auth_token). Where Ray's own line above says to run `ray stop`: the "
                "address it read names a Ray that has since stopped; `make cluster-down` clears this project's "
                "head (`ray stop` would stop every Ray of this user), or pass the --address of a running one",
                1,
            ) from None
        _watch_cluster(ray, address)
        return ray, True
    os.environ.setdefault("RAY_metrics_report_interval_ms", EMBEDDED_METRICS_REPORT_INTERVAL_MS)
    submit.token_auth_for_embedded()  # Ray's default, stated: no "set RAY_AUTH_MODE=disabled" line in our output
    try:
        ray.init(
            address="local",
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=free_local_port(RAY_DASHBOARD_PORT),
            _node_ip_address="127.0.0.1",
            _temp_dir=None if os.environ.get("RAY_TMPDIR") else EMBEDDED_RAY_TEMP_DIR,
        )
    except Exception as e:  # noqa: BLE001 - live metrics are optional; the sweep is not
        ray.shutdown()
        if NODE_START_TIMEOUT in str(e):  # not the dashboard: the node itself did not come up
            raise ClusterError(_node_start_message(e), 1) from None
        print(
            f"sweep: Ray's dashboard did not start ({error_message(e)[:200]}); running without it: "
            "no live replica metrics in Prometheus",
            file=sys.stderr,
        )
        try:
            ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
        except Exception as e2:  # noqa: BLE001 - our message, not a traceback
            ray.shutdown()
            raise ClusterError(
                _node_start_message(e2)
                if NODE_START_TIMEOUT in str(e2)
                else f"the embedded Ray did not start: {error_message(e2)[:600]}",
                1,
            ) from None
    _watch_cluster(ray, "embedded")
    return ray, True


#: What Ray 2.60 raises when the raylet of a node it starts has not registered with the GCS in time.
NODE_START_TIMEOUT = "timed out during startup"


def _node_start_message(exc: BaseException) -> str:
    """The embedded Ray's node did not register in time: say so, with this machine's load (measured
    cause of the sweeps that stopped minutes after "Token authentication is enabled" here)."""
    load1 = os.getloadavg()[0]
    return (
        f"the embedded Ray did not start: its node did not register with its GCS within Ray's start timeout "
        f"({error_message(exc)[:200]}); load average {load1:.1f} on {os.cpu_count()} CPU(s): the machine is "
        "too busy. Try again when it is less loaded, or give Ray longer: "
        "RAY_raylet_start_wait_time_s=300 (no point was run)"
    )


def _watch_cluster(ray, cluster: str) -> None:
    """End the run with its own message when the cluster goes away (`cluster.supervise`)."""
    try:
        supervise.watch_cluster(ray, cluster)
    except ValueError as e:  # $SCISSORHANDS_CLUSTER_GONE_S
        ray.shutdown()
        raise ClusterError(str(e), 2) from None


def replica_resources(ray, replicas: int, device: str) -> tuple[int, float, float]:
    """(torch threads, Ray CPUs, Ray GPUs) per replica, sized so that `replicas` replicas fit on
    the alive nodes that exist, a replica never spanning nodes (`cluster.placement.fit_share`):
    two 1-CPU nodes give one replica 1 CPU, not the cluster's 2 (which no node could ever hold).

    Raises:
        SweepError: (exit 2) device 'cuda' on a cluster without a GPU.
    """
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive", n.get("alive", False))]
    if not nodes:  # no node list (should not happen): the cluster's totals, as one node
        nodes = [ray.cluster_resources()]
    cpus = fit_share([n.get("CPU", 0.0) for n in nodes], replicas) or 1.0
    if cpus >= 1:  # whole CPUs, one torch thread each (a smaller share still fits)
        cpus = float(int(cpus))
    threads = max(1, int(cpus))
    num_gpus = 0.0
    if device.startswith("cuda"):
        gpus = fit_share([n.get("GPU", 0.0) for n in nodes], replicas)
        if gpus <= 0:
            raise ClusterError("device: 'cuda' requested but the Ray cluster has no GPU", 2)
        num_gpus = min(1.0, gpus)
    return threads, cpus, num_gpus
