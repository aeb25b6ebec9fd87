"""Join one more Ray node to a head on loopback, to try multi-node runs on one machine.

    python -m cluster.local_node [--address 127.0.0.1:6379] [--num-cpus 1] [--num-gpus 0]
                                 [--resources node_b=1] [--metrics-export-port 8081]
                                 [--object-store-mib 80]

What `make cluster-node` runs after `make cluster-up`. The node runs until this process gets
SIGINT/SIGTERM (Ctrl-C, or `kill PID`), then stops exactly the processes it started.

Why not `ray start --address`: on Linux, Ray's CLI refuses to start a worker node when
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (which this project sets to keep every Ray process on
loopback), and with `=1` it rewrites `127.0.0.1` into the machine's interface address. This
starts the node the way `ray.cluster_utils.Cluster.add_node` does (`ray._private.node.Node`),
with node and GCS addresses on 127.0.0.1. On real clusters use `ray start --address` (see the
recipes in `cluster/recipes/`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from cluster.signals import StopSignals
from cluster.submit import auth_env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.local_node", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:6379", help="GCS address of the head (loopback only)")
    p.add_argument("--num-cpus", type=int, default=1)
    p.add_argument("--num-gpus", type=int, default=0)
    p.add_argument("--resources", default="", help="custom resources: node_b=1[,name=amount] or JSON '{\"node_b\": 1}'")
    p.add_argument(
        "--metrics-export-port",
        type=int,
        default=8081,
        help="this node's Prometheus metrics port (the head's is 8080 with make cluster-up)",
    )
    p.add_argument("--object-store-mib", type=int, default=80)
    args = p.parse_args(argv)
    host = args.address.rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost"):
        p.error(f"--address: {args.address!r} is not on loopback; on a real cluster use `ray start --address`")
    text = args.resources.strip()
    try:
        if text.startswith("{"):
            args.resources = json.loads(text)
        else:  # name=amount[,name=amount]: no quotes or spaces, easy to pass through make ARGS=
            args.resources = {
                k.strip(): float(v) for k, v in (kv.split("=", 1) for kv in text.split(",") if kv.strip())
            }
    except (json.JSONDecodeError, ValueError) as e:
        p.error(f"--resources: expected name=amount[,name=amount] or a JSON object, got {text!r} ({e})")
    if not isinstance(args.resources, dict):
        p.error("--resources: expected a JSON object of resource name to amount")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.update(auth_env(dict(os.environ)))  # a head from `ray start` uses token auth
    import ray._private.node  # after the environment above is set: Ray reads it on import
    import ray._private.parameter

    params = ray._private.parameter.RayParams(
        node_ip_address="127.0.0.1",
        gcs_address=args.address.replace("localhost", "127.0.0.1"),
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        resources=args.resources,
        metrics_export_port=args.metrics_export_port,
        object_store_memory=args.object_store_mib * 1024 * 1024,
        include_log_monitor=True,
        node_manager_port=0,
        min_worker_port=0,
        max_worker_port=0,
    )
    params.dashboard_agent_listen_port = None
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    stop = StopSignals()  # from here on in place of Ray's own SIGTERM handler
    print(
        f"local_node: node {node.node_id} joined {args.address} on 127.0.0.1 "
        f"(CPU {args.num_cpus}, GPU {args.num_gpus}, resources {args.resources}, "
        f"metrics on 127.0.0.1:{args.metrics_export_port}); pid {os.getpid()}; Ctrl-C or kill to stop",
        flush=True,
    )
    stop.wait()
    node.kill_all_processes(check_alive=False, allow_graceful=True)
    print("local_node: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
