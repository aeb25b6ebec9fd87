"""Run a batch suite: static batches on model replicas, one record per point (``kind: batch``).

    python -m workloads.sweep SUITE.yaml [--replicas N] [--results-dir results] [--run-id ID]
                              [--resume RUN_ID] [--address ADDR] [--local] [--pushgateway HOST:PORT|off]

* The suite (`workloads.batch.suite`) expands into points (policy x budget x batch x prompt x new).
* Ray: joins `--address` (or `$RAY_ADDRESS`, as inside `ray job submit`) when given, otherwise
  starts an embedded local Ray on loopback. `N` replicas (default: the suite's `replicas`, 2)
  each load the model once; each gets `max(1, cluster CPUs // N)` torch threads and reserves as
  many Ray CPUs, so replicas on one machine don't fight over cores. Idle replicas take the next
  point in suite order, so points run in parallel (`workloads.core.dispatch`). ``--local``: one
  replica in this process, no Ray.
* Every finished point is appended as one JSON line to `<results-dir>/<run_id>/points.jsonl`
  (status `ok`, or `error` with the message; the sweep goes on after an error). `--resume RUN_ID`
  skips the points already `ok` in that file. At the end the table is printed and written to
  `table.md` and `points.csv` next to it (`workloads.batch.report`).
* Monitoring: after it is written, each point's summary and the run's progress are pushed to the
  Pushgateway (`workloads.core.push`). The replicas record live metrics through `ray.util.metrics`
  (`replica.metrics.ReplicaMetrics`, labelled with the run id); when a Pushgateway took the pushes, the
  replicas stay up one Ray export interval and one Prometheus scrape after the last point, so that
  their last values are scraped.

Exit status: 0 all points ok; 1 a point failed or no replica could start (e.g. a missing model
path); 2 the suite or the arguments are invalid (nothing is recorded); 130 interrupted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

from replica.metrics import RECORD_QUANTILES
from workloads.batch.report import write_report
from workloads.batch.suite import BatchPoint, BatchSuite
from workloads.core.dispatch import replica_points
from workloads.core.results import MIB
from workloads.core.template import Finished, Kind, Report, Session, kind_main
from workloads.load.prompts import make_prompts

#: A static batch's sequences share one TTFT, TPOT and latency, so each quantile of the point is it (every quantile
#: the catalogue pushes: p50, p90, p95, p99).
STATIC_BATCH_QUANTILES = tuple(RECORD_QUANTILES)
#: Seconds between Prometheus scrapes (dashboards/prometheus.yml).
PROMETHEUS_SCRAPE_INTERVAL_S = 5.0


def final_scrape_wait_s(pusher) -> float:
    """Seconds to keep the replicas (and an embedded Ray) up after the last point, so that Ray
    exports the live metrics' last values and Prometheus scrapes them: Ray's export interval
    (``$RAY_metrics_report_interval_ms``, else Ray's default 10 s) plus one scrape interval.
    0 when no Pushgateway took a push (no monitoring stack is up)."""
    if not getattr(pusher, "pushes", 0):
        return 0.0
    return float(os.environ.get("RAY_metrics_report_interval_ms", 10_000)) / 1000 + PROMETHEUS_SCRAPE_INTERVAL_S


class BatchKind(Kind):
    """Static batches (`replica.static_batch.ModelReplica.run_batch`) on the run's replicas."""

    name = "batch"
    suite_model = BatchSuite

    def execute(self, session: Session, pending: list[BatchPoint]) -> Iterator[Finished]:
        return replica_points(
            session,
            pending,
            remote=lambda handle, point: handle.run_batch.remote(point.spec()),
            local=lambda replica, point: replica.run_batch(point.spec()),
            replica_kwargs=dict(prompt_fn=make_prompts),
            linger_s=lambda: final_scrape_wait_s(session.pusher),
        )

    def record_fields(self, suite: BatchSuite, point: BatchPoint, finished: Finished) -> dict:
        metrics = finished.metrics or {}
        quantiles = {
            f"{name}_{q}_s": metrics[f"{name}_s"]
            for name in ("ttft", "tpot", "e2e_latency")
            if metrics.get(f"{name}_s") is not None
            for q in STATIC_BATCH_QUANTILES
        }
        return dict(
            quantiles,
            batch_size=point.batch_size,
            prompt_tokens=point.prompt_tokens,
            new_tokens=point.new_tokens,
            budget_tokens=metrics.get("budget_tokens"),
        )

    def ok_line(self, rec: dict) -> str:
        kv = rec.get("kv_cache_bytes") or 0
        return (
            f"prefill {rec['prefill_s']:.2f} s, decode {rec.get('decode_tokens_per_s') or 0:.1f} "
            f"tok/s, KV {kv / MIB:.1f} MiB, budget {rec.get('budget_tokens') or '-'} tok"
        )

    def report(self, run_dir: Path, suite: BatchSuite, records: list[dict]) -> Report:
        return write_report(run_dir, records)


KIND = BatchKind()


def main(argv: list[str] | None = None) -> int:
    return kind_main(KIND, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
