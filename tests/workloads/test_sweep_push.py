"""The sweep's monitoring wiring without a cluster: PointPublisher and the --pushgateway flag."""

import json
import logging
import socket

from workloads import sweep
from workloads.core.push import PointPublisher, SweepPusher


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


class _Recorder:
    def __init__(self):
        self.calls = []

    def push_point(self, rec):
        self.calls.append(("point", rec["point_id"]))
        return True

    def push_progress(self, done, total):
        self.calls.append(("progress", done, total))
        return True


def test_publisher_writes_before_it_pushes_and_counts_from_the_resumed_state(tmp_path):
    path = tmp_path / "points.jsonl"
    pusher = _Recorder()
    publish = PointPublisher(str(path), pusher, done=2, planned=4)
    assert pusher.calls == [("progress", 2, 4)]
    for i in (3, 4):
        publish({"point_id": f"p{i}", "status": "ok"})
        assert json.loads(path.read_text().splitlines()[-1])["point_id"] == f"p{i}"  # on disk before the push
    assert pusher.calls[1:] == [("point", "p3"), ("progress", 3, 4), ("point", "p4"), ("progress", 4, 4)]
    publish({"point_id": "again", "status": "error"})  # more records than planned never raise
    assert pusher.calls[-1] == ("progress", 4, 4) and len(path.read_text().splitlines()) == 3


def test_publisher_with_a_dead_pushgateway_keeps_every_record_and_says_so_once(tmp_path, caplog):
    path = tmp_path / "points.jsonl"
    with caplog.at_level(logging.WARNING, logger="workloads.core.push"):
        publish = PointPublisher(str(path), SweepPusher(_dead_address(), "run-dead"), done=0, planned=3)
        for i in range(3):
            publish(
                {
                    "point_id": f"p{i}",
                    "status": "ok",
                    "policy": "full",
                    "batch_size": 1,
                    "output_throughput_tok_per_s": 10.0,
                }
            )
    assert [json.loads(line)["point_id"] for line in path.read_text().splitlines()] == ["p0", "p1", "p2"]
    notices = [r for r in caplog.records if "Pushgateway" in r.getMessage()]
    assert len(notices) == 1 and "run-dead" in notices[0].getMessage()
    assert publish.pusher.enabled is False and publish.pusher.pushes == 0


def test_sweep_takes_the_pushgateway_flag():
    assert sweep.parse_args(["s.yaml"]).pushgateway is None  # $SCISSORHANDS_PUSHGATEWAY, else 127.0.0.1:9091
    assert sweep.parse_args(["s.yaml", "--pushgateway", "off"]).pushgateway == "off"


def test_replicas_stay_up_for_the_last_scrape_only_when_a_pushgateway_answered(monkeypatch):
    from workloads.batch.runner import PROMETHEUS_SCRAPE_INTERVAL_S, final_scrape_wait_s

    def pusher(pushes):
        return type("P", (), {"pushes": pushes})()

    monkeypatch.setenv("RAY_metrics_report_interval_ms", "5000")
    assert final_scrape_wait_s(pusher(3)) == 5.0 + PROMETHEUS_SCRAPE_INTERVAL_S
    assert final_scrape_wait_s(pusher(0)) == 0.0  # Pushgateway down or off: no wait
    monkeypatch.delenv("RAY_metrics_report_interval_ms")
    assert final_scrape_wait_s(pusher(1)) == 10.0 + PROMETHEUS_SCRAPE_INTERVAL_S
