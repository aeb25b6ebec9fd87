"""The Ray node inventory that every run records.

Replicas themselves are `cluster.placement.ReplicaSet` actors (`cluster.placement.PlacedReplica`,
a `replica.static_batch.ModelReplica` that records where it runs).
"""

from __future__ import annotations

import ray


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
