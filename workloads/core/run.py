"""What every run shares, whatever its kind: the run folder, the command line, the Ray connection, the replicas.

* `open_run`: the run folder `<results-dir>/<run_id>/` (a new id, or `--resume RUN_ID`), its
  `points.jsonl` repaired when the last line was cut mid-write, and `run.json` (suite, git commit);
  `pending_points`: what a (resumed) run still has to run.
* `runner_args`, `cli_main`: the command line every runner takes, and its exit statuses.
* `resolve_run_dtype`, `start_replicas`: the replicas of a run (a Ray Serve deployment: `cluster.replica_set`),
  sized to the cluster (`cluster.connect.replica_resources`), in one dtype (a resumed run's: as recorded).
* `SweepError`: stops a run before or between points, with the exit status.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cluster import submit, supervise
from cluster.connect import ClusterError, error_message, replica_resources
from cluster.dtype_probe import resolve_run_dtype as resolve
from cluster.placement import PlacementError, not_ready_message
from cluster.replica_set import app_name_for, delete_leftover_apps, point_replicas
from replica.backends.openvino import BackendUnavailable
from replica.backends.openvino import check_available as check_openvino
from replica.model_loading import model_context_tokens
from workloads.core import results as res

REPO_ROOT = Path(__file__).resolve().parents[2]


class SweepError(ClusterError):
    """An error that stops the run before or between points (exit status `code`). The runners stop on its base,
    `cluster.connect.ClusterError`, too: the cluster could not be joined, started or sized."""


def cli_main(name: str, run) -> int:
    """The runners' command-line wrapper: ``run()``'s exit status; a `SweepError` (or `ClusterError`) printed as
    ``<name>: error: ...`` with its code; Ctrl-C 130 with where the finished points are."""
    try:
        return run()
    except ClusterError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{name}: interrupted; finished points are in the points file (use --resume)", file=sys.stderr)
        return 130


def runner_args(argv: list[str] | None, prog: str, doc: str, suite_help: str) -> argparse.Namespace:
    """The command line every suite runner takes (`python -m workloads.sweep`, each kind's runner): the suite
    file and the run's options."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("suite", help=suite_help)
    p.add_argument("--replicas", type=int, default=None, help="replicas (overrides the suite's `replicas`)")
    p.add_argument("--results-dir", default="results", help="folder of run folders (default: results)")
    p.add_argument("--run-id", default=None, help="id of a new run (default: <suite>-<UTC time>)")
    p.add_argument("--resume", metavar="RUN_ID", default=None, help="continue this run; skip its ok points")
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else embedded)")
    p.add_argument(
        "--local",
        action="store_true",
        help="run the points in this process, without Ray (one replica; debugging, tests)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a suite key (repeatable; the value is YAML: --set scheduler=mixed, --set slo.ttft_s=0.5); "
        "a resumed run needs the same overrides",
    )
    p.add_argument(
        "--pushgateway",
        default=None,
        help="Pushgateway host:port for per-point summaries (default: $SCISSORHANDS_PUSHGATEWAY, else "
        "127.0.0.1:9091; 'off' disables); an unreachable one is reported once and skipped",
    )
    return p.parse_args(argv)


def git_commit() -> str:
    """`git rev-parse HEAD` of this repository, else `$SCISSORHANDS_GIT_COMMIT`, else 'unknown'."""
    return submit.git_commit(REPO_ROOT)


def resolve_run_dir(args: argparse.Namespace, suite) -> tuple[str, Path]:
    if args.resume and args.run_id and args.resume != args.run_id:
        raise SweepError("--run-id and --resume name different runs; pass only --resume RUN_ID", 2)
    root = Path(args.results_dir)
    if args.resume:
        run_dir = root / args.resume
        if not (run_dir / "points.jsonl").exists() and not (run_dir / "run.json").exists():
            raise SweepError(f"--resume: no run {args.resume!r} under {root}/ (no points.jsonl)", 2)
        return args.resume, run_dir
    run_id = args.run_id or f"{suite.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    if "/" in run_id or run_id in ("", ".", ".."):
        raise SweepError(f"--run-id: not a valid folder name: {run_id!r}", 2)
    run_dir = root / run_id
    if (run_dir / "points.jsonl").exists():
        raise SweepError(f"--run-id: run {run_id!r} already exists in {run_dir}; use --resume {run_id}", 2)
    return run_id, run_dir


def replica_count(args: argparse.Namespace, suite) -> int:
    """``--replicas`` when given, else the suite's `replicas`; SweepError (exit 2) below 1."""
    replicas = args.replicas if args.replicas is not None else suite.replicas
    if replicas < 1:
        raise SweepError(f"--replicas: must be >= 1, got {replicas}", 2)
    return replicas


def pending_points(points_path: str, points: list, done_statuses: tuple[str, ...] = ("ok",)) -> list:
    """The points of a (resumed) run still to run: those without a record in ``done_statuses``.

    Raises:
        SweepError: (exit 2) a point recorded in this run has changed settings since (the suite was
            edited: model, dtype, device, lengths, load, limits or policy parameters); the message
            names the changed fields with their recorded and new values. Start a new run instead.
            Also (exit 2) when a kept record's resolved policy parameters differ from what this code
            resolves for its point (a changed default such as ``min_budget_tokens``; the id does not
            cover defaults), naming ``policy_params`` and each changed parameter.
    """
    records = res.read_records(points_path)
    changed = res.changed_settings(records, points)
    if changed:
        fields = sorted({k for diff in changed.values() for k in diff})
        first = next(iter(changed.values()))
        detail = ", ".join(f"{k}: {first[k][0]!r} -> {first[k][1]!r}" for k in fields if k in first)
        raise SweepError(
            f"--resume: the suite changed since its points were recorded; changed field(s) {fields} "
            f"({detail}) in {len(changed)} point(s); start a new run (--run-id) for the new settings",
            2,
        )
    params = res.changed_policy_params(records, points, done_statuses)
    if params:
        fields = sorted({k for diff in params.values() for k in diff})
        first = next(iter(params.values()))
        detail = ", ".join(f"{k}: {first[k][0]!r} -> {first[k][1]!r}" for k in fields if k in first)
        raise SweepError(
            f"--resume: policy_params: the policy parameters this code resolves changed since the run's points "
            f"were recorded; changed parameter(s) {fields} ({detail}) in {len(params)} point(s); the run would mix "
            "their numbers. Start a new run (--run-id) for this code's settings",
            2,
        )
    done = {r["point_id"] for r in records if r.get("status") in done_statuses}
    return [p for p in points if p.point_id not in done]


def check_resolved_dtype(earlier: list[dict], record: dict) -> None:
    """Refuse to add `record` to a resumed run whose `earlier` records ran in another dtype.

    A point's id covers the *requested* dtype; ``auto`` is resolved by a probe (`scissorhands.models.resolve_dtype`),
    which a resumed run does not repeat (`resolve_run_dtype` takes the recorded dtype), so this is the last guard:
    a replica that loaded another dtype anyway (records put together from two runs, a model that ignores the
    dtype) would make its table mix the two. The record is compared with the earlier records of the same
    requested dtype that ran on a replica (they have a ``dtype_reason``).

    Raises:
        SweepError: (exit 2) naming ``dtype``, the earlier and the new resolved dtype and why.
    """
    if record.get("dtype_reason") is None:
        return  # the point never reached a replica (nothing resolved)
    for old in earlier:
        if (
            old.get("dtype_reason") is not None
            and old.get("dtype_requested") == record.get("dtype_requested")
            and old.get("dtype") != record.get("dtype")
        ):
            raise SweepError(
                f"--resume: dtype: the suite's dtype {record.get('dtype_requested')!r} resolved to "
                f"{old.get('dtype')!r} for the points this run recorded ({old.get('dtype_reason')}) but to "
                f"{record.get('dtype')!r} on replica {record.get('replica_id')} now ({record['dtype_reason']}); "
                "the run would mix their numbers. Start a new run (--run-id) here, or resume where it resolves "
                f"to {old.get('dtype')!r}",
                2,
            )


@dataclass
class OpenedRun:
    """A run folder ready for points: ``points_path`` repaired, ``run.json`` written once."""

    run_id: str
    run_dir: Path
    points_path: str
    commit: str


def check_same_suite(run_dir: Path, suite) -> None:
    """Refuse to resume the run in `run_dir` with a suite of another kind or name than its ``run.json`` records
    (its points, table and plots would mix two suites). A run without a readable ``run.json`` is not checked.

    Raises:
        SweepError: (exit 2) naming ``kind`` or ``name``, the run's and the suite's.
    """
    try:
        recorded = json.loads((run_dir / "run.json").read_text())["suite"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    for field in ("kind", "name"):
        if recorded.get(field) != getattr(suite, field):
            raise SweepError(
                f"--resume: {field}: run {run_dir.name!r} was made by a {recorded.get(field)!r} suite, not "
                f"{getattr(suite, field)!r}; resume it with its own suite, or start a new run (--run-id)",
                2,
            )


def open_run(args: argparse.Namespace, suite, kind: str) -> OpenedRun:
    """Resolve the run folder from ``args`` (``results_dir``, ``run_id``, ``resume``, ``suite``), create
    it, repair a cut last line of its ``points.jsonl`` (``kind`` names the runner in the notice) and
    write ``run.json`` (the suite as a dict, the git commit) unless it exists.

    Raises:
        SweepError: (exit 2) as `resolve_run_dir` and `check_same_suite`.
    """
    run_id, run_dir = resolve_run_dir(args, suite)
    check_same_suite(run_dir, suite)
    run_dir.mkdir(parents=True, exist_ok=True)
    points_path = str(run_dir / "points.jsonl")
    res.repair_points_file(points_path, kind)
    commit = git_commit()
    supervise.note_run(kind, run_id, run_dir, points_path)  # named should the cluster go away
    if not (run_dir / "run.json").exists():
        meta = {
            "run_id": run_id,
            "suite_file": args.suite,
            "suite": suite.model_dump(mode="json"),
            "git_commit": commit,
            "created_at_unix_s": time.time(),
            "schema_version": res.SCHEMA_VERSION,
        }
        res.write_atomic(str(run_dir / "run.json"), json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return OpenedRun(run_id, run_dir, points_path, commit)


def record_run_dtypes(run_dir, records) -> None:
    """Add to ``run.json`` the dtypes the run's points ran in and why (``dtypes``: each distinct
    ``{dtype, dtype_requested, dtype_reason}`` of ``records``), so a suite's ``dtype: auto`` is resolved
    in the run's own record. A missing or unreadable ``run.json`` is left alone."""
    path = Path(run_dir) / "run.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    seen = []
    for r in records:
        entry = {k: r.get(k) for k in ("dtype", "dtype_requested", "dtype_reason")}
        if entry["dtype_reason"] is not None and entry not in seen:
            seen.append(entry)
    if seen and meta.get("dtypes") != seen:
        meta["dtypes"] = seen
        res.write_atomic(str(path), json.dumps(meta, indent=2, sort_keys=True) + "\n")


def check_model_context(suite) -> None:
    """Every sequence the suite runs (`SuiteBase.context_lengths`: prompt + output) must fit its model's context,
    the rule the OpenAI API applies to one request.

    Raises:
        SweepError: (exit 2) naming the fields, their total and the model's context.
    """
    needs = suite.context_lengths()
    context = model_context_tokens(suite.model) if needs else None
    if context is None:
        return
    for fields, tokens in needs:
        if tokens > context:
            raise SweepError(
                f"{fields} = {tokens} tokens exceeds the context of model {suite.model!r} ({context} tokens); "
                "shorten the prompt or the output",
                2,
            )


def check_engines(suite) -> None:
    """Every engine backend the suite's points name can run here (`replica.backends.openvino.check_available`): a
    suite naming ``engine: openvino`` without its runtime or export stops before a run folder exists.

    Raises:
        SweepError: (exit 2) naming the make target that installs the runtime or makes the export, or the field.
    """
    if getattr(suite, "target", None) is not None:  # a server at a URL runs its own engine
        return
    engines = {getattr(p, "engine", None) for p in suite.points()} | {getattr(suite, "engine", None)}
    if "openvino" in engines:
        try:
            check_openvino(suite.model)
        except BackendUnavailable as e:
            raise SweepError(str(e), 2) from None


def recorded_run_dtype(run_dir: Path | str | None, requested: str) -> dict | None:
    """What a resumed run's points resolved ``dtype: auto`` to: ``{"dtype", "dtype_reason"}`` of the first record
    in ``<run_dir>/points.jsonl`` that requested `requested` and ran on a replica (it has a ``dtype_reason``);
    None for an explicit dtype (nothing to resolve), a new run, or a run none of whose points reached a replica."""
    if requested != "auto" or run_dir is None:
        return None
    for r in res.read_records(str(Path(run_dir) / "points.jsonl")):
        if r.get("dtype_requested") == requested and r.get("dtype_reason") is not None and r.get("dtype"):
            return {"dtype": r["dtype"], "dtype_reason": r["dtype_reason"]}
    return None


def resolve_run_dtype(
    suite,
    ray=None,
    *,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    num_threads: int | None = None,
    run_dir: Path | str | None = None,
) -> dict:
    """Resolve the suite's ``dtype`` once for the whole run (`cluster.dtype_probe.resolve_run_dtype`): in this
    process when `ray` is None, else as one Ray task with a replica's resources. Every replica of the run
    then loads that concrete dtype with the same ``dtype_reason`` (``auto``'s probe is noisy under load, so
    replicas resolving on their own could disagree; docs/sweep.md).

    A resumed run (`run_dir` holding points that ran) takes ``auto`` as its points recorded it
    (`recorded_run_dtype`, the reason unchanged) without probing again: a probe near its threshold on a loaded
    machine could resolve the other dtype, and the run would be refused (`check_resolved_dtype`) or mix its
    numbers. A suite naming another dtype than the run recorded is refused before this (`pending_points`, naming
    ``dtype``).

    Returns:
        replica keyword arguments: ``{"dtype": name}`` and, for ``auto``, ``"dtype_reason"``.
    Raises:
        SweepError: (exit 1) the probe could not run (the message names ``dtype``).
    """
    recorded = recorded_run_dtype(run_dir, suite.dtype)
    if recorded is not None:
        print(
            f"dtype: {suite.dtype!r} is {recorded['dtype']!r}, as this run's points recorded it "
            f"({recorded['dtype_reason']}); not probed again",
            file=sys.stderr,
        )
        return recorded
    try:
        return resolve(
            suite.model,
            suite.dtype,
            suite.device,
            ray=ray,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            num_threads=num_threads,
            timeout_s=suite.placement.ready_timeout_s,
        )
    except Exception as e:  # noqa: BLE001 - e.g. no node ran the probe's task within ready_timeout_s
        if type(e).__name__ == "GetTimeoutError":  # the probe asks a replica's resources: the same fault
            raise SweepError(
                "dtype: the run's dtype probe (one task with a replica's resources): "
                + not_ready_message(ray, 1, "probe", suite.placement.ready_timeout_s),
                1,
            ) from None
        raise SweepError(f"dtype: could not resolve {suite.dtype!r} for the run: {error_message(e)}", 1) from None


def start_replicas(
    ray,
    suite,
    replicas: int,
    replica_kwargs: dict,
    *,
    name: str,
    name_prefix: str = "replica",
    run_id: str | None = None,
    run_dir: Path | str | None = None,
):
    """Start `replicas` point replicas of `suite` (`cluster.replica_set.point_replicas`: a Serve application
    of this run's own, one placement-group bundle per replica, resources from `replica_resources` unless the
    suite's `placement:` names them) and wait until every one has loaded its model. `replica_kwargs` go to
    `cluster.placement.PlacedReplica`, their ``dtype`` resolved once for all replicas first (`resolve_run_dtype`;
    a resumed run's `run_dir` gives the dtype its points recorded).

    Returns:
        (the started `ServeReplicaSet`, the replicas' `info()` dicts).
    Raises:
        SweepError: (exit 1) not placed and loaded within `placement.ready_timeout_s`, or a replica could
            not load its model (the application is deleted); (exit 2) as `replica_resources`.
    """
    threads, num_cpus, num_gpus = replica_resources(ray, replicas, suite.device)
    rset = point_replicas(
        replicas,
        suite.placement,
        replica_kwargs,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        num_threads=threads,
        app_name=app_name_for(name, run_id),
        name_prefix=name_prefix,
    )
    try:
        rset.check_fits()  # refused at once, before the dtype probe asks for them
    except PlacementError as e:
        raise SweepError(str(e), 1) from None
    delete_leftover_apps(rset.app_name)  # a killed attempt's replicas hold CPUs the probe needs
    rset.init_kwargs.update(
        resolve_run_dtype(
            suite, ray, num_cpus=rset.num_cpus, num_gpus=rset.num_gpus, num_threads=rset.num_threads, run_dir=run_dir
        )
    )  # auto: once for all replicas (a resumed run: as its points recorded it)
    try:
        rset.start()
        infos = sorted(rset.broadcast("info").values(), key=lambda i: i["replica_id"])
    except PlacementError as e:  # no node can hold it, or not placed and loaded within ready_timeout_s
        rset.shutdown()
        raise SweepError(str(e), 1) from None
    except Exception as e:  # noqa: BLE001 - a replica could not load its model
        rset.shutdown()
        raise SweepError(f"replica failed to start: {error_message(e)}", 1) from None
    print(
        f"{name}: {replicas} replica(s) ready ({rset.num_threads} torch thread(s), {rset.num_cpus:g} CPU(s) each): "
        + ", ".join(f"{i['replica_id']}@{i['hostname']}" for i in infos),
        file=sys.stderr,
    )
    return rset, infos
