"""What every suite kind shares: the base model, the policy list, budgets, point ids, validation and YAML reading.

A suite file (YAML, read with `yaml.safe_load`) names its kind first; `workloads.kinds.load_suite` (the one front
door) picks the kind's model from `workloads.kinds.KINDS` and validates the file with `validate_suite`. Every
kind's model extends `SuiteBase`::

    kind: batch              # a key of workloads.kinds.KINDS: batch | serving | quality | frontier
    name: smoke              # default: the file's name
    description: the question this suite answers
    model: embedded          # "embedded", an HF id, a local folder; "tiny-llama" is test-only
    dtype: auto              # auto (bfloat16 where >= 1.2x faster, see scissorhands.models.resolve_dtype) | float32 | bfloat16 | float16
    device: cpu              # cpu, cuda or cuda:<index>
    policies:                # names of scissorhands.POLICIES, or {name: ..., params: {...}}, or all (every one;
                             # the default of quality and frontier suites)
      - full
      - name: scissorhands
        params: {history_window: 400}
    compression_ratios: [2, 5]   # budget B = ceil(length / ratio), ratio >= 1
    budget_tokens: []            # absolute budgets B (slots per KV head), optional
    seed: 0
    replicas: 2
    placement: {strategy: SPREAD, num_gpus: 1}   # optional; see cluster.placement

Serving and frontier suites also state one KV memory limit per replica the same way (`KVMemoryLimit`, the engine's
own typed limit: `replica.common.types.KVMemoryLimit`)::

    kv_memory_limit: {full_sequences: 4}   # room for 4 full-cache sequences of the suite's longest prompt +
                                           # longest output, in the run's dtype; or {bytes: 200000000}; or
                                           # {fraction: 0.5} of device memory (serving suites)

Each policy entry is checked by the library's own `scissorhands.policies.get_policy`; budgets expand with
`SuiteBase.budgets` and the library's formula (`scissorhands.budget_from_ratio`). Every error is a `SuiteError`
whose message names the field (`policies[1]`, `seed`) and the accepted values; the runners exit with status 2 on it.
This module imports no suite kind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Annotated, Any, ClassVar, Literal, Mapping, Sequence

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cluster.placement import PlacementConfig, parse_placement
from replica.common.rules import NonNegativeInt, PositiveInt, one_line
from replica.common.types import ENGINES, KV_REUSES
from replica.openvino_settings import OPENVINO_POLICIES
from scissorhands import POLICIES, budget_from_ratio
from scissorhands.models import DEVICE_NAMES, DTYPE_CHOICES, is_device_name
from scissorhands.policies import get_policy


class SuiteError(ValueError):
    """A suite that cannot run; the message names the field."""


# -- number types: the project's own (`replica.common.rules`: strict, 2.0 and True are not integers), and a ratio -----
Ratio = Annotated[float, Field(ge=1, allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1)]


def _one_or_many(value: Any) -> Any:
    """A scalar where a list is expected is a one-element list."""
    return value if isinstance(value, (list, tuple)) or value is None else [value]


def in_policy_entry(message: str, index: int) -> str:
    """An engine's refusal (`replica.common.types.EngineConfig`'s message) in a suite's field names: its policy
    fields become entry `index`'s (``policy`` -> ``policies[i].name``, ``policy_params[.key]`` ->
    ``policies[i].params[.key]``, wherever the message names them); other fields are left as they are."""
    message = re.sub(r"\bpolicy_params\b", f"policies[{index}].params", message)
    return re.sub(r"^policy(?=[:,])", f"policies[{index}].name", message)


class PolicySpec(BaseModel):
    """One policy of a suite: a key of `scissorhands.POLICIES` and its keyword parameters, and the engine backend that
    runs it (`engine`: None runs the suite's ``engine``, ours by default; ``openvino`` runs ``full`` or
    ``openvino_eviction``, `replica.openvino_settings.OPENVINO_POLICIES`, checked with the point's `EngineConfig`).
    `enable_prefix_caching`: serving suites only, this series' prefix cache (`EngineConfig.enable_prefix_caching`;
    None: the suite's), so one suite pairs the same engine without and with it on the same requests. `kv_reuse`:
    serving suites only, the same for `EngineConfig.kv_reuse` (``none``; ``session_state``, which needs the suite's
    ``budget: fixed``, the paged layout of engine ``ours`` and no prefix caching; or ``shared_prefix``, which needs
    the paged layout of engine ``ours`` and turns the series' prefix cache on: refused at load naming
    ``policies[i].kv_reuse``), so one suite compares a policy's ways of reusing KV on the same requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Name
    params: dict[str, Any] = Field(default_factory=dict)
    engine: Literal[ENGINES] | None = None
    enable_prefix_caching: StrictBool | None = None
    kv_reuse: Literal[KV_REUSES] | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in POLICIES and name not in OPENVINO_POLICIES:
            raise ValueError(f"unknown policy {name!r} (valid policies: {', '.join(POLICIES)})")
        return name

    @field_validator("params")
    @classmethod
    def _accepted_by_the_policy(cls, params: dict, info: ValidationInfo) -> dict:
        if info.data.get("name") in POLICIES:
            get_policy(info.data["name"], **params)  # ValueError naming the parameter
        return params

    @property
    def ours(self) -> bool:
        """Whether our library runs it (a key of `scissorhands.POLICIES`, not a backend's own policy)."""
        return self.name in POLICIES and self.engine != "openvino"

    @property
    def evicts(self) -> bool:
        """Whether it keeps fewer tokens than it saw (so it takes budgets)."""
        return POLICIES[self.name].evicts if self.ours else self.name == "openvino_eviction"

    @property
    def policy(self):
        """The library's policy instance for these parameters."""
        return get_policy(self.name, **self.params)

    def point_fields(self, compression_ratio: float | None) -> dict:
        """The policy's part of a point's identity at `compression_ratio`, the same in every suite kind (its
        `engine` only when one is named: the ids of suites written before it stay as they were)."""
        out = {"policy": self.name, "policy_params": dict(self.params), "compression_ratio": compression_ratio}
        if self.enable_prefix_caching is not None:
            out["enable_prefix_caching"] = self.enable_prefix_caching
        if self.kv_reuse is not None:
            out["kv_reuse"] = self.kv_reuse
        return out if self.engine is None else {**out, "engine": self.engine}

    def tag(self) -> str:
        """The policy's part of a readable point id: the engine when named, the name, a digest of explicit params."""
        name = self.name if self.engine is None else f"{self.engine}-{self.name}"
        if self.enable_prefix_caching is not None:
            name += "+prefix" if self.enable_prefix_caching else "-noprefix"
        if self.kv_reuse is not None:
            name += f"+reuse-{self.kv_reuse}"
        if not self.params:
            return name
        return f"{name}@{hashlib.sha1(json.dumps(self.params, sort_keys=True).encode()).hexdigest()[:8]}"


def _placement(value: Any) -> PlacementConfig:
    return parse_placement(value)


class SuiteBase(BaseModel):
    """What every kind of suite shares; subclasses add their axes and `points()`.

    Subclasses name the total lengths their ratios apply to in `budget_lengths()` (prompt + new
    tokens), so the budget check below runs once for every kind.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())
    kind: str
    name: Name = "suite"
    description: str = ""
    model: Name = "embedded"
    dtype: Literal[DTYPE_CHOICES] = "auto"  # auto: bfloat16 where >= 1.2x faster (scissorhands.models.resolve_dtype)
    device: str = "cpu"  # where each replica runs its model: cpu, cuda or cuda:<index>
    policies: Annotated[tuple[PolicySpec, ...], Field(min_length=1)]
    compression_ratios: tuple[Ratio, ...] = ()
    budget_tokens: tuple[PositiveInt, ...] = ()
    seed: NonNegativeInt = 0
    replicas: PositiveInt = 2
    placement: Annotated[PlacementConfig, PlainValidator(_placement), PlainSerializer(PlacementConfig.model_dump)] = (
        Field(default_factory=PlacementConfig)
    )

    _list_fields: ClassVar[tuple[str, ...]] = ("compression_ratios", "budget_tokens", "policies")
    #: `policies` of a suite that names none: None (the key is required) or "all"
    _policies_default: ClassVar[str | None] = None
    #: whether a policy may name its own `enable_prefix_caching` and `kv_reuse` (a serving suite's series)
    _policy_prefix_caching: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _scalars_to_lists(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            if cls._policies_default is not None:
                data.setdefault("policies", cls._policies_default)
            if data.get("policies") == "all":  # every key of scissorhands.POLICIES
                data["policies"] = list(POLICIES)
            data = {k: (_one_or_many(v) if k in cls._list_fields else v) for k, v in data.items()}
            for k in ("compression_ratios", "budget_tokens"):
                if data.get(k) is None:
                    data.pop(k, None)
        return data

    @field_validator("device")
    @classmethod
    def _device_kind(cls, value: str) -> str:
        if not is_device_name(value):
            raise ValueError(f"expected {DEVICE_NAMES}, got {value!r}")
        return value

    @field_validator("policies")
    @classmethod
    def _distinct(cls, value: tuple[PolicySpec, ...]) -> tuple[PolicySpec, ...]:
        if len(
            {
                (p.name, json.dumps(p.params, sort_keys=True), p.engine, p.enable_prefix_caching, p.kv_reuse)
                for p in value
            }
        ) != len(value):
            raise ValueError("the same policy with the same params is listed twice")
        if not cls._policy_prefix_caching:
            for i, p in enumerate(value):
                for knob in ("enable_prefix_caching", "kv_reuse"):
                    if getattr(p, knob) is not None:
                        raise ValueError(
                            f"policies[{i}].{knob}: only a serving suite (kind: serving) sets it per policy"
                        )
        return value

    def budget_lengths(self) -> list[int]:
        """Total lengths (prompt + new tokens) the compression ratios apply to."""
        return []

    def context_lengths(self) -> list[tuple[str, int]]:
        """The longest sequences the suite runs on its model, as (the fields that make it, tokens): each must
        fit the model's context (`workloads.core.run.check_model_context`, when the suite loads for a run)."""
        return []

    def budgets(self, policy: PolicySpec) -> list[tuple[float | None, int | None]]:
        """(compression_ratio, budget_tokens) pairs of `policy`: one `(None, None)` for a policy that
        never evicts (`full`), else every ratio, then every absolute budget."""
        if not policy.evicts:
            return [(None, None)]
        return [(r, None) for r in self.compression_ratios] + [(None, b) for b in self.budget_tokens]

    @model_validator(mode="after")
    def _budgets_fit_every_policy(self) -> "SuiteBase":
        for i, spec in enumerate(self.policies):
            if not spec.evicts or not spec.ours:  # a backend's own policy: its EngineConfig checks the budget
                continue
            if not self.compression_ratios and not self.budget_tokens:
                raise SuiteError(
                    f"compression_ratios: policy {spec.name!r} needs at least one compression ratio "
                    "or budget_tokens entry"
                )
            checks = [(f"budget_tokens[{j}]", b) for j, b in enumerate(self.budget_tokens)]
            checks += [
                (f"compression_ratios[{j}] (ratio {r:g} at {n} tokens)", budget_from_ratio(n, r, spec.policy))
                for j, r in enumerate(self.compression_ratios)
                for n in self.budget_lengths()
            ]
            for where, b in checks:
                _check_budget(where, spec, b)
        return self

    def identity(self) -> dict:
        """The suite-level settings that change a point's numbers (part of every point's identity)."""
        return {"model": self.model, "dtype": self.dtype, "device": self.device}


def _check_budget(where: str, spec: PolicySpec, budget: int) -> None:
    """A budget must leave room for the policy's protected windows (`Policy.resolve` says which)."""
    try:
        spec.policy.resolve(budget)
    except ValueError as e:
        raise SuiteError(f"{where}: budget {budget} tokens: {e} (policy {spec.name!r})") from None


def point_id(tag: str, identity: dict) -> str:
    """A readable tag plus a digest of everything that changes the point's numbers.

    Two points differ in id exactly when one of their settings differs; `tag` (policy, budget,
    shape) only makes the id readable, and `workloads.core.run.pending_points` compares the settings
    of points with the same tag when a run is resumed.
    """
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{tag}-{digest}"


def tag_of(point_id_: str) -> str:
    """The readable tag of a point id (what `point_id` put before the digest)."""
    return point_id_.rsplit("-", 1)[0]


def budget_tag(ratio: float | None, budget: int | None) -> str:
    """The budget's part of a readable point id: ``-B<slots>``, ``-r<ratio>`` or nothing (`full`)."""
    return f"-B{budget}" if budget is not None else f"-r{ratio:g}" if ratio is not None else ""


def validation_message(e: ValidationError, cls: type[BaseModel]) -> str:
    """One line per error, each naming its field (``policies[1]: ...``) and what was given (`replica.common.rules.one_line`)."""
    return one_line(e, accepted=cls.model_fields, default="suite")


def validate_suite(models: Mapping[str, type[BaseModel]], data: Any, source: str = "<suite>"):
    """Validate a parsed YAML mapping into the suite model its ``kind`` names in `models` (``{kind: model}``).

    A suite without ``name`` is named after its file. `workloads.kinds.load_suite` passes every kind's model; a
    kind's own runner only its own (`workloads.core.template.load_suite_of`).

    Raises:
        SuiteError: not a mapping, `kind` missing or not a key of `models`, or any field invalid (the message names
            it: unknown key, wrong type, ratio < 1, unknown policy with the valid names, unknown policy
            parameter, budget below the policy's windows, empty list).
    """
    if not isinstance(data, dict):
        raise SuiteError(f"{source}: expected a YAML mapping at the top level, got {type(data).__name__}")
    kind = data.get("kind")
    if kind not in models:
        raise SuiteError(
            f"kind: {'missing' if kind is None else f'unknown kind {kind!r}'} "
            f"(accepted: {', '.join(models)}); every suite names its kind"
        )
    data = dict(data)
    data.setdefault("name", os.path.splitext(os.path.basename(source))[0] or "suite")
    try:
        return models[kind].model_validate(data)
    except ValidationError as e:
        raise SuiteError(validation_message(e, models[kind])) from None


def read_suite_file(path: str, overrides: Sequence[str] = ()):
    """The parsed YAML of a suite file, with the command line's ``--set KEY=VALUE`` `overrides` applied in order
    (the value read as YAML: ``--set scheduler=mixed``, ``--set loads=[1,2]``; a dotted key sets a key of a
    mapping: ``--set slo.ttft_s=0.5``), so a flag wins over the file and is validated as the file is.

    Raises:
        SuiteError: the file does not exist or is not valid YAML; an override is not ``KEY=VALUE`` or its value
            is not valid YAML.
    """
    if not os.path.isfile(path):
        raise SuiteError(f"suite: file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise SuiteError(f"suite: {path} is not valid YAML: {e}") from None
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or any(not k for k in key.strip().split(".")):
            raise SuiteError(f"--set: expected KEY=VALUE (e.g. scheduler=mixed or slo.ttft_s=0.5), got {item!r}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SuiteError(f"--set {key}: the value {text!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            break  # validation names what is wrong with the file itself
        *parents, last = key.strip().split(".")
        node = data
        for k in parents:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[last] = value
    return data
