"""End a run with our own message, in bounded time, when its Ray cluster goes away.

A driver whose Ray head (its GCS) stops is ended by Ray's core worker from C++ once it has not
reached the GCS for ``RAY_gcs_rpc_server_reconnect_timeout_s`` (60 s by default), with Ray's own
"Failed to connect to GCS within 60 seconds" and no Python cleanup: until then the runner's main
thread sits inside Ray calls (``ray.wait``, ``ray.nodes``) that neither return nor raise, so the
runner's own error handling never runs and the message says nothing about the run.

`ClusterWatch` is a daemon thread, started by `cluster.connect.init_ray` once this process is
connected, that opens a TCP connection to the GCS port every `POLL_S` s. When no connection has
succeeded for ``gone_after_s`` (``$SCISSORHANDS_CLUSTER_GONE_S``, default `DEFAULT_GONE_AFTER_S`
= 15 s, well inside Ray's 60 s) while Ray is still connected, it

* writes ``error.json`` next to the run's points (as a runner that stops early does),
* prints one message naming the cause, the cluster's address and GCS, the points already written
  (``points.jsonl`` is appended one whole line per point, so they stay as they are) and how to
  resume (the same command with ``--resume RUN_ID``),
* and ends the process with exit status 1 (`os._exit`: the main thread cannot be interrupted while
  it is inside Ray's C++ client).

The run it reports on is the one `note_run` names (`workloads.core.run.open_run` calls it). A TCP
connect is the probe because it needs no Ray call (those block while the GCS is away); a refused
or timed-out connect counts as unreachable. The watch stops with `stop`, at interpreter exit, or
as soon as this process is no longer connected to that GCS (``ray.shutdown()`` at the end of a run
stops the GCS of an embedded Ray, which must not be reported; a later ``ray.init`` is another cluster).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: Environment variable: seconds without any GCS connection after which the run is ended.
GONE_AFTER_ENV = "SCISSORHANDS_CLUSTER_GONE_S"
#: Default of ``$SCISSORHANDS_CLUSTER_GONE_S``: well under Ray's own 60 s GCS reconnect bound.
DEFAULT_GONE_AFTER_S = 15.0
#: Seconds between GCS probes; each connect attempt times out after the same.
POLL_S = 2.0
#: Exit status of a run ended because its cluster went away (as any run stopped by an error).
EXIT_CLUSTER_GONE = 1


def gone_after_s() -> float:
    """``$SCISSORHANDS_CLUSTER_GONE_S`` as a positive finite number of seconds, else the default.

    Raises:
        ValueError: the variable is set but not a positive finite number (the message names it).
    """
    raw = os.environ.get(GONE_AFTER_ENV)
    if raw is None or raw == "":
        return DEFAULT_GONE_AFTER_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise ValueError(f"${GONE_AFTER_ENV}: must be a positive number of seconds, got {raw!r}")
    return value


@dataclass
class RunNote:
    """The run a lost cluster ends: its runner's name (``sweep``, ``quality``...), id and points file."""

    runner: str
    run_id: str
    run_dir: Path
    points_path: Path


_run: RunNote | None = None
_watch: "ClusterWatch | None" = None


def note_run(runner: str, run_id: str, run_dir, points_path) -> None:
    """Name the run whose points a lost cluster leaves behind (its message and ``error.json``)."""
    global _run
    _run = RunNote(runner, run_id, Path(run_dir), Path(points_path))


def gcs_reachable(host: str, port: int, timeout_s: float = POLL_S) -> bool:
    """True when a TCP connection to ``host:port`` opens within ``timeout_s`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def split_address(address: str) -> tuple[str, int]:
    """``'host:port'`` -> (host, port); IPv6 in brackets is accepted.

    Raises:
        ValueError: no port in ``address``.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"GCS address {address!r} has no port")
    return host.strip("[]") or "127.0.0.1", int(port)


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))
    except OSError:
        return 0


def gone_message(cluster: str, gcs_address: str, waited_s: float, run: RunNote | None) -> str:
    """The one message printed when the cluster is gone: cause, address, points kept, how to resume."""
    what = "the embedded Ray" if cluster == "embedded" else f"the Ray cluster at {cluster}"
    text = (
        f"{what} is gone: its GCS at {gcs_address} has not accepted a connection for {waited_s:.0f} s "
        f"(${GONE_AFTER_ENV}; Ray itself would end this process after 60 s)"
    )
    if run is None:
        return text
    return (
        f"{text}; the {_count_lines(run.points_path)} point(s) written to {run.points_path} stay; once a "
        f"cluster is up again (`make cluster-up`), run the rest with the same command and `--resume {run.run_id}` "
        f"(without --run-id)"
    )


class ClusterWatch(threading.Thread):
    """Probe the GCS at ``gcs_address`` every `POLL_S` s; call ``on_gone(message)`` once when it has
    been unreachable for ``gone_after_s`` while ``connected()`` is still true.

    Args:
        cluster: what the user asked for (``'127.0.0.1:6379'``, ``'auto'``) or ``'embedded'``; named in the message.
        gcs_address: ``host:port`` of the GCS (``ray.get_runtime_context().gcs_address``).
        connected: () -> bool, whether this process is still connected to Ray (``ray.is_initialized``).
        on_gone: called with the message; the default writes ``error.json``, prints and exits (status 1).
    """

    def __init__(
        self,
        cluster: str,
        gcs_address: str,
        connected,
        gone_after_s: float = DEFAULT_GONE_AFTER_S,
        poll_s: float = POLL_S,
        on_gone=None,
        probe=gcs_reachable,
    ):
        super().__init__(name="scissorhands-cluster-watch", daemon=True)
        self.cluster, self.gcs_address = cluster, gcs_address
        self.host, self.port = split_address(gcs_address)
        self.connected, self.gone_after_s, self.poll_s = connected, gone_after_s, poll_s
        self.on_gone = on_gone or _end_run
        self.probe = probe
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self._halt.wait(self.poll_s):
            if not self.connected():  # the run ended and disconnected (ray.shutdown)
                return
            if self.probe(self.host, self.port, self.poll_s):
                last_ok = time.monotonic()
                continue
            waited_s = time.monotonic() - last_ok
            if waited_s < self.gone_after_s:
                continue
            if self._halt.is_set() or not self.connected():  # a run that ended and stopped its own Ray
                return
            self.on_gone(gone_message(self.cluster, self.gcs_address, waited_s, _run))
            return


def _end_run(message: str) -> None:
    run = _run
    if run is not None:  # written here, not with workloads.core.results, whose import (torch) takes seconds
        path = run.run_dir / "error.json"
        try:
            tmp = path.with_name(f".error.json.{os.getpid()}")
            tmp.write_text(
                json.dumps(
                    {"run_id": run.run_id, "error": message, "exit_code": EXIT_CLUSTER_GONE, "at_unix_s": time.time()},
                    sort_keys=True,
                )
                + "\n"
            )
            os.replace(tmp, path)
        except OSError:
            pass
    print(f"\n{run.runner if run else 'sweep'}: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_CLUSTER_GONE)


def watch_cluster(ray, cluster: str) -> ClusterWatch | None:
    """Start the watch on the GCS this process is connected to (`ClusterWatch`); None when Ray gives no
    GCS address (a Ray Client ``ray://`` connection). Replaces a watch started before.

    Raises:
        ValueError: ``$SCISSORHANDS_CLUSTER_GONE_S`` is invalid.
    """
    global _watch
    limit_s = gone_after_s()
    try:
        gcs = ray.get_runtime_context().gcs_address
        split_address(gcs)
    except Exception:  # noqa: BLE001 - no GCS address to watch (Ray Client)
        return None
    stop_watch()
    _watch = ClusterWatch(cluster, gcs, lambda: _connected_to(ray, gcs), gone_after_s=limit_s)
    _watch.start()
    return _watch


def _connected_to(ray, gcs_address: str) -> bool:
    """Whether this process is still connected to the Ray whose GCS is ``gcs_address`` (not a later
    ``ray.init`` of the same process, as in a test session; `ray.get_runtime_context` would start one)."""
    if not ray.is_initialized():
        return False
    try:
        return ray._private.worker.global_worker.gcs_client.address == gcs_address
    except Exception:  # noqa: BLE001 - disconnected meanwhile
        return False


def stop_watch() -> None:
    """Stop the running watch, if any (also at interpreter exit)."""
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None


atexit.register(stop_watch)
