"""`cluster.serve_routing.StreamHolderRouter`: a stop string's ``finish(request_id, replica_tag)`` goes to the replica
whose tag it names, the one streaming the request (the end-to-end check through Serve is in
tests/cluster/test_serve_app_openai.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from cluster.serve_routing import StreamHolderRouter


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
