"""Serving suites (`kind: serving`): load sweeps against continuously batching replicas.

A serving suite (YAML, read through `workloads.core.suite.load_suite`) asks one question; its `mode`
names the load::

    kind: serving
    name: serving-rate
    description: the question this suite answers
    mode: rate                    # serving-batch | concurrency | rate | max_batch | trace
    model: embedded
    policies: [full, scissorhands]
    compression_ratios: [5]       # B = ceil((max prompt + max new) / ratio) for every sequence
    budget_tokens: []
    loads: [0.5, 1, 2, 4]         # batch sizes | concurrencies | request rates (req/s); not for max_batch
    prompt_tokens: {dist: uniform, min: 128, max: 512}   # or an integer
    new_tokens: {dist: uniform, min: 16, max: 64}        # output length, as in every suite and record
    kv_memory_limit_bytes: 200000000   # or kv_memory_fraction: 0.5 (of device memory); per replica
    max_batch: 64                 # most running sequences per replica
    num_requests: 64              # and/or duration_s; measured requests per point
    warmup_requests: 1
    arrival: poisson              # rate mode: poisson | gamma (with burstiness)
    max_concurrency: null         # rate mode: cap on requests in flight; cap_policy: delay | drop
    saturation: {max_error_rate: 0.05, max_p50_ttft_s: null, min_achieved_rate_fraction: 0.8}
    rounds: 2                     # max_batch mode: requests = rounds x the max batch
    trace_path: traces/azure_code_2023.csv  # trace mode (instead of loads and lengths): arrival time,
    trace_time_scale: 0.5         #   prompt and output tokens per row (docs/load-generation.md)
    replicas: 1

The shared fields (model, policies, budgets, seed, replicas, placement) and their checks are
`workloads.core.suite.SuiteBase`'s. Points are policy x budget x load, in that order, so each
(policy, budget) is a series of increasing load; the series stops (remaining points `skipped`,
stop reason `saturated`) once a point's error rate, p50 TTFT or achieved/target rate shows
saturation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, model_validator

from replica.types import EngineConfig
from workloads.load.loadgen import ARRIVALS, CAP_POLICIES, LengthDist, LoadConfig, TraceLoad
from workloads.core.suite import (Name, NonNegativeInt, PositiveFloat, PositiveInt, SuiteBase, SuiteError, budget_tag,
                             point_id)

SERVING_MODES = ("serving-batch", "concurrency", "rate", "max_batch", "trace")
_LOAD_MODE = {"serving-batch": "batch", "concurrency": "concurrency", "rate": "rate", "max_batch": "batch",
              "trace": "trace"}


class Saturation(BaseModel):
    """When a series stops raising the load (None disables a criterion)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_error_rate: Annotated[float, Field(ge=0, le=1)] | None = 0.05
    max_p50_ttft_s: PositiveFloat | None = None
    min_achieved_rate_fraction: Annotated[float, Field(ge=0, le=1)] | None = 0.8

    def reason(self, rec: dict) -> str | None:
        """Why the point `rec` (a results record) shows saturation, or None."""
        sent = rec.get("sent_requests") or 0
        if self.max_error_rate is not None and sent and (rec.get("failed_requests") or 0) / sent > self.max_error_rate:
            return f"error rate {(rec.get('failed_requests') or 0) / sent:.0%} > {self.max_error_rate:.0%}"
        p50 = rec.get("ttft_p50_s")
        if self.max_p50_ttft_s is not None and p50 is not None and p50 > self.max_p50_ttft_s:
            return f"p50 TTFT {p50:.3g} s > {self.max_p50_ttft_s:g} s"
        # against the arrival times the run drew, not the nominal rate (a small Poisson sample differs)
        target = rec.get("scheduled_rate_req_per_s") or rec.get("target_rate_req_per_s")
        achieved = rec.get("achieved_rate_req_per_s")
        if self.min_achieved_rate_fraction is not None and target and achieved is not None \
                and achieved < self.min_achieved_rate_fraction * target:
            return f"achieved {achieved:.3g} req/s < {self.min_achieved_rate_fraction:.0%} of {target:.3g} req/s scheduled"
        return None


@dataclass(frozen=True)
class ServingPoint:
    """One load level of one (policy, budget) series; `identity` holds every setting that changes
    its numbers, `point_id` is derived from it (see `workloads.core.suite.point_id`)."""

    index: int
    series: str                      # policy + budget: the points of one series share it
    policy: str
    policy_params: dict
    compression_ratio: float | None
    budget_tokens: int | None
    load: float | None               # batch size / concurrency / rate; None for max_batch
    seed: int
    point_id: str
    identity: dict


def _lengths(value: Any, info) -> LengthDist:
    dist = value if isinstance(value, LengthDist) else LengthDist.parse(info.field_name, value)
    dist.upper  # noqa: B018 - bounded, for memory (ValueError naming the field otherwise)
    return dist


Length = Annotated[LengthDist, PlainValidator(_lengths), PlainSerializer(dataclasses.asdict)]
Load = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class ServingSuite(SuiteBase):
    """A validated serving suite (see the module docstring for the YAML form)."""

    kind: Literal["serving"]
    mode: Literal[SERVING_MODES]
    prompt_tokens: Length
    new_tokens: Length
    loads: tuple[Load, ...] = ()
    kv_memory_limit_bytes: PositiveInt | None = None
    kv_memory_fraction: Annotated[float, Field(gt=0, le=1)] | None = None
    max_batch: PositiveInt | None = None
    max_prefill_tokens: PositiveInt = EngineConfig.model_fields["max_prefill_tokens"].default
    num_requests: PositiveInt | None = None
    duration_s: PositiveFloat | None = None
    warmup_requests: NonNegativeInt = 1
    warmup_s: Annotated[float, Field(ge=0)] = 0.0
    request_timeout_s: PositiveFloat | None = None
    arrival: Literal[ARRIVALS] = "poisson"
    burstiness: PositiveFloat = 1.0
    max_concurrency: PositiveInt | None = None
    cap_policy: Literal[CAP_POLICIES] = "delay"
    saturation: Saturation = Field(default_factory=Saturation)
    rounds: PositiveInt = 2
    replicas: PositiveInt = 1
    # HTTP: drive the OpenAI-compatible server at `target` (http://HOST:PORT/v1); `model` is then the
    # served model id and `tokenizer` the model spec whose tokenizer builds the prompts (default embedded)
    target: Annotated[str, Field(pattern=r"^https?://")] | None = None
    tokenizer: Name | None = None
    # trace mode: replay this trace (its rows give arrivals and lengths), time offsets x the scale;
    # the point's `load` is the scale
    trace_path: Name | None = None
    trace_time_scale: PositiveFloat = 1.0

    @property
    def max_length_tokens(self) -> int:
        return self.prompt_tokens.upper + self.new_tokens.upper

    def budget_lengths(self) -> list[int]:
        return [self.max_length_tokens]

    @model_validator(mode="before")
    @classmethod
    def _lengths_from_the_trace(cls, data: Any) -> Any:
        """In trace mode the trace's rows give arrivals and lengths: none of them may be given too."""
        if not isinstance(data, dict) or data.get("mode") != "trace":
            return data
        for k in ("prompt_tokens", "new_tokens", "loads"):
            if data.get(k) is not None:
                raise SuiteError(f"{k}: not used in mode trace (the trace's rows give arrivals and lengths)")
        if data.get("trace_path") is None:
            raise SuiteError("trace_path: mode trace needs a trace file (CSV or JSONL, docs/load-generation.md)")
        prompt, new = TraceLoad(LoadConfig(mode="trace", trace_path=str(data["trace_path"]),
                                           trace_time_scale=data.get("trace_time_scale", 1.0))).length_range()
        return {**data, "prompt_tokens": prompt, "new_tokens": new}

    @model_validator(mode="after")
    def _mode_needs(self) -> "ServingSuite":
        if self.target is not None and self.mode == "max_batch":
            raise SuiteError("target: max_batch mode needs our replicas' memory model; use concurrency, rate or "
                             "serving-batch")
        if self.mode == "max_batch":
            if self.loads:
                raise SuiteError("loads: not used in mode max_batch (the batch is found from the memory limit)")
            if self.kv_memory_limit_bytes is None and self.kv_memory_fraction is None:
                raise SuiteError("kv_memory_limit_bytes: mode max_batch needs a KV memory limit (or kv_memory_fraction)")
            if self.prompt_tokens.dist != "fixed" or self.new_tokens.dist != "fixed":
                raise SuiteError("prompt_tokens, new_tokens: mode max_batch needs fixed lengths (integers)")
        elif self.mode != "trace":
            if not self.loads:
                what = {"rate": "request rates (req/s)", "serving-batch": "batch sizes"}.get(self.mode, "concurrencies")
                raise SuiteError(f"loads: mode {self.mode} needs a non-empty list of {what}")
            if self.mode != "rate" and any(v != int(v) for v in self.loads):
                raise SuiteError(f"loads: mode {self.mode} needs integers, got {list(self.loads)}")
            if list(self.loads) != sorted(self.loads):
                raise SuiteError("loads: must increase (a series stops raising the load at saturation)")
            if self.num_requests is None and self.duration_s is None:
                raise SuiteError("num_requests, duration_s: give at least one bound")
        if self.kv_memory_limit_bytes is not None and self.kv_memory_fraction is not None:
            raise SuiteError("kv_memory_limit_bytes, kv_memory_fraction: give one of them, not both")
        for p in self.points():           # every point's load config must be valid now, not mid-sweep
            self.load_config(p, max_batch=1)
        return self

    def identity(self) -> dict:
        """Suite-level settings that change a serving point's numbers (the load axis aside)."""
        keep = set(type(self).model_fields) - {"kind", "name", "description", "policies", "compression_ratios",
                                                "budget_tokens", "loads", "replicas", "placement", "saturation"}
        return self.model_dump(include=keep, mode="json")

    def points(self) -> list[ServingPoint]:
        out: list[ServingPoint] = []
        loads: list[float | None] = [None] if self.mode == "max_batch" else \
            [self.trace_time_scale] if self.mode == "trace" else list(self.loads)
        base = self.identity()
        for pol in self.policies:
            for ratio, budget in self.budgets(pol):
                series = f"{self.mode}-{pol.tag()}{budget_tag(ratio, budget)}"
                for load in loads:
                    ident = dict(base, policy=pol.name, policy_params=dict(pol.params), compression_ratio=ratio,
                                 budget_tokens=budget, load=load)
                    tag = f"{series}-L{'max' if load is None else f'{load:g}'}-s{self.seed}"
                    out.append(ServingPoint(len(out), series, pol.name, dict(pol.params), ratio, budget, load,
                                            self.seed, point_id(tag, ident), ident))
        return out

    def engine_config(self, point: ServingPoint) -> dict:
        """`replica.engine.EngineConfig` fields for `point`."""
        return dict(policy=point.policy, policy_params=dict(point.policy_params), budget_tokens=point.budget_tokens,
                    compression_ratio=point.compression_ratio, kv_memory_limit_bytes=self.kv_memory_limit_bytes,
                    kv_memory_fraction=self.kv_memory_fraction, max_batch=self.max_batch,
                    max_prefill_tokens=self.max_prefill_tokens, max_length_tokens=self.max_length_tokens)

    def load_config(self, point: ServingPoint, max_batch: int | None = None) -> LoadConfig:
        """The load generator's config for `point` (`max_batch`: the batch of a max_batch point)."""
        mode = _LOAD_MODE[self.mode]
        kw: dict[str, Any] = dict(mode=mode, num_requests=self.num_requests, duration_s=self.duration_s,
                                  warmup_requests=self.warmup_requests, warmup_s=self.warmup_s,
                                  request_timeout_s=self.request_timeout_s, seed=self.seed + point.index)
        if self.mode == "max_batch":
            kw.update(batch_size=max_batch, num_requests=max_batch * self.rounds, duration_s=None)
        elif mode == "batch":
            kw["batch_size"] = int(point.load)
        elif mode == "concurrency":
            kw["concurrency"] = int(point.load)
        elif mode == "trace":
            kw.update(trace_path=self.trace_path, trace_time_scale=float(point.load),
                      max_concurrency=self.max_concurrency, cap_policy=self.cap_policy)
        else:
            kw.update(rate_req_per_s=float(point.load), arrival=self.arrival, burstiness=self.burstiness,
                      max_concurrency=self.max_concurrency, cap_policy=self.cap_policy)
        return LoadConfig(**kw)
