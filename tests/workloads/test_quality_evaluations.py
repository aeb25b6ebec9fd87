"""The quality evaluations registry (workloads.quality.evaluations): suite sections, point ids, runs, progress lines."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from scissorhands.testing import tiny_llama
from workloads.core.suite import SuiteError, validate_suite
from workloads.quality import points as quality_points
from workloads.quality.evaluations import (
    EVALUATIONS,
    Evaluation,
    Fewshot,
    Passkey,
    Perplexity,
    Persistence,
    Section,
    TurnRecall,
)
from workloads.quality.report import markdown, write_report
from workloads.quality.suite import QualityPoint, QualitySuite

SUITES = Path(__file__).resolve().parents[2] / "workloads" / "suites"

#: Per shipped quality suite: point count, sha1 (first 16 hex digits) of the ids joined by newlines, first and last
#: id. Computed from the suites before the evaluations became one registry: resume compares these ids, so a
#: refactoring must not move one.
POINT_IDS = {
    "quality.yaml": (
        70,
        "50a89f92638e1ce5",
        "ppl-full-r1-t192x1-s0-423d366b",
        "fewshot-openbookqa-snapkv-r5-q4-d5-s0-2c29a4b0",
    ),
    "quality_ablation_drop1.yaml": (
        4,
        "5c48ec8bf3beccce",
        "ppl-scissorhands-r2-t512x1-s0-856fe9f8",
        "ppl-scissorhands-r5-t512x1-s0-096fde3d",
    ),
    "quality_full.yaml": (
        265,
        "b14919bd0f94fb3e",
        "ppl-full-r1-t2048x8-s0-42c57ed1",
        "fewshot-copa-snapkv-r5-q4-dall-s0-1769d975",
    ),
    "quality_passkey.yaml": (
        46,
        "63b8d1247ade67e3",
        "passkey-full-r1-l256-n4-k5-s0-500fb357",
        "passkey-snapkv-r4-q4-l512-n4-k5-s0-9ce19950",
    ),
    "quality_passkey_cpu.yaml": (
        30,
        "716027e2c266b447",
        "passkey-full-r1-l256-n3-k5-s0-4a0efb75",
        "passkey-snapkv-r4-l512-n3-k5-s0-8e742f53",
    ),
    "quality_passkey_openvino.yaml": (
        6,
        "af83927d64d70c53",
        "passkey-full-r1-l256-n3-k5-s0-4a0efb75",
        "passkey-openvino-openvino_eviction-r4-l256-n3-k5-s0-41605e0f",
    ),
    "quality_turn_recall.yaml": (  # 3 sessions and the three reuse ways since the ways were built
        9,
        "7d7e54ad227d87e3",
        "turnrecall-full-r1-k8-n3-none-s0-4e9c0048",
        "turnrecall-scissorhands-r5-k8-n3-shared_prefix-s0-2c0898a5",
    ),
    "quality_report.yaml": (
        91,
        "4a0c44ae51ce11c7",
        "ppl-full-r1-t512x1-s0-6dec90fd",
        "fewshot-copa-snapkv-r5-q4-d20-s0-86af1c0a",
    ),
}


def _suite(path: Path) -> QualitySuite:
    return validate_suite({"quality": QualitySuite}, yaml.safe_load(path.read_text()), str(path))


def _parse(data: dict) -> QualitySuite:
    return validate_suite({"quality": QualitySuite}, data, "test.yaml")


def test_every_shipped_quality_suite_is_pinned():
    assert sorted(p.name for p in SUITES.glob("quality*.yaml")) == sorted(POINT_IDS)


@pytest.mark.parametrize("name", sorted(POINT_IDS))
def test_point_ids_of_the_shipped_suites_did_not_move(name):
    ids = [p.point_id for p in _suite(SUITES / name).points()]
    count, digest, first, last = POINT_IDS[name]
    assert (len(ids), ids[0], ids[-1]) == (count, first, last)
    assert hashlib.sha1("\n".join(ids).encode()).hexdigest()[:16] == digest
    assert len(set(ids)) == len(ids)


def test_the_suite_has_one_section_per_registered_evaluation():
    assert list(EVALUATIONS) == ["perplexity", "persistence", "passkey", "turn_recall", "fewshot"]  # run order
    sections = {
        "perplexity": Perplexity,
        "persistence": Persistence,
        "passkey": Passkey,
        "turn_recall": TurnRecall,
        "fewshot": Fewshot,
    }
    for name, evaluation in EVALUATIONS.items():
        assert evaluation.section is sections[name] and issubclass(evaluation.section, Section)
        assert QualitySuite.model_fields[name].default is None  # omitted: skipped
    with pytest.raises(
        SuiteError, match=r"^suite: needs at least one of perplexity, persistence, passkey, turn_recall, fewshot$"
    ):
        _parse({"kind": "quality", "policies": ["full"]})
    with pytest.raises(SuiteError, match=r"perplexity\.windows"):
        _parse({"kind": "quality", "policies": ["full"], "perplexity": {"windows": 0}})


def test_points_follow_the_registry_order_and_tags():
    suite = _parse(
        {
            "kind": "quality",
            "policies": ["full", "scissorhands"],
            "compression_ratios": [2, 4],
            "quantized": [{"compression_ratio": 4, "kv_bits": 4}],
            "fewshot": {"tasks": ["copa"], "docs": 3, "compression_ratios": [4]},
            "passkey": {"lengths": [128], "depths": [0.5], "trials": 2, "digits": 4, "compression_ratios": [2]},
            "persistence": {"tokens": 64, "windows": 2, "split_fraction": 0.25},
            "perplexity": {"tokens": 32, "windows": 1},
        }
    )
    tags = [p.point_id.rsplit("-", 1)[0] for p in suite.points()]
    assert tags == [
        "ppl-full-r1-t32x1-s0",
        "ppl-full-r1-q4-t32x1-s0",
        "ppl-scissorhands-r2-t32x1-s0",
        "ppl-scissorhands-r4-t32x1-s0",
        "ppl-scissorhands-r4-q4-t32x1-s0",
        "persistence-t64x2-f0.25-s0",
        "passkey-full-r1-l128-n2-k4-s0",
        "passkey-full-r1-q4-l128-n2-k4-s0",
        "passkey-scissorhands-r2-l128-n2-k4-s0",
        "passkey-scissorhands-r4-q4-l128-n2-k4-s0",
        "fewshot-copa-full-r1-d3-s0",
        "fewshot-copa-full-r1-q4-d3-s0",
        "fewshot-copa-scissorhands-r4-d3-s0",
        "fewshot-copa-scissorhands-r4-q4-d3-s0",
    ]
    assert [p.index for p in suite.points()] == list(range(14))


def test_ok_line_of_each_evaluation():
    assert (
        quality_points.ok_line({"evaluation": "perplexity", "perplexity": 12.34567, "budget_tokens": 64})
        == "perplexity 12.346, budget 64 tok"
    )
    assert (
        quality_points.ok_line({"evaluation": "fewshot", "accuracy": 0.66666, "docs_scored": 3})
        == "accuracy 0.667 over 3 docs"
    )
    assert (
        quality_points.ok_line(
            {
                "evaluation": "passkey",
                "accuracy": 0.75,
                "correct": 6,
                "trials": 4,
                "depths": [0, 1],
                "length_tokens": 256,
            }
        )
        == "passkey accuracy 0.75 (6/8) at 256 tokens"
    )
    assert (
        quality_points.ok_line({"evaluation": "turn_recall", "turns": [2, 8], "sessions": 4, "correct_by_turn": [4, 1]})
        == "turn recall k=2: 4/4, k=8: 1/4"
    )
    assert (
        quality_points.ok_line({"evaluation": "persistence", "persistence_ratio_mean": 0.9})
        == "mean persistence ratio 0.9"
    )
    with pytest.raises(
        ValueError,
        match=r"^evaluation: unknown evaluation 'bleu' \(valid: perplexity, persistence, "
        r"passkey, turn_recall, fewshot\)$",
    ):
        quality_points.ok_line({"evaluation": "bleu"})


def test_run_point_dispatches_through_the_registry():
    model = tiny_llama(seed=0)
    point = QualityPoint(
        index=0, kind="perplexity", policy="scissorhands", compression_ratio=2.0, settings={"tokens": 16, "windows": 2}
    )
    out = quality_points.run_point(model, None, point)
    # 16 tokens at 2x: ceil(16 / 2) = 8, raised to the budget floor and capped at the window (not compressed)
    assert out["tokens_scored"] == 32 and out["windows"] == 2 and out["budget_tokens"] == 16
    assert out["perplexity"] > 1 and out["torch_threads"] >= 1
    with pytest.raises(ValueError, match=r"^kind: unknown evaluation 'bleu'"):
        quality_points.run_point(model, None, QualityPoint(index=0, kind="bleu"))


def test_a_new_evaluation_is_one_entry(monkeypatch):
    """Registered once, an evaluation runs, is tagged and reports its progress line with nothing else changed."""

    def run(model, tokenizer, point, device):
        return {"vocab": int(model.config.vocab_size), "device": str(device), "ratio": float("nan")}

    echo = Evaluation(
        section=Section,
        points=lambda suite, section: iter([{}]),
        tag=lambda p: f"echo-s{p.seed}",
        run=run,
        ok_line=lambda rec: f"echo of {rec['vocab']} ids",
    )
    monkeypatch.setitem(EVALUATIONS, "echo", echo)
    point = QualityPoint(index=0, kind="echo", seed=3, identity={"kind": "echo"})
    out = quality_points.run_point(tiny_llama(seed=0), None, point)
    assert out["vocab"] == 128 and out["device"] == "cpu" and out["ratio"] is None  # NaN made JSON-safe
    assert point.point_id.startswith("echo-s3-")
    assert quality_points.ok_line({"evaluation": "echo", **out}) == "echo of 128 ids"


def _ppl(policy, ratio, value):
    return {
        "status": "ok",
        "evaluation": "perplexity",
        "point_id": f"ppl-{policy}-{ratio}",
        "policy": policy,
        "compression_ratio": ratio,
        "kv_bits": None,
        "perplexity": value,
        "budget_tokens": 10,
        "tokens_scored": 20,
        "windows": 1,
        "settings": {"tokens": 20},
        "seed": 0,
        "model_id": "tiny-llama",
        "dtype": "float32",
        "device": "cpu",
        "cpu_model": "Test CPU",
        "torch_threads": 2,
        "git_commit": "abc123",
    }


def test_table_starts_with_its_conditions_line(tmp_path):
    records = [_ppl("full", 1.0, 10.0), _ppl("scissorhands", 2.0, 11.5)]
    md = markdown(records)
    assert md.startswith(
        "Conditions: model tiny-llama; dtype float32; device cpu; CPU Test CPU; 2 torch thread(s) "
        "per replica; commit abc123\n\n### Perplexity (lower is better)"
    )
    assert "| scissorhands |" in md and "11.500" in md
    report = write_report(tmp_path, records)
    assert report.table == md and report.files[0].read_text(encoding="utf-8") == md
    assert markdown([]).startswith("Conditions: model -;") and markdown([]).endswith("No finished points.\n")
