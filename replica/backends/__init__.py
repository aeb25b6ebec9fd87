"""The engine backends a replica runs, behind one protocol (`EngineBackend`), by ``EngineConfig.engine``.

`BACKENDS` maps each name of `replica.common.types.ENGINES` to its class: ``ours`` is
`replica.engine.ContinuousBatchingEngine`; ``openvino`` is `replica.backends.openvino.OpenVINOEngine` (OpenVINO
GenAI's ``ContinuousBatchingPipeline`` in this process: plain Python, no Ray). `ServingReplica` builds the
config's backend with `make_engine` and steps it on its thread (`replica.engine.EngineLoop`), so every suite that
serves, `make serve` and the frontier's serving runs take the backend from the config like any other knob.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from replica.backends.openvino import OpenVINOEngine
from replica.common.types import EngineConfig, GenerationRequest, GenerationResult, Refusal
from replica.engine import ContinuousBatchingEngine

__all__ = ["BACKENDS", "EngineBackend", "make_engine"]


class _Wakeable(Protocol):
    def wake(self) -> None: ...


@runtime_checkable
class EngineBackend(Protocol):
    """What a replica and its loop call of an engine (`ContinuousBatchingEngine` is the reference).

    Thread-safety: `submit`, `abort` and `finish` come from any thread; `step` and the rest from the loop's.
    Every request is answered exactly once through its `on_done` (a `GenerationResult`; a failure as
    ``error_kind`` and ``error``), tokens before it through `on_token(token_id, time_s)`.
    """

    config: EngineConfig
    replica_id: str
    #: The KV memory limit the backend holds (bytes; None: no limit).
    kv_memory_limit_bytes: int | None
    budget_tokens: int | None
    slot_bytes: int | None
    #: The waiting queue; `EngineLoop.stop` wakes the loop through it.
    queue: _Wakeable

    def submit(
        self,
        request: GenerationRequest,
        on_done: Callable[[GenerationResult], None],
        on_token: Callable[[int, float], None] | None = None,
    ) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def finish(self, request_id: str) -> None: ...
    def step(self) -> bool:
        """One scheduling iteration; False when there was nothing to do."""
        ...

    def wait_for_work(self, timeout_s: float) -> bool: ...
    def stats(self) -> dict:
        """Counters since `reset_stats`, under the keys of `ContinuousBatchingEngine.stats` (None where the
        backend does not report one)."""
        ...

    def reset_stats(self) -> None: ...
    def fits_alone(self, prompt_tokens: int, max_new_tokens: int) -> Refusal | None:
        """Why a request of these lengths can never run, even alone (None: it can): a `replica.common.types.Refusal` of
        kind ``kv_memory``, ``policy`` or ``context`` (`ServingReplica.check` prefixes it with `Refusal.wrapped`)."""
        ...

    def max_new_tokens_for(self, prompt_tokens: int, most: int) -> int:
        """The most new tokens (at most `most`) a request of `prompt_tokens` may ask and still run alone (0: none);
        a chat without ``max_tokens`` is given this (`ServingReplica.max_new_tokens_for`)."""
        ...

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int) -> int: ...
    def stop_on_fault(self, message: str) -> int: ...
    def abort_all(self, message: str, fault: bool = False) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def queued(self) -> int: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def fault(self) -> str | None: ...


#: ``EngineConfig.engine`` -> the backend's class, each built as ``cls(model, config, eos_token_id=, replica_id=,
#: metrics=)``.
BACKENDS: dict[str, Callable[..., EngineBackend]] = {"ours": ContinuousBatchingEngine, "openvino": OpenVINOEngine}


def make_engine(model, config: EngineConfig, **kwargs) -> EngineBackend:
    """The backend `config.engine` names, on `model` (ours runs it; OpenVINO's sizes its KV limit from it).

    Raises:
        ValueError: from the backend: a config it cannot run.
        BackendUnavailable (`replica.backends.openvino`): its runtime or model export is absent (the message names
            the make target that makes it).
    """
    return BACKENDS[config.engine](model, config, **kwargs)
