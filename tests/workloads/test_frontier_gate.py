"""The frontier's quality on real values (workloads/frontier/gate.py, report.py): the t quantile against published
critical values, the perplexity interval and the paired ratio interval on known NLLs, the quality gate's
decisions on crafted records (the null case included), the first line of table.md, the suite's `quality_gate`
errors, and a plot whose labels do not overlap where the points crowd together."""

import itertools
import math

import pytest

from workloads.core.suite import SuiteError
from workloads.frontier.gate import (
    gate_passed,
    gate_resolved,
    mean_interval,
    paired_ratio_interval,
    perplexity_interval,
    t_quantile,
)
from workloads.frontier.report import GATE_GID, LABEL_GID, figure, frontier_rows, headline, markdown
from workloads.kinds import parse_suite


@pytest.mark.parametrize(
    "df,critical",  # two-sided 95% (the 97.5% quantile), e.g. NIST/SEMATECH e-Handbook table 1.3.6.7.2
    [(1, 12.706204736), (2, 4.302652730), (3, 3.182446305), (4, 2.776445105), (7, 2.364624252), (30, 2.042272456)],
)
def test_t_quantile_matches_published_critical_values(df, critical):
    assert t_quantile(df) == pytest.approx(critical, abs=1e-8)


def test_t_quantile_refuses_bad_arguments():
    with pytest.raises(ValueError, match="df must be an integer >= 1"):
        t_quantile(0)
    with pytest.raises(ValueError, match=r"confidence must be in \(0, 1\)"):
        t_quantile(3, 1.0)


def test_perplexity_interval_is_exp_of_the_t_interval_of_mean_nll_per_token():
    nll = [3.0, 3.2, 3.4, 3.6]  # nats per token, one per window: mean 3.3, sample sd sqrt(0.2 / 3)
    half = 3.182446305284 * math.sqrt(0.2 / 3) / math.sqrt(4)  # t(0.975, 3 df) s / sqrt(n) = 0.410852
    low, high = perplexity_interval(nll)
    assert low == pytest.approx(math.exp(3.3 - half), rel=1e-10) == pytest.approx(17.97798, rel=1e-6)
    assert high == pytest.approx(math.exp(3.3 + half), rel=1e-10) == pytest.approx(40.88863, rel=1e-6)
    assert low < math.exp(3.3) < high  # the point's perplexity = exp(mean NLL), inside its interval
    assert perplexity_interval([3.3, 3.3, 3.3]) == pytest.approx((math.exp(3.3), math.exp(3.3)))


def test_one_window_gives_no_interval_rather_than_zero_width():
    assert perplexity_interval([3.3]) == (None, None)
    assert mean_interval([3.3]) == (None, None)
    assert paired_ratio_interval([3.31], [3.3]) == (None, None)


def test_interval_inputs_that_are_not_numbers_are_refused_by_position():
    with pytest.raises(ValueError, match="values: need at least one value"):
        perplexity_interval([])
    with pytest.raises(ValueError, match=r"values\[1\]: expected a finite number, got nan"):
        perplexity_interval([3.0, math.nan])


def test_paired_ratio_interval_uses_the_per_window_differences():
    full = [3.0, 3.5, 2.8]  # the text's variation (0.7 nats) cancels in the differences
    point = [3.01, 3.52, 2.83]  # d = 0.01, 0.02, 0.03: mean 0.02, sd 0.01
    half = 4.302652729749 * 0.01 / math.sqrt(3)
    low, high = paired_ratio_interval(point, full)
    assert low == pytest.approx(math.exp(0.02 - half), rel=1e-9) and high == pytest.approx(math.exp(0.02 + half))
    assert paired_ratio_interval(point, full[:2]) == (None, None)  # not the same windows
    assert paired_ratio_interval(None, full) == (None, None)  # a record from before windows were recorded
    assert gate_resolved((low, high), 0.01) is False  # 1.01 lies inside (0.995, 1.046)
    assert gate_resolved((low, high), 0.05) is True and gate_resolved((None, None), 0.01) is None


def test_gate_passes_at_most_the_full_caches_perplexity_times_one_plus_the_bound():
    assert gate_passed(20.19, 20.0, 0.01) is True  # +0.95%
    assert gate_passed(20.0 * 1.01, 20.0, 0.01) is True  # the bound itself passes
    assert gate_passed(20.21, 20.0, 0.01) is False  # +1.05%
    assert gate_passed(19.0, None, 0.01) is None  # nothing to compare with: null, not False
    with pytest.raises(ValueError, match="max_perplexity_increase must be a finite number > 0, got 0"):
        gate_passed(20.0, 20.0, 0)


def _rec(pid, policy, ratio, tok_s, nll, **extra):
    """An ok frontier record with per-window NLLs (nats per token) and what the point derives from them."""
    low, high = perplexity_interval(nll)
    return {
        "point_id": pid,
        "status": "ok",
        "policy": policy,
        "compression_ratio": ratio,
        "budget_tokens": None if ratio is None else 8,
        "batch_size": 2 if ratio is None else 6,
        "output_throughput_tok_per_s": tok_s,
        "output_tok_per_cpu_s": tok_s / 2,
        "decode_tokens_per_s": tok_s,
        "perplexity": math.exp(sum(nll) / len(nll)),
        "perplexity_ci_low": low,
        "perplexity_ci_high": high,
        "window_nll_per_token": list(nll),
        "perplexity_windows": len(nll),
        "kv_cache_bytes": 1 << 20,
        "max_batch_verified": True,
        "kv_memory_limit_bytes": 2 << 20,
        "prompt_tokens": 24,
        "new_tokens": 8,
        "perplexity_tokens_scored": 32 * len(nll),
        "dtype": "bfloat16",
        **extra,
    }


FULL_NLL = [3.0, 3.2, 3.4, 3.6]  # perplexity exp(3.3) = 27.11


def _shifted(nats):
    return [v + nats for v in FULL_NLL]


def test_gate_decisions_on_crafted_records_with_the_null_case():
    records = [
        _rec("full", "full", None, 10.0, FULL_NLL),
        _rec("h2o4", "h2o", 4.0, 40.0, _shifted(0.02)),  # perplexity x exp(0.02) = +2.0%: fails
        _rec("tova4", "tova", 4.0, 30.0, _shifted(0.005)),  # +0.5%: passes
        _rec("snap4", "snapkv", 4.0, 35.0, _shifted(-0.01)),  # better than full: passes
        _rec("f32", "h2o", 2.0, 20.0, FULL_NLL, dtype="float32", kv_memory_limit_bytes=4 << 20),  # no full here
        {"point_id": "bad", "status": "error", "error": "boom", "policy": "random"},
    ]
    rows = {r["point_id"]: r for r in frontier_rows(records)}
    assert {k: r["quality_gate_passed"] for k, r in rows.items()} == {
        "full": True,
        "h2o4": False,
        "tova4": True,
        "snap4": True,
        "f32": None,  # its group (float32, 4 MiB) has no full-cache point
        "bad": None,
    }
    assert rows["h2o4"]["quality_gate_perplexity"] == pytest.approx(math.exp(3.3) * 1.01)
    assert rows["h2o4"]["perplexity_vs_full"] == pytest.approx(math.exp(0.02))
    assert rows["h2o4"]["perplexity_ratio_ci_low"] == pytest.approx(math.exp(0.02))  # every window +0.02: no spread
    assert rows["h2o4"]["quality_gate_resolved"] is True
    assert rows["tova4"]["quality_gate_max_perplexity_increase"] == 0.01  # the default
    looser = {r["point_id"]: r["quality_gate_passed"] for r in frontier_rows(records, max_perplexity_increase=0.05)}
    assert looser["h2o4"] is True
    carried = [dict(r, quality_gate_max_perplexity_increase=0.05) for r in records]  # as the runner records it
    assert {r["point_id"]: r["quality_gate_passed"] for r in frontier_rows(carried)} == looser


def test_table_first_line_names_the_fastest_configuration_that_passes_the_gate():
    rows = frontier_rows(
        [
            _rec("full", "full", None, 10.0, FULL_NLL),
            _rec("h2o4", "h2o", 4.0, 40.0, _shifted(0.02)),  # fastest, but fails
            _rec("snap4", "snapkv", 4.0, 35.0, _shifted(-0.01)),
            _rec("tova4", "tova", 4.0, 30.0, _shifted(0.005)),
        ]
    )
    first = markdown(rows).splitlines()[0]
    assert first == headline(rows)
    assert first.startswith(
        "**Fastest within the quality gate: snapkv x4** (policy snapkv, compression ratio 4x) at 35.0 output tok/s, "
        "3.50x the full cache's 10.0 (max batch 6 vs 2); perplexity 26.843 (95% CI "
    )
    assert first.endswith(
        ", -1.00% vs full (paired 95% CI of the ratio 0.9900-0.9900). Gate: perplexity at most 1% above the full "
        "cache's 27.113, i.e. <= 27.384."
    )
    assert (
        "| h2o x4 | bfloat16 | 8 | 6 | 40.0 | 20.00 | 40.0 | 27.660 | 18.341-41.715 | 1.0202 (1.0202-1.0202) | fail |"
        in (markdown(rows))
    )


def test_table_first_line_says_when_no_compressed_configuration_passed():
    rows = frontier_rows([_rec("full", "full", None, 10.0, FULL_NLL), _rec("h2o4", "h2o", 4.0, 40.0, _shifted(0.02))])
    assert markdown(rows).splitlines()[0] == (
        "**No compressed configuration beats the full cache within the quality gate** (perplexity at most 1% above "
        "the full cache's 27.113, i.e. <= 27.384): 0 of 1 passed; fastest passing is the full cache at 10.0 output "
        "tok/s."
    )


def test_table_first_line_says_when_there_is_no_full_cache_to_judge_by():
    rows = frontier_rows([_rec("h2o4", "h2o", 4.0, 40.0, FULL_NLL[:1])])  # one window, no full point
    assert rows[0]["quality_gate_passed"] is None and rows[0]["perplexity_ci_low"] is None
    assert (
        markdown(rows).splitlines()[0].startswith("**No quality gate: no full-cache point finished to compare with**")
    )
    assert "| 20.086 | - | - | - |" in markdown(rows)  # no interval, no ratio, no gate decision


@pytest.mark.parametrize(
    "gate,message",
    [
        ({"max_perplexity_increase": 0}, r"quality_gate.max_perplexity_increase: Input should be greater than 0"),
        ({"max_perplexity_increase": -0.01}, r"quality_gate.max_perplexity_increase: Input should be greater than 0"),
        ({"max_perplexity_increase": "1%"}, r"quality_gate.max_perplexity_increase: expected a number > 0"),
        ({"max_perplexity_increase": True}, r"quality_gate.max_perplexity_increase: expected a number > 0"),
        ({"max_perplexity_increase": math.inf}, r"quality_gate.max_perplexity_increase: Input should be a finite"),
        ({"max_increase": 0.01}, r"quality_gate.max_increase: unknown key"),
        (0.01, r"quality_gate: expected \{max_perplexity_increase: X\}"),
    ],
)
def test_invalid_quality_gates_name_the_field(gate, message):
    base = {"kind": "frontier", "model": "tiny-llama", "policies": ["full"], "prompt_tokens": 24, "new_tokens": 8}
    with pytest.raises(SuiteError, match=message):
        parse_suite({**base, "quality_gate": gate})
    assert parse_suite(base).quality_gate.max_perplexity_increase == 0.01  # the default: within 1%


def test_plot_labels_do_not_overlap_where_points_crowd_together():
    """Measured: the full cache and the x2 points all sat at 50-60 tok/s and perplexity within 1%, and their
    labels overlapped; every label's box (as drawn) must now be clear of every other."""
    policies = ["scissorhands", "h2o", "tova", "streaming_llm", "knorm", "snapkv", "random"]
    records = [_rec("full", "full", None, 52.0, FULL_NLL)]
    for i, p in enumerate(policies):  # x2 crowd round the full cache; x5 far to the right, two of them broken
        records.append(_rec(f"{p}2", p, 2.0, 53.0 + 0.8 * i, _shifted(0.001 * (i - 2))))
        records.append(_rec(f"{p}5", p, 5.0, 130.0 + 8 * i, _shifted(0.9 if i >= 5 else 0.01 * i)))
    rows = frontier_rows(records)
    fig = figure(rows)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    left = fig.axes[0]
    crowd = [left.transData.transform((r["output_throughput_tok_per_s"], r["perplexity"])) for r in rows]
    assert min(math.dist(a, b) for a, b in itertools.combinations(crowd, 2)) < 5  # pixels: points do crowd
    labels = [t for ax in fig.axes for t in ax.texts if t.get_gid() == LABEL_GID]
    assert len(labels) == len(records) + len(records) - 2  # every point on the left, all but the broken two zoomed
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
    for (a, p), (b, q) in itertools.combinations(boxes, 2):
        assert not (p.x0 < q.x1 and q.x0 < p.x1 and p.y0 < q.y1 and q.y0 < p.y1), f"{a!r} overlaps {b!r}"
    gate_lines = [line for ax in fig.axes for line in ax.lines if line.get_gid() == GATE_GID]
    assert [line.get_ydata()[0] for line in gate_lines] == pytest.approx([math.exp(3.3) * 1.01] * 2)
