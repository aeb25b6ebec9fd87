"""Run a sweep suite on Ray replicas and record every point.

    python -m workloads.sweep SUITE.yaml [--replicas N] [--results-dir results] [--run-id ID]
                              [--resume RUN_ID] [--address ADDR] [--pushgateway HOST:PORT|off]

* The suite (see `workloads.core.suite`) expands into points (policy x budget x batch x prompt x new).
* Ray: joins `--address` (or `$RAY_ADDRESS`, as inside `ray job submit`) when given, otherwise
  starts an embedded local Ray on loopback. `N` replicas (default: the suite's `replicas`, 2)
  each load the model once; each gets `max(1, cluster CPUs // N)` torch threads and reserves as
  many Ray CPUs, so replicas on one machine don't fight over cores. Idle replicas take the next
  point in suite order, so points run in parallel.
* Every finished point is appended as one JSON line to `<results-dir>/<run_id>/points.jsonl`
  (status `ok`, or `error` with the message; the sweep goes on after an error). `--resume RUN_ID`
  skips the points already `ok` in that file. At the end the table is printed and written to
  `table.md` and `points.csv` next to it.
* Monitoring: after it is written, each point's summary and the run's progress are pushed to the
  Pushgateway (`workloads.core.push`; `--pushgateway`, else `$SCISSORHANDS_PUSHGATEWAY`, else
  127.0.0.1:9091; one notice line and no failure when none answers). The replicas record live
  metrics through `ray.util.metrics` (`replica.metrics.ReplicaMetrics`, labelled with the run
  id); the embedded Ray runs its dashboard on 127.0.0.1 so that it exports them and writes the
  service-discovery file Prometheus reads (see `workloads.core.run.init_ray`).

Exit status: 0 all points ok; 1 a point failed or no replica could start (e.g. a missing model
path); 2 the suite or the arguments are invalid (nothing is recorded); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from workloads.core import results as res
from workloads.core.run import (SweepError, cli_main, dispatch_points, init_ray, load_suite_of_kind, open_run, pending_points,
                           record_run_dtypes, replica_count, runner_args, start_replicas)
from workloads.core.suite import Point, Suite


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return runner_args(argv, "python -m workloads.sweep", __doc__, "suite YAML file, e.g. workloads/suites/smoke.yaml")


#: A static batch's sequences share one TTFT, TPOT and latency, so each quantile of the point is it.
_STATIC_BATCH_QUANTILES = ("p50", "p90", "p99")


def _record(run_id, commit, suite, point, inventory, info, status, metrics=None, error=None, t0=None, t1=None) -> dict:
    metrics = dict(metrics or {})
    for name in ("ttft", "tpot", "e2e_latency"):
        if metrics.get(f"{name}_s") is not None:
            metrics.update({f"{name}_{q}_s": metrics[f"{name}_s"] for q in _STATIC_BATCH_QUANTILES})
    rec = res.build_record(kind="batch", run_id=run_id, commit=commit, suite=suite, point=point, status=status,
                           error=error, replica=info, inventory=inventory, started_at_unix_s=t0, finished_at_unix_s=t1,
                           metrics=metrics)
    rec.update(batch_size=point.batch_size, prompt_tokens=point.prompt_tokens, new_tokens=point.new_tokens)
    rec.setdefault("budget_tokens", None)
    return rec


def run_sweep(args: argparse.Namespace) -> int:
    suite = load_suite_of_kind(args.suite, "batch")
    replicas = replica_count(args, suite)
    run = open_run(args, suite, "sweep")
    run_id, run_dir, points_path, commit = run.run_id, run.run_dir, run.points_path, run.commit
    points = suite.points()
    pending = pending_points(points_path, points)
    print(f"sweep: run {run_id}: {len(points)} points, {len(points) - len(pending)} already done, "
          f"{len(pending)} to run on {replicas} replica(s); results in {run_dir}/", file=sys.stderr)

    failed, stop = 0, None
    if pending:
        from workloads.core.push import PointPublisher, SweepPusher

        publish = PointPublisher(points_path, SweepPusher(args.pushgateway, run_id),
                                 done=len(points) - len(pending), planned=len(points))
        try:
            failed = _run_points(args, suite, run_id, commit, pending, replicas, publish)
        except SweepError as e:  # still write the table of what is on disk
            stop = e

    ids = {p.point_id for p in points}
    record_run_dtypes(run_dir, (r for r in res.read_records(points_path) if r["point_id"] in ids))
    rows = res.table_rows(r for r in res.read_records(points_path) if r["point_id"] in ids)
    table = res.markdown_table(rows)
    res.write_atomic(str(run_dir / "table.md"), table)
    res.write_atomic(str(run_dir / "points.csv"), res.csv_text(rows))
    print(table, end="")
    written = [p for p in (points_path, run_dir / "table.md", run_dir / "points.csv") if os.path.exists(p)]
    print(f"sweep: wrote {', '.join(map(str, written))}", file=sys.stderr)     # no points.jsonl when no point ran
    if stop is not None:  # the reason stays next to the points, not only in the (job) log
        res.write_atomic(str(run_dir / "error.json"), json.dumps(
            {"run_id": run_id, "error": str(stop), "exit_code": stop.code, "at_unix_s": time.time()}, sort_keys=True) + "\n")
        raise stop
    if (run_dir / "error.json").exists():  # a resumed run got past the earlier stop
        os.remove(run_dir / "error.json")
    _warn_contention(rows)
    failed_total = sum(1 for r in rows if r.get("status") != "ok")
    missing = len(points) - len(rows)
    if failed_total or missing:
        print(f"sweep: {failed_total} point(s) failed, {missing} not run", file=sys.stderr)
        return 1
    return 1 if failed else 0


def _warn_contention(rows: list[dict]) -> None:
    """Say when the replicas got much less CPU than their torch threads (shared or busy machine):
    timings are then slower than the hardware allows, though still comparable within the run."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("process_cpu_s") and r.get("e2e_latency_s")]
    if not ok:
        return
    cpu_s = sum(r["process_cpu_s"] for r in ok)
    busy_s = sum(r["e2e_latency_s"] * (r.get("torch_threads") or 1) for r in ok)
    share = cpu_s / busy_s
    print(f"sweep: points used {cpu_s:.0f} CPU-s in {sum(r['e2e_latency_s'] for r in ok):.0f} s of point time "
          f"({share:.0%} of their torch threads)", file=sys.stderr)
    if share < 0.7:
        print("sweep: warning: the replicas waited for cores (other load on the machine); "
              "absolute timings are pessimistic", file=sys.stderr)


#: Seconds between Prometheus scrapes (dashboards/prometheus.yml).
PROMETHEUS_SCRAPE_INTERVAL_S = 5.0


def _final_scrape_wait_s(publish) -> float:
    """Seconds to keep the replicas (and an embedded Ray) up after the last point, so that Ray
    exports the live metrics' last values and Prometheus scrapes them: Ray's export interval
    (``$RAY_metrics_report_interval_ms``, else Ray's default 10 s) plus one scrape interval.
    0 when no Pushgateway took a push (no monitoring stack is up)."""
    if not getattr(getattr(publish, "pusher", None), "pushes", 0):
        return 0.0
    return float(os.environ.get("RAY_metrics_report_interval_ms", 10_000)) / 1000 + PROMETHEUS_SCRAPE_INTERVAL_S


def _run_points(args, suite: Suite, run_id: str, commit: str, pending: list[Point], replicas: int, publish) -> int:
    """Run `pending` on `replicas` replica actors; `publish(record)` writes (and pushes) each finished point."""
    ray, started_here = init_ray(args.address)
    from cluster.inventory import cluster_inventory

    from workloads.load.prompts import make_prompts

    rset = None
    try:
        inventory = cluster_inventory()
        kwargs = dict(model_spec=suite.model, dtype=suite.dtype, device=suite.device, prompt_fn=make_prompts,
                      run_id=run_id)
        # a Serve deployment of this run, one placement-group bundle per replica (the suite's `placement:`)
        rset, infos = start_replicas(ray, suite, replicas, kwargs, name="sweep", run_id=run_id)
        failed = dispatch_points(
            ray, rset, infos, pending, lambda handle, point: handle.run.remote("run_batch", point.spec()),
            lambda point, info, *rest: _record(run_id, commit, suite, point, inventory, info, *rest),
            publish, _one_line, name="sweep")
        wait_s = _final_scrape_wait_s(publish)
        if wait_s:
            print(f"sweep: keeping the replicas up {wait_s:g} s more so Prometheus scrapes their last live values",
                  file=sys.stderr)
            time.sleep(wait_s)
        return failed
    finally:
        if rset is not None:
            rset.shutdown()
        if started_here:
            ray.shutdown()


def _one_line(rec: dict) -> str:
    what = f"{rec['point_id']} on {rec.get('replica_id')}"
    if rec["status"] != "ok":
        return f"  error  {what}: {rec['error']}"
    kv = rec.get("kv_cache_bytes") or 0
    return (f"  ok     {what}: prefill {rec['prefill_s']:.2f} s, decode {rec.get('decode_tokens_per_s') or 0:.1f} tok/s, "
            f"KV {kv / res.MIB:.1f} MiB, budget {rec.get('budget_tokens') or '-'} tok")


def _run_kind(args) -> int:
    kind = load_suite_of_kind(args.suite, None).kind
    if kind == "serving":       # continuously batching replicas under a load pattern
        from workloads.serving.runner import run_serving_sweep

        return run_serving_sweep(args)
    if kind == "quality":
        raise SweepError(f"kind: quality suites run with `make quality` (python -m workloads.quality.runner "
                         f"{args.suite}); this command runs kinds batch and serving", 2)
    return run_sweep(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return cli_main("sweep", lambda: _run_kind(args))


if __name__ == "__main__":
    sys.exit(main())
