"""Run a serving suite: load points against continuously batching replicas, recorded as they finish.

    python -m workloads.sweep workloads/suites/serving-rate.yaml [--replicas N] [--resume RUN_ID] [--local] ...

Per point (`workloads.serving.point.run_point`): every replica is configured (policy, budget, KV memory limit),
the load generator drives them through a Ray Serve deployment handle (`workloads.serving.pools.ServeReplicaPool`:
`cluster.replica_set`, the one replica lifecycle; least outstanding requests), one in-process replica
(``--local``), or the OpenAI-compatible server a suite's `target:` names; and one JSON line lands in
`<results-dir>/<run_id>/points.jsonl` (appended whole, fsync'ed): the metrics with `n`, the
replicas' peak KV bytes and running sequences, status and `stop_reason`.

* status `ok`; `oom` when a request ran out of device memory (recorded, the sweep goes on);
  `skipped` for the loads above a saturated point of the same series; `error` when every request
  failed of an error other than a timeout or a refusal for load (those are measurements of attainment 0: the point
  is `ok`, and saturated), the point could not start, or a replica died (Serve replaces it; the point records why).
* `--resume RUN_ID` skips points already `ok`, `oom` or `skipped`; a point in progress when the
  sweep was killed simply runs again.
* `mode: capacity` (`workloads.serving.capacity`): per series a search picks the next Poisson rate of its grid
  (a session start rate, judged by the session SLO attainment, with a `sessions:` block) from the last probe's SLO
  attainment, one probe at a time; every probe is a point, with the search's state
  after it. A resumed run re-derives each search from the records: no probe recorded ok or oom runs again; an
  errored one stopped its series (exit 1) and runs again.
* At the end: `table.md`, and PNG plots next to the results (`workloads.serving.report`).

Exit status: 0 every point ok/oom/skipped (a capacity suite: every search ended, no probe errored); 1 a point
failed or no replica could start (the error names the missing model path); 2 invalid suite or arguments.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from cluster.connect import error_message, init_ray, replica_resources
from cluster.inventory import cluster_inventory
from replica.model_loading import TEST_MODEL_NAMES
from scissorhands.models import load_tokenizer
from scissorhands.testing import TINY_LLAMA_CONFIG
from workloads.core import results as res
from workloads.core.run import SweepError, resolve_run_dtype
from workloads.core.template import Finished, Kind, Progress, Report, Session, kind_main
from workloads.load.numbers import significant
from workloads.load.slo import describe_slo
from workloads.serving import capacity
from workloads.serving.point import run_point
from workloads.serving.pools import HTTPTargetPool, LocalReplicaPool, ReplicaPool, ServeReplicaPool
from workloads.serving.report import write_report
from workloads.serving.suite import ServingPoint, ServingSuite


class ServingKind(Kind):
    """Load points against continuously batching replicas; `pool` injects the replicas (tests, benchmarks)."""

    name = "serving"
    suite_model = ServingSuite
    done_statuses = ("ok", "oom", "skipped")

    def __init__(self, pool: ReplicaPool | None = None):
        self.pool = pool

    def _pool(self, session: Session):
        """The pool of this run, and a function that releases what it started."""
        suite = session.suite
        if self.pool is not None:
            return self.pool, lambda: None
        if suite.target is not None:
            return HTTPTargetPool(suite.target, suite.model), lambda: None
        if session.local:
            resolved = resolve_run_dtype(suite, run_dir=session.run_dir)
            return LocalReplicaPool(1, suite.model, device=suite.device, **resolved), lambda: None
        ray, started_ray = init_ray(session.args.address)
        threads, num_cpus, num_gpus = replica_resources(ray, suite.replicas, suite.device)
        session.inventory = cluster_inventory()
        resolved = resolve_run_dtype(
            suite, ray, num_cpus=num_cpus, num_gpus=num_gpus, num_threads=threads, run_dir=session.run_dir
        )
        pool = ServeReplicaPool(
            suite.replicas,
            model_spec=suite.model,
            device=suite.device,
            placement=suite.placement,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            num_threads=threads,
            run_id=session.run_id,
            **resolved,
        )
        return pool, (ray.shutdown if started_ray else (lambda: None))

    def announce(self, suite: ServingSuite):
        if suite.capacity_search:
            yield (
                f"capacity: per series, {suite.capacity.describe()}; SLO {describe_slo(*suite.slo.record_fields().values())}"
            )
            target = suite.capacity.target_attainment
            n, what = (
                (suite.sessions.users, "sessions")
                if suite.capacity.over_sessions and suite.sessions.users
                else (suite.num_requests, "requests")
            )
            if target < 1 and n and n * (1 - target) < 1:
                yield (
                    f"capacity: {n} measured {what} a probe: an attainment of {target:g} allows no "
                    f"miss (at least {math.ceil(1 / (1 - target))} {what} let one miss)"
                )

    def progress(self, suite: ServingSuite, points: list[ServingPoint], latest: list[dict]) -> Progress:
        """A capacity suite's: the probes on each series' search path (done), the series waiting for a probe that
        errored (failed: a resume runs it again), and the most probes the other searches still take."""
        if not suite.capacity_search:
            return super().progress(suite, points, latest)
        by_id = {r["point_id"]: r for r in latest}
        done = failed = missing = 0
        for pts in capacity.by_series(points).values():
            search = capacity.search_series(suite.capacity, pts, by_id)
            errors = int(capacity.errored_next(search, pts, by_id))
            done, failed, missing = done + len(search.path), failed + errors, missing + search.remaining - errors
        return Progress(done, failed, missing, missing, bound=True)

    def execute(self, session: Session, pending: list[ServingPoint]) -> Iterator[Finished]:
        """The points in suite order; the loads above a saturated point of a series are skipped (also when the
        saturated point ran earlier in a resumed run). A capacity suite: each series' search, probe by probe."""
        suite: ServingSuite = session.suite
        tokenizer, vocab = _tokenizer(suite)
        pool, release = self._pool(session)
        records = res.read_records(str(session.run_dir / "points.jsonl"))
        try:
            try:
                infos = pool.start()
            except Exception as e:  # noqa: BLE001 - e.g. the model path does not exist
                raise SweepError(f"replica failed to start: {error_message(e)}", 1) from None
            print(f"serving: {getattr(pool, 'n', len(infos))} serving replica(s) ready", file=sys.stderr)
            dtype_info = infos[0] if infos else None

            def run(point: ServingPoint) -> dict:
                return run_point(pool, suite, point, tokenizer=tokenizer, vocab_size=vocab, run_id=session.run_id)

            steps = (
                capacity.searches(suite, records, run)
                if suite.capacity_search
                else _sweep(suite, pending, records, run)
            )
            for point, body, t0 in steps:
                status, error = body.pop("status"), body.pop("error", None)
                yield Finished(point, status, body, error, dtype_info, t0, time.time())
        finally:
            pool.close()
            release()

    def replica_fields(self, finished: Finished) -> dict:
        """The dtype the replicas run in (the first replica's `info()`) and the replicas and nodes that answered
        the point's requests (comma-joined when several)."""
        where = dict(finished.replica or {})
        stats = [s for s in (finished.metrics or {}).get("replica_stats") or [] if s.get("replica_id")]
        if stats:
            join = lambda key: ",".join(sorted({str(s[key]) for s in stats if s.get(key)})) or None  # noqa: E731
            where.update(
                replica_id=join("replica_id"),
                node_id=join("node_id"),
                hostname=join("hostname") or where.get("hostname"),
            )
        return where

    def record_fields(self, suite: ServingSuite, point: ServingPoint, finished: Finished) -> dict:
        """The suite's columns of a point's record. Its KV limit: ``kv_limit_full_sequences`` (None for a limit in
        bytes) beside the bytes each replica resolved it to (``kv_memory_limit_bytes``, from the replicas' stats)."""
        fixed = lambda d: d.value if d.dist == "fixed" else None  # noqa: E731 - exact lengths label the pushed series
        return dict(
            kv_limit_full_sequences=suite.kv_limit.full_sequences if suite.kv_limit else None,
            mode=suite.mode,
            series=point.series,
            load=point.load,
            target=suite.target,
            prompt_tokens=fixed(suite.prompt_tokens),
            new_tokens=fixed(suite.new_tokens),
            prompt_tokens_dist=suite.prompt_tokens.model_dump(),
            new_tokens_dist=suite.new_tokens.model_dump(),
            **suite.record_columns(point, (finished.metrics or {}).get("max_batch_size")),
        )

    def one_line(self, rec: dict) -> str:
        return self._point_line(rec) + _search_line(rec)

    def _point_line(self, rec: dict) -> str:
        what = f"{rec['point_id']}"
        if rec["status"] not in ("ok",):
            return f"  {rec['status']:<7} {what}: {rec.get('stop_reason')}{': ' + rec['error'] if rec.get('error') else ''}"
        f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
        ms = lambda key: significant(None if rec.get(key) is None else rec[key] * 1000)  # noqa: E731 - s -> ms
        return (
            f"  ok      {what}: {f(rec.get('output_throughput_tok_per_s'), '.1f')} tok/s out, TTFT p50/p99 "
            f"{ms('ttft_p50_s')}/{ms('ttft_p99_s')} ms (n={rec.get('ttft_n')}), TPOT p50/p99 {ms('tpot_p50_s')}/"
            f"{ms('tpot_p99_s')} ms, {rec.get('completed_requests')}/{rec.get('sent_requests')} ok, SLO attainment "
            f"{f(rec.get('slo_attainment'), '.3f')} (n={rec.get('slo_requests')}), goodput "
            f"{f(rec.get('goodput_req_per_s'), '.3g')} req/s {f(rec.get('goodput_tok_per_s'), '.1f')} tok/s"
            + (
                f", RATE SHORTFALL: {f(rec.get('completed_rate_req_per_s'), '.3g')} req/s completed, "
                f"{f(rec.get('achieved_rate_req_per_s'), '.3g')} sent of "
                f"{f(rec.get('scheduled_rate_req_per_s') or rec.get('target_rate_req_per_s'), '.3g')} offered"
                if rec.get("rate_shortfall")
                else ""
            )
            + (
                f", sessions meeting the SLO {rec.get('sessions_slo_met')}/{rec.get('sessions')} "
                f"({f(rec.get('session_slo_attainment'), '.3f')})"
                if rec.get("sessions") is not None
                else ""
            )
            + "".join(f"\n          warning: {w}" for w in rec.get("warnings") or [] if not w.startswith("p99:"))
        )

    def report(self, run_dir: Path, suite: ServingSuite, records: list[dict]) -> Report:
        """The table and plots; a capacity suite's with each series' search over `records` (the suite's grid,
        target and probes) first."""
        found = capacity.summaries(suite.capacity, suite.points(), records) if suite.capacity_search else None
        return write_report(run_dir, records, capacity=found)


Step = tuple[ServingPoint, dict, float]  # a point, its body (status, error and metrics), when it started (Unix s)


def _sweep(suite: ServingSuite, pending: list[ServingPoint], records: list[dict], run: Callable) -> Iterator[Step]:
    """Every pending point in suite order; once a point of a series saturates, the higher loads are skipped."""
    saturated = _saturated_series(suite, records)
    for point in pending:
        t0 = time.time()
        if point.series in saturated:
            body = {"status": "skipped", "stop_reason": saturated[point.series], "error": None}
        else:
            body = run(point)
        status = body["status"]
        yield point, body, t0
        reason = "out of memory" if status == "oom" else suite.saturation.reason(body) if status == "ok" else None
        if reason and point.load is not None and point.series not in saturated:
            saturated[point.series] = f"saturated at load {point.load:g}: {reason}"


def _search_line(rec: dict) -> str:
    """A capacity probe's part of its progress line: passed or not, and the search's state after it."""
    if rec.get("capacity_status") is None:
        return ""
    g = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    unit = capacity.rate_unit(rec)
    attained = rec.get(capacity.RATE_UNITS[unit][1])
    verdict = "passed" if rec.get("capacity_passed") else "failed"
    state = rec["capacity_status"]
    bracket = f"passes at {g(capacity.rate_of(rec, 'lo'))}, fails at {g(capacity.rate_of(rec, 'hi'))} {unit}"
    state = f"capacity {g(capacity.rate_of(rec))} {unit} ({bracket})" if state == "ok" else f"{state} ({bracket})"
    what = "session attainment" if unit == "sessions/s" else "attainment"
    return (
        f"\n          capacity probe {rec.get('capacity_probe')} at {g(rec.get('load'))} {unit} {verdict} "
        f"({what} {g(attained)} vs target {rec.get('capacity_target_attainment'):g}); search: {state}"
    )


def _saturated_series(suite: ServingSuite, records: list[dict]) -> dict[str, str]:
    """Series a resumed run already found saturated (a skipped point, or an ok point past a limit) -> why."""
    done = [r for r in res.latest_by_point(records).values() if r.get("series")]
    saturated = {r["series"]: r["stop_reason"] for r in done if r.get("status") == "skipped"}
    for r in done:
        reason = suite.saturation.reason(r) if r.get("status") == "ok" else None
        if reason and r["series"] not in saturated:
            saturated[r["series"]] = f"saturated at load {r.get('load'):g}: {reason}"
    return saturated


def _tokenizer(suite: ServingSuite):
    """(tokenizer, vocab size): the model's own tokenizer for real-text prompts; none for test models."""
    spec = suite.tokenizer or ("embedded" if suite.target is not None else suite.model)
    if spec in TEST_MODEL_NAMES:
        return None, TINY_LLAMA_CONFIG["vocab_size"]
    try:
        return load_tokenizer(spec), None
    except Exception:  # noqa: BLE001 - the replicas report a missing model with its path
        return None, 128


KIND = ServingKind()


def main(argv: list[str] | None = None) -> int:
    return kind_main(KIND, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
