"""Confidence for quality numbers (workloads.quality.stats) and their place in points and the report."""

from __future__ import annotations

import math

import pytest

from workloads.quality import stats


def test_wilson_interval_known_values():
    # 8 of 10: the textbook Wilson interval (0.4902, 0.9433); 0 of 10: (0, 0.2775); 10 of 10: (0.7225, 1)
    lo, hi = stats.wilson_interval(8, 10)
    assert lo == pytest.approx(0.49016, abs=1e-4) and hi == pytest.approx(0.94331, abs=1e-4)
    assert stats.wilson_interval(0, 10) == (0.0, pytest.approx(0.27753, abs=1e-4))
    lo, hi = stats.wilson_interval(10, 10)
    assert lo == pytest.approx(0.72247, abs=1e-4) and hi == 1.0
    # about +-3 points needs about 1,000 documents at 50%
    lo, hi = stats.wilson_interval(500, 1000)
    assert (hi - lo) / 2 == pytest.approx(0.0309, abs=1e-3)
    with pytest.raises(ValueError, match="correct"):
        stats.wilson_interval(11, 10)
    with pytest.raises(ValueError, match="^n: expected an integer >= 1, got 0$"):
        stats.wilson_interval(0, 0)


@pytest.mark.parametrize(
    "b, c, p",
    [
        (1, 5, 2 * (1 + 6) / 2**6),  # 0.21875 by hand: 2 (C(6,0) + C(6,1)) / 64
        (0, 6, 2 / 2**6),  # 0.03125
        (5, 1, 2 * 7 / 64),  # symmetric
        (2, 2, 1.0),  # capped at 1
        (0, 0, 1.0),  # no discordant pair
        (0, 10, 2 / 1024),
        (3, 12, 2 * (1 + 15 + 105 + 455) / 2**15),
    ],
)
def test_mcnemar_exact_by_hand(b, c, p):
    assert stats.mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)


def test_paired_accuracy_counts_discordant_documents():
    full = {1: True, 2: True, 3: False, 4: True, 5: False, 9: True}
    point = {1: True, 2: False, 3: True, 4: False, 5: False, 7: True}  # 7 and 9 are not shared
    d = stats.paired_accuracy(full, point)
    assert d["docs_paired"] == 5
    assert (d["only_reference_right"], d["only_other_right"]) == (2, 1)
    assert d["accuracy_diff"] == pytest.approx(-1 / 5)
    assert d["mcnemar_p"] == pytest.approx(1.0)  # 2 (1 + 3) / 8 = 1
    with pytest.raises(ValueError, match="share no document"):
        stats.paired_accuracy({1: True}, {2: True})


def test_spread():
    s = stats.spread([1.0, 2.0, 4.0])
    assert s["mean"] == pytest.approx(7 / 3) and s["min"] == 1.0 and s["max"] == 4.0 and s["n"] == 3
    assert s["std"] == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert stats.spread([3.0])["std"] is None


def test_perplexity_points_report_windows_and_spread():
    import torch

    from scissorhands.testing import tiny_llama
    from workloads.quality.perplexity import heldout_windows, perplexity, window_nll

    model = tiny_llama(seed=0)
    windows = heldout_windows(None, 24, 3, seed=0, vocab_size=128)
    out = perplexity(model, windows, "scissorhands", 3)
    per = [math.exp(window_nll(model, w, "scissorhands", 3)["nll_sum"] / 24) for w in windows]
    assert out["windows"] == 3 and out["tokens_per_window"] == 24 and out["tokens_scored"] == 72
    assert out["window_perplexity"] == pytest.approx(per, rel=1e-9)
    assert out["window_perplexity_std"] == pytest.approx(float(torch.tensor(per, dtype=torch.float64).std()))
    assert out["window_perplexity_min"] == min(per) and out["window_perplexity_max"] == max(per)
    assert not out["one_token_per_call"]
    assert perplexity(model, windows[:1], "full")["window_perplexity_std"] is None


def _fewshot(policy, ratio, right, bits=None, task="copa"):
    n = len(right)
    lo, hi = stats.wilson_interval(sum(right), n)
    return {
        "status": "ok",
        "evaluation": "fewshot",
        "point_id": f"{task}-{policy}-{ratio}-{bits}",
        "task": task,
        "policy": policy,
        "policy_label": policy,
        "compression_ratio": ratio,
        "kv_bits": bits,
        "accuracy": sum(right) / n,
        "accuracy_ci95_low": lo,
        "accuracy_ci95_high": hi,
        "docs_scored": n,
        "primary_metric": "acc_raw",
        "doc_ids": list(range(100, 100 + n)),
        "correct_primary": right,
        "model_id": "m",
    }


def test_report_gives_intervals_and_the_paired_test(tmp_path):
    from workloads.quality.report import markdown, write_report

    full = [1] * 8 + [0] * 2
    worse = [0] * 6 + [1] * 2 + [0] * 2  # right only with full: 6; only with it: 0
    records = [
        _fewshot("full", 1.0, full),
        _fewshot("scissorhands", 5.0, worse),
        _fewshot("scissorhands", 5.0, full, bits=4),
    ]
    md = markdown(records)
    assert "0.800 [0.49, 0.94]" in md  # Wilson 8/10
    assert "-0.600 (p=0.031, 6/0)" in md  # McNemar: 2 / 2^6
    assert "+0.000 (p=1, 0/0)" in md  # 4-bit: the same answers
    report = write_report(tmp_path, records)
    assert (tmp_path / "accuracy.png").stat().st_size > 1000 and report.files[0] == tmp_path / "table.md"


# -- what a document count can resolve, before a run ---------------------------------------------------
def test_wilson_half_width_matches_the_interval():
    from workloads.quality.stats import wilson_half_width

    low, high = stats.wilson_interval(10, 20)
    assert wilson_half_width(20) == pytest.approx((high - low) / 2, abs=1e-12)  # 0.5: the continuous form is exact
    assert wilson_half_width(20) == pytest.approx(0.2007, abs=1e-4)
    assert wilson_half_width(95) == pytest.approx(0.0986, abs=1e-4)  # COPA's whole scorable set
    assert wilson_half_width(500) == pytest.approx(0.0437, abs=1e-4)  # OpenBookQA's
    assert wilson_half_width(100, 0.9) < wilson_half_width(100, 0.5)
    with pytest.raises(ValueError, match="n must be"):
        wilson_half_width(0)
    with pytest.raises(ValueError, match="accuracy"):
        wilson_half_width(10, 1.5)


def test_docs_for_half_width_is_the_fewest_documents_that_reach_it():
    from workloads.quality.stats import docs_for_half_width, wilson_half_width

    n = docs_for_half_width(0.03)
    assert n == 1064 and wilson_half_width(n) <= 0.03 < wilson_half_width(n - 1)
    assert docs_for_half_width(0.03, 0.7) == 894
    with pytest.raises(ValueError, match="half_width"):
        docs_for_half_width(0)


def test_precision_line_says_what_a_task_can_resolve():
    from workloads.quality.fewshot import precision_line

    assert precision_line("copa", 20, available=95) == (
        "copa: 20 of 95 documents -> 95% interval +-0.201 at 50% accuracy; the whole set gives +-0.099, "
        "so +-0.03 (~1,064 documents) is out of reach on this task"
    )
    assert precision_line("piqa", 200, available=1838) == (
        "piqa: 200 of 1838 documents -> 95% interval +-0.069 at 50% accuracy; +-0.03 needs 1,064 (docs: 1064 or null)"
    )
    assert precision_line("winogrande", None, available=1267) == (
        "winogrande: 1267 of 1267 documents -> 95% interval +-0.027 at 50% accuracy"
    )
