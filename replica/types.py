"""The types a replica's engine speaks: its config, a request, and the result it returns.

Every caller (the engine, the replicas, the load generator, the HTTP client, the Serve app) imports
them from here, so a request is typed the same at both ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Mapping

from pydantic import Field, field_validator, model_validator

from replica.rules import FrozenConfig, at_most_one, check_fraction, check_number, checked, need_one_of
from scissorhands import POLICIES, budget_from_ratio, cache_policy
from scissorhands.checks import check_int

__all__ = [
    "ConfigError",
    "EngineConfig",
    "GREEDY_BELOW_TEMPERATURE",
    "GenerationRequest",
    "GenerationResult",
    "MAX_LOGPROBS",
]

KV_LAYOUTS = ("preallocated", "paged")
BUDGETS = ("fixed", "per_request")
SCHEDULERS = ("prefill_first", "mixed")
_Count = Annotated[int, checked(check_int, 1)]
_CountOrNone = Annotated[int | None, checked(check_int, 1, optional=True)]
#: The ways to give the engine its KV memory limit (at most one; none: no limit).
KV_LIMIT_FIELDS = ("kv_memory_limit_bytes", "kv_memory_fraction", "kv_limit_full_sequences")


class ConfigError(ValueError):
    """An invalid `EngineConfig`: one line per wrong field, each naming it and what it accepts."""


class EngineConfig(FrozenConfig):
    """What a replica's engine runs: the cache policy and budget, and the memory it may use.

    A frozen pydantic model (`replica.rules.FrozenConfig`): ``EngineConfig(**fields)`` validates every
    field, `model_dump()` gives the mapping back.

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
            None of the three: no memory limit; more than one: an error.
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
    kv_layout: str = "preallocated"
    budget: str = "fixed"
    block_tokens: _Count = 16
    scheduler: str = "prefill_first"
    max_num_batched_tokens: _Count = 512

    @field_validator("policy", mode="before")
    @classmethod
    def _known_policy(cls, value: Any) -> str:
        if not isinstance(value, str) or value not in POLICIES:
            raise ValueError(f"policy: unknown policy {value!r}; valid policies: {', '.join(POLICIES)}")
        return value

    @field_validator("policy_params", mode="before")
    @classmethod
    def _mapping(cls, value: Any) -> dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"policy_params: expected a mapping, got {value!r}")
        return dict(value)

    @field_validator("kv_layout", "budget", "scheduler", mode="before")
    @classmethod
    def _one_of(cls, value: Any, info) -> str:
        accepted = {"kv_layout": KV_LAYOUTS, "budget": BUDGETS, "scheduler": SCHEDULERS}[info.field_name]
        if value not in accepted:
            raise ValueError(f"{info.field_name}: expected one of {', '.join(accepted)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _budget_and_limit(self) -> "EngineConfig":
        at_most_one(self, *KV_LIMIT_FIELDS, what="give one KV memory limit, not several")
        if self.kv_layout == "paged" and all(getattr(self, f) is None for f in KV_LIMIT_FIELDS):
            raise ValueError(
                "kv_layout: 'paged' sizes its block pool from kv_memory_limit_bytes, kv_memory_fraction or "
                "kv_limit_full_sequences; give one"
            )
        if self.scheduler == "mixed" and self.kv_layout != "paged":
            raise ValueError(
                "scheduler: 'mixed' feeds prompts in chunks that take KV blocks as they arrive; it needs "
                f"kv_layout: 'paged' (got {self.kv_layout!r})"
            )
        if self.scheduler == "mixed" and self.max_num_batched_tokens < self.block_tokens:
            raise ValueError(
                f"max_num_batched_tokens: {self.max_num_batched_tokens} is below one block ({self.block_tokens} "
                "tokens, block_tokens); give at least block_tokens"
            )
        if self.kv_limit_full_sequences is not None and self.max_length_tokens is None:
            raise ValueError(
                "max_length_tokens: kv_limit_full_sequences sizes the limit from full-cache rows of the workload's "
                "longest prompt + output (tokens); give it"
            )
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
        """B, slots per KV head per sequence (None for a policy that never evicts)."""
        if not POLICIES[self.policy].evicts or self.budget == "per_request":
            return None
        if self.budget_tokens is not None:
            return self.budget_tokens
        return budget_from_ratio(
            self.max_length_tokens, self.compression_ratio, cache_policy(self.policy, **self.policy_params)
        )


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
    `max_new_tokens` may be 0 (score only).

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

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"prompt_ids: request {self.request_id!r} has an empty prompt")
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
    `error_kind`: None (ok), `"rejected"` (cannot fit the memory limit even alone), `"oom"` (the
    device ran out of memory), `"error"` (any other exception, a failed sampling of this request's
    row included; `error` holds it).
    With the request's `logprobs`: `output_logprobs[i]` is `output_ids[i]`'s log-probability (nats)
    and `output_top_logprobs[i]` its alternatives as ``[[token_id, logprob], ...]``, best first. With
    `prompt_logprobs`: the same per prompt token (`prompt_logprobs[0]` and `prompt_top_logprobs[0]`
    are None: the first token has no context).
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

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)
