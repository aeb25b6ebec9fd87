"""Serving suites: load sweeps against continuously batching replicas (`mode` other than `batch`).

A serving suite (YAML, `yaml.safe_load`) asks one question; `workloads.sweep` hands a suite whose
`mode` is `concurrency`, `rate` or `max_batch` (or `serving-batch`) to `workloads.serving_sweep`::

    name: serving-rate
    description: the question this suite answers
    mode: rate                    # serving-batch | concurrency | rate | max_batch | trace
    model: embedded
    policies: [full, scissorhands]
    compression_ratios: [5]       # B = ceil((max prompt + max output) / ratio) for every sequence
    budget_tokens: []
    loads: [0.5, 1, 2, 4]         # batch sizes | concurrencies | request rates (req/s); not for max_batch
    prompt_tokens: {dist: uniform, min: 128, max: 512}   # or an integer
    output_tokens: {dist: uniform, min: 16, max: 64}
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

Points are policy x budget x load, in that order, so each (policy, budget) is a series of
increasing load; the series stops (remaining points `skipped`, stop reason `saturated`) once
a point's error rate, p50 TTFT or achieved/target rate shows saturation.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from cluster.engine import EngineConfig
from workloads.loadgen import ARRIVALS, CAP_POLICIES, LengthDist, LoadConfig, TraceLoad
from workloads.suite import PolicySpec, SuiteError, check_budget, parse_policy, policy_classes, read_suite_file

SERVING_MODES = ("serving-batch", "concurrency", "rate", "max_batch", "trace")
_LOAD_MODE = {"serving-batch": "batch", "concurrency": "concurrency", "rate": "rate", "max_batch": "batch",
              "trace": "trace"}


@dataclass(frozen=True)
class Saturation:
    """When a series stops raising the load (None disables a criterion)."""

    max_error_rate: float | None = 0.05
    max_p50_ttft_s: float | None = None
    min_achieved_rate_fraction: float | None = 0.8

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
    index: int
    series: str                      # policy + budget: the points of one series share it
    policy: str
    policy_params: dict
    compression_ratio: float | None
    budget_tokens: int | None
    load: float | None               # batch size / concurrency / rate; None for max_batch
    seed: int

    @property
    def point_id(self) -> str:
        load = "max" if self.load is None else f"{self.load:g}"
        return f"{self.series}-L{load}-s{self.seed}"


@dataclass(frozen=True)
class ServingSuite:
    name: str
    mode: str
    policies: tuple[PolicySpec, ...]
    prompt_tokens: LengthDist
    output_tokens: LengthDist
    description: str = ""
    model: str = "embedded"
    dtype: str = "auto"
    device: str = "cpu"
    compression_ratios: tuple[float, ...] = ()
    budget_tokens: tuple[int, ...] = ()
    loads: tuple[float, ...] = ()
    kv_memory_limit_bytes: int | None = None
    kv_memory_fraction: float | None = None
    max_batch: int | None = None
    max_prefill_tokens: int = EngineConfig.max_prefill_tokens
    num_requests: int | None = None
    duration_s: float | None = None
    warmup_requests: int = 1
    warmup_s: float = 0.0
    request_timeout_s: float | None = None
    arrival: str = "poisson"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    cap_policy: str = "delay"
    saturation: Saturation = field(default_factory=Saturation)
    rounds: int = 2
    seed: int = 0
    replicas: int = 1
    # HTTP: drive the OpenAI-compatible server at `target` (http://HOST:PORT/v1); `model` is then the
    # served model id and `tokenizer` the model spec whose tokenizer builds the prompts (default embedded)
    target: str | None = None
    tokenizer: str | None = None
    # trace mode: replay this trace (its rows give arrivals and lengths), time offsets x the scale;
    # the point's `load` is the scale
    trace_path: str | None = None
    trace_time_scale: float = 1.0

    @property
    def max_length_tokens(self) -> int:
        return self.prompt_tokens.upper + self.output_tokens.upper

    def points(self) -> list[ServingPoint]:
        out: list[ServingPoint] = []
        loads: list[float | None] = [None] if self.mode == "max_batch" else \
            [self.trace_time_scale] if self.mode == "trace" else list(self.loads)
        for pol in self.policies:
            tag = pol.name
            if pol.params:
                tag += "@" + hashlib.sha1(json.dumps(pol.params, sort_keys=True).encode()).hexdigest()[:8]
            budgets: list[tuple[float | None, int | None]] = [(None, None)] if pol.name == "full" else \
                [(r, None) for r in self.compression_ratios] + [(None, b) for b in self.budget_tokens]
            for ratio, budget in budgets:
                series = f"{self.mode}-{tag}" + (f"-B{budget}" if budget else f"-r{ratio:g}" if ratio else "")
                for load in loads:
                    out.append(ServingPoint(len(out), series, pol.name, dict(pol.params), ratio, budget, load, self.seed))
        return out

    def engine_config(self, point: ServingPoint) -> dict:
        """`cluster.engine.EngineConfig` fields for `point`."""
        cfg = dict(policy=point.policy, policy_params=dict(point.policy_params), budget_tokens=point.budget_tokens,
                   compression_ratio=point.compression_ratio, kv_memory_limit_bytes=self.kv_memory_limit_bytes,
                   kv_memory_fraction=self.kv_memory_fraction, max_batch=self.max_batch,
                   max_prefill_tokens=self.max_prefill_tokens, max_length_tokens=self.max_length_tokens)
        return cfg

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


_FIELDS = {f.name for f in dataclasses.fields(ServingSuite)}


def _num(name: str, v: Any, *, integer: bool = False, minimum: float = 0, strict: bool = True, none: bool = True):
    if v is None and none:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
        (v > minimum if strict else v >= minimum) and (not integer or isinstance(v, int))
    if not ok:
        kind = "an integer" if integer else "a number"
        raise SuiteError(f"{name}: expected {kind} {'>' if strict else '>='} {minimum:g}"
                         f"{' or null' if none else ''}, got {v!r}")
    return v


def parse_serving_suite(data: Any, source: str = "<suite>") -> ServingSuite:
    """Validate a parsed YAML mapping into a `ServingSuite`; `SuiteError` names the field."""
    if not isinstance(data, dict):
        raise SuiteError(f"{source}: expected a YAML mapping at the top level, got {type(data).__name__}")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise SuiteError(f"{source}: unknown key(s) {unknown} (accepted: {', '.join(sorted(_FIELDS))})")
    mode = data.get("mode")
    if mode not in SERVING_MODES:
        raise SuiteError(f"mode: expected one of {', '.join(SERVING_MODES)} for a serving suite, got {mode!r}")
    for k in ("policies", "prompt_tokens", "output_tokens") if mode != "trace" else ("policies", "trace_path"):
        if k not in data:
            raise SuiteError(f"{source}: missing required key {k!r}")
    kw: dict[str, Any] = {"mode": mode}
    kw["name"] = str(data.get("name") or os.path.splitext(os.path.basename(source))[0] or "suite")
    kw["description"] = str(data.get("description") or "")
    for k in ("model", "dtype", "device", "target", "tokenizer"):
        if k in data:
            if not isinstance(data[k], str) or not data[k]:
                raise SuiteError(f"{k}: expected a non-empty string, got {data[k]!r}")
            kw[k] = data[k]
    if "target" in kw and not kw["target"].startswith(("http://", "https://")):
        raise SuiteError(f"target: expected http://HOST:PORT/v1 (an OpenAI-compatible server), got {kw['target']!r}")
    if "target" in kw and mode == "max_batch":
        raise SuiteError("target: max_batch mode needs our replicas' memory model; use concurrency, rate or serving-batch")
    if "dtype" in kw:
        from scissorhands.models import DTYPE_CHOICES

        if kw["dtype"] not in DTYPE_CHOICES:
            raise SuiteError(f"dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {kw['dtype']!r}")
    try:
        if mode == "trace":                # the trace gives arrivals and lengths
            for k in ("prompt_tokens", "output_tokens", "loads"):
                if data.get(k) is not None:
                    raise SuiteError(f"{k}: not used in mode trace (the trace's rows give arrivals and lengths)")
            kw["trace_path"] = str(data["trace_path"])
            kw["trace_time_scale"] = _num("trace_time_scale", data.get("trace_time_scale", 1.0), none=False)
            kw["prompt_tokens"], kw["output_tokens"] = TraceLoad(LoadConfig(
                mode="trace", trace_path=kw["trace_path"], trace_time_scale=kw["trace_time_scale"])).length_range()
        else:
            kw["prompt_tokens"] = LengthDist.parse("prompt_tokens", data["prompt_tokens"])
            kw["output_tokens"] = LengthDist.parse("output_tokens", data["output_tokens"])
            kw["prompt_tokens"].upper, kw["output_tokens"].upper  # noqa: B018 - bounded, for memory
    except ValueError as e:
        raise SuiteError(str(e)) from None
    classes = policy_classes()
    pols = data["policies"] if isinstance(data["policies"], list) else [data["policies"]]
    if not pols:
        raise SuiteError("policies: must not be empty")
    specs, insts = zip(*(parse_policy(i, v, classes) for i, v in enumerate(pols)))
    kw["policies"] = tuple(specs)
    ratios = tuple(float(_num(f"compression_ratios[{i}]", v, minimum=1, strict=False, none=False))
                   for i, v in enumerate(data.get("compression_ratios") or []))
    budgets = tuple(_num(f"budget_tokens[{i}]", v, integer=True, minimum=1, strict=False, none=False)
                    for i, v in enumerate(data.get("budget_tokens") or []))
    kw["compression_ratios"], kw["budget_tokens"] = ratios, budgets
    max_len = kw["prompt_tokens"].upper + kw["output_tokens"].upper
    for spec, inst in zip(specs, insts):
        if spec.name == "full":
            continue
        if not ratios and not budgets:
            raise SuiteError(f"compression_ratios: policy {spec.name!r} needs a compression ratio or budget_tokens")
        for i, b in enumerate(budgets):
            check_budget(f"budget_tokens[{i}]", spec.name, inst, b)
        for i, r in enumerate(ratios):
            check_budget(f"compression_ratios[{i}]", spec.name, inst, math.ceil(max_len / r))
    loads = data.get("loads")
    if mode == "max_batch":
        if loads:
            raise SuiteError("loads: not used in mode max_batch (the batch is found from the memory limit)")
        if data.get("kv_memory_limit_bytes") is None and data.get("kv_memory_fraction") is None:
            raise SuiteError("kv_memory_limit_bytes: mode max_batch needs a KV memory limit (or kv_memory_fraction)")
        if kw["prompt_tokens"].dist != "fixed" or kw["output_tokens"].dist != "fixed":
            raise SuiteError("prompt_tokens, output_tokens: mode max_batch needs fixed lengths (integers)")
    elif mode != "trace":
        if not isinstance(loads, list) or not loads:
            raise SuiteError(f"loads: mode {mode} needs a non-empty list of "
                             f"{'request rates (req/s)' if mode == 'rate' else 'batch sizes' if mode == 'serving-batch' else 'concurrencies'}")
        integer = mode != "rate"
        kw["loads"] = tuple(_num(f"loads[{i}]", v, integer=integer, none=False) for i, v in enumerate(loads))
        if list(kw["loads"]) != sorted(kw["loads"]):
            raise SuiteError("loads: must increase (a series stops raising the load at saturation)")
    for k, integer, minimum, strict in (("kv_memory_limit_bytes", True, 1, False), ("kv_memory_fraction", False, 0, True),
                                        ("max_batch", True, 1, False), ("num_requests", True, 1, False),
                                        ("duration_s", False, 0, True), ("warmup_s", False, 0, False),
                                        ("request_timeout_s", False, 0, True), ("burstiness", False, 0, True),
                                        ("max_concurrency", True, 1, False), ("max_prefill_tokens", True, 1, False),
                                        ("warmup_requests", True, 0, False), ("rounds", True, 1, False),
                                        ("seed", True, 0, False), ("replicas", True, 1, False)):
        if k in data:
            v = _num(k, data[k], integer=integer, minimum=minimum, strict=strict,
                     none=k not in ("burstiness", "warmup_s", "max_prefill_tokens", "warmup_requests", "rounds",
                                    "seed", "replicas"))
            if v is not None:
                kw[k] = v
    if kw.get("kv_memory_fraction") is not None and kw["kv_memory_fraction"] > 1:
        raise SuiteError(f"kv_memory_fraction: expected a number in (0, 1], got {kw['kv_memory_fraction']}")
    if kw.get("kv_memory_limit_bytes") is not None and kw.get("kv_memory_fraction") is not None:
        raise SuiteError("kv_memory_limit_bytes, kv_memory_fraction: give one of them, not both")
    if mode not in ("max_batch", "trace") and kw.get("num_requests") is None and kw.get("duration_s") is None:
        raise SuiteError("num_requests, duration_s: give at least one bound")
    for k, accepted in (("arrival", ARRIVALS), ("cap_policy", CAP_POLICIES)):
        if k in data:
            if data[k] not in accepted:
                raise SuiteError(f"{k}: unknown {data[k]!r} (accepted: {', '.join(accepted)})")
            kw[k] = data[k]
    sat = data.get("saturation") or {}
    if not isinstance(sat, dict) or set(sat) - {f.name for f in dataclasses.fields(Saturation)}:
        raise SuiteError("saturation: expected a mapping of max_error_rate, max_p50_ttft_s, min_achieved_rate_fraction")
    kw["saturation"] = Saturation(**{k: _num(f"saturation.{k}", v, strict=False) for k, v in sat.items()})
    suite = ServingSuite(**kw)
    try:                                  # every point's load config must be valid now, not mid-sweep
        for p in suite.points():
            suite.load_config(p, max_batch=1)
    except ValueError as e:
        raise SuiteError(str(e)) from None
    return suite


def suite_mode(path: str) -> str:
    """The `mode` of a suite file (`batch` when absent or unreadable: the batch loader reports errors)."""
    try:
        data = read_suite_file(path)
    except (SuiteError, OSError):
        return "batch"
    return str(data.get("mode", "batch")) if isinstance(data, dict) else "batch"


def load_serving_suite(path: str) -> ServingSuite:
    """Read and validate a serving suite file (errors: `SuiteError`, as `workloads.suite.load_suite`)."""
    return parse_serving_suite(read_suite_file(path), source=path)
