"""Session affinity through real Ray Serve with 2 replicas of the tiny model keeping each session's state
(``kv_reuse: session_state``): every turn of a session reaches its session's replica
(`replica.common.session_affinity.session_replica` over the replicas' tags), so every turn after the first starts
from its session's kept cache. Over HTTP (`cluster.serve_app`: OpenAI's `user` field, `StreamHolderRouter`) and
through the serving sweep's pool (`workloads.serving.pools.ServeReplicaPool`, `LeastOutstandingRouter`)."""

from __future__ import annotations

import asyncio

import pytest
import requests

from replica.common.session_affinity import session_replica
from replica.common.types import GenerationRequest
from tests.ray_helpers import local_ray
from tests.waiting import free_port

pytestmark = pytest.mark.ray

#: 12 sessions: both replicas hold some (all on one: 2 * 2^-12)
SESSIONS = [f"conv-{i}" for i in range(12)]
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
KEEPS = dict(
    policy="scissorhands",
    budget_tokens=16,
    kv_layout="paged",
    block_tokens=4,
    kv_memory_limit_bytes=400_000,
    kv_reuse="session_state",
)


def _tag(replica_id: str) -> str:
    return replica_id.rpartition("#")[2]


def test_two_serve_replicas_get_each_sessions_turns_on_its_replica_over_http_and_through_the_sweeps_pool():
    from ray import serve

    from cluster.serve_app import APP_NAME, build_serve_app, start
    from workloads.serving.pools import ServeReplicaPool

    with local_ray():
        try:
            port = free_port()
            app = build_serve_app(
                "tiny-llama",
                ["scissorhands:b16"],
                dtype="float32",
                tokenizer_spec=None,
                num_replicas=2,
                replica_cpus=0.5,
                budget="fixed",
                block_tokens=4,
                kv_memory_limit_bytes=400_000,
                kv_reuse="session_state",
            )
            start(app, port=port)
            url = f"http://127.0.0.1:{port}/v1"
            (model,) = requests.get(url + "/models", timeout=30).json()["data"]
            assert model["metadata"]["kv_reuse"] == "session_state"

            def post(prompt, sid):
                body = dict(model=model["id"], prompt=prompt, max_tokens=3, ignore_eos=True, user=sid)
                reply = requests.post(url + "/completions", json=body, timeout=120).json()
                return reply, _tag(reply["scissorhands"]["replica_id"])

            firsts = {s: post(PROMPT, s) for s in SESSIONS}
            seconds = {s: post(PROMPT + r["choices"][0]["token_ids"] + [20, 21], s) for s, (r, _) in firsts.items()}
            tags = {t for _, t in firsts.values()}
            assert len(tags) == 2  # both replicas hold sessions
            for s in SESSIONS:
                home = session_replica(s, sorted(tags))
                assert firsts[s][1] == seconds[s][1] == home, s
                # the second turn started from the first's kept state: its prompt and answer but the last token
                assert seconds[s][0]["usage"]["prompt_tokens_details"] == {"cached_tokens": len(PROMPT) + 3 - 1}
        finally:
            serve.delete(APP_NAME, _blocking=True)

        pool = ServeReplicaPool(
            2, model_spec="tiny-llama", dtype="float32", device="cpu", num_cpus=0.5, num_gpus=0, num_threads=1
        )
        try:
            pool.start()
            pool.configure(KEEPS)
            client = pool.client()

            async def turns(sid):
                first = await client.generate(GenerationRequest(f"{sid}-0", PROMPT, 3, session_id=sid))
                prompt = PROMPT + list(first.output_ids) + [20, 21]
                return sid, first, await client.generate(GenerationRequest(f"{sid}-1", prompt, 3, session_id=sid))

            async def go():
                return await asyncio.gather(*(turns(s) for s in SESSIONS))

            results = asyncio.run(go())
            tags = sorted({_tag(first.replica_id) for _, first, _ in results})
            assert len(tags) == 2
            for sid, first, second in results:
                home = session_replica(sid, tags)
                assert _tag(first.replica_id) == _tag(second.replica_id) == home
                assert first.session_affinity_hit is True and second.session_affinity_hit is True
                assert second.session_reused_tokens == len(PROMPT) + 3 - 1
            stats = pool.stats()
            assert sum(s["session_state_hits"] for s in stats) == len(SESSIONS)
            assert sum(s["session_state_misses"] for s in stats) == 0
            # the engine keeps nothing: no session key, no affinity judged
            pool.configure(dict(KEEPS, kv_reuse="none"))
            client = pool.client()
            results = asyncio.run(go())
            assert all(f.session_affinity_hit is None and s.session_affinity_hit is None for _, f, s in results)
        finally:
            pool.close()
            serve.shutdown()
