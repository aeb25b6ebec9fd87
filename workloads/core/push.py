"""Push per-point sweep summaries to a Prometheus Pushgateway, one group per point.

Usage (what the run template, `workloads.core.template.run_suite`, does for every kind through
`PointPublisher`)::

    from workloads.core.push import PointPublisher, SweepPusher
    pusher = SweepPusher(None, run_id="20260101-120000-smoke")  # URL from SCISSORHANDS_PUSHGATEWAY
    publish = PointPublisher(points_path, pusher, done=0, planned=len(points))  # pushes 0 / planned
    for point in points:
        publish(run_point(point))          # appends the record to points.jsonl, then pushes it and i / planned

Every metric is a gauge named in `replica.metrics.METRICS` (``source="pushgateway"``). A point's
summaries are read from the record keys the catalogue names (`MetricSpec.record_key`) and pushed
(HTTP PUT) to their own group, ``job="scissorhands_sweep"``, ``{run_id, point_id}``: two points
never share a series, and a later push (a resumed run) never erases an earlier point's series.
The run's progress, largest completed batch and last success time go to the run's group
``{run_id}``. Prometheus scrapes the Pushgateway with ``honor_labels: true`` so ``job``,
``run_id`` and ``point_id`` survive.

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

from replica.common.metric_labels import POINT_LABELS, PREFIX
from replica.metrics import METRICS, RECORD_QUANTILES, label_value, ratio_label
from workloads.core.results import append_record, read_records
from workloads.core.run import check_resolved_dtype

log = logging.getLogger(__name__)

#: Env var holding the Pushgateway address (``host:port`` or a URL); ``off`` disables pushing.
PUSHGATEWAY_ENV = "SCISSORHANDS_PUSHGATEWAY"
DEFAULT_PUSHGATEWAY = "127.0.0.1:9091"
JOB = "scissorhands_sweep"
SWEEP_PREFIX = PREFIX + "sweep_"
_DISABLED_WORDS = {"", "off", "none", "no", "0", "false", "disabled"}


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


class SweepPusher:
    """Pushes one group per sweep point, plus the run's progress, to a Pushgateway.

    Args:
        url: ``host:port`` or ``http://host:port`` of the Pushgateway; None reads env
            `SCISSORHANDS_PUSHGATEWAY` (default ``127.0.0.1:9091``); ``"off"`` disables pushing.
        run_id: the run's id; part of every grouping key, so each run is its own set of groups.
        timeout_s: HTTP timeout of one push, in seconds.

    `enabled` is False once pushing is disabled or has failed (after one logged notice).
    `registry` holds the run's own gauges; `point_registries[point_id]` each point's summaries.
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
        self.point_registries: dict[str, CollectorRegistry] = {}
        run_metrics = [m for m in METRICS if m.source == "pushgateway" and not m.record_key]
        self._run = {
            m.name.removeprefix(SWEEP_PREFIX): Gauge(m.name, m.help, list(m.labels), registry=self.registry)
            for m in run_metrics
        }
        self._max_batch: dict[tuple[str, str, str, str], int] = {}

    # ------------------------------------------------------------------ points
    @staticmethod
    def point_labels(record: Mapping[str, Any]) -> dict[str, str]:
        """The label values of a record's series (`replica.common.metric_labels.POINT_LABELS`; "" when absent)."""
        labels = {k: label_value(record.get(k)) for k in POINT_LABELS}
        labels.update(
            policy=str(record["policy"]),
            compression_ratio=ratio_label(record["policy"], record.get("compression_ratio")),
            budget_tokens=label_value(record.get("budget_tokens_requested")),
            engine=str(record.get("engine") or "ours"),  # batch and quality points run on ours and do not say so
        )  # the budget asked for, not B used
        return labels

    def point_registry(self, record: Mapping[str, Any]) -> CollectorRegistry:
        """A registry holding the point's summaries: every catalogue metric whose record key the
        record has a finite value under."""
        registry, labels = CollectorRegistry(), self.point_labels(record)
        for spec in METRICS:
            if not spec.record_key:
                continue
            gauge = Gauge(spec.name, spec.help, list(spec.labels), registry=registry)
            if "quantile" in spec.labels:
                for key, quantile in RECORD_QUANTILES.items():
                    value = _finite(record.get(spec.record_key.format(q=key)))
                    if value is not None:
                        gauge.labels(**labels, quantile=quantile).set(value)
            elif (value := _finite(record.get(spec.record_key))) is not None:
                gauge.labels(**labels).set(value)
        return registry

    def remember(self, record: Mapping[str, Any]) -> None:
        """Count a finished point in the run's gauges (largest completed batch, last success time)
        without pushing it; a resumed run calls this for the points recorded before it."""
        if record.get("status") != "ok":
            return
        labels = self.point_labels(record)
        batch = _finite(record.get("batch_size"))
        if batch is not None:
            key = (labels["policy"], labels["compression_ratio"], labels["kv_bits"], labels["model"])
            self._max_batch[key] = max(self._max_batch.get(key, 0), int(batch))
            policy, ratio, bits, model = key
            self._run["max_batch_size"].labels(policy=policy, compression_ratio=ratio, kv_bits=bits, model=model).set(
                self._max_batch[key]
            )
        self._run["last_success_timestamp_seconds"].set(record.get("finished_at_unix_s") or time.time())

    def push_point(self, record: Mapping[str, Any]) -> bool:
        """Push one finished point (a results record) to its own group, then the run's gauges.

        Values come from the keys `replica.metrics.METRICS` names (missing or non-finite ones are
        skipped); an ``ok`` point also updates the largest completed batch and the last-success
        time. Returns True when the pushes reached the Pushgateway.
        """
        registry = self.point_registries[record["point_id"]] = self.point_registry(record)
        self.remember(record)
        return self._push(registry, {"run_id": self.run_id, "point_id": record["point_id"]}) and self.push()

    def push_progress(self, done: int, total: int) -> bool:
        """Set the run's progress (points finished, points planned) and push. True when pushed."""
        if done < 0 or total < 0 or done > total:
            raise ValueError(f"progress needs 0 <= done <= total, got done={done}, total={total}")
        self._run["points_completed"].set(done)
        self._run["points_planned"].set(total)
        return self.push()

    def push(self) -> bool:
        """Push the run's gauges (PUT) to the run's group. False (never raises) when disabled or failing."""
        return self._push(self.registry, {"run_id": self.run_id})

    def _push(self, registry: CollectorRegistry, grouping_key: dict[str, str]) -> bool:
        if not self.enabled:
            return False
        try:
            push_to_gateway(self.url, job=JOB, registry=registry, grouping_key=grouping_key, timeout=self.timeout_s)
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
            (`workloads.core.results.append_record`) before anything is pushed, so a Pushgateway
            problem never costs a point.
        pusher: the run's `SweepPusher` (a disabled or failing one makes pushing a no-op).
        done: points of the run already finished (a resumed run), planned: points in all.

    Construction counts the points already recorded (a resumed run) in the run's gauges and pushes
    the progress ``done / planned``, so the run shows up before its first point ends; every call
    pushes the point's summary and the progress one point further. The earlier points' own
    groups are left as they are.

    Raises (on a call): `workloads.core.run.SweepError` (exit 2, nothing written) when the record ran in
    another resolved dtype than the run's earlier records (`workloads.core.run.check_resolved_dtype`).
    """

    def __init__(self, points_path: str, pusher: SweepPusher, done: int, planned: int):
        self.points_path = str(points_path)
        self.pusher = pusher
        self.planned = int(planned)
        self.done = min(int(done), self.planned)
        self.earlier = read_records(self.points_path)  # the records of the run before this resume
        for record in self.earlier:
            pusher.remember(record)
        pusher.push_progress(self.done, self.planned)

    def __call__(self, record: Mapping[str, Any]) -> None:
        check_resolved_dtype(self.earlier, dict(record))
        append_record(self.points_path, dict(record))
        self.pusher.push_point(record)
        self.done = min(self.done + 1, self.planned)
        self.pusher.push_progress(self.done, self.planned)
