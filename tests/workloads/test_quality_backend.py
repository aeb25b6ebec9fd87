"""Quality rows of an engine backend (``engine: openvino``; workloads/quality/backend.py): its policies run the passkey
evaluation through the backend (a stub here), skip the log-likelihood evaluations, are refused at load where they
cannot run, and the report says which rows have no log-likelihood measure; in the slow tier, the real OpenVINO
GenAI pipeline retrieves the passkey on the embedded model's export."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import yaml

from replica import backends
from scissorhands.models import load_tokenizer
from scissorhands.testing import tiny_llama
from tests.peer_stub import real_runtime_or_skip
from workloads.core import results as res
from workloads.core.suite import SuiteError
from workloads.kinds import parse_suite
from workloads.quality import passkey as pk
from workloads.quality import runner
from workloads.quality.points import run_point
from workloads.quality.report import markdown

OV_FULL = {"name": "full", "engine": "openvino"}
OV_EVICT = {"name": "openvino_eviction", "engine": "openvino"}
SUITE = {
    "kind": "quality",
    "model": "embedded",
    "policies": ["full", "scissorhands", OV_FULL, OV_EVICT],
    "compression_ratios": [2, 4],
    "quantized": [{"compression_ratio": 4, "kv_bits": 4}],
    "perplexity": {"tokens": 64, "windows": 1},
    "passkey": {"lengths": [128], "depths": [0, 1], "trials": 2, "digits": 5},
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


class StubEngine:
    """The backend protocol's part a quality point uses: answers each prompt with the passkey its needle states,
    except the request ids in ``wrong`` (answered ``00000``) and ``failing`` (failed with the peer's message)."""

    built: list = []
    wrong: set = set()
    failing: set = set()
    tokenizer = None

    def __init__(self, model, config, *, eos_token_id=None, replica_id="", **_):
        self.config, self.eos_token_id, self.pending, self.steps = config, eos_token_id, [], 0
        StubEngine.built.append(self)

    def submit(self, request, on_done, on_token=None):
        self.pending.append((request, on_done))

    def step(self) -> bool:
        if not self.pending:
            return False
        self.steps += 1
        req, done = self.pending.pop(0)
        if req.request_id in self.failing:
            done(SimpleNamespace(request_id=req.request_id, output_ids=[], error="SnapKV window", error_kind="error"))
            return True
        key = re.search(r"pass key is (\d+)", self.tokenizer.decode(req.prompt_ids)).group(1)
        key = "00000" if req.request_id in self.wrong else key
        ids = self.tokenizer(" " + key + ". The", add_special_tokens=False)["input_ids"][: req.max_new_tokens]
        done(SimpleNamespace(request_id=req.request_id, output_ids=ids, error=None, error_kind=None))
        return True

    def stats(self) -> dict:
        ev = self.config.policy == "openvino_eviction"
        return {
            "budget_tokens": 96 if ev else None,
            "kv_memory_limit_bytes": 1000,
            "openvino_kv_precision": "u8",
            "openvino_max_cache_size_rounding": "ceil(136 / 2) = 68 -> 96 (32-token blocks)" if ev else None,
        }


@pytest.fixture
def stub(monkeypatch, tokenizer):
    monkeypatch.setitem(backends.BACKENDS, "openvino", StubEngine)
    monkeypatch.setattr(StubEngine, "built", [])
    monkeypatch.setattr(StubEngine, "wrong", set())
    monkeypatch.setattr(StubEngine, "failing", set())
    monkeypatch.setattr(StubEngine, "tokenizer", tokenizer)
    return StubEngine


def test_backend_policies_get_passkey_points_only_at_their_ratios_without_kv_bits():
    points = parse_suite(SUITE).points()
    ov = [p for p in points if p.engine == "openvino"]
    assert {(p.kind, p.policy, p.compression_ratio, p.kv_bits) for p in ov} == {
        ("passkey", "full", 1.0, None),
        ("passkey", "openvino_eviction", 2.0, None),
        ("passkey", "openvino_eviction", 4.0, None),
    }
    ours = [p for p in points if p.engine is None]
    assert {p.kind for p in ours} == {"perplexity", "passkey"} and (4.0, 4) in {
        (p.compression_ratio, p.kv_bits) for p in ours
    }
    ids = [p.point_id for p in points]
    assert len(set(ids)) == len(ids)  # openvino's full apart from ours
    assert any(i.startswith("passkey-openvino-full-r1-") for i in ids)
    assert all(p.identity["engine"] == "openvino" for p in ov) and all("engine" not in p.identity for p in ours)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"passkey": None}, r"policies\[2\]: engine 'openvino' gives no log-likelihoods.*: passkey"),
        (
            {"policies": [{"name": "openvino_eviction"}]},
            r"policies\[0\].engine: 'openvino_eviction' runs on engine: openvino only",
        ),
        (
            {"policies": [{"name": "scissorhands", "engine": "openvino"}]},
            r"^policies\[0\]\.name: engine 'openvino' runs full, openvino_eviction, not 'scissorhands'",
        ),
        (
            {"policies": [{**OV_EVICT, "params": {"aggregation_mode": "MAX"}}]},
            r"^policies\[0\]\.params\.aggregation_mode: 'MAX'; accepted: SUM, NORM_SUM",
        ),
        (
            {"policies": [{**OV_EVICT, "params": {"window": 4}}]},
            r"^policies\[0\]\.params: openvino_eviction takes no window; accepted: aggregation_mode",
        ),
        (
            {"policies": [{**OV_FULL, "params": {"start_size": 32}}]},
            r"policies\[0\].params: unknown parameter\(s\) \['start_size'\] for policy 'full'",
        ),
    ],
)
def test_backend_policies_it_cannot_run_are_refused_at_load_naming_the_field(change, message):
    with pytest.raises(SuiteError, match=message):
        parse_suite({**SUITE, **change})


def test_a_suite_it_cannot_run_exits_2_and_records_nothing(tmp_path, capsys):
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({**SUITE, "passkey": None}))
    assert runner.main([str(path), "--local", "--pushgateway", "off", "--results-dir", str(tmp_path / "out")]) == 2
    assert "policies[2]: engine 'openvino' gives no log-likelihoods" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_backend_passkey_point_runs_the_same_prompts_through_the_engine_and_scores_them(stub, tokenizer):
    point = next(p for p in parse_suite(SUITE).points() if p.engine == "openvino" and p.compression_ratio == 2.0)
    stub.wrong = {"q1", "q2"}  # depth 0's second trial, depth 1's first
    out = run_point(tiny_llama(0), tokenizer, point)
    (engine,) = stub.built
    n_new = pk.answer_tokens(tokenizer, 5)
    cfg = engine.config
    assert (cfg.engine, cfg.policy, cfg.compression_ratio, cfg.max_length_tokens) == (
        "openvino",
        "openvino_eviction",
        2.0,
        128 + n_new,
    )
    assert (cfg.kv_layout, cfg.scheduler, cfg.kv_limit_full_sequences) == ("paged", "mixed", 4)
    assert engine.eos_token_id is None and engine.steps == 4  # greedy to the length, one request a step here
    assert out["correct_trials"] == [1, 0, 0, 1] and out["accuracy_by_depth"] == [0.5, 0.5]
    assert out["accuracy"] == 0.5 and out["correct"] == 2
    assert out["engine"] == "openvino" and out["budget_tokens"] == 96 and out["openvino_kv_precision"] == "u8"
    assert out["openvino_max_cache_size_rounding"].endswith("-> 96 (32-token blocks)")
    # every row of one seed gets the same prompts (built before the engine is chosen): the full row here
    full = pk.evaluate_passkey(tiny_llama(0), tokenizer, "full", 128, [0.0, 1.0], 2, 5, engine="openvino")
    assert full["passkeys"] == out["passkeys"] and full["needle_positions"] == out["needle_positions"]
    assert full["budget_tokens"] is None and stub.built[-1].config.compression_ratio is None


def test_a_request_the_backend_fails_fails_the_point_with_its_message(stub, tokenizer):
    stub.failing = {"q3"}
    with pytest.raises(RuntimeError, match=r"engine 'openvino': request 3 failed \(error\): SnapKV window"):
        pk.evaluate_passkey(tiny_llama(0), tokenizer, "full", 128, [0.0, 1.0], 2, 5, engine="openvino")


def test_kv_bits_on_a_backend_is_refused_naming_the_field(stub, tokenizer):
    with pytest.raises(ValueError, match="kv_bits: engine 'openvino' runs no kv_bits of ours; accepted: null"):
        pk.evaluate_passkey(tiny_llama(0), tokenizer, "full", 128, [0.0], 1, 5, kv_bits=4, engine="openvino")


def test_backend_rows_are_labelled_apart_and_paired_with_our_full_cache():
    suite = parse_suite(SUITE)
    by = {(p.engine, p.policy, p.compression_ratio): p for p in suite.points() if p.kind == "passkey"}
    fields = runner.KIND.record_fields(suite, by[("openvino", "full", 1.0)], None)
    assert fields["engine"] == "openvino" and fields["policy_label"] == "openvino:full"
    assert runner.KIND.record_fields(suite, by[(None, "full", 1.0)], None)["policy_label"] == "full"

    def rec(pid, policy, label, engine, ratio, right, evaluation="passkey"):
        return {
            "status": "ok", "point_id": pid, "evaluation": evaluation, "policy": policy, "policy_label": label,
            "engine": engine, "compression_ratio": ratio, "kv_bits": None, "length_tokens": 128,
            "depths": [0.0, 1.0], "trials": 2, "digits": 5, "correct_trials": right,
            "accuracy": sum(right) / 4, "accuracy_by_depth": [sum(right[:2]) / 2, sum(right[2:]) / 2],
            "accuracy_ci95_low": 0.0, "accuracy_ci95_high": 1.0, "model_id": "m",
        }  # fmt: skip

    records = [
        rec("a", "full", "full", None, 1.0, [1, 1, 1, 1]),
        rec("b", "full", "openvino:full", "openvino", 1.0, [1, 1, 0, 1]),
        rec("c", "openvino_eviction", "openvino:openvino_eviction", "openvino", 2.0, [0, 0, 1, 1]),
    ]
    md = markdown(records)
    assert "No perplexity, few-shot accuracy or perplexity gate for openvino:full, openvino:openvino_eviction" in md
    # both backend rows are compared with our full cache (b/c = right only with ours / only with the row)
    assert re.search(r"\| openvino:full\s+\|\s+-0\.250 \(p=1, 1/0\)", md), md
    assert re.search(r"\| openvino:openvino_eviction\s+\|\s+-\s+\|\s+-0\.500 \(p=0\.5, 2/0\)", md), md
    assert "No perplexity" not in markdown(records[:1])


# ---------------------------------------------------------------------------------------------- the real backend


@pytest.mark.slow
def test_the_real_pipeline_retrieves_the_passkey_full_and_evicting(tmp_path):
    """A local run of a suite with OpenVINO's full cache and its eviction at 2x, 3 trials of 256 tokens each (depths
    0, 0.5, 1), float32: the full cache retrieves 3 of 3 (ours retrieves 9 of 9 at 256 tokens)."""
    real_runtime_or_skip()
    torch.set_num_threads(2)
    suite = {
        "kind": "quality",
        "name": "ov",
        "model": "embedded",
        "dtype": "float32",
        "replicas": 1,
        "policies": [OV_FULL, OV_EVICT],
        "compression_ratios": [2],
        "passkey": {"lengths": [256], "depths": [0, 0.5, 1], "trials": 1, "digits": 5},
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "results"
    assert runner.main([str(path), "--local", "--pushgateway", "off", "--results-dir", str(out), "--run-id", "r"]) == 0
    recs = {r["policy"]: r for r in res.read_records(str(out / "r" / "points.jsonl"))}
    full, ev = recs["full"], recs["openvino_eviction"]
    assert full["status"] == "ok" and full["engine"] == "openvino" and full["policy_label"] == "openvino:full"
    assert full["correct_trials"] == [1, 1, 1], full["answers"]
    assert full["openvino_inference_precision"] == "f32" and full["openvino_genai_version"].startswith("2026.")
    assert ev["status"] == "ok" and ev["budget_tokens"] == 160  # ceil(263 / 2) = 132 -> 160 (32-token blocks)
    assert ev["openvino_eviction"]["max_cache_size"] == 160 and len(ev["correct_trials"]) == 3
    table = (out / "r" / "table.md").read_text()
    assert "No perplexity, few-shot accuracy or perplexity gate for openvino:full, openvino:openvino_eviction" in table
