"""The replicas a serving point runs on, behind one interface (`ReplicaPool`): a Ray Serve deployment
(`ServeReplicaPool`), one in-process replica (`LocalReplicaPool`, tests and benchmarks), or any
OpenAI-compatible server over HTTP (`HTTPTargetPool`). `client()` is the load generator's client of them all.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Protocol

from cluster.replica_set import ServeReplicaSet, app_name_for
from cluster.serve_app import EngineDeployment
from cluster.serve_routing import SESSION_KEY
from replica import cpu_share
from replica.common.session_affinity import keeps_session_state, session_replica
from replica.common.types import EngineConfig, GenerationRequest, GenerationResult
from replica.continuous import ServingReplica
from workloads.load.driver import error_kind
from workloads.load.http_client import API_KEY_ENVS, OpenAIHTTPClient, env_api_key

#: Seconds a pool waits, when a point ends, for its replicas to drop the requests the load generator gave up on
#: (each aborted at the engine's next step), so the point's replica figures count them failed and the next point
#: starts on idle replicas.
SETTLE_S = 10.0
SETTLE_POLL_S = 0.02


def settled(read: Callable[[], list[dict]], timeout_s: float = SETTLE_S) -> list[dict]:
    """`read()` (every replica's stats) once no replica runs or queues a request, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = read()
        busy = any(s.get("running_sequences") or s.get("queued_requests") for s in stats)
        if not busy or time.monotonic() > deadline:
            return stats
        time.sleep(SETTLE_POLL_S)


class ReplicaPool(Protocol):
    """What the sweep needs from its replicas (a Serve deployment, one in-process replica for tests, or an
    HTTP server): `client()` is the one load-generator client of them all (the routing is theirs)."""

    def start(self) -> list[dict]: ...
    def configure(self, engine_config: EngineConfig, run_id: str | None = None) -> None: ...
    def client(self): ...
    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int: ...
    def stats(self, reset: bool = False) -> list[dict]: ...
    def cpu_samples(self) -> dict[str, dict]: ...
    def restart_dead(self) -> list[str]: ...
    def close(self) -> None: ...


def _keeps_state(engine_config: EngineConfig | dict) -> bool:
    """Whether the engine keeps a session's state across its turns (so the turns go to its session's replica)."""
    get = engine_config.get if isinstance(engine_config, dict) else lambda k, d=None: getattr(engine_config, k, d)
    return keeps_session_state(get("kv_reuse", "none"), get("enable_prefix_caching", False))


def mark_affinity(result: GenerationResult, session_id: str | None, replica_ids: list[str], tag_of=str) -> None:
    """Set `result.session_affinity_hit`: whether the replica that served it (`tag_of(result.replica_id)`) is its
    session's (`session_replica` over `replica_ids`). Nothing for a request of no session or a result of no
    replica."""
    if session_id is not None and result.replica_id is not None and replica_ids:
        result.session_affinity_hit = tag_of(result.replica_id) == session_replica(session_id, replica_ids)


class LocalClient:
    """The load generator's client of a `LocalReplicaPool`'s replicas: a turn of a session goes to its session's
    replica when the engine keeps session state (`affinity`; `replica.common.session_affinity`), any other request
    to the replica with the fewest requests in flight (ties: the first)."""

    def __init__(self, replicas: list[ServingReplica], affinity: bool):
        self.replicas, self.affinity = replicas, affinity
        self.by_id = {r.replica_id: r for r in replicas}
        self.in_flight = {r.replica_id: 0 for r in replicas}

    def _pick(self, request: GenerationRequest) -> ServingReplica:
        if self.affinity and request.session_id is not None:
            return self.by_id[session_replica(request.session_id, list(self.by_id))]
        return self.by_id[min(self.in_flight, key=self.in_flight.get)]

    def _mark(self, request: GenerationRequest, result: GenerationResult) -> None:
        if self.affinity:
            mark_affinity(result, request.session_id, list(self.by_id))

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        replica = self._pick(request)
        self.in_flight[replica.replica_id] += 1
        try:
            result = await replica.generate(request)
        finally:
            self.in_flight[replica.replica_id] -= 1
        self._mark(request, result)
        return result

    async def events(self, request: GenerationRequest):
        replica = self._pick(request)
        self.in_flight[replica.replica_id] += 1
        try:
            async for ev in replica.events(request):
                if isinstance(ev, GenerationResult):
                    self._mark(request, ev)
                yield ev
        finally:
            self.in_flight[replica.replica_id] -= 1


class LocalReplicaPool:
    """`n` `ServingReplica`s in this process (each its engine on a thread of its own, ids ``local-0``...); for tests
    and the benchmark. With several, `client()` routes a session's turns to its session's replica when the engine
    keeps session state (`LocalClient`)."""

    def __init__(
        self,
        n: int,
        model_spec: str,
        dtype: str = "auto",
        device: str = "cpu",
        model=None,
        num_threads: int | None = None,
        dtype_reason: str | None = None,
    ):
        if n < 1:
            raise ValueError(f"replicas: expected an integer >= 1, got {n}")
        self.n = n
        self.kwargs = dict(
            model_spec=model_spec, dtype=dtype, device=device, num_threads=num_threads, dtype_reason=dtype_reason
        )
        self.model = model
        self.replicas: list[ServingReplica] = []
        self.affinity = False

    @property
    def replica(self) -> ServingReplica | None:
        """The first replica (the only one of a one-replica pool)."""
        return self.replicas[0] if self.replicas else None

    def start(self) -> list[dict]:
        # without a given model the replica loads its own (with its tokenizer's EOS and the run's dtype reason)
        self.replicas = [
            ServingReplica(replica_id=f"local-{i}", model=self.model, **self.kwargs) for i in range(self.n)
        ]
        return [self.replica.info()]

    def configure(self, engine_config: EngineConfig, run_id: str | None = None) -> None:
        for r in self.replicas:
            r.configure(engine_config, run_id)
        self.affinity = self.n > 1 and _keeps_state(engine_config)

    def client(self):
        return self.replica if self.n == 1 else LocalClient(self.replicas, self.affinity)

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return self.replica.max_batch_for(prompt_tokens, max_new_tokens)

    def cpu_samples(self) -> dict[str, dict]:
        """{replica id: this process's `replica.cpu_share.sample`} (the replicas run here)."""
        return {r.replica_id: cpu_share.sample().as_dict() for r in self.replicas}

    def stats(self, reset: bool = False) -> list[dict]:
        """Each replica's figures once it is idle (`settled`: the requests given up on aborted and counted)."""
        settled(lambda: [asyncio.run(r.stats()) for r in self.replicas])
        return [{**asyncio.run(r.stats(reset)), "node_id": r.node_id} for r in self.replicas]

    def restart_dead(self) -> list[str]:
        return []

    def close(self) -> None:
        for r in self.replicas:
            r.shutdown()


class ServeClient:
    """The load generator's client of a serving deployment: each request goes through the deployment
    handle (Serve picks the replica), as the `GenerationRequest` dataclass itself; each answer is a
    `replica.continuous.ReplicaReply`, whose `replica_stats` are kept per replica in `stats` (the latest
    of each, by requests answered) and whose `result` goes to the load generator. A call that fails
    because its replica died is counted in `died` and raised to the load generator. A call the load
    generator gives up on (its `request_timeout_s`) is cancelled in Serve: the replica aborts it."""

    def __init__(self, handle, replica_tags: list[str] | None = None):
        self.handle = handle
        self.stats: dict[str, dict] = {}
        self.died = 0
        self.cancelled = 0  # calls given up on: their replicas' figures are not in any reply
        # the running replicas' tags when the engine keeps session state (a session's turns go to its replica:
        # `cluster.serve_routing`), else None
        self.replica_tags = replica_tags

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        key = request.session_id if self.replica_tags else None
        response = self.handle.generate.remote(request, **({SESSION_KEY: key} if key else {}))
        try:
            reply = await response
        except asyncio.CancelledError:  # awaiting alone leaves it running on the replica
            response.cancel()
            self.cancelled += 1
            raise
        except Exception as e:
            if error_kind(e) == "replica_died":
                self.died += 1
            raise
        stats = reply.replica_stats
        seen = self.stats.get(stats["replica_id"])
        if seen is None or _answered(stats) >= _answered(seen):
            self.stats[stats["replica_id"]] = stats
        if self.replica_tags:
            mark_affinity(reply.result, key, self.replica_tags, tag_of=lambda rid: rid.rpartition("#")[2])
        return reply.result


def _answered(stats: dict) -> int:
    return sum(
        stats.get(k, 0)
        for k in ("completed_requests", "failed_requests", "warmup_completed_requests", "warmup_failed_requests")
    )


class ServeReplicaPool:
    """The suite's replicas as one Ray Serve deployment (`cluster.replica_set.ServeReplicaSet` of
    `cluster.serve_app.EngineDeployment`): a point's engine configuration is broadcast to every running
    replica (each builds the new engine); Serve routes the requests and replaces a replica that died (the
    next point configures it). Per-replica figures come back with each reply (`ServeClient`)."""

    def __init__(
        self,
        n: int,
        *,
        model_spec: str,
        dtype: str,
        device: str,
        placement=None,
        num_cpus: float,
        num_gpus: float,
        num_threads: int | None,
        run_id: str | None = None,
        dtype_reason: str | None = None,
    ):
        self.rset = ServeReplicaSet(
            EngineDeployment,
            dict(model_id="serving", model_spec=model_spec, dtype=dtype, device=device, dtype_reason=dtype_reason),
            n,
            placement,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            num_threads=num_threads,
            app_name=app_name_for("serving", run_id),
            max_ongoing_requests=100_000,
            what="serving replica(s)",
        )
        self.n = n
        self._client: ServeClient | None = None

    def start(self) -> list[dict]:
        """Deploy and wait (at most ``placement.ready_timeout_s``) until every replica has loaded its model.

        Raises:
            PlacementError: no node can ever hold a replica, or not every replica was placed and loaded in
                time (the message gives what is free and the alive nodes).
            RuntimeError: a replica's own load error (e.g. FileNotFoundError naming the path).
        """
        handle = self.rset.start()
        self._client = ServeClient(handle)
        return [handle.info.remote().result()]

    def configure(self, engine_config: EngineConfig, run_id: str | None = None) -> None:
        infos = self.rset.broadcast("configure", engine_config, run_id)
        tags = sorted(rid.rpartition("#")[2] for rid in infos) if self.n > 1 and _keeps_state(engine_config) else None
        self._client = ServeClient(self.rset.handle, tags)

    def client(self) -> ServeClient:
        return self._client

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return int(self.rset.handle.max_batch_for.remote(prompt_tokens, max_new_tokens).result())

    def cpu_samples(self) -> dict[str, dict]:
        """{replica id: that replica process's own `replica.cpu_share.sample`} (one cheap call to each)."""
        return self.rset.broadcast("cpu_sample")

    def stats(self, reset: bool = False) -> list[dict]:
        """Every replica's latest figures from the replies; after calls given up on (whose replicas answered
        nothing), asked of every replica once it is idle (`settled`), so the aborted requests count as failed."""
        client = self._client
        if client.cancelled:
            fresh = settled(lambda: list(self.rset.broadcast("stats").values()))
            for s in fresh:
                client.stats[s["replica_id"]] = {**client.stats.get(s["replica_id"], {}), **s}
            client.cancelled = 0
        out = [client.stats[k] for k in sorted(client.stats)]
        if reset:
            client.stats.clear()
        return out

    def restart_dead(self) -> list[str]:
        """How many calls of this point found their replica dead (as ``"<n> replica call(s)"``; Serve
        replaces the replica), after waiting (at most ``ready_timeout_s``) for the deployment to run again."""
        died, self._client.died = self._client.died, 0
        if died:
            self.rset.wait_running(self.rset.placement.ready_timeout_s)
        return [f"{died} request(s) on a dead replica"] if died else []

    def close(self) -> None:
        self.rset.shutdown()


class HTTPTargetPool:
    """The OpenAI-compatible server at `target` as the sweep's pool (ours from `make serve`, or any
    other): it only checks that `model` is served; the server's cache configuration is its own, so
    `configure` changes nothing and the records carry the served model's `/v1/models` metadata."""

    #: the server's caches hold what earlier points sent (`configure` builds no engine): a sessions point's reuse
    #: check (`workloads.serving.reuse`) cannot bound what a turn may find cached
    caches_outlive_points = True

    def __init__(self, target: str, model: str, timeout_s: float = 30.0):
        self.target, self.model, self.timeout_s = target.rstrip("/"), model, timeout_s
        self.metadata: dict = {}

    def start(self) -> list[dict]:
        import requests

        key = env_api_key()
        try:
            reply = requests.get(
                f"{self.target}/models",
                headers={"Authorization": f"Bearer {key}"} if key else {},
                timeout=self.timeout_s,
            )
            served = None if reply.status_code in (401, 403) else reply.json()["data"]
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"target: no OpenAI-compatible server answered GET {self.target}/models: {e}") from None
        if served is None:
            raise RuntimeError(
                f"target: {self.target} wants an API key ({'the one given was refused' if key else 'none given'}): "
                f"set ${' or $'.join(API_KEY_ENVS)}"
            )
        ids = [m.get("id") for m in served]
        if self.model not in ids:
            raise RuntimeError(
                f"model: {self.model!r} is not served at {self.target} (served: {', '.join(map(str, ids))})"
            )
        self.metadata = next(m for m in served if m.get("id") == self.model).get("metadata") or {}
        return [{"replica_id": self.target, "served_model": self.model, **self.metadata}]

    def configure(self, engine_config: EngineConfig, run_id: str | None = None) -> None:
        pass

    def client(self):
        return OpenAIHTTPClient(f"{self.target}", self.model, session_per_request=True)

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        raise RuntimeError("target: max_batch needs our replicas' memory model, not an HTTP server")

    def cpu_samples(self) -> dict[str, dict]:
        """None: another server's processes are not ours to measure (its points record no CPU share)."""
        return {}

    def stats(self, reset: bool = False) -> list[dict]:
        return [{"replica_id": self.target, "served_model": self.model, **self.metadata}]

    def restart_dead(self) -> list[str]:
        return []

    def close(self) -> None:
        pass
