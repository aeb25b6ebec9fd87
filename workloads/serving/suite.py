"""Serving suites (`kind: serving`): load sweeps against continuously batching replicas.

A serving suite (YAML, read through `workloads.kinds.load_suite`) asks one question; its `mode`
names the load::

    kind: serving
    name: serving-rate
    description: the question this suite answers
    mode: rate                    # serving-batch | concurrency | rate | max_batch | trace | capacity | sessions
    model: embedded
    policies: [full, scissorhands]
    compression_ratios: [5]       # B = ceil((max prompt + max new) / ratio) for every sequence
    budget_tokens: []
    loads: [0.5, 1, 2, 4]         # batch sizes | concurrencies | request rates (req/s); not for max_batch
    prompt_tokens: {dist: uniform, min: 128, max: 512}   # or an integer
    new_tokens: {dist: uniform, min: 16, max: 64}        # output length, as in every suite and record
    kv_memory_limit: {full_sequences: 4}   # per replica: room for 4 full-cache sequences of the longest prompt +
                                  #   the longest output, in the run's dtype; or {bytes: 200000000};
                                  #   or {fraction: 0.5} (of device memory; older: kv_memory_fraction: 0.5)
    max_batch: 64                 # most running sequences per replica
    kv_layout: preallocated       # or paged: one block pool of the limit, blocks taken as sequences grow
    block_tokens: 16              # paged: slots per block
    budget: fixed                 # or per_request: B_i = ceil((prompt_i + new_i) / ratio) per request
    scheduler: prefill_first      # or mixed (needs kv_layout: paged): one token budget a step, decodes first,
    max_num_batched_tokens: 512   #   then prompt chunks (replica.common.types.EngineConfig)
    num_requests: 64              # and/or duration_s; measured requests per point
    warmup_requests: 1
    arrival: poisson              # rate mode: poisson | gamma (with burstiness)
    max_concurrency: null         # rate mode: cap on requests in flight; cap_policy: delay | drop
    saturation: {max_error_rate: 0.05, max_p50_ttft_s: null, min_achieved_rate_fraction: 0.8}
    slo: {ttft_s: 2.0, tpot_s: 0.1}   # per-request latency limits (s; the defaults: MLPerf's Llama-3.1-8B server
                                  #   limits); e2e_latency_s: S adds one; judged for slo_attainment and goodput
    rounds: 2                     # max_batch mode: requests = rounds x the max batch
    trace_path: traces/azure_code_2023.csv  # trace mode (instead of loads and lengths): arrival time,
    trace_time_scale: 0.5         #   prompt and output tokens per row (docs/load-generation.md)
    capacity: {min_rate_req_per_s: 0.1, max_rate_req_per_s: 1.6, target_attainment: 0.99, resolution: 0.25}
                                  # capacity mode (instead of loads): per series the highest Poisson rate whose SLO
                                  #   attainment >= target, by bisection on a grid (workloads.serving.capacity);
                                  #   with a sessions: block, {min_rate_sessions_per_s, max_rate_sessions_per_s}:
                                  #   session start rates, judged by the session SLO attainment
    sessions: {users: 4, turns: 3, message_tokens: 32, think_time_s: 0.5, system_prompt_tokens: 64,
               group_context_tokens: 32, group_size: 2}   # sessions mode (loads: session start rates, sessions/s;
                                  #   no prompt_tokens: a turn's prompt is the conversation so far;
                                  #   or {trace_path: T, ...}: a multi-turn trace, workloads.load.sessions)
    replicas: 1

The shared fields (model, policies, budgets, seed, replicas, placement) and their checks are
`workloads.core.suite.SuiteBase`'s. The engine's knobs (`max_batch` to `max_num_batched_tokens` above) are
`replica.common.types.EngineConfig`'s own fields, declared there once (`EngineConfig.knobs`), and every point's
`EngineConfig` is built when the suite loads (`engine_config`), so a combination the engine refuses fails the suite
(exit 2, the engine's message naming the field), not a point. `kv_memory_limit` is `replica.common.types.KVMemoryLimit`,
the engine's typed limit and the frontier's:
``full_sequences`` resolves on each replica (`replica.engine.full_rows_kv_bytes`, the model in the run's dtype)
to the bytes of that many full-cache rows of ``max(prompt_tokens) + max(new_tokens)`` (the longest prompt plus
the longest output, what one preallocated full row reserves), so its rows are the same in float32 and bfloat16.
The older ``kv_memory_limit_bytes: N`` still loads, as ``kv_memory_limit: {bytes: N}`` (the same point ids as
before). At most one limit; none: the replicas' memory is the only limit.

`slo` (`workloads.load.slo.SLO`) judges every request of every point (`workloads.load.metrics.summarize`: attainment
and goodput); a limit that is not a positive number of seconds is an error naming ``slo.<field>`` (exit 2). The
default SLO adds nothing to the point ids (runs recorded before it resume); another SLO is part of every point's
identity, so a run resumed with a changed SLO is refused rather than mixing two SLOs in one table.

Points are policy x budget x load, in that order, so each (policy, budget) is a series of increasing load; the
series stops (remaining points `skipped`, stop reason `saturated`) once a point's error rate, p50 TTFT or
achieved/target rate shows saturation. In `capacity` mode the points are every rate of the search's grid, of which
each series' search runs a few (`workloads.serving.capacity`: no saturation, no `loads`; a probe's requests and
arrivals are seeded by the rate's value, and `capacity:` is not part of a point's id).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, create_model, model_validator

from replica.common.rules import NonNegativeInt, PositiveFloat, PositiveInt, at_most_one
from replica.common.types import ConfigError, EngineConfig, KVMemoryLimit
from replica.engine.scheduler import SCHEDULE_KEYS
from replica.openvino_settings import eviction_from_policy, evicts_nothing
from scissorhands import POLICIES
from workloads.core.suite import (
    Name,
    SuiteBase,
    SuiteError,
    budget_tag,
    in_policy_entry,
    point_id,
)
from workloads.load.lengths import LengthDist
from workloads.load.patterns import ARRIVALS, CAP_POLICIES, MODES, LoadConfig, LoadPattern, mode_pattern
from workloads.load.sessions import SessionSpec
from workloads.load.slo import DEFAULT_SLO, SLO
from workloads.serving.capacity import CapacitySearch, probe_seed

#: A serving suite's modes: every load pattern's name, and the aliases of `workloads.load.patterns.MODE_ALIASES`.
SERVING_MODES = tuple(MODES)


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
        if (
            self.min_achieved_rate_fraction is not None
            and target
            and achieved is not None
            and achieved < self.min_achieved_rate_fraction * target
        ):
            return (
                f"achieved {achieved:.3g} req/s < {self.min_achieved_rate_fraction:.0%} of {target:.3g} req/s scheduled"
            )
        return None


@dataclass(frozen=True)
class ServingPoint:
    """One load level of one (policy, budget) series; `identity` holds every setting that changes
    its numbers, `point_id` is derived from it (see `workloads.core.suite.point_id`)."""

    index: int
    series: str  # policy + budget: the points of one series share it
    policy: str
    policy_params: dict
    compression_ratio: float | None
    budget_tokens: int | None
    load: float | None  # batch size / concurrency / rate; None for max_batch
    seed: int
    point_id: str
    identity: dict
    engine: str | None = None  # the policy entry's backend (None: the suite's `engine`)


def _lengths(value: Any, info) -> LengthDist:
    dist = value if isinstance(value, LengthDist) else LengthDist.parse(info.field_name, value)
    dist.upper  # bounded, for memory (ValueError naming the field otherwise)
    return dist


Length = Annotated[LengthDist, PlainValidator(_lengths), PlainSerializer(LengthDist.model_dump)]
Load = Annotated[float, Field(gt=0, allow_inf_nan=False)]


#: The engine's knobs as suite fields, declared once in `replica.common.types.EngineConfig` (types, checks, defaults):
#: `kv_memory_limit_bytes` (the older spelling of ``kv_memory_limit: {bytes: N}``), `kv_memory_fraction`, `max_batch`,
#: the layout, budget and scheduler and their sizes; ``full_sequences`` is only spelled as ``kv_memory_limit``.
_EngineKnobs = create_model(
    "_EngineKnobs", __base__=SuiteBase, __module__=__name__, **EngineConfig.knobs(exclude=("kv_limit_full_sequences",))
)
#: The knobs whose value is in every point's id at its default too (they were suite fields before the others).
_KNOBS_ALWAYS_IN_ID = (
    "kv_memory_limit_bytes",
    "kv_memory_fraction",
    "max_batch",
    "max_prefill_tokens",
    "kv_layout",
    "block_tokens",
    "budget",
)


class ServingSuite(_EngineKnobs):
    """A validated serving suite (see the module docstring for the YAML form); its engine knobs are
    `replica.common.types.EngineConfig`'s own fields (`EngineConfig.knobs`), and every point's `EngineConfig` is built
    when the suite loads, so a bad combination fails the suite, not a point."""

    #: a policy entry may set its own `enable_prefix_caching` (`workloads.core.suite.PolicySpec`): one series each
    _policy_prefix_caching: ClassVar[bool] = True

    kind: Literal["serving"]
    mode: Literal[SERVING_MODES]
    prompt_tokens: Length
    new_tokens: Length
    loads: tuple[Load, ...] = ()
    kv_memory_limit: KVMemoryLimit | None = None
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
    slo: SLO = DEFAULT_SLO  # per-request latency limits (seconds) for slo_attainment and goodput
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
    # capacity mode: the search's bracket, target, resolution and probes (workloads.serving.capacity)
    capacity: CapacitySearch | None = None
    # sessions mode: the conversations (workloads.load.sessions.SessionSpec); the loads are session start rates
    sessions: SessionSpec | None = None
    session_tokens: PositiveInt | None = None  # set from `sessions`: the longest whole conversation (tokens)

    @property
    def max_length_tokens(self) -> int:
        return self.prompt_tokens.upper + self.new_tokens.upper

    @property
    def longest_sequence_tokens(self) -> int:
        """The longest sequence a request of the suite makes (tokens): a whole conversation in sessions mode, else
        the largest prompt + the largest output."""
        return self.session_tokens if self.sessions is not None and self.session_tokens else self.max_length_tokens

    @property
    def kv_limit(self) -> KVMemoryLimit | None:
        """The suite's KV memory limit however it is spelled (`kv_memory_limit`, or the older
        `kv_memory_limit_bytes` and `kv_memory_fraction`), one typed value; None without one."""
        if self.kv_memory_limit_bytes is not None:
            return KVMemoryLimit(bytes=self.kv_memory_limit_bytes)
        if self.kv_memory_fraction is not None:
            return KVMemoryLimit(fraction=self.kv_memory_fraction)
        return self.kv_memory_limit

    def budget_lengths(self) -> list[int]:
        return [self.max_length_tokens]

    def context_lengths(self) -> list[tuple[str, int]]:
        """The longest request (largest prompt + largest output); none for a `target:` (the server applies
        its own context, and answers a request beyond it with a 400)."""
        if self.target is not None:
            return []
        p, n = self.prompt_tokens.upper, self.new_tokens.upper
        if self.sessions is not None:  # the whole conversation is one sequence by its last turn
            field = "sessions.turns" if self.sessions.trace_path is None else "sessions.trace_path"  # what sets it
            return [(f"{field}: the last turn's prompt (at most {p} tokens) + its answer", self.session_tokens)]
        return [(f"prompt_tokens (at most {p}) + new_tokens (at most {n})", p + n)]

    @property
    def pattern(self) -> type[LoadPattern]:
        """The load pattern the suite's `mode` sweeps (`workloads.load.patterns.mode_pattern`: `mode: capacity` with a
        `sessions:` block searches session start rates)."""
        return mode_pattern(self.mode, self.sessions is not None)[0]

    @property
    def pattern_options(self) -> dict:
        """The options of the mode on its pattern (`workloads.load.patterns.MODE_ALIASES`; {} for a pattern's own name)."""
        return MODES[self.mode][1]

    @property
    def sized_by_memory(self) -> bool:
        """Whether a point's batch is the most sequences the replicas' KV memory holds (`max_batch` mode):
        the runner asks the pool (`max_batch_for`) and passes it to `load_config` and `record_columns`."""
        return bool(self.pattern_options.get("sized_by_memory"))

    @property
    def capacity_search(self) -> bool:
        """Whether the points are probes of a capacity search (`capacity` mode): the runner picks which to run."""
        return bool(self.pattern_options.get("capacity_search"))

    @model_validator(mode="before")
    @classmethod
    def _pattern_defaults(cls, data: Any) -> Any:
        """What the mode's pattern supplies itself (a trace's lengths), and the fields it forbids."""
        if not isinstance(data, dict) or data.get("mode") not in MODES:
            return data
        pattern, options = mode_pattern(data["mode"], data.get("sessions") is not None)
        try:
            return pattern.suite_defaults(data, **options)
        except ValueError as e:
            raise SuiteError(str(e)) from None

    @model_validator(mode="after")
    def _mode_needs(self) -> "ServingSuite":
        self.pattern.check_suite(self, self.mode, **self.pattern_options)
        if self.capacity is not None and not self.capacity_search:
            raise SuiteError(
                f"capacity: only used in mode capacity (the search over Poisson rates), not in {self.mode}"
            )
        if self.capacity_search and self.capacity.over_sessions != (self.sessions is not None):
            sfx = self.capacity.rate_suffix
            raise SuiteError(
                f"capacity.min_rate_{sfx}, capacity.max_rate_{sfx}: "
                + (
                    "a search over session start rates needs a sessions: block (the conversations it starts); give "
                    "one, or search request rates with min_rate_req_per_s and max_rate_req_per_s"
                    if self.capacity.over_sessions
                    else "with a sessions: block mode capacity searches session start rates: give "
                    "min_rate_sessions_per_s and max_rate_sessions_per_s (sessions/s)"
                )
            )
        at_most_one(
            self,
            "kv_memory_limit",
            "kv_memory_limit_bytes",
            "kv_memory_fraction",
            what="give one KV memory limit: kv_memory_limit ({full_sequences: N} or {bytes: N}), its older form "
            "kv_memory_limit_bytes, or kv_memory_fraction",
        )
        if self.budget == "per_request" and self.budget_tokens:
            raise SuiteError(
                "budget: 'per_request' computes each request's budget from compression_ratios; drop budget_tokens"
            )
        for p in self.points():  # every point's engine and load configs must be valid now, not mid-sweep
            try:  # the engine's own rules (replica.common.types.EngineConfig), written once
                self.engine_config(p)
            except ConfigError as e:  # its policy fields named as the suite's entry (policies[i].name, .params)
                i = self._policy_index(p)
                if "kv_reuse" in p.identity and "kv_reuse" in str(e):  # the policy entry's own: name the entry
                    raise SuiteError(f"policies[{i}].{str(e).strip()}") from None
                raise SuiteError(in_policy_entry(str(e), i)) from None
            self.load_config(p, max_batch=1)
        self._warn_evicting_nothing()
        return self

    def _warn_evicting_nothing(self) -> None:
        """Warn (once a series) of an OpenVINO eviction row whose rounded ``max_cache_size`` holds the longest
        sequence: it runs the full cache under its ``x<ratio>`` label (its records say so: ``evicts``)."""
        seen = set()
        for p in self.points():
            if p.policy != "openvino_eviction" or p.series in seen:
                continue
            seen.add(p.series)
            ev, _ = eviction_from_policy(dict(p.policy_params), p.compression_ratio, self.max_length_tokens)
            why = evicts_nothing(ev["max_cache_size"], self.longest_sequence_tokens)
            if why is not None:
                warnings.warn(f"policies: series {p.series}: OpenVINO's eviction {why}; it runs the full cache")

    def _policy_index(self, point: ServingPoint) -> int:
        """The index in `policies` of the entry whose series `point` is."""
        for i, pol in enumerate(self.policies):
            if pol.point_fields(point.compression_ratio).items() <= point.identity.items():
                return i
        raise LookupError(f"no policy entry makes point {point.point_id}")

    def identity(self) -> dict:
        """Suite-level settings that change a serving point's numbers (the load axis aside)."""
        knobs = set(EngineConfig.model_fields) - set(_KNOBS_ALWAYS_IN_ID)
        # a knob added to EngineConfig after these ids were written joins a point's id only when set off its default
        # (the ids of suites written before it stay as they were)
        moved = {
            k for k in knobs & set(type(self).model_fields) if getattr(self, k) == type(self).model_fields[k].default
        }
        keep = (
            set(type(self).model_fields)
            - moved
            - {
                "kind",
                "name",
                "description",
                "policies",
                "compression_ratios",
                "budget_tokens",
                "loads",
                "replicas",
                "placement",
                "saturation",
                "kv_memory_limit",
                "slo",
                *SCHEDULE_KEYS,  # below
                "capacity",  # a probe's numbers depend on its rate, not on the search that picked it
            }
        )
        if self.sessions is None:  # added after these ids were written: only a sessions suite's ids carry them
            keep -= {"sessions", "session_tokens"}
        ident = self.model_dump(include=keep, mode="json")
        # the SLO changes a point's attainment and goodput: a non-default one is part of its identity, the default
        # adds nothing (the ids of suites written before `slo:` stay as they were)
        if self.slo != DEFAULT_SLO:
            ident["slo"] = self.slo.model_dump(mode="json")
        if self.scheduler == "mixed":  # likewise: prefill_first (the older engine's only scheduler) adds nothing
            ident.update({k: getattr(self, k) for k in SCHEDULE_KEYS})  # its token budget always, as ids had it
        # the limit under the record's names: {bytes: N} and the older kv_memory_limit_bytes are one setting (and
        # keep the ids of suites written before kv_memory_limit); full_sequences adds its own key
        lim = self.kv_limit
        if lim is not None and lim.bytes is not None:
            ident["kv_memory_limit_bytes"] = lim.bytes
        elif lim is not None and lim.full_sequences is not None:
            ident["kv_limit_full_sequences"] = lim.full_sequences
        ident["kv_memory_fraction"] = lim.fraction if lim is not None else None  # a key ids always had
        return ident

    def points(self) -> list[ServingPoint]:
        out: list[ServingPoint] = []
        loads = self.pattern.point_loads(self, **self.pattern_options)
        base = self.identity()
        for pol in self.policies:
            for ratio, budget in self.budgets(pol):
                series = f"{self.mode}-{pol.tag()}{budget_tag(ratio, budget)}"
                for load in loads:
                    ident = dict(base, **pol.point_fields(ratio), budget_tokens=budget, load=load)
                    tag = f"{series}-L{'max' if load is None else f'{load:g}'}-s{self.seed}"
                    out.append(
                        ServingPoint(
                            len(out),
                            series,
                            pol.name,
                            dict(pol.params),
                            ratio,
                            budget,
                            load,
                            self.seed,
                            point_id(tag, ident),
                            ident,
                            pol.engine,
                        )
                    )
        return out

    def engine_config(self, point: ServingPoint) -> EngineConfig:
        """`point`'s `replica.common.types.EngineConfig`: the suite's knobs and KV limit, the point's policy and budget.

        Raises:
            ConfigError: a combination the engine refuses (the message names the field and what it accepts);
                `_mode_needs` builds every point's when the suite loads.
        """
        fields = {k: getattr(self, k) for k in EngineConfig.knobs() if k in type(self).model_fields}
        lim = self.kv_limit
        fields.update(lim.engine_fields() if lim is not None else {})  # full_sequences resolves on the replica
        fields.update(
            policy=point.policy,
            policy_params=dict(point.policy_params),
            budget_tokens=point.budget_tokens,
            compression_ratio=point.compression_ratio,
            max_length_tokens=self.max_length_tokens,
            budget=self.budget if point.policy in POLICIES and POLICIES[point.policy].evicts else "fixed",
            engine=point.engine or self.engine,
        )
        if "enable_prefix_caching" in point.identity:  # the policy entry's own (its series'), over the suite's
            fields["enable_prefix_caching"] = point.identity["enable_prefix_caching"]
        if "kv_reuse" in point.identity:  # likewise
            fields["kv_reuse"] = point.identity["kv_reuse"]
        explicit = "enable_prefix_caching" in point.identity or "enable_prefix_caching" in self.model_fields_set
        if fields.get("kv_reuse") == "shared_prefix" and not explicit:  # it turns the prefix cache on: no default off
            fields.pop("enable_prefix_caching", None)
        return EngineConfig(**fields)

    def workload_seed(self, point: ServingPoint) -> int:
        """The seed of `point`'s requests and arrival times: the suite's `seed` and the point's load (its
        place in the series), never the series, so every policy at one load is measured on the same
        requests in the same order at the same times (a paired comparison); other loads draw anew. A capacity
        probe's: the suite's `seed` alone, at every rate (`workloads.serving.capacity.probe_seed`: the same requests
        and arrival pattern, scaled to the rate)."""
        if self.capacity_search:
            return probe_seed(self.seed)
        loads = self.pattern.point_loads(self, **self.pattern_options)
        return self.seed * 1_009 + loads.index(point.load)

    def load_config(self, point: ServingPoint, max_batch: int | None = None) -> LoadConfig:
        """The load generator's config for `point` (`max_batch`: the batch of a max_batch point), seeded
        by `workload_seed`.

        Raises ValueError naming the field (and what it accepts) when the point cannot run."""
        return self.pattern.point_config(
            self, point.load, seed=self.workload_seed(point), max_batch=max_batch, **self.pattern_options
        )

    def record_columns(self, point: ServingPoint, max_batch_size: int | None = None) -> dict:
        """The record's load columns (`batch_size`, `concurrency`, `request_rate`: every pattern's
        `record_column`), the mode's own filled with the point's load (a max_batch point's batch:
        `max_batch_size`), the others None."""
        return self.pattern.record_columns(point.load, max_batch_size, **self.pattern_options)
