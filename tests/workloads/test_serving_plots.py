"""The serving plots (`workloads/serving/plots.py`): one line and one legend entry per series, so series that differ
only in prefix caching, `kv_reuse`, the engine or their policy params are never drawn as one."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the Agg backend

from workloads.serving import plots  # noqa: E402


def _record(series: str, policy: str, ratio=None, engine="ours", load=0.5, **point_config) -> dict:
    return {
        "series": series,
        "policy": policy,
        "compression_ratio": ratio,
        "engine": engine,
        "point_config": point_config,
        "status": "ok",
        "load": load,
        "tpot_mean_s": 0.1,
        "output_throughput_tok_per_s": 10.0,
        "replicas": 1,
        "turns": [{"turn": 0, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0}, {"turn": 1, "ttft_p50_s": 0.5, "ttft_p99_s": 1.0}],
    }


SESSIONS = [
    _record("sessions-full", "full"),
    _record("sessions-full+prefix", "full", enable_prefix_caching=True),
    _record("sessions-scissorhands+reuse-none-r5", "scissorhands", 5, kv_reuse="none"),
    _record("sessions-scissorhands+reuse-session_state-r5", "scissorhands", 5, kv_reuse="session_state"),
    _record("rate-openvino-full", "full", engine="openvino"),
    _record("rate-scissorhands@0123abcd-r5", "scissorhands", 5),
    _record("rate-scissorhands@99ffee00-r5", "scissorhands", 5),
]


def test_series_that_differ_only_in_reuse_engine_or_params_get_their_own_legend_entries():
    labels = [plots._label(r) for r in SESSIONS]
    assert labels == [
        "full",
        "full + prefix caching",
        "scissorhands x5, kv_reuse none",
        "scissorhands x5, kv_reuse session_state",
        "openvino full",
        "scissorhands x5 @0123abcd",
        "scissorhands x5 @99ffee00",
    ]
    assert len(plots._series(SESSIONS, "tpot_mean_s", "output_throughput_tok_per_s")) == len(SESSIONS)


def test_the_ttft_per_turn_plot_has_one_legend_entry_per_series_and_whole_turn_ticks(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(plots, "_finish", lambda fig, ax, path, grid_which="major": seen.setdefault(path.name, ax))
    plots._plot_ttft_per_turn(plt, SESSIONS[:4], tmp_path)
    ax = seen["ttft_per_turn.png"]
    legend = [line.get_label() for line in ax.get_lines()]
    assert len(set(legend)) == len(legend) == 8  # p50 and p99 of each of the 4 series
    assert "full + prefix caching at 0.5 sessions/s" in legend
    fig = ax.get_figure()
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_xticks())
    plt.close(fig)
