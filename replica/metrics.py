"""Prometheus metrics of the benchmark: the one catalogue, and the live replica metrics.

Two exporters publish metrics, and every name either of them publishes is listed once, in
`METRICS` (name, type, help, labels, source); tests and dashboards check against it.

* Live replica metrics (`source="ray"`) go through `ray.util.metrics`; Ray exports them on
  every node's metrics port, and Prometheus finds the nodes through the service-discovery file
  Ray writes (`/tmp/ray/prom_metrics_service_discovery.json`). Ray 2.60 prefixes application
  metrics with ``ray_`` on export, and appends ``_total`` to counters itself, so the counter
  ``scissorhands_generated_tokens_total`` is created in Ray as ``scissorhands_generated_tokens``
  and scraped as ``ray_scissorhands_generated_tokens_total``. `MetricSpec.exported_name` gives
  the name Prometheus stores; dashboards use that.
* Sweep summaries (`source="pushgateway"`) are pushed with `prometheus_client` by
  `workloads.core.push.SweepPusher`, under exactly the names listed here (no prefix added).

Naming (docs/monitoring.md, "Metric names"): prefix ``scissorhands_``, base units in the name (``_seconds``,
``_bytes``, ``_tokens``), counters end in ``_total``, ratios lie in 0..1, labels are low
cardinality only.

`ReplicaMetrics` is what a replica calls::

    from replica.metrics import ReplicaMetrics
    base = ReplicaMetrics(policy="full", compression_ratio=None, replica="replica-0",
                          model="embedded", run_id="smoke-20260101T000000Z")  # in-memory when Ray is off
    m = base.for_point("scissorhands", 5)        # labels of the point being run
    m.observe_prefill(0.120, tokens=4 * 128)     # one prefill forward: seconds, prompt tokens
    m.observe_decode_step(0.015, batch_size=4)   # one decode forward: seconds, sequences
    m.observe_ttft(0.120); m.add_generated_tokens(4); m.set_kv_cache(bytes=1 << 20, slots=4 * 32)
    m.add_generated_tokens(2, phase="warmup")  # tokens of the load generator's warm-up requests

`NullMetrics`, the base class `ReplicaMetrics` overrides, has the same methods and records nothing (live metrics
off).

Exact means: Ray's exporter writes a histogram's ``_sum`` as bucket midpoints times bucket counts,
not the values observed (an example in docs/performance.md). So every histogram has a companion counter
``<histogram>_exact_sum_total`` (`MetricSpec.exact_sum`) that the recorder increments by the exact
value of each observation; a mean is ``rate(<h>_exact_sum_total) / rate(<h>_count)`` (the
``_count`` is exact). Histograms serve quantiles only; no dashboard reads their ``_sum``
(`dashboards/check.py` refuses it).

Quantiles: latency histograms have E12 buckets from 1 ms to `LATENCY_TOP_S` (27.8 h), so
`histogram_quantile` lands within 25% of the true value anywhere in that range. A quantile beyond the
top bucket falls in +Inf, where Prometheus returns the top bound; every dashboard quantile is guarded
to show it as "above the top bucket" instead (`dashboards/check.py`, `guard_quantile`), and Ray
Serve's own latency histograms (top 10 min) the same way.

Warm-up: request-level metrics (generated and prefill tokens, TTFT, TPOT) carry a
``phase`` label, ``measured`` or ``warmup`` (the load generator marks its warm-up requests,
`replica.common.types.GenerationRequest.warmup`), so the server-side figures of a point can be taken
over the same requests as the client's. Step-level metrics (step times, batch sizes, KV bytes)
describe the engine, whichever requests are in the step, and have no phase.

Paged KV layout: an engine with a block pool (`EngineConfig.kv_layout` ``paged``) also records its used and free
blocks after every step (`set_kv_blocks`) and each preemption with the tokens it will recompute
(`add_preemption`). On the preallocated layout there is no pool: those series are absent, never zero (an
engine without a pool calls `clear_kv_blocks`, so a replica reconfigured from paged to preallocated stops
showing its old pool); a paged replica that never preempted has no preemption series yet (a Ray counter
is exported from its first increment).

Engines: every live series carries ``engine`` (`REPLICA_LABELS`). OpenVINO GenAI's backend
(`replica.backends.openvino`) records what its pipeline reports (``get_metrics()``): running sequences (its
``scheduled_requests``), queued ones (ours' queue plus the requests it holds unscheduled), KV bytes, slots and
used/free blocks (its ``cache_usage`` of the pool), generated tokens, TTFT and TPOT. Its pipeline counts no
preemptions, recomputed tokens or evicted tokens and times no prefill or decode forward apart (one fused step),
so those series are absent for ``engine="openvino"``, never zero.

Prefix cache: an engine of ours with `EngineConfig.enable_prefix_caching` counts each admission's prompt tokens
taken from the cache and computed (`add_prefix_cache_tokens`, with ``phase``) and after every step records the
blocks cached and those reclaimed since (`set_prefix_cache`). With the cache off, on OpenVINO GenAI's backend (its
pipeline reports no prefix cache figures) and in static batches those series are absent, never zero (an engine
without a prefix cache calls `clear_prefix_cache`).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping

from replica.common.metric_labels import (
    OURS_ENGINE,
    PHASE_LABEL,
    PHASES,
    POINT_LABELS,
    PREFIX,
    RAY_EXPORT_PREFIX,
    REPLICA_LABELS,
)


def _e12_buckets(low_s: float, high_s: float) -> tuple[float, ...]:
    """Upper bounds from the E12 preferred-number series (IEC 60063) between low and high.

    Neighbouring bounds differ by at most 25%, so `histogram_quantile` lands within a bucket of
    that width around the true value.
    """
    mantissas = (1.0, 1.2, 1.5, 1.8, 2.2, 2.7, 3.3, 3.9, 4.7, 5.6, 6.8, 8.2)
    out = []
    exponent = math.floor(math.log10(low_s))
    while True:
        for m in mantissas:
            value = float(f"{m * 10.0**exponent:.6g}")  # 0.0012, not 0.0012000000000000001
            if value > high_s * 1.0000001:
                return tuple(out)
            if value >= low_s * 0.9999999:
                out.append(value)
        exponent += 1


#: Top finite latency bucket in seconds (27.8 h): a request a suite waits a day for still lands in a
#: finite bucket. Suites set no upper limit on `request_timeout_s` (none by default), so anything
#: longer falls in +Inf, where `histogram_quantile` returns this bound; the dashboards show such a
#: quantile as "above the top bucket", never as a number (`dashboards.check.guard_quantile`).
LATENCY_TOP_S = 100_000.0
#: Latency buckets in seconds: 1 ms .. `LATENCY_TOP_S`, E12 steps (97 bounds; +Inf is implicit).
LATENCY_BUCKETS_S: tuple[float, ...] = _e12_buckets(0.001, LATENCY_TOP_S)
#: Batch-size buckets in sequences: powers of two, 1 .. 1024.
BATCH_SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(11))


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric.

    `name` is the name this project gives it (ends in ``_total`` for counters); `kind` is
    ``counter``, ``gauge`` or ``histogram``; `source` is ``ray`` (live, `ray.util.metrics`) or
    ``pushgateway`` (sweep summaries); `buckets` are histogram upper bounds in the metric's unit.
    `record_key` names the results-record key a per-point summary is read from
    (`workloads.core.results`); with a ``quantile`` label it holds ``{q}``, filled with each of
    `RECORD_QUANTILES`' keys (``ttft_{q}_s`` -> ``ttft_p50_s``).
    """

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    source: str
    buckets: tuple[float, ...] = ()
    record_key: str = ""

    @property
    def ray_name(self) -> str:
        """The name to pass to `ray.util.metrics` (Ray adds ``_total`` to counters itself)."""
        if self.kind == "counter":
            return self.name.removesuffix("_total")
        return self.name

    @property
    def exported_name(self) -> str:
        """The metric name as Prometheus stores it (what a dashboard's PromQL must use)."""
        if self.source in ("ray", "ray_serve"):
            return RAY_EXPORT_PREFIX + self.name
        return self.name

    @property
    def exact_sum(self) -> "MetricSpec":
        """The counter holding the exact sum of a histogram's observations (its ``_sum`` is not exact
        under Ray's exporter; see the module docstring). ValueError for a counter or gauge."""
        if self.kind != "histogram":
            raise ValueError(f"{self.name}: only a histogram has an exact-sum counter (kind is {self.kind!r})")
        return MetricSpec(
            self.name + "_exact_sum_total",
            "counter",
            f"Exact sum of the values observed in {self.name} (mean = this / {self.name}_count).",
            self.labels,
            self.source,
        )

    @property
    def sample_names(self) -> tuple[str, ...]:
        """Every sample name in the exposition text (``_bucket``/``_sum``/``_count`` for histograms)."""
        if self.kind == "histogram":
            return tuple(self.exported_name + s for s in ("_bucket", "_sum", "_count"))
        return (self.exported_name,)


def _replica(name: str, kind: str, help: str, buckets: tuple[float, ...] = (), per_request: bool = False) -> MetricSpec:
    """A live replica metric; `per_request` ones count requests' work and carry the `phase` label."""
    labels = REPLICA_LABELS + ((PHASE_LABEL,) if per_request else ())
    return MetricSpec(PREFIX + name, kind, help, labels, "ray", buckets)


#: Record-key suffix -> the `quantile` label value of a per-point latency summary.
RECORD_QUANTILES: dict[str, str] = {"p50": "0.5", "p90": "0.9", "p95": "0.95", "p99": "0.99"}


def _point(name: str, record_key: str, help: str, extra_labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(
        PREFIX + "sweep_" + name, "gauge", help, POINT_LABELS + extra_labels, "pushgateway", record_key=record_key
    )


#: Every metric the project exports, live and pushed. Tests and dashboards read this list.
METRICS: tuple[MetricSpec, ...] = (
    # live, per replica, through ray.util.metrics
    _replica("running_sequences", "gauge", "Sequences in the batch the replica is running now."),
    _replica("queued_sequences", "gauge", "Sequences waiting in the replica's queue."),
    _replica(
        "generated_tokens_total", "counter", "Output tokens generated (counted from generated ids).", per_request=True
    ),
    _replica("prefill_tokens_total", "counter", "Prompt tokens processed by prefill forwards.", per_request=True),
    _replica("prefill_seconds", "histogram", "Wall time of one prefill forward.", LATENCY_BUCKETS_S),
    _replica(
        "decode_step_seconds", "histogram", "Wall time of one decode-step forward (whole batch).", LATENCY_BUCKETS_S
    ),
    _replica("decode_batch_size", "histogram", "Sequences in one decode-step forward.", BATCH_SIZE_BUCKETS),
    _replica(
        "ttft_seconds",
        "histogram",
        "Time to first token: request start to first generated token.",
        LATENCY_BUCKETS_S,
        per_request=True,
    ),
    _replica(
        "tpot_seconds",
        "histogram",
        "Time per output token: (e2e - ttft) / (output tokens - 1).",
        LATENCY_BUCKETS_S,
        per_request=True,
    ),
    _replica(
        "kv_cache_bytes", "gauge", "Bytes of every tensor the replica's KV caches hold now, bookkeeping included."
    ),
    _replica(
        "kv_cache_slots", "gauge", "KV slots in use now (token positions kept per KV head, summed over sequences)."
    ),
    _replica(
        "evicted_tokens_total",
        "counter",
        "Token positions the policy evicted from the KV cache, summed over sequences (per KV head: tokens seen minus slots kept).",
    ),
    _replica("model_load_seconds", "gauge", "Wall time of the replica's last model load."),
    # the paged KV layout only (`kv_layout: paged`); a replica on the preallocated layout has no pool and exports none
    _replica(
        "kv_used_blocks",
        "gauge",
        "Paged KV layout only: blocks of the replica's KV pool held by sequences now (all layers; a block is "
        "block_tokens slots of one layer).",
    ),
    _replica(
        "kv_free_blocks",
        "gauge",
        "Paged KV layout only: blocks of the replica's KV pool free now (used + free = the pool's blocks).",
    ),
    _replica(
        "preemptions_total",
        "counter",
        "Paged KV layout only: running sequences preempted for want of free blocks (freed, requeued, recomputed).",
    ),
    _replica(
        "recomputed_tokens_total",
        "counter",
        "Paged KV layout only: tokens whose KV a preemption freed, fed again by the sequence's next prefill "
        "(its prompt and the outputs fed so far).",
    ),
    # the prefix cache of the paged engine (`enable_prefix_caching`, or `kv_reuse: shared_prefix`); absent when off, on OpenVINO
    _replica(
        "prefix_cache_hit_tokens_total",
        "counter",
        "Prefix cache only: prompt tokens a request's prefill took from the prefix cache (counted at admission; a "
        "preempted request's recompute counts again).",
        per_request=True,
    ),
    _replica(
        "prefix_cache_miss_tokens_total",
        "counter",
        "Prefix cache only: prompt tokens a request's prefill computed, not found in the prefix cache (counted at "
        "admission; hit + miss = the prompt tokens admitted).",
        per_request=True,
    ),
    _replica(
        "prefix_cache_reclaimed_blocks_total",
        "counter",
        "Prefix cache only: pool blocks of idle cached entries reclaimed (least recently used) for other rows.",
    ),
    _replica(
        "kv_prefix_cache_blocks",
        "gauge",
        "Prefix cache only: pool blocks holding cached prefix entries now, in use or idle (all layers).",
    ),
    # per sweep point, through the Pushgateway (grouping key: job="scissorhands_sweep", run_id, point_id)
    _point(
        "output_throughput_tokens_per_second",
        "output_throughput_tok_per_s",
        "Output tokens produced inside the window (every request's, warm-ups included) / window length.",
    ),
    _point(
        "total_throughput_tokens_per_second",
        "total_throughput_tok_per_s",
        "(Prompt tokens of the requests whose first token came inside the window + output tokens produced inside it) "
        "/ window length.",
    ),
    _point(
        "ttft_seconds",
        "ttft_{q}_s",
        "Time to first token at the given quantile of the point's requests.",
        ("quantile",),
    ),
    _point(
        "tpot_seconds",
        "tpot_{q}_s",
        "Time per output token at the given quantile of the point's requests.",
        ("quantile",),
    ),
    _point(
        "e2e_latency_seconds",
        "e2e_latency_{q}_s",
        "Request latency (start to last token) at the given quantile.",
        ("quantile",),
    ),
    _point(
        "slo_attainment_ratio",
        "slo_attainment",
        "Serving points: fraction (0..1) of the point's measured requests that met every latency SLO "
        "(TTFT, TPOT, optionally e2e; failed and dropped ones miss).",
    ),
    _point(
        "goodput_requests_per_second",
        "goodput_req_per_s",
        "Serving points: requests that met every latency SLO and completed in the window / window length.",
    ),
    _point(
        "goodput_tokens_per_second",
        "goodput_tok_per_s",
        "Serving points: output tokens of the requests that met every latency SLO, produced in the window / window "
        "length.",
    ),
    _point("kv_cache_bytes", "kv_cache_bytes", "Peak bytes the KV cache held during the point, bookkeeping included."),
    _point("perplexity", "perplexity", "Perplexity of the policy's cache on the evaluation text (quality runs)."),
    _point("accuracy_ratio", "accuracy", "Accuracy in 0..1 of the policy's cache on the point's task (quality runs)."),
    # per (policy, ratio, model) of a run
    MetricSpec(
        PREFIX + "sweep_max_batch_size",
        "gauge",
        "Largest batch size that completed without error (the batch that fits at the memory limit).",
        ("policy", "compression_ratio", "kv_bits", "model"),
        "pushgateway",
    ),
    # progress of a run
    MetricSpec(PREFIX + "sweep_points_completed", "gauge", "Points of the sweep finished so far.", (), "pushgateway"),
    MetricSpec(PREFIX + "sweep_points_planned", "gauge", "Points the sweep will run in all.", (), "pushgateway"),
    MetricSpec(
        PREFIX + "sweep_last_success_timestamp_seconds",
        "gauge",
        "Unix time at which the last point finished successfully.",
        (),
        "pushgateway",
    ),
)

#: Every histogram's exact-sum counter follows it in the catalogue (a new histogram gets one).
METRICS = METRICS + tuple(m.exact_sum for m in METRICS if m.kind == "histogram")

METRICS_BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}

#: Live metrics that only a replica on the paged KV layout exports (its block pool and its preemptions); on the
#: preallocated layout, and in static batches, they are absent (see the module docstring), so their panels are
#: titled "(paged layout)" and a batch sweep never feeds them.
PAGED_LAYOUT_METRICS: frozenset[str] = frozenset(
    PREFIX + n for n in ("kv_used_blocks", "kv_free_blocks", "preemptions_total", "recomputed_tokens_total")
)

#: Live metrics that only a replica of ours with the prefix cache on exports (`EngineConfig.enable_prefix_caching`,
#: the paged layout); with it off, on OpenVINO GenAI's backend and in static batches they are absent, never zero, so
#: their panels are titled "(prefix cache)".
PREFIX_CACHE_METRICS: frozenset[str] = frozenset(
    PREFIX + n
    for n in (
        "prefix_cache_hit_tokens_total",
        "prefix_cache_miss_tokens_total",
        "prefix_cache_reclaimed_blocks_total",
        "kv_prefix_cache_blocks",
    )
)

#: Ray Serve's own metrics that the dashboards read (`source="ray_serve"`): Serve defines and records
#: them (`ray/serve/_private/request_ingress_metrics.py`, `replica.py`, `router.py` in the installed
#: Ray 2.60), in its own units (milliseconds), and Ray exports them with the ``ray_`` prefix through the
#: same node metrics port and service discovery as the replicas' live metrics. Listed here so that every
#: name a dashboard uses is in one catalogue; the project never records them itself. Labels: the ones
#: Serve sets that the dashboards group by (Serve adds others, e.g. `method`, `replica`, `handle`).
_SERVE_PROXY_LABELS = ("route", "method", "application", "status_code")  # an HTTP request at the proxy
_SERVE_CALL_LABELS = ("deployment", "replica", "route", "application")  # one call of a deployment


#: Ray Serve 2.60's latency buckets in ms (`DEFAULT_LATENCY_BUCKET_MS` of `ray/serve/_private/constants.py`;
#: the environment variable `RAY_SERVE_REQUEST_LATENCY_BUCKETS_MS` replaces them): the top is 10 minutes.
SERVE_LATENCY_BUCKETS_MS: tuple[float, ...] = (
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 300.0, 400.0, 500.0, 1000.0, 2000.0, 5000.0,
    10000.0, 60000.0, 120000.0, 300000.0, 600000.0,
)  # fmt: skip


def _serve(name: str, kind: str, labels: tuple[str, ...], help: str) -> MetricSpec:
    buckets = SERVE_LATENCY_BUCKETS_MS if kind == "histogram" else ()
    return MetricSpec(name, kind, help, labels, "ray_serve", buckets)


SERVE_METRICS: tuple[MetricSpec, ...] = (
    _serve(
        "serve_num_http_requests_total",
        "counter",
        _SERVE_PROXY_LABELS,
        "HTTP requests the Serve proxy answered, by status code and route.",
    ),
    _serve(
        "serve_http_request_latency_ms",
        "histogram",
        _SERVE_PROXY_LABELS,
        "End-to-end latency of an HTTP request at the Serve proxy (ms; a stream counts until its last byte).",
    ),
    _serve(
        "serve_deployment_queued_queries",
        "gauge",
        ("deployment", "application"),
        "Requests to a deployment waiting in its callers' routers for a replica (Serve's queue).",
    ),
    _serve(
        "serve_replica_processing_queries",
        "gauge",
        ("deployment", "replica", "application"),
        "Requests a deployment's replica is processing now (ongoing; bounded by max_ongoing_requests).",
    ),
    _serve(
        "serve_deployment_request_counter_total",
        "counter",
        _SERVE_CALL_LABELS,
        "Calls a deployment's replicas processed (the engine deployment gets 2 per HTTP request: check and stream).",
    ),
    _serve(
        "serve_deployment_processing_latency_ms",
        "histogram",
        _SERVE_CALL_LABELS,
        "Time a deployment's replica spent on one call (ms; a stream until its last item).",
    ),
)


def catalogue_markdown() -> str:
    """The catalogue as the Markdown table of docs/monitoring.md (`python -m replica.metrics`): the names
    Prometheus stores, our metrics then Ray Serve's."""
    lines = ["| metric | type | source | meaning |", "|---|---|---|---|"]
    for m in METRICS + SERVE_METRICS:
        source = {"ray": "replica (live)", "pushgateway": "sweep (pushed)", "ray_serve": "Ray Serve"}[m.source]
        lines.append(f"| `{m.exported_name}` | {m.kind} | {source} | {m.help} |")
    return "\n".join(lines)


def metric(name: str) -> MetricSpec:
    """The spec of `name` (project name, e.g. ``scissorhands_ttft_seconds``); KeyError lists valid names."""
    try:
        return METRICS_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; known: {sorted(METRICS_BY_NAME)}") from None


def exported_metric_names(source: str | None = None) -> set[str]:
    """Names as Prometheus stores them (``ray_``-prefixed for live metrics), optionally of one source."""
    return {m.exported_name for m in METRICS if source is None or m.source == source}


def label_value(value) -> str:
    """A label value as this project writes it: ints plainly, floats with `%g`, None as ``""``.

    ``5`` and ``5.0`` both give ``"5"``, so live and pushed series join on `compression_ratio`.
    """
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


#: Policy name of the uncompressed reference cache.
FULL_POLICY = "full"


def ratio_label(policy: str, compression_ratio) -> str:
    """`compression_ratio` label: the ratio (``%g``); ``"1"`` for the full cache without a ratio;
    ``""`` for a compressed cache whose budget is absolute (no ratio)."""
    if compression_ratio is None or compression_ratio == "":
        return "1" if policy == FULL_POLICY else ""
    return label_value(float(compression_ratio))


class _LocalRecorder:
    """Stand-in for `ray.util.metrics` when Ray is not initialised: keeps values in memory.

    `values[name][label tuple]` is the counter sum, the last gauge value, or for histograms
    ``(count, sum)``; plain-class unit tests read them through `ReplicaMetrics.snapshot()`.
    """

    def __init__(self):
        self.values: dict[str, dict[tuple, object]] = {}

    def record(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        series = self.values.setdefault(spec.name, {})
        key = tuple(tags[k] for k in spec.labels)
        if spec.kind == "counter":
            series[key] = series.get(key, 0.0) + value
        elif spec.kind == "gauge":
            series[key] = value
        else:
            count, total = series.get(key, (0, 0.0))
            series[key] = (count + 1, total + value)

    def forget(self, spec: MetricSpec, tags: Mapping[str, str]) -> None:
        """Drop the series of `spec` with `tags` (its labels' values)."""
        self.values.get(spec.name, {}).pop(tuple(tags[k] for k in spec.labels), None)


#: Seconds between re-records of every gauge's last value (see `_RayRecorder`).
GAUGE_REFRESH_S = 1.0


class _RayRecorder:
    """Records into `ray.util.metrics` objects, created once per process and metric name.

    Ray exports a gauge only while it is being set: a value set once disappears from the
    exporter after about two export intervals (docs/performance.md). So the recorder keeps every gauge series' last value and a
    daemon thread re-records them every `GAUGE_REFRESH_S`; an idle replica still shows
    running 0 and its KV bytes, and the model load time stays visible.
    """

    _objects: dict[str, object] = {}
    _gauge_values: dict[tuple[str, tuple], tuple[object, dict, float]] = {}
    _lock = threading.Lock()
    _thread: threading.Thread | None = None

    def _object(self, spec: MetricSpec):
        m = self._objects.get(spec.name)
        if m is None:
            from ray.util import metrics as ray_metrics

            if spec.kind == "counter":
                m = ray_metrics.Counter(spec.ray_name, description=spec.help, tag_keys=spec.labels)
            elif spec.kind == "gauge":
                m = ray_metrics.Gauge(spec.ray_name, description=spec.help, tag_keys=spec.labels)
            else:
                m = ray_metrics.Histogram(
                    spec.ray_name, description=spec.help, boundaries=list(spec.buckets), tag_keys=spec.labels
                )
            self._objects[spec.name] = m
        return m

    def record(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        tags = dict(tags)
        with self._lock:
            m = self._object(spec)
            if spec.kind == "counter":
                m.inc(value, tags=tags)
            elif spec.kind == "gauge":
                m.set(value, tags=tags)
                self._gauge_values[(spec.name, tuple(sorted(tags.items())))] = (m, tags, value)
                self._ensure_refresher()
            else:
                m.observe(value, tags=tags)

    def forget(self, spec: MetricSpec, tags: Mapping[str, str]) -> None:
        """Stop re-recording the gauge series of `spec` with `tags`: Ray drops it after about two export
        intervals (Ray cannot remove a series at once)."""
        with self._lock:
            self._gauge_values.pop((spec.name, tuple(sorted(dict(tags).items()))), None)

    @classmethod
    def _ensure_refresher(cls) -> None:
        if cls._thread is None or not cls._thread.is_alive():
            cls._thread = threading.Thread(target=cls._refresh_forever, name="scissorhands-gauges", daemon=True)
            cls._thread.start()

    @classmethod
    def _refresh_forever(cls) -> None:
        while True:
            time.sleep(GAUGE_REFRESH_S)
            with cls._lock:
                for m, tags, value in list(cls._gauge_values.values()):
                    try:
                        m.set(value, tags=tags)
                    except Exception:  # noqa: BLE001 - metrics must never break a replica
                        pass


def _ray_is_initialized() -> bool:
    """Whether this process runs Ray (always inside an actor); a process that never imported Ray does not,
    and is not made to import it here."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


_REPLICA_SPECS = {m.name: m for m in METRICS if m.source == "ray"}


class NullMetrics:
    """The recorder interface, recording nothing: the base class of `ReplicaMetrics`, and the recorder of a
    replica whose live metrics are off.

    Every live metric is one method here that does nothing, overridden once by `ReplicaMetrics`, so the two
    cannot drift (a live metric is added as a method of `ReplicaMetrics` plus its no-op here). The engine and
    the static-batch replica call their recorder unconditionally; they get this one when no recorder is given
    (an engine built by a benchmark or a test) and for the replica's warm-up. `for_point` returns the same
    object; `snapshot` is empty. Arguments are in base units (seconds, bytes, tokens); see `ReplicaMetrics`.
    """

    uses_ray = False

    def for_point(self, policy: str, compression_ratio: float | None, run_id: str | None = None) -> "NullMetrics":
        """A recorder for one point's policy and ratio (this one: nothing is labelled)."""
        return self

    def observe_prefill(self, seconds: float, tokens: int, warmup_tokens: int = 0) -> None:
        """One prefill forward: wall time (s), prompt tokens of measured and of warm-up requests."""

    def observe_decode_step(self, seconds: float, batch_size: int) -> None:
        """One decode-step forward: wall time (s) and sequences in it."""

    def observe_ttft(self, seconds: float, phase: str = "measured") -> None:
        """Time to first token of one request (s)."""

    def observe_tpot(self, seconds: float, phase: str = "measured") -> None:
        """Time per output token of one request (s)."""

    def set_running(self, n: int) -> None:
        """Sequences in the batch running now."""

    def set_queued(self, n: int) -> None:
        """Sequences waiting in the queue now."""

    def add_generated_tokens(self, n: int, phase: str = "measured") -> None:
        """`n` more output tokens of `phase`'s requests."""

    def set_kv_cache(self, bytes: int, slots: int) -> None:  # the field's term (shadows the builtin on purpose)
        """KV cache size now: bytes and slots in use."""

    def add_evictions(self, n: int) -> None:
        """`n` more token positions evicted by the policy."""

    def observe_model_load(self, seconds: float) -> None:
        """Wall time of the model load (s)."""

    def set_kv_blocks(self, used: int, free: int) -> None:
        """Paged KV layout: blocks of the pool used and free now."""

    def clear_kv_blocks(self) -> None:
        """Stop reporting the block gauges (no block pool any more)."""

    def add_preemption(self, recomputed_tokens: int) -> None:
        """One sequence preempted, whose next prefill recomputes `recomputed_tokens` tokens."""

    def add_prefix_cache_tokens(self, hit: int, miss: int, phase: str = "measured") -> None:
        """Prefix cache: one admission's prompt tokens taken from the cache (`hit`) and computed (`miss`)."""

    def set_prefix_cache(self, blocks: int, reclaimed_blocks: int) -> None:
        """Prefix cache: pool blocks cached now, and `reclaimed_blocks` more reclaimed since the last call."""

    def clear_prefix_cache(self) -> None:
        """Stop reporting the prefix cache's block gauge (no prefix cache any more)."""

    def snapshot(self, phase: str = "measured") -> dict[str, object]:
        """In-memory values by metric name (none here)."""
        return {}


class ReplicaMetrics(NullMetrics):
    """Live metrics of one replica, exported through `ray.util.metrics` (see the module docstring): overrides
    each no-op of `NullMetrics` once.

    Args:
        policy: cache policy name (a key of `scissorhands.POLICIES`).
        compression_ratio: the ratio; None gives label ``"1"`` for ``full`` and ``""`` for an
            absolute budget.
        replica: replica id (low cardinality: one per actor, not per request).
        model: model id.
        run_id: the sweep run this replica serves.
        engine: the backend whose figures these are (``ours`` or ``openvino``, `replica.common.types.ENGINES`).
        use_ray: True forces Ray metrics, False forces the in-memory recorder; None (default)
            uses Ray when `ray.is_initialized()` (always true inside an actor) and the
            in-memory recorder otherwise.

    A replica that runs points of several policies calls `for_point(policy, ratio)` per point;
    the children share the replica's labels and recorder. Every method takes base units
    (seconds, bytes, tokens). A zero increment is ignored; a negative or NaN value raises
    ValueError naming the argument.
    """

    def __init__(
        self,
        policy: str,
        compression_ratio: float | None,
        replica: str,
        model: str,
        run_id: str,
        use_ray: bool | None = None,
        engine: str = OURS_ENGINE,
    ):
        self.tags = {
            "policy": str(policy),
            "compression_ratio": ratio_label(str(policy), compression_ratio),
            "replica": str(replica),
            "model": str(model),
            "run_id": str(run_id),
            "engine": str(engine),
        }
        self.uses_ray = _ray_is_initialized() if use_ray is None else bool(use_ray)
        self._recorder = _RayRecorder() if self.uses_ray else _LocalRecorder()

    def for_point(self, policy: str, compression_ratio: float | None, run_id: str | None = None) -> "ReplicaMetrics":
        """A recorder with this replica's labels but the point's policy, ratio (and run id, if given)."""
        child = object.__new__(type(self))
        child.tags = {
            **self.tags,
            "policy": str(policy),
            "compression_ratio": ratio_label(str(policy), compression_ratio),
        }
        if run_id is not None:
            child.tags["run_id"] = str(run_id)
        child.uses_ray = self.uses_ray
        child._recorder = self._recorder
        return child

    def _record(self, short: str, value: float, phase: str | None = None) -> None:
        """Record `value` into metric `short`; a histogram's exact-sum counter gets the value too."""
        spec = _REPLICA_SPECS[PREFIX + short]
        tags = self.tags
        if PHASE_LABEL in spec.labels:
            if phase not in PHASES:
                raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {phase!r}")
            tags = {**tags, PHASE_LABEL: phase}
        self._recorder.record(spec, float(value), tags)
        if spec.kind == "histogram" and value > 0:  # Ray's counters take increments > 0 only
            self._recorder.record(_REPLICA_SPECS[spec.exact_sum.name], float(value), tags)

    @staticmethod
    def _check(field: str, value: float) -> float:
        value = float(value)
        if value < 0 or math.isnan(value):
            raise ValueError(f"{field} must be a number >= 0, got {value!r}")
        return value

    def observe_prefill(self, seconds: float, tokens: int, warmup_tokens: int = 0) -> None:
        """One prefill forward: its wall time (s) and the prompt tokens it processed (all sequences):
        `tokens` of measured requests, `warmup_tokens` of warm-up requests (phase ``warmup``)."""
        self._record("prefill_seconds", self._check("seconds", seconds))
        if self._check("tokens", tokens) > 0:
            self._record("prefill_tokens_total", tokens, "measured")
        if self._check("warmup_tokens", warmup_tokens) > 0:
            self._record("prefill_tokens_total", warmup_tokens, "warmup")

    def observe_decode_step(self, seconds: float, batch_size: int) -> None:
        """One decode-step forward: its wall time (s) and the sequences in it."""
        self._record("decode_step_seconds", self._check("seconds", seconds))
        self._record("decode_batch_size", self._check("batch_size", batch_size))

    def observe_ttft(self, seconds: float, phase: str = "measured") -> None:
        """Time to first token of one request (s); `phase` ``warmup`` for a warm-up request."""
        self._record("ttft_seconds", self._check("seconds", seconds), phase)

    def observe_tpot(self, seconds: float, phase: str = "measured") -> None:
        """Time per output token of one request (s): (e2e - ttft) / (output tokens - 1)."""
        self._record("tpot_seconds", self._check("seconds", seconds), phase)

    def set_running(self, n: int) -> None:
        """Sequences in the batch running now."""
        self._record("running_sequences", self._check("n", n))

    def set_queued(self, n: int) -> None:
        """Sequences waiting in the queue now."""
        self._record("queued_sequences", self._check("n", n))

    def add_generated_tokens(self, n: int, phase: str = "measured") -> None:
        """Add `n` output tokens (count generated ids, never re-tokenized text) of `phase`'s requests."""
        if self._check("n", n) > 0:
            self._record("generated_tokens_total", n, phase)

    def set_kv_cache(self, bytes: int, slots: int) -> None:  # the field's term (shadows the builtin on purpose)
        """KV cache size now: `bytes` of every cache tensor (bookkeeping included), `slots` in use."""
        self._record("kv_cache_bytes", self._check("bytes", bytes))
        self._record("kv_cache_slots", self._check("slots", slots))

    def add_evictions(self, n: int) -> None:
        """Add `n` token positions evicted by the policy, summed over the batch's sequences.

        Counted per KV head (at a fixed budget every head evicts the same number): for a static
        batch, ``batch * max(0, tokens seen - budget_tokens)`` by the end of the point.
        """
        if self._check("n", n) > 0:
            self._record("evicted_tokens_total", n)

    def observe_model_load(self, seconds: float) -> None:
        """Wall time of the model load (s); a gauge holding the last load."""
        self._record("model_load_seconds", self._check("seconds", seconds))

    def set_kv_blocks(self, used: int, free: int) -> None:
        """Paged KV layout: blocks of the pool held by sequences now (`used`, all layers) and free (`free`).

        Never called on the preallocated layout (no pool, so no block series); see `clear_kv_blocks`."""
        self._record("kv_used_blocks", self._check("used", used))
        self._record("kv_free_blocks", self._check("free", free))

    def clear_kv_blocks(self) -> None:
        """Stop reporting this recorder's block gauges (an engine without a block pool took over its labels):
        in memory they are dropped; under Ray they are no longer re-recorded, so the exporter drops them after
        about two export intervals, instead of repeating the last pool's blocks."""
        for short in ("kv_used_blocks", "kv_free_blocks"):
            self._recorder.forget(_REPLICA_SPECS[PREFIX + short], self.tags)

    def add_preemption(self, recomputed_tokens: int) -> None:
        """One sequence preempted (paged KV layout), whose next prefill recomputes `recomputed_tokens` tokens
        (its prompt and the outputs fed so far)."""
        recomputed_tokens = self._check("recomputed_tokens", recomputed_tokens)  # before anything is recorded
        self._record("preemptions_total", 1)
        if recomputed_tokens > 0:
            self._record("recomputed_tokens_total", recomputed_tokens)

    def add_prefix_cache_tokens(self, hit: int, miss: int, phase: str = "measured") -> None:
        """Prefix cache (our engine, `enable_prefix_caching`): one admission's prompt tokens its prefill takes from
        the cache (`hit`) and computes (`miss`), of `phase`'s requests. A zero count is not recorded, so a replica
        that never hit has no hit series yet (a Ray counter is exported from its first increment)."""
        hit, miss = self._check("hit", hit), self._check("miss", miss)  # both checked before anything is recorded
        if hit > 0:
            self._record("prefix_cache_hit_tokens_total", hit, phase)
        if miss > 0:
            self._record("prefix_cache_miss_tokens_total", miss, phase)

    def set_prefix_cache(self, blocks: int, reclaimed_blocks: int) -> None:
        """Prefix cache: pool blocks holding cached entries now (`blocks`, all layers) and blocks of idle entries
        reclaimed for other rows since the last call (`reclaimed_blocks`, an increment)."""
        blocks, reclaimed_blocks = self._check("blocks", blocks), self._check("reclaimed_blocks", reclaimed_blocks)
        self._record("kv_prefix_cache_blocks", blocks)
        if reclaimed_blocks > 0:
            self._record("prefix_cache_reclaimed_blocks_total", reclaimed_blocks)

    def clear_prefix_cache(self) -> None:
        """Stop reporting this recorder's prefix cache block gauge (an engine without a prefix cache took over its
        labels), as `clear_kv_blocks` does for the pool's gauges."""
        self._recorder.forget(_REPLICA_SPECS[PREFIX + "kv_prefix_cache_blocks"], self.tags)

    def snapshot(self, phase: str = "measured") -> dict[str, object]:
        """In-memory values of this recorder's labels, by project metric name ({} under Ray);
        request-level metrics of `phase` (``measured`` or ``warmup``).

        Counters give their sum, gauges their last value, histograms ``(count, sum)``.
        """
        if self.uses_ray:
            return {}
        out = {}
        tags = {**self.tags, PHASE_LABEL: phase}
        for name, series in self._recorder.values.items():
            key = tuple(tags[k] for k in _REPLICA_SPECS[name].labels)
            if key in series:
                out[name] = series[key]
        return out


def strip_sample_suffix(name: str) -> str:
    """Drop one ``_bucket``/``_sum``/``_count``/``_total`` suffix (how Prometheus names a metric's samples)."""
    for suffix in ("_bucket", "_sum", "_count", "_total"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


if __name__ == "__main__":
    print(catalogue_markdown())
