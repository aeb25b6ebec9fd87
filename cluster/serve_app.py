"""The OpenAI-compatible service on Ray Serve: one deployment per cache configuration, one HTTP ingress.

    python -m cluster.serve_app --model embedded --cache full --cache scissorhands:5 --port 8000

* `EngineDeployment`: a thin Serve wrapper around `replica.continuous.ServingReplica` (the
  continuous-batching engine on its own thread). Each Serve replica loads the model once and runs
  one engine with the deployment's cache configuration. `events(request)` yields the engine's
  typed token events (`StreamChunk`s, then the `GenerationResult`); `generate(request)` answers a
  `ReplicaReply` (the result and the replica's figures). Serve cancels a stream when the HTTP client
  goes away, and the replica then aborts the request (its KV row is freed at the next engine step). `check_health` fails when the engine
  thread died, so Serve replaces the replica; a replica process that dies mid-stream ends its open
  streams with an error event (`replica.openai_api`).
* `OpenAIIngress`: FastAPI (`replica.openai_api.build_app`) with the tokenizer, routing each
  request by its `model` field to that cache's deployment handle.
* Back-pressure is Serve's: `max_ongoing_requests` per engine replica (the engine's own queue
  holds what memory does not admit yet), `max_queued_requests` per deployment beyond which Serve
  raises `BackPressureError` (answered 503 + `Retry-After`); the ingress also answers 429 past
  `max_pending_requests` in flight per model.

Model ids: `<model name>:<cache label>`, e.g. `smollm2-135m-instruct:full` and
`smollm2-135m-instruct:scissorhands-x5`. Binds 127.0.0.1 unless `--host` says otherwise.

Authentication, as vLLM's `--api-key`: with `--api-key` (or `$SCISSORHANDS_API_KEY`) every `/v1/*` request
needs `Authorization: Bearer <key>` (401 otherwise); the key reaches the ingress only as its SHA-256
(`replica.openai_api.ApiKey`), so no Serve config, log or record holds it. Binding beyond loopback without a
key refuses to start (exit 2) unless `--allow-unauthenticated` says so.

Metrics: `main` starts Ray with its dashboard (so its metrics agent exports Ray Serve's own
``ray_serve_*`` metrics and the replicas' ``ray_scissorhands_*`` ones) under `SERVE_RAY_TEMP_DIR`,
whose service-discovery file `dashboards/prometheus.yml` reads (docs/monitoring.md).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import typing
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster import loopback
from cluster.dtype_probe import resolve_run_dtype
from cluster.serve_routing import SESSION_KEY, StreamHolderRouter
from cluster.signals import StopSignals
from replica import cpu_share
from replica.backends.openvino import BackendUnavailable, check_available
from replica.common.session_affinity import keeps_session_state
from replica.common.types import (
    BUDGETS,
    ENGINES,
    KV_LAYOUTS,
    KV_LIMIT_FIELDS,
    SCHEDULERS,
    EngineConfig,
    GenerationRequest,
    GenerationResult,
)
from replica.continuous import ReplicaReply, ServingReplica, openai_event
from replica.model_loading import model_context_tokens
from replica.openai_api import API_KEY_ENV, DEFAULT_MAX_BODY_BYTES, ApiKey, build_app, cache_metadata
from replica.openvino_settings import OPENVINO_POLICIES
from scissorhands import POLICIES
from scissorhands.models import load_tokenizer, model_id_of

APP_NAME = "scissorhands-openai"
DEFAULT_MAX_LENGTH_TOKENS = 2048
DEFAULT_KV_MEMORY_LIMIT_BYTES = 1 << 30
#: Root folder of `make serve`'s Ray (``$RAY_TMPDIR`` wins). Its dashboard writes
#: ``<this>/prom_metrics_service_discovery.json`` (`dashboards.serve.SERVE_SD_FILE`), so Prometheus scrapes
#: this Ray's node: Serve's own metrics and the replicas' live metrics. A folder of its own, not /tmp/ray
#: nor the sweep's /tmp/scissorhands-ray: every Ray head re-points its root's service-discovery link.
SERVE_RAY_TEMP_DIR = "/tmp/scissorhands-serve"
#: Ray's metrics export interval (ms): the scrape interval of dashboards/prometheus.yml.
METRICS_REPORT_INTERVAL_MS = "5000"


@serve.deployment(
    max_ongoing_requests=64,
    max_queued_requests=256,
    health_check_period_s=5,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=5,
    request_router_config=RequestRouterConfig(request_router_class=StreamHolderRouter),  # `finish` to its holder
)
class EngineDeployment:
    """One Serve replica: a `ServingReplica` running one cache configuration.

    The HTTP service passes `engine_config` at construction; the serving sweep configures every
    running replica before each point (`configure`, `cluster.replica_set.ServeReplicaSet.broadcast`).
    """

    def __init__(
        self,
        model_id: str,
        model_spec: str,
        engine_config: EngineConfig | dict | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        num_threads: int | None = None,
        dtype_reason: str | None = None,
    ):
        import ray

        loopback.setup_worker()  # before Serve starts this replica's gRPC server
        ctx = serve.get_replica_context()
        self.replica = ServingReplica(
            model_spec=model_spec,
            dtype=dtype,
            device=device,
            num_threads=num_threads,
            replica_id=f"{model_id}#{ctx.replica_tag if ctx else 0}",
            node_id=ray.get_runtime_context().get_node_id(),
            dtype_reason=dtype_reason,
        )
        if engine_config is not None:
            self.replica.configure(engine_config)

    def configure(self, engine_config: EngineConfig | dict, run_id: str | None = None) -> dict:
        """A new engine with `engine_config` (`ServingReplica.configure`); returns the replica's `info()`."""
        return self.replica.configure(engine_config, run_id)

    async def events(self, request: GenerationRequest, session_key: str | None = None):
        """`ServingReplica.events`: one request's `StreamChunk`s, then its `GenerationResult` (typed across Ray).
        `session_key`: read by the router only (`cluster.serve_routing`: the session's replica first)."""
        async for ev in self.replica.events(request):
            yield ev

    async def generate(self, request: GenerationRequest, session_key: str | None = None) -> ReplicaReply:
        """One request, answered whole, with the replica's figures after it (`ServingReplica.stats`, its
        ``node_id`` and ``hostname``), so the caller learns every replica's figures from the replies it gets.
        `session_key`: read by the router only (`cluster.replica_set.LeastOutstandingRouter`)."""
        result = await self.replica.generate(request)
        stats = {**await self.replica.stats(), "node_id": self.replica.node_id, "hostname": socket.gethostname()}
        return ReplicaReply(result, stats)

    async def check(self, prompt_tokens: int, max_new_tokens: int, logprobs: bool = False) -> str | None:
        return await self.replica.check(prompt_tokens, max_new_tokens, logprobs)

    def finish(self, request_id: str, replica_tag: str | None = None) -> None:
        """`ServingReplica.finish`: `request_id` ends as completed (a stop string). `replica_tag` is this
        replica's, read from the stream's chunks: `cluster.serve_routing.StreamHolderRouter` routes by it."""
        self.replica.finish(request_id)

    async def stats(self) -> dict:
        return await self.replica.stats()

    def cpu_sample(self) -> dict:
        """This replica process's CPU counters now (`replica.cpu_share.sample`), with its ``replica_id``: a point
        measures the CPU its replicas got between two of these."""
        return {"replica_id": self.replica.replica_id, **cpu_share.sample().as_dict()}

    def info(self) -> dict:
        return self.replica.info()

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return self.replica.max_batch_for(prompt_tokens, max_new_tokens)

    def check_health(self) -> None:
        loop = self.replica.loop
        if loop is not None and not loop.alive:  # None only while `configure` swaps engines
            raise RuntimeError(f"engine thread stopped: {loop and loop.error}")

    def crash(self) -> None:
        """Exit the replica's process at once (tests of replica death mid-stream)."""
        self.replica.crash()


class ServeBackend:
    """A cache configuration's deployment handle as a `replica.openai_api.Backend`."""

    def __init__(self, handle, metadata: dict):
        self.handle, self.metadata = handle, metadata
        self.stream_handle = handle.options(stream=True)
        self.holders: dict[str, str] = {}  # request id -> tag of the replica streaming it, while it streams

    async def check(self, prompt_tokens: int, max_new_tokens: int, logprobs: bool = False) -> str | None:
        return await self.handle.check.remote(prompt_tokens, max_new_tokens, logprobs)

    async def stream(self, request: GenerationRequest):
        """The deployment's typed events of `request` in the OpenAI API's form (`replica.continuous.openai_event`)."""
        affinity = keeps_session_state(self.metadata.get("kv_reuse"), self.metadata.get("enable_prefix_caching"))
        key = request.session_id if affinity else None  # the session's replica holds its state
        gen = self.stream_handle.events.remote(request, **({SESSION_KEY: key} if key else {}))
        finished = False
        try:
            async for ev in gen:
                finished = isinstance(ev, GenerationResult)
                if ev.replica_id and request.request_id not in self.holders:
                    self.holders[request.request_id] = ev.replica_id.rpartition("#")[2]
                yield openai_event(ev)
        finally:
            self.holders.pop(request.request_id, None)
            if not finished:
                gen.cancel()  # the replica's generator closes: the engine aborts (completed if `finish` came first)

    async def finish(self, request_id: str) -> None:
        """End `request_id` as completed on the replica that streams it (`EngineDeployment.finish`, routed there by
        `cluster.serve_routing.StreamHolderRouter`); called before the stream is closed. Nothing when no chunk has
        named its replica yet (the close then aborts it)."""
        tag = self.holders.get(request_id)
        if tag is not None:
            await self.handle.finish.remote(request_id, tag)


@serve.deployment(max_ongoing_requests=1024)
@serve.ingress()
class OpenAIIngress:
    """The HTTP front: tokenizes, validates and routes by `model` to the engine deployments."""

    def __init__(
        self,
        handles: dict,
        metadata: dict,
        tokenizer_spec: str | None,
        max_pending_requests: int = 256,
        context_tokens: int | None = None,
        api_key: ApiKey | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        loopback.setup_worker()  # before Serve starts this replica's gRPC server
        self.handles, self.metadata = handles, metadata
        self.tokenizer_spec, self.max_pending_requests = tokenizer_spec, max_pending_requests
        self.context_tokens, self.api_key, self.max_body_bytes = context_tokens, api_key, max_body_bytes

    def __serve_build_asgi_app__(self):
        tokenizer = None
        if self.tokenizer_spec is not None:
            tokenizer = load_tokenizer(self.tokenizer_spec)
        backends = {m: ServeBackend(h, self.metadata[m]) for m, h in self.handles.items()}
        return build_app(
            backends,
            tokenizer,
            context_tokens=self.context_tokens,
            max_pending_requests=self.max_pending_requests,
            api_key=self.api_key,
            max_body_bytes=self.max_body_bytes,
        )


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to any interface


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """Refuse to serve beyond loopback without a key. Raises ValueError naming `--host`, `--api-key`,
    `$SCISSORHANDS_API_KEY` and `--allow-unauthenticated`."""
    if api_key or allow_unauthenticated or is_loopback(host):
        return
    raise ValueError(
        f"--host {host} serves beyond this machine, and no API key is set: anyone who reaches the port would be "
        f"served. Give --api-key KEY (or ${API_KEY_ENV}), or pass --allow-unauthenticated to serve without one"
    )


#: What makes ``engine: openvino`` runnable here: the runtime in this venv and the embedded model's export.
OPENVINO_TARGETS = "make openvino-runtime openvino-peer"
#: `make serve`'s caches without ``--cache``, per ``--engine``: each engine's full cache and its eviction at x5.
DEFAULT_CACHES = {"ours": ["full", "scissorhands:5"], "openvino": ["full", "openvino_eviction:5"]}


def split_engine(spec: str, engine: str = "ours") -> tuple[str, str]:
    """``[<engine>/]<cache>`` -> (engine, cache): ``openvino/full`` -> ("openvino", "full"); no prefix: `engine`.

    Raises:
        ValueError: an unknown engine, naming `--cache` and `replica.common.types.ENGINES`.
    """
    named, sep, cache = spec.rpartition("/")
    engine = named if sep else engine
    if engine not in ENGINES:
        raise ValueError(f"--cache: unknown engine {engine!r} in {spec!r} (accepted: {', '.join(ENGINES)})")
    return engine, cache


def parse_cache(
    spec: str, max_length_tokens: int, budget: str = "per_request", engine: str = "ours"
) -> tuple[str, dict]:
    """`full`, `<policy>:<ratio>` (e.g. `scissorhands:5`) or `<policy>:b<budget>`, optionally after an engine
    (``openvino/full``, ``openvino/openvino_eviction:5``; none: `engine`) -> (label, EngineConfig fields, without
    the layout and the memory limit, which `build_serve_app` adds to every cache).

    On our engine a ratio under ``budget="per_request"`` (the default) gives each request its own budget,
    ``B_i = ceil((prompt_i + max_new_i) / ratio)``, so a short request evicts as a long one does; under
    ``"fixed"`` every request gets ``B = ceil(max_length_tokens / ratio)``, sized for the longest. A
    ``b<budget>`` is that fixed budget for every request.

    On engine ``openvino`` (policies `replica.openvino_settings.OPENVINO_POLICIES`) the label starts with
    ``openvino-`` unless the policy says it; ``openvino_eviction:<ratio>`` is one ``max_cache_size`` for every
    sequence (``ceil(max_length_tokens / ratio)`` rounded up to its 32-token block, `budget` ignored: the
    pipeline has no per-request budget) and ``openvino_eviction:b<tokens>`` is that ``max_cache_size``.

    Raises:
        ValueError: naming `--cache` and the accepted forms, or `--budget` and its values.
    """
    if budget not in BUDGETS:
        raise ValueError(f"--budget: expected one of {', '.join(BUDGETS)}, got {budget!r}")
    engine, spec = split_engine(spec, engine)
    policy, _, arg = spec.partition(":")
    accepted = POLICIES if engine == "ours" else OPENVINO_POLICIES
    if policy not in accepted:
        raise ValueError(
            f"--cache: engine {engine!r} has no policy {policy!r} in {spec!r} (accepted: {', '.join(accepted)})"
        )
    prefix = "" if engine == "ours" or policy.startswith("openvino") else "openvino-"
    base = {"policy": policy} if engine == "ours" else {"policy": policy, "engine": engine}
    if policy == "full" or (engine == "ours" and not POLICIES[policy].evicts):
        return prefix + policy, base
    try:
        if arg.startswith("b"):
            size = int(arg[1:])
            if engine == "openvino":
                return f"{policy}-b{size}", {**base, "policy_params": {"max_cache_size": size}, "budget": "fixed"}
            return f"{policy}-b{size}", {**base, "budget_tokens": size}
        ratio = float(arg)
    except ValueError:
        raise ValueError(
            f"--cache: {spec!r}: expected {policy}:<ratio> (e.g. {policy}:5) or {policy}:b<budget>"
        ) from None
    label = f"{prefix}{policy}-x{ratio:g}"
    if engine == "openvino":
        return label, {**base, "compression_ratio": ratio, "max_length_tokens": max_length_tokens, "budget": "fixed"}
    if budget == "per_request":
        return label, {**base, "compression_ratio": ratio, "budget": "per_request"}
    return label, {**base, "compression_ratio": ratio, "max_length_tokens": max_length_tokens}


#: The engine knobs `make serve` sets itself (its own defaults: the paged layout, a budget per request, the scheduler
#: that suits the layout, `DEFAULT_KV_MEMORY_LIMIT_BYTES`); every other knob of `replica.common.types.EngineConfig` is a flag
#: generated from its field (`engine_knob_flags`: ``--max-num-batched-tokens``, ``--block-tokens``, ...).
SERVE_SETS = ("kv_layout", "budget", "scheduler", *KV_LIMIT_FIELDS)


def _flag_bool(text: str) -> bool | str:
    """``true`` / ``false`` (any case) as a bool; anything else as given, for `EngineConfig` to refuse by name."""
    return {"true": True, "false": False}.get(text.lower(), text)


def engine_knob_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Add one flag per engine knob not in `SERVE_SETS` (``--<field-name>``, its type and default from
    `EngineConfig.knobs`, checked by `EngineConfig` itself); return the knobs' names (the parsed args' attributes)."""
    names = []
    for name, (annotation, info) in EngineConfig.knobs(exclude=SERVE_SETS).items():
        args = (annotation, *typing.get_args(annotation))
        kind = (
            _flag_bool if bool in args else float if float in args else str if str in args else int
        )  # str: a choice (--engine), checked by the config
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            # a switch not given is left out, so what implies it decides (--kv-reuse shared_prefix: the prefix cache)
            default=None if kind is _flag_bool else info.default,
            help=f"every engine's {name} (replica.common.types.EngineConfig; default {info.default})",
        )
        names.append(name)
    return names


def serve_engine_config(
    spec: str,
    *,
    max_length_tokens: int = DEFAULT_MAX_LENGTH_TOKENS,
    kv_memory_limit_bytes: int | None = DEFAULT_KV_MEMORY_LIMIT_BYTES,
    kv_layout: str = "paged",
    budget: str = "per_request",
    scheduler: str | None = None,
    **knobs: Any,
) -> tuple[str, dict, int | None]:
    """One `--cache` spec -> (label, EngineConfig fields, fixed budget or None): `parse_cache`'s fields plus the
    KV layout and memory limit every cache of the service shares, and `knobs`, any other field of
    `replica.common.types.EngineConfig` (``block_tokens=32``; one not given keeps EngineConfig's default; ``engine`` is
    the engine of a spec without an ``<engine>/`` prefix).
    The default is the engine people serve with: the paged layout (blocks taken as a sequence grows, the newest
    sequence preempted when the pool runs out), a ratio's budget per request, and on it the mixed scheduler (one
    token budget a step: decodes first, then prompt chunks; `scheduler` None picks mixed on the paged layout,
    prefill_first on the preallocated one). The fields are validated here (`EngineConfig`), so a bad combination
    fails at start, naming the field (the paged layout needs a memory limit; mixed needs the paged layout).

    Raises:
        ValueError: a bad spec, `--kv-layout`, `--budget`, `--scheduler`, or engine config.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"--kv-layout: expected one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
    label, cfg = parse_cache(spec, max_length_tokens, budget, knobs.pop("engine", "ours"))
    if scheduler is None:
        scheduler = "mixed" if kv_layout == "paged" else "prefill_first"
    knobs = {k: v for k, v in knobs.items() if v is not None}  # a flag not given: EngineConfig's default
    cfg = {**knobs, **cfg, "kv_layout": kv_layout, "kv_memory_limit_bytes": kv_memory_limit_bytes}
    cfg["scheduler"] = scheduler
    try:
        return label, cfg, EngineConfig(**cfg).resolved_budget_tokens()  # validates now, names the field
    except ValueError as e:
        raise ValueError(_named_by_cache(str(e), spec)) from None


#: `EngineConfig` fields a `--cache` spec sets (its policy, ratio or b<budget>): an error in one is the spec's.
_SPEC_FIELDS = ("policy", "policy_params", "compression_ratio", "budget_tokens")


def _named_by_cache(message: str, spec: str) -> str:
    """An `EngineConfig` refusal of a field `spec` set, named as ``--cache`` and the spec with its accepted forms
    (``--cache: 'openvino/openvino_eviction:0': compression_ratio: expected a number >= 1 ...; accepted: ...``);
    a refusal of another field (a flag's) is left as it is."""
    field = message.partition(":")[0].split(".")[0]
    if field not in _SPEC_FIELDS:
        return message
    policy = spec.rpartition("/")[2].partition(":")[0]
    forms = f"{policy}:<ratio> (a number >= 1, e.g. {policy}:5) or {policy}:b<tokens>"
    if spec.startswith("openvino/") or policy == "openvino_eviction":
        forms += " (b<tokens>: its max_cache_size, a multiple of 32 above start_size + recent_size, 64)"
    return f"--cache: {spec!r}: {message}; accepted: {forms}"


def build_serve_app(
    model_spec: str,
    caches: list[str],
    *,
    model_name: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    num_threads: int | None = 1,
    replica_cpus: float = 1.0,
    replica_gpus: float = 0.0,
    num_replicas: int = 1,
    max_pending_requests: int = 256,
    tokenizer_spec: str | None | Any = "auto",
    deployment_options: dict | None = None,
    api_key: str | ApiKey | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    **engine_options,
):
    """The Serve application: one `EngineDeployment` per entry of `caches` behind one `OpenAIIngress`.

    `engine_options` are `serve_engine_config`'s keywords, shared by every cache: by default each runs on the
    paged layout under `kv_memory_limit_bytes`, a ratio's budget per request. The ingress learns the model's context
    (`replica.model_loading.model_context_tokens`: a chat without `max_tokens` runs to it),
    `api_key` only as its digest (`ApiKey`), and the body limit `max_body_bytes`.

    `dtype` is resolved once here, for every deployment and replica (`cluster.dtype_probe.resolve_run_dtype`, in
    this process on `num_threads` torch threads): with `auto` resolved per replica, the full cache and
    Scissorhands could run in different dtypes and their comparison would be unfair.

    A cache on engine ``openvino`` (``openvino/full``, or every cache under ``engine="openvino"``) runs OpenVINO
    GenAI's pipeline in its Serve replica (`replica.backends.openvino`); its runtime and the model's export are
    checked here, before anything is deployed.

    Raises:
        ValueError: a bad `--cache` spec or engine config (the message names the field).
        BackendUnavailable: a cache on engine ``openvino`` without its runtime or export (`check_available`; the
            message names the make target).
    """

    name = model_name or model_id_of(model_spec).split("/")[-1].lower()
    configs = [(spec, *serve_engine_config(spec, **engine_options)) for spec in caches]  # bad input fails first
    if any(cfg.get("engine") == "openvino" for _, _, cfg, _ in configs):
        check_available(model_spec)  # before Ray: a missing runtime or export names its make target
    resolved = resolve_run_dtype(model_spec, dtype, device, num_threads=num_threads)  # once for all deployments
    handles, metadata = {}, {}
    for spec, label, cfg, budget_tokens in configs:
        model_id = f"{name}:{label}"
        if model_id in handles:
            raise ValueError(f"--cache: {spec!r} repeats the model {model_id!r}")
        opts = dict(
            name=f"engine-{label}",
            num_replicas=num_replicas,
            ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        )
        opts.update(deployment_options or {})
        handles[model_id] = EngineDeployment.options(**opts).bind(  # the config crosses Ray typed
            model_id,
            model_spec,
            EngineConfig(**cfg),
            resolved["dtype"],
            device,
            num_threads,
            resolved.get("dtype_reason"),
        )
        metadata[model_id] = cache_metadata(cfg, budget_tokens, model_spec)
    if tokenizer_spec == "auto":
        tokenizer_spec = None if model_spec == "tiny-llama" else model_spec
    key = ApiKey(api_key) if isinstance(api_key, str) else api_key
    return OpenAIIngress.options(ray_actor_options={"num_cpus": 0}).bind(
        handles, metadata, tokenizer_spec, max_pending_requests, model_context_tokens(model_spec), key, max_body_bytes
    )


def start(app, *, host: str = "127.0.0.1", port: int = 8000, route_prefix: str = "/"):
    """Start Serve's HTTP proxy on `host:port` and deploy `app` (Ray must be initialized)."""
    serve.start(http_options={"host": host, "port": port})
    return serve.run(app, name=APP_NAME, route_prefix=route_prefix, blocking=False)


def init_ray(num_cpus: float):
    """Start a local Ray on loopback for the service, with its dashboard on a free 127.0.0.1 port (8265
    when free) and its files under `SERVE_RAY_TEMP_DIR`, exporting metrics every 5 s
    (``$RAY_metrics_report_interval_ms`` wins). Without the dashboard's dependencies it starts without
    it, after one line: the service runs, its metrics do not reach Prometheus."""
    import socket

    import ray

    os.environ.setdefault("RAY_metrics_report_interval_ms", METRICS_REPORT_INTERVAL_MS)
    port = 0
    for preferred in (8265, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", preferred))
            except OSError:
                continue
            port = s.getsockname()[1]
            break
    try:
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            num_cpus=num_cpus,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=port,
            _temp_dir=None if os.environ.get("RAY_TMPDIR") else SERVE_RAY_TEMP_DIR,
        )
    except Exception as e:  # noqa: BLE001 - metrics are optional; the service is not
        ray.shutdown()
        print(
            f"serve: Ray's dashboard did not start ({type(e).__name__}: {str(e)[:200]}); running without it: "
            "no Serve or replica metrics in Prometheus",
            file=sys.stderr,
        )
        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=num_cpus, include_dashboard=False)
    return ray


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.serve_app", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded", help="model spec (embedded, an HF id or folder)")
    p.add_argument(
        "--cache",
        action="append",
        help="[<engine>/]full | <policy>:<ratio> | <policy>:b<budget> (repeat); e.g. openvino/full, "
        "openvino/openvino_eviction:5 beside scissorhands:5 (no prefix: --engine's)",
    )
    p.add_argument("--host", default="127.0.0.1", help="beyond loopback needs --api-key or --allow-unauthenticated")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"every /v1/* request needs 'Authorization: Bearer <key>' (default: ${API_KEY_ENV}; prefer it: "
        "a flag shows in the process list)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve beyond loopback without an API key (anyone who reaches the port is served)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 before they are parsed",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max-length-tokens",
        type=int,
        default=None,
        help="only with --budget fixed or an OpenVINO eviction cache: the longest prompt + output a ratio's budget "
        f"is sized for (B = ceil(this / ratio); default {DEFAULT_MAX_LENGTH_TOKENS})",
    )
    p.add_argument(
        "--budget",
        default="per_request",
        choices=list(BUDGETS),
        help="a ratio's budget: per_request (B_i = ceil((prompt_i + max_tokens_i) / ratio)) or fixed (one B, "
        "from --max-length-tokens)",
    )
    p.add_argument(
        "--kv-layout",
        default="paged",
        choices=list(KV_LAYOUTS),
        help="paged (one block pool of the KV limit, taken as sequences grow) or preallocated (each request "
        "reserves its final length)",
    )
    p.add_argument(
        "--scheduler",
        default=None,
        choices=list(SCHEDULERS),
        help="a step's work: mixed (one token budget, decodes first, then prompt chunks; the default on the paged "
        "layout) or prefill_first (whole prompts, then a decode step; the default on the preallocated layout)",
    )
    knobs = engine_knob_flags(p)
    p.add_argument("--kv-memory-limit-bytes", type=int, default=DEFAULT_KV_MEMORY_LIMIT_BYTES, help="per engine")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per engine replica")
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--replica-gpus", type=float, default=0.0)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' dtype; auto: bfloat16 where this machine runs it faster (scissorhands.models.resolve_dtype)",
    )
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--pid-file", default=None, help="write this process's id here (make serve-down)")
    args = p.parse_args(argv)
    try:
        check_exposure(args.host, args.api_key, args.allow_unauthenticated)
        if args.engine not in ENGINES:
            raise ValueError(f"--engine: expected one of {', '.join(ENGINES)}, got {args.engine!r}")
        caches = args.cache or DEFAULT_CACHES[args.engine]
        if args.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes: expected an integer >= 1, got {args.max_body_bytes}")
        sized_by_length = args.budget == "fixed" or any(
            split_engine(c, args.engine)[0] == "openvino" for c in caches
        )  # OpenVINO's max_cache_size is one size for every sequence
        if args.max_length_tokens is not None and not sized_by_length:
            raise ValueError(
                f"--max-length-tokens: sizes the one budget of --budget fixed; under --budget {args.budget} each "
                "request's budget comes from its own prompt + max_tokens, so drop it or pass --budget fixed"
            )
        app = build_serve_app(
            args.model,
            caches,
            max_length_tokens=args.max_length_tokens or DEFAULT_MAX_LENGTH_TOKENS,
            kv_memory_limit_bytes=args.kv_memory_limit_bytes,
            kv_layout=args.kv_layout,
            budget=args.budget,
            scheduler=args.scheduler,
            **{k: getattr(args, k) for k in knobs},
            dtype=args.dtype,
            device=args.device,
            num_threads=args.num_threads,
            replica_cpus=args.replica_cpus,
            replica_gpus=args.replica_gpus,
            num_replicas=args.num_replicas,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
        )
    except ValueError as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2
    except BackendUnavailable as e:
        print(f"serve: {e}; `{OPENVINO_TARGETS}` makes both", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(str(os.getpid()))
    try:
        init_ray(max(os.cpu_count() or 1, len(caches) * args.replica_cpus * args.num_replicas))
        stop = StopSignals()
        start(app, host=args.host, port=args.port)
        print(
            f"serve: OpenAI-compatible API on http://{args.host}:{args.port}/v1 (models: "
            f"GET /v1/models; {'a bearer API key required' if args.api_key else 'no API key'}); "
            "Ctrl-C or `make serve-down` stops it",
            flush=True,
        )
        stop.wait()
    finally:
        print("serve: shutting down", flush=True)
        serve.shutdown()
        ray.shutdown()
        if args.pid_file and os.path.exists(args.pid_file):
            os.remove(args.pid_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
