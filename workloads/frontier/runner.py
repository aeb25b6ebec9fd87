"""Run a frontier suite: ``python -m workloads.frontier.runner SUITE [options]`` (``make frontier``).

Each point (one policy at one compression ratio) runs on one of N model replicas as
``ModelReplica.apply(run_frontier_point, point)``, through the quality runner's executor
(`workloads.core.run.run_on_replicas`: the replica set and dispatch loop of every suite kind), and measures both
numbers of the picture on that replica: output tok/s at the policy's own max batch under the run's one KV
memory limit, and perplexity of held-out text (`workloads.frontier.point`). Every finished point is one
record (`workloads.core.results.build_record`, ``kind: frontier``) appended to
``<results-dir>/<run_id>/points.jsonl`` and pushed to the Pushgateway like a sweep point; ``--resume RUN_ID``
skips the points already ``ok``. At the end ``frontier.png`` and ``table.md`` (the Pareto frontier marked,
`workloads.frontier.report`) are written next to the points. ``--local`` runs the points in this process.

Exit status: 0 all points ok; 1 a point failed or no replica could start; 2 invalid suite or arguments
(nothing recorded); 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workloads.core import results as res
from workloads.core.run import (cli_main, load_suite_of_kind, open_run, pending_points, record_run_dtypes, replica_count,
                           run_on_replicas, runner_args)

from .point import run_frontier_point
from .suite import FrontierPoint, FrontierSuite


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return runner_args(argv, "python -m workloads.frontier.runner", __doc__,
                       "frontier suite YAML, e.g. workloads/suites/frontier.yaml", local=True)


def _record(run_id, commit, suite: FrontierSuite, point: FrontierPoint, inventory, info, status, metrics=None,
            error=None, t0=None, t1=None) -> dict:
    from workloads.quality.runner import policy_label

    rec = res.build_record(kind="frontier", run_id=run_id, commit=commit, suite=suite, point=point, status=status,
                           error=error, replica=info, inventory=inventory, started_at_unix_s=t0, finished_at_unix_s=t1,
                           metrics=metrics)
    rec.update(policy_label=policy_label(point.policy, point.policy_params), prompt_tokens=point.prompt_tokens,
               new_tokens=point.new_tokens)
    return rec


def _one_line(rec: dict) -> str:
    what = f"{rec['point_id']} on {rec.get('replica_id')}"
    if rec["status"] != "ok":
        return f"  error  {what}: {rec['error']}"
    return (f"  ok     {what}: max batch {rec['batch_size']}, {rec['output_throughput_tok_per_s']:.1f} output tok/s, "
            f"perplexity {rec['perplexity']:.3f}" + (f", B {rec['budget_tokens']} tok" if rec.get("budget_tokens") else ""))


def run(args: argparse.Namespace) -> int:
    suite = load_suite_of_kind(args.suite, "frontier")
    replicas = replica_count(args, suite)
    run = open_run(args, suite, "frontier")
    points = suite.points()
    pending = pending_points(run.points_path, points)
    where = "this process" if args.local else f"{replicas} replica(s)"
    print(f"frontier: run {run.run_id}: {len(points)} points, {len(points) - len(pending)} already done, "
          f"{len(pending)} to run on {where}; results in {run.run_dir}/", file=sys.stderr)
    if pending:
        from workloads.core.push import PointPublisher, SweepPusher

        publish = PointPublisher(run.points_path, SweepPusher(args.pushgateway, run.run_id),
                                 done=len(points) - len(pending), planned=len(points))
        run_on_replicas(args, suite, run.run_id, pending, replicas, run_frontier_point,
                        lambda point, inventory, info, *rest: _record(run.run_id, run.commit, suite, point, inventory,
                                                                      info, *rest),
                        publish, _one_line, name="frontier")

    from .report import write_report

    ids = {p.point_id for p in points}
    mine = [r for r in res.read_records(run.points_path) if r["point_id"] in ids]
    record_run_dtypes(run.run_dir, mine)
    written = write_report(run.run_dir, mine)
    print(Path(written["table"]).read_text(encoding="utf-8"), end="")
    print("frontier: wrote " + ", ".join(written.values()), file=sys.stderr)
    latest = res.latest_by_point(mine)
    bad = sum(1 for r in latest.values() if r["status"] != "ok")
    missing = len(points) - len(latest)
    if bad or missing:
        print(f"frontier: {bad} point(s) failed, {missing} not run", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return cli_main("frontier", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
