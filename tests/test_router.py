"""Least-outstanding-requests routing (cluster.router) over fake replicas on a virtual clock."""
from __future__ import annotations

import asyncio

import pytest

from cluster.router import NoLiveReplicaError, Router
from tests.serving_fakes import FakeReplica, Script, requests, run_virtual, virtual_clock
from workloads.loadgen import LoadConfig, run_load


def test_least_outstanding_sends_more_to_the_faster_replica_and_keeps_both_busy():
    fast = FakeReplica(script=lambda r: Script(ttft_s=0.1, gap_s=0.01), replica_id="fast")
    slow = FakeReplica(script=lambda r: Script(ttft_s=0.5, gap_s=0.05), replica_id="slow")
    router = Router([fast, slow])

    async def go():
        return await run_load(router, requests(60), LoadConfig(mode="concurrency", concurrency=4, num_requests=60),
                              clock=virtual_clock())
    res = run_virtual(go())
    assert res.metrics.completed_requests == 60
    assert len(fast.received) > 2 * len(slow.received) > 0
    assert {r.replica_id for r in res.records} == {"fast", "slow"}
    assert router.outstanding == [0, 0] and sum(router.sent) == 60


def test_ties_go_round_robin_and_a_dead_replica_leaves_rotation_until_replaced():
    class RayActorError(Exception):
        pass

    class Dead:
        replica_id = "dead"

        async def generate(self, request):
            raise RayActorError("The actor died unexpectedly before finishing this task")

    a, b = FakeReplica(replica_id="a"), FakeReplica(replica_id="b")
    router = Router([a, Dead(), b])

    async def go():
        out = []
        for req in requests(6):
            try:
                out.append((await router.generate(req)).replica_id)
            except RayActorError:
                out.append("died")
        return out
    assert run_virtual(go()) == ["a", "died", "b", "a", "b", "a"]
    assert router.dead == {1} and router.live == 2
    router.replace(1, FakeReplica(replica_id="c"))
    assert router.live == 3
    with pytest.raises(ValueError, match="replicas"):
        Router([])
    all_dead = Router([Dead()])

    async def twice():
        with pytest.raises(RayActorError):
            await all_dead.generate(requests(1)[0])
        with pytest.raises(NoLiveReplicaError):
            await all_dead.generate(requests(1)[0])
    asyncio.run(twice())
