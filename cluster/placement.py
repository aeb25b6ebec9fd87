"""Placement of model replicas on a Ray cluster: resources, placement group, sharding over GPUs.

A suite may carry a ``placement:`` mapping (all keys optional)::

    placement:
      strategy: SPREAD          # SPREAD | STRICT_SPREAD | PACK | STRICT_PACK (how replicas share nodes)
      num_cpus: 4               # Ray CPUs per replica (default: the sweep's share of the cluster's CPUs)
      num_gpus: 2               # GPUs per replica (default: 1 for device cuda, else 0); > 1 shards the model
      resources: {a100: 1}      # custom Ray resources per replica (node types, fake GPUs in tests)
      gpu_memory_fraction: 0.9  # cap of each GPU's memory given to weights (accelerate max_memory)
      max_memory_per_gpu_bytes: null   # explicit weight cap per GPU (wins over the fraction)
      max_restarts: 2           # the run stops after replicas x (this + 1) replica deaths
      max_task_retries: 1       # a point in flight on a dead replica is queued again this many times
      ready_timeout_s: 600      # wait this long for every replica to be placed and loaded
                                # (default: $SCISSORHANDS_READY_TIMEOUT_S, else 600)

How replicas are placed: every runner's replicas are a Ray Serve deployment
(`cluster.replica_set`, the one replica lifecycle), each replica in **a placement group of its own
with one bundle** holding every resource it asks for (CPUs, GPUs, custom resources). Ray never
splits a bundle across nodes, so a replica with several GPUs always gets them on one node. Across
replicas Serve spreads them over the nodes (``SPREAD``); ``STRICT_SPREAD`` allows one replica per node
(``max_replicas_per_node: 1``); ``PACK``/``STRICT_PACK`` are left to Serve's scheduler. Serve replaces a
replica whose process died; the point it was running is queued again (``max_task_retries``).

A replica that Ray gave several GPUs loads its model on the CPU, plans an accelerate
``device_map`` over exactly those GPUs (``CUDA_VISIBLE_DEVICES`` set by Ray, so ``0..n-1``) with
an explicit ``max_memory`` per GPU (balanced, so every GPU keeps room for its layers' KV cache),
and dispatches the layers; the Scissorhands cache allocates each layer's slots on that layer's
device. Every point records ``node_id``, ``node_ip``, ``accelerator_ids`` (Ray's GPU ids),
``devices`` (the torch devices of the weights) and ``replica_pid``.

This module keeps what does not depend on Serve: the ``placement:`` config, the resource checks
(`fit_share`, `check_fits`, `replica_bundle`), the not-ready message, and the replica's own loading
(`PlacedReplica`, `load_sharded`, `plan_device_map`). Ray is imported lazily so that suites can be
validated without it.
"""

from __future__ import annotations

import math
import os
import time
from typing import Annotated, Any, ClassVar, Mapping

from pydantic import Field, field_validator

from replica.common.rules import FrozenConfig, check_fraction, check_number, checked
from replica.model_loading import load_replica_model
from replica.static_batch import BatchSpec, ModelReplica
from scissorhands.checks import check_int
from scissorhands.models import resolve_dtype

#: Placement-group strategies Ray accepts, in the order the docs list them.
PLACEMENT_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
#: Resource names a suite may not use as custom resources (they have their own keys).
_RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


#: Environment variable of the default bound on waiting for replicas to be placed and loaded (seconds).
READY_TIMEOUT_ENV = "SCISSORHANDS_READY_TIMEOUT_S"
#: Its default: long enough for a large model to load on a GPU node, short of "forever".
DEFAULT_READY_TIMEOUT_S = 600.0


def default_ready_timeout_s() -> float:
    """``$SCISSORHANDS_READY_TIMEOUT_S`` (seconds, > 0), else `DEFAULT_READY_TIMEOUT_S`.

    Raises:
        PlacementError: the variable is set but is not a number > 0.
    """
    text = os.environ.get(READY_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_READY_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise PlacementError(f"{READY_TIMEOUT_ENV}: expected a number of seconds > 0, got {text!r}")
    return value


def fit_share(node_amounts: list[float], replicas: int) -> float:
    """The largest amount of one resource per replica such that `replicas` replicas fit on the
    nodes, a replica never spanning nodes: max c with sum(floor(a / c)) >= replicas over the
    nodes' amounts `a`; 0.0 when no node has any.

    Examples: two 1-CPU nodes, 1 replica -> 1.0 (not the cluster's 2); nodes of 4 and 2 CPUs,
    3 replicas -> 2.0; one 3-CPU node, 2 replicas -> 1.5.
    """
    amounts = [float(a) for a in node_amounts if a and a > 0]
    if not amounts or replicas < 1:
        return 0.0
    candidates = sorted({a / k for a in amounts for k in range(1, replicas + 1)}, reverse=True)
    for c in candidates:
        if sum(math.floor(a / c + 1e-9) for a in amounts) >= replicas:
            return c
    return 0.0


class PlacementError(ValueError):
    """Replicas cannot be placed as asked; the message names the field or the missing resource."""


_AmountOrNone = Annotated[int | float | None, checked(check_number, 0, optional=True)]
_Retries = Annotated[int, checked(check_int, 0)]


class PlacementConfig(FrozenConfig):
    """Resources and placement of each replica (the suite's ``placement:`` mapping).

    Fields: see the module docstring. ``num_cpus``/``num_gpus`` None mean "the sweep decides"
    (a share of the cluster's CPUs; 1 GPU for ``device: cuda``, else 0). A frozen pydantic model
    (`replica.common.rules.FrozenConfig`); an invalid field raises PlacementError naming ``placement.<field>``.
    """

    error: ClassVar[type[ValueError]] = PlacementError
    prefix: ClassVar[str] = "placement"

    strategy: str = "SPREAD"
    num_cpus: _AmountOrNone = None  # an int stays an int (as written in the suite)
    num_gpus: _AmountOrNone = None
    resources: dict[str, float] = Field(default_factory=dict)
    gpu_memory_fraction: Annotated[float, checked(check_fraction)] = 0.9
    max_memory_per_gpu_bytes: Annotated[int | None, checked(check_int, 1, optional=True)] = None
    max_restarts: _Retries = 2
    max_task_retries: _Retries = 1
    ready_timeout_s: Annotated[float, checked(check_number, 0)] = Field(
        default_factory=lambda: default_ready_timeout_s()
    )

    @field_validator("strategy", mode="before")
    @classmethod
    def _strategy(cls, value: Any) -> str:
        if not isinstance(value, str) or value.upper() not in PLACEMENT_STRATEGIES:
            raise ValueError(f"strategy: unknown strategy {value!r} (accepted: {', '.join(PLACEMENT_STRATEGIES)})")
        return value.upper()

    @field_validator("num_gpus")
    @classmethod
    def _whole_gpus(cls, value: float | None) -> float | None:
        if value is not None and value > 1 and value != int(value):
            raise ValueError(f"num_gpus: a replica on several GPUs needs a whole number, got {value:g}")
        return value

    @field_validator("resources", mode="before")
    @classmethod
    def _resources(cls, value: Any) -> dict:
        value = {} if value is None else value
        if not isinstance(value, Mapping):
            raise ValueError(f"resources: expected a mapping of resource name to amount, got {value!r}")
        for name, amount in value.items():
            if not isinstance(name, str) or not name or name in _RESERVED_RESOURCES:
                raise ValueError(
                    f"resources: invalid resource name {name!r} (use num_cpus / num_gpus for "
                    f"{', '.join(_RESERVED_RESOURCES[:2])}; reserved: {', '.join(_RESERVED_RESOURCES)})"
                )
            check_number(f"resources.{name}", amount, 0)
        return {k: float(v) for k, v in value.items()}


def parse_placement(data: Any) -> PlacementConfig:
    """Validate a suite's ``placement:`` mapping (None gives the defaults; a `PlacementConfig` is returned as is).

    Raises:
        PlacementError: not a mapping, unknown key (lists the accepted ones), unknown strategy (lists the
            accepted ones), a negative or non-numeric amount, a fractional GPU count above 1, a reserved
            resource name; the message names ``placement.<field>``.
    """
    return PlacementConfig.parse(data)


def replica_bundle(num_cpus: float, num_gpus: float, resources: Mapping[str, float]) -> dict:
    """The placement-group bundle of one replica: {"CPU": .., "GPU": .., custom: ..} (zeros left out)."""
    bundle = {"CPU": float(num_cpus)}
    if num_gpus:
        bundle["GPU"] = float(num_gpus)
    bundle.update({k: float(v) for k, v in resources.items() if v})
    return {k: v for k, v in bundle.items() if v}


def _alive_nodes(ray) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive", n.get("alive", False))]


def check_fits(bundle: Mapping[str, float], replicas: int, strategy: str, nodes: list[dict]) -> None:
    """Fail fast when no node (or, for STRICT_SPREAD, too few nodes) can ever hold a bundle.

    `nodes` are `ray.nodes()` entries (their total `Resources`). Raises PlacementError naming the
    resource, the amount asked for, and the largest amount any node has.
    """
    fitting = [n for n in nodes if all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in bundle.items())]
    if not fitting:
        short = []
        for k, v in bundle.items():
            most = max((n.get("Resources", {}).get(k, 0.0) for n in nodes), default=0.0)
            if most < v:
                short.append(f"{k}: asks {v:g}, the largest node has {most:g}")
        raise PlacementError(
            f"placement: no node can hold one replica {dict(bundle)} ({'; '.join(short) or 'resources split over nodes'}); "
            "a replica never spans nodes: lower placement.num_gpus / num_cpus / resources or add bigger nodes"
        )
    if strategy == "STRICT_SPREAD" and len(fitting) < replicas:
        raise PlacementError(
            f"placement.strategy: STRICT_SPREAD needs {replicas} nodes that each hold {dict(bundle)}, "
            f"the cluster has {len(fitting)}; use SPREAD or fewer replicas"
        )


# -- sharding a replica over its GPUs ------------------------------------------------------
def gpu_max_memory(
    n_gpus: int, *, fraction: float = 0.9, per_gpu_bytes: int | None = None, totals_bytes: list[int] | None = None
) -> dict[int, int]:
    """Explicit accelerate ``max_memory`` {gpu index: bytes} for GPUs ``0..n_gpus-1``.

    `per_gpu_bytes` wins; otherwise `fraction` of each GPU's total memory (`totals_bytes`, read
    from torch.cuda when None).
    """
    if per_gpu_bytes is not None:
        return {i: int(per_gpu_bytes) for i in range(n_gpus)}
    if totals_bytes is None:
        import torch

        totals_bytes = [torch.cuda.get_device_properties(i).total_memory for i in range(n_gpus)]
    return {i: int(totals_bytes[i] * fraction) for i in range(n_gpus)}


def plan_device_map(model, max_memory: Mapping[int, int]) -> dict[str, int]:
    """An accelerate ``device_map`` (module name -> GPU index) spreading `model` over the GPUs.

    Weights are balanced over the GPUs (`accelerate.utils.get_balanced_memory`, capped by
    `max_memory`) so each GPU keeps free memory for its layers' KV cache; decoder layers are
    never split (`model._no_split_modules`).

    Raises:
        PlacementError: the weights do not fit in `max_memory` (some module would go to the CPU
            or disk); the message gives the weight bytes and the caps.
    """
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    caps = {int(k): int(v) for k, v in max_memory.items()}
    balanced = get_balanced_memory(model, max_memory=dict(caps), no_split_module_classes=no_split)
    balanced = {k: min(int(v), caps[k]) for k, v in balanced.items() if k in caps}
    device_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split)
    if any(d not in caps for d in device_map.values()):
        device_map = infer_auto_device_map(model, max_memory=dict(caps), no_split_module_classes=no_split)
    spilled = sorted(name for name, d in device_map.items() if d not in caps)
    if spilled:
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        raise PlacementError(
            f"placement: the model's weights ({weight_bytes / 2**30:.2f} GiB) do not fit in max_memory "
            f"{ {k: f'{v / 2**30:.2f} GiB' for k, v in caps.items()} }; left over: {', '.join(spilled[:5])}; "
            "raise placement.num_gpus or placement.gpu_memory_fraction / max_memory_per_gpu_bytes"
        )
    return {name: int(d) for name, d in device_map.items()}


def load_sharded(model_spec: str, dtype: str, max_memory: Mapping[int, int]):
    """Load a model on the CPU, then dispatch its layers over GPUs ``0..n-1``.

    Returns ``(model, tokenizer, device_map)``. The model's inputs go to GPU 0 (the embedding);
    accelerate's hooks move activations between GPUs and bring the logits back to GPU 0.
    Raises PlacementError (does not fit), FileNotFoundError (model path missing).
    """
    from accelerate import dispatch_model

    # the weights run on the GPUs: resolve "auto" for them, not for the CPU they are loaded on
    torch_dtype, reason = resolve_dtype(dtype, None, "cuda:0")
    model, tokenizer = load_replica_model(model_spec, dtype=str(torch_dtype).removeprefix("torch."), device="cpu")
    model.scissorhands_dtype_reason = reason if dtype == "auto" else model.scissorhands_dtype_reason
    device_map = plan_device_map(model, max_memory)
    model = dispatch_model(model, device_map=device_map)
    model.eval()
    return model, tokenizer, device_map


class PlacedReplica(ModelReplica):
    """`ModelReplica` inside a Ray Serve replica (`cluster.replica_set.PointReplica`): records where it
    runs; shards over several GPUs.

    Extra args: `gpu_memory_fraction`, `max_memory_per_gpu_bytes` (see `gpu_max_memory`).
    `info()` and every `run_batch` result add `node_id`, `node_ip`, `accelerator_ids`,
    `devices` and `replica_pid`.
    """

    def __init__(
        self,
        *args: Any,
        gpu_memory_fraction: float = 0.9,
        max_memory_per_gpu_bytes: int | None = None,
        **kwargs: Any,
    ):
        import ray

        ctx = ray.get_runtime_context()
        kwargs.setdefault("node_id", ctx.get_node_id())
        self.node_ip = ray.util.get_node_ip_address()
        self.accelerator_ids = [str(i) for i in ctx.get_accelerator_ids().get("GPU", [])]
        self.device_map = None
        self.load_error: BaseException | None = None
        self.replica_id = kwargs.get("replica_id", "replica-0")
        self.node_id = kwargs["node_id"]
        try:
            device = str(kwargs.get("device", "cpu"))
            sharded_load_s = None
            if device.startswith("cuda") and kwargs.get("model") is None:
                import torch

                visible = torch.cuda.device_count()
                if visible > 1:
                    if num_threads := kwargs.get("num_threads"):
                        torch.set_num_threads(int(num_threads))
                    max_memory = gpu_max_memory(
                        visible, fraction=gpu_memory_fraction, per_gpu_bytes=max_memory_per_gpu_bytes
                    )
                    t0 = time.perf_counter()
                    model, tokenizer, self.device_map = load_sharded(
                        kwargs.get("model_spec", "embedded"), kwargs.get("dtype", "auto"), max_memory
                    )
                    sharded_load_s = time.perf_counter() - t0
                    kwargs.update(model=model, tokenizer=tokenizer, device="cuda:0")
            super().__init__(*args, **kwargs)
            if sharded_load_s is not None:  # ModelReplica times only the loads it does itself
                self.live_metrics.observe_model_load(sharded_load_s)
            self.devices = sorted({str(p.device) for p in self.model.parameters()})
        except Exception as e:  # noqa: BLE001 - any load error, raised again from info()/run_batch()
            # Keep the actor alive and raise the original error (e.g. FileNotFoundError naming the
            # model path) from info()/run_batch(): Ray then hands the caller that exception itself
            # instead of an ActorDiedError wrapping a traceback.
            self.load_error = e

    def _raise_load_error(self) -> None:
        if self.load_error is not None:
            raise self.load_error

    def _placement_fields(self) -> dict:
        return {
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "accelerator_ids": list(self.accelerator_ids),
            "devices": list(getattr(self, "devices", [str(self.device)])),
            "replica_pid": os.getpid(),
        }

    def info(self) -> dict:
        self._raise_load_error()
        return {**super().info(), **self._placement_fields(), "device_map_layers": _count_by_device(self.device_map)}

    def apply(self, fn, *args: Any, **kwargs: Any) -> Any:
        self._raise_load_error()
        return super().apply(fn, *args, **kwargs)

    def run_batch(self, point: BatchSpec, _warmup: bool = False) -> dict:
        self._raise_load_error()
        metrics = super().run_batch(point, _warmup=_warmup)
        metrics.update(self._placement_fields())
        return metrics


def _count_by_device(device_map: Mapping[str, int] | None) -> dict | None:
    if not device_map:
        return None
    counts: dict[str, int] = {}
    for d in device_map.values():
        counts[f"cuda:{d}"] = counts.get(f"cuda:{d}", 0) + 1
    return counts


def not_ready_message(ray, n: int, what: str, timeout_s: float | None) -> str:
    """Why `n` replicas are not ready after `timeout_s`: what the cluster has free, its alive nodes."""
    try:
        free = {
            k: round(v, 2)
            for k, v in ray.available_resources().items()
            if not k.startswith(("node:", "bundle_group")) and k not in ("memory", "object_store_memory")
        }
        nodes = [
            {
                k: v
                for k, v in n_.get("Resources", {}).items()
                if k in ("CPU", "GPU") or not (k.startswith("node:") or k in ("memory", "object_store_memory"))
            }
            for n_ in _alive_nodes(ray)
        ]
    except Exception as e:  # noqa: BLE001 - the cluster itself may be gone
        free, nodes = f"unknown ({type(e).__name__})", "unknown"
    return (
        f"placement: {n} {what} not placed and loaded within {timeout_s:g} s (placement.ready_timeout_s, or "
        f"${READY_TIMEOUT_ENV}); free now: {free}; alive nodes: {nodes}. Either the resources each asks for are "
        "held by other work on the cluster and never freed, the node it was on left, or its model did not load "
        "in time (then raise the timeout)"
    )
