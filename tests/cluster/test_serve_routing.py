"""`cluster.serve_routing.StreamHolderRouter`: a stop string's ``finish(request_id, replica_tag)`` goes to the replica
whose tag it names, the one streaming the request (the end-to-end check through Serve is in
tests/cluster/test_serve_app_openai.py); a call naming its session (``session_key``) goes first to its session's
replica, in this router and the sweep's `cluster.replica_set.LeastOutstandingRouter` (through real Serve:
tests/cluster/test_serve_session_affinity.py)."""

from __future__ import annotations

import asyncio
from collections import namedtuple
from types import SimpleNamespace

from cluster.replica_set import LeastOutstandingRouter
from cluster.serve_routing import StreamHolderRouter
from replica.common.session_affinity import session_replica


def _replica(tag: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=tag))


def _request(method: str, *args):
    return SimpleNamespace(metadata=SimpleNamespace(call_method=method), args=list(args))


def test_finish_goes_to_the_replica_its_tag_names_and_only_there():
    router = object.__new__(StreamHolderRouter)  # the choice reads nothing of the router's state
    replicas = [_replica(t) for t in ("a1", "b2", "c3")]
    for tag, i in (("b2", 1), ("c3", 2), ("a1", 0)):
        got = asyncio.run(router.choose_replicas(replicas, _request("finish", "req-7", tag)))
        assert got == [[replicas[i]]]


def test_other_calls_and_a_finish_whose_replica_is_gone_fall_back_to_the_default_choice(monkeypatch):
    seen = []

    async def default(self, candidate_replicas, pending_request=None):
        seen.append(pending_request.metadata.call_method)
        return [candidate_replicas]

    monkeypatch.setattr(StreamHolderRouter.__mro__[1], "choose_replicas", default)
    router = object.__new__(StreamHolderRouter)
    replicas = [_replica("a1"), _replica("b2")]
    assert asyncio.run(router.choose_replicas(replicas, _request("events", object()))) == [replicas]
    assert asyncio.run(router.choose_replicas(replicas, _request("finish", "req-7", "gone"))) == [replicas]
    assert asyncio.run(router.choose_replicas(replicas, _request("finish", "req-7"))) == [replicas]  # no tag
    assert seen == ["events", "finish", "finish"]


def test_finish_naming_its_replica_tag_by_keyword_goes_to_that_replica():
    router = object.__new__(StreamHolderRouter)
    replicas = [_replica(t) for t in ("a1", "b2")]
    request = SimpleNamespace(
        metadata=SimpleNamespace(call_method="finish"), args=["req-7"], kwargs={"replica_tag": "b2"}
    )
    assert asyncio.run(router.choose_replicas(replicas, request)) == [[replicas[1]]]


ReplicaID = namedtuple("ReplicaID", "unique_id")


def _session_call(method: str, key: str | None):
    return SimpleNamespace(
        metadata=SimpleNamespace(call_method=method, internal_request_id=f"i-{method}-{key}"),
        args=[object()],
        kwargs={} if key is None else {"session_key": key},
    )


def test_a_call_naming_its_session_goes_first_to_the_sessions_replica_then_the_others():
    router = object.__new__(StreamHolderRouter)
    replicas = [_replica(t) for t in ("a1", "b2", "c3")]
    for key in ("conv-0", "conv-1", "conv-2", "conv-3"):
        home = session_replica(key, ["a1", "b2", "c3"])
        (first,), rest = asyncio.run(router.choose_replicas(replicas, _session_call("events", key)))
        assert first.replica_id.unique_id == home
        assert sorted(r.replica_id.unique_id for r in rest) == sorted({"a1", "b2", "c3"} - {home})
    (only,) = asyncio.run(router.choose_replicas(replicas[:1], _session_call("events", "conv-0")))
    assert only == [replicas[0]]  # one replica: no fall-through rank


def test_the_sweeps_least_outstanding_router_ranks_the_sessions_replica_first_however_busy():
    router = object.__new__(LeastOutstandingRouter)
    router.initialize_state()
    replicas = [SimpleNamespace(replica_id=ReplicaID(t)) for t in ("a1", "b2")]  # ids key its counts
    home = session_replica("conv-7", ["a1", "b2"])
    busy = next(r for r in replicas if r.replica_id.unique_id == home)
    router.outstanding[busy.replica_id] = 5  # the session's replica is the busier one
    ranked = asyncio.run(router.choose_replicas(replicas, _session_call("generate", "conv-7")))
    assert [r.replica_id.unique_id for (r,) in ranked] == [home, ({"a1", "b2"} - {home}).pop()]
    assert router.outstanding[busy.replica_id] == 6  # counted on the replica it ranked first
    # a call of no session: the least busy first, as before
    ranked = asyncio.run(router.choose_replicas(replicas, _session_call("generate", None)))
    assert ranked[0][0].replica_id.unique_id != home
