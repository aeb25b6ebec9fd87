#!/usr/bin/env python3
"""Start and stop Prometheus and the Pushgateway on loopback for watching sweeps.

    python3 dashboards/serve.py up      # what `make dashboards-up` runs
    python3 dashboards/serve.py status
    python3 dashboards/serve.py down    # what `make dashboards-down` runs

`up` installs the Debian packages ``prometheus`` (2.42) and ``prometheus-pushgateway`` with
``apt-get install -y --no-install-recommends`` when the binaries are missing, writes
``<data-dir>/prometheus.yml`` from ``dashboards/prometheus.yml`` with the chosen ports and Ray
service-discovery file, then runs both binaries directly, bound to 127.0.0.1, with their data
in ``<data-dir>`` (default ``dashboards/data/``, gitignored) and pid files there, so `down`
stops exactly the processes `up` started. Standard library only: runs with any python3.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "prometheus.yml"
DEFAULT_DATA_DIR = HERE / "data"
RAY_SD_FILE = "/tmp/ray/prom_metrics_service_discovery.json"
#: The embedded Ray of `python -m workloads.sweep` keeps its files in cluster.connect.EMBEDDED_RAY_TEMP_DIR.
EMBEDDED_RAY_SD_FILE = "/tmp/scissorhands-ray/prom_metrics_service_discovery.json"
#: `make cluster-up` runs its head under cluster.local_head.DEFAULT_TEMP_DIR (the Makefile's CLUSTER_TEMP_DIR).
CLUSTER_UP_SD_FILE = "/tmp/scissorhands-cluster/prom_metrics_service_discovery.json"
#: `make serve` (and the server `make crosscheck` starts) runs its Ray under cluster.serve_app.SERVE_RAY_TEMP_DIR:
#: Ray Serve's own metrics (ray_serve_*) and the service replicas' live metrics.
SERVE_SD_FILE = "/tmp/scissorhands-serve/prom_metrics_service_discovery.json"
#: The service-discovery files Prometheus reads by default (all four are listed in dashboards/prometheus.yml).
DEFAULT_SD_FILES = (RAY_SD_FILE, EMBEDDED_RAY_SD_FILE, CLUSTER_UP_SD_FILE, SERVE_SD_FILE)
DEBIAN_PACKAGES = ("prometheus", "prometheus-pushgateway")
HOST = "127.0.0.1"

# The values in dashboards/prometheus.yml that `render_config` replaces.
_TEMPLATE_PROMETHEUS = "127.0.0.1:9090"
_TEMPLATE_PUSHGATEWAY = "127.0.0.1:9091"
_TEMPLATE_INTERVAL = "5s"


def find_binary(name: str) -> str | None:
    """Path of `name` on PATH or in /usr/bin (Debian puts both binaries there), else None."""
    found = shutil.which(name)
    if found:
        return found
    candidate = Path("/usr/bin") / name
    return str(candidate) if candidate.exists() else None


def binaries() -> dict[str, str | None]:
    """{"prometheus": path or None, "pushgateway": path or None}."""
    return {"prometheus": find_binary("prometheus"), "pushgateway": find_binary("prometheus-pushgateway")}


def install_packages() -> None:
    """apt-get install the Debian packages (as root, or through sudo). Raises RuntimeError on failure."""
    apt = ["apt-get", "install", "-y", "--no-install-recommends", *DEBIAN_PACKAGES]
    prefix: list[str] = []
    if os.geteuid() != 0:
        if not shutil.which("sudo"):
            raise RuntimeError(
                "Prometheus/Pushgateway are missing and this is not root; install them with: "
                "sudo apt-get install -y --no-install-recommends " + " ".join(DEBIAN_PACKAGES)
            )
        prefix = ["sudo"]
    if not shutil.which("apt-get"):
        raise RuntimeError(
            "Prometheus/Pushgateway are missing and apt-get is not available; install Prometheus >= 2.42 "
            "and the Pushgateway and put `prometheus` and `prometheus-pushgateway` on PATH."
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print("installing " + " ".join(DEBIAN_PACKAGES) + " (apt-get, --no-install-recommends)", flush=True)
    for cmd in (prefix + ["apt-get", "update", "-qq"], prefix + apt):
        result = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()[-500:]}")
    # On a systemd host the packages start their own services on 0.0.0.0:9090/9091; the
    # benchmark runs its own copies on loopback, so stop the ones this install just started.
    if shutil.which("systemctl"):
        for service in DEBIAN_PACKAGES:
            subprocess.run(prefix + ["systemctl", "disable", "--now", service], capture_output=True)


def render_config(
    prometheus_port: int = 9090,
    pushgateway_port: int = 9091,
    sd_files: tuple[str, ...] = DEFAULT_SD_FILES,
    scrape_interval: str = _TEMPLATE_INTERVAL,
    template: Path = TEMPLATE,
) -> str:
    """dashboards/prometheus.yml with the given ports, Ray service-discovery files and intervals."""
    text = template.read_text()
    template_files = "\n".join(f"          - {f}" for f in DEFAULT_SD_FILES)
    for needle in (
        _TEMPLATE_PROMETHEUS,
        _TEMPLATE_PUSHGATEWAY,
        template_files,
        f"scrape_interval: {_TEMPLATE_INTERVAL}",
    ):
        if needle not in text:
            raise ValueError(f"{template}: expected {needle!r} in the template")
    text = text.replace(_TEMPLATE_PROMETHEUS, f"{HOST}:{prometheus_port}")
    text = text.replace(_TEMPLATE_PUSHGATEWAY, f"{HOST}:{pushgateway_port}")
    files = "\n".join(f"          - {f}" for f in sd_files)
    text = text.replace(template_files, files)
    for key in ("scrape_interval", "evaluation_interval", "refresh_interval"):
        text = text.replace(f"{key}: {_TEMPLATE_INTERVAL}", f"{key}: {scrape_interval}")
    return text


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _pid_alive(pid: int, binary: str) -> bool:
    """True when `pid` runs and its command line is `binary` (guards against reused pids)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return os.path.basename(cmdline) == os.path.basename(binary)


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def wait_ready(url: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200; RuntimeError when `proc` exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s ({last})")


def _start(name: str, cmd: list[str], data_dir: Path, ready_url: str) -> int:
    pid_file = data_dir / f"{name}.pid"
    pid = _read_pid(pid_file)
    if pid and _pid_alive(pid, cmd[0]):
        print(f"{name}: already running (pid {pid})")
        if name == "prometheus":  # pick up the config just written
            try:
                urllib.request.urlopen(
                    urllib.request.Request(ready_url.replace("/-/ready", "/-/reload"), method="POST"), timeout=5
                )
            except OSError as exc:
                print(f"prometheus: config reload failed ({exc}); run `down` then `up`")
        return pid
    log_file = open(data_dir / f"{name}.log", "ab")
    proc = subprocess.Popen(
        cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )
    log_file.close()
    pid_file.write_text(f"{proc.pid}\n")
    try:
        wait_ready(ready_url, proc=proc)
    except RuntimeError as exc:
        _stop_pid(proc.pid, cmd[0])
        pid_file.unlink(missing_ok=True)
        raise RuntimeError(f"{name} did not start: {exc}; see {data_dir / (name + '.log')}") from None
    return proc.pid


def up(
    data_dir: Path = DEFAULT_DATA_DIR,
    prometheus_port: int = 9090,
    pushgateway_port: int = 9091,
    sd_files: tuple[str, ...] = DEFAULT_SD_FILES,
    scrape_interval: str = _TEMPLATE_INTERVAL,
    install: bool = True,
) -> dict[str, int]:
    """Start (or find running) Prometheus and the Pushgateway; returns {"prometheus": pid, "pushgateway": pid}.

    Raises RuntimeError when a binary is missing and cannot be installed, a port is taken by
    another process, or a server does not become ready within 30 s.
    """
    data_dir = Path(data_dir).resolve()
    bins = binaries()
    if not all(bins.values()):
        if not install:
            raise RuntimeError("missing binaries: " + ", ".join(k for k, v in bins.items() if not v))
        install_packages()
        bins = binaries()
        if not all(bins.values()):
            raise RuntimeError("apt-get finished but the binaries are still missing: " + str(bins))
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "prometheus").mkdir(exist_ok=True)
    config = data_dir / "prometheus.yml"
    config.write_text(render_config(prometheus_port, pushgateway_port, tuple(sd_files), scrape_interval))

    for name, port in (("pushgateway", pushgateway_port), ("prometheus", prometheus_port)):
        pid = _read_pid(data_dir / f"{name}.pid")
        if not (pid and _pid_alive(pid, bins[name])) and not port_is_free(port):
            raise RuntimeError(
                f"{name}: port {HOST}:{port} is already in use by another process "
                f"(a system service? pass another port, e.g. make dashboards-up {name.upper()}_PORT=...)"
            )
    pids = {
        "pushgateway": _start(
            "pushgateway",
            [
                bins["pushgateway"],
                f"--web.listen-address={HOST}:{pushgateway_port}",
                f"--persistence.file={data_dir / 'pushgateway.data'}",
                "--persistence.interval=30s",
            ],
            data_dir,
            f"http://{HOST}:{pushgateway_port}/-/ready",
        ),
        "prometheus": _start(
            "prometheus",
            [
                bins["prometheus"],
                f"--config.file={config}",
                f"--storage.tsdb.path={data_dir / 'prometheus'}",
                f"--web.listen-address={HOST}:{prometheus_port}",
                "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=15d",
            ],
            data_dir,
            f"http://{HOST}:{prometheus_port}/-/ready",
        ),
    }
    return pids


def _stop_pid(pid: int, binary: str, timeout_s: float = 10.0) -> bool:
    if not _pid_alive(pid, binary):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)  # reap when it is our child
        except ChildProcessError:
            done = 0
        if done == pid or not _pid_alive(pid, binary):
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return True


def down(data_dir: Path = DEFAULT_DATA_DIR) -> list[str]:
    """Stop the processes whose pid files `up` wrote in `data_dir`; returns the names stopped."""
    data_dir = Path(data_dir).resolve()
    stopped = []
    for name, binary in (("prometheus", "prometheus"), ("pushgateway", "prometheus-pushgateway")):
        pid_file = data_dir / f"{name}.pid"
        pid = _read_pid(pid_file)
        if pid and _stop_pid(pid, binary):
            stopped.append(name)
        pid_file.unlink(missing_ok=True)
    return stopped


def status(data_dir: Path = DEFAULT_DATA_DIR) -> dict[str, int | None]:
    """{"prometheus": pid or None, "pushgateway": pid or None} of the processes `up` started."""
    data_dir = Path(data_dir).resolve()
    out = {}
    for name, binary in (("prometheus", "prometheus"), ("pushgateway", "prometheus-pushgateway")):
        pid = _read_pid(data_dir / f"{name}.pid")
        out[name] = pid if pid and _pid_alive(pid, binary) else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="data, logs and pid files")
    parser.add_argument("--prometheus-port", type=int, default=int(os.environ.get("PROMETHEUS_PORT", 9090)))
    parser.add_argument("--pushgateway-port", type=int, default=int(os.environ.get("PUSHGATEWAY_PORT", 9091)))
    parser.add_argument(
        "--ray-sd-file",
        action="append",
        default=None,
        help=f"Ray service-discovery file, repeatable (default {' and '.join(DEFAULT_SD_FILES)})",
    )
    parser.add_argument("--scrape-interval", default=_TEMPLATE_INTERVAL, help="e.g. 5s")
    parser.add_argument("--no-install", action="store_true", help="fail instead of apt-get installing missing binaries")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            pids = up(
                args.data_dir,
                args.prometheus_port,
                args.pushgateway_port,
                tuple(args.ray_sd_file or DEFAULT_SD_FILES),
                args.scrape_interval,
                install=not args.no_install,
            )
            print(f"Prometheus:  http://{HOST}:{args.prometheus_port}  (pid {pids['prometheus']})")
            print(f"Pushgateway: http://{HOST}:{args.pushgateway_port}  (pid {pids['pushgateway']})")
            print(f"Ray targets: {', '.join(args.ray_sd_file or DEFAULT_SD_FILES)}; data and logs: {args.data_dir}")
            if args.pushgateway_port != 9091:
                print(f"sweeps push there with: export SCISSORHANDS_PUSHGATEWAY={HOST}:{args.pushgateway_port}")
        elif args.command == "down":
            stopped = down(args.data_dir)
            print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        else:
            for name, pid in status(args.data_dir).items():
                print(f"{name}: " + (f"running (pid {pid})" if pid else "not running"))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
