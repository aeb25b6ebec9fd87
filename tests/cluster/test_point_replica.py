"""`cluster.replica_set.PointReplica`'s calls, on the plain class behind the Serve deployment (no Ray started):
one named method per call, each returning the replica's info with the result or the error."""

import pytest

from cluster.replica_set import PointReplica, PointReply
from replica import cpu_share


class FakeReplica:
    def info(self) -> dict:
        return {"replica_id": "replica-1", "node_id": "n1"}

    def run_batch(self, spec: dict) -> dict:
        if spec.get("fail"):
            raise RuntimeError("out of memory\n  at step 3")
        return {"batch_size": spec["batch_size"], "tokens": 4 * spec["batch_size"]}

    def apply(self, fn, *args):
        return fn(*args)


@pytest.fixture
def point_replica():
    replica = object.__new__(PointReplica.func_or_class)  # the class Serve wraps, without its constructor
    replica.replica = FakeReplica()
    return replica


def test_run_batch_returns_the_result_with_the_replica_info(point_replica):
    reply = point_replica.run_batch({"batch_size": 3})
    measured = {k: reply.result.pop(k) for k in cpu_share.FIELDS}  # the CPU the point got, measured where it ran
    assert reply == PointReply({"replica_id": "replica-1", "node_id": "n1"}, {"batch_size": 3, "tokens": 12}, None)
    assert measured["contended_rule"] == cpu_share.CONTENDED_RULE and measured["cpu_process_s"] >= 0


def test_apply_runs_the_function_on_the_point(point_replica):
    reply = point_replica.apply(lambda point: point * 10, 7)
    assert reply.result == 70 and reply.error is None and reply.replica["replica_id"] == "replica-1"


def test_a_failed_point_returns_the_error_on_one_line_and_no_result(point_replica):
    reply = point_replica.run_batch({"batch_size": 1, "fail": True})
    assert reply.result is None and reply.error == "RuntimeError: out of memory at step 3"
    assert reply.replica["node_id"] == "n1"
