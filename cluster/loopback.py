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

from typing import Any

import ray
from ray._common import tls_utils
from ray.serve._private import replica as serve_replica

#: The address Ray's Serve replica binds its inter-deployment gRPC server to (all interfaces, any port).
ALL_INTERFACES = "[::]:0"


def node_address() -> str:
    """This worker's node IP address as Ray knows it (``_node_ip_address`` of ``ray.init`` / ``ray start``)."""
    return ray._private.worker.global_worker.node_ip_address or "127.0.0.1"


def setup_worker() -> None:
    """Make this worker's Serve replica bind its inter-deployment gRPC server to `node_address` instead of
    ``[::]:0`` (the module docstring); other addresses pass through unchanged."""
    original = tls_utils.add_port_to_grpc_server

    def bind(server: Any, address: str) -> int:
        return original(server, f"{node_address()}:0" if address == ALL_INTERFACES else address)

    serve_replica.add_port_to_grpc_server = bind
