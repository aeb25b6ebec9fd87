"""Frontier suites (``kind: frontier``): a typed model validated on load (through `workloads.kinds.load_suite`),
expanded into one point per policy and compression ratio.

A frontier suite (YAML, read with ``yaml.safe_load``) has the keys every suite has (`workloads.core.suite`), with
``policies`` defaulting to ``all`` and compression by ratio only, as a quality suite has
(`workloads.quality.suite`), and these::

    kind: frontier
    seed: 0                      # the prompts and the held-out text windows
    compression_ratios: [2, 5]   # B = ceil((prompt_tokens + new_tokens) / ratio), the same B in both measurements
    prompt_tokens: 512           # every request's prompt (real load-test text, the same prompts for every point)
    new_tokens: 128              # every request's output (EOS ignored)
    kv_memory_limit:             # one limit for every point (`replica.common.types.KVMemoryLimit`): exactly one of
      full_sequences: 2          #   the bytes the full cache needs for this many sequences of prompt + new tokens,
                                 #   in the run's dtype (resolved on the replica)
      # bytes: 50000000          #   or an absolute limit in bytes
    perplexity_windows: 4        # held-out windows of prompt_tokens + new_tokens tokens each (>= 2 for an interval)
    throughput: capacity         # the throughput axis: capacity (the default) or max_batch
    capacity:                    # throughput: capacity: each point's search (`workloads.serving.capacity`)
      min_rate_req_per_s: 0.25
      max_rate_req_per_s: 8.0
      target_attainment: 0.99
      resolution: 0.25
    slo: {ttft_s: 2.0, tpot_s: 0.1}   # capacity: the latency limits every request is judged by (`workloads.load.slo`)
    num_requests: 32             # capacity: measured requests a probe (after warmup_requests: 1)
    max_num_batched_tokens: 512  # capacity: the mixed scheduler's token budget a step; like block_tokens, max_batch
                                 #   and max_prefill_tokens, an engine knob of `replica.common.types.EngineConfig`
                                 #   (declared there once: `EngineConfig.knobs`; off its default it joins the ids)
    quality_gate:                # the report's gate (`workloads.frontier.gate`); not part of a point's identity:
      max_perplexity_increase: 0.01  # pass at perplexity <= the full cache's x (1 + this); a number > 0

The throughput axis (``throughput``):

* ``capacity`` (the default): capacity at the SLO, the serving measure (docs/serving.md, "Capacity at an SLO"). Each
  point runs, on its replica, the search of `workloads.serving.capacity` over Poisson rates: ``num_requests`` equal
  requests of ``prompt_tokens`` + ``new_tokens`` (EOS ignored) a probe, the same requests and arrival pattern for
  every point, on the paged engine (blocks of 16 slots from one pool of the KV memory limit) under the mixed
  scheduler (``max_num_batched_tokens`` a step), budgets per request (every request's B is the point's). A probe
  passes when at least ``capacity.target_attainment`` of its requests meet ``slo``; the point's
  ``capacity_req_per_s`` is the highest passing rate of the grid, or null when the search could not bracket it
  (``capacity_status`` says why). The search's settings, the SLO and the request count are part of the point's id.
* ``max_batch``: output tok/s of one batch of the policy's own max batch under the limit (preallocated rows,
  prefill-first), all requests at once: the older measure, quicker, without latency.

Engine backends (`replica.backends`, docs/serving.md "Engine backends") are a policy axis as in a serving suite: a
policy entry may name its ``engine`` (``{name: full, engine: openvino}``, ``{name: openvino_eviction, engine:
openvino, params: {...}}``; the suite's ``engine`` runs the entries that name none), so one frontier gives ours and
OpenVINO GenAI's rows on the same requests and arrivals under one KV byte limit (``openvino_kv_precision`` sets its
KV precision). Another engine's point runs the same capacity search on its backend (its ``max_cache_size`` from the
ratio, one for every sequence), with ``throughput: capacity`` only; it gives no log-likelihoods, so it has no
perplexity (``quality_note``: `NO_PERPLEXITY`) and the report lists it without a gate. A policy or parameter its
backend cannot run fails the suite when it loads, naming ``policies[i]`` and the field with what it accepts.

``full`` never evicts, so it runs once (ratio 1). Absolute ``budget_tokens`` are refused: both measurements
derive B from the ratio and the same length (prompt + new tokens), so a point's two numbers describe one cache.
Every error is a `workloads.core.suite.SuiteError` naming the field.

``perplexity_windows`` gives every point its 95% interval (one window: none); ``quality_gate`` changes no
measurement, only the report, so changing it re-reports a run (``--resume``) without re-running a point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationError, create_model, field_validator, model_validator

from replica.common.rules import NonNegativeInt, PositiveFloat, PositiveInt, Section
from replica.common.types import KV_LIMIT_FIELDS, EngineConfig, KVMemoryLimit
from workloads.core.suite import (
    SuiteBase,
    SuiteError,
    budget_tag,
    point_id,
    validation_message,
)
from workloads.frontier.gate import DEFAULT_MAX_PERPLEXITY_INCREASE
from workloads.load.slo import DEFAULT_SLO, SLO
from workloads.serving.capacity import CapacitySearch
from workloads.serving.suite import ServingSuite

#: The backends whose points score perplexity (their log-likelihoods are this process's model's).
PERPLEXITY_ENGINES = ("ours",)
#: What a point of another backend records instead of a perplexity (``quality_note``; the report shows it so).
NO_PERPLEXITY = "no perplexity: backend gives no log-likelihoods"
#: The frontier's throughput axes (the module docstring).
THROUGHPUTS = ("capacity", "max_batch")
#: The default search of ``throughput: capacity``: 17 rates 0.25-8 req/s, at most 25% apart, 5 probes a point.
DEFAULT_CAPACITY = CapacitySearch(min_rate_req_per_s=0.25, max_rate_req_per_s=8.0, resolution=0.25)


@dataclass(frozen=True)
class FrontierPoint:
    """One policy at one compression ratio (None for ``full``): both measurements of one cache.
    `identity` holds every setting that changes its numbers; `point_id` is derived from it."""

    index: int
    policy: str
    policy_params: dict
    compression_ratio: float | None
    prompt_tokens: int
    new_tokens: int
    kv_limit_full_sequences: int | None
    kv_memory_limit_bytes: int | None
    perplexity_windows: int
    seed: int
    point_id: str
    identity: dict = field(default_factory=dict)
    #: ``throughput: capacity``: the fields of the one-series serving suite (``mode: capacity``) whose search the point
    #: runs (`FrontierSuite.capacity_suite`); None: ``throughput: max_batch``.
    capacity_suite: dict | None = None
    #: The backend that runs the point (`replica.backends`): the policy entry's ``engine``, else the suite's.
    engine: str = "ours"
    #: Frontier points compress by a ratio, never by an absolute budget.
    budget_tokens: ClassVar[None] = None

    @property
    def scores_perplexity(self) -> bool:
        """Whether the point's backend gives log-likelihoods to score held-out text with (ours does; OpenVINO GenAI's
        pipeline returns tokens only, so its points have no perplexity: `NO_PERPLEXITY`)."""
        return self.engine in PERPLEXITY_ENGINES


#: What a capacity point's search fixes (`FrontierSuite.capacity_suite`): the engine people serve with.
_SEARCH_ENGINE = {"kv_layout": "paged", "budget": "per_request", "scheduler": "mixed"}
#: The engine's other knobs, declared once in `replica.common.types.EngineConfig` (types, checks, defaults), as suite
#: fields passed to the search (the KV limit is the suite's `kv_memory_limit`); ``engine`` among them: the backend of
#: every policy entry that names none (`replica.backends`), whose ``budget: per_request`` becomes the one
#: ``max_cache_size`` of OpenVINO's rows (`workloads.serving.suite.ServingSuite.engine_config`).
#: Not prefix caching yet: it runs the full cache only, and a frontier compares budgeted policies with it; nor
#: ``kv_reuse``: its session state needs ``budget: fixed`` and the frontier's requests carry no session.
_ENGINE_KNOBS = EngineConfig.knobs(exclude=(*_SEARCH_ENGINE, *KV_LIMIT_FIELDS, "enable_prefix_caching", "kv_reuse"))
#: The frontier fields only ``throughput: capacity`` uses.
_CAPACITY_FIELDS = ("capacity", "slo", "num_requests", "warmup_requests", *_ENGINE_KNOBS)
#: The settings of a capacity point's search that change its numbers (part of its id, with the engine knobs set off
#: their defaults); the rest follow from the point's own fields. The token budget a step is in every id: it was the
#: one knob before the others came from `EngineConfig`.
_CAPACITY_IDENTITY = (
    "mode",
    "kv_layout",
    "scheduler",
    "max_num_batched_tokens",
    "num_requests",
    "warmup_requests",
    "arrival",
    "slo",
    "capacity",
)


class QualityGate(Section):
    """``quality_gate``: a point passes when its perplexity is at most the full cache's (same run, dtype and KV
    limit) times ``1 + max_perplexity_increase`` (`workloads.frontier.gate.gate_passed`); 0.01 = within 1%."""

    section: ClassVar[str] = "quality_gate"
    form: ClassVar[str] = (
        "{max_perplexity_increase: X} (X a number > 0; 0.01 = perplexity within 1% of the full cache's)"
    )
    max_perplexity_increase: PositiveFloat = DEFAULT_MAX_PERPLEXITY_INCREASE

    @field_validator("max_perplexity_increase", mode="before")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"quality_gate.max_perplexity_increase: expected a number > 0 (0.01 = within 1%), got {value!r}"
            )
        return value


def _in_entry(error: Exception, index: int, tag: str) -> str:
    """A row's serving-suite error as entry `index`'s: the row's suite holds that entry alone, so its
    ``policies[0].`` fields are our ``policies[index].`` (``policies[1].name: ... (row openvino-tova)``); an error
    naming another field is prefixed with the entry (``policies[1] (openvino-tova): slo...``)."""
    inner = validation_message(error, ServingSuite) if isinstance(error, ValidationError) else str(error)
    inner = inner.replace("policies[0].", f"policies[{index}].")
    return f"{inner} (row {tag})" if inner.startswith(f"policies[{index}].") else f"policies[{index}] ({tag}): {inner}"


class FrontierSuite(create_model("_FrontierKnobs", __base__=SuiteBase, __module__=__name__, **_ENGINE_KNOBS)):
    """A validated frontier suite (see the module docstring for the YAML form); the engine knobs of its capacity
    search are `replica.common.types.EngineConfig`'s own fields (`EngineConfig.knobs`)."""

    kind: Literal["frontier"]
    name: Annotated[str, Field(min_length=1, pattern=r"^[^/]+$")]
    prompt_tokens: PositiveInt = 512
    new_tokens: PositiveInt = 128
    kv_memory_limit: KVMemoryLimit = KVMemoryLimit(full_sequences=2)
    perplexity_windows: PositiveInt = 4
    quality_gate: QualityGate = QualityGate()
    throughput: Literal[THROUGHPUTS] = "capacity"
    capacity: CapacitySearch = DEFAULT_CAPACITY
    slo: SLO = DEFAULT_SLO
    num_requests: PositiveInt = 32
    warmup_requests: NonNegativeInt = 1

    _policies_default: ClassVar[str | None] = "all"

    @model_validator(mode="after")
    def _ratios_only(self) -> "FrontierSuite":
        if self.budget_tokens:
            raise SuiteError(
                "budget_tokens: frontier suites compress by compression_ratios (B = ceil((prompt_tokens "
                "+ new_tokens) / ratio) in both measurements)"
            )
        return self

    @model_validator(mode="after")
    def _one_limit_for_every_dtype(self) -> "FrontierSuite":
        if self.kv_memory_limit.fraction is not None:
            raise SuiteError(
                "kv_memory_limit: a frontier point states its limit as {full_sequences: N} or {bytes: N} (N a whole "
                f"number >= 1), not a fraction of device memory; got {self.kv_memory_limit.model_dump(exclude_none=True)}"
            )
        return self

    @model_validator(mode="after")
    def _capacity_fields_need_capacity(self) -> "FrontierSuite":
        if self.throughput == "max_batch":
            # a setting changed from its default means a search the max-batch axis would silently not run
            changed = sorted(k for k in _CAPACITY_FIELDS if getattr(self, k) != type(self).model_fields[k].default)
            if changed:
                raise SuiteError(
                    f"{', '.join(changed)}: only used with throughput: capacity (the search at the SLO), not max_batch"
                )
            for i, pol in enumerate(self.policies):  # max_batch runs our engine's preallocated rows directly
                if (pol.engine or self.engine) != "ours":
                    raise SuiteError(
                        f"policies[{i}].engine: {pol.engine!r} runs with throughput: capacity only (a serving search "
                        "on its backend); accepted with throughput: max_batch: ours"
                    )
            return self
        for i, pol in enumerate(self.policies):  # the serving suite each point runs, checked now, not on a replica
            for ratio, _ in self.budgets(pol):
                try:
                    ServingSuite.model_validate(self.capacity_suite(pol, ratio))
                except (ValidationError, SuiteError) as e:  # the engine's refusal (`ServingSuite._mode_needs`)
                    raise SuiteError(_in_entry(e, i, pol.tag())) from None
        return self

    def capacity_suite(self, policy, ratio: float | None) -> dict:
        """The fields of the serving suite (``mode: capacity``, one series: `policy` at `ratio`) whose search a
        ``throughput: capacity`` point runs on its replica (`workloads.frontier.point`); its settings are checked
        when the suite loads (`_capacity_fields_need_capacity`)."""
        lim = self.kv_memory_limit
        return dict(
            kind="serving",
            name=f"{self.name}-capacity",
            mode="capacity",
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
            replicas=1,
            policies=[{"name": policy.name, "params": dict(policy.params), "engine": policy.engine}],
            compression_ratios=[ratio] if ratio is not None else [],
            prompt_tokens=self.prompt_tokens,
            new_tokens=self.new_tokens,
            kv_memory_limit=lim.model_dump(exclude_none=True),
            **_SEARCH_ENGINE,
            **{k: getattr(self, k) for k in _ENGINE_KNOBS},
            num_requests=self.num_requests,
            warmup_requests=self.warmup_requests,
            arrival="poisson",
            slo=self.slo.model_dump(exclude_none=True),
            capacity=self.capacity.model_dump(exclude_none=True),
        )

    def budget_lengths(self) -> list[int]:
        return [self.prompt_tokens + self.new_tokens]

    def context_lengths(self) -> list[tuple[str, int]]:
        p, n = self.prompt_tokens, self.new_tokens
        return [(f"prompt_tokens ({p}) + new_tokens ({n})", p + n)]

    def points(self) -> list[FrontierPoint]:
        """One point per policy and ratio (``full`` once), in suite order."""
        out: list[FrontierPoint] = []
        lim = self.kv_memory_limit
        for pol in self.policies:
            for ratio, _ in self.budgets(pol):
                ident = dict(
                    self.identity(),
                    **pol.point_fields(ratio),
                    prompt_tokens=self.prompt_tokens,
                    new_tokens=self.new_tokens,
                    kv_limit_full_sequences=lim.full_sequences,
                    kv_memory_limit_bytes=lim.bytes,
                    perplexity_windows=self.perplexity_windows,
                    seed=self.seed,
                )
                limit_tag = f"f{lim.full_sequences}" if lim.bytes is None else f"m{lim.bytes}"
                serving = None
                if self.throughput == "capacity":  # max_batch points keep the ids they had before this axis
                    serving = self.capacity_suite(pol, ratio)
                    ident["capacity_search"] = {k: serving[k] for k in _CAPACITY_IDENTITY}
                    ident["capacity_search"].update(  # a knob off its default (ids without it stay as they were)
                        {k: serving[k] for k, (_, f) in _ENGINE_KNOBS.items() if serving[k] != f.default}
                    )
                    limit_tag += "-cap"
                tag = (
                    f"frontier-{pol.tag()}{budget_tag(ratio, None)}-p{self.prompt_tokens}-n{self.new_tokens}-"
                    f"{limit_tag}-w{self.perplexity_windows}-s{self.seed}"
                )
                out.append(
                    FrontierPoint(
                        len(out),
                        pol.name,
                        dict(pol.params),
                        ratio,
                        self.prompt_tokens,
                        self.new_tokens,
                        lim.full_sequences,
                        lim.bytes,
                        self.perplexity_windows,
                        self.seed,
                        point_id(tag, ident),
                        ident,
                        serving,
                        pol.engine or self.engine,
                    )
                )
        return out
