"""Serving replicas as one Ray Serve deployment (`workloads.serving.pools.ServeReplicaPool`, loopback, no
HTTP proxy): requests routed by Serve over both replicas, each reply carrying its replica's figures,
the replica's event loop answering while its engine generates, a point's engine configuration pushed to
the running replicas, and a replica that dies replaced by Serve and configured again."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.ray_helpers import local_ray

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_session():
    import ray
    from ray import serve

    with local_ray():
        yield ray
        serve.shutdown()


def test_serve_pool_routes_reports_per_replica_reconfigures_and_survives_a_dead_replica(ray_session):
    from ray import serve

    from replica.common.types import GenerationRequest, GenerationResult
    from workloads.serving.pools import ServeReplicaPool

    pool = ServeReplicaPool(
        2, model_spec="tiny-llama", dtype="float32", device="cpu", num_cpus=0.5, num_gpus=0, num_threads=1, run_id="t1"
    )
    try:
        (info,) = pool.start()
        assert info["replica_id"].startswith("serving#") and info["dtype"] == "float32"
        assert pool.rset.app_name.startswith("serving-t1-") and pool.rset.app_name in serve.status().applications
        pool.configure({"policy": "scissorhands", "budget_tokens": 32}, run_id="t1")
        client = pool.client()
        long = [GenerationRequest(f"long-{i}", list(range(1, 100)), 300) for i in range(6)]

        async def go():
            gen = asyncio.gather(*(client.generate(r) for r in long))
            worst_s, polls = 0.0, 0
            while not gen.done():  # the replicas' event loops answer while they generate
                t0 = time.perf_counter()
                await pool.rset.handle.stats.remote()
                worst_s, polls = max(worst_s, time.perf_counter() - t0), polls + 1
                await asyncio.sleep(0.2)
            return worst_s, polls, await gen

        worst_s, polls, results = asyncio.run(go())
        assert polls >= 1 and worst_s < 5.0
        # each reply is the engine's own result (the replica's figures went to the pool, not to the load generator)
        assert all(type(r) is GenerationResult and len(r.output_ids) == 300 and r.error_kind is None for r in results)
        ids = {r.replica_id for r in results}
        assert len(ids) == 2  # Serve used both replicas
        stats = pool.stats(reset=True)
        assert [s["replica_id"] for s in stats] == sorted(ids)
        assert all(s["budget_tokens"] == 32 and s["node_id"] and s["hostname"] for s in stats)
        assert sum(s["completed_requests"] for s in stats) == 6 and pool.stats() == []
        # a replica that dies: Serve replaces it and gives it the current configuration
        pool.rset.handle.crash.remote()
        time.sleep(3.0)
        pool.configure({"policy": "scissorhands", "budget_tokens": 16}, run_id="t1")
        client = pool.client()

        async def burst():
            return await asyncio.gather(*(client.generate(GenerationRequest(f"r-{i}", [1, 2, 3], 4)) for i in range(8)))

        results = asyncio.run(burst())
        assert all(r.error_kind is None for r in results)
        assert {s["budget_tokens"] for s in pool.stats()} == {16}
    finally:
        pool.close()
    assert pool.rset.app_name not in serve.status().applications  # only its own app, deleted


def test_a_serve_call_the_load_generator_gave_up_on_is_aborted_on_its_replica(ray_session):
    from replica.common.types import GenerationRequest
    from workloads.serving.pools import ServeReplicaPool

    pool = ServeReplicaPool(
        1, model_spec="tiny-llama", dtype="float32", device="cpu", num_cpus=0.5, num_gpus=0, num_threads=1, run_id="t2"
    )
    try:
        pool.start()
        pool.configure({"policy": "full", "max_length_tokens": 512}, run_id="t2")
        client = pool.client()

        async def give_up_once_it_runs():
            call = asyncio.ensure_future(client.generate(GenerationRequest("long", list(range(1, 100)), 400)))
            deadline = time.monotonic() + 60
            # cancelled before it reaches the replica, a call leaves nothing there to abort: wait until it runs
            while not (await pool.rset.handle.stats.remote())["running_sequences"]:
                assert not call.done() and time.monotonic() < deadline, "the call never ran on its replica"
                await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

        asyncio.run(give_up_once_it_runs())
        # Serve cancelled the replica's call, whose engine dropped the request: counted failed, the slot free
        (stats,) = pool.stats()
        assert (stats["completed_requests"], stats["failed_requests"]) == (0, 1)
        assert (stats["running_sequences"], stats["queued_requests"]) == (0, 0)
    finally:
        pool.close()
