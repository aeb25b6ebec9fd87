"""Submit a sweep suite to a Ray cluster with `ray job submit` (what `make submit` runs).

    python -m cluster.submit SUITE.yaml [--address http://HEAD:8265] [--results-dir DIR]
                             [--run-id ID] [--set KEY=VALUE ...] [--max-package-mib 100] [--exclude PATTERN ...]
                             [--job-python PYTHON] [--no-wait] [--dry-run] [-- SWEEP ARGS ...]

`--set KEY=VALUE` overrides a suite key as `make sweep`'s does (the value is YAML; a dotted key sets a key of a
mapping: `--set slo.ttft_s=0.5`): each is checked for its form here (exit 2 before anything is uploaded) and passed
to the job's sweep, which validates the suite with them (a resumed run needs the same overrides). So
`make submit SUITE=... ARGS="--set scheduler=mixed"` runs what `make sweep SUITE=... ARGS="--set scheduler=mixed"`
runs.

1. **Package check, before anything is uploaded.** The working directory (default: this
   repository) is listed with Ray's own packaging rules: Ray's default excludes (`.git`,
   `.venv`, `venv`, `__pycache__`), `.gitignore` / `.rayignore`, and this project's excludes
   (`/results/`, `/.cache/`, `/dashboards/data/`, virtual environments, caches; see
   `DEFAULT_EXCLUDES`), plus `--exclude`. When what is left is larger than the job server
   accepts (`--max-package-mib`, default 100 MiB: Ray's dashboard takes at most that much in
   one upload; Ray zips without compression, so the size is the files' bytes plus headers), the
   command stops with exit status 2 and a message that gives the size, the limit and the largest
   entries, before `ray job submit` runs.
2. **Submit.** Runs `ray job submit --address ... --submission-id sweep-<run_id>-<UTC time>-<4 hex>
   --metadata-json {"scissorhands_run_id": RUN_ID} --runtime-env-json {working_dir, excludes, env_vars}
   -- <python> -m workloads.sweep SUITE --results-dir DIR --run-id RUN_ID [SWEEP ARGS]`, streaming the
   job's output. Every submission has an id of its own, so a run submitted again (to resume it, or
   the same `--run-id` by mistake) is never read as its earlier job; while a job of the same run id
   is still pending or running, the submission is refused (exit 2, naming `--run-id` and that job)
   before anything is uploaded: two jobs would write one `points.jsonl`.
   The job writes `DIR/<run_id>/points.jsonl` (+ `run.json`, `table.md`, `points.csv`, and
   `error.json` when the sweep stops early). On a real cluster DIR must be storage every node
   sees at the same path (NFS, a PVC mounted at the same path in every pod); a relative path
   would land in the job's temporary copy of the working dir and vanish, so it is refused for
   a remote address. For a loopback address the default is `./results` made absolute.
3. **Outcome.** Exit status 0 when the job SUCCEEDED, 1 when it FAILED or was STOPPED (the
   sweep exits non-zero on any failed point, so `ray job status` says FAILED), 2 for errors
   before submission. When `DIR/<run_id>/` is reachable from here (a local head, or shared
   storage mounted here too) the job's log and final status are saved next to the points as
   `job.log` and `job.json`, so `ray job logs` is not the only record; a later submission of the
   same run id writes `job-<submission id>.log` and `.json` beside them, never over an earlier job's.

`--job-python` is the interpreter the job runs: the `python` on the cluster's PATH (the image's)
for remote addresses, this interpreter for a loopback address (a head started by
`make cluster-up` from this checkout's virtual environment).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import yaml

from scissorhands.models import embedded_cache_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
#: Excluded from the uploaded working dir (gitignore syntax, relative to the working dir; a
#: leading "/" anchors at its top, so `workloads/core/results.py` still travels).
DEFAULT_EXCLUDES = (
    ".git",
    ".venv",
    "venv",
    "__pycache__",
    "*.pyc",
    "/results/",
    "/.cache/",
    "/dashboards/data/",
    ".pytest_cache",
    "*.egg-info",
    "/.whl/",
    "/.gl/",
)
#: Ray's dashboard accepts at most this many bytes in one package upload (ray_constants.DASHBOARD_CLIENT_MAX_SIZE).
DEFAULT_MAX_PACKAGE_MIB = 100.0
MIB = 1024 * 1024
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
GIT_COMMIT_ENV = "SCISSORHANDS_GIT_COMMIT"
MODEL_CACHE_ENV = "SCISSORHANDS_CACHE_DIR"
TOKEN_CACHE_ENV = "SCISSORHANDS_TOKEN_CACHE_DIR"
#: Passed on to the job when set here: the Pushgateway of per-point summaries, cache folders.
PASS_THROUGH_ENV = ("SCISSORHANDS_PUSHGATEWAY", MODEL_CACHE_ENV, TOKEN_CACHE_ENV)
#: The job metadata key naming the run a job writes (`--metadata-json`), to find a run's earlier jobs.
RUN_ID_METADATA = "scissorhands_run_id"
#: Job states in which a job still runs (or will): a second job of its run id is refused meanwhile.
LIVE_JOB_STATES = ("PENDING", "RUNNING")
#: `ray job submit` runs again when the job server took no job (its job agent was not up yet).
SUBMIT_ATTEMPTS = 3
SUBMIT_RETRY_S = 10.0
_QUIET = logging.getLogger("cluster.submit.packaging")
_QUIET.setLevel(logging.WARNING)


class SubmitError(Exception):
    """An error found before anything is submitted (exit status 2)."""


# -- the package -------------------------------------------------------------------------
def ray_default_excludes() -> list[str]:
    """Ray's own default excludes (`RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES` respected)."""
    # Ray on use only: cluster.connect sets the environment Ray reads on import first; --local runs never need it
    from ray._private import ray_constants

    return list(ray_constants.get_runtime_env_default_excludes())


def package_files(working_dir: str | Path, excludes: list[str]) -> list[tuple[str, int]]:
    """Files Ray would upload for `working_dir` with `excludes`: [(relative path, bytes)].

    Uses Ray's own traversal (`ray._private.runtime_env.packaging`), so `.gitignore`,
    `.rayignore` (in every folder) and Ray's default excludes apply exactly as in the upload.
    """
    from ray._private.runtime_env import packaging  # on use, as ray_default_excludes

    root = Path(working_dir).absolute()
    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    out: list[tuple[str, int]] = []

    def handler(path: Path) -> None:
        if path.is_file():
            out.append((str(path.relative_to(root)), path.stat().st_size))

    all_excludes = ray_default_excludes() + list(excludes)
    packaging._dir_travel(
        root, [packaging._get_excludes(root, all_excludes)], handler, include_gitignore=include_gitignore, logger=_QUIET
    )
    return out


def zip_bytes(files: list[tuple[str, int]]) -> int:
    """Size of the zip Ray builds from `files`: Ray stores files uncompressed (ZIP_STORED), so
    it is their bytes plus the per-file headers (local 30 + central 46 bytes + the name twice)
    and the 22-byte end record."""
    return sum(size + 76 + 2 * len(path.encode()) for path, size in files) + 22


def _largest_entries(files: list[tuple[str, int]], n: int = 5) -> str:
    """The n largest top-level entries (folders summed, with their largest file)."""
    tops: dict[str, list] = {}
    for rel, size in files:
        top = rel.split(os.sep, 1)[0] + ("/" if os.sep in rel else "")
        entry = tops.setdefault(top, [0, rel, -1])
        entry[0] += size
        if size > entry[2]:
            entry[1], entry[2] = rel, size
    parts = []
    for top, (size, big, big_size) in sorted(tops.items(), key=lambda t: -t[1][0])[:n]:
        inner = f", largest file {big} {big_size / MIB:.1f} MiB" if top.endswith("/") else ""
        parts.append(f"{top} ({size / MIB:.1f} MiB{inner})")
    return "; ".join(parts)


def check_package(working_dir: str | Path, excludes: list[str], max_bytes: int) -> dict:
    """Measure the package and raise SubmitError (before any upload) when it is too large.

    Returns {"files": n, "bytes": the zip's size, "max_bytes": ...}.
    """
    files = package_files(working_dir, excludes)
    total = zip_bytes(files)
    report = {"files": len(files), "bytes": total, "max_bytes": int(max_bytes)}
    if total <= max_bytes:
        return report
    raise SubmitError(
        f"package too large: the working dir {Path(working_dir).absolute()} packs to {total / MIB:.1f} MiB "
        f"({len(files)} files after excludes) and the Ray job server accepts at most {max_bytes / MIB:.1f} MiB "
        f"per upload, so `ray job submit` would fail; nothing was uploaded. Largest entries: "
        f"{_largest_entries(files)}. Exclude them (--exclude PATTERN, .rayignore or .gitignore), or put "
        "models and data on shared storage or in the cluster's image."
    )


# -- the command -------------------------------------------------------------------------
def normalize_address(address: str) -> str:
    """`HOST:PORT` -> `http://HOST:PORT` (the job server's address); `ray://` is refused."""
    if address.startswith("ray://"):
        raise SubmitError(f"--address: {address!r} is a Ray client address; give the dashboard's http://HOST:8265")
    return address if "://" in address else f"http://{address}"


def is_loopback(address: str) -> bool:
    return (urlparse(address).hostname or "") in LOOPBACK_HOSTS


def suite_name(suite_path: Path) -> str:
    """The suite's `name:` (YAML), else the file's stem."""
    try:
        data = yaml.safe_load(suite_path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise SubmitError(f"suite: cannot read {suite_path}: {e}") from None
    name = data.get("name") if isinstance(data, dict) else None
    return str(name) if isinstance(name, str) and name else suite_path.stem


def git_commit(working_dir: Path) -> str:
    """`git rev-parse HEAD` in `working_dir`, else `$SCISSORHANDS_GIT_COMMIT` (set for a job), else 'unknown'."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=working_dir, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get(GIT_COMMIT_ENV) or "unknown"


def ray_cli() -> str:
    """The `ray` executable next to this interpreter, else the one on PATH."""
    here = Path(sys.executable).parent / "ray"
    return str(here) if here.exists() else "ray"


def run_ray_cli(cmd: list[str]) -> int:
    """Run `ray job submit ...` (output streams through); return its exit status."""
    return subprocess.run(cmd, env=dict(os.environ)).returncode


def check_overrides(items: list[str]) -> list[str]:
    """The `--set` overrides, each checked for the form the sweep accepts (``KEY=VALUE``, a dotted key of non-empty
    parts, a YAML value); the suite's own checks of their values run in the job, as in `make sweep`.

    Raises:
        SubmitError: an override is not ``KEY=VALUE`` or its value is not valid YAML (the message names `--set`).
    """
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or any(not k for k in key.strip().split(".")):
            raise SubmitError(f"--set: expected KEY=VALUE (e.g. scheduler=mixed or slo.ttft_s=0.5), got {item!r}")
        try:
            yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SubmitError(f"--set {key}: the value {text!r} is not valid YAML: {e}") from None
    return list(items)


def _results_dir(given: str | None, working_dir: Path, local: bool) -> Path:
    """The run's results folder (normalized): `given` (relative to here on a loopback cluster only), else the
    working dir's ``results/`` on a loopback cluster. Raises SubmitError naming ``--results-dir`` for a remote
    cluster without an absolute folder (a relative one would land in the job's temporary copy and vanish)."""
    if given:
        results = Path(given)
        if not results.is_absolute():
            if not local:
                raise SubmitError(
                    f"--results-dir: {given!r} is relative; for a remote cluster give an absolute folder on "
                    "storage all nodes share (e.g. /mnt/shared/results): a relative one would land in the job's "
                    "temporary copy of the working dir and vanish"
                )
            results = Path.cwd() / results
    elif local:
        results = working_dir / "results"
    else:
        raise SubmitError(
            "--results-dir: required for a remote cluster: an absolute folder on storage all nodes share "
            "(e.g. /mnt/shared/results)"
        )
    return Path(os.path.normpath(results))


def build(args: argparse.Namespace) -> dict:
    """Validate the arguments and build the runtime env and the `ray job submit` command."""
    working_dir = Path(args.working_dir).absolute()
    if not working_dir.is_dir():
        raise SubmitError(f"--working-dir: not a folder: {working_dir}")
    suite = Path(args.suite)
    suite_abs = suite if suite.is_absolute() else Path.cwd() / suite
    if not suite_abs.is_file():
        raise SubmitError(f"suite: file not found: {suite_abs}")
    try:
        suite_rel = suite_abs.resolve().relative_to(working_dir.resolve())
    except ValueError:
        raise SubmitError(
            f"suite: {suite_abs} is outside the working dir {working_dir}; only the working dir is uploaded"
        ) from None
    address = normalize_address(args.address)
    local = is_loopback(address)
    results = _results_dir(args.results_dir, working_dir, local)
    run_id = args.run_id or f"{suite_name(suite_abs)}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    excludes = list(DEFAULT_EXCLUDES) + list(args.exclude or [])
    try:  # results inside the working dir never travel, wherever they are
        inside = "/" + str(results.relative_to(working_dir)) + "/"
        if inside not in excludes and inside != "/./":
            excludes.append(inside)
    except ValueError:
        pass
    job_python = args.job_python or (sys.executable if local else "python")
    runtime_env = {
        "working_dir": str(working_dir),
        "excludes": excludes,
        "env_vars": {
            # "0" keeps a loopback head's driver on 127.0.0.1; "1" is Ray's normal multi-node
            # behaviour (the sweep defaults to "0", which would make a remote driver report 127.0.0.1)
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0" if local else "1",
            "PYTHONUNBUFFERED": "1",
            GIT_COMMIT_ENV: git_commit(working_dir),
        },
    }
    if local:  # same machine: the job reuses this checkout's converted model and token caches
        runtime_env["env_vars"][MODEL_CACHE_ENV] = str(embedded_cache_dir())
        runtime_env["env_vars"][TOKEN_CACHE_ENV] = str(
            working_dir / ".cache" / "tokens"
        )  # workloads.load.prompts' default
    for name in PASS_THROUGH_ENV:  # what the user set here wins (e.g. shared cache paths on a cluster)
        if os.environ.get(name):
            runtime_env["env_vars"][name] = os.environ[name]
    if auth_env(dict(os.environ)).get("RAY_AUTH_MODE") == "token":
        # the job's driver joins the cluster with an explicit RAY_ADDRESS, for which Ray does not
        # turn token auth on by itself; the nodes hold the token (~/.ray/auth_token or RAY_AUTH_TOKEN)
        runtime_env["env_vars"]["RAY_AUTH_MODE"] = "token"
    entrypoint = [
        job_python,
        "-m",
        "workloads.sweep",
        str(suite_rel),
        "--results-dir",
        str(results),
        "--run-id",
        run_id,
    ]
    for item in check_overrides(getattr(args, "set", None) or []):
        entrypoint += ["--set", item]
    entrypoint += list(args.sweep_args or [])
    # one id per submission: a run id used before must not find (and report) its earlier job
    submission_id = f"sweep-{run_id}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(2)}"
    cmd = [
        ray_cli(),
        "job",
        "submit",
        "--address",
        address,
        "--submission-id",
        submission_id,
        "--metadata-json",
        json.dumps({RUN_ID_METADATA: run_id}),
        "--runtime-env-json",
        json.dumps(runtime_env),
    ]
    if args.no_wait:
        cmd.append("--no-wait")
    cmd += ["--", *entrypoint]
    return {
        "cmd": cmd,
        "runtime_env": runtime_env,
        "address": address,
        "run_id": run_id,
        "results_dir": results,
        "submission_id": submission_id,
        "working_dir": working_dir,
        "excludes": excludes,
        "entrypoint": entrypoint,
    }


def job_files(run_dir: Path, submission_id: str) -> tuple[Path, Path]:
    """(status file, log file) of `submission_id` in `run_dir`: ``job.json`` and ``job.log`` for the run's
    first job (or when they are this job's already), else ``job-<submission_id>.json`` and ``.log``, so an
    earlier job's files are never overwritten."""
    first = run_dir / "job.json"
    try:
        owner = json.loads(first.read_text(encoding="utf-8")).get("submission_id") if first.exists() else None
    except (OSError, ValueError, AttributeError):
        owner = "unreadable"  # someone's file: keep it
    if owner is None or owner == submission_id:
        return first, run_dir / "job.log"
    return run_dir / f"job-{submission_id}.json", run_dir / f"job-{submission_id}.log"


def save_job_record(plan: dict, status: str, message: str | None, logs: str | None) -> Path | None:
    """Write the job's status (+ log) into the run folder when it is reachable from here (`job_files`:
    never over an earlier job's); return the status file written, None when the folder is not reachable."""
    run_dir = Path(plan["results_dir"]) / plan["run_id"]
    if not run_dir.is_dir():
        return None
    record = {
        "submission_id": plan["submission_id"],
        "run_id": plan["run_id"],
        "address": plan["address"],
        "status": status,
        "message": message,
        "entrypoint": shlex.join(plan["entrypoint"]),
        "saved_at_unix_s": time.time(),
    }
    status_file, log_file = job_files(run_dir, plan["submission_id"])
    status_file.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if logs is not None:
        log_file.write_text(logs, encoding="utf-8")
    return status_file


def live_jobs_of_run(address: str, run_id: str) -> list[tuple[str, str]]:
    """[(submission id, status)] of the jobs at `address` that write `run_id` (their metadata says so, or the
    id of this command's earlier releases, ``sweep-<run_id>``) and are still pending or running. [] when the
    job server cannot be asked (the submission itself then reports why)."""
    from ray.job_submission import JobSubmissionClient  # on use, as ray_default_excludes

    try:
        jobs = JobSubmissionClient(address).list_jobs()
    except Exception:  # noqa: BLE001 - no job server: `ray job submit` says so itself
        return []
    out = []
    for job in jobs:
        sid = getattr(job, "submission_id", None) or ""
        status = str(getattr(job.status, "value", job.status))
        ours = (getattr(job, "metadata", None) or {}).get(RUN_ID_METADATA) == run_id or sid == f"sweep-{run_id}"
        if ours and status in LIVE_JOB_STATES:
            out.append((sid, status))
    return out


def job_exists(address: str, submission_id: str) -> bool:
    """Whether the job server knows the job (False when it cannot be asked)."""
    from ray.job_submission import JobSubmissionClient  # on use, as ray_default_excludes

    try:
        JobSubmissionClient(address).get_job_info(submission_id)
        return True
    except Exception:  # noqa: BLE001 - any failure to read the job: not known to the server
        return False


def job_outcome(address: str, submission_id: str) -> tuple[str, str | None, str | None]:
    """(status, message, logs) of a job from the job server."""
    from ray.job_submission import JobSubmissionClient  # on use, as ray_default_excludes

    client = JobSubmissionClient(address)
    info = client.get_job_info(submission_id)
    try:
        logs = client.get_job_logs(submission_id)
    except Exception:  # noqa: BLE001 - the logs are optional: the status is still read
        logs = None
    return str(getattr(info.status, "value", info.status)), info.message, logs


def auth_env(env: dict) -> dict:
    """`env` with RAY_AUTH_MODE=token when a Ray auth token is available and no mode is set.

    `ray start --head` (Ray >= 2.52) turns token authentication on by default and saves the
    token to ~/.ray/auth_token, but the job CLI only sends it when RAY_AUTH_MODE=token. Remote
    clusters: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token.
    """
    env = dict(env)
    if "RAY_AUTH_MODE" not in env:
        token_file = Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        if env.get("RAY_AUTH_TOKEN") or token_file.is_file():
            env["RAY_AUTH_MODE"] = "token"
    return env


def follow_token_auth() -> bool:
    """Turn token authentication on for this process (and the processes it starts) when a token
    is available and `RAY_AUTH_MODE` is unset; return whether it is on.

    For a driver joining a cluster by an explicit address (`ray.init(address=...)`, `$RAY_ADDRESS`),
    which Ray 2.60 never does by itself: `ray start --head` runs with token auth whenever a token
    exists (`~/.ray/auth_token`, `$RAY_AUTH_TOKEN`, `$RAY_AUTH_TOKEN_PATH`), and a driver without it
    is refused ("InvalidAuthToken"). A driver in token mode also joins a head without auth.
    `RAY_AUTH_MODE` set by the user always wins. Works when Ray is already imported (Ray's cached
    config is refreshed).
    """
    mode = auth_env(dict(os.environ)).get("RAY_AUTH_MODE")
    if mode == "token" and os.environ.get("RAY_AUTH_MODE") != "token":
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # Ray caches the mode per process; re-read it as Ray's own auto-detection does
            from ray._raylet import Config  # private and absent from some Ray builds: guarded, so here

            Config.initialize("")
        except ImportError:
            pass
    return mode == "token"


def token_auth_for_embedded() -> None:
    """Token authentication for a Ray this process starts itself (the embedded loopback Ray), stated explicitly:
    Ray 2.60 turns it on by default for a new local cluster, and says so with a line suggesting
    ``RAY_AUTH_MODE=disabled`` unless the mode is set. It stays on (another local user cannot run code in our
    Ray) without that line; `RAY_AUTH_MODE` set by the user always wins."""
    if os.environ.get("RAY_AUTH_MODE") is None:
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # Ray caches the mode per process; re-read it as Ray's own setup does
            from ray._raylet import Config  # private and absent from some Ray builds: guarded, so here

            Config.initialize("")
        except ImportError:
            pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    sweep_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, sweep_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="python -m cluster.submit", description=__doc__.split("\n\n")[0])
    p.add_argument("suite", help="suite YAML inside the working dir, e.g. workloads/suites/smoke.yaml")
    p.add_argument(
        "--address",
        default=os.environ.get("RAY_JOB_ADDRESS") or DEFAULT_ADDRESS,
        help=f"job server (dashboard) address (default: $RAY_JOB_ADDRESS or {DEFAULT_ADDRESS})",
    )
    p.add_argument(
        "--results-dir",
        default=None,
        help="folder of run folders as the cluster sees it (shared storage on a real cluster; "
        "default for a loopback address: ./results)",
    )
    p.add_argument("--run-id", default=None, help="run id (default: <suite name>-<UTC time>)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a suite key, as make sweep's --set (repeatable; the value is YAML: --set scheduler=mixed, "
        "--set slo.ttft_s=0.5); a resumed run needs the same overrides",
    )
    p.add_argument(
        "--working-dir", default=str(REPO_ROOT), help="folder uploaded as the job's working dir (default: this repo)"
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="another gitignore-style pattern left out of the upload (repeatable)",
    )
    p.add_argument(
        "--max-package-mib",
        type=float,
        default=DEFAULT_MAX_PACKAGE_MIB,
        help=f"refuse to upload a package larger than this (default {DEFAULT_MAX_PACKAGE_MIB:g}, Ray's limit)",
    )
    p.add_argument("--job-python", default=None, help="interpreter of the job (default: see the module docs)")
    p.add_argument("--no-wait", action="store_true", help="submit and return; follow with `ray job logs -f`")
    p.add_argument("--dry-run", action="store_true", help="check the package and print the command; submit nothing")
    args = p.parse_args(argv)
    args.sweep_args = sweep_args
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # before Ray is imported: Ray reads the auth mode once per process
    os.environ.update(auth_env(dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")))
    try:
        plan = build(args)
        report = check_package(plan["working_dir"], plan["excludes"], int(args.max_package_mib * MIB))
    except SubmitError as e:
        print(f"submit: error: {e}", file=sys.stderr)
        return 2
    print(
        f"submit: package {report['bytes'] / MIB:.2f} MiB in {report['files']} files "
        f"(limit {report['max_bytes'] / MIB:.0f} MiB); excludes: {' '.join(plan['excludes'])}",
        file=sys.stderr,
    )
    print(
        f"submit: results -> {plan['results_dir']}/{plan['run_id']}/ ; job {plan['submission_id']} at {plan['address']}",
        file=sys.stderr,
    )
    print("submit: " + shlex.join(plan["cmd"]), file=sys.stderr)
    if args.dry_run:
        return 0
    live = live_jobs_of_run(plan["address"], plan["run_id"])
    if live:
        sid, status = live[0]
        print(
            f"submit: error: --run-id {plan['run_id']}: job {sid} of this run is still {status} at "
            f"{plan['address']}; two jobs would write one run folder. Wait for it (ray job logs -f --address "
            f"{plan['address']} {sid}), stop it (ray job stop ...), or give another --run-id; nothing was submitted",
            file=sys.stderr,
        )
        return 2
    for attempt in range(1, SUBMIT_ATTEMPTS + 1):
        rc = run_ray_cli(plan["cmd"])
        if rc == 0 or attempt == SUBMIT_ATTEMPTS or job_exists(plan["address"], plan["submission_id"]):
            break
        # the job server took no job (e.g. "No available agent": a head that just started)
        print(
            f"submit: the job server did not accept the job (attempt {attempt} of {SUBMIT_ATTEMPTS}); "
            f"retrying in {SUBMIT_RETRY_S:g} s",
            file=sys.stderr,
        )
        time.sleep(SUBMIT_RETRY_S)
    if args.no_wait:
        if rc == 0:
            print(
                f"submit: follow with: ray job logs -f --address {plan['address']} {plan['submission_id']}",
                file=sys.stderr,
            )
        return 0 if rc == 0 else 1
    try:
        status, message, logs = job_outcome(plan["address"], plan["submission_id"])
    except Exception as e:  # noqa: BLE001 - the job server is gone or never got the job
        print(f"submit: could not read the job's status: {e}", file=sys.stderr)
        return rc or 1
    saved = save_job_record(plan, status, message, logs)
    where = f"; status and log saved as {saved} (+ .log)" if saved else ""
    print(f"submit: job {plan['submission_id']} {status}{where}", file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
