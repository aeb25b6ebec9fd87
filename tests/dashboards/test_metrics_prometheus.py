"""The metrics stack for real: a Ray head, Prometheus and the Pushgateway on loopback.

One module-scoped stack: `ray.init` (local, loopback, dashboard on so Ray writes its
Prometheus service-discovery file, metrics exported every second), then Prometheus and the
Pushgateway started by `dashboards/serve.py` on free ports, scraping every second, with Ray's
service-discovery file of this session. A Ray actor records replica metrics through
`replica.metrics.ReplicaMetrics`, and `workloads.core.push.SweepPusher` pushes the points of a sweep.
The OpenAI service (`cluster.serve_app`, tiny model, one engine deployment) runs on the same Ray
and answers a short HTTP load (streamed and not, and one 404), so Ray Serve's own metrics
(`replica.metrics.SERVE_METRICS`, the dashboards' HTTP row) reach Prometheus the same way. A real
continuous-batching engine on the paged KV layout, too small a pool for its requests, runs in the actor twice
(so its preemption counters rise between scrapes) and feeds the paged-layout panels, which a batch sweep
(static batches, no block pool) never does.
Then every target of every panel of every dashboard must return data (the static checks live in test_dashboards.py), and the histogram quantiles must be accurate.

Needs the binaries `prometheus` and `prometheus-pushgateway` (Debian packages of the same
names; `.ci/run` installs them); skipped with that reason when they are missing.
"""

import math
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashboards import check, serve
from replica.metrics import (
    LATENCY_TOP_S,
    METRICS,
    PAGED_LAYOUT_METRICS,
    PREFIX_CACHE_METRICS,
    SERVE_METRICS,
    strip_sample_suffix,
)
from tests.waiting import free_port, wait_for
from workloads.core.push import SweepPusher

_missing = [k for k, v in serve.binaries().items() if not v]
pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.ray,
    pytest.mark.skipif(
        bool(_missing),
        reason=f"missing {', '.join(_missing)}: apt-get install -y --no-install-recommends prometheus "
        "prometheus-pushgateway (`.ci/run` and `make dashboards-up` do this)",
    ),
]

RUN_ID = "test-metrics-run"
LIVE_SECONDS = 8.0
SERVED_MODEL = "tiny-llama:full"


#: Serve's counts of the requests `_http_load` sends, each from the process that records it: the HTTP proxy's, and
#: the deployments' (the replicas export their processing latency on their own schedule).
SERVE_COUNTS = (
    'ray_serve_num_http_requests_total{status_code="200"}',
    "ray_serve_deployment_processing_latency_ms_count",
)


def _http_load(prom: str, url: str, n: int = 4) -> None:
    """`n` completions through the Serve app (alternately streamed), one unknown model (404), then wait
    until Prometheus has scraped every count of them in `SERVE_COUNTS` (the HTTP row's rates need fresh samples)."""
    import requests

    def counts() -> list[float]:
        return [sum(check.finite_values(check.query(prom, f"sum({sel})"))) for sel in SERVE_COUNTS]

    before = counts()
    for i in range(n):
        r = requests.post(
            url + "/v1/completions",
            timeout=120,
            json=dict(model=SERVED_MODEL, prompt=[1, 2, 3, 4], max_tokens=6, ignore_eos=True, stream=bool(i % 2)),
        )
        assert r.status_code == 200, r.text
        r.content
    assert requests.post(url + "/v1/completions", json=dict(model="nope", prompt=[1]), timeout=60).status_code == 404
    wait_for(
        lambda: all(now >= was + n for now, was in zip(counts(), before)),
        60,
        "Prometheus to scrape Ray Serve's request counts (HTTP proxy and deployments)",
    )


class _FakeReplica:
    """Stands in for a replica actor: calls ReplicaMetrics as the replica does."""

    def load(self, run_id: str, seconds: float) -> int:
        return _replica_load(run_id, seconds)

    def quantile_samples(self, run_id: str) -> None:
        _quantile_samples(run_id)
        _l21_samples(run_id)

    def long_latencies(self, run_id: str, first: bool) -> None:
        _long_latencies(run_id, first)

    def paged_run(self, run_id: str) -> dict:
        """One more run of the same paged engine (kept in the actor); its stats since the first."""
        if not hasattr(self, "paged_engine"):
            self.paged_engine = _paged_engine(run_id)
        return _paged_run(self.paged_engine)

    def prefix_run(self, run_id: str) -> dict:
        """One more run of the same prefix-caching paged engine (kept in the actor); its stats since the first."""
        if not hasattr(self, "prefix_engine"):
            self.prefix_engine = _paged_engine(run_id, PREFIX_POLICY, enable_prefix_caching=True)
        return _paged_run(self.prefix_engine, shared_prefix_tokens=16)


#: Policy label of the paged engine's series (the fake load's "full" series stay its own).
PAGED_POLICY = "paged-full"
#: The paged-layout panels' series, as Prometheus stores them (a batch sweep exports none).
PAGED_NAMES = sorted(m.exported_name for m in METRICS if m.name in PAGED_LAYOUT_METRICS)
#: Policy label of the prefix-caching paged engine's series.
PREFIX_POLICY = "paged-prefix-full"
#: The prefix cache panels' series (only an engine of ours with the prefix cache on exports them).
PREFIX_NAMES = sorted(m.exported_name for m in METRICS if m.name in PREFIX_CACHE_METRICS)


def _paged_engine(run_id: str, policy: str = PAGED_POLICY, enable_prefix_caching: bool = False):
    """A full-cache engine on the paged layout (tiny model, blocks of 4 slots, a 60 kB pool: 12 requests outgrow
    it, so the newest rows are preempted), recording its live metrics through Ray."""
    import torch

    from replica.common.types import EngineConfig
    from replica.engine import ContinuousBatchingEngine
    from replica.metrics import ReplicaMetrics
    from scissorhands.testing import tiny_llama

    torch.set_num_threads(1)
    model = tiny_llama(0)
    model.generation_config.eos_token_id = None
    metrics = ReplicaMetrics(policy, None, "replica-paged", "tiny-llama", run_id)
    assert metrics.uses_ray
    cfg = EngineConfig(
        kv_layout="paged", kv_memory_limit_bytes=60_000, block_tokens=4, enable_prefix_caching=enable_prefix_caching
    )
    return ContinuousBatchingEngine(model, cfg, metrics=metrics)


def _paged_run(engine, shared_prefix_tokens: int = 0) -> dict:
    """12 requests of random prompts (each behind the same `shared_prefix_tokens` first tokens) to `engine`."""
    import torch

    from replica.common.types import GenerationRequest

    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 128, (shared_prefix_tokens,), generator=g).tolist()
    for i in range(12):
        prompt = torch.randint(0, 128, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
        engine.submit(GenerationRequest(f"p{i}", shared + prompt, 39, ignore_eos=True), lambda r: None)
    engine.run_until_idle()
    stats = engine.stats()
    assert stats["preemptions"] > 0 and engine.pool.blocks_in_use == 0
    return stats


#: Latencies of a saturated point: 1,000 evenly from 100 to 150 s (mean 125 s).
SATURATED_S = [100.0 + 50.0 * i / 999 for i in range(1000)]
#: Latencies beyond the top finite bucket (they fall in +Inf).
ABOVE_TOP_S = [2.0 * LATENCY_TOP_S] * 10
LONG_LATENCIES = {"latency-saturated": SATURATED_S, "latency-above-top": ABOVE_TOP_S}
#: How the replica records each latency histogram of the catalogue (seconds in, one observation).
LATENCY_OBSERVERS = {
    "scissorhands_ttft_seconds": lambda m, s: m.observe_ttft(s),
    "scissorhands_tpot_seconds": lambda m, s: m.observe_tpot(s),
    "scissorhands_prefill_seconds": lambda m, s: m.observe_prefill(s, tokens=1),
    "scissorhands_decode_step_seconds": lambda m, s: m.observe_decode_step(s, batch_size=1),
}
LATENCY_HISTOGRAMS = [m for m in METRICS if m.kind == "histogram" and m.name.endswith("_seconds")]


def _long_latencies(run_id: str, first: bool) -> None:
    """Every latency histogram, per policy of `LONG_LATENCIES`: its first value alone (`first`: the series is
    born with it, so a rate() sees none of it), else all of them (the increase a panel's rate() shows)."""
    from replica.metrics import ReplicaMetrics

    base = ReplicaMetrics("long", None, "replica-long", "tiny-llama", run_id)
    for policy, values in LONG_LATENCIES.items():
        m = base.for_point(policy, None)
        for value in values[:1] if first else values:
            for observe in LATENCY_OBSERVERS.values():
                observe(m, value)


def _replica_load(run_id: str, seconds: float) -> int:
    """Record every replica metric for `seconds` (several scrapes) from inside a Ray actor."""
    from replica.metrics import ReplicaMetrics

    base = ReplicaMetrics("full", None, "replica-0", "tiny-llama", run_id)
    assert base.uses_ray
    base.observe_model_load(1.25)
    points = [base, base.for_point("scissorhands", 2), base.for_point("scissorhands", 5)]
    # OpenVINO GenAI's full cache beside ours' (the same policy): only the series its backend records
    ov = ReplicaMetrics("full", None, "replica-ov", "tiny-llama", run_id, engine="openvino")
    steps = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ov.set_running(3)
        ov.set_queued(1)
        ov.observe_ttft(0.03)
        ov.observe_tpot(0.005)
        ov.add_generated_tokens(15)
        ov.add_generated_tokens(3, phase="warmup")
        ov.set_kv_cache(bytes=8192, slots=96)
        ov.set_kv_blocks(used=3, free=5)
        for i, m in enumerate(points):
            batch = 2 ** (i + 1)
            m.set_running(batch)
            m.set_queued(i)
            m.observe_prefill(0.02 * (i + 1), tokens=64 * batch)
            m.observe_ttft(0.02 * (i + 1))
            for _ in range(4):
                m.observe_decode_step(0.004 * (i + 1), batch_size=batch)
            m.observe_tpot(0.004 * (i + 1))
            m.add_generated_tokens(5 * batch)
            m.add_generated_tokens(batch, phase="warmup")  # the load generator's warm-up requests
            m.set_kv_cache(bytes=4096 * batch // (i + 1), slots=32 * batch // (i + 1))
            m.add_evictions(3 * i if i else 0)
        steps += 1
        time.sleep(0.1)
    return steps


def _quantile_samples(run_id: str) -> None:
    """1,000 latencies of 5 ms and 1,000 of 150 ms into the exported TTFT histogram."""
    from replica.metrics import ReplicaMetrics

    base = ReplicaMetrics("quantiles", None, "replica-quantiles", "tiny-llama", run_id)
    only5, only150, mixed = (base.for_point(p, None) for p in ("quantile-5ms", "quantile-150ms", "quantile-mixed"))
    for _ in range(1000):
        only5.observe_ttft(0.005)
        only150.observe_ttft(0.150)
        mixed.observe_ttft(0.005)
        mixed.observe_ttft(0.150)


def _l21_samples(run_id: str) -> None:
    """20 decode steps of exactly 3 rows (5 ms each), and 20 of 5 rows (the bucket 4-8,
    whose midpoint 6 is what Ray's exporter puts in `_sum`), into the exported histograms."""
    from replica.metrics import ReplicaMetrics

    base = ReplicaMetrics("l21", None, "replica-l21", "tiny-llama", run_id)
    for policy, rows in (("l21-3rows", 3), ("l21-5rows", 5)):
        m = base.for_point(policy, None)
        for _ in range(20):
            m.observe_decode_step(0.005, batch_size=rows)


def _sweep_records(run_id: str) -> list[dict]:
    """Points as `workloads.sweep` writes them (full, scissorhands 2x and 5x; batch 1 and 4)."""
    records = []
    for policy, ratio, bytes_factor in (("full", None, 1.0), ("scissorhands", 2.0, 0.5), ("scissorhands", 5.0, 0.2)):
        for batch in (1, 4):
            records.append(
                {
                    "run_id": run_id,
                    "point_id": f"{policy}-r{ratio}-b{batch}",
                    "status": "ok",
                    "error": None,
                    "model": "tiny-llama",
                    "model_id": "tiny-llama",
                    "policy": policy,
                    "compression_ratio": ratio,
                    "budget_tokens_requested": None,
                    "batch_size": batch,
                    "prompt_tokens": 64,
                    "new_tokens": 8,
                    **{
                        f"{name}_{q}_s": value
                        for q in ("p50", "p90", "p99")
                        for name, value in (
                            ("ttft", 0.01 * batch),
                            ("tpot", 0.002 * batch),
                            ("e2e_latency", 0.01 * batch + 7 * 0.002 * batch),
                        )
                    },
                    "output_throughput_tok_per_s": 100.0 * batch,
                    "total_throughput_tok_per_s": 900.0 * batch,
                    "kv_cache_bytes": int(65536 * batch * bytes_factor),
                    "perplexity": 12.0 / bytes_factor**0.1,
                    "accuracy": 0.9 * bytes_factor**0.05,
                }
            )
    # a quality point of a quantized cache: no batch, a task, KV bits
    records.append(
        {
            "run_id": run_id,
            "point_id": "fewshot-copa",
            "status": "ok",
            "error": None,
            "kind": "quality",
            "evaluation": "fewshot",
            "model": "tiny-llama",
            "policy": "scissorhands",
            "compression_ratio": 5.0,
            "kv_bits": 4,
            "task": "copa",
            "accuracy": 0.7,
            "perplexity": 14.5,
        }
    )
    failed = {
        k: v for k, v in records[-2].items() if not k.endswith(("_s", "_tok_per_s", "_bytes", "perplexity", "accuracy"))
    }
    records += _serving_records(run_id)
    records.append(
        {
            **failed,
            "point_id": "scissorhands-r5-b16",
            "batch_size": 16,
            "status": "error",
            "error": "RuntimeError: out of memory",
        }
    )
    return records


#: (policy, ratio) -> {request rate (req/s): (SLO attainment, goodput req/s)} of `_serving_records`
SERVING_POINTS = {
    ("full", None): {1.0: (1.0, 1.0), 2.0: (0.5, 1.0)},
    ("scissorhands", 5.0): {1.0: (1.0, 1.0), 2.0: (0.875, 1.75)},
}


def _serving_records(run_id: str) -> list[dict]:
    """Serving points of a rate sweep as `workloads.serving.runner` writes them: no batch size, a request rate, the
    SLO attainment and goodputs (8 output tokens per request)."""
    return [
        {
            "run_id": run_id,
            "point_id": f"rate-{policy}-r{ratio}-L{rate:g}",
            "status": "ok",
            "error": None,
            "kind": "serving",
            "model": "tiny-llama",
            "model_id": "tiny-llama",
            "policy": policy,
            "compression_ratio": ratio,
            "budget_tokens_requested": None,
            "batch_size": None,
            "concurrency": None,
            "request_rate": rate,
            "prompt_tokens": 64,
            "new_tokens": 8,
            "output_throughput_tok_per_s": 8.0 * rate,
            "kv_cache_bytes": 65536 if policy == "full" else 13107,
            "slo_attainment": attainment,
            "slo_requests": 32,
            "goodput_req_per_s": goodput,
            "goodput_tok_per_s": 8.0 * goodput,
        }
        for (policy, ratio), by_rate in SERVING_POINTS.items()
        for rate, (attainment, goodput) in by_rate.items()
    ]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ("RAY_metrics_report_interval_ms", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # export every second (default 10 s)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when ray is first imported: keep loopback
    import ray

    if ray.is_initialized():
        ray.shutdown()
    metrics_port = free_port()
    data_dir = tmp_path_factory.mktemp("dashboards-data")
    prom_port, pg_port = free_port(), free_port()
    try:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=True,  # its reporter module writes the service-discovery file
            dashboard_host="127.0.0.1",
            dashboard_port=free_port(),
            _metrics_export_port=metrics_port,
            _node_ip_address="127.0.0.1",
        )
        session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
        sd_file = session_dir / "prom_metrics_service_discovery.json"
        wait_for(lambda: sd_file.exists(), 60, f"Ray to write {sd_file}")
        serve.up(data_dir, prom_port, pg_port, (str(sd_file),), "1s", install=False)
        prom = f"http://127.0.0.1:{prom_port}"
        pushgateway = f"127.0.0.1:{pg_port}"

        # the OpenAI service on this Ray (no CPU reserved: the real sweep below needs the node's CPUs)
        from cluster.serve_app import build_serve_app, start

        serve_port = free_port()
        start(build_serve_app("tiny-llama", ["full"], max_length_tokens=256, replica_cpus=0.0), port=serve_port)
        serve_url = f"http://127.0.0.1:{serve_port}"
        wait_for(lambda: _health(serve_url), 180, "the Serve app to answer /health")

        # live replica metrics, recorded in an actor while Prometheus scrapes; this module is not
        # importable in Ray's workers, so its functions travel by value
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        actor = ray.remote(num_cpus=0)(_FakeReplica).remote()
        load = actor.load.remote(RUN_ID, LIVE_SECONDS)
        ray.get(actor.quantile_samples.remote(RUN_ID))
        # long latencies: the series are born (scraped once) before the values a rate() is to see
        ray.get(actor.long_latencies.remote(RUN_ID, True))
        born = _latency_counts_are(1)
        wait_for(lambda: check.query(prom, born), 60, "Prometheus to scrape the long-latency series once")
        long_from = time.time()
        ray.get(actor.long_latencies.remote(RUN_ID, False))
        # the paged engine: its counters are born (scraped once) before the second run raises them
        paged_first = ray.get(actor.paged_run.remote(RUN_ID))
        preempted = f'ray_scissorhands_preemptions_total{{run_id="{RUN_ID}", policy="{PAGED_POLICY}"}}'
        wait_for(
            lambda: check.query(prom, f"{preempted} == {paged_first['preemptions']}"),
            60,
            "Prometheus to scrape the paged engine's first preemptions",
        )
        prefix_first = ray.get(actor.prefix_run.remote(RUN_ID))
        hits = f'ray_scissorhands_prefix_cache_hit_tokens_total{{run_id="{RUN_ID}", policy="{PREFIX_POLICY}"}}'
        wait_for(
            lambda: check.query(prom, f"{hits} == {prefix_first['prefix_cache_hit_tokens']}"),
            60,
            "Prometheus to scrape the prefix-caching engine's first hits",
        )
        paged_from = time.time()
        paged = ray.get(actor.paged_run.remote(RUN_ID))
        prefix = ray.get(actor.prefix_run.remote(RUN_ID))
        # sweep summaries, pushed point by point
        records = _sweep_records(RUN_ID)
        pusher = SweepPusher(pushgateway, RUN_ID)
        assert pusher.push_progress(0, len(records))
        for i, rec in enumerate(records, 1):
            assert pusher.push_point(rec), "push to the live Pushgateway failed"
            assert pusher.push_progress(i, len(records))
        assert ray.get(load) > 10
        _http_load(prom, serve_url)
        wait_for(
            lambda: (
                check.query(prom, f'ray_scissorhands_running_sequences{{run_id="{RUN_ID}"}}')
                and check.query(prom, f'scissorhands_sweep_points_completed{{run_id="{RUN_ID}"}} == {len(records)}')
                and check.query(prom, 'ray_scissorhands_ttft_seconds_count{policy="quantile-mixed"} == 2000')
                and check.query(prom, 'ray_scissorhands_decode_batch_size_exact_sum_total{policy="l21-5rows"} == 100')
                and check.query(prom, _latency_counts_are(None))
                and check.query(prom, f"{preempted} == {paged['preemptions']}")
                and check.query(prom, f"{hits} == {prefix['prefix_cache_hit_tokens']}")
            ),
            60,
            "Prometheus to scrape the replica metrics and the pushed sweep",
        )
        time.sleep(2.0)  # one more scrape of the final values
        yield {
            "ray_address": ray._private.worker._global_node.address,
            "prometheus": prom,
            "pushgateway": f"http://{pushgateway}",
            "sd_file": sd_file,
            "metrics_port": metrics_port,
            "records": records,
            "serve_url": serve_url,
            "long_from": long_from,
            "paged_stats": paged,
            "prefix_stats": prefix,
            "paged_from": paged_from,
        }
    finally:
        from ray import serve as ray_serve

        if ray.is_initialized():
            ray_serve.shutdown()
        serve.down(data_dir)
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _latency_counts_are(first: int | None) -> str:
    """PromQL true when every latency histogram of every long-latency policy counts `first` observations
    (None: all of its values plus the first)."""
    want = len(LATENCY_HISTOGRAMS) * len(LONG_LATENCIES)
    terms = []
    for policy, values in LONG_LATENCIES.items():
        n = first if first is not None else len(values) + 1
        names = "|".join(m.exported_name for m in LATENCY_HISTOGRAMS)
        terms.append(f'count({{__name__=~"({names})_count", run_id="{RUN_ID}", policy="{policy}"}} == {n})')
    return f"({' + '.join(terms)}) == {want}"


def test_prometheus_finds_ray_through_the_service_discovery_file(stack):
    def targets():
        return check.prom_get(stack["prometheus"], "/api/v1/targets", {"state": "active"})["activeTargets"]

    def node(ts):
        return [
            t for t in ts if t["scrapePool"] == "ray" and t["labels"]["instance"].endswith(f":{stack['metrics_port']}")
        ]

    ts = targets()
    assert any(t["labels"]["instance"] == f"127.0.0.1:{stack['metrics_port']}" for t in node(ts)), ts
    # one scrape may time out on a loaded machine (1 s interval = 1 s timeout; Serve's series are many):
    # the node's target must be up again within a few scrapes
    wait_for(
        lambda: all(t["health"] == "up" for t in node(targets())),
        30,
        f"the node's metrics target to be up ({[(t['health'], t.get('lastError')) for t in node(ts)]})",
    )
    pools = {t["scrapePool"]: t["health"] for t in targets()}
    assert pools.get("pushgateway") == "up" and pools.get("prometheus") == "up"


def _health(url: str) -> bool:
    import requests

    try:
        return requests.get(url + "/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def test_every_panel_of_every_dashboard_returns_data(stack):
    _http_load(stack["prometheus"], stack["serve_url"])  # fresh samples for the HTTP row's rates
    rows = check.check(stack["prometheus"], RUN_ID, rate_interval="30s")
    assert len(rows) >= 25
    empty = [f"{file} / {title} [{ref}]: {expr}" for file, title, ref, expr, values in rows if not values]
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_ours_and_openvinos_full_cache_are_series_of_their_own_and_openvino_has_none_it_does_not_record(stack):
    """Both engines' full cache is policy ``full``: the live panels grouped by engine show one series each, and the
    ``$engine`` variable narrows a panel to OpenVINO, whose backend records no eviction or forward-time series."""
    board = check.load_dashboards()["live-replicas.json"]
    panels = {p["title"]: p for p in check.iter_panels(board)}
    values = {"run_id": RUN_ID, "engine": ".*", "policy": "full", "replica": ".*", "datasource": "prometheus"}

    def series(title: str, engine: str = ".*") -> list[dict]:
        expr = check.substitute(panels[title]["targets"][0]["expr"], {**values, "engine": engine}, "30s")
        return [r for r in check.query(stack["prometheus"], expr) if check.finite_values([r])]

    assert {r["metric"]["engine"] for r in series("Output tokens/s")} == {"ours", "openvino"}
    assert {r["metric"]["engine"] for r in series("KV cache bytes", "openvino")} == {"openvino"}
    [used] = series("KV blocks used and free (paged layout)", "openvino")
    assert used["metric"]["replica"] == "replica-ov" and float(used["value"][1]) == 3
    running = {r["metric"]["replica"]: float(r["value"][1]) for r in series("Running and queued sequences", "openvino")}
    assert running == {"replica-ov": 3.0}
    for title in ("Evicted token slots/s", "Decode step p50 / p99 / mean", "Preemptions/s (paged layout)"):
        assert series(title, "openvino") == [], title  # absent, never a zero


def test_a_paged_engine_feeds_the_paged_panels_with_its_own_counts(stack):
    """A real paged engine that preempts, through Ray's exporter: Prometheus holds its stats' preemptions and
    recomputed tokens, and its pool (every block free at the end); every "(paged layout)" panel shows it, its
    rates rising over the second run."""
    prom, stats = stack["prometheus"], stack["paged_stats"]
    sel = f'{{run_id="{RUN_ID}", policy="{PAGED_POLICY}"}}'

    def value(name: str) -> float:
        [v] = check.finite_values(check.query(prom, f"sum({name}{sel})"))
        return v

    assert value("ray_scissorhands_preemptions_total") == stats["preemptions"] > 0
    assert value("ray_scissorhands_recomputed_tokens_total") == stats["recomputed_tokens"] > 0
    assert value("ray_scissorhands_kv_used_blocks") == 0
    assert value("ray_scissorhands_kv_free_blocks") == stats["kv_pool_blocks"]
    board = check.load_dashboards()["live-replicas.json"]
    panels = [
        p
        for p in check.iter_panels(board)
        if any(set(PAGED_NAMES) & check.metric_names(t["expr"]) for t in p["targets"])
    ]
    assert len(panels) == 3 and all(p["title"].endswith("(paged layout)") for p in panels)
    window = f"{math.ceil(time.time() - stack['paged_from']) + 5}s"  # from before the second run
    values = {"run_id": RUN_ID, "engine": ".*", "policy": PAGED_POLICY, "replica": ".*", "datasource": "prometheus"}
    for panel in panels:
        for target in panel["targets"]:
            got = check.finite_values(check.query(prom, check.substitute(target["expr"], values, window)))
            assert len(got) == 1, f"{panel['title']} [{target['refId']}]: {got}"
            if "rate(" in target["expr"]:
                assert got[0] > 0, f"{panel['title']}: no rise over the second run"


def test_a_prefix_caching_engine_feeds_the_prefix_cache_panels_with_its_own_counts(stack):
    """A real paged engine with the prefix cache on (12 prompts behind one 16-token prefix, a pool they outgrow),
    through Ray's exporter: Prometheus holds its stats' hit and miss tokens, cached and reclaimed blocks; the hit
    rate panel reads hit / (hit + miss) over the second run; the engine without the cache has none of these series."""
    prom, stats = stack["prometheus"], stack["prefix_stats"]

    def value(name: str, policy: str = PREFIX_POLICY) -> list[float]:
        return check.finite_values(check.query(prom, f'sum({name}{{run_id="{RUN_ID}", policy="{policy}"}})'))

    assert value("ray_scissorhands_prefix_cache_hit_tokens_total") == [stats["prefix_cache_hit_tokens"]]
    assert stats["prefix_cache_hit_tokens"] > 0
    assert value("ray_scissorhands_prefix_cache_miss_tokens_total") == [stats["prefix_cache_miss_tokens"]]
    assert value("ray_scissorhands_kv_prefix_cache_blocks") == [stats["prefix_cache_blocks"]]
    reclaimed = stats["prefix_cache_reclaimed_blocks"]
    assert value("ray_scissorhands_prefix_cache_reclaimed_blocks_total") == [reclaimed] and reclaimed > 0
    for name in PREFIX_NAMES:  # the paged engine without a prefix cache: absent, never a zero
        assert value(name, PAGED_POLICY) == [], name
    board = check.load_dashboards()["live-replicas.json"]
    panels = {p["title"]: p for p in check.iter_panels(board) if p["title"].endswith("(prefix cache)")}
    assert len(panels) == 3
    window = f"{math.ceil(time.time() - stack['paged_from']) + 5}s"  # from before the second run
    values = {"run_id": RUN_ID, "engine": ".*", "policy": PREFIX_POLICY, "replica": ".*", "datasource": "prometheus"}
    for title, panel in panels.items():
        [got] = check.finite_values(check.query(prom, check.substitute(panel["targets"][0]["expr"], values, window)))
        if title.startswith("Prefix cache hit rate"):
            assert 0 < got < 1, got
        else:
            assert got > 0, title


def test_every_variable_query_returns_values(stack):
    for file, board in check.load_dashboards().items():
        values = check.default_values(board, stack["prometheus"], RUN_ID)
        for name, query in check.variable_queries(board):
            found = check.label_values(stack["prometheus"], check.substitute(query, values))
            assert found, f"{file}: variable ${name} ({query}) has no values"
            if name == "run_id":
                assert RUN_ID in found


def _published_sample_names(stack) -> set[str]:
    """Sample names in the exposition text of every exporter: Ray's targets and the Pushgateway."""
    import json

    urls = [f"http://{t}/metrics" for group in json.loads(stack["sd_file"].read_text()) for t in group["targets"]]
    urls.append(stack["pushgateway"] + "/metrics")
    names = set()
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
        except OSError:
            continue  # a Ray target that does not serve metrics right now
        for family in text_string_to_metric_families(text):
            names |= {s.name for s in family.samples}
    return names


def test_every_dashboard_metric_is_published_by_the_exporters(stack):
    published = _published_sample_names(stack)
    stripped = {strip_sample_suffix(n) for n in published}
    used = {strip_sample_suffix(n) for n in check.dashboard_metric_names(check.load_dashboards())}
    assert used and used <= stripped, f"dashboards name metrics nobody publishes: {sorted(used - stripped)}"
    # the catalogue states the exported names as they really are (ray_ prefix, counters' _total),
    # Ray Serve's included (the names its dashboards read)
    for spec in METRICS + SERVE_METRICS:
        for name in spec.sample_names:
            assert name in published, f"{spec.name}: {name} is not in the exporters' output"
    ours = {n for n in published if "scissorhands_" in n}
    known = {n for spec in METRICS for n in spec.sample_names}
    assert ours <= known, f"exported but not in the catalogue: {sorted(ours - known)}"


def test_warm_up_tokens_are_a_series_of_their_own(stack):
    """Measured and warm-up tokens reach Prometheus apart (5 x batch and 1 x batch per step)."""
    q = f'sum by (phase) (ray_scissorhands_generated_tokens_total{{run_id="{RUN_ID}", policy="full"}})'
    by_phase = {r["metric"]["phase"]: float(r["value"][1]) for r in check.query(stack["prometheus"], q)}
    assert set(by_phase) == {"measured", "warmup"}
    assert by_phase["measured"] == 5 * by_phase["warmup"] > 0


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@pytest.mark.parametrize(
    "policy, samples",
    [
        ("quantile-5ms", [0.005] * 1000),
        ("quantile-150ms", [0.150] * 1000),
        ("quantile-mixed", [0.005] * 1000 + [0.150] * 1000),
    ],
)
@pytest.mark.parametrize("q", [0.5, 0.99])
def test_histogram_quantiles_within_twenty_percent(stack, policy, samples, q):
    expr = (
        f"histogram_quantile({q}, sum by (le) "
        f'(ray_scissorhands_ttft_seconds_bucket{{run_id="{RUN_ID}", policy="{policy}"}}))'
    )
    [estimate] = check.finite_values(check.query(stack["prometheus"], expr))
    exact = _nearest_rank(samples, q)
    assert abs(estimate - exact) <= 0.2 * exact, f"p{q * 100:g} of {policy}: {estimate} vs exact {exact}"


def test_every_latency_histogram_of_the_catalogue_is_recorded_here():
    """A new latency histogram needs its line in `LATENCY_OBSERVERS` (so the long-latency tests cover it)."""
    assert set(LATENCY_OBSERVERS) == {m.name for m in LATENCY_HISTOGRAMS}


def _latency_panel(spec):
    """The live panel showing `spec`'s quantiles and mean, with the values of its template variables."""
    board = check.load_dashboards()["live-replicas.json"]
    [panel] = [
        p
        for p in check.iter_panels(board)
        if any(spec.exported_name + "_bucket" in check.metric_names(t["expr"]) for t in p["targets"])
    ]
    return panel


def _panel_values(stack, panel, policy: str) -> dict[str, list[float]]:
    """{legend: values} of every target of `panel` for `policy`'s series, as Grafana would query them now
    (the rate window reaches back before the long latencies were recorded); NaN kept."""
    window = f"{math.ceil(time.time() - stack['long_from']) + 15}s"
    values = {"run_id": RUN_ID, "engine": ".*", "policy": policy, "replica": ".*", "datasource": "prometheus"}
    out = {}
    for target in panel["targets"]:
        result = check.query(stack["prometheus"], check.substitute(target["expr"], values, window))
        out[target["legendFormat"].split()[0]] = [float(r["value"][1]) for r in result]
    return out


@pytest.mark.parametrize("name", [m.name for m in LATENCY_HISTOGRAMS])
def test_saturated_latencies_read_right_on_every_latency_panel(stack, name):
    """100-150 s latencies (a saturated point): the panel's p50 and p99 within 20% of the exact ones, its
    mean 125 s, for every latency histogram the replicas export."""
    got = _panel_values(stack, _latency_panel(next(m for m in METRICS if m.name == name)), "latency-saturated")
    assert set(got) == {"p50", "p99", "mean"}
    for q in (0.5, 0.99):
        [estimate] = got[f"p{q * 100:g}"]
        exact = _nearest_rank(SATURATED_S, q)
        assert abs(estimate - exact) <= 0.2 * exact, f"{name} p{q * 100:g}: {estimate} vs exact {exact}"
    [mean] = got["mean"]
    assert mean == pytest.approx(125.0, rel=1e-3)


@pytest.mark.parametrize("name", [m.name for m in LATENCY_HISTOGRAMS])
def test_a_quantile_above_the_top_bucket_is_never_shown_as_a_number(stack, name):
    """Latencies past the top bucket: Prometheus' quantile is the top bound itself, the panel's is NaN (which
    the panel shows as "above the top bucket"); the exact mean still reads the latencies."""
    spec = next(m for m in METRICS if m.name == name)
    raw = f'histogram_quantile(0.99, sum by (le) ({spec.exported_name}_bucket{{policy="latency-above-top"}}))'
    assert check.finite_values(check.query(stack["prometheus"], raw)) == [LATENCY_TOP_S]
    panel = _latency_panel(spec)
    got = _panel_values(stack, panel, "latency-above-top")
    for q in ("p50", "p99"):
        assert len(got[q]) == 1 and math.isnan(got[q][0]), f"{name} {q}: {got[q]}"
    assert got["mean"] == [pytest.approx(2.0 * LATENCY_TOP_S, rel=1e-3)]
    texts = [
        m["options"]["result"]["text"]
        for o in panel["fieldConfig"]["overrides"]
        for p in o["properties"]
        for m in p["value"]
        if m["options"]["match"] == "nan"
    ]
    assert texts == ["above the top bucket (100,000 s)"] * 2


def test_saturated_point_summaries_read_exact_on_the_sweep_panels(stack):
    """A saturated point's pushed TTFT, TPOT and e2e quantiles reach every sweep panel as they were measured."""
    run_id = "test-metrics-saturated-point"
    exact = {q: _nearest_rank(SATURATED_S, float(f"0.{q[1:]}")) for q in ("p50", "p90", "p99")}
    record = {
        **_sweep_records(run_id)[0],
        **{f"{name}_{q}_s": v for name in ("ttft", "tpot", "e2e_latency") for q, v in exact.items()},
    }
    assert SweepPusher(stack["pushgateway"].removeprefix("http://"), run_id).push_point(record)
    prom = stack["prometheus"]
    wait_for(lambda: check.query(prom, f'scissorhands_sweep_ttft_seconds{{run_id="{run_id}"}}'), 30, "the pushed point")
    board = check.load_dashboards()["sweep-overview.json"]
    values = {"run_id": run_id, "policy": ".*", "datasource": "prometheus"}
    seen = 0
    for _, target in check.iter_targets(board):
        m = re.search(r'scissorhands_sweep_(ttft|tpot|e2e_latency)_seconds\{[^}]*quantile="(0\.\d+)"', target["expr"])
        if m:
            got = check.finite_values(check.query(prom, check.substitute(target["expr"], values)))
            assert got == [exact["p" + m.group(2)[2:].ljust(2, "0")]], target["expr"]
            seen += 1
    assert seen >= 5


@pytest.mark.parametrize("policy, rows", [("l21-3rows", 3), ("l21-5rows", 5)])
def test_means_through_the_real_exporter_are_exact(stack, policy, rows):
    """Every mean a dashboard shows is exact: the exact-sum counter over the histogram's count."""
    prom = stack["prometheus"]

    def mean(name: str) -> float:
        sel = f'{{run_id="{RUN_ID}", policy="{policy}"}}'
        [v] = check.finite_values(check.query(prom, f"{name}_exact_sum_total{sel} / {name}_count{sel}"))
        return v

    assert mean("ray_scissorhands_decode_batch_size") == rows
    assert mean("ray_scissorhands_decode_step_seconds") == pytest.approx(0.005, rel=1e-9)
    # the dashboard's panel reads exactly these series (its rate() over them gives the same ratio)
    board = check.load_dashboards()["live-replicas.json"]
    [panel] = [p for p in check.iter_panels(board) if p["title"] == "Mean decode batch size"]
    assert "ray_scissorhands_decode_batch_size_exact_sum_total" in panel["targets"][0]["expr"]


def test_pushed_points_keep_job_and_run_id_and_values(stack):
    result = check.query(stack["prometheus"], f'scissorhands_sweep_kv_cache_bytes{{run_id="{RUN_ID}", batch_size!=""}}')
    assert len(result) == 6  # the batch points; the failed one has no kv value
    assert {r["metric"]["job"] for r in result} == {"scissorhands_sweep"}
    by_key = {
        (r["metric"]["policy"], r["metric"]["compression_ratio"], r["metric"]["batch_size"]): float(r["value"][1])
        for r in result
    }
    assert by_key[("full", "1", "4")] == 65536 * 4
    assert by_key[("scissorhands", "5", "4")] == int(65536 * 4 * 0.2)
    [saved] = check.query(
        stack["prometheus"],
        (
            f'1 - (scissorhands_sweep_kv_cache_bytes{{run_id="{RUN_ID}", policy="scissorhands", compression_ratio="5", '
            f'batch_size="4"}} / ignoring(policy, compression_ratio, budget_tokens, kv_bits, point_id) group_left '
            f'scissorhands_sweep_kv_cache_bytes{{run_id="{RUN_ID}", policy="full"}})'
        ),
    )
    assert float(saved["value"][1]) == pytest.approx(0.8, abs=1e-4)
    [max_batch] = check.query(
        stack["prometheus"], f'scissorhands_sweep_max_batch_size{{run_id="{RUN_ID}", compression_ratio="5"}}'
    )
    assert float(max_batch["value"][1]) == 4  # batch 16 failed
    # the quality panels name a quantized cache "<policy> x<ratio> int<bits>"
    board = check.load_dashboards()["sweep-overview.json"]
    [panel] = [p for p in check.iter_panels(board) if p["title"].startswith("Accuracy vs compression ratio")]
    expr = check.substitute(panel["targets"][0]["expr"], {"run_id": RUN_ID, "policy": ".*"})
    series = {r["metric"]["series"]: float(r["value"][1]) for r in check.query(stack["prometheus"], expr)}
    assert series["scissorhands x5 int4"] == pytest.approx(0.7)
    assert series["full x1"] == pytest.approx(0.9)


def test_the_slo_panels_show_each_serving_points_attainment_and_goodput_at_its_load(stack):
    """The sweep overview's SLO row: one value per (policy x ratio, load), the load read from the point's request
    rate; and the table of points carries attainment and both goodputs per point, exactly as pushed."""
    board = check.load_dashboards()["sweep-overview.json"]
    values = {"run_id": RUN_ID, "policy": ".*", "datasource": "prometheus"}
    panels = {p["title"]: p for p in check.iter_panels(board)}
    for title, which in (("SLO attainment vs load, per policy", 0), ("Goodput vs load, per policy", 1)):
        [target] = panels[title]["targets"]
        result = check.query(stack["prometheus"], check.substitute(target["expr"], values))
        got = {(r["metric"]["series"], r["metric"]["load"]): float(r["value"][1]) for r in result}
        assert got == {
            (f"{policy} x{1 if ratio is None else int(ratio)}", f"{rate:g}"): point[which]
            for (policy, ratio), by_rate in SERVING_POINTS.items()
            for rate, point in by_rate.items()
        }, title
    table = panels["Points of the run"]
    for ref, key in (("H", "slo_attainment"), ("I", "goodput_req_per_s"), ("J", "goodput_tok_per_s")):
        [target] = [t for t in table["targets"] if t["refId"] == ref]
        result = check.query(stack["prometheus"], check.substitute(target["expr"], values))
        got = sorted(float(r["value"][1]) for r in result)
        assert got == sorted(r[key] for r in _serving_records(RUN_ID)), key


# --------------------------------------------------------------------------- a real sweep on the tiny model
TINY_SUITE = """\
kind: batch
name: metrics-test
description: the smallest sweep that feeds every dashboard panel (tiny random-weight model)
model: tiny-llama
dtype: float32
device: cpu
policies: [full, scissorhands]
compression_ratios: [2]
batch_sizes: [1, 2]
prompt_tokens: [32]
new_tokens: [{new_tokens}]
seed: 0
replicas: 1
"""
TINY_POINTS = 4
# The live panels are rates over histograms and counters. Prometheus sees an increase only between
# two scrapes, and a series is born with its first exported value, so each (policy, ratio) needs two
# observations more than one export + scrape interval apart (1 s here). The points run batch-major
# (full b1, scissorhands b1, full b2, ...), so a series' two observations lie two points' run time
# apart: 448 new tokens make a point last about 0.8 s on an idle core (several seconds on a loaded one).
LIVE_NEW_TOKENS = 448


def _run_sweep(stack, tmp_path, run_id: str, pushgateway: str, new_tokens: int = 8):
    """`python -m workloads.sweep` on the tiny model, joined to the test's Ray head."""
    import subprocess

    suite = tmp_path / "metrics-test.yaml"
    suite.write_text(TINY_SUITE.format(new_tokens=new_tokens))
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "SCISSORHANDS_PUSHGATEWAY": pushgateway,
    }
    started = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "workloads.sweep",
            str(suite),
            "--results-dir",
            str(tmp_path / "results"),
            "--run-id",
            run_id,
            "--address",
            stack["ray_address"],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    points = tmp_path / "results" / run_id / "points.jsonl"
    return proc, points, started


def _assert_results_whole(proc, points):
    import json

    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = points.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one whole JSON record
    assert len(records) == TINY_POINTS
    assert len({r["point_id"] for r in records}) == TINY_POINTS
    assert all(r["status"] == "ok" and r["output_throughput_tok_per_s"] > 0 for r in records)
    assert (points.parent / "table.md").exists()
    return records


def test_sweep_completes_with_the_pushgateway_down(stack, tmp_path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc, points, _ = _run_sweep(stack, tmp_path, "metrics-test-pushgateway-down", dead)
    _assert_results_whole(proc, points)
    notices = [line for line in proc.stderr.splitlines() if "Pushgateway" in line]
    assert len(notices) <= 1, notices  # one notice at most, never a traceback
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def real_sweep(stack, tmp_path_factory):
    run_id = "metrics-test-real-sweep"
    proc, points, started = _run_sweep(
        stack, tmp_path_factory.mktemp("sweep"), run_id, stack["pushgateway"], new_tokens=LIVE_NEW_TOKENS
    )
    records = _assert_results_whole(proc, points)
    return {"run_id": run_id, "records": records, "started": started, "finished": time.time()}


def test_real_sweep_feeds_every_sweep_panel(stack, real_sweep):
    prom, run_id = stack["prometheus"], real_sweep["run_id"]
    wait_for(
        lambda: check.query(prom, f'scissorhands_sweep_points_completed{{run_id="{run_id}"}} == {TINY_POINTS}'),
        30,
        "the sweep's progress in Prometheus",
    )
    kv = check.query(prom, f'scissorhands_sweep_kv_cache_bytes{{run_id="{run_id}"}}')
    assert len(kv) == TINY_POINTS
    by_point = {(r["metric"]["policy"], r["metric"]["batch_size"]): float(r["value"][1]) for r in kv}
    for rec in real_sweep["records"]:
        assert by_point[(rec["policy"], str(rec["batch_size"]))] == rec["kv_cache_bytes"]
    has_quality = any(r.get("perplexity") is not None or r.get("accuracy") is not None for r in real_sweep["records"])
    # SLO attainment and goodput are serving points' (a batch sweep pushes none; the stack's serving records feed
    # those panels in test_the_slo_panels_show_each_serving_points_attainment_and_goodput_at_its_load)
    has_slo = any(r.get("slo_attainment") is not None for r in real_sweep["records"])
    slo_series = ("scissorhands_sweep_slo_attainment_ratio", "scissorhands_sweep_goodput_")
    rows = [r for r in check.check(prom, run_id, rate_interval="30s") if r[0] == "sweep-overview.json"]
    empty = [
        f"{title} [{ref}]: {expr}"
        for _, title, ref, expr, values in rows
        if not values
        and (
            has_quality
            or "scissorhands_sweep_perplexity" not in expr
            and "scissorhands_sweep_accuracy_ratio" not in expr
        )
        and (has_slo or not any(name in expr for name in slo_series))
    ]
    assert not empty, "sweep panels without data:\n" + "\n".join(empty)


def test_real_sweep_feeds_every_live_panel(stack, real_sweep):
    prom, run_id = stack["prometheus"], real_sweep["run_id"]
    # the raw samples of a range selector carry their scrape times: the last is the last scrape that still
    # found the replicas' gauges (a query_range step is no such moment: its 5-minute lookback reports a
    # series up to the range's end until the stale marker of the scrape after the replicas' exit lands,
    # which can come between two of the panel queries below, so late panels read empty)
    since_s = math.ceil(time.time() - real_sweep["started"]) + 5
    data = check.query(prom, f'ray_scissorhands_running_sequences{{run_id="{run_id}"}}[{since_s}s]')
    stamps = [float(t) for series in data for t, _ in series["values"]]
    assert stamps, f"no live replica metrics of run {run_id} were scraped"
    # the last moment the replicas were scraped, with the rate window over the whole sweep (Grafana's
    # $__rate_interval widens with the time range shown): every point's observations count, however
    # long the points took on this machine
    window_s = math.ceil(max(stamps) - real_sweep["started"]) + 5
    rows = check.check(prom, run_id, rate_interval=f"{window_s}s", at={"live-replicas.json": max(stamps)})
    # the HTTP row reads Ray Serve's metrics: the batch sweep drives its replicas as actors, not over HTTP
    # (that row is checked with the service's load in test_every_panel_of_every_dashboard_returns_data); the
    # "(paged layout)" panels read series a static batch has none of (no block pool, no preemption): they are
    # checked against a real paged engine in test_a_paged_engine_feeds_the_paged_panels_with_its_own_counts,
    # and here the sweep must have exported none of them (absent, never a made-up zero)
    empty = [
        f"{title} [{ref}]: {expr}"
        for file, title, ref, expr, values in rows
        if file == "live-replicas.json"
        and not values
        and "ray_serve_" not in expr
        and not check.metric_names(expr) & set(PAGED_NAMES + PREFIX_NAMES)
    ]
    assert not empty, "live panels without data during the sweep:\n" + "\n".join(empty)
    for name in PAGED_NAMES + PREFIX_NAMES:
        seen = check.query(prom, f'count_over_time({name}{{run_id="{run_id}"}}[{window_s}s])', max(stamps))
        assert not seen, f"a batch sweep (no block pool, no prefix cache) exported {name}: {seen}"
    # the replicas stay up one export + scrape interval after the last point, so the counters end whole:
    # one token per sequence per forward (prefill + every decode step)
    tokens = check.query(
        prom,
        f'sum by (policy) (max_over_time(ray_scissorhands_generated_tokens_total{{run_id="{run_id}"}}[{window_s}s]))',
        max(stamps),
    )
    expected: dict[str, float] = {}
    for rec in real_sweep["records"]:
        expected[rec["policy"]] = expected.get(rec["policy"], 0) + rec["batch_size"] * LIVE_NEW_TOKENS
    assert (
        {r["metric"]["policy"]: float(r["value"][1]) for r in tokens}
        == expected
        == {"full": 1344, "scissorhands": 1344}
    )
