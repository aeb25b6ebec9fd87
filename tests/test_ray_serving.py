"""Serving replicas as Ray actors (loopback): generation through the router, health answered during
generation (separate concurrency group), a crashed replica detected and replaced."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_session():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


def test_actors_serve_through_the_router_and_health_never_waits_behind_generation(ray_session):
    ray = ray_session
    from cluster.engine import GenerationRequest
    from cluster.router import Router
    from workloads.serving_sweep import RayReplicaPool

    pool = RayReplicaPool(2, model_spec="tiny-llama", dtype="float32", device="cpu", num_cpus=0.5, num_gpus=0,
                          num_threads=1)
    try:
        infos = pool.start()
        assert sorted(i["replica_id"] for i in infos) == ["serving-0", "serving-1"]
        pool.configure({"policy": "scissorhands", "budget_tokens": 32})
        router = Router(pool.clients())
        long = [GenerationRequest(f"long-{i}", list(range(1, 100)), 400) for i in range(4)]

        async def go():
            gen = asyncio.gather(*(router.generate(r) for r in long))
            seen, worst_s = [], 0.0
            while not gen.done():                        # poll health while the batch generates
                t0 = time.perf_counter()
                seen.append(await pool.actors[0].health.remote())
                worst_s = max(worst_s, time.perf_counter() - t0)
                await asyncio.sleep(0.2)
            return seen, worst_s, await gen
        seen, worst_s, results = asyncio.run(go())
        assert any(h["engine_alive"] and h["running_sequences"] >= 1 for h in seen)   # answered mid-generation
        assert worst_s < 5.0
        assert all(len(r["output_ids"]) == 400 and r["error_kind"] is None for r in results)
        assert {r["replica_id"] for r in results} == {"serving-0", "serving-1"}
        stats = pool.stats(reset=True)
        assert all(s["peak_running_sequences"] == 2 and s["budget_tokens"] == 32 for s in stats)
        # a replica that dies is found by the health check and replaced (reconfigured)
        pool.actors[1].crash.remote()
        time.sleep(2.0)
        assert pool.restart_dead() == ["serving-1"]
        assert ray.get(pool.actors[1].health.remote())["configured"] is True
    finally:
        pool.close()
