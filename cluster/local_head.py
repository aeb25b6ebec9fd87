"""Start and stop the Ray head of `make cluster-up` / `make cluster-down`, and only that one.

    python -m cluster.local_head up   [--temp-dir /tmp/scissorhands-cluster] [--port 6379]
                                      [--dashboard-port 8265] [--metrics-export-port 8080]
                                      [--dashboard-agent-listen-port 52375]
                                      [--ray-client-server-port 10001] [--num-cpus N]
    python -m cluster.local_head down [--temp-dir /tmp/scissorhands-cluster] [--timeout-s 10]

`up` runs `ray start --head` on 127.0.0.1 with every port given and its own root folder
(`--temp-dir`): the head's session files, logs and sockets live under that folder only, so its
processes can be told apart from any other Ray on the machine (the embedded Ray of a sweep runs
under `/tmp/scissorhands-ray`, a test's cluster under its own folder). It then writes
`<temp-dir>/cluster.json` (GCS address, dashboard URL, session folder, the head's pids).

`down` stops the processes of that head and nothing else: every process whose command line names
a session folder under `--temp-dir` (the GCS server, raylet, dashboard, log monitor, autoscaler
monitor; also the raylet of a `make cluster-node` joined to it, which runs in the head's session),
plus every process below those (Ray workers, the dashboard and runtime-env agents, replica actors).
They get SIGTERM, and SIGKILL after `--timeout-s`. Other Rays on the machine, and a sweep's
embedded Ray, are left alone. (`ray stop --force`, which this replaces, stops every Ray process of
the user on the machine.)

Token authentication: `ray start --head` turns it on when a token exists (`~/.ray/auth_token`,
written by the first local `ray.init()` or `ray get-auth-token --generate`, or `$RAY_AUTH_TOKEN`);
every client of this project follows it (`cluster.submit.follow_token_auth`).

Exit status: 0 on success; 1 when `ray start` fails, or when `down` left a process running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

DEFAULT_TEMP_DIR = "/tmp/scissorhands-cluster"
STATE_FILE = "cluster.json"


def _ray_cli() -> str:
    here = Path(sys.executable).parent / "ray"
    return str(here) if here.exists() else "ray"


def start_command(args: argparse.Namespace) -> list[str]:
    """The `ray start --head` command line of `up` (loopback only, every port explicit)."""
    cmd = [
        _ray_cli(),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--port={args.port}",
        f"--dashboard-port={args.dashboard_port}",
        f"--metrics-export-port={args.metrics_export_port}",
        # the agent gets its own port: the default 52365 is taken by any other Ray on the machine,
        # and without it `ray job submit` fails with "No available agent to submit job"
        f"--dashboard-agent-listen-port={args.dashboard_agent_listen_port}",
        f"--ray-client-server-port={args.ray_client_server_port}",
        f"--temp-dir={args.temp_dir}",
        "--disable-usage-stats",
    ]
    if args.num_cpus is not None:
        cmd.append(f"--num-cpus={args.num_cpus}")
    return cmd


def cluster_pids(temp_dir: str | Path) -> list[int]:
    """Pids of the Ray processes of the head rooted at `temp_dir`, and of every process below them.

    A process belongs to the head when its command line names `<temp_dir>/session_...` or
    `--temp-dir=<temp_dir>` exactly (so `/tmp/x` never matches `/tmp/x2`). This process is never listed.
    """
    root = os.path.normpath(os.path.abspath(str(temp_dir)))
    marks = (root + "/session_", "--temp-dir=" + root + " ", "--temp-dir=" + root + "/ ")
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            line = " ".join(proc.info["cmdline"] or []) + " "
        except (psutil.Error, TypeError):
            continue
        if any(m in line for m in marks):
            found[proc.pid] = proc
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.Error:
            pass
    found.pop(os.getpid(), None)
    return sorted(found)


def stop(temp_dir: str | Path, timeout_s: float = 10.0, log=print) -> int:
    """SIGTERM the head's processes (`cluster_pids`), SIGKILL those left after `timeout_s`.

    Returns the number of processes still running at the end (0 on success).
    """
    pids = cluster_pids(temp_dir)
    if not pids:
        log(f"cluster-down: no Ray process of the cluster under {temp_dir} is running; nothing stopped")
        return 0
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.send_signal(signal.SIGTERM)
            procs.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=10)
    log(
        f"cluster-down: stopped {len(procs) - len(alive)} process(es) of the cluster under {temp_dir}"
        + (f"; still running: {[p.pid for p in alive]}" if alive else "")
        + "; no other Ray was touched"
    )
    return len(alive)


def up(args: argparse.Namespace) -> int:
    temp_dir = Path(os.path.abspath(args.temp_dir))
    args.temp_dir = str(temp_dir)
    if cluster_pids(temp_dir):
        print(
            f"cluster-up: a cluster under {temp_dir} is already running (make cluster-down stops it)", file=sys.stderr
        )
        return 1
    temp_dir.mkdir(parents=True, exist_ok=True)
    rc = subprocess.run(start_command(args)).returncode
    if rc != 0:
        return 1
    latest = temp_dir / "session_latest"
    state = {
        "gcs_address": f"127.0.0.1:{args.port}",
        "dashboard_url": f"http://127.0.0.1:{args.dashboard_port}",
        "temp_dir": str(temp_dir),
        "session_dir": os.path.realpath(latest) if latest.exists() else None,
        "pids": cluster_pids(temp_dir),
        "started_at_unix_s": time.time(),
    }
    (temp_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    print(
        f"cluster-up: head on {state['gcs_address']} (sweeps: --address {state['gcs_address']}), "
        f"job server {state['dashboard_url']} (make submit), files under {temp_dir}; "
        f"`make cluster-down` stops this cluster only",
        file=sys.stderr,
    )
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.local_head", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    u = sub.add_parser("up", help="ray start --head on loopback under its own --temp-dir")
    d = sub.add_parser("down", help="stop only the cluster started under --temp-dir")
    for q in (u, d):
        q.add_argument(
            "--temp-dir",
            default=DEFAULT_TEMP_DIR,
            help=f"root folder of the cluster's Ray files (default {DEFAULT_TEMP_DIR})",
        )
    u.add_argument("--port", type=int, default=6379, help="GCS port (the --address of sweeps)")
    u.add_argument("--dashboard-port", type=int, default=8265, help="dashboard and job server port")
    u.add_argument("--metrics-export-port", type=int, default=8080)
    u.add_argument("--dashboard-agent-listen-port", type=int, default=52375)
    u.add_argument("--ray-client-server-port", type=int, default=10001)
    u.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers (default: all)")
    d.add_argument("--timeout-s", type=float, default=10.0, help="SIGKILL what SIGTERM left after this long")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.command == "up":
        return up(args)
    return 1 if stop(args.temp_dir, args.timeout_s, log=lambda s: print(s, file=sys.stderr)) else 0


if __name__ == "__main__":
    sys.exit(main())
