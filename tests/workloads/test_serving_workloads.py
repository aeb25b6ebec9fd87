"""What a serving point sends: every series at one load gets the same requests (a paired comparison), other
loads draw anew, and no prompt is sent twice in a point however long its duration runs."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from cluster.placement import PlacementError
from replica import cpu_share
from tests.serving_fakes import FakeReplica, OneReplicaPool, Script
from tests.suite_helpers import serving_suite, uniform
from workloads.batch.suite import BatchSuite
from workloads.core.template import run_suite
from workloads.load.lengths import LengthDist, RequestStream
from workloads.serving.runner import ServingKind
from workloads.serving.suite import ServingSuite

BASE = serving_suite(
    compression_ratios=[2],
    prompt_tokens=uniform(8, 64),
    new_tokens=uniform(2, 8),
    warmup_requests=1,
    seed=3,
    saturation={"max_error_rate": None, "min_achieved_rate_fraction": None},
)


class RecordingPool(OneReplicaPool):
    """A pool of one instant fake replica that keeps, per configured point, every request it received."""

    def __init__(self):
        self.sent: list[list] = []

    def configure(self, cfg, run_id=None):
        got: list = []
        self.sent.append(got)

        def script(req):
            got.append((tuple(req.prompt_ids), req.max_new_tokens, req.warmup))
            return Script(ttft_s=0.0, gap_s=0.0, chunk_tokens=64)

        self.replica = FakeReplica(script=script, clock=time.time)


def _run(tmp: Path, **kw) -> tuple[list[dict], RecordingPool]:
    path = tmp / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", **BASE, **kw}))
    args = argparse.Namespace(
        suite=str(path), replicas=None, results_dir=str(tmp / "r"), run_id="run", resume=None, address=None,
        pushgateway="off",
    )  # fmt: skip
    pool = RecordingPool()
    assert run_suite(args, ServingKind(pool)) == 0
    lines = (tmp / "r" / "run" / "points.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines], pool


def test_every_series_at_one_load_gets_the_same_requests_in_the_same_order(tmp_path):
    recs, pool = _run(tmp_path, mode="concurrency", loads=[2, 4], num_requests=12)
    full, sh = [r for r in recs if r["policy"] == "full"], [r for r in recs if r["policy"] == "scissorhands"]
    # full at load 2 and 4, then scissorhands at 2 and 4: the same prompts, lengths and order at each load
    by_point = pool.sent  # in the order each point sent them
    assert by_point[0] == by_point[2] and by_point[1] == by_point[3]
    assert sorted(by_point[0]) != sorted(by_point[1])  # another load is another draw
    assert [r["input_tokens"] for r in full] == [r["input_tokens"] for r in sh]
    assert full[0]["input_tokens"] != full[1]["input_tokens"]


def test_every_series_of_a_rate_or_batch_suite_shares_its_loads_seed():
    data = dict(BASE, name="s", mode="rate", loads=[1, 2], num_requests=4)

    suite = ServingSuite.model_validate(data)
    points = suite.points()
    seeds = {(p.series, p.load): suite.load_config(p).seed for p in points}
    assert seeds[("rate-full", 1.0)] == seeds[("rate-scissorhands-r2", 1.0)]
    assert seeds[("rate-full", 2.0)] == seeds[("rate-scissorhands-r2", 2.0)]
    assert seeds[("rate-full", 1.0)] != seeds[("rate-full", 2.0)]
    batch = ServingSuite.model_validate(dict(data, mode="serving-batch", loads=[2]))
    assert len({batch.load_config(p).seed for p in batch.points()}) == 1
    static = BatchSuite.model_validate(
        dict(kind="batch", name="b", model="tiny-llama", policies=["full", "scissorhands"], compression_ratios=[2],
             batch_sizes=[2], prompt_tokens=[16], new_tokens=[4], seed=5)
    )  # fmt: skip
    assert {p.spec().seed for p in static.points()} == {5}  # the static batches share their prompts


def test_a_duration_bound_point_never_sends_a_prompt_twice(tmp_path):
    recs, pool = _run(tmp_path, mode="concurrency", loads=[8], duration_s=4, policies=["full"])
    (rec,) = recs
    (sent,) = pool.sent
    prompts = [p for p, _, _ in sent]
    assert len(prompts) > 2 * 257  # an instant server takes more than the old list of 256 + warm-up
    assert len(set(prompts)) == len(prompts)  # no repeat, none of the warm-up prompt either
    assert rec["status"] == "ok" and rec["stop_reason"] == "duration" and rec["repeated_prompts"] == 0


def test_a_prompt_space_too_small_for_the_point_counts_its_repeats_and_says_so(tmp_path):
    recs, pool = _run(tmp_path, mode="concurrency", loads=[2], num_requests=300, policies=["full"], prompt_tokens=1)
    (rec,) = recs
    distinct = len({p for p, _, _ in pool.sent[0]})
    assert distinct == 128  # the tiny model's vocabulary: every one-token prompt, then repeats
    assert rec["repeated_prompts"] == 301 - 128
    assert any("repeated an earlier prompt" in w for w in rec["warnings"])


def test_a_request_stream_is_the_same_whatever_order_it_is_asked_in():
    dist = LengthDist("uniform", min=4, max=9)
    a, b = (
        RequestStream(dist, dist, seed=1, vocab_size=1000, chunk=8),
        RequestStream(dist, dist, seed=1, vocab_size=1000, chunk=8),
    )
    forward = [a(i).prompt_ids for i in range(20)]
    backward = [b(i).prompt_ids for i in reversed(range(20))][::-1]
    assert forward == backward and a(19).request_id == "req-19"


class CpuSamplingFails(RecordingPool):
    """A pool whose CPU sampling raises as a broadcast to a replaced replica does (after its wait)."""

    def cpu_samples(self):
        raise PlacementError("replica fake-0 was replaced and its successor is not ready after 30 s")


def test_a_point_whose_cpu_sampling_fails_records_its_load_with_empty_cpu_fields_and_a_warning(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", **BASE, "mode": "concurrency", "loads": [2], "num_requests": 4}))
    args = argparse.Namespace(
        suite=str(path), replicas=None, results_dir=str(tmp_path / "r"), run_id="run", resume=None, address=None,
        pushgateway="off",
    )  # fmt: skip
    assert run_suite(args, ServingKind(CpuSamplingFails())) == 0
    recs = [json.loads(x) for x in (tmp_path / "r" / "run" / "points.jsonl").read_text().splitlines()]
    assert recs and all(r["status"] == "ok" and r["completed_requests"] == 4 for r in recs)
    for r in recs:
        assert {k: r[k] for k in cpu_share.empty()} == cpu_share.empty()
        assert any("CPU share not measured" in w and "successor is not ready" in w for w in r["warnings"])
