"""One run template for every suite kind: the steps of a run exist once; a kind supplies its half.

    run_suite(args, kind) -> exit status            (a kind's CLI: ``kind_main(kind)``)

1. load the suite file, which must be of `kind` (exit 2 naming the field otherwise), and check that its longest
   sequences (prompt + output) fit the model's context (`workloads.core.run.check_model_context`, exit 2);
2. the replica count: ``--replicas``, else the suite's `replicas`;
3. the run folder (`workloads.core.run.open_run`: a new id or ``--resume``, a cut last line repaired, ``run.json``);
4. the suite's points, and those still to run (`workloads.core.run.pending_points`: a resumed run skips the points
   whose latest status is in `Kind.done_statuses`; a point whose settings changed since is refused), counted by
   `Kind.progress` (a kind whose next point depends on the last, a serving capacity search, counts its own);
5. one header line, and the kind's own lines (`Kind.announce`);
6. the publisher (`workloads.core.push.PointPublisher`: each record appended to ``points.jsonl``, then pushed);
7. the kind runs the pending points and yields each as it finishes (`Kind.execute` -> `Finished`);
8. one record per finished point, built once (`workloads.core.results.build_record` with the kind's
   `Kind.record_fields`), published, and its progress line (`Kind.one_line`, then `replica.cpu_share.note`:
   ``[contended: ...]`` when the point's processes waited for cores; the ``cpu_*`` and ``contended`` fields
   come with the point's metrics, measured where it ran);
9. the dtypes the run resolved go into ``run.json``; the kind's report (`Kind.report`: ``table.md`` and the files
   it writes) is printed and written, also after a `SweepError` stopped the run (then its reason is written next
   to the points as ``error.json``, and raised);
10. the exit status: 0 when `Kind.progress` counts no failed point and none still to run, else 1.

A new suite kind is one folder `workloads/<kind>/` whose `runner.py` holds a `Kind` subclass, plus one line in
`workloads.kinds.KINDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Sequence

from tqdm import tqdm

from cluster.connect import ClusterError
from replica import cpu_share
from workloads.core import results as res
from workloads.core.push import PointPublisher, SweepPusher
from workloads.core.results import Report
from workloads.core.run import (
    SweepError,
    check_engines,
    check_model_context,
    cli_main,
    open_run,
    pending_points,
    record_run_dtypes,
    replica_count,
    runner_args,
)
from workloads.core.suite import SuiteBase, SuiteError, read_suite_file, validate_suite


@dataclass(frozen=True)
class Finished:
    """One point as a kind's executor hands it back; the template builds its record from it.

    `status`: ``ok``, ``error``, or a kind's own (``oom``, ``skipped``); `metrics`: the point's numbers, under the
    record keys the metrics catalogue names (None when it failed before any); `replica`: where it ran (a replica's
    `info()`), None when it never reached one; times in Unix seconds.
    """

    point: Any
    status: str
    metrics: dict | None
    error: str | None
    replica: dict | None
    started_at_unix_s: float
    finished_at_unix_s: float


@dataclass
class Session:
    """What a kind's executor gets: the command line, the suite, the run and where to report the Ray inventory."""

    args: argparse.Namespace
    suite: Any
    run_id: str
    run_dir: Path
    replicas: int
    pusher: SweepPusher
    inventory: Any = None  # the Ray node inventory, set by an executor that joined a cluster

    @property
    def local(self) -> bool:
        """``--local``: the points run in this process, without Ray."""
        return bool(getattr(self.args, "local", False))


@dataclass(frozen=True)
class Progress:
    """Where a run stands (`Kind.progress`): points recorded with a done status, points whose latest record failed,
    points not recorded yet, and how many a (resumed) run still runs; `bound`: the last two are upper bounds (a
    search ends when it has its answer)."""

    done: int
    failed: int
    missing: int
    to_run: int
    bound: bool = False

    @property
    def planned(self) -> int:
        return self.done + self.failed + self.missing


class Kind:
    """A suite kind: its suite model and its half of the run template (see the module docstring).

    Override `execute`, `ok_line` (or the whole `one_line`) and `report`; `record_fields` and `announce` when the
    kind adds to them.
    """

    name: ClassVar[str]  # the suite file's `kind:`
    suite_model: ClassVar[type[SuiteBase]]
    done_statuses: ClassVar[tuple[str, ...]] = ("ok",)  # a resumed run does not run these points again

    def announce(self, suite) -> Iterable[str]:
        """Lines printed once before the points run (e.g. what the suite's sizes can resolve)."""
        return ()

    def progress(self, suite, points: list, latest: list[dict]) -> Progress:
        """How far the run is, given `latest` (the latest record of each of `points` recorded so far): by default
        every point of the suite is to run, and a failed one runs again on resume."""
        done = sum(1 for r in latest if r["status"] in self.done_statuses)
        failed = len(latest) - done
        missing = len(points) - len(latest)
        return Progress(done, failed, missing, failed + missing)

    def execute(self, session: Session, pending: list) -> Iterator[Finished]:
        """Run `pending` and yield each point as it finishes (in any order).

        Raises:
            SweepError: the run cannot go on (no replica could start, the cluster went away); the points
                yielded so far are kept.
        """
        raise NotImplementedError

    def record_fields(self, suite, point, finished: Finished) -> dict:
        """The kind's half of the record (the template adds the common header and the metrics)."""
        return {}

    def replica_fields(self, finished: Finished) -> dict | None:
        """The record header's replica fields (default: the replica the point ran on)."""
        return finished.replica

    def one_line(self, record: dict) -> str:
        """The point's progress line: its status, id and replica, then the kind's `ok_line` or the error."""
        what = f"{record['point_id']} on {record.get('replica_id')}"
        if record["status"] != "ok":
            return f"  {record['status']:<6} {what}: {record['error']}"
        return f"  ok     {what}: {self.ok_line(record)}"

    def ok_line(self, record: dict) -> str:
        """The figures of a finished point's progress line."""
        raise NotImplementedError

    def report(self, run_dir: Path, suite, records: list[dict]) -> Report:
        """Write the run's table (and plots) from the latest record of every point of the suite."""
        raise NotImplementedError


def load_suite_of(kind: Kind, path: str, overrides: Sequence[str] = ()):
    """The suite file at `path`, `overrides` (``--set KEY=VALUE``) applied, validated as `kind`'s suite model.

    Raises:
        SweepError: (exit 2) the file is missing, not YAML, of another kind, or invalid (the message names the field).
    """
    try:
        data = read_suite_file(path, overrides)
        found = data.get("kind") if isinstance(data, dict) else None
        if found is not None and found != kind.name:
            raise SuiteError(f"kind: {path} is a {found} suite; this runner takes kind {kind.name}")
        return validate_suite({kind.name: kind.suite_model}, data, path)
    except SuiteError as e:
        raise SweepError(str(e), 2) from None


def run_suite(args: argparse.Namespace, kind: Kind, suite=None, *, name: str | None = None) -> int:
    """Run the suite file ``args.suite`` (or the already validated `suite`) as `kind`; return the exit status.
    `name` (default: the kind's) starts every message, as the command that runs it names itself.

    Raises:
        SweepError: as `load_suite_of`, `workloads.core.run.open_run` and `Kind.execute`; the report is written first.
    """
    name = name or kind.name
    suite = suite if suite is not None else load_suite_of(kind, args.suite, getattr(args, "set", None) or ())
    check_model_context(suite)  # before a run folder exists: a suite that cannot run records nothing
    check_engines(suite)
    replicas = replica_count(args, suite)
    suite = suite.model_copy(update={"replicas": replicas})
    run = open_run(args, suite, name)
    points = suite.points()
    pending = pending_points(run.points_path, points, kind.done_statuses)
    progress = kind.progress(suite, points, _latest(run.points_path, points))
    where = "this process" if getattr(args, "local", False) else f"{replicas} replica(s)"
    at_most = "at most " if progress.bound else ""
    print(
        f"{name}: run {run.run_id}: {at_most}{progress.planned} points, {progress.done} already done, "
        f"{at_most}{progress.to_run} to run on {where}; results in {run.run_dir}/",
        file=sys.stderr,
    )
    for line in kind.announce(suite):
        print(f"{name}: {line}", file=sys.stderr)
    stop = None
    if pending and progress.to_run:
        session = Session(args, suite, run.run_id, run.run_dir, replicas, SweepPusher(args.pushgateway, run.run_id))
        publish = PointPublisher(run.points_path, session.pusher, done=progress.done, planned=progress.planned)
        try:
            # closing: the executor's replicas and Ray are released even when publishing a record raises
            with (
                tqdm(total=progress.to_run, desc="points", unit="point", file=sys.stderr, dynamic_ncols=True) as bar,
                contextlib.closing(kind.execute(session, pending)) as finished,
            ):
                for done in finished:
                    record = res.build_record(
                        kind=kind.name,
                        run_id=run.run_id,
                        commit=run.commit,
                        suite=suite,
                        point=done.point,
                        status=done.status,
                        error=done.error,
                        replica=kind.replica_fields(done),
                        inventory=session.inventory,
                        started_at_unix_s=done.started_at_unix_s,
                        finished_at_unix_s=done.finished_at_unix_s,
                        metrics=done.metrics,
                        fields=kind.record_fields(suite, done.point, done),
                    )
                    publish(record)
                    bar.update(1)
                    bar.write(kind.one_line(record) + cpu_share.note(record), file=sys.stderr)
        except ClusterError as e:  # the report of what is on disk is still written
            stop = e
    latest = _latest(run.points_path, points)
    record_run_dtypes(run.run_dir, latest)
    report = kind.report(run.run_dir, suite, latest)
    print(report.table, end="")
    print(
        f"{name}: wrote {', '.join(str(p) for p in (run.points_path, *report.files) if os.path.exists(p))}",
        file=sys.stderr,
    )
    error_file = run.run_dir / "error.json"
    if stop is not None:  # the reason stays next to the points, not only in the (job) log
        res.write_atomic(
            str(error_file),
            json.dumps(
                {"run_id": run.run_id, "error": str(stop), "exit_code": stop.code, "at_unix_s": time.time()},
                sort_keys=True,
            )
            + "\n",
        )
        raise stop
    if error_file.exists():  # a resumed run got past the earlier stop
        error_file.unlink()
    progress = kind.progress(suite, points, latest)
    if progress.failed or progress.missing:
        print(f"{name}: {progress.failed} point(s) failed, {progress.missing} not run", file=sys.stderr)
        return 1
    return 0


def _latest(points_path: str, points: list) -> list[dict]:
    """The latest record of each of `points` in the points file (points of other settings left out)."""
    ids = {p.point_id for p in points}
    return [r for r in res.latest_by_point(res.read_records(points_path)).values() if r["point_id"] in ids]


def kind_main(kind: Kind, argv: list[str] | None = None, doc: str | None = None) -> int:
    """The command line of one kind's runner (``python -m workloads.<kind>.runner SUITE [options]``)."""
    args = runner_args(
        argv,
        f"python -m workloads.{kind.name}.runner",
        doc or run_suite.__doc__,
        f"{kind.name} suite YAML, e.g. workloads/suites/*.yaml",
    )
    return cli_main(kind.name, lambda: run_suite(args, kind))
