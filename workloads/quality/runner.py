"""Run a quality suite on Ray replicas: ``python -m workloads.quality.runner SUITE [options]``.

Each point (a perplexity, few-shot, persistence or passkey evaluation) runs on one of N model
replicas (``ModelReplica.apply(run_point, point)``) in the throughput sweep's replica lifecycle and dispatch
loop (``workloads.core.run.start_replicas``, ``dispatch_points``: a Ray Serve deployment with the suite's
``placement:``, Serve's restarts, GPU sharding, the node-left watch): replicas load the model once, idle replicas take the next point, and every
finished point is appended as one JSON line (a single ``O_APPEND`` write, fsync'ed) to
``<results-dir>/<run_id>/points.jsonl`` with the schema version, git commit, model id, policy and
its resolved parameters, seed and the Ray node inventory, and its perplexity / accuracy is
pushed to the Pushgateway like a sweep point (``scissorhands_sweep_perplexity``,
``scissorhands_sweep_accuracy_ratio``). ``--resume RUN_ID`` skips the points already ``ok``. At the end the report (``table.md`` and PNG plots) is written next to the points.
``--local`` runs the points in this process without Ray (debugging, tests).

Exit status: 0 all points ok; 1 a point failed or no replica could start; 2 invalid suite or
arguments (nothing recorded); 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workloads.core import results as res
from workloads.core.run import (cli_main, load_suite_of_kind, open_run, pending_points, record_run_dtypes, replica_count,
                           run_on_replicas, runner_args)

from .points import run_point
from .suite import QualityPoint, QualitySuite


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return runner_args(argv, "python -m workloads.quality.runner", __doc__,
                       "quality suite YAML, e.g. workloads/suites/quality.yaml", local=True)


def policy_label(policy: str | None, params: dict | None) -> str | None:
    """``name`` or ``name (key=value, ...)`` with the suite's explicit parameters (tables and plots use it)."""
    if policy is None or not params:
        return policy
    return f"{policy} (" + ", ".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"


def _record(run_id, commit, suite: QualitySuite, point: QualityPoint, inventory, info, status, metrics=None,
            error=None, t0=None, t1=None) -> dict:
    ratio, bits = point.compression_ratio, point.kv_bits
    rec = res.build_record(kind="quality", run_id=run_id, commit=commit, suite=suite, point=point, status=status,
                           error=error, replica=info, inventory=inventory, started_at_unix_s=t0, finished_at_unix_s=t1,
                           metrics=metrics)
    rec.update(evaluation=point.kind, policy_label=policy_label(point.policy, point.policy_params), kv_bits=bits,
               # nominal KV compression against a 16-bit cache (the paper's convention; scales/zero points not counted)
               compression_vs_16bit_x=None if ratio is None else ratio * (16 / bits if bits else 1),
               task=point.task, settings=point.settings)
    return rec


def _one_line(rec: dict) -> str:
    what = f"{rec['point_id']} on {rec.get('replica_id')}"
    if rec["status"] != "ok":
        return f"  error  {what}: {rec['error']}"
    if rec["evaluation"] == "perplexity":
        return f"  ok     {what}: perplexity {rec['perplexity']:.3f}, budget {rec.get('budget_tokens')} tok"
    if rec["evaluation"] == "fewshot":
        acc = rec.get("accuracy")
        return f"  ok     {what}: accuracy {acc if acc is None else round(acc, 3)} over {rec['docs_scored']} docs"
    if rec["evaluation"] == "passkey":
        return (f"  ok     {what}: passkey accuracy {rec['accuracy']:.2f} ({rec['correct']}/"
                f"{rec['trials'] * len(rec['depths'])}) at {rec['length_tokens']} tokens")
    return f"  ok     {what}: mean persistence ratio {rec.get('persistence_ratio_mean')}"


def run(args: argparse.Namespace) -> int:
    suite = load_suite_of_kind(args.suite, "quality")
    replicas = replica_count(args, suite)
    run = open_run(args, suite, "quality")
    run_id, run_dir, points_path, commit = run.run_id, run.run_dir, run.points_path, run.commit
    points = suite.points()
    pending = pending_points(points_path, points)
    where = "this process" if args.local else f"{replicas} replica(s)"
    print(f"quality: run {run_id}: {len(points)} points, {len(points) - len(pending)} already done, "
          f"{len(pending)} to run on {where}; results in {run_dir}/", file=sys.stderr)
    if suite.fewshot is not None:  # what the document counts can resolve, before hours are spent on them
        from .fewshot import precision_line

        for task in suite.fewshot.tasks:
            print(f"quality: {precision_line(task, suite.fewshot.docs_of(task))}", file=sys.stderr)
    failed = 0
    if pending:
        from workloads.core.push import PointPublisher, SweepPusher

        # appends the point's line, then pushes its summary (perplexity / accuracy gauges) and the progress
        record = PointPublisher(points_path, SweepPusher(args.pushgateway, run_id),
                                done=len(points) - len(pending), planned=len(points))
        failed = run_on_replicas(
            args, suite, run_id, pending, replicas, run_point,
            lambda point, inventory, info, *rest: _record(run_id, commit, suite, point, inventory, info, *rest),
            record, _one_line, name="quality")

    from .report import write_report

    ids = {p.point_id for p in points}
    record_run_dtypes(run_dir, (r for r in res.read_records(points_path) if r["point_id"] in ids))
    written = write_report(run_dir, [r for r in res.read_records(points_path) if r["point_id"] in ids])
    print(Path(written["table"]).read_text(encoding="utf-8"), end="")
    print("quality: wrote " + ", ".join(str(v) for v in written.values()), file=sys.stderr)
    latest = res.latest_by_point(r for r in res.read_records(points_path) if r["point_id"] in ids)
    bad = sum(1 for r in latest.values() if r["status"] != "ok")
    missing = len(points) - len(latest)
    if bad or missing:
        print(f"quality: {bad} point(s) failed, {missing} not run", file=sys.stderr)
        return 1
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return cli_main("quality", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
