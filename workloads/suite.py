"""Sweep suites: a typed YAML config validated on load, expanded into points.

A suite file (YAML, read with `yaml.safe_load`) looks like::

    name: smoke
    description: the question this suite answers
    model: embedded          # "embedded", an HF id, a local folder; "tiny-llama" is test-only
    dtype: auto              # auto (bfloat16 where faster, see scissorhands.models.resolve_dtype) | float32 | bfloat16 | float16
    device: cpu
    policies:                # names of scissorhands.POLICIES, or {name: ..., params: {...}}
      - full
      - name: scissorhands
        params: {history_window: 400}
    compression_ratios: [2, 5]   # budget B = ceil((prompt + new) / ratio), ratio >= 1
    budget_tokens: []            # absolute budgets B (slots per KV head), optional
    batch_sizes: [1, 4, 16]
    prompt_tokens: [512]
    new_tokens: [64]
    seed: 0
    replicas: 2
    placement: {strategy: SPREAD, num_gpus: 1}   # optional; see cluster.placement

Points are policy x budget (every ratio and every absolute budget) x batch size x prompt
tokens x new tokens; `full` runs once per batch/prompt/new combination, not once per budget.
Every error is a `SuiteError` whose message names the field and the accepted values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from cluster.placement import PlacementConfig, PlacementError, parse_placement

class SuiteError(ValueError):
    """A suite that cannot run; the message names the field."""


@dataclass(frozen=True)
class PolicySpec:
    """One policy of a suite: a key of `scissorhands.POLICIES` and its keyword parameters."""

    name: str
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Point:
    """One static batch of the sweep.

    `compression_ratio` is None for absolute budgets and for `full`; `budget_tokens` is the
    requested absolute budget (None when derived from the ratio, or for `full`).
    """

    index: int
    policy: str
    policy_params: dict
    compression_ratio: float | None
    budget_tokens: int | None
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    seed: int

    @property
    def point_id(self) -> str:
        """Stable, readable id: the same config gives the same id across runs (used by resume)."""
        tag = self.policy
        if self.policy_params:
            digest = hashlib.sha1(json.dumps(self.policy_params, sort_keys=True).encode()).hexdigest()[:8]
            tag += f"@{digest}"
        if self.budget_tokens is not None:
            tag += f"-B{self.budget_tokens}"
        elif self.compression_ratio is not None:
            tag += f"-r{self.compression_ratio:g}"
        return f"{tag}-b{self.batch_size}-p{self.prompt_tokens}-n{self.new_tokens}-s{self.seed}"

    def as_dict(self) -> dict:
        """The mapping `cluster.replica.ModelReplica.run_batch` takes."""
        d = dataclasses.asdict(self)
        d.pop("index")
        return d


@dataclass(frozen=True)
class Suite:
    """A validated suite (see the module docstring for the YAML form)."""

    name: str
    policies: tuple[PolicySpec, ...]
    batch_sizes: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    new_tokens: tuple[int, ...]
    description: str = ""
    model: str = "embedded"
    dtype: str = "auto"
    device: str = "cpu"
    compression_ratios: tuple[float, ...] = ()
    budget_tokens: tuple[int, ...] = ()
    seed: int = 0
    replicas: int = 2
    # resources and node placement of each replica (see cluster.placement)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def points(self) -> list[Point]:
        """Expand into points, in suite order (batch, prompt, new, policy, budget)."""
        out: list[Point] = []
        for batch in self.batch_sizes:
            for prompt in self.prompt_tokens:
                for new in self.new_tokens:
                    for pol in self.policies:
                        if pol.name == "full":
                            budgets: list[tuple[float | None, int | None]] = [(None, None)]
                        else:
                            budgets = [(r, None) for r in self.compression_ratios]
                            budgets += [(None, b) for b in self.budget_tokens]
                        for ratio, budget in budgets:
                            out.append(Point(len(out), pol.name, dict(pol.params), ratio, budget, batch, prompt, new, self.seed))
        return out


_REQUIRED = ("policies", "batch_sizes", "prompt_tokens", "new_tokens")
_FIELDS = {f.name for f in dataclasses.fields(Suite)}


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SuiteError(f"{name}: expected an integer >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise SuiteError(f"{name}: must be >= {minimum}, got {value}")
    return value


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise SuiteError(f"{name}: expected a non-empty string, got {value!r} ({type(value).__name__})")
    return value


def _list(name: str, value: Any, allow_empty: bool) -> list:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]  # a scalar is a one-element list
    if not isinstance(value, list):
        raise SuiteError(f"{name}: expected a list, got {value!r} ({type(value).__name__})")
    if not value and not allow_empty:
        raise SuiteError(f"{name}: must not be empty")
    return value


def policy_classes() -> dict:
    """The policy classes by name (``scissorhands.POLICIES``)."""
    from scissorhands import POLICIES

    return dict(POLICIES)


def parse_policy(i: int, value: Any, classes: dict) -> tuple[PolicySpec, Any]:
    """Entry ``i`` of a suite's ``policies`` (a name or ``{name, params}``) -> its spec and a policy instance.

    Raises:
        SuiteError: naming ``policies[i]``: not a name or mapping, unknown keys, unknown policy (lists the
            valid ones), unknown parameters (lists the accepted ones) or a parameter the policy rejects.
    """
    where = f"policies[{i}]"
    if isinstance(value, str):
        name, params = value, {}
    elif isinstance(value, dict):
        unknown = set(value) - {"name", "params"}
        if unknown:
            raise SuiteError(f"{where}: unknown key(s) {sorted(unknown)} (accepted: name, params)")
        name = _str(f"{where}.name", value.get("name"))
        params = value.get("params") or {}
        if not isinstance(params, dict):
            raise SuiteError(f"{where}.params: expected a mapping, got {params!r}")
    else:
        raise SuiteError(f"{where}: expected a policy name or {{name, params}}, got {value!r}")
    if name not in classes:
        raise SuiteError(f"{where}: unknown policy {name!r} (valid policies: {', '.join(sorted(classes))})")
    cls = classes[name]
    accepted = sorted(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None
    if accepted is not None:
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            raise SuiteError(
                f"{where}.params: unknown parameter(s) {unknown} for policy {name!r} (accepted: {', '.join(accepted) or 'none'})"
            )
    try:
        instance = cls(**params)
    except (TypeError, ValueError) as e:
        raise SuiteError(f"{where}.params: {e}") from None
    return PolicySpec(name, dict(params)), instance


def check_budget(field_name: str, policy_name: str, instance: Any, budget: int) -> None:
    """A budget must leave room for the recent window (budget >= recent_window + 1)."""
    recent = getattr(instance, "recent_window", None)
    if recent is not None and budget < recent + 1:
        raise SuiteError(
            f"{field_name}: budget {budget} tokens is below recent_window + 1 = {recent + 1} "
            f"for policy {policy_name!r}; use a larger budget or a smaller recent_window"
        )
    resolve = getattr(instance, "resolve", None)
    if callable(resolve):
        try:
            resolve(budget)
        except ValueError as e:
            raise SuiteError(f"{field_name}: {e} (policy {policy_name!r})") from None


def parse_suite(data: Any, source: str = "<suite>") -> Suite:
    """Validate a parsed YAML mapping into a `Suite`.

    Raises:
        SuiteError: unknown key, wrong type, ratio < 1, unknown policy (lists the valid names),
            unknown policy parameter, budget below recent_window + 1, empty list, etc.
    """
    if not isinstance(data, dict):
        raise SuiteError(f"{source}: expected a YAML mapping at the top level, got {type(data).__name__}")
    if data.get("mode", "batch") != "batch":         # serving modes: workloads.serving_suite
        raise SuiteError(f"mode: {data['mode']!r} is a serving mode; this loader reads mode 'batch' suites")
    data = {k: v for k, v in data.items() if k != "mode"}
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise SuiteError(f"{source}: unknown key(s) {unknown} (accepted: {', '.join(sorted(_FIELDS))})")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise SuiteError(f"{source}: missing required key(s) {missing}")

    kw: dict[str, Any] = {}
    kw["name"] = _str("name", data.get("name", os.path.splitext(os.path.basename(source))[0] or "suite"))
    kw["description"] = str(data.get("description", "") or "")
    for key in ("model", "dtype", "device"):
        if key in data:
            kw[key] = _str(key, data[key])
    if "dtype" in kw:
        from scissorhands.models import DTYPE_CHOICES

        if kw["dtype"] not in DTYPE_CHOICES:
            raise SuiteError(f"dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {kw['dtype']!r}")
    kw["seed"] = _int("seed", data.get("seed", 0), 0)
    kw["replicas"] = _int("replicas", data.get("replicas", 2), 1)
    try:
        kw["placement"] = parse_placement(data.get("placement"))
    except PlacementError as e:
        raise SuiteError(str(e)) from None
    for key in ("batch_sizes", "prompt_tokens", "new_tokens"):
        kw[key] = tuple(_int(f"{key}[{i}]", v, 1) for i, v in enumerate(_list(key, data[key], allow_empty=False)))
    ratios = []
    for i, v in enumerate(_list("compression_ratios", data.get("compression_ratios") or [], allow_empty=True)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise SuiteError(f"compression_ratios[{i}]: expected a number >= 1, got {v!r}")
        if v < 1:
            raise SuiteError(f"compression_ratios[{i}]: compression ratio must be >= 1, got {v}")
        ratios.append(float(v))
    kw["compression_ratios"] = tuple(ratios)
    kw["budget_tokens"] = tuple(
        _int(f"budget_tokens[{i}]", v, 1)
        for i, v in enumerate(_list("budget_tokens", data.get("budget_tokens") or [], allow_empty=True))
    )

    classes = policy_classes()
    specs, instances = [], []
    for i, v in enumerate(_list("policies", data["policies"], allow_empty=False)):
        spec, inst = parse_policy(i, v, classes)
        specs.append(spec)
        instances.append(inst)
    kw["policies"] = tuple(specs)
    if len({(s.name, json.dumps(s.params, sort_keys=True)) for s in specs}) != len(specs):
        raise SuiteError("policies: the same policy with the same params is listed twice")

    for spec, inst in zip(specs, instances):
        if spec.name == "full":
            continue
        if not ratios and not kw["budget_tokens"]:
            raise SuiteError(
                f"compression_ratios: policy {spec.name!r} needs at least one compression ratio or budget_tokens entry"
            )
        for i, b in enumerate(kw["budget_tokens"]):
            check_budget(f"budget_tokens[{i}]", spec.name, inst, b)
        for i, r in enumerate(ratios):
            for p in kw["prompt_tokens"]:
                for n in kw["new_tokens"]:
                    check_budget(f"compression_ratios[{i}] (ratio {r:g} at {p}+{n} tokens)", spec.name, inst,
                                  math.ceil((p + n) / r))
    return Suite(**kw)


def read_suite_file(path: str):
    """The parsed YAML of a suite file (any kind of suite).

    Raises:
        SuiteError: the file does not exist or is not valid YAML.
    """
    if not os.path.isfile(path):
        raise SuiteError(f"suite: file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise SuiteError(f"suite: {path} is not valid YAML: {e}") from None


def load_suite(path: str) -> Suite:
    """Read and validate a suite file.

    Raises:
        SuiteError: the file does not exist / is not valid YAML / fails validation.
    """
    return parse_suite(read_suite_file(path), source=path)
