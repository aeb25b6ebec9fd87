"""Batch suites (`kind: batch`): static batches, the paper's setting; one point per policy x budget x shape.

    kind: batch
    name: smoke
    description: the question this suite answers
    model: embedded
    policies: [full, scissorhands]
    compression_ratios: [2, 5]   # budget B = ceil((prompt + new) / ratio)
    batch_sizes: [1, 4, 16]
    prompt_tokens: [512]
    new_tokens: [64]             # output length, the same name in every suite and record
    seed: 0
    replicas: 2

(the shared keys: `workloads.core.suite`). Points are policy x budget (every ratio and every absolute budget) x
batch size x prompt tokens x new tokens; `full` runs once per batch/prompt/new combination, not once per budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from replica.common.rules import PositiveInt
from replica.static_batch import BatchSpec
from workloads.core.suite import SuiteBase, budget_tag, point_id


@dataclass(frozen=True)
class BatchPoint:
    """One static batch of a batch suite.

    `compression_ratio` is None for absolute budgets and for `full`; `budget_tokens` is the
    requested absolute budget (None when derived from the ratio, or for `full`). `identity` holds
    every setting that changes the point's numbers (model, dtype, device, policy and parameters,
    budget, shape, seed); `point_id` is derived from it.
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
    point_id: str
    identity: dict

    def spec(self) -> BatchSpec:
        """The `replica.static_batch.BatchSpec` that `replica.static_batch.ModelReplica.run_batch` takes (the
        batch settings; not the index, id or identity, which only the records use)."""
        return BatchSpec(
            policy=self.policy,
            policy_params=dict(self.policy_params),
            compression_ratio=self.compression_ratio,
            budget_tokens=self.budget_tokens,
            batch_size=self.batch_size,
            prompt_tokens=self.prompt_tokens,
            new_tokens=self.new_tokens,
            seed=self.seed,
        )


class BatchSuite(SuiteBase):
    """A batch suite (`kind: batch`; see the module docstring for the YAML form)."""

    kind: Literal["batch"]
    batch_sizes: Annotated[tuple[PositiveInt, ...], Field(min_length=1)]
    prompt_tokens: Annotated[tuple[PositiveInt, ...], Field(min_length=1)]
    new_tokens: Annotated[tuple[PositiveInt, ...], Field(min_length=1)]

    _list_fields = SuiteBase._list_fields + ("batch_sizes", "prompt_tokens", "new_tokens")

    def budget_lengths(self) -> list[int]:
        return sorted({p + n for p in self.prompt_tokens for n in self.new_tokens})

    def context_lengths(self) -> list[tuple[str, int]]:
        p, n = max(self.prompt_tokens), max(self.new_tokens)
        return [(f"prompt_tokens ({p}) + new_tokens ({n})", p + n)]

    def points(self) -> list[BatchPoint]:
        """Expand into points, in suite order (batch, prompt, new, policy, budget)."""
        out: list[BatchPoint] = []
        for batch in self.batch_sizes:
            for prompt in self.prompt_tokens:
                for new in self.new_tokens:
                    for pol in self.policies:
                        for ratio, budget in self.budgets(pol):
                            ident = dict(
                                self.identity(),
                                **pol.point_fields(ratio),
                                budget_tokens=budget,
                                batch_size=batch,
                                prompt_tokens=prompt,
                                new_tokens=new,
                                seed=self.seed,
                            )
                            tag = f"{pol.tag()}{budget_tag(ratio, budget)}-b{batch}-p{prompt}-n{new}-s{self.seed}"
                            out.append(
                                BatchPoint(
                                    len(out),
                                    pol.name,
                                    dict(pol.params),
                                    ratio,
                                    budget,
                                    batch,
                                    prompt,
                                    new,
                                    self.seed,
                                    point_id(tag, ident),
                                    ident,
                                )
                            )
        return out
