"""The cluster watch (`cluster.supervise`): a run whose Ray cluster goes away ends in bounded time
with our message. No Ray here: the GCS is a real loopback listener that is closed,
and the watch's `on_gone` is captured instead of ending the process (the end-to-end case, with a real
`cluster-up` head stopped mid-sweep, is in tests/cluster/test_scaleout_fit.py)."""

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cluster import supervise
from cluster.supervise import ClusterWatch, gcs_reachable, gone_after_s, gone_message, split_address


def _listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s, f"127.0.0.1:{s.getsockname()[1]}"


def test_split_address():
    assert split_address("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert split_address("[::1]:6380") == ("::1", 6380)
    with pytest.raises(ValueError, match="no port"):
        split_address("auto")


def test_gone_after_s_default_and_environment(monkeypatch):
    monkeypatch.delenv(supervise.GONE_AFTER_ENV, raising=False)
    assert gone_after_s() == supervise.DEFAULT_GONE_AFTER_S == 15.0
    monkeypatch.setenv(supervise.GONE_AFTER_ENV, "2.5")
    assert gone_after_s() == 2.5
    for bad in ("soon", "0", "-3", "inf", "nan"):
        monkeypatch.setenv(supervise.GONE_AFTER_ENV, bad)
        with pytest.raises(ValueError, match=supervise.GONE_AFTER_ENV):
            gone_after_s()


def test_probe_sees_a_listener_and_its_absence():
    s, address = _listener()
    host, port = split_address(address)
    assert gcs_reachable(host, port, 1.0)
    s.close()
    assert not gcs_reachable(host, port, 1.0)


def _watch(address, connected=lambda: True, gone_after_s=0.6):
    gone = []
    event = threading.Event()
    w = ClusterWatch(
        "127.0.0.1:1234",
        address,
        connected,
        gone_after_s=gone_after_s,
        poll_s=0.1,
        on_gone=lambda m: (gone.append((time.monotonic(), m)), event.set()),
    )
    return w, gone, event


def test_a_gcs_that_stops_answering_is_reported_once_after_the_bound(tmp_path, monkeypatch):
    points = tmp_path / "points.jsonl"
    points.write_text('{"a": 1}\n{"b": 2}\n')
    monkeypatch.setattr(supervise, "_run", None)
    supervise.note_run("sweep", "run-7", tmp_path, points)
    s, address = _listener()
    w, gone, event = _watch(address)
    w.start()
    time.sleep(1.0)  # answering: nothing reported
    assert gone == []
    s.close()
    t0 = time.monotonic()
    assert event.wait(10)
    w.join(5)
    assert not w.is_alive() and len(gone) == 1
    at, message = gone[0]
    assert 0.6 - 0.1 - 0.05 <= at - t0 < 5  # the bound, less the poll since the last connect that opened
    assert message.startswith(
        f"the Ray cluster at 127.0.0.1:1234 is gone: its GCS at {address} has not accepted a connection for"
    )
    assert f"the 2 point(s) written to {points} stay" in message and "--resume run-7" in message


def test_nothing_is_reported_after_the_run_disconnected():
    """`ray.shutdown()` at the end of a run stops an embedded Ray's GCS: not a lost cluster."""
    s, address = _listener()
    connected = [True]
    w, gone, _ = _watch(address, connected=lambda: connected[0])
    w.start()
    time.sleep(0.3)
    connected[0] = False
    s.close()
    w.join(5)
    assert not w.is_alive() and gone == []


def test_a_short_outage_is_not_reported():
    s, address = _listener()
    port = int(address.rsplit(":", 1)[1])
    w, gone, _ = _watch(address, gone_after_s=1.5)
    w.start()
    s.close()
    time.sleep(0.5)  # down for less than the bound, then back on the same port
    s2 = socket.socket()
    s2.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s2.bind(("127.0.0.1", port))
    s2.listen(8)
    time.sleep(2.0)
    w.stop()
    w.join(5)
    s2.close()
    assert gone == []


def test_embedded_ray_is_named_as_such():
    assert gone_message("embedded", "127.0.0.1:5", 15.2, None).startswith(
        "the embedded Ray is gone: its GCS at 127.0.0.1:5 has not accepted a connection for 15 s"
    )


def test_the_default_end_writes_error_json_prints_and_exits_1(tmp_path):
    """`_end_run` in a child process: exit status 1, our message on stderr, error.json next to the points."""
    points = tmp_path / "points.jsonl"
    points.write_text('{"a": 1}\n')
    code = textwrap.dedent(f"""
        from cluster import supervise
        supervise.note_run("quality", "q1", {str(tmp_path)!r}, {str(points)!r})
        supervise._end_run(supervise.gone_message("127.0.0.1:9", "127.0.0.1:9", 15.0, supervise._run))
    """)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "quality: error: the Ray cluster at 127.0.0.1:9 is gone" in proc.stderr and "--resume q1" in proc.stderr
    error = json.loads((tmp_path / "error.json").read_text())
    assert error["run_id"] == "q1" and error["exit_code"] == 1 and "the 1 point(s) written" in error["error"]


def test_a_later_ray_init_of_the_same_process_is_another_cluster():
    """A test session (or a library user) that shuts Ray down and inits another: the old watch must not
    take the new cluster's connection for its own and end the process when the old GCS is gone."""
    from types import SimpleNamespace

    def fake_ray(initialized, address):
        worker = SimpleNamespace(gcs_client=SimpleNamespace(address=address))
        return SimpleNamespace(
            is_initialized=lambda: initialized, _private=SimpleNamespace(worker=SimpleNamespace(global_worker=worker))
        )

    assert supervise._connected_to(fake_ray(True, "127.0.0.1:6379"), "127.0.0.1:6379")
    assert not supervise._connected_to(fake_ray(True, "127.0.0.1:6400"), "127.0.0.1:6379")
    assert not supervise._connected_to(fake_ray(False, "127.0.0.1:6379"), "127.0.0.1:6379")


# -- an embedded Ray whose node does not come up (the sweeps that said nothing for minutes) --
NODE_TIMEOUT = (
    "The current node timed out during startup. This could happen because some of the raylet failed to "
    "startup or the GCS has become overloaded."
)


@pytest.mark.parametrize("first_error", [NODE_TIMEOUT, "dashboard: address already in use"])
def test_an_embedded_ray_that_does_not_start_stops_with_our_message(monkeypatch, capsys, first_error):
    """Measured at load ~30 on 2 cores: Ray's node did not register in time; the sweep blamed the
    dashboard, started Ray again (another minute) and ended with a traceback. Now: our message naming
    the cause and the load, exit 1; the dashboard retry is kept for a real dashboard failure only."""
    import ray

    from cluster.connect import ClusterError, init_ray

    calls = []

    def fake_init(**kwargs):
        calls.append(kwargs.get("include_dashboard"))
        raise Exception(first_error if len(calls) == 1 else NODE_TIMEOUT)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ClusterError) as e:
        init_ray(None)
    assert e.value.code == 1
    message = str(e.value)
    assert (
        message.startswith(
            "the embedded Ray did not start: its node did not register with its GCS within Ray's start timeout"
        )
        and "load average" in message
        and "RAY_raylet_start_wait_time_s" in message
    )
    if first_error == NODE_TIMEOUT:
        assert calls == [True] and "dashboard did not start" not in capsys.readouterr().err
    else:
        assert calls == [True, False] and "Ray's dashboard did not start" in capsys.readouterr().err
