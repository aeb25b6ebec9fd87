"""Least-outstanding-requests routing over N replicas, so they serve one request stream.

`Router` is a plain class on the client side: each request goes to the live replica with the
fewest requests in flight (ties: the one that has waited longest since it was last picked). A
replica whose call fails with a dead-actor error is taken out of rotation; `replace` puts a
restarted one in its place.
"""
from __future__ import annotations

import itertools
from typing import Any, Protocol


class ReplicaClient(Protocol):
    replica_id: str

    async def generate(self, request) -> Any: ...


class NoLiveReplicaError(RuntimeError):
    """Every replica behind the router is dead."""


def _is_dead_actor_error(exc: BaseException) -> bool:
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"RayActorError", "ActorDiedError", "ActorUnavailableError"})


class Router:
    """Least outstanding requests over `replicas` (objects with `async generate(request)`)."""

    def __init__(self, replicas: list[ReplicaClient]):
        if not replicas:
            raise ValueError("replicas: the router needs at least one replica")
        self.replicas = list(replicas)
        self.outstanding = [0] * len(replicas)
        self.sent = [0] * len(replicas)
        self.dead: set[int] = set()
        self._tick = itertools.count()
        self._last_pick = [-1] * len(replicas)

    def pick(self) -> int:
        """Index of the live replica with the fewest requests in flight."""
        live = [i for i in range(len(self.replicas)) if i not in self.dead]
        if not live:
            raise NoLiveReplicaError("no live replica behind the router")
        return min(live, key=lambda i: (self.outstanding[i], self._last_pick[i]))

    async def generate(self, request):
        i = self.pick()
        self.outstanding[i] += 1
        self.sent[i] += 1
        self._last_pick[i] = next(self._tick)
        try:
            return await self.replicas[i].generate(request)
        except BaseException as e:
            if _is_dead_actor_error(e):
                self.dead.add(i)
            raise
        finally:
            self.outstanding[i] -= 1

    def replace(self, index: int, replica: ReplicaClient) -> None:
        """Put `replica` (a restarted one) at `index` and back into rotation."""
        self.replicas[index] = replica
        self.dead.discard(index)

    @property
    def live(self) -> int:
        return len(self.replicas) - len(self.dead)
