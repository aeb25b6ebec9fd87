"""Session affinity: which of several replicas holds a session's state, so each of its turns goes there.

An engine keeps state across a session's turns when it carries the session's cache (`EngineConfig.kv_reuse:
session_state`) or caches prompt blocks by prefix (`EngineConfig.enable_prefix_caching`, or `kv_reuse: shared_prefix`,
which turns it on); either only helps a turn that reaches the replica its earlier turns ran on. `session_replica`
picks that replica by rendezvous hashing
(highest random weight, Thaler and Ravishankar, "Using name-based mappings to increase hit rates", IEEE/ACM ToN
1998), a consistent hash: every router given the same replicas picks the same one for a session, with no table to
share, and a replica that leaves moves only its own sessions. Used by Ray Serve's routers
(`cluster.serve_routing`, `cluster.replica_set.LeastOutstandingRouter`) and the in-process pool
(`workloads.serving.pools.LocalReplicaPool`).
"""

from __future__ import annotations

import hashlib
from typing import Iterable

__all__ = ["keeps_session_state", "session_replica"]


def _weight(session_id: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{replica}\x00{session_id}".encode(), digest_size=8).digest()


def session_replica(session_id: str, replicas: Iterable[str]) -> str:
    """The replica (one of `replicas`, ids as strings) that holds `session_id`: the one whose hash with the session
    is highest. The same for the same set in any order.

    Raises:
        ValueError: `replicas` is empty.
    """
    ids = list(replicas)
    if not ids:
        raise ValueError("replicas: no replica to hold the session")
    return max(ids, key=lambda r: (_weight(session_id, r), r))


def keeps_session_state(kv_reuse: str | None, enable_prefix_caching: bool | None) -> bool:
    """Whether an engine with these settings keeps state a session's next turn reuses (so the turn should go to its
    session's replica): ``kv_reuse: session_state``, ``kv_reuse: shared_prefix`` (which turns the prefix cache on),
    or the prefix cache on."""
    return kv_reuse in ("session_state", "shared_prefix") or bool(enable_prefix_caching)
