"""The load generator (`workloads.load.driver`, `workloads.load.patterns`) and its metrics.

Everything runs against `FakeReplica` on a virtual-time event loop: scripted seconds cost no real
time and every number is exact.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from replica.common.types import GenerationRequest, GenerationResult
from replica.continuous import StreamChunk
from tests.serving_fakes import FakeReplica, Script, requests, run_virtual, virtual_clock
from tests.suite_helpers import serving_suite, tiny_suite
from workloads import sweep
from workloads.load.driver import Run, run_load
from workloads.load.lengths import LengthDist, build_requests
from workloads.load.metrics import LatencyStats, RequestRecord, summarize
from workloads.load.patterns import LoadConfig, arrival_gaps_s
from workloads.serving.report import table_markdown
from workloads.serving.runner import ServingKind


def _run(client, reqs, cfg):
    async def go():
        return await run_load(client, reqs, cfg, clock=virtual_clock())

    return run_virtual(go())


def test_output_tokens_are_the_generated_ids_never_re_encoded_text():
    hello_world_ids = [28120, 905]  # what a model generated; its text is "hello world"

    class Client:
        async def generate(self, req):
            return GenerationResult(
                req.request_id, 3, output_ids=hello_world_ids, token_times_s=[1.0, 1.5], finish_reason="length"
            )

    res = _run(
        Client(), [GenerationRequest("a", [1, 2, 3], 2)], LoadConfig(mode="concurrency", concurrency=1, num_requests=1)
    )
    (rec,) = res.records
    assert rec.output_tokens == len(hello_world_ids) == 2
    assert res.metrics.output_tokens == 2


def test_tpot_is_e2e_minus_ttft_over_tokens_minus_one_and_chunk_gap_is_separate():
    # 25 chunks of 4 tokens, 40 ms apart, the first one 300 ms after the request was sent
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.3, gap_s=0.04, chunk_tokens=4))
    res = _run(fake, [GenerationRequest("a", [1], 100)], LoadConfig(mode="concurrency", concurrency=1, num_requests=1))
    m = res.metrics
    assert m.ttft_s.mean_s == pytest.approx(0.3)
    assert m.e2e_latency_s.mean_s == pytest.approx(0.3 + 24 * 0.04)
    assert m.tpot_s.mean_s == pytest.approx((0.3 + 24 * 0.04 - 0.3) / 99)  # 9.7 ms, not 40 ms / 4
    assert m.inter_chunk_gap_s.mean_s == pytest.approx(0.04) and m.inter_chunk_gap_s.n == 24
    assert m.itl_s.n == 99 and m.itl_s.p50_s == pytest.approx(0.0)  # tokens of one chunk: gap 0
    assert RequestRecord("x", 1, 1, send_time_s=0, token_times_s=[1.0], output_tokens=1).tpot_s is None


def test_every_per_request_field_summarizes_the_record_attribute_of_its_name_over_completed_requests():
    """The seam a new per-request metric uses: a `RequestRecord` property and a `PointMetrics` field of the
    same name marked `PER_REQUEST`; `summarize` fills it (numbers and pooled lists), and `flat` writes it."""
    from workloads.load.metrics import per_request_fields

    marked = per_request_fields()
    assert {"ttft_s", "tpot_s", "itl_s", "inter_chunk_gap_s", "e2e_latency_s", "replica_ttft_s"} <= set(marked)
    recs = [
        RequestRecord("a", 4, 3, send_time_s=0.0, token_times_s=[0.5, 0.75, 1.0], output_tokens=3, replica_ttft_s=0.25),
        RequestRecord("b", 4, 2, send_time_s=1.0, token_times_s=[1.25, 1.75], output_tokens=2),
        RequestRecord("c", 4, 2, send_time_s=1.0, error_kind="error"),
    ]  # failed: not summarized
    m = summarize(recs, mode="batch", window_start_s=0.0, window_end_s=2.0)
    assert (m.ttft_s.n, m.ttft_s.mean_s) == (2, pytest.approx(0.375))
    assert (m.tpot_s.n, m.tpot_s.mean_s) == (2, pytest.approx(0.375))  # (0.25 + 0.5) / 2
    assert (m.itl_s.n, m.itl_s.p50_s) == (3, pytest.approx(0.25))  # 0.25, 0.25, 0.5 pooled
    assert (m.e2e_latency_s.n, m.e2e_latency_s.mean_s) == (2, pytest.approx(0.875))
    assert (m.replica_ttft_s.n, m.replica_ttft_s.mean_s) == (1, pytest.approx(0.25))  # only "a" reports it
    flat = m.flat()
    assert {f"{name[:-2]}_{q}_s" for name in marked for q in ("mean", "p50", "p90", "p95", "p99")} <= set(flat)


def test_closed_loop_keeps_n_in_flight_while_one_request_is_slow():
    slow = {"q0"}
    fake = FakeReplica(script=lambda r: Script(ttft_s=10.0 if r.request_id.startswith("q0#") else 0.5, gap_s=0.5 / 3))
    res = _run(fake, requests(40), LoadConfig(mode="concurrency", concurrency=4, num_requests=40))
    m = res.metrics
    assert m.completed_requests == 40
    assert m.achieved_peak_concurrency == 4
    assert m.achieved_mean_concurrency > 3.5
    # the three other slots kept finishing requests during the slow one: about 3 per second
    done_during_slow = [r for r in res.records if r.finish_time_s < 10.0 and r.request_id != "q0#0"]
    assert len(done_during_slow) >= 27
    # no lockstep: new requests were sent while the slow one was still running
    assert len([r for r in res.records if 0 < r.send_time_s < 10.0]) >= 27
    assert slow  # (q0#0 is the slow one)


def test_concurrency_shortfall_is_measured_and_warned_not_silently_capped():
    fake = FakeReplica(capacity=8)  # the replicas run at most 8 at once
    res = _run(fake, requests(40), LoadConfig(mode="concurrency", concurrency=64, num_requests=40))
    m = res.metrics
    assert m.target_concurrency == 64
    assert m.achieved_peak_concurrency == 40  # only 40 requests exist: measured, reported
    assert any("concurrency: target 64, achieved peak 40" in w for w in m.warnings)
    # what the replicas ran is reported by the sweep next to it (replica peak running sequences)
    m2 = summarize(
        res.records,
        mode="concurrency",
        window_start_s=m.window_start_s,
        window_end_s=m.window_end_s,
        target_concurrency=64,
        replica_peak_running_sequences=fake.peak_running,
    )
    assert fake.peak_running == 8
    assert any("the replicas ran at most 8 sequences" in w for w in m2.warnings)


def test_exactly_the_requests_sent_reach_the_replicas_and_all_are_accounted_for():
    fake = FakeReplica(script=lambda r: Script(error_kind="oom") if r.request_id.endswith(("#5", "#9")) else Script())
    res = _run(fake, requests(20), LoadConfig(mode="concurrency", concurrency=20, num_requests=20, warmup_requests=2))
    m = res.metrics
    assert len(fake.received) == 22  # 20 + 2 declared warm-ups
    assert len(res.records) == 22 and sorted(fake.received) == sorted(r.request_id for r in res.records)
    assert m.sent_requests == 20 and m.warmup_requests == 2
    assert m.completed_requests + m.failed_requests == 20
    assert m.errors_by_kind == {"oom": 2}


@pytest.mark.parametrize("policy", ["delay", "drop"])
def test_open_loop_with_a_cap_reports_target_and_achieved_rate_and_late_or_dropped_arrivals(policy):
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.5, gap_s=0.5 / 3))  # 1 s per request
    cfg = LoadConfig(mode="rate", rate_req_per_s=50, max_concurrency=10, cap_policy=policy, num_requests=200)
    m = _run(fake, requests(200), cfg).metrics
    assert m.target_rate_req_per_s == 50
    assert m.achieved_rate_req_per_s < 12  # 10 in flight x 1 s each
    assert any(w.startswith("rate: target 50 req/s, achieved") for w in m.warnings)
    assert m.achieved_peak_concurrency <= 10
    if policy == "delay":
        assert m.sent_requests == 200 and m.delayed_arrivals > 150 and m.arrival_delay_s.p99_s > 1
    else:
        assert m.dropped_arrivals > 140 and m.sent_requests + m.dropped_arrivals == 200


def test_warm_up_requests_and_requests_sent_before_the_window_are_excluded():
    def script(r):
        return Script(ttft_s=20.0) if r.request_id == "slow" else Script(ttft_s=0.5, gap_s=0.1)

    sent_at_9 = []

    def make(i):
        # the request sent around 9 s (still warm-up) is a long one
        return GenerationRequest("slow" if i == 11 else f"r{i}", [1, 2], 4)

    async def go():
        clock = virtual_clock()
        res = await run_load(
            FakeReplica(script=script),
            make,
            LoadConfig(mode="concurrency", concurrency=1, warmup_s=10.0, duration_s=20.0),
            clock=clock,
        )
        sent_at_9.extend(r.send_time_s for r in res.records if r.request_id == "slow")
        return res

    res = run_virtual(go())
    m = res.metrics
    assert 8.0 <= sent_at_9[0] < 10.0
    assert m.window_start_s >= 10.0
    assert m.warmup_requests >= 10
    assert m.e2e_latency_s.n == m.completed_requests > 0
    assert m.e2e_latency_s.p99_s < 1.0  # the 20 s warm-up request is not in it
    assert all(not r.warmup for r in res.records if r.send_time_s >= m.window_start_s)


def test_every_request_failing_still_gives_a_complete_summary_with_null_percentiles():
    fake = FakeReplica(script=lambda r: Script(raises=RuntimeError("CUDA error")))
    m = _run(fake, requests(6), LoadConfig(mode="concurrency", concurrency=2, num_requests=6)).metrics
    assert (m.completed_requests, m.failed_requests, m.errors_by_kind) == (0, 6, {"error": 6})
    assert m.ttft_s == LatencyStats(0) and m.ttft_s.p99_s is None and m.e2e_latency_s.mean_s is None
    assert m.output_throughput_tok_per_s == 0
    json.dumps(m.flat(), allow_nan=False)  # no NaN anywhere


def test_percentiles_carry_n_and_p99_of_eight_samples_is_low_confidence():
    m = _run(FakeReplica(), requests(8), LoadConfig(mode="concurrency", concurrency=2, num_requests=8)).metrics
    assert m.ttft_s.n == 8 and m.e2e_latency_s.n == 8 and m.tpot_s.n == 8
    assert m.ttft_s.p99_low_confidence and m.ttft_s.p90_low_confidence
    big = LatencyStats.of(np.linspace(0, 1, 100))
    assert big.n == 100 and not big.p99_low_confidence and not big.p90_low_confidence
    flat = m.flat()
    assert flat["ttft_n"] == 8 and flat["ttft_p99_low_confidence"] is True


def test_p95_sits_beside_p50_p90_p99_and_is_low_confidence_below_20_samples():
    """p95 (GuideLLM's and vLLM's reports give it) is numpy's linear-interpolation percentile like the others, and is
    flagged low-confidence below 1 / (1 - 0.95) = 20 samples."""
    twenty = LatencyStats.of(np.arange(1, 21, dtype=float))  # 1 .. 20 s
    assert (twenty.p50_s, twenty.p90_s, twenty.p95_s, twenty.p99_s) == pytest.approx((10.5, 18.1, 19.05, 19.81))
    assert not twenty.p95_low_confidence and not twenty.p90_low_confidence and twenty.p99_low_confidence
    nineteen = LatencyStats.of(np.arange(1, 20, dtype=float))
    assert nineteen.p95_low_confidence and not nineteen.p90_low_confidence
    assert LatencyStats(0).p95_s is None
    flat = summarize(
        [
            RequestRecord(f"r{i}", 4, 2, send_time_s=0.0, token_times_s=[i + 1.0, i + 2.0], output_tokens=2)
            for i in range(20)
        ],
        mode="concurrency",
        window_start_s=0.0,
        window_end_s=30.0,
    ).flat()
    assert flat["ttft_p95_s"] == pytest.approx(19.05) and flat["ttft_p95_low_confidence"] is False
    assert flat["e2e_latency_p95_s"] == pytest.approx(20.05) and flat["tpot_p95_s"] == pytest.approx(1.0)


def test_open_loop_2000_scripted_arrivals_within_5_percent_of_the_target_rate():
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.05, gap_s=0.01))
    cfg = LoadConfig(mode="rate", rate_req_per_s=40.0, num_requests=2000, seed=3)
    res = _run(fake, requests(50), cfg)
    m = res.metrics
    assert m.sent_requests == 2000 == len(fake.received)
    assert abs(m.achieved_rate_req_per_s / 40.0 - 1) < 0.05
    assert m.delayed_arrivals == 0 and m.dropped_arrivals == 0


def test_gamma_burstiness_changes_the_spread_not_the_mean_rate():
    poisson = arrival_gaps_s(20000, 10.0, 1.0, seed=0)
    bursty = arrival_gaps_s(20000, 10.0, 0.25, seed=0)
    assert poisson.mean() == pytest.approx(0.1, rel=0.03) and bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1 / sqrt(shape)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)


def test_batch_mode_sends_static_batches():
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.2 + 0.1 * int(r.request_id.split("#")[1]), gap_s=0.01))
    res = _run(fake, requests(12), LoadConfig(mode="batch", batch_size=4, num_requests=12, warmup_requests=1))
    warm = [r for r in res.records if r.warmup]
    assert len(warm) == 1 and warm[0].send_time_s == 0  # the warm-up request runs alone first
    res.records = [r for r in res.records if not r.warmup]
    sends = sorted({round(r.send_time_s, 9) for r in res.records})
    assert len(sends) == 3  # then three waves of four
    assert all(sum(round(r.send_time_s, 9) == t for r in res.records) == 4 for t in sends)
    first_wave_done = max(r.finish_time_s for r in res.records if round(r.send_time_s, 9) == sends[0])
    assert sends[1] == pytest.approx(first_wave_done)


def test_build_requests_is_seeded_and_follows_the_length_distributions():
    p = LengthDist.parse("prompt_tokens", {"dist": "uniform", "min": 8, "max": 16})
    o = LengthDist.parse("output_tokens", 5)
    a = build_requests(50, p, o, seed=1, vocab_size=100)
    b = build_requests(50, p, o, seed=1, vocab_size=100)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert all(8 <= len(r.prompt_ids) <= 16 and r.max_new_tokens == 5 for r in a)
    assert len({len(r.prompt_ids) for r in a}) > 4
    with pytest.raises(ValueError, match="prompt_tokens.dist"):
        LengthDist.parse("prompt_tokens", {"dist": "zipf", "value": 3})


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(mode="poisson", num_requests=1), "mode"),
        (dict(mode="rate", num_requests=1), "rate_req_per_s"),
        (dict(mode="concurrency", concurrency=2), "num_requests, duration_s"),
        (dict(mode="rate", rate_req_per_s=1, burstiness=0.5, num_requests=1), "burstiness"),
        (dict(mode="batch", batch_size=0, num_requests=1), "batch_size"),
    ],
)
def test_load_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        LoadConfig(**kw)


# ---------------------------------------------------------------------------- replies, windows and trace replay
def test_a_reply_without_token_times_is_an_error_of_a_named_kind_and_the_point_is_summarized():
    class Client:
        async def generate(self, req):
            second = req.request_id.endswith("#1")
            return GenerationResult(
                req.request_id, 1, output_ids=[5, 6, 7], token_times_s=[] if second else [1.0, 1.1, 1.2]
            )

    res = _run(Client(), requests(4), LoadConfig(mode="batch", batch_size=4, num_requests=4))
    m = res.metrics
    assert (m.completed_requests, m.failed_requests, m.errors_by_kind) == (3, 1, {"missing_token_times": 1})
    [bad] = [r for r in res.records if not r.ok]
    assert bad.request_id == "q1#1" and bad.output_tokens == 3 and "3 generated ids but 0 token times" in bad.error
    assert m.output_tokens == 9 and m.e2e_latency_s.n == 3


def test_four_ids_in_two_streamed_chunks_count_four_tokens_with_zero_gaps_inside_a_chunk():
    class Streamer:
        async def events(self, req):
            import asyncio

            await asyncio.sleep(0.1)
            yield StreamChunk([11, 12], 0.1)
            await asyncio.sleep(0.3)
            yield StreamChunk([13, 14], 0.4)

    res = _run(Streamer(), requests(1), LoadConfig(mode="concurrency", concurrency=1, num_requests=1))
    (rec,) = res.records
    m = res.metrics
    assert rec.output_tokens == 4 and m.output_tokens == 4
    assert rec.token_times_s == [0.1, 0.1, 0.4, 0.4]
    assert sorted(rec.itl_s) == pytest.approx([0.0, 0.0, 0.3])
    assert m.tpot_s.mean_s == pytest.approx(0.3 / 3)  # (e2e - ttft) / (4 - 1)
    assert m.inter_chunk_gap_s.mean_s == pytest.approx(0.3) and m.inter_chunk_gap_s.n == 1


def test_a_stream_without_times_is_stamped_on_arrival_and_an_error_chunk_ends_it():
    class Streamer:
        async def events(self, req):
            import asyncio

            await asyncio.sleep(0.2)
            yield StreamChunk([1])
            await asyncio.sleep(0.1)
            yield StreamChunk([], error_kind="replica_died", error="stream ended by the server")

    res = _run(Streamer(), requests(2), LoadConfig(mode="concurrency", concurrency=1, num_requests=2))
    assert res.records[0].token_times_s == [pytest.approx(0.2)]
    assert res.metrics.errors_by_kind == {"replica_died": 2} and res.metrics.completed_requests == 0


def _instant(req):
    return Script(ttft_s=0.0, gap_s=0.0)


def test_an_instant_client_at_40_req_s_is_not_saturated_nor_delayed():
    from workloads.serving.suite import Saturation

    cfg = LoadConfig(mode="rate", rate_req_per_s=40, num_requests=16, seed=7)
    m = _run(FakeReplica(script=_instant), requests(16), cfg).metrics
    assert m.sent_requests == 16 and m.delayed_arrivals == 0 and m.dropped_arrivals == 0
    assert m.target_rate_req_per_s == 40
    # the 16 arrivals drawn with seed 7 span a rate well below 40 req/s: that is the schedule, not saturation
    assert m.scheduled_rate_req_per_s < 0.8 * 40
    assert m.achieved_rate_req_per_s == pytest.approx(m.scheduled_rate_req_per_s)
    assert not [w for w in m.warnings if w.startswith("rate:")]
    assert Saturation().reason(m.flat()) is None
    # the point says its schedule is not its target, and why
    (note,) = [w for w in m.warnings if w.startswith("scheduled rate:")]
    assert f"the 16 arrival times drawn span {m.scheduled_rate_req_per_s:.3g} req/s, not the target 40 req/s" in note


@pytest.mark.parametrize("n, seed, noted", [(4, 2, True), (4, 5, True), (2000, 3, False), (64, 0, None)])
def test_a_poisson_point_states_when_its_drawn_schedule_strays_from_its_target_rate(n, seed, noted):
    cfg = LoadConfig(mode="rate", rate_req_per_s=1.0, num_requests=n, seed=seed)
    m = _run(FakeReplica(script=_instant), requests(8), cfg).metrics
    off = abs(m.scheduled_rate_req_per_s - 1.0)
    notes = [w for w in m.warnings if w.startswith("scheduled rate:")]
    assert bool(notes) == (off > 0.1)  # the tolerance: 10% of the target
    if noted is not None:
        assert bool(notes) is noted
    if notes:
        assert f"span {m.scheduled_rate_req_per_s:.3g} req/s, not the target 1 req/s" in notes[0]
        assert f"a random sample of {n} arrivals" in notes[0]


def test_on_the_wall_clock_no_arrival_counts_as_delayed_without_a_cap():
    import asyncio

    from workloads.serving.suite import Saturation

    class Instant:
        async def generate(self, req):
            t = time.time()
            return GenerationResult(req.request_id, 1, output_ids=[1], token_times_s=[t])

    cfg = LoadConfig(mode="rate", rate_req_per_s=40, num_requests=16, seed=7)
    m = asyncio.run(run_load(Instant(), requests(16), cfg)).metrics
    assert m.delayed_arrivals == 0 and m.sent_requests == m.completed_requests == 16
    assert Saturation().reason(m.flat()) is None


def test_a_count_that_ends_first_closes_the_window_at_the_last_token():
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.02, gap_s=0.02))  # 10 tokens, 20 ms apart
    cfg = LoadConfig(mode="concurrency", concurrency=2, num_requests=6, duration_s=10)
    m = _run(fake, requests(6, new_tokens=10), cfg).metrics
    assert m.stop_reason == "count"
    assert m.window_s == pytest.approx(0.6)  # 3 waves of 0.2 s, not 10 s
    assert m.output_tokens == 60 and m.output_throughput_tok_per_s == pytest.approx(100.0)
    assert m.request_throughput_req_per_s == pytest.approx(10.0)


def test_a_duration_that_ends_first_says_duration():
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.02, gap_s=0.02))
    cfg = LoadConfig(mode="concurrency", concurrency=2, num_requests=100, duration_s=0.91)
    m = _run(fake, requests(6, new_tokens=10), cfg).metrics
    assert m.stop_reason == "duration" and m.window_s == pytest.approx(0.91)
    # 5 waves sent (0, 0.2, ..., 0.8 s); the 5th wave's tokens after 0.91 s are outside the window
    assert m.sent_requests == 10 and m.output_tokens == 4 * 20 + 2 * 5
    # the count reached, but the last token after the deadline: the duration ended the window
    cfg = LoadConfig(mode="concurrency", concurrency=2, num_requests=6, duration_s=0.5)
    m = _run(fake, requests(6, new_tokens=10), cfg).metrics
    assert m.stop_reason == "duration" and m.window_s == pytest.approx(0.5)
    # duration only
    m = _run(fake, requests(6, new_tokens=10), LoadConfig(mode="concurrency", concurrency=2, duration_s=1.0)).metrics
    assert m.stop_reason == "duration" and m.window_s == pytest.approx(1.0)


def test_server_side_counts_cover_the_same_requests_as_the_client(tmp_path):
    """Rate mode with a time-based warm-up, then 4 measured requests, on the tiny model's real engine."""
    import torch
    import yaml

    from scissorhands.testing import tiny_llama
    from workloads.core.template import run_suite
    from workloads.serving.pools import LocalReplicaPool
    from workloads.serving.runner import ServingKind

    torch.set_num_threads(1)
    suite = tmp_path / "l20.yaml"
    suite.write_text(
        yaml.safe_dump(
            serving_suite(
                name="l20",
                mode="rate",
                policies=["full"],
                loads=[20],
                prompt_tokens=8,
                new_tokens=3,
                num_requests=4,
                warmup_s=0.3,
            )
        )
    )

    args = sweep.parse_args(
        [str(suite), "--results-dir", str(tmp_path / "r"), "--run-id", "run", "--pushgateway", "off"]
    )
    assert run_suite(args, ServingKind(LocalReplicaPool(1, "tiny-llama", model=tiny_llama(0)))) == 0
    [rec] = [json.loads(x) for x in (tmp_path / "r" / "run" / "points.jsonl").read_text().splitlines()]
    [stats] = rec["replica_stats"]
    assert rec["warmup_requests"] >= 1 and rec["sent_requests"] == 4
    assert stats["received_requests"] == stats["completed_requests"] == rec["completed_requests"] == 4
    assert stats["generated_tokens"] == rec["output_tokens"] == 4 * 3
    assert stats["warmup_received_requests"] == rec["warmup_requests"]
    assert stats["warmup_generated_tokens"] == 3 * rec["warmup_requests"]


AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:46.7805900,396,109
2023-11-16 18:15:47.0805905,879,4
2023-11-16 18:15:49.6805900,91,7
"""


def test_trace_replay_sends_each_row_at_its_scaled_time_with_its_lengths(tmp_path):
    from workloads.load.patterns import LOAD_PATTERNS, TraceLoad
    from workloads.load.traces import read_trace

    path = tmp_path / "azure.csv"
    path.write_text(AZURE_CSV)
    rows = read_trace(path)
    assert [r.arrival_s for r in rows] == pytest.approx([0.0, 0.1, 0.4000005, 3.0], abs=1e-9)
    assert [(r.prompt_tokens, r.output_tokens) for r in rows] == [(374, 44), (396, 109), (879, 4), (91, 7)]
    assert LOAD_PATTERNS["trace"] is TraceLoad
    cfg = LoadConfig(mode="trace", trace_path=str(path), trace_time_scale=0.5)
    reqs = TraceLoad(cfg).requests(vocab_size=100)
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.01, gap_s=0.001))
    res = _run(fake, reqs, cfg)
    sends = [r.send_time_s for r in res.records]
    assert sends == pytest.approx([0.0, 0.05, 0.20000025, 1.5], abs=1e-9)  # offsets x 0.5
    assert [(r.prompt_tokens, r.max_new_tokens) for r in res.records] == [(374, 44), (396, 109), (879, 4), (91, 7)]
    m = res.metrics
    assert m.stop_reason == "count" and m.sent_requests == 4 and m.output_tokens == 44 + 109 + 4 + 7
    assert m.target_rate_req_per_s == pytest.approx(3 / 1.5)
    assert m.scheduled_rate_req_per_s == pytest.approx(3 / 1.5) and not [w for w in m.warnings if "rate" in w]


def test_trace_replay_shares_warm_up_and_bounds_and_reads_jsonl(tmp_path):
    from workloads.load.patterns import TraceLoad

    path = tmp_path / "ours.jsonl"
    path.write_text(
        "".join(
            json.dumps({"arrival_time_s": 0.25 * i, "prompt_tokens": 4 + i, "output_tokens": 2}) + "\n"
            for i in range(10)
        )
    )
    cfg = LoadConfig(mode="trace", trace_path=str(path), warmup_requests=2, num_requests=5)
    res = _run(FakeReplica(), TraceLoad(cfg).requests(vocab_size=50), cfg)
    assert [r.warmup for r in res.records] == [True, True, False, False, False, False, False]
    assert [r.prompt_tokens for r in res.records] == [4, 5, 6, 7, 8, 9, 10]
    assert res.metrics.window_start_s == pytest.approx(0.5) and res.metrics.stop_reason == "count"
    cfg = LoadConfig(mode="trace", trace_path=str(path), duration_s=1.0)
    res = _run(FakeReplica(), TraceLoad(cfg).requests(vocab_size=50), cfg)
    assert res.metrics.stop_reason == "duration" and len(res.records) == 4  # sent at 0, 0.25, 0.5, 0.75


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "time,ContextTokens,GeneratedTokens\n1,2,3\n",
            r"expected one of \(TIMESTAMP, ContextTokens, GeneratedTokens\)",
        ),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n5,2,3\n4,2,3\n", r"row 2, TIMESTAMP: earlier than the row before"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n5,2,0\n", r"row 1, GeneratedTokens: expected an integer >= 1"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,2,1\n", r"row 1, TIMESTAMP: not a number of seconds"),
    ],
)
def test_trace_errors_name_the_row_and_column(tmp_path, text, match):
    from workloads.load.traces import read_trace

    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_trace(path)
    with pytest.raises(ValueError, match=match):
        LoadConfig(mode="trace", trace_path=str(path))  # checked when the config is made
    with pytest.raises(ValueError, match="trace_path: required in mode 'trace'"):
        LoadConfig(mode="trace")
    with pytest.raises(ValueError, match="trace_path: no such file"):
        LoadConfig(mode="trace", trace_path=str(tmp_path / "missing.csv"))


def test_the_serving_replicas_own_stream_feeds_the_load_generator(tmp_path):
    """`ServingReplica.events` (one `StreamChunk` per token, then the `GenerationResult`) on the tiny model:
    one time per id."""
    import asyncio

    import torch

    from replica.continuous import ServingReplica
    from scissorhands.testing import tiny_llama

    torch.set_num_threads(1)
    replica = ServingReplica(replica_id="s0", model_spec="tiny-llama", model=tiny_llama(0))
    replica.configure({"policy": "full"})
    try:
        res = asyncio.run(
            run_load(
                replica,
                requests(3, new_tokens=5),
                LoadConfig(mode="concurrency", concurrency=2, num_requests=3, warmup_requests=1),
            )
        )
        stats = asyncio.run(replica.stats())
    finally:
        replica.shutdown()
    m = res.metrics
    assert m.completed_requests == 3 and m.output_tokens == 15 and m.itl_s.n == 3 * 4
    assert all(r.replica_id == "s0" and len(r.token_times_s) == 5 for r in res.records)
    assert (stats["received_requests"], stats["warmup_received_requests"], stats["generated_tokens"]) == (3, 1, 15)


def test_a_serving_suite_replays_a_trace_on_the_tiny_model(tmp_path):
    """`mode: trace` with `trace_path` and `trace_time_scale`: one point per series, the trace's lengths."""

    import torch
    import yaml

    from scissorhands.testing import tiny_llama
    from workloads.core.suite import SuiteError
    from workloads.core.template import run_suite
    from workloads.kinds import load_suite
    from workloads.serving.pools import LocalReplicaPool
    from workloads.serving.runner import ServingKind

    torch.set_num_threads(1)
    trace = tmp_path / "azure.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:4{i}.5000000,{6 + i},{2 + i % 3}\n" for i in range(6))
    )
    body = tiny_suite(
        "serving",
        name="replay",
        mode="trace",
        compression_ratios=[2],
        trace_path=str(trace),
        trace_time_scale=0.05,
        warmup_requests=1,
        seed=0,
    )
    suite = tmp_path / "replay.yaml"
    suite.write_text(yaml.safe_dump(body))
    s = load_suite(str(suite))
    assert [p.load for p in s.points()] == [0.05, 0.05] and s.max_length_tokens == 11 + 4
    args = sweep.parse_args(
        [str(suite), "--results-dir", str(tmp_path / "r"), "--run-id", "run", "--pushgateway", "off"]
    )
    assert run_suite(args, ServingKind(LocalReplicaPool(1, "tiny-llama", model=tiny_llama(0)))) == 0
    recs = [json.loads(x) for x in (tmp_path / "r" / "run" / "points.jsonl").read_text().splitlines()]
    assert [r["status"] for r in recs] == ["ok", "ok"]
    for r in recs:
        assert (r["warmup_requests"], r["sent_requests"], r["completed_requests"]) == (1, 5, 5)
        assert r["stop_reason"] == "count" and r["load_config"]["trace_time_scale"] == 0.05
        assert r["output_tokens"] == sum(2 + i % 3 for i in range(1, 6))  # rows 2-6, measured
        assert r["target_rate_req_per_s"] == pytest.approx(5 / (5 * 0.05))
    for bad, match in (
        (dict(body, prompt_tokens=8), "prompt_tokens: not used in mode trace"),
        (dict(body, trace_path=str(tmp_path / "none.csv")), "trace_path: no such file"),
        ({k: v for k, v in body.items() if k != "trace_path"}, "trace_path: mode trace needs a trace file"),
    ):
        suite.write_text(yaml.safe_dump(bad))
        with pytest.raises(SuiteError, match=match):
            load_suite(str(suite))


def _warmups_then_measured(i: int) -> GenerationRequest:
    """Requests 0-3 warm up with 10/30/50/70 tokens; every later one asks 40."""
    return GenerationRequest(f"q{i}", [1] * 8, (10, 30, 50, 70)[i] if i < 4 else 40)


def test_throughput_counts_the_tokens_warm_up_requests_produce_inside_the_window():
    """GuideLLM's rule: the window's throughput credits every token produced in it, as its concurrency counts every
    request in flight in it. Concurrency 4, warm-ups of 10/30/50/70 tokens, 8 measured requests of 40, 100 tok/s per
    request: the window runs from 0.1 s (the first warm-up ends) to 1.3 s, and holds 320 measured tokens and
    1 + 21 + 41 + 61 warm-up ones: 444 / 1.2 s = 370 tok/s (measured tokens alone: 266.7)."""
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.01, gap_s=0.01))
    cfg = LoadConfig(mode="concurrency", concurrency=4, num_requests=8, warmup_requests=4)
    m = _run(fake, _warmups_then_measured, cfg).metrics
    assert m.window_start_s == pytest.approx(0.1) and m.window_s == pytest.approx(1.2)
    assert m.output_tokens == 320  # the measured requests' own tokens (what the replicas count as measured)
    assert m.window_output_tokens == 444
    assert m.output_throughput_tok_per_s == pytest.approx(370.0, rel=1e-6)
    # the point's concurrency and its throughput agree: 100 tok/s per request in flight
    assert m.achieved_mean_concurrency == pytest.approx(4.4 / 1.2, rel=1e-6)
    assert m.output_throughput_tok_per_s == pytest.approx(100 * m.achieved_mean_concurrency, rel=0.02)
    # prompt tokens: every request whose first token came inside the window (the warm-ups' came at 0.01 s, before it)
    assert m.window_input_tokens == m.input_tokens == 8 * 8
    assert m.total_throughput_tok_per_s == pytest.approx((444 + 64) / 1.2, rel=1e-6)
    # goodput counts only measured requests that met the SLO: all 8 here, so their 320 tokens
    assert m.slo_met_requests == 8 and m.goodput_tok_per_s == pytest.approx(320 / 1.2, rel=1e-6)
    assert m.goodput_tok_per_s <= m.output_throughput_tok_per_s


def test_throughput_leaves_out_tokens_after_a_duration_windows_end_whatever_the_request():
    """Concurrency 2 of 100-token requests at 100 tok/s after warm-ups of 50 and 30 tokens, a 1.505 s window from
    0.3 s: the 30-token warm-up's last token opens it, the 50-token one straddles its start (21 tokens inside), the
    second measured wave its end (50 and 30 tokens inside). So 302 tokens / 1.505 s = 200.7 tok/s = 2 in flight x 100
    tok/s; measured tokens alone: 280."""
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.01, gap_s=0.01))

    def make(i):
        return GenerationRequest(f"q{i}", [1] * 8, (50, 30)[i] if i < 2 else 100)

    m = _run(fake, make, LoadConfig(mode="concurrency", concurrency=2, duration_s=1.505, warmup_requests=2)).metrics
    assert m.stop_reason == "duration" and m.window_start_s == pytest.approx(0.3) and m.window_s == pytest.approx(1.505)
    assert m.window_output_tokens == 1 + 21 + 100 + 50 + 100 + 30 and m.output_tokens == 280
    assert m.output_throughput_tok_per_s == pytest.approx(302 / 1.505, rel=1e-6)
    assert m.output_throughput_tok_per_s == pytest.approx(100 * m.achieved_mean_concurrency, rel=0.01)


def test_batch_mode_warm_ups_end_before_the_window_so_every_window_token_is_measured():
    fake = FakeReplica(script=lambda r: Script(ttft_s=0.01, gap_s=0.01))

    def make(i):
        return GenerationRequest(f"q{i}", [1] * 8, 70 if i < 2 else 40)

    m = _run(fake, make, LoadConfig(mode="batch", batch_size=4, num_requests=8, warmup_requests=2)).metrics
    # the window opens when the first measured batch is sent, after the warm-up batch (it opened at 0 s before, when
    # the warm-up batch asked for its next index, and counted the warm-up batch's 0.7 s: 320 / 1.5 s = 213 tok/s)
    assert m.window_start_s == pytest.approx(0.7) and m.window_s == pytest.approx(0.8)
    # the warm-up batch's last tokens come the instant the window opens: at most those two inside it
    assert m.output_tokens == 320 and m.window_output_tokens - m.output_tokens <= 2
    assert m.output_throughput_tok_per_s == pytest.approx(m.window_output_tokens / 0.8)


def test_tokens_a_failed_request_produced_inside_the_window_count_in_throughput_not_in_goodput():
    ok = RequestRecord("a", 8, 4, send_time_s=0.0, token_times_s=[0.1, 0.15, 0.2, 0.25], output_tokens=4)
    ok.finish_time_s = 0.4
    cut = RequestRecord("b", 8, 4, send_time_s=0.0, token_times_s=[0.1, 0.2], output_tokens=2, error_kind="timeout")
    cut.finish_time_s = 0.5
    warm = RequestRecord("w", 8, 9, send_time_s=-1.0, token_times_s=[-0.5, 0.25, 0.35], output_tokens=3, warmup=True)
    warm.finish_time_s = 0.35
    m = summarize([warm, ok, cut], mode="concurrency", window_start_s=0.0, window_end_s=0.5)
    assert m.output_tokens == 4 and m.window_output_tokens == 4 + 2 + 2
    assert m.output_throughput_tok_per_s == pytest.approx(16.0)
    assert m.window_input_tokens == 16  # the warm-up's first token came before the window: its prompt is not in it
    assert m.goodput_tok_per_s == pytest.approx(8.0) and m.slo_met_requests == 1


def test_a_rate_the_replicas_cannot_keep_up_with_is_flagged_as_a_shortfall_in_record_table_and_progress_line():
    """0.3 req/s offered to a replica that serves one request at a time in 14.5 s (0.069 req/s): every request is sent
    on schedule, so the send rate alone says nothing; the completions say the rate was not served."""
    fake = FakeReplica(script=lambda r: Script(ttft_s=14.1, gap_s=0.1), capacity=1)
    cfg = LoadConfig(mode="rate", rate_req_per_s=0.3, num_requests=16, seed=1)
    m = _run(fake, requests(16, new_tokens=5), cfg).metrics
    assert m.achieved_rate_req_per_s == pytest.approx(m.scheduled_rate_req_per_s)  # sends kept the schedule
    assert m.completed_requests == 16 and m.completed_rate_req_per_s == pytest.approx(1 / 14.5, rel=1e-6)
    assert m.rate_shortfall is True
    (note,) = [w for w in m.warnings if w.startswith("rate shortfall:")]
    assert f"{m.scheduled_rate_req_per_s:.3g} req/s offered, completed 0.069 req/s" in note
    rec = {**m.flat(), "point_id": "rate-full-L0.3", "status": "ok", "series": "full", "load": 0.3}
    assert rec["rate_shortfall"] is True and rec["completed_rate_req_per_s"] == pytest.approx(0.069, abs=1e-3)
    line = ServingKind().one_line(rec)
    assert "RATE SHORTFALL: 0.069 req/s completed" in line and "warning: rate shortfall:" in line
    table = table_markdown([rec])
    assert f"0.3/{m.scheduled_rate_req_per_s:.3g}/{m.achieved_rate_req_per_s:.3g}/0.069 SHORTFALL" in table
    assert "SHORTFALL: the point sent less than 95%" in table


def test_a_send_shortfall_alone_sets_the_flag_with_a_warning_naming_the_load_generator():
    """Arrivals drawn at 10 req/s sent at 9 req/s (below 95%) and each answered at once (completions keep up, above
    80%): the point is a rate shortfall, and its `rate shortfall:` warning says the sends fell behind."""
    records = []
    for i in range(11):
        sent = i / 9
        r = RequestRecord(f"q{i}", 8, 1, scheduled_time_s=i / 10, send_time_s=sent, token_times_s=[sent + 0.01])
        r.output_tokens, r.finish_time_s = 1, sent + 0.01
        records.append(r)
    m = summarize(records, mode="rate", window_start_s=0.0, window_end_s=1.2, target_rate_req_per_s=10.0)
    assert m.achieved_rate_req_per_s == pytest.approx(9.0) and m.completed_rate_req_per_s == pytest.approx(9.0)
    assert m.rate_shortfall is True
    (note,) = [w for w in m.warnings if w.startswith("rate shortfall:")]
    assert (
        note
        == "rate shortfall: 10 req/s offered, sent 9 req/s (below 95%: the load generator fell behind its schedule)"
    )
    assert "did not keep up" not in note


@pytest.mark.parametrize(
    "mode, script, timeout_s, expected",
    [
        ("rate", Script(ttft_s=0.05, gap_s=0.01), None, False),  # keeps up
        ("rate", Script(ttft_s=0.4, gap_s=0.01), None, True),  # one at a time, 0.4-0.8 s each: under 2 of 4 req/s
        ("rate", Script(ttft_s=0.05, gap_s=0.01), 0.06, True),  # every other request (long ones) times out
        ("concurrency", Script(ttft_s=0.4, gap_s=0.01), None, None),  # a closed loop offers no rate
    ],
)
def test_rate_shortfall_is_judged_on_completions_against_the_rate_offered(mode, script, timeout_s, expected):
    fake = FakeReplica(script=lambda r: script, capacity=1 if script.ttft_s > 0.1 else None)
    load = {"rate_req_per_s": 4.0} if mode == "rate" else {"concurrency": 2}
    cfg = LoadConfig(mode=mode, num_requests=40, seed=3, request_timeout_s=timeout_s, **load)
    reqs = [GenerationRequest(f"q{i}", [1] * 8, 1 if i % 2 else 40) for i in range(40)]
    m = _run(fake, reqs, cfg).metrics
    assert m.rate_shortfall is expected
    if timeout_s:
        assert m.errors_by_kind == {"timeout": 20} and any("only 20 of 40 arrivals completed" in w for w in m.warnings)


def test_a_batch_asking_for_warm_ups_gets_none_when_warm_up_ended_and_the_window_stays_closed():
    ticks = iter([0.0, 0.9, 1.1, 1.2])  # the run starts at 0; warm-up ends at 1.0
    cfg = LoadConfig(mode="batch", batch_size=4, num_requests=4, warmup_s=1.0)
    run = Run(None, None, cfg, clock=lambda: next(ticks))
    assert run.next_index() == (0, True)  # read at 0.9: warm-up
    assert run.next_index(warmup=True) is None  # read at 1.1: measured, not asked for
    assert (run.window_start, run.issued, run.measured) == (None, 1, 0)  # nothing opened, nothing handed out
    assert run.next_index(warmup=False) == (1, False) and run.window_start == 1.2  # opened by the measured one
