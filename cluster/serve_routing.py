"""Ray Serve request routing for `cluster.serve_app.EngineDeployment`: a request's ``finish`` reaches the replica that
streams it.

`ServeBackend.finish(request_id)` (a stop string in the text) must end the request as completed on the engine that
holds it; Serve's default router (power of two choices) would send it to any replica, where the id is unknown and
ignored, and the holder would then count the request aborted when its stream closes. A stream's chunks carry the
replica's tag (`StreamChunk.replica_id`, ``<model id>#<replica tag>``), and ``finish(request_id, replica_tag)``
names it: `StreamHolderRouter` sends that call to the replica whose tag it is, and every other call as the default
router does (it extends Serve's default router, ``RequestRouterConfig(request_router_class=...)``).
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

#: The deployment method routed by its second argument, a replica tag.
ROUTED_METHOD = "finish"


class StreamHolderRouter(PowerOfTwoChoicesRequestRouter):
    """Power of two choices, except ``finish(request_id, replica_tag)``: that replica only (the default choice when
    it is gone: the id is unknown there and ignored, so the request ends aborted, as without a finish)."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is not None and pending_request.metadata.call_method == ROUTED_METHOD:
            tag = pending_request.args[1] if len(pending_request.args) > 1 else None
            holder = [r for r in candidate_replicas if r.replica_id.unique_id == tag]
            if holder:
                return [holder]
        return await super().choose_replicas(candidate_replicas, pending_request)
