"""Run a quality suite on model replicas: ``python -m workloads.quality.runner SUITE [options]`` (``make quality``).

Each point (a perplexity, few-shot, persistence or passkey evaluation, `workloads.quality.points`) runs on one of N
model replicas (``ModelReplica.apply(run_point, point)``) through the run template every kind shares
(`workloads.core.template`, `workloads.core.dispatch`: a Ray Serve deployment with the suite's ``placement:``,
Serve's restarts, GPU sharding, the node-left watch): replicas load the model once, idle replicas take the next
point, and every finished point is appended as one JSON line to ``<results-dir>/<run_id>/points.jsonl`` and its
perplexity / accuracy pushed to the Pushgateway (``scissorhands_sweep_perplexity``,
``scissorhands_sweep_accuracy_ratio``). ``--resume RUN_ID`` skips the points already ``ok``. At the end the
report (``table.md`` and PNG plots, `workloads.quality.report`) is written next to the points. ``--local`` runs
the points in this process without Ray (debugging, tests).

Exit status: 0 all points ok; 1 a point failed or no replica could start; 2 invalid suite or
arguments (nothing recorded); 130 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

from workloads.core.dispatch import replica_points
from workloads.core.template import Finished, Kind, Report, Session, kind_main
from workloads.quality.fewshot import precision_line
from workloads.quality.points import ok_line, run_point
from workloads.quality.report import write_report
from workloads.quality.suite import QualityPoint, QualitySuite


def policy_label(policy: str | None, params: dict | None) -> str | None:
    """``name`` or ``name (key=value, ...)`` with the suite's explicit parameters (tables and plots use it)."""
    if policy is None or not params:
        return policy
    return f"{policy} (" + ", ".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"


def apply_point(fn, kind: str):
    """`replica_points`' two ways to run ``fn(model, tokenizer, point)`` where the model is (quality, frontier), on
    replicas named after the `kind`."""
    return dict(
        remote=lambda handle, point: handle.apply.remote(fn, point),
        local=lambda replica, point: replica.apply(fn, point),
        replica_kwargs=dict(warmup=False),
        replica_name=kind,
    )


class QualityKind(Kind):
    """Quality evaluations of every policy and ratio on the run's replicas."""

    name = "quality"
    suite_model = QualitySuite

    def announce(self, suite: QualitySuite):
        if suite.fewshot is not None:  # what the document counts can resolve, before hours are spent on them
            return [precision_line(task, suite.fewshot.docs_of(task)) for task in suite.fewshot.tasks]
        return []

    def execute(self, session: Session, pending: list[QualityPoint]) -> Iterator[Finished]:
        return replica_points(session, pending, **apply_point(run_point, self.name))

    def record_fields(self, suite: QualitySuite, point: QualityPoint, finished: Finished) -> dict:
        ratio, bits = point.compression_ratio, point.kv_bits
        label = policy_label(point.policy, point.policy_params)
        return dict(
            evaluation=point.kind,
            engine=point.engine,
            # a backend's rows apart from ours (its `full` is not our full cache)
            policy_label=label if point.engine in (None, "ours") else f"{point.engine}:{label}",
            kv_bits=bits,
            # nominal KV compression against a 16-bit cache (the paper's convention; scales/zero points not counted)
            compression_vs_16bit_x=None if ratio is None else ratio * (16 / bits if bits else 1),
            task=point.task,
            settings=point.settings,
        )

    def ok_line(self, rec: dict) -> str:
        return ok_line(rec)

    def report(self, run_dir: Path, suite: QualitySuite, records: list[dict]) -> Report:
        return write_report(run_dir, records)


KIND = QualityKind()


def main(argv: list[str] | None = None) -> int:
    return kind_main(KIND, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
