"""The types a replica's engine speaks: its config, a request, and the result it returns.

Every caller (the engine, the replicas, the load generator, the HTTP client, the Serve app) imports
them from here, so a request is typed the same at both ends.

`EngineConfig` is declared here once: the serving and frontier suites and `make serve` take its knobs from it
(`EngineConfig.knobs`: each field's type, check and default), so an engine knob is one field here and its reading
in the engine. The KV memory limit is one typed value, `KVMemoryLimit` (bytes | fraction of device memory |
full-cache sequences), resolved to bytes in one place (`KVMemoryLimit.resolve_bytes`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Mapping

import psutil
import torch
from pydantic import Field, field_validator, model_validator

from replica.common.rules import (
    FrozenConfig,
    PositiveInt,
    Section,
    at_most_one,
    check_choice,
    check_fraction,
    check_number,
    checked,
    need_one_of,
)
from replica.openvino_settings import BACKEND_KV_PRECISIONS, OPENVINO_POLICIES, eviction_from_policy
from scissorhands import POLICIES, budget_from_ratio, cache_policy
from scissorhands.batching import sequence_slot_bytes
from scissorhands.checks import check_int

__all__ = [
    "ConfigError",
    "EngineConfig",
    "KVMemoryLimit",
    "device_memory_bytes",
    "full_rows_kv_bytes",
    "GREEDY_BELOW_TEMPERATURE",
    "GenerationRequest",
    "GenerationResult",
    "MAX_LOGPROBS",
    "OUTCOMES",
    "REFUSAL_KINDS",
    "Refusal",
]

KV_LAYOUTS = ("preallocated", "paged")
BUDGETS = ("fixed", "per_request")
SCHEDULERS = ("prefill_first", "mixed")
#: The engine backends a replica runs (`replica.backends.BACKENDS`): our engine, or OpenVINO GenAI's
#: ContinuousBatchingPipeline in process (`replica.backends.openvino`).
ENGINES = ("ours", "openvino")
#: `EngineConfig.kv_reuse`: how a request reuses KV computed by an earlier one (`replica.engine.session_state`)
KV_REUSES = ("none", "session_state", "shared_prefix")
_Count = Annotated[int, checked(check_int, 1)]
_CountOrNone = Annotated[int | None, checked(check_int, 1, optional=True)]
#: The `EngineConfig` field of each form of `KVMemoryLimit` (at most one given; none: no limit).
KV_LIMIT_FORMS = {
    "bytes": "kv_memory_limit_bytes",
    "fraction": "kv_memory_fraction",
    "full_sequences": "kv_limit_full_sequences",
}
#: The ways to give the engine its KV memory limit (at most one; none: no limit).
KV_LIMIT_FIELDS = tuple(KV_LIMIT_FORMS.values())
#: The `EngineConfig` fields each point of a suite sets itself (the policy, its budget, the workload's longest
#: request); every other field is a knob a front door takes from its user (`EngineConfig.knobs`).
PER_POINT_FIELDS = ("policy", "policy_params", "budget_tokens", "compression_ratio", "max_length_tokens")


def _one_of(accepted: tuple[str, ...]) -> Any:
    """A string field that takes one of `accepted` (``<field>: expected one of a, b, got 'c'``)."""
    return Annotated[str, checked(check_choice, accepted)]


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of `device` (bytes): the GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(psutil.virtual_memory().total)


def full_rows_kv_bytes(model, rows: int, length_tokens: int) -> int:
    """The bytes `rows` full-cache rows of `length_tokens` slots need: ``rows * length_tokens * slot_bytes``, with
    the bytes per slot (all layers, bookkeeping included) of the full cache preallocating `length_tokens` per row,
    measured on `model` as loaded, so in its dtype (a float32 slot holds about twice a bfloat16 one's bytes).

    What ``KVMemoryLimit(full_sequences=N)`` resolves to when an engine is built (the suites'
    ``kv_memory_limit: {full_sequences: N}``, `length_tokens` their longest prompt + longest output).

    Raises:
        ValueError: `rows` or `length_tokens` below 1 (the message names it).
    """
    check_int("rows", rows, 1)
    check_int("length_tokens", length_tokens, 1)
    return rows * length_tokens * sequence_slot_bytes(model, "full", max_length=length_tokens)


class ConfigError(ValueError):
    """An invalid `EngineConfig`: one line per wrong field, each naming it and what it accepts."""


class KVMemoryLimit(Section):
    """One KV memory limit (a replica's, or a suite's ``kv_memory_limit``): exactly one of

    * ``bytes: N``: an absolute limit, the same bytes in every dtype (so about twice the rows in bfloat16);
    * ``fraction: F``: F in (0, 1] of the device's memory (the GPU's total, or the machine's RAM);
    * ``full_sequences: N``: the bytes N full-cache sequences of the workload's longest prompt + output need, in the
      model's own dtype (``N x length x slot_bytes`` of the full cache preallocating that length per row). A slot
      holds about twice the bytes in float32 as in bfloat16, so "room for N full sequences" holds whichever dtype
      ``auto`` picks.

    `resolve_bytes` turns it into bytes (the one place that does); `EngineConfig` carries it as its three fields
    (`KV_LIMIT_FORMS`: ``kv_memory_limit_bytes``, ``kv_memory_fraction``, ``kv_limit_full_sequences``) and gives it
    back as `EngineConfig.kv_limit`. Records carry the resolved bytes (``kv_memory_limit_bytes``) and
    ``kv_limit_full_sequences`` (None for bytes).

    Raises:
        ValueError (through the suite's or config's loader): none or several of the three, or one out of range.
    """

    section: ClassVar[str] = "kv_memory_limit"
    form: ClassVar[str] = (
        "{full_sequences: N} or {bytes: N} (N a whole number >= 1), or {fraction: F} (F a number in (0, 1])"
    )
    full_sequences: PositiveInt | None = None
    bytes: PositiveInt | None = None
    fraction: Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "KVMemoryLimit":
        if sum(v is not None for v in (self.full_sequences, self.bytes, self.fraction)) != 1:
            raise ValueError(
                "kv_memory_limit: give exactly one of full_sequences (how many full-cache sequences of the suite's "
                "longest prompt + output it holds, in the run's dtype) or bytes (an absolute limit), each a whole "
                "number >= 1, or fraction (of the device's memory, a number in (0, 1]); "
                f"got {self.model_dump(exclude_none=True) or 'neither'}"
            )
        return self

    def engine_fields(self) -> dict[str, int | float | None]:
        """The limit as `EngineConfig`'s three fields (the one given set, the others None)."""
        return {name: getattr(self, form) for form, name in KV_LIMIT_FORMS.items()}

    def resolve_bytes(self, model, device: torch.device, max_length_tokens: int | None) -> int:
        """The limit in bytes on `model` (as loaded, so in its dtype) on `device`.

        ``full_sequences``: ``N * max_length_tokens * slot_bytes``, the bytes per slot (all layers, bookkeeping
        included) of the full cache preallocating `max_length_tokens` per row (`scissorhands.batching.
        sequence_slot_bytes`); ``fraction``: of `device_memory_bytes`; ``bytes``: as given.

        Raises:
            ValueError: ``full_sequences`` without `max_length_tokens` >= 1 (the message names it).
        """
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            return int(self.fraction * device_memory_bytes(device))
        check_int("max_length_tokens", max_length_tokens, 1)
        return full_rows_kv_bytes(model, self.full_sequences, max_length_tokens)


class EngineConfig(FrozenConfig):
    """What a replica's engine runs: the cache policy and budget, and the memory it may use.

    A frozen pydantic model (`replica.common.rules.FrozenConfig`): ``EngineConfig(**fields)`` validates every
    field, `model_dump()` gives the mapping back; it crosses Ray as this model. Fields are attributes
    (``cfg.max_batch``); ``EngineConfig(**cfg.model_dump())`` rebuilds it.

    Declared once: every field but `PER_POINT_FIELDS` is a knob that the serving and frontier suites and
    `make serve` take from here (`knobs`: its type, check and default), so a knob is declared in this class only.

    Attributes:
        policy: a key of `scissorhands.POLICIES`.
        policy_params: the policy's keyword parameters.
        budget_tokens: slots per KV head per sequence (B); wins over `compression_ratio`.
        compression_ratio: `B = ceil(max_length_tokens / ratio)`, raised to the policy's floor (`min_budget_tokens`) and
            protected windows (`scissorhands.budget_from_ratio`); needs `max_length_tokens`.
        max_length_tokens: the longest prompt + output of the workload (tokens): fixes B for a ratio;
            with the full cache every row preallocates it (decode writes in place, no regrowth).
        kv_memory_limit_bytes: the KV memory the running batch may hold (bytes).
        kv_memory_fraction: else this fraction (0..1] of the device's memory (GPU total, or RAM).
        kv_limit_full_sequences: else the bytes this many full-cache rows of `max_length_tokens` slots need
            in the model's own dtype (`replica.engine.full_rows_kv_bytes`), resolved when the engine is built,
            so "room for N full sequences" holds in float32 and bfloat16 alike; needs `max_length_tokens`.
            None of the three: no memory limit; more than one: an error. The three are one typed value,
            `kv_limit` (a `KVMemoryLimit`), resolved to bytes by `kv_memory_limit_bytes_on`.
        max_batch: most sequences running at once (None: only memory limits).
        kv_layout: ``"preallocated"`` (each row reserves its final length up front, padded to the batch's
            longest row: the paper's setting) or ``"paged"`` (one pool of blocks sized to the memory limit,
            taken as sequences grow, newest sequence preempted and recomputed when it runs out, as vLLM;
            `scissorhands.paged`); paged needs one of the three limits above.
        block_tokens: slots per block of the paged layout (per KV head).
        budget: ``"fixed"`` (every sequence gets B from `budget_tokens`, or from `compression_ratio` of
            `max_length_tokens`) or ``"per_request"`` (each request ``B_i = ceil((prompt_i + max_new_i) / ratio)``, floored alike:
            a short request does not reserve the longest one's budget); per_request needs `compression_ratio`
            and a policy that evicts, and takes no `budget_tokens`.
        max_prefill_tokens: most prompt tokens prefilled in one step (bounds the stall of running
            sequences and a prefill's activation memory); a longer single prompt is still
            prefilled, alone. The default keeps up to 4 prompts of 1,024 tokens in one prefill, where
            prefilling them together costs no more per prompt (docs/performance.md). Read by
            ``scheduler: prefill_first`` only.
        scheduler: ``"prefill_first"`` (a step prefills whole prompts, up to `max_prefill_tokens`, then runs one
            decode step: running sequences wait while prompts prefill) or ``"mixed"`` (one token budget per
            step, `max_num_batched_tokens`: every running sequence's decode token first, then chunks of
            waiting prompts filling the rest, as vLLM V1 and Sarathi-Serve schedule); mixed needs
            ``kv_layout: paged`` (a prompt's chunks take blocks as they arrive).
        max_num_batched_tokens: the token budget of one step under ``scheduler: mixed`` (decode tokens +
            prompt-chunk tokens); at least one block (`block_tokens`). The default, 512, is `make bench-scheduler`'s
            pick on the embedded model: the lowest Scissorhands ITL p99 among budgets within 10% of prefill-first's
            output tok/s (docs/results/2026-12-04-mixed-scheduler.md).
        engine: the backend that runs the requests (`replica.backends.BACKENDS`): ``"ours"`` (this package's
            engine) or ``"openvino"`` (OpenVINO GenAI's ContinuousBatchingPipeline in process, the embedded model's
            export; `replica.backends.openvino`). ``openvino`` runs policy ``full`` or ``openvino_eviction``
            (``policy_params``: aggregation_mode SUM | NORM_SUM, start_size, recent_size, max_cache_size, tokens,
            multiples of its 32-token block; a compression_ratio gives max_cache_size as ours gives B, rounded up to
            a block), needs ``kv_layout: paged``, ``scheduler: mixed`` and a KV memory limit.
        openvino_kv_precision: ``"u8"`` (OpenVINO's CPU default, with per-block scales) or ``"bf16"`` (about twice
            the bytes a token); the KV limit's bytes become its blocks at this precision.
        enable_prefix_caching: share full blocks of prompt tokens across requests (`replica.engine.prefix_cache`,
            vLLM's automatic prefix caching): a request skips the prefill of the cached blocks its prompt starts
            with. Off by default; on needs engine ``"ours"``, ``kv_layout: paged`` and a policy that keeps every
            token (``full``), or ``kv_reuse: shared_prefix`` (which turns it on) for a budgeted policy.
        kv_reuse: how a request of a session reuses the KV cache an earlier request computed, for any policy
            (a budgeted one included): ``"none"`` (default: every request prefills its prompt) or
            ``"session_state"`` (Sparse-vLLM's "chain" mode, `replica.engine.session_state`): when a request with a
            `GenerationRequest.session_id` completes, its row's cache (compressed, for a budgeted policy) is kept
            in the block pool while the session is idle, reclaimed least recently used when the pool needs blocks;
            the session's next request whose prompt starts with that request's prompt + generated tokens prefills
            only the tokens past them. Needs engine ``"ours"``, ``kv_layout: paged``, ``budget: fixed`` and
            ``enable_prefix_caching: false``. Or ``"shared_prefix"`` (TensorRT-LLM's TriAttention way,
            `replica.engine.prefix_cache`): the whole full blocks of a request's prompt (at most
            ``floor((prompt - 1) / block_tokens)``) stay uncompressed and are shared through the prefix cache; only
            what follows them is compressed, so a budgeted row holds at most ``P + B`` slots (``P`` its pinned
            prefix, shared). It turns ``enable_prefix_caching`` on (true or left out; false is refused) and needs
            engine ``"ours"`` and ``kv_layout: paged``; for the full cache it is ``enable_prefix_caching: true``.

    Raises:
        ConfigError (a ValueError): an unknown key, or a field out of range; the message names
            each field and the values it accepts.
    """

    error: ClassVar[type[ValueError]] = ConfigError

    policy: str = "full"
    policy_params: dict[str, Any] = Field(default_factory=dict)
    budget_tokens: _CountOrNone = None
    compression_ratio: Annotated[float | None, checked(check_number, 1, optional=True)] = None
    max_length_tokens: _CountOrNone = None
    kv_memory_limit_bytes: _CountOrNone = None
    kv_memory_fraction: Annotated[float | None, checked(check_fraction, optional=True)] = None
    kv_limit_full_sequences: _CountOrNone = None
    max_batch: _CountOrNone = None
    max_prefill_tokens: _Count = 4096
    kv_layout: _one_of(KV_LAYOUTS) = "preallocated"
    budget: _one_of(BUDGETS) = "fixed"
    block_tokens: _Count = 16
    scheduler: _one_of(SCHEDULERS) = "prefill_first"
    max_num_batched_tokens: _Count = 512
    engine: _one_of(ENGINES) = "ours"
    openvino_kv_precision: _one_of(BACKEND_KV_PRECISIONS) = "u8"
    enable_prefix_caching: bool = False
    kv_reuse: _one_of(KV_REUSES) = "none"

    @field_validator("policy", mode="before")
    @classmethod
    def _known_policy(cls, value: Any) -> str:
        # which engine runs it is checked with the whole config (`_engine_runs_the_policy`)
        if not isinstance(value, str) or (value not in POLICIES and value not in OPENVINO_POLICIES):
            raise ValueError(f"policy: unknown policy {value!r}; valid policies: {', '.join(POLICIES)}")
        return value

    @field_validator("enable_prefix_caching", mode="before")
    @classmethod
    def _a_bool(cls, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"enable_prefix_caching: expected true or false, got {value!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _shared_prefix_turns_the_prefix_cache_on(cls, data: Any) -> Any:
        # kv_reuse: shared_prefix shares its pinned prompt blocks through the prefix cache: it implies the knob
        if isinstance(data, Mapping) and data.get("kv_reuse") == "shared_prefix":
            value = data.get("enable_prefix_caching", True)
            if value is not True:
                raise ValueError(
                    "enable_prefix_caching: kv_reuse 'shared_prefix' shares prompt blocks through the prefix cache, "
                    f"so it turns enable_prefix_caching on; accepted: true or left out (got {value!r}), or kv_reuse: "
                    f"{', '.join(r for r in KV_REUSES if r != 'shared_prefix')} without it"
                )
            data = {**data, "enable_prefix_caching": True}
        return data

    @field_validator("policy_params", mode="before")
    @classmethod
    def _mapping(cls, value: Any) -> dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"policy_params: expected a mapping, got {value!r}")
        return dict(value)

    @model_validator(mode="after")
    def _engine_runs_the_policy(self) -> "EngineConfig":
        if self.engine == "ours":
            if self.policy not in POLICIES:
                raise ValueError(
                    f"policy: {self.policy!r} runs on engine: openvino only; engine 'ours' runs {', '.join(POLICIES)}"
                )
            return self
        if self.policy not in OPENVINO_POLICIES:
            raise ValueError(
                f"policy: engine 'openvino' runs {', '.join(OPENVINO_POLICIES)}, not {self.policy!r} "
                "(ours runs the others)"
            )
        if self.kv_layout != "paged" or self.scheduler != "mixed":
            raise ValueError(
                "kv_layout: engine 'openvino' is paged with split-fuse scheduling (32-token blocks, one token budget a "
                "step); give kv_layout: paged and scheduler: mixed so both engines are configured alike"
            )
        if self.budget != "fixed":
            raise ValueError("budget: engine 'openvino' has one max_cache_size for every sequence; accepted: fixed")
        if self.policy == "full":
            if self.policy_params or self.compression_ratio is not None or self.budget_tokens is not None:
                raise ValueError("policy_params: the full cache of engine 'openvino' takes no parameters nor budget")
        elif self.budget_tokens is not None:
            raise ValueError(
                "budget_tokens: openvino_eviction takes policy_params.max_cache_size (tokens) or a compression_ratio"
            )
        else:
            eviction_from_policy(self.policy_params, self.compression_ratio, self.max_length_tokens)
        return self

    @model_validator(mode="after")
    def _budget_and_limit(self) -> "EngineConfig":
        at_most_one(self, *KV_LIMIT_FIELDS, what="give one KV memory limit, not several")
        if self.kv_layout == "paged" and all(getattr(self, f) is None for f in KV_LIMIT_FIELDS):
            raise ValueError(
                "kv_layout: 'paged' sizes its block pool from kv_memory_limit ({full_sequences: N}, {bytes: N} or "
                "{fraction: F}: kv_memory_limit_bytes, kv_memory_fraction or kv_limit_full_sequences); give one"
            )
        if self.scheduler == "mixed" and self.kv_layout != "paged":
            raise ValueError(
                "scheduler: 'mixed' feeds prompts in chunks that take KV blocks as they arrive; it needs "
                f"kv_layout: 'paged' (got {self.kv_layout!r})"
            )
        if self.scheduler == "mixed" and self.max_num_batched_tokens < self.block_tokens:
            raise ValueError(
                f"max_num_batched_tokens: {self.max_num_batched_tokens} is below one block (block_tokens: "
                f"{self.block_tokens}); give at least {self.block_tokens}"
            )
        if self.kv_limit_full_sequences is not None and self.max_length_tokens is None:
            raise ValueError(
                "max_length_tokens: kv_limit_full_sequences sizes the limit from full-cache rows of the workload's "
                "longest prompt + output (tokens); give it"
            )
        if self.kv_reuse == "shared_prefix" and (self.engine != "ours" or self.kv_layout != "paged"):
            raise ValueError(
                "kv_reuse: 'shared_prefix' shares uncompressed prompt blocks through the prefix cache of engine 'ours' "
                f"with kv_layout: 'paged'; accepted: {', '.join(KV_REUSES)} (got engine {self.engine!r}, kv_layout "
                f"{self.kv_layout!r})"
            )
        budgeted = self.engine == "ours" and POLICIES[self.policy].evicts and self.kv_reuse != "shared_prefix"
        if self.enable_prefix_caching and (self.engine != "ours" or self.kv_layout != "paged" or budgeted):
            raise ValueError(
                "enable_prefix_caching: true shares the full cache's prompt blocks on engine 'ours' with kv_layout: "
                "'paged' and policy 'full' (a budgeted policy's blocks depend on the whole sequence: it shares its "
                "uncompressed prompt prefix with kv_reuse: shared_prefix); accepted: false, or true with those (got "
                f"engine {self.engine!r}, kv_layout {self.kv_layout!r}, policy {self.policy!r}, kv_reuse "
                f"{self.kv_reuse!r})"
            )
        if self.kv_reuse == "session_state" and (
            self.engine != "ours" or self.kv_layout != "paged" or self.budget != "fixed" or self.enable_prefix_caching
        ):
            raise ValueError(
                "kv_reuse: 'session_state' keeps a session's row in the block pool of engine 'ours' with kv_layout: "
                "'paged', budget: 'fixed' and enable_prefix_caching: false; accepted: "
                f"{', '.join(KV_REUSES)} (got engine {self.engine!r}, kv_layout {self.kv_layout!r}, budget "
                f"{self.budget!r}, enable_prefix_caching {self.enable_prefix_caching})"
            )
        if self.engine != "ours":  # its policy and budget: `_engine_runs_the_policy`
            return self
        if self.budget == "per_request":
            if not POLICIES[self.policy].evicts:
                raise ValueError(f"budget: 'per_request' needs a policy that evicts; {self.policy!r} keeps every token")
            if self.budget_tokens is not None or self.compression_ratio is None:
                raise ValueError(
                    "budget: 'per_request' computes each request's budget from compression_ratio; give "
                    "compression_ratio and no budget_tokens"
                )
        elif POLICIES[self.policy].evicts:
            need_one_of(self, "budget_tokens", "compression_ratio", what=f"policy {self.policy!r} needs one of them")
            if self.budget_tokens is None and self.max_length_tokens is None:
                raise ValueError(
                    "max_length_tokens: a compression_ratio needs the workload's longest "
                    "prompt + output (tokens) to fix the budget of every sequence"
                )
        return self

    def resolved_budget_tokens(self) -> int | None:
        """B, slots per KV head per sequence (None for a policy that never evicts, and on engine 'openvino': its
        ``max_cache_size`` is `replica.backends.openvino`'s)."""
        if self.engine != "ours" or not POLICIES[self.policy].evicts or self.budget == "per_request":
            return None
        if self.budget_tokens is not None:
            return self.budget_tokens
        return budget_from_ratio(
            self.max_length_tokens, self.compression_ratio, cache_policy(self.policy, **self.policy_params)
        )

    @property
    def kv_limit(self) -> KVMemoryLimit | None:
        """The KV memory limit as one typed value (None: no limit)."""
        given = {form: getattr(self, name) for form, name in KV_LIMIT_FORMS.items() if getattr(self, name) is not None}
        return KVMemoryLimit(**given) if given else None

    def kv_memory_limit_bytes_on(self, model, device: torch.device) -> int | None:
        """The KV memory limit in bytes for `model` (its dtype) on `device` (`KVMemoryLimit.resolve_bytes`, rows of
        `max_length_tokens`); None without a limit."""
        lim = self.kv_limit
        return None if lim is None else lim.resolve_bytes(model, device, self.max_length_tokens)

    @classmethod
    def knobs(cls, exclude: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
        """The fields a front door takes from its user, as `pydantic.create_model` definitions (the type with its
        check, and the default): every field but `PER_POINT_FIELDS` and `exclude`, in declaration order."""
        skip = set(PER_POINT_FIELDS) | set(exclude)
        return {n: (f.annotation, copy.copy(f)) for n, f in cls.model_fields.items() if n not in skip}


#: A temperature below this samples greedily (vLLM's `_SAMPLING_EPS`): logits / 5e-324 overflow to inf.
GREEDY_BELOW_TEMPERATURE = 1e-5
#: The most alternatives `logprobs` / `prompt_logprobs` may ask for per token (vLLM's default cap).
MAX_LOGPROBS = 20


@dataclass
class GenerationRequest:
    """One request: prompt token ids (never text) and how many tokens to generate.

    Greedy by default. `temperature` > 0 samples from softmax(logits / temperature), restricted to
    the smallest set of tokens whose probability reaches `top_p` (nucleus sampling, Holtzman et
    al. 2020); `seed` makes the draws repeatable (a generator of its own per request, so a
    request's tokens do not depend on its batch neighbours' draws). `min_new_tokens`: EOS is masked
    out of the logits until that many tokens exist (vLLM's `min_tokens`; only when EOS stops it).
    `warmup`: the load generator's warm-up request; the engine counts it apart (`stats()`'s
    ``warmup_*`` keys, live metrics with ``phase="warmup"``), so a point's server-side figures
    cover the same requests as its client-side ones.

    Sampling values every sampler can use, as vLLM maps them: a `temperature` below
    `GREEDY_BELOW_TEMPERATURE` (1e-5) is greedy (dividing logits by it would overflow); `seed` must
    fit in 64 bits (``[-2**63, 2**64)``, the range `torch.Generator.manual_seed` takes).
    `logprobs` (0..`MAX_LOGPROBS`): each generated token's log-probability and that many most
    likely alternatives (`GenerationResult.output_logprobs`). `prompt_logprobs` (0..`MAX_LOGPROBS`):
    each prompt token's log-probability given the tokens before it, the prompt fed as decoding would
    feed it (`replica.sampling.score_prompt`; `GenerationResult.prompt_logprobs`); with it,
    `max_new_tokens` may be 0 (score only). `session_id`: the conversation it belongs to; under
    ``EngineConfig.kv_reuse: session_state`` its row's cache is kept for the session's next request.

    Raises:
        ValueError: a field out of range; the message names it and what it accepts.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0
    warmup: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"prompt_ids: request {self.request_id!r} has an empty prompt")
        if self.session_id is not None and (not isinstance(self.session_id, str) or not self.session_id):
            raise ValueError(f"session_id: expected a non-empty string or null, got {self.session_id!r}")
        check_int("logprobs", self.logprobs, 0, optional=True)
        check_int("prompt_logprobs", self.prompt_logprobs, 0, optional=True)
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(self, name) or 0) > MAX_LOGPROBS:
                raise ValueError(
                    f"{name}: expected an integer in [0, {MAX_LOGPROBS}] or null, got {getattr(self, name)!r}"
                )
        check_int("max_new_tokens", self.max_new_tokens, 0 if self.prompt_logprobs is not None else 1)
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):
            raise ValueError(f"seed: expected a 64-bit integer (in [-2**63, 2**64)) or null, got {self.seed!r}")
        check_int("min_new_tokens", self.min_new_tokens, 0)

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0, or below `GREEDY_BELOW_TEMPERATURE` (vLLM's rule)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass
class GenerationResult:
    """What a replica returns for a request; times are the replica's `clock` (wall clock, seconds).

    `token_times_s[i]` is when `output_ids[i]` was produced; `output_tokens` is `len(output_ids)`.
    `finish_reason`: ``"eos"``, ``"length"``, ``"stop"`` (the client had what it asked, a stop string:
    `ContinuousBatchingEngine.finish`) or ``"error"``. `error_kind`: None (ok), `"rejected"` (cannot fit
    the memory limit even alone), `"aborted"` (the client went away or aborted it), `"oom"` (the device ran
    out of memory), `"error"` (any other exception, a failed sampling of this request's row included;
    `error` holds it). `outcome` is the one classification of both (`OUTCOMES`).
    With the request's `logprobs`: `output_logprobs[i]` is `output_ids[i]`'s log-probability (nats)
    and `output_top_logprobs[i]` its alternatives as ``[[token_id, logprob], ...]``, best first. With
    `prompt_logprobs`: the same per prompt token (`prompt_logprobs[0]` and `prompt_top_logprobs[0]`
    are None: the first token has no context). `cached_prompt_tokens`: prompt tokens its first admission took
    from the prefix cache (`EngineConfig.enable_prefix_caching`), never above its prompt (OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``; a preempted request's recompute counts in the engine's hit
    tokens only); `prefilled_prompt_tokens`: tokens its prefills computed, summed over its prefills (a preempted
    request's recompute, its outputs included, counts again). Under
    ``kv_reuse: session_state``: `session_reused_tokens`, the tokens its prefill took from its session's kept
    state (also in `cached_prompt_tokens`), and `session_recomputed_tokens`, the tokens of the session's previous
    request (its prompt + generated tokens but the last) that its prompt starts with and its prefill computed
    again (the state was reclaimed, or the prompt does not extend it).
    """

    request_id: str
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    received_time_s: float | None = None
    admitted_time_s: float | None = None
    finish_time_s: float | None = None
    finish_reason: str | None = None
    error_kind: str | None = None
    error: str | None = None
    replica_id: str | None = None
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[list[list]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[list] | None] | None = None
    cached_prompt_tokens: int = 0
    prefilled_prompt_tokens: int = 0
    session_reused_tokens: int = 0
    session_recomputed_tokens: int = 0
    # whether the replica that served it is its session's (`replica.common.session_affinity`; set by the caller
    # that routed it when its engine keeps session state, else None)
    session_affinity_hit: bool | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def outcome(self) -> str:
        """How the request ended, one of `OUTCOMES`: ``"stop"`` (EOS, or the client's stop string), ``"length"``
        (its `max_new_tokens`), ``"abort"`` (the client went away or aborted it), ``"error"`` (any failure,
        rejection included); None while it runs. Completed = stop or length: the replica's counters
        (``completed_requests``, ``failed_requests``) and its live metrics' TPOT (completed requests only) count by
        it (`replica.engine.lifecycle.Lifecycle.finished`)."""
        if self.error_kind is not None:
            return "abort" if self.error_kind == "aborted" else "error"
        return {"eos": "stop", "stop": "stop", "length": "length"}.get(self.finish_reason)


#: Every `GenerationResult.outcome`: the first two are completed requests, the others failed ones.
OUTCOMES = ("stop", "length", "abort", "error")


#: Why a request can never be served: longer than the model's context, more than the KV memory limit holds for it
#: alone, a budget the cache policy refuses, or something the engine cannot give (log-probabilities on an engine
#: without them: `ServingReplica.check`'s ``logprobs``) (`Refusal.kind`).
REFUSAL_KINDS = ("context", "kv_memory", "policy", "unsupported")


class Refusal(str):
    """Why a request can never be served (`ContinuousBatchingEngine.fits_alone`, `ServingReplica.check`): the
    message itself (a str, so it reads and compares as one) and `kind`, one of `REFUSAL_KINDS`, so a caller picks
    its answer (the OpenAI API's error code) without reading the text. It crosses processes whole (pickled).

    Raises:
        ValueError: `kind` not one of `REFUSAL_KINDS` (the message names them).
    """

    kind: str

    def __new__(cls, kind: str, message: str) -> "Refusal":
        if kind not in REFUSAL_KINDS:
            raise ValueError(f"kind: expected one of {', '.join(REFUSAL_KINDS)}, got {kind!r}")
        obj = super().__new__(cls, message)
        obj.kind = kind
        return obj

    def __reduce__(self):
        return (Refusal, (self.kind, str(self)))

    def wrapped(self, prefix: str) -> "Refusal":
        """The same refusal with `prefix` before its message."""
        return Refusal(self.kind, prefix + str(self))
