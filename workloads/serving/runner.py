"""Run a serving suite: load points against continuously batching replicas, recorded as they finish.

    python -m workloads.sweep workloads/suites/serving-rate.yaml [--replicas N] [--resume RUN_ID] ...

(`workloads.sweep` hands suites whose `mode` is a serving mode here; same flags and exit codes.)

Per point: every replica is configured (policy, budget, KV memory limit), the load generator drives
them through a Ray Serve deployment handle (`ServeReplicaPool`: `cluster.replica_set`, the one
replica lifecycle; least outstanding requests), and one JSON line lands in
`<results-dir>/<run_id>/points.jsonl` (appended whole, fsync'ed): the metrics with `n`, the
replicas' peak KV bytes and running sequences, status and `stop_reason`.

* status `ok`; `oom` when a request ran out of device memory (recorded, the sweep goes on);
  `skipped` for the loads above a saturated point of the same series; `error` when every request
  failed, the point could not start, or a replica died (Serve replaces it; the point records why).
* `--resume RUN_ID` skips points already `ok`, `oom` or `skipped`; a point in progress when the
  sweep was killed simply runs again.
* At the end: `table.md`, and PNG plots next to the results (`workloads.serving.plots`).

Exit status: 0 every point ok/oom/skipped; 1 a point failed or no replica could start (the error
names the missing model path); 2 invalid suite or arguments.
"""
from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from workloads.core import results as res
from workloads.load.loadgen import run_load
from workloads.core.run import (SweepError, error_message, init_ray, load_suite_of_kind, open_run, pending_points,
                           record_run_dtypes, replica_count, replica_resources, resolve_run_dtype)
from workloads.serving.pools import HTTPTargetPool, LocalReplicaPool, ReplicaPool, ServeReplicaPool  # noqa: F401 (LocalReplicaPool: tests)
from workloads.serving.suite import ServingPoint, ServingSuite

TERMINAL = ("ok", "oom", "skipped")


# ---------------------------------------------------------------------------- one point
def _requests_for(suite: ServingSuite, point: ServingPoint, cfg, n: int, tokenizer, vocab_size: int | None):
    """The point's requests, as its load pattern builds them (drawn lengths, or a trace's rows)."""
    return cfg.pattern.requests(max(1, n), suite.prompt_tokens, suite.new_tokens, seed=suite.seed + 7919 * point.index,
                                tokenizer=tokenizer, vocab_size=vocab_size, prefix=point.point_id)


def run_point(pool: ReplicaPool, suite: ServingSuite, point: ServingPoint, *, tokenizer=None,
              vocab_size: int | None = None, run_id: str | None = None) -> dict:
    """Run one point on `pool`; return the metrics part of its record (never raises for load errors)."""
    out: dict[str, Any] = {}
    try:
        pool.configure(suite.engine_config(point), run_id)
    except Exception as e:  # noqa: BLE001 - an invalid config / model error ends this point only
        return {"status": "error", "stop_reason": "configure failed", "error": error_message(e)}
    max_batch = None
    if suite.mode == "max_batch":
        max_batch = pool.max_batch_for(suite.prompt_tokens.upper, suite.new_tokens.upper)
        out["max_batch_size"] = max_batch
        if max_batch < 1:
            return {**out, "status": "error", "stop_reason": "does not fit",
                    "error": "not even one sequence fits the KV memory limit"}
    cfg = suite.load_config(point, max_batch=max_batch)
    n_pool = (cfg.num_requests or 256) + cfg.warmup_requests
    reqs = _requests_for(suite, point, cfg, n_pool, tokenizer, vocab_size)
    pool.stats(reset=True)
    result = asyncio.run(run_load(pool.client(), reqs, cfg))
    stats = pool.stats(reset=True)
    m = result.metrics
    peak_running = [s.get("peak_running_sequences") for s in stats]
    peak_kv = [s.get("peak_kv_cache_bytes") for s in stats]
    live = [x for x in peak_running if x is not None]
    if live and cfg.target_concurrency is not None:
        from workloads.load.metrics import summarize

        m = summarize(result.records, mode=cfg.mode, window_start_s=m.window_start_s, window_end_s=m.window_end_s,
                      stop_reason=m.stop_reason, target_rate_req_per_s=m.target_rate_req_per_s, target_concurrency=m.target_concurrency,
                      replica_peak_running_sequences=sum(live))
    flat = m.flat()
    flat["load_mode"] = flat.pop("mode")          # the record's `mode` is the suite's
    out.update(flat)
    out.update({
        "load": point.load, "load_config": dataclasses.asdict(cfg),
        "replica_stats": stats, "replica_ids": [s.get("replica_id") for s in stats],
        "peak_running_sequences_per_replica": peak_running, "peak_kv_cache_bytes_per_replica": peak_kv,
        "kv_cache_bytes": max([x for x in peak_kv if x is not None], default=None),
        "budget_tokens": next((s.get("budget_tokens") for s in stats if "budget_tokens" in s), None),
        "kv_memory_limit_bytes": next((s.get("kv_memory_limit_bytes") for s in stats if "slot_bytes" in s), None),
        "slot_bytes": next((s.get("slot_bytes") for s in stats if "slot_bytes" in s), None),
        "replicas": getattr(pool, "n", len(stats)),
    })
    if max_batch is not None:
        out["max_batch_verified"] = bool(live) and max(live) >= max_batch and all(
            x is None or x <= (out["kv_memory_limit_bytes"] or x) for x in peak_kv)
    replaced = pool.restart_dead()
    errors = m.errors_by_kind
    if replaced or errors.get("replica_died"):
        out.update(status="error", stop_reason="replica died",
                   error=f"replica(s) died during the point and were restarted: {', '.join(replaced) or '?'}")
    elif errors.get("oom"):
        out.update(status="oom", stop_reason="out of memory", error=f"{errors['oom']} request(s) ran out of memory")
    elif m.sent_requests and not m.completed_requests:
        out.update(status="error", stop_reason="every request failed",
                   error=", ".join(f"{k}: {v}" for k, v in sorted(errors.items())))
    else:
        out.update(status="ok", stop_reason=m.stop_reason, error=None)   # `count` or `duration` (the load generator's)
    return out


# ---------------------------------------------------------------------------- the sweep
def _record(run_id, commit, suite: ServingSuite, point: ServingPoint, inventory, body: dict, t0, t1,
            dtype_info: dict | None = None) -> dict:
    """`dtype_info`: the dtype the replicas run in and why (`dtype`, `dtype_reason`; the suite may ask for auto)."""
    body = dict(body)
    rec = res.build_record(kind="serving", run_id=run_id, commit=commit, suite=suite, point=point,
                           status=body.pop("status"), error=body.pop("error", None),
                           replica=_where(dtype_info, body.get("replica_stats")), inventory=inventory,
                           started_at_unix_s=t0, finished_at_unix_s=t1, metrics=body)
    fixed = lambda d: d.value if d.dist == "fixed" else None  # noqa: E731 - exact lengths label the pushed series
    rec.update(mode=suite.mode, series=point.series, load=point.load, target=suite.target,
               prompt_tokens=fixed(suite.prompt_tokens), new_tokens=fixed(suite.new_tokens),
               prompt_tokens_dist=dataclasses.asdict(suite.prompt_tokens),
               new_tokens_dist=dataclasses.asdict(suite.new_tokens),
               batch_size=body.get("max_batch_size") if suite.mode == "max_batch"
               else point.load if suite.mode == "serving-batch" else None,
               concurrency=point.load if suite.mode == "concurrency" else None,
               request_rate=point.load if suite.mode == "rate" else None)
    return rec


def _where(dtype_info: dict | None, replica_stats: list[dict] | None) -> dict:
    """The record header's replica fields of a serving point: the dtype the replicas run in (`dtype_info`)
    and the replicas and nodes that answered its requests (`replica_stats`; comma-joined when several)."""
    where = dict(dtype_info or {})
    stats = [s for s in replica_stats or [] if s.get("replica_id")]
    if stats:
        join = lambda key: ",".join(sorted({str(s[key]) for s in stats if s.get(key)})) or None  # noqa: E731
        where.update(replica_id=join("replica_id"), node_id=join("node_id"), hostname=join("hostname") or where.get("hostname"))
    return where


def run_serving_points(pool: ReplicaPool, suite: ServingSuite, run_id: str, points_path: str, *, commit: str,
                       inventory=None, tokenizer=None, vocab_size: int | None = None, log=print,
                       publish=None, dtype_info: dict | None = None) -> int:
    """Run the suite's pending points on a started pool; return how many failed (status `error`).

    `publish(record)` records a finished point (default: append it to `points_path`; the sweep passes
    a `workloads.core.push.PointPublisher`, which appends it, then pushes it to the Pushgateway).
    `dtype_info`: a replica's `info()` (its `dtype` and `dtype_reason` go into every record).
    """
    publish = publish or (lambda rec: res.append_record(points_path, rec))
    done = {r["point_id"]: r for r in res.read_records(points_path) if r.get("status") in TERMINAL}
    failed = 0
    saturated: dict[str, str] = {r["series"]: r["stop_reason"] for r in done.values()
                                 if r.get("status") == "skipped" and r.get("series")}
    for r in done.values():                       # a saturated point of an earlier run stops its series too
        reason = suite.saturation.reason(r) if r.get("status") == "ok" else None
        if reason and r.get("series") not in saturated:
            saturated[r["series"]] = f"saturated at load {r.get('load'):g}: {reason}"
    for point in suite.points():
        if point.point_id in done:
            continue
        t0 = time.time()
        if point.series in saturated:
            body = {"status": "skipped", "stop_reason": saturated[point.series], "error": None}
        else:
            body = run_point(pool, suite, point, tokenizer=tokenizer, vocab_size=vocab_size, run_id=run_id)
        rec = _record(run_id, commit, suite, point, inventory, body, t0, time.time(), dtype_info)
        publish(rec)
        log(_one_line(rec))
        if rec["status"] == "error":
            failed += 1
        reason = suite.saturation.reason(rec) if rec["status"] in ("ok", "oom") else None
        if rec["status"] == "oom":
            reason = "out of memory"
        if reason and point.load is not None and point.series not in saturated:
            saturated[point.series] = f"saturated at load {point.load:g}: {reason}"
    return failed


def _one_line(rec: dict) -> str:
    what = f"{rec['point_id']}"
    if rec["status"] not in ("ok",):
        return f"  {rec['status']:<7} {what}: {rec.get('stop_reason')}{': ' + rec['error'] if rec.get('error') else ''}"
    f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    return (f"  ok      {what}: {f(rec.get('output_throughput_tok_per_s'), '.1f')} tok/s out, TTFT p50 "
            f"{f(rec.get('ttft_p50_s'), '.3f')} s (n={rec.get('ttft_n')}), TPOT p50 {f(rec.get('tpot_p50_s'), '.4f')} s, "
            f"{rec.get('completed_requests')}/{rec.get('sent_requests')} ok"
            + "".join(f"\n          warning: {w}" for w in rec.get("warnings") or [] if not w.startswith("p99:")))


TABLE = [  # (header with unit, key, format)
    ("series", "series", "s"), ("load", "load", "g"), ("max batch", "max_batch_size", "d"),
    ("budget (tok)", "budget_tokens", "d"), ("ok/sent", "ok_sent", "s"),
    ("output (tok/s)", "output_throughput_tok_per_s", ".1f"), ("total (tok/s)", "total_throughput_tok_per_s", ".1f"),
    ("req/s", "request_throughput_req_per_s", ".3f"), ("rate target/scheduled/achieved (req/s)", "rate", "s"),
    ("conc. target/peak", "conc", "s"), ("TTFT p50/p99 (s)", "ttft", "s"), ("TPOT p50 (s)", "tpot_p50_s", ".4f"),
    ("e2e p99 (s)", "e2e_latency_p99_s", ".2f"), ("n", "e2e_latency_n", "d"),
    ("peak KV (MiB)", "kv_mib", ".1f"), ("peak running", "peak_running", "s"), ("status", "status", "s"),
    ("stop reason", "stop_reason", "s"),
]


def table_markdown(records: list[dict]) -> str:
    """The serving points as a Markdown table; every numeric column has its unit in the header."""
    fmt = res.format_value
    rows = []
    for r in sorted(records, key=lambda r: r.get("point_index", 0)):
        g = lambda k, f=".3g": fmt(r.get(k), f)  # noqa: E731
        d = dict(r)
        d["ok_sent"] = f"{r.get('completed_requests', '-')}/{r.get('sent_requests', '-')}"
        d["rate"] = (f"{g('target_rate_req_per_s')}/{g('scheduled_rate_req_per_s')}/{g('achieved_rate_req_per_s')}"
                     if r.get("target_rate_req_per_s") else "-")   # scheduled: the arrival times the run drew
        d["conc"] = f"{g('target_concurrency', 'd')}/{g('achieved_peak_concurrency', 'd')}"
        p99 = g("ttft_p99_s") + ("*" if r.get("ttft_p99_low_confidence") else "")
        d["ttft"] = f"{g('ttft_p50_s')}/{p99}"
        d["kv_mib"] = r["kv_cache_bytes"] / res.MIB if r.get("kv_cache_bytes") is not None else None
        d["peak_running"] = ",".join(str(x) for x in r.get("peak_running_sequences_per_replica") or []) or "-"
        rows.append([fmt(d.get(k), f) for _, k, f in TABLE])
    header = [h for h, _, _ in TABLE]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines) + "\n\n`*` p99 over fewer than 100 samples (low confidence).\n"


def finish_run(run_dir: Path, suite: ServingSuite, points_path: str) -> list[dict]:
    """Write table.md and the plots for the suite's points; return their latest records."""
    ids = {p.point_id for p in suite.points()}
    latest = [r for r in res.latest_by_point(res.read_records(points_path)).values() if r["point_id"] in ids]
    table = table_markdown(latest)
    res.write_atomic(str(run_dir / "table.md"), table)
    print(table, end="")
    try:
        from workloads.serving.plots import write_plots

        for path in write_plots(latest, run_dir):
            print(f"sweep: wrote {path}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - a plot never fails a sweep
        print(f"sweep: plots not written: {error_message(e)}", file=sys.stderr)
    return latest


def run_serving_sweep(args, pool: ReplicaPool | None = None) -> int:
    """`workloads.sweep` entry for serving suites (same arguments); `pool` injects replicas (tests)."""
    suite = load_suite_of_kind(args.suite, "serving")
    if args.replicas is not None:
        suite = suite.model_copy(update={"replicas": replica_count(args, suite)})
    run = open_run(args, suite, "sweep")
    run_id, run_dir, points_path, commit = run.run_id, run.run_dir, run.points_path, run.commit
    pending = pending_points(points_path, suite.points(), TERMINAL)
    done = len(suite.points()) - len(pending)
    print(f"sweep: run {run_id} ({suite.mode}): {len(suite.points())} points, {done} already done, "
          f"{len(pending)} to run on {suite.replicas} replica(s); results in {run_dir}/", file=sys.stderr)
    failed = 0
    if pending:
        tokenizer, vocab = _tokenizer(suite)
        started_ray = False
        inventory = None
        if pool is None and suite.target is not None:
            pool = HTTPTargetPool(suite.target, suite.model)
        if pool is None:
            ray, started_ray = init_ray(args.address)
            from cluster.inventory import cluster_inventory

            threads, num_cpus, num_gpus = replica_resources(ray, suite.replicas, suite.device)
            inventory = cluster_inventory()
            resolved = resolve_run_dtype(suite, ray, num_cpus=num_cpus, num_gpus=num_gpus, num_threads=threads)
            pool = ServeReplicaPool(suite.replicas, model_spec=suite.model, device=suite.device,
                                    placement=suite.placement, num_cpus=num_cpus, num_gpus=num_gpus,
                                    num_threads=threads, run_id=run_id, **resolved)
        try:
            try:
                infos = pool.start()
            except Exception as e:  # noqa: BLE001 - e.g. the model path does not exist
                raise SweepError(f"replica failed to start: {error_message(e)}", 1) from None
            print(f"sweep: {getattr(pool, 'n', len(infos))} serving replica(s) ready", file=sys.stderr)
            from workloads.core.push import PointPublisher, SweepPusher

            publish = PointPublisher(points_path, SweepPusher(args.pushgateway, run_id),
                                     done=done, planned=len(suite.points()))
            failed = run_serving_points(pool, suite, run_id, points_path, commit=commit, inventory=inventory,
                                        tokenizer=tokenizer, vocab_size=vocab,
                                        log=lambda s: print(s, file=sys.stderr), publish=publish,
                                        dtype_info=infos[0] if infos else None)
        finally:
            pool.close()
            if started_ray:
                import ray

                ray.shutdown()
    record_run_dtypes(run_dir, res.read_records(points_path))
    latest = finish_run(run_dir, suite, points_path)
    bad = [r for r in latest if r.get("status") not in TERMINAL]
    missing = len(suite.points()) - len(latest)
    if bad or missing or failed:
        print(f"sweep: {len(bad)} point(s) failed, {missing} not run", file=sys.stderr)
        return 1
    return 0


def _tokenizer(suite: ServingSuite):
    """(tokenizer, vocab size): the model's own tokenizer for real-text prompts; none for test models."""
    from replica.static_batch import TEST_MODEL_NAMES

    spec = suite.tokenizer or ("embedded" if suite.target is not None else suite.model)
    if spec in TEST_MODEL_NAMES:
        from scissorhands.testing import TINY_LLAMA_CONFIG

        return None, TINY_LLAMA_CONFIG["vocab_size"]
    from scissorhands.models import load_tokenizer

    try:
        return load_tokenizer(spec), None
    except Exception:  # noqa: BLE001 - the replicas report a missing model with its path
        return None, 128
