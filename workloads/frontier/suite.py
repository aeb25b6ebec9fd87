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
    kv_memory_limit:             # one limit for every point (`workloads.core.suite.KVMemoryLimit`): exactly one of
      full_sequences: 2          #   the bytes the full cache needs for this many sequences of prompt + new tokens,
                                 #   in the run's dtype (resolved on the replica)
      # bytes: 50000000          #   or an absolute limit in bytes
    perplexity_windows: 4        # held-out windows of prompt_tokens + new_tokens tokens each (>= 2 for an interval)
    quality_gate:                # the report's gate (`workloads.frontier.gate`); not part of a point's identity:
      max_perplexity_increase: 0.01  # pass at perplexity <= the full cache's x (1 + this); a number > 0

``full`` never evicts, so it runs once (ratio 1). Absolute ``budget_tokens`` are refused: both measurements
derive B from the ratio and the same length (prompt + new tokens), so a point's two numbers describe one cache.
Every error is a `workloads.core.suite.SuiteError` naming the field.

``perplexity_windows`` gives every point its 95% interval (one window: none); ``quality_gate`` changes no
measurement, only the report, so changing it re-reports a run (``--resume``) without re-running a point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from workloads.core.suite import (
    KVMemoryLimit,
    PositiveFloat,
    PositiveInt,
    SuiteBase,
    SuiteError,
    budget_tag,
    point_id,
)
from workloads.frontier.gate import DEFAULT_MAX_PERPLEXITY_INCREASE


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
    #: Frontier points compress by a ratio, never by an absolute budget.
    budget_tokens: ClassVar[None] = None


class QualityGate(BaseModel):
    """``quality_gate``: a point passes when its perplexity is at most the full cache's (same run, dtype and KV
    limit) times ``1 + max_perplexity_increase`` (`workloads.frontier.gate.gate_passed`); 0.01 = within 1%."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_perplexity_increase: PositiveFloat = DEFAULT_MAX_PERPLEXITY_INCREASE

    @model_validator(mode="before")
    @classmethod
    def _a_mapping(cls, value: Any) -> Any:
        if not isinstance(value, (dict, QualityGate)):
            raise ValueError(
                f"quality_gate: expected {{max_perplexity_increase: X}} (X a number > 0; 0.01 = perplexity within "
                f"1% of the full cache's), got {value!r}"
            )
        return value

    @field_validator("max_perplexity_increase", mode="before")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"quality_gate.max_perplexity_increase: expected a number > 0 (0.01 = within 1%), got {value!r}"
            )
        return value


class FrontierSuite(SuiteBase):
    """A validated frontier suite (see the module docstring for the YAML form)."""

    kind: Literal["frontier"]
    name: Annotated[str, Field(min_length=1, pattern=r"^[^/]+$")]
    prompt_tokens: PositiveInt = 512
    new_tokens: PositiveInt = 128
    kv_memory_limit: KVMemoryLimit = KVMemoryLimit(full_sequences=2)
    perplexity_windows: PositiveInt = 4
    quality_gate: QualityGate = QualityGate()

    _policies_default: ClassVar[str | None] = "all"

    @model_validator(mode="after")
    def _ratios_only(self) -> "FrontierSuite":
        if self.budget_tokens:
            raise SuiteError(
                "budget_tokens: frontier suites compress by compression_ratios (B = ceil((prompt_tokens "
                "+ new_tokens) / ratio) in both measurements)"
            )
        return self

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
                    policy=pol.name,
                    policy_params=dict(pol.params),
                    compression_ratio=ratio,
                    prompt_tokens=self.prompt_tokens,
                    new_tokens=self.new_tokens,
                    kv_limit_full_sequences=lim.full_sequences,
                    kv_memory_limit_bytes=lim.bytes,
                    perplexity_windows=self.perplexity_windows,
                    seed=self.seed,
                )
                limit_tag = f"f{lim.full_sequences}" if lim.bytes is None else f"m{lim.bytes}"
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
                    )
                )
        return out
