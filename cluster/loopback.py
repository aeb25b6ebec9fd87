"""Every port our Serve replicas open binds this node's own address (127.0.0.1 on a loopback cluster).

Ray 2.60's Serve replica starts an inter-deployment gRPC server on ``[::]:0`` in every replica
(``ray/serve/_private/replica.py``, ``_on_initialized``), with no setting to move it (Serve's ``http_options`` /
``grpc_options`` and ``RAY_SERVE_*`` name only the proxy's and direct ingress's ports; ray-project/ray discusses a
port-range setting, none for the address). So each of our deployments calls `setup_worker` in its constructor,
which Serve runs before it starts that server (``ray_actor_options``' ``worker_process_setup_hook`` would be the
natural seat, but Ray 2.60 honours it only in a job's runtime_env): it binds that server to the node's IP address
instead, the address Ray itself was started on (``_node_ip_address``, 127.0.0.1
for ``make serve``, the sweeps and the local head), which other nodes still reach in a multi-node cluster.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import ray

#: The Ray release whose private names the rebind uses (pyproject.toml pins it).
WRITTEN_FOR_RAY = "2.60.0"
#: The address Ray's Serve replica binds its inter-deployment gRPC server to (all interfaces, any port).
ALL_INTERFACES = "[::]:0"

# private Ray names, imported guarded: another Ray must still import every cluster module; only applying the
# rebind needs them (setup_worker then fails naming the Ray it was written for)
try:
    from ray._common import tls_utils
    from ray._private import worker as ray_worker
    from ray.serve._private import replica as serve_replica

    _MISSING: str | None = (
        None
        if hasattr(serve_replica, "add_port_to_grpc_server")
        else ("ray.serve._private.replica.add_port_to_grpc_server")
    )
except ImportError as e:  # another Ray release moved them
    tls_utils = ray_worker = serve_replica = None
    _MISSING = str(e)


def host_port(ip: str, port: int) -> str:
    """``ip:port``, an IPv6 address bracketed (``[::1]:0``), as gRPC reads an address."""
    try:
        bracket = ipaddress.ip_address(ip).version == 6
    except ValueError:  # a host name
        bracket = False
    return f"[{ip}]:{port}" if bracket else f"{ip}:{port}"


def node_address() -> str:
    """This worker's node IP address as Ray knows it (``_node_ip_address`` of ``ray.init`` / ``ray start``).

    Raises:
        RuntimeError: this Ray lacks the private names the rebind reads (`setup_worker`).
    """
    _check_ray()
    return ray_worker.global_worker.node_ip_address or "127.0.0.1"


def _check_ray() -> None:
    if _MISSING is not None:
        raise RuntimeError(
            f"cluster.loopback: the Serve replica's gRPC listener rebind was written for Ray {WRITTEN_FOR_RAY} "
            f"(ray._common.tls_utils, ray._private.worker, ray.serve._private.replica.add_port_to_grpc_server); "
            f"Ray {ray.__version__} lacks them ({_MISSING}): install ray[serve]=={WRITTEN_FOR_RAY} "
            "(pyproject.toml) or port the rebind"
        )


def setup_worker() -> None:
    """Make this worker's Serve replica bind its inter-deployment gRPC server to `node_address` instead of
    ``[::]:0`` (the module docstring); other addresses pass through unchanged.

    Raises:
        RuntimeError: this Ray is not the one the rebind was written for (its private names are missing), naming
            both versions.
    """
    _check_ray()
    original = tls_utils.add_port_to_grpc_server

    def bind(server: Any, address: str) -> int:
        return original(server, host_port(node_address(), 0) if address == ALL_INTERFACES else address)

    serve_replica.add_port_to_grpc_server = bind
