"""Metric catalogue, naming conventions, ReplicaMetrics without Ray, SweepPusher without a Pushgateway.

The tests against a real Ray head, Prometheus and Pushgateway are in test_metrics_prometheus.py.
"""

import logging
import math
import re

import pytest
import torch
from prometheus_client import generate_latest

from replica.common.metric_labels import POINT_LABELS, REPLICA_LABELS
from replica.common.types import EngineConfig, GenerationRequest
from replica.engine import ContinuousBatchingEngine
from replica.metrics import (
    LATENCY_BUCKETS_S,
    LATENCY_TOP_S,
    METRICS,
    PAGED_LAYOUT_METRICS,
    PREFIX_CACHE_METRICS,
    RECORD_QUANTILES,
    SERVE_LATENCY_BUCKETS_MS,
    SERVE_METRICS,
    ReplicaMetrics,
    exported_metric_names,
    metric,
    ratio_label,
    strip_sample_suffix,
)
from tests.waiting import free_port
from workloads.core.push import SweepPusher, resolve_pushgateway_url

#: The labels a metric may carry, written out here so a new label fails the test until it is reviewed: the live
#: replica labels and their phase, the sweep axes of a point summary and the quantile of a record's percentile
#: series; none takes a value per request.
ALLOWED_LABELS = set(
    "batch_size budget_tokens compression_ratio concurrency engine kv_bits model new_tokens phase policy prompt_tokens "
    "quantile replica request_rate run_id task".split()
)
UNIT_SUFFIXES = (
    "_seconds",
    "_bytes",
    "_tokens",
    "_tokens_total",
    "_tokens_per_second",
    "_requests_per_second",  # goodput in requests
    "_ratio",
    "_sequences",
    "_slots",
    "_requests",
    "_size",
    "_completed",
    "_planned",
    "_perplexity",
    "_blocks",  # KV blocks of the paged layout's pool
    "_blocks_total",  # a count of KV blocks (the prefix cache's reclaimed blocks)
    "_preemptions_total",  # a count of events is its own unit, as requests are
)


# --------------------------------------------------------------------------- naming conventions
@pytest.mark.parametrize("spec", METRICS, ids=lambda m: m.name)
def test_metric_names_follow_the_conventions(spec):
    assert re.fullmatch(r"[a-z_][a-z0-9_]*", spec.name), spec.name
    assert spec.name.startswith("scissorhands_")
    assert spec.kind in ("counter", "gauge", "histogram")
    assert spec.source in ("ray", "pushgateway")
    assert (spec.kind == "counter") == spec.name.endswith("_total"), "counters, and only counters, end in _total"
    # a histogram's exact-sum counter is `<histogram>_exact_sum_total`: its unit is the histogram's
    unit_name = spec.name.removesuffix("_exact_sum_total")
    assert unit_name.endswith(UNIT_SUFFIXES) or spec.name == "scissorhands_sweep_perplexity", spec.name
    # base units only: no milliseconds, kilobytes, percent
    assert not re.search(r"_(ms|milliseconds|s|kb|mb|gb|kib|mib|percent|pct)(_|$)", spec.name), spec.name
    if any(w in spec.name for w in ("ttft", "tpot", "latency", "_load_", "prefill_seconds", "step")):
        assert unit_name.endswith("_seconds"), spec.name
    if "bytes" in spec.name:
        assert spec.name.endswith("_bytes")
    assert spec.help.strip() and spec.help.endswith(".")
    assert set(spec.labels) <= ALLOWED_LABELS, set(spec.labels) - ALLOWED_LABELS
    assert "request_id" not in spec.labels
    if spec.source == "ray":
        assert spec.labels in (REPLICA_LABELS, REPLICA_LABELS + ("phase",))
        assert spec.exported_name == "ray_" + spec.name  # Ray 2.60 prefixes application metrics
    else:
        assert spec.exported_name == spec.name
    if spec.kind == "histogram" and spec.name.endswith("_seconds"):
        assert spec.buckets == LATENCY_BUCKETS_S, "every latency histogram has the latency buckets"
    if spec.kind == "counter":
        assert spec.ray_name + "_total" == spec.name  # Ray adds _total to counters on export


def test_catalogue_names_are_unique_and_complete():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert metric("scissorhands_ttft_seconds").kind == "histogram"
    with pytest.raises(KeyError, match="scissorhands_ttft_seconds"):
        metric("scissorhands_ttft_ms")
    live = exported_metric_names("ray")
    assert "ray_scissorhands_generated_tokens_total" in live
    assert "scissorhands_sweep_output_throughput_tokens_per_second" in exported_metric_names("pushgateway")
    assert all(n.startswith("ray_scissorhands_") for n in live)


def test_latency_buckets_are_fine_enough_for_twenty_percent():
    ratios = [b / a for a, b in zip(LATENCY_BUCKETS_S, LATENCY_BUCKETS_S[1:])]
    assert all(1.15 < r <= 1.251 for r in ratios), max(ratios)
    assert LATENCY_BUCKETS_S == tuple(sorted(set(LATENCY_BUCKETS_S)))
    assert 0.005 > LATENCY_BUCKETS_S[8] and 0.15 in LATENCY_BUCKETS_S  # 4.7 ms < 5 ms <= 5.6 ms


def test_latency_buckets_reach_past_a_day():
    """1 ms .. 100,000 s: a saturated point's 100-150 s TTFTs, or a request waited on for a day, land in
    finite buckets no more than 25% wide, not in +Inf (where a quantile would read as the top bound)."""
    assert LATENCY_BUCKETS_S[0] == 0.001 and LATENCY_BUCKETS_S[-1] == LATENCY_TOP_S == 100_000.0
    assert len(LATENCY_BUCKETS_S) == 97
    assert LATENCY_TOP_S > 24 * 3600
    assert {100.0, 120.0, 150.0} <= set(LATENCY_BUCKETS_S)  # 100-150 s lies in two buckets


def test_serve_latency_buckets_are_the_ones_ray_serve_records():
    """The catalogue's top bound of Serve's latency histograms (what its panels guard against) is Ray's own."""
    from ray.serve._private.constants import REQUEST_LATENCY_BUCKETS_MS

    assert SERVE_LATENCY_BUCKETS_MS == tuple(float(b) for b in REQUEST_LATENCY_BUCKETS_MS)
    assert SERVE_LATENCY_BUCKETS_MS[-1] == 600_000.0  # 10 minutes
    for spec in SERVE_METRICS:
        assert spec.buckets == (SERVE_LATENCY_BUCKETS_MS if spec.kind == "histogram" else ())


def test_strip_sample_suffix():
    assert strip_sample_suffix("ray_scissorhands_ttft_seconds_bucket") == "ray_scissorhands_ttft_seconds"
    assert strip_sample_suffix("ray_scissorhands_generated_tokens_total") == "ray_scissorhands_generated_tokens"
    assert strip_sample_suffix("scissorhands_sweep_kv_cache_bytes") == "scissorhands_sweep_kv_cache_bytes"


def test_ratio_label():
    assert ratio_label("scissorhands", 5) == ratio_label("scissorhands", 5.0) == "5"
    assert ratio_label("scissorhands", 2.5) == "2.5"
    assert ratio_label("full", None) == "1"
    assert ratio_label("scissorhands", None) == ""  # absolute budget


# --------------------------------------------------------------------------- ReplicaMetrics without Ray
def test_replica_metrics_records_in_memory_without_ray():
    m = ReplicaMetrics("scissorhands", 5, "replica-0", "tiny-llama", "run-1", use_ray=False)
    assert not m.uses_ray
    m.observe_prefill(0.25, tokens=512)
    m.observe_decode_step(0.01, batch_size=4)
    m.observe_decode_step(0.03, batch_size=4)
    m.observe_ttft(0.25)
    m.observe_tpot(0.02)
    m.set_running(4)
    m.set_queued(2)
    m.set_queued(0)
    m.add_generated_tokens(4)
    m.add_generated_tokens(12)
    m.add_generated_tokens(0)  # ignored
    m.set_kv_cache(bytes=3 * 2**20, slots=128)
    m.add_evictions(7)
    m.observe_model_load(1.5)
    m.set_kv_blocks(used=12, free=30)
    m.add_preemption(recomputed_tokens=40)
    m.add_preemption(recomputed_tokens=9)
    m.add_prefix_cache_tokens(hit=32, miss=7)
    m.set_prefix_cache(blocks=11, reclaimed_blocks=3)
    snap = m.snapshot()
    assert snap["scissorhands_prefill_seconds"] == (1, 0.25)
    assert snap["scissorhands_prefill_tokens_total"] == 512
    assert snap["scissorhands_decode_step_seconds"] == (2, pytest.approx(0.04))
    assert snap["scissorhands_decode_batch_size"] == (2, 8.0)
    assert snap["scissorhands_ttft_seconds"] == (1, 0.25)
    assert snap["scissorhands_tpot_seconds"] == (1, 0.02)
    assert snap["scissorhands_running_sequences"] == 4
    assert snap["scissorhands_queued_sequences"] == 0
    assert snap["scissorhands_generated_tokens_total"] == 16
    assert snap["scissorhands_kv_cache_bytes"] == 3 * 2**20
    assert snap["scissorhands_kv_cache_slots"] == 128
    assert snap["scissorhands_evicted_tokens_total"] == 7
    assert snap["scissorhands_model_load_seconds"] == 1.5
    assert snap["scissorhands_kv_used_blocks"] == 12 and snap["scissorhands_kv_free_blocks"] == 30
    assert snap["scissorhands_preemptions_total"] == 2 and snap["scissorhands_recomputed_tokens_total"] == 49
    assert snap["scissorhands_prefix_cache_hit_tokens_total"] == 32
    assert snap["scissorhands_prefix_cache_miss_tokens_total"] == 7
    assert snap["scissorhands_kv_prefix_cache_blocks"] == 11
    assert snap["scissorhands_prefix_cache_reclaimed_blocks_total"] == 3
    assert set(snap) == {s.name for s in METRICS if s.source == "ray"}
    assert m.tags == {
        "policy": "scissorhands",
        "compression_ratio": "5",
        "replica": "replica-0",
        "model": "tiny-llama",
        "run_id": "run-1",
        "engine": "ours",  # the default: our own engine's figures
    }


def test_for_point_keeps_series_apart():
    base = ReplicaMetrics("full", None, "replica-1", "tiny-llama", "run-2", use_ray=False)
    a = base.for_point("scissorhands", 2)
    b = base.for_point("scissorhands", 5)
    a.add_generated_tokens(3)
    b.add_generated_tokens(5)
    base.add_generated_tokens(1)
    assert a.snapshot()["scissorhands_generated_tokens_total"] == 3
    assert b.snapshot()["scissorhands_generated_tokens_total"] == 5
    assert base.snapshot()["scissorhands_generated_tokens_total"] == 1
    assert base.tags["compression_ratio"] == "1" and b.tags["compression_ratio"] == "5"
    assert b.tags["replica"] == "replica-1" and b.tags["run_id"] == "run-2"
    c = base.for_point("scissorhands", 5, run_id="run-3")
    c.add_generated_tokens(2)
    assert c.tags["run_id"] == "run-3" and c.snapshot()["scissorhands_generated_tokens_total"] == 2
    assert b.snapshot()["scissorhands_generated_tokens_total"] == 5


def test_replica_metrics_defaults_to_memory_when_ray_is_off():
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray session is open in this process")
    assert ReplicaMetrics("full", None, "r", "m", "run").uses_ray is False


def test_paged_layout_metrics_are_marked_and_their_blocks_can_be_cleared():
    """The paged layout's series are catalogued as such, and `clear_kv_blocks` drops only this recorder's block
    gauges (an engine without a pool on the same labels), never its counters or other labels' blocks."""
    assert PAGED_LAYOUT_METRICS <= {m.name for m in METRICS if m.source == "ray"}
    assert {metric(n).kind for n in PAGED_LAYOUT_METRICS} == {"gauge", "counter"}
    assert all(metric(n).help.startswith("Paged KV layout only: ") for n in PAGED_LAYOUT_METRICS)
    base = ReplicaMetrics("full", None, "r", "m", "run", use_ray=False)
    other = base.for_point("scissorhands", 5)
    for m in (base, other):
        m.set_kv_blocks(used=3, free=5)
        m.add_preemption(recomputed_tokens=0)  # a zero token count is ignored, the preemption is not
    base.clear_kv_blocks()
    assert {k: v for k, v in base.snapshot().items() if k in PAGED_LAYOUT_METRICS} == {
        "scissorhands_preemptions_total": 1
    }
    assert other.snapshot()["scissorhands_kv_used_blocks"] == 3
    base.clear_kv_blocks()  # clearing what is not there is a no-op
    with pytest.raises(ValueError, match="free must be a number >= 0"):
        base.set_kv_blocks(used=1, free=-1)
    with pytest.raises(ValueError, match="recomputed_tokens must be a number >= 0"):
        base.add_preemption(recomputed_tokens=-2)


def test_prefix_cache_metrics_count_per_phase_and_their_block_gauge_can_be_cleared():
    """Hit and miss tokens are counted per phase (a zero count records nothing), reclaimed blocks are increments,
    the cached-blocks gauge is the last value and `clear_prefix_cache` drops only that gauge; bad counts raise."""
    assert PREFIX_CACHE_METRICS <= {m.name for m in METRICS if m.source == "ray"}
    assert all(metric(n).help.startswith("Prefix cache only: ") for n in PREFIX_CACHE_METRICS)
    assert "phase" in metric("scissorhands_prefix_cache_hit_tokens_total").labels
    m = ReplicaMetrics("full", None, "r", "m", "run", use_ray=False)
    m.add_prefix_cache_tokens(hit=0, miss=12)
    m.add_prefix_cache_tokens(hit=8, miss=4)
    m.add_prefix_cache_tokens(hit=16, miss=0, phase="warmup")
    m.set_prefix_cache(blocks=6, reclaimed_blocks=0)
    m.set_prefix_cache(blocks=4, reclaimed_blocks=3)
    m.set_prefix_cache(blocks=5, reclaimed_blocks=2)
    got = {k: v for k, v in m.snapshot().items() if k in PREFIX_CACHE_METRICS}
    assert got == {
        "scissorhands_prefix_cache_hit_tokens_total": 8,
        "scissorhands_prefix_cache_miss_tokens_total": 16,
        "scissorhands_prefix_cache_reclaimed_blocks_total": 5,
        "scissorhands_kv_prefix_cache_blocks": 5,
    }
    warm = {k: v for k, v in m.snapshot("warmup").items() if "tokens" in k and k in PREFIX_CACHE_METRICS}
    assert warm == {"scissorhands_prefix_cache_hit_tokens_total": 16}
    m.clear_prefix_cache()
    assert "scissorhands_kv_prefix_cache_blocks" not in m.snapshot()
    assert m.snapshot()["scissorhands_prefix_cache_reclaimed_blocks_total"] == 5
    with pytest.raises(ValueError, match="miss must be a number >= 0"):
        m.add_prefix_cache_tokens(hit=3, miss=-1)
    assert m.snapshot()["scissorhands_prefix_cache_hit_tokens_total"] == 8  # nothing recorded by the bad call
    with pytest.raises(ValueError, match="phase: expected one of measured, warmup"):
        m.add_prefix_cache_tokens(hit=3, miss=1, phase="later")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_an_engine_records_its_prefix_cache_counts_as_its_stats_and_none_when_off(model, prefix_caching):
    """A paged engine whose 6 prompts share a 12-token prefix, in a pool they outgrow: its live hit, miss, cached and
    reclaimed block series equal its `stats()`; with the prefix cache off, none of the series exist."""
    m = ReplicaMetrics("full", None, "r", "tiny-llama", "run", use_ray=False)
    cfg = EngineConfig(
        kv_layout="paged", kv_memory_limit_bytes=30_000, block_tokens=4, enable_prefix_caching=prefix_caching
    )
    engine = ContinuousBatchingEngine(model, cfg, metrics=m)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 128, (12,), generator=g).tolist()
    for i in range(6):
        tail = torch.randint(0, 128, (3 + 2 * i,), generator=g).tolist()
        engine.submit(GenerationRequest(f"q{i}", shared + tail, 20, ignore_eos=True), lambda r: None)
    engine.run_until_idle()
    s, got = engine.stats(), m.snapshot()
    if not prefix_caching:
        assert not PREFIX_CACHE_METRICS & set(got) and s["prefix_cache_hit_tokens"] is None
        return
    assert s["prefix_cache_hit_tokens"] > 0 and s["prefix_cache_reclaimed_blocks"] > 0
    assert got["scissorhands_prefix_cache_hit_tokens_total"] == s["prefix_cache_hit_tokens"]
    assert got["scissorhands_prefix_cache_miss_tokens_total"] == s["prefix_cache_miss_tokens"]
    assert got["scissorhands_prefix_cache_reclaimed_blocks_total"] == s["prefix_cache_reclaimed_blocks"]
    assert got["scissorhands_kv_prefix_cache_blocks"] == s["prefix_cache_blocks"] > 0


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.observe_ttft(-0.1),
        lambda m: m.observe_decode_step(0.1, batch_size=-1),
        lambda m: m.set_kv_cache(bytes=-1, slots=0),
        lambda m: m.observe_prefill(float("nan"), tokens=3),
    ],
)
def test_replica_metrics_rejects_negative_values(call):
    m = ReplicaMetrics("full", None, "r", "m", "run", use_ray=False)
    with pytest.raises(ValueError, match="must be a number >= 0"):
        call(m)


# --------------------------------------------------------------------------- SweepPusher, no Pushgateway
RECORD = {
    "run_id": "run-x",
    "point_id": "scissorhands-r5-b4-p64-n8-s0-0a1b2c3d",
    "status": "ok",
    "error": None,
    "model": "tiny-llama",
    "model_id": "tiny-llama",
    "policy": "scissorhands",
    "compression_ratio": 5.0,
    "budget_tokens_requested": None,
    "budget_tokens": 20,
    "batch_size": 4,
    "prompt_tokens": 64,
    "new_tokens": 8,
    "ttft_s": 0.05,
    "ttft_p50_s": 0.05,
    "ttft_p90_s": 0.05,
    "ttft_p99_s": 0.05,
    "tpot_p50_s": 0.01,
    "e2e_latency_p50_s": 0.12,
    "output_throughput_tok_per_s": 266.0,
    "total_throughput_tok_per_s": 2400.0,
    "kv_cache_bytes": 81920,
}


def _sample(pusher, name, **labels):
    for registry in (pusher.registry, *pusher.point_registries.values()):
        for family in registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
    return None


def test_point_labels_and_values_come_from_the_catalogue_record_keys():
    p = SweepPusher("off", "run-x")
    assert p.enabled is False and p.push_point(RECORD) is False  # disabled: no push, no error
    labels = p.point_labels(RECORD)
    assert tuple(labels) == POINT_LABELS
    assert labels == {
        "policy": "scissorhands",
        "compression_ratio": "5",
        "budget_tokens": "",
        "batch_size": "4",
        "prompt_tokens": "64",
        "new_tokens": "8",
        "concurrency": "",
        "request_rate": "",
        "kv_bits": "",
        "task": "",
        "model": "tiny-llama",
        "engine": "ours",  # a record without one ran on ours
    }
    # a point OpenVINO GenAI served is a series of its own beside ours' of the same policy
    assert p.point_labels({**RECORD, "engine": "openvino"})["engine"] == "openvino"
    assert _sample(p, "scissorhands_sweep_output_throughput_tokens_per_second", policy="scissorhands") == 266.0
    assert _sample(p, "scissorhands_sweep_kv_cache_bytes", batch_size="4") == 81920
    for q in ("0.5", "0.9", "0.99"):
        assert _sample(p, "scissorhands_sweep_ttft_seconds", quantile=q) == 0.05
    assert _sample(p, "scissorhands_sweep_tpot_seconds", quantile="0.5") == 0.01
    assert _sample(p, "scissorhands_sweep_tpot_seconds", quantile="0.99") is None  # no tpot_p99_s: not exported
    assert _sample(p, "scissorhands_sweep_max_batch_size", policy="scissorhands") == 4
    assert _sample(p, "scissorhands_sweep_perplexity") is None  # not in the record: not exported
    # only the catalogue's record keys are read: no other spelling is guessed
    other = SweepPusher("off", "run-x")
    other.push_point({k: v for k, v in RECORD.items() if not k.startswith("ttft_p")} | {"ttft_s": {"p50": 1.0}})
    assert _sample(other, "scissorhands_sweep_ttft_seconds") is None
    assert {m.record_key for m in METRICS if m.record_key} >= {
        "output_throughput_tok_per_s",
        "ttft_{q}_s",
        "perplexity",
    }


def test_a_serving_point_pushes_attainment_goodput_and_p95_from_the_keys_its_summary_writes():
    """The SLO series and the p95 quantile are read from the record keys `summarize(...).flat()` writes (one
    definition: the catalogue's `record_key`s are the summary's own keys)."""
    from workloads.load.metrics import RequestRecord, summarize
    from workloads.load.slo import SLO

    recs = [  # TTFT 0.25 s and 1.25 s, TPOT 62.5 ms: an SLO of TTFT 1 s (TPOT 100 ms) keeps the first
        RequestRecord("r0", 8, 4, send_time_s=0.0, token_times_s=[0.25, 0.3125, 0.375, 0.4375], output_tokens=4),
        RequestRecord("r1", 8, 4, send_time_s=1.0, token_times_s=[2.25, 2.3125, 2.375, 2.4375], output_tokens=4),
    ]
    flat = summarize(recs, mode="concurrency", window_start_s=0.0, window_end_s=4.0, slo=SLO(ttft_s=1.0)).flat()
    assert (flat["slo_attainment"], flat["goodput_req_per_s"], flat["goodput_tok_per_s"]) == (0.5, 0.25, 1.0)
    for spec in METRICS:
        if spec.name.startswith(("scissorhands_sweep_slo_", "scissorhands_sweep_goodput_")):
            assert spec.record_key in flat, spec.name
        if spec.source == "pushgateway" and "quantile" in spec.labels:  # every latency quantile, p95 included
            assert {spec.record_key.format(q=q) for q in RECORD_QUANTILES} <= set(flat), spec.name
    record = {**RECORD, "batch_size": None, "concurrency": 2, **flat}
    p = SweepPusher("off", "run-slo")
    p.push_point(record)
    assert _sample(p, "scissorhands_sweep_slo_attainment_ratio", concurrency="2") == 0.5
    assert _sample(p, "scissorhands_sweep_goodput_requests_per_second", concurrency="2") == 0.25
    assert _sample(p, "scissorhands_sweep_goodput_tokens_per_second", concurrency="2") == 1.0
    for q, key in (("0.5", "p50"), ("0.9", "p90"), ("0.95", "p95"), ("0.99", "p99")):
        assert _sample(p, "scissorhands_sweep_ttft_seconds", quantile=q) == flat[f"ttft_{key}_s"]
    # a batch point carries none of them: no series, never a made-up 0
    batch = SweepPusher("off", "run-batch")
    batch.push_point(RECORD)
    assert _sample(batch, "scissorhands_sweep_slo_attainment_ratio") is None


def test_each_point_has_its_own_group_and_failed_points_do_not_count():
    p = SweepPusher("off", "run-y")
    p.push_point({**RECORD, "point_id": "a", "ttft_p50_s": 0.04, "ttft_p99_s": 0.09, "batch_size": 16})
    p.push_point(
        {
            **RECORD,
            "point_id": "b",
            "batch_size": 64,
            "status": "error",
            "error": "RuntimeError: out of memory",
            "output_throughput_tok_per_s": None,
        }
    )
    assert set(p.point_registries) == {"a", "b"}
    assert _sample(p, "scissorhands_sweep_ttft_seconds", batch_size="16", quantile="0.5") == 0.04
    assert _sample(p, "scissorhands_sweep_ttft_seconds", batch_size="16", quantile="0.99") == 0.09
    assert _sample(p, "scissorhands_sweep_max_batch_size") == 16  # the failed batch 64 does not count
    assert _sample(p, "scissorhands_sweep_output_throughput_tokens_per_second", batch_size="64") is None
    p.push_progress(2, 5)
    assert _sample(p, "scissorhands_sweep_points_completed") == 2
    assert _sample(p, "scissorhands_sweep_points_planned") == 5
    with pytest.raises(ValueError, match="done <= total"):
        p.push_progress(6, 5)
    # every exported family is in the catalogue
    exposed = {f.name for r in (p.registry, *p.point_registries.values()) for f in r.collect()}
    assert exposed <= exported_metric_names("pushgateway")
    assert b"scissorhands_sweep_ttft_seconds{" in generate_latest(p.point_registries["a"])


def test_pushgateway_url_resolution(monkeypatch):
    monkeypatch.delenv("SCISSORHANDS_PUSHGATEWAY", raising=False)
    assert resolve_pushgateway_url(None) == "127.0.0.1:9091"
    monkeypatch.setenv("SCISSORHANDS_PUSHGATEWAY", "http://127.0.0.1:19091")
    assert resolve_pushgateway_url(None) == "http://127.0.0.1:19091"
    assert resolve_pushgateway_url("127.0.0.1:1") == "127.0.0.1:1"
    monkeypatch.setenv("SCISSORHANDS_PUSHGATEWAY", "off")
    assert resolve_pushgateway_url(None) is None
    with pytest.raises(ValueError, match="run_id"):
        SweepPusher(None, "")


def test_unreachable_pushgateway_is_one_notice_then_a_no_op(caplog):
    port = free_port()  # nothing listens there
    pusher = SweepPusher(f"127.0.0.1:{port}", "run-down", timeout_s=1.0)
    with caplog.at_level(logging.WARNING, logger="workloads.core.push"):
        assert pusher.push_progress(0, 3) is False
        for i in range(3):
            assert pusher.push_point({**RECORD, "batch_size": 2**i}) is False
        assert pusher.push_progress(3, 3) is False
    notices = [r for r in caplog.records if r.name == "workloads.core.push"]
    assert len(notices) == 1, [r.getMessage() for r in notices]
    message = notices[0].getMessage()
    assert "\n" not in message and f"127.0.0.1:{port}" in message and "not be pushed" in message
    assert pusher.enabled is False and pusher.pushes == 0
    assert not math.isnan(_sample(pusher, "scissorhands_sweep_max_batch_size"))  # still kept locally


# --------------------------------------------------------------------------- exact means, phases
def test_every_histogram_has_an_exact_sum_counter_fed_with_the_exact_values():
    hists = [s for s in METRICS if s.kind == "histogram"]
    assert hists and all(metric(h.exact_sum.name).kind == "counter" for h in hists)
    m = ReplicaMetrics("scissorhands", 5, "replica-0", "tiny-llama", "run-1", use_ray=False)
    for _ in range(20):
        m.observe_decode_step(0.005, batch_size=3)  # 5 ms lies between the E12 bounds 4.7 and 5.6 ms
    snap = m.snapshot()
    assert snap["scissorhands_decode_batch_size_exact_sum_total"] / snap["scissorhands_decode_batch_size"][0] == 3
    assert snap["scissorhands_decode_step_seconds_exact_sum_total"] == pytest.approx(20 * 0.005, rel=1e-12)
    with pytest.raises(ValueError, match="only a histogram"):
        metric("scissorhands_generated_tokens_total").exact_sum


def test_request_level_metrics_keep_warm_up_apart():
    m = ReplicaMetrics("full", None, "replica-0", "tiny-llama", "run-1", use_ray=False)
    m.add_generated_tokens(4)
    m.add_generated_tokens(3, phase="warmup")
    m.observe_prefill(0.1, tokens=16, warmup_tokens=8)
    m.observe_ttft(0.2, phase="warmup")
    assert m.snapshot()["scissorhands_generated_tokens_total"] == 4
    assert m.snapshot()["scissorhands_prefill_tokens_total"] == 16
    assert "scissorhands_ttft_seconds" not in m.snapshot()
    warm = m.snapshot("warmup")
    assert warm["scissorhands_generated_tokens_total"] == 3 and warm["scissorhands_prefill_tokens_total"] == 8
    assert warm["scissorhands_ttft_seconds"] == (1, 0.2)
    with pytest.raises(ValueError, match="phase: expected one of measured, warmup"):
        m.add_generated_tokens(1, phase="warm")


def test_a_process_without_ray_gets_the_in_memory_recorder_and_does_not_import_ray():
    """Ray runs in a process only once imported: the recorder asks `sys.modules`, never imports Ray itself
    (importing it costs seconds in every plain-class user: the engine, the benchmarks, the tests)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; from replica.metrics import ReplicaMetrics; "
        "m = ReplicaMetrics('full', None, 'r', 'm', 'run'); print(m.uses_ray, 'ray' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
