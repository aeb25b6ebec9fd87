"""Ray Serve request routing for `cluster.serve_app.EngineDeployment`: a request's ``finish`` reaches the replica that
streams it.

`ServeBackend.finish(request_id)` (a stop string in the text) must end the request as completed on the engine that
holds it; Serve's default router (power of two choices) would send it to any replica, where the id is unknown and
ignored, and the holder would then count the request aborted when its stream closes. A stream's chunks carry the
replica's tag (`StreamChunk.replica_id`, ``<model id>#<replica tag>``), and ``finish(request_id, replica_tag)``
names it: `StreamHolderRouter` sends that call to the replica whose tag it is, and every other call as the default
router does (it extends Serve's default router, ``RequestRouterConfig(request_router_class=...)``).

Session affinity: a call that names a session (the ``session_key`` keyword, `SESSION_KEY`: a caller passes it when
the engine keeps a session's state, `replica.common.session_affinity.keeps_session_state`) goes first to the
session's replica, `replica.common.session_affinity.session_replica` over the candidates' tags (a consistent hash:
every router picks the same replica), then to the others as Serve falls through when it has no room.
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from replica.common.session_affinity import session_replica

#: The deployment method routed by its replica tag (second argument, or the ``replica_tag`` keyword).
ROUTED_METHOD = "finish"
#: The keyword of a call that names its session (routed to the session's replica).
SESSION_KEY = "session_key"


def session_key_of(pending_request) -> str | None:
    """The session a call names (its ``session_key`` keyword), or None."""
    if pending_request is None:
        return None
    key = (getattr(pending_request, "kwargs", None) or {}).get(SESSION_KEY)
    return key if isinstance(key, str) and key else None


def session_first(candidate_replicas, key: str) -> list:
    """`candidate_replicas` with the session `key`'s replica (by tag, `session_replica`) first, the others after in
    their order."""
    tag = session_replica(key, [str(r.replica_id.unique_id) for r in candidate_replicas])
    return sorted(candidate_replicas, key=lambda r: str(r.replica_id.unique_id) != tag)


def _replica_tag(pending_request) -> str | None:
    """The replica tag a ``finish`` call names: its second positional argument or its ``replica_tag`` keyword."""
    args = pending_request.args
    if len(args) > 1:
        return args[1]
    return (getattr(pending_request, "kwargs", None) or {}).get("replica_tag")


class StreamHolderRouter(PowerOfTwoChoicesRequestRouter):
    """Power of two choices, except ``finish(request_id, replica_tag)``: that replica only (the default choice when
    it is gone: the id is unknown there and ignored, so the request ends aborted, as without a finish); and a call
    with a ``session_key``: its session's replica first (`session_first`), the others next."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is not None and pending_request.metadata.call_method == ROUTED_METHOD:
            tag = _replica_tag(pending_request)
            holder = [r for r in candidate_replicas if r.replica_id.unique_id == tag]
            if holder:
                return [holder]
        key = session_key_of(pending_request)
        if key is not None and candidate_replicas:
            first, *rest = session_first(candidate_replicas, key)
            return [[first], rest] if rest else [[first]]
        return await super().choose_replicas(candidate_replicas, pending_request)
