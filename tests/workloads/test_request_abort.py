"""A request the load generator gave up on (its `request_timeout_s`) is aborted on the replica: its slot is freed
and the replica counts it failed, whether the point runs on the in-process pool (streamed) or through Serve
(whole replies; here a stand-in handle that, as Serve's, keeps running a call its caller only stopped awaiting)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import requests
import torch
import yaml

from replica import cpu_share
from replica.common.types import GenerationRequest
from replica.continuous import ReplicaReply, ServingReplica
from replica.openai_api import ReplicaBackend, build_app
from scissorhands.testing import tiny_llama
from tests.http_fakes import ServerThread
from workloads.core.template import run_suite
from workloads.serving.pools import LocalReplicaPool, ServeReplicaPool
from workloads.serving.runner import ServingKind

STEP_S = 0.01  # each forward of the slowed model: 200 new tokens take 2 s, far past the timeout


@pytest.fixture
def slow_model():
    torch.set_num_threads(1)
    model = tiny_llama(0)
    model.register_forward_hook(lambda *a: time.sleep(STEP_S))
    return model


def test_a_whole_reply_its_caller_stopped_waiting_for_is_aborted_and_counted_failed(slow_model):
    replica = ServingReplica(model=slow_model, engine_config={"policy": "full", "max_length_tokens": 256})
    try:

        async def give_up():
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(replica.generate(GenerationRequest("r0", [1] * 8, 200)), 0.2)

        asyncio.run(give_up())
        deadline = time.monotonic() + 5
        while replica.engine.stats()["running_sequences"] and time.monotonic() < deadline:
            time.sleep(0.01)
        s = replica.engine.stats()
        assert (s["running_sequences"], s["queued_requests"], s["completed_requests"], s["failed_requests"]) == (
            0,
            0,
            0,
            1,
        )
    finally:
        replica.shutdown()


def _settled_stats(replica: ServingReplica, failed: int) -> dict:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        s = replica.engine.stats()
        if s["failed_requests"] >= failed and not s["running_sequences"]:
            break
        time.sleep(0.01)
    return replica.engine.stats()


def test_a_whole_http_reply_whose_client_disconnected_is_aborted_on_the_replica(slow_model):
    replica = ServingReplica(model=slow_model, engine_config={"policy": "full", "max_length_tokens": 256})
    try:
        with ServerThread(build_app({"m": ReplicaBackend(replica, {})}, None)) as url:
            body = {"model": "m", "prompt": [1] * 8, "max_tokens": 200}
            with pytest.raises(requests.exceptions.ReadTimeout):  # the client gives up and closes the connection
                requests.post(f"{url}/v1/completions", json=body, timeout=0.3)
            s = _settled_stats(replica, 1)
        assert (s["completed_requests"], s["failed_requests"], s["running_sequences"]) == (0, 1, 0)
    finally:
        replica.shutdown()


class ServeLikeResponse:
    """A `DeploymentResponse` stand-in: the call runs on its own; awaiting it and being cancelled does not stop
    it (as in Serve), `cancel()` does (Serve cancels the replica's call)."""

    def __init__(self, coro):
        self.task = asyncio.ensure_future(coro)

    def __await__(self):
        return asyncio.shield(self.task).__await__()

    def cancel(self):
        self.task.cancel()


class ServeLikeSet:
    """The replica set of one in-process `ServingReplica` behind a Serve-like handle (`EngineDeployment`'s calls)."""

    def __init__(self, replica: ServingReplica):
        self.replica = replica

        async def generate(req):
            result = await replica.generate(req)
            return ReplicaReply(result, {**await replica.stats(), "node_id": "n0", "hostname": "h"})

        self.handle = SimpleNamespace(generate=SimpleNamespace(remote=lambda req: ServeLikeResponse(generate(req))))

    def broadcast(self, method, *args):
        if method == "configure":
            return {self.replica.replica_id: self.replica.configure(*args)}
        if method == "cpu_sample":  # EngineDeployment.cpu_sample: the replica process's CPU counters
            return {self.replica.replica_id: cpu_share.sample().as_dict()}
        assert method == "stats"
        return {self.replica.replica_id: asyncio.run(self.replica.stats())}

    def shutdown(self):
        self.replica.shutdown()


def _serve_like_pool(model) -> ServeReplicaPool:
    pool = ServeReplicaPool.__new__(ServeReplicaPool)  # its Ray replica set replaced by the stand-in
    pool.rset, pool.n, pool._client = ServeLikeSet(ServingReplica(model=model, replica_id="serving#a")), 1, None
    pool.start = lambda: [pool.rset.replica.info()]
    return pool


@pytest.mark.parametrize("pool_of", [lambda m: LocalReplicaPool(1, "tiny-llama", model=m), _serve_like_pool])
def test_a_serving_batch_point_whose_requests_time_out_frees_the_replica_and_counts_them_failed(
    tmp_path, slow_model, pool_of
):
    suite = tmp_path / "s.yaml"
    suite.write_text(
        yaml.safe_dump(
            dict(kind="serving", name="s", mode="serving-batch", model="tiny-llama", policies=["full"], loads=[2],
                 prompt_tokens=8, new_tokens=200, num_requests=4, warmup_requests=1, request_timeout_s=0.3,
                 replicas=1, saturation={"max_error_rate": None})
        )
    )  # fmt: skip
    args = argparse.Namespace(
        suite=str(suite), replicas=None, results_dir=str(tmp_path / "r"), run_id="run", resume=None, address=None,
        pushgateway="off",
    )  # fmt: skip
    t0 = time.monotonic()
    # every request timed out: a measurement of the load (attainment 0), not an error of the point
    assert run_suite(args, ServingKind(pool_of(slow_model))) == 0
    (rec,) = [json.loads(x) for x in (tmp_path / "r" / "run" / "points.jsonl").read_text().splitlines()]
    assert rec["errors_by_kind"] == {"timeout": 4} and rec["completed_requests"] == 0
    assert (rec["status"], rec["slo_attainment"], rec["slo_requests"]) == ("ok", 0.0, 4)
    (stats,) = rec["replica_stats"]
    # the replica dropped every request the client gave up on: none completed, each counted failed, none left
    assert (stats["completed_requests"], stats["failed_requests"], stats["warmup_failed_requests"]) == (0, 4, 1)
    assert stats["warmup_completed_requests"] == 0
    assert (stats["running_sequences"], stats["queued_requests"]) == (0, 0)
    assert time.monotonic() - t0 < 8  # 3 batches of 0.3 s, not 5 requests of 2 s run to the end
