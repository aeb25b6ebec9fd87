"""Push per-point sweep summaries to a Prometheus Pushgateway, grouped by run.

Usage (what `workloads.sweep` and `workloads.quality.runner` do, through `PointPublisher`)::

    from workloads.push import PointPublisher, SweepPusher
    pusher = SweepPusher(None, run_id="20260101-120000-smoke")  # URL from SCISSORHANDS_PUSHGATEWAY
    publish = PointPublisher(points_path, pusher, done=0, planned=len(points))  # pushes 0 / planned
    for point in points:
        publish(run_point(point))          # appends the record to points.jsonl, then pushes it and i / planned

Every metric is a gauge named in `cluster.metrics.METRICS` (``source="pushgateway"``), kept in
the pusher's own `CollectorRegistry`; each push sends the whole registry with
``job="scissorhands_sweep"`` and grouping key ``{"run_id": run_id}`` (HTTP PUT), so the group
always holds every point of the run pushed so far. Prometheus scrapes the Pushgateway with
``honor_labels: true`` so ``job`` and ``run_id`` survive.

When the Pushgateway cannot be reached (or answers with an error) the pusher logs one warning
line and turns into a no-op for the rest of the run: pushing never fails a sweep.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Gauge, push_to_gateway

from cluster.metrics import METRICS, POINT_LABELS, label_value, ratio_label
from workloads.results import append_record

log = logging.getLogger(__name__)

#: Env var holding the Pushgateway address (``host:port`` or a URL); ``off`` disables pushing.
PUSHGATEWAY_ENV = "SCISSORHANDS_PUSHGATEWAY"
DEFAULT_PUSHGATEWAY = "127.0.0.1:9091"
JOB = "scissorhands_sweep"
#: Quantile labels pushed for the latency summaries (as Prometheus summaries spell them).
QUANTILES = {"p50": "0.5", "p90": "0.9", "p99": "0.99"}
_DISABLED_WORDS = {"", "off", "none", "no", "0", "false", "disabled"}
#: Keys under which a record may nest its point config or its results (searched one level down).
_NESTED_KEYS = ("point", "config", "params", "result", "results", "metrics", "summary", "stats")


def resolve_pushgateway_url(url: str | None) -> str | None:
    """The Pushgateway address to use: `url`, else env `SCISSORHANDS_PUSHGATEWAY`, else 127.0.0.1:9091.

    Returns None when the value is one of ``off``/``none``/``0``/``false``/empty (pushing disabled).
    """
    if url is None:
        url = os.environ.get(PUSHGATEWAY_ENV, DEFAULT_PUSHGATEWAY)
    return None if url.strip().lower() in _DISABLED_WORDS else url.strip()


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


class _Record:
    """Key lookup over a record and the dicts nested under `_NESTED_KEYS` (top level first)."""

    def __init__(self, record: Mapping[str, Any]):
        self.layers = [record] + [record[k] for k in _NESTED_KEYS if isinstance(record.get(k), Mapping)]

    def get(self, *keys: str) -> Any:
        for layer in self.layers:
            for key in keys:
                if key in layer and layer[key] is not None:
                    return layer[key]
        return None


class SweepPusher:
    """Pushes one series per sweep point, plus the run's progress, to a Pushgateway.

    Args:
        url: ``host:port`` or ``http://host:port`` of the Pushgateway; None reads env
            `SCISSORHANDS_PUSHGATEWAY` (default ``127.0.0.1:9091``); ``"off"`` disables pushing.
        run_id: the run's id; the grouping key, so each run is its own group.
        timeout_s: HTTP timeout of one push, in seconds.

    `enabled` is False once pushing is disabled or has failed (after one logged notice).
    """

    def __init__(self, url: str | None, run_id: str, timeout_s: float = 2.0):
        if not run_id or not isinstance(run_id, str):
            raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
        self.url = resolve_pushgateway_url(url)
        self.run_id = run_id
        self.timeout_s = float(timeout_s)
        self.enabled = self.url is not None
        self.pushes = 0
        self.registry = CollectorRegistry()
        self._gauges: dict[str, Gauge] = {}
        for spec in METRICS:
            if spec.source == "pushgateway":
                self._gauges[spec.name] = Gauge(spec.name, spec.help, list(spec.labels), registry=self.registry)
        self._max_batch: dict[tuple[str, str, str], int] = {}

    def _g(self, short: str) -> Gauge:
        return self._gauges["scissorhands_sweep_" + short]

    # ------------------------------------------------------------------ points
    def point_labels(self, record: Mapping[str, Any]) -> dict[str, str]:
        """The label values of a record's series: policy, compression_ratio, batch_size, ... ("" when absent)."""
        r = _Record(record)
        policy = str(r.get("policy") or "")
        ratio = ratio_label(policy, r.get("compression_ratio"))
        if any("budget_tokens_requested" in layer for layer in r.layers):
            budget = r.get("budget_tokens_requested")  # a results record: `budget_tokens` is the one used
        else:
            budget = r.get("budget_tokens") if ratio == "" else None
        labels = {
            "policy": policy,
            "compression_ratio": ratio,
            "budget_tokens": label_value(budget),
            "batch_size": label_value(r.get("batch_size")),
            "prompt_tokens": label_value(r.get("prompt_tokens")),
            "new_tokens": label_value(r.get("new_tokens")),
            "concurrency": label_value(r.get("concurrency")),
            "request_rate": label_value(r.get("request_rate", "target_rate_req_per_s", "rate_req_per_s")),
            "kv_bits": label_value(r.get("kv_bits")),
            "task": label_value(r.get("task")),
            "model": label_value(r.get("model", "model_id")),
        }
        assert tuple(labels) == POINT_LABELS
        return labels

    def _set_point_values(self, record: Mapping[str, Any], labels: dict[str, str]) -> bool:
        """Set every gauge the record has a value for; returns whether the point succeeded."""
        r = _Record(record)
        simple = {
            "output_throughput_tokens_per_second": ("output_throughput_tok_per_s",),
            "total_throughput_tokens_per_second": ("total_throughput_tok_per_s",),
            "kv_cache_bytes": ("kv_cache_bytes", "peak_kv_cache_bytes"),
            "perplexity": ("perplexity",),
            "accuracy_ratio": ("accuracy_ratio", "accuracy"),
        }
        for short, keys in simple.items():
            value = _finite(r.get(*keys))
            if value is not None:
                self._g(short).labels(**labels).set(value)
        for short, field in (("ttft_seconds", "ttft"), ("tpot_seconds", "tpot"), ("e2e_latency_seconds", "e2e_latency")):
            for quantile, value in self._quantiles(r, field).items():
                self._g(short).labels(**labels, quantile=quantile).set(value)

        error = r.get("error")
        status = str(r.get("status") or "ok").lower()
        failed = _finite(r.get("failed_requests", "failed", "n_failed")) or 0
        completed = _finite(r.get("completed_requests", "completed", "n_completed"))
        return not error and status in ("ok", "success", "succeeded", "done") and not (failed and completed == 0)

    @staticmethod
    def _quantiles(r: _Record, field: str) -> dict[str, float]:
        """Quantile label -> seconds for `field` (``ttft``, ``tpot``, ``e2e_latency``).

        Accepts ``{field}_s`` as a dict ``{"p50": .., "p99": ..}`` or as one number (a static
        batch, where every sequence has the same value, so every quantile equals it), and flat
        ``{field}_p50_s`` / ``{field}_s_p50`` / ``p50_{field}_s`` keys.
        """
        out: dict[str, float] = {}
        value = r.get(f"{field}_s")
        if isinstance(value, Mapping):
            for p, q in QUANTILES.items():
                v = _finite(value.get(p))
                if v is not None:
                    out[q] = v
        elif _finite(value) is not None:
            out = {q: _finite(value) for q in QUANTILES.values()}
        for p, q in QUANTILES.items():
            v = _finite(r.get(f"{field}_{p}_s", f"{field}_s_{p}", f"{p}_{field}_s"))
            if v is not None:
                out[q] = v
        return out

    def push_point(self, record: Mapping[str, Any]) -> bool:
        """Add one finished point (a results record) to the run's group and push it.

        Label values come from the record's `policy`, `compression_ratio` (``"1"`` for `full`
        without one), `budget_tokens_requested`, `batch_size`, `prompt_tokens`, `new_tokens`,
        `concurrency`, `request_rate`, `kv_bits`, `task`, `model`/`model_id`; values from
        `output_throughput_tok_per_s`, `total_throughput_tok_per_s`, `ttft_s`/`tpot_s`/
        `e2e_latency_s` (number or percentile dict), `kv_cache_bytes`, `perplexity`,
        `accuracy`. Missing values are skipped. A point without
        error also updates `scissorhands_sweep_max_batch_size` and the last-success time.
        Returns True when the push reached the Pushgateway.
        """
        labels = self.point_labels(record)
        ok = self._set_point_values(record, labels)
        if ok:
            batch = _finite(_Record(record).get("batch_size"))
            if batch is not None:
                key = (labels["policy"], labels["compression_ratio"], labels["kv_bits"], labels["model"])
                self._max_batch[key] = max(self._max_batch.get(key, 0), int(batch))
                policy, ratio, bits, model = key
                self._g("max_batch_size").labels(policy=policy, compression_ratio=ratio, kv_bits=bits, model=model).set(
                    self._max_batch[key]
                )
            self._g("last_success_timestamp_seconds").set(time.time())
        return self.push()

    def push_progress(self, done: int, total: int) -> bool:
        """Set the run's progress (points finished, points planned) and push. True when pushed."""
        if done < 0 or total < 0 or done > total:
            raise ValueError(f"progress needs 0 <= done <= total, got done={done}, total={total}")
        self._g("points_completed").set(done)
        self._g("points_planned").set(total)
        return self.push()

    def push(self) -> bool:
        """Push the whole registry (PUT) to the run's group. False (never raises) when disabled or failing."""
        if not self.enabled:
            return False
        try:
            push_to_gateway(
                self.url,
                job=JOB,
                registry=self.registry,
                grouping_key={"run_id": self.run_id},
                timeout=self.timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - a monitoring failure must never fail the sweep
            self.enabled = False
            reason = " ".join(str(getattr(exc, "reason", exc)).split()) or type(exc).__name__
            log.warning(
                "Pushgateway %s not usable (%s); sweep summaries of run %s will not be pushed "
                "(start one with `make dashboards-up`, or set %s=off to silence this).",
                self.url,
                reason,
                self.run_id,
                PUSHGATEWAY_ENV,
            )
            return False
        self.pushes += 1
        return True


class PointPublisher:
    """Records each finished point of a run: appends it to the points file, then pushes it.

    Args:
        points_path: the run's ``points.jsonl``; each record is appended whole
            (`workloads.results.append_record`) before anything is pushed, so a Pushgateway
            problem never costs a point.
        pusher: the run's `SweepPusher` (a disabled or failing one makes pushing a no-op).
        done: points of the run already finished (a resumed run), planned: points in all.

    Construction pushes the progress ``done / planned``, so the run shows up before its first
    point ends; every call pushes the point's summary and the progress one point further.
    """

    def __init__(self, points_path: str, pusher: SweepPusher, done: int, planned: int):
        self.points_path = str(points_path)
        self.pusher = pusher
        self.planned = int(planned)
        self.done = min(int(done), self.planned)
        pusher.push_progress(self.done, self.planned)

    def __call__(self, record: Mapping[str, Any]) -> None:
        append_record(self.points_path, dict(record))
        self.pusher.push_point(record)
        self.done = min(self.done + 1, self.planned)
        self.pusher.push_progress(self.done, self.planned)
