"""PNG plots of serving points (matplotlib, Agg): written next to the results.

* `throughput_vs_batch.png`: output tokens/s vs batch size (static batches / the max-batch sweep),
  one line per policy and budget;
* `latency_vs_rate.png`: p50 and p99 end-to-end latency vs achieved request rate, per policy;
* `pareto_tokens_per_user.png`: tokens/s per user (1 / mean TPOT) vs output tokens/s per replica,
  every ok point, with each policy's Pareto front;
* `ttft_per_turn.png` (sessions suites): p50 and p99 TTFT by turn index, per point;
* `attainment_vs_rate.png` (capacity suites): SLO attainment vs Poisson rate per series, every probe (an ``oom``
  or ``error`` one at 0, as its search counted it), the target line and each series' capacity marked.
"""

from __future__ import annotations

import collections
from pathlib import Path

from workloads.core.results import save_figure
from workloads.serving.capacity import RATE_UNITS, rate_of, rate_unit


def _label(r: dict) -> str:
    """A series' legend entry: its policy and ratio or budget, and what else sets its series apart (the engine when
    not ours, prefix caching, `kv_reuse`, the digest of explicit policy params), so two series never share a line."""
    if r.get("policy") == "full":
        label = "full"
    elif r.get("compression_ratio"):
        label = f"{r['policy']} x{r['compression_ratio']:g}"
    else:
        label = f"{r['policy']} B={r.get('budget_tokens_requested') or r.get('budget_tokens')}"
    engine, cfg = r.get("engine"), r.get("point_config") or {}
    if engine not in (None, "ours") and not label.startswith(engine):
        label = f"{engine} {label}"
    if cfg.get("enable_prefix_caching") is not None:
        label += " + prefix caching" if cfg["enable_prefix_caching"] else " no prefix caching"
    if cfg.get("kv_reuse") is not None:
        label += f", kv_reuse {cfg['kv_reuse']}"
    digest = (r.get("series") or "").partition("@")[2]
    if digest:  # two entries of one policy with other params: the digest the series id carries
        label += f" @{digest.split('-')[0]}"
    return label


def _series(records, x_key, y_key):
    out = collections.defaultdict(list)
    for r in records:
        x, y = r.get(x_key), r.get(y_key)
        if r.get("status") == "ok" and x is not None and y is not None:
            out[_label(r)].append((x, y))
    return {k: sorted(v) for k, v in out.items()}


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated (higher x and higher y are better), sorted by x."""
    front, best_y = [], float("-inf")
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if y > best_y:
            front.append((x, y))
            best_y = y
    return sorted(front)


def _capacity_label(label: str, row: dict) -> str:
    """A series' legend entry: its capacity, or what its search found instead."""
    lo, hi, status, unit = rate_of(row, "lo"), rate_of(row, "hi"), row["capacity_status"], rate_unit(row)
    if status == "ok":
        return f"{label}: {rate_of(row):.3g} {unit}"
    if status == "below_min_rate":
        return f"{label}: < {hi:.3g} {unit} (below the bracket)"
    if status == "at_least_max_rate":
        return f"{label}: >= {lo:.3g} {unit} (the bracket's top passed)"
    bracket = f"{'-' if lo is None else format(lo, '.3g')} to {'-' if hi is None else format(hi, '.3g')} {unit}"
    return f"{label}: {status.replace('_', ' ')}, {bracket}"


def _finish(fig, ax, path: Path, grid_which: str = "major") -> Path:
    """Grid and legend on `ax`; save the figure to `path`."""
    ax.grid(alpha=0.3, which=grid_which)
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


def plot_capacity(records: list[dict], capacity: list[dict], out_dir: Path):
    """`attainment_vs_rate.png`: attainment vs rate per series (log rate axis), the target, each capacity marked
    (a star and a dotted line at it); None when no series has a probe."""
    import matplotlib.pyplot as plt

    unit = rate_unit(capacity[0]) if capacity else "req/s"
    key = RATE_UNITS[unit][1]  # a search over sessions is judged by the session SLO attainment
    probes = collections.defaultdict(list)
    for r in records:
        if r.get("series") is not None and r.get("load") is not None:
            attained = r.get(key) if r.get("status") == "ok" else 0.0
            probes[r["series"]].append((r["load"], attained, r.get("status") == "ok", r))
    if not any(probes.get(row["series"]) for row in capacity):
        return None
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    names = [_label(probes[row["series"]][0][3]) for row in capacity if probes.get(row["series"])]
    for row in capacity:
        pts = sorted((p for p in probes.get(row["series"], []) if p[1] is not None), key=lambda p: p[0])
        if not pts:
            continue
        # two series of one policy (prefix caching, a way of session reuse) are told apart by their series names
        name = _label(pts[0][3])
        label = _capacity_label(row["series"].split("-", 1)[-1] if names.count(name) > 1 else name, row)
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        bad = [p for p in pts if not p[2]]
        if bad:
            ax.scatter([p[0] for p in bad], [p[1] for p in bad], marker="x", color=line.get_color(), zorder=3)
        cap = rate_of(row)
        if cap is not None:
            at = next((p[1] for p in pts if p[0] == cap), None)
            ax.axvline(cap, color=line.get_color(), ls=":", alpha=0.8)
            if at is not None:
                ax.scatter([cap], [at], marker="*", s=160, color=line.get_color(), zorder=4)
    targets = sorted({row["capacity_target_attainment"] for row in capacity})
    for t in targets:
        ax.axhline(t, color="0.3", ls="--", lw=1, label=f"target {t:g}")
    ax.set_xscale("log")
    sessions = unit == "sessions/s"
    ax.set_xlabel("session start rate (sessions/s)" if sessions else "Poisson request rate (requests/s)")
    ax.set_ylabel("session SLO attainment (share of sessions)" if sessions else "SLO attainment (share of requests)")
    ax.set_ylim(-0.03, 1.05)
    ax.set_title(f"SLO attainment vs {'session' if sessions else 'request'} rate; capacity marked (star)")
    return _finish(fig, ax, out_dir / "attainment_vs_rate.png", grid_which="both")


def _plot_batch(plt, records: list[dict], out_dir: Path) -> list[Path]:
    """Throughput vs batch size (max_batch and serving-batch points), when the records have it."""
    batch = []
    for r in records:
        if r.get("mode") == "max_batch":
            batch.append({**r, "_batch": r.get("max_batch_size")})
        elif r.get("mode") == "serving-batch":
            batch.append({**r, "_batch": r.get("load")})
    if not _series(batch, "_batch", "output_throughput_tok_per_s"):
        return []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in _series(batch, "_batch", "output_throughput_tok_per_s").items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for x, y in pts:
            ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title("Throughput vs batch size under one KV memory limit")
    return [_finish(fig, ax, out_dir / "throughput_vs_batch.png")]


def _p99_beside(ax, p50_line, xs: list, ys: list, label: str) -> None:
    """A series' p99 drawn dashed in the colour of its p50 line (`p50_line`), so the two read as one series."""
    ax.plot(xs, ys, marker="^", ls="--", color=p50_line.get_color(), label=f"{label} p99")


def _plot_latency(plt, records: list[dict], out_dir: Path) -> list[Path]:
    """Latency (p50, p99) vs the achieved request rate (rate and capacity points), when the records have it."""
    rate = [r for r in records if r.get("mode") in ("rate", "capacity")]  # a capacity probe is a rate point
    if not _series(rate, "achieved_rate_req_per_s", "e2e_latency_p50_s"):
        return []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in _series(rate, "achieved_rate_req_per_s", "e2e_latency_p50_s").items():
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{label} p50")
        p99 = _series([r for r in rate if _label(r) == label], "achieved_rate_req_per_s", "e2e_latency_p99_s")
        for pts99 in p99.values():
            _p99_beside(ax, line, [p[0] for p in pts99], [p[1] for p in pts99], label)
    ax.set_xlabel("achieved request rate (requests/s)")
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title("Latency vs request rate")
    return [_finish(fig, ax, out_dir / "latency_vs_rate.png")]


def _plot_pareto(plt, records: list[dict], out_dir: Path) -> list[Path]:
    """Per-user speed (1 / mean TPOT) vs throughput per replica, with each series' Pareto front."""
    pareto = []
    for r in records:
        tpot, thr = r.get("tpot_mean_s"), r.get("output_throughput_tok_per_s")
        if r.get("status") == "ok" and tpot and thr is not None:
            pareto.append({**r, "_user": 1.0 / tpot, "_replica": thr / max(1, r.get("replicas") or 1)})
    if not pareto:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in _series(pareto, "_user", "_replica").items():
        sc = ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=label, s=18)
        front = pareto_front(pts)
        ax.plot([p[0] for p in front], [p[1] for p in front], color=sc.get_facecolor()[0], alpha=0.8)
    ax.set_xlabel("tokens/s per user (1 / mean TPOT)")
    ax.set_ylabel("output tokens/s per replica")
    ax.set_title("Pareto: per-user speed vs replica throughput")
    return [_finish(fig, ax, out_dir / "pareto_tokens_per_user.png")]


def _plot_ttft_per_turn(plt, records: list[dict], out_dir: Path) -> list[Path]:
    """TTFT p50 (solid) and p99 (dashed) per turn index of each sessions point (`workloads.load.sessions`)."""
    sessions = [r for r in records if r.get("status") == "ok" and r.get("turns")]
    if not sessions:
        return []
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in sessions:
        turns = [t for t in r["turns"] if t.get("ttft_p50_s") is not None]
        load = r.get("load")
        label = _label(r) if load is None else f"{_label(r)} at {load:g} sessions/s"
        (line,) = ax.plot([t["turn"] for t in turns], [t["ttft_p50_s"] for t in turns], marker="o", label=label)
        _p99_beside(ax, line, [t["turn"] for t in turns], [t["ttft_p99_s"] for t in turns], label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # turns are whole numbers
    ax.set_xlabel("turn index")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT per turn (p50 solid, p99 dashed)")
    return [_finish(fig, ax, out_dir / "ttft_per_turn.png")]


def write_plots(records: list[dict], out_dir: Path, capacity: list[dict] | None = None) -> list[Path]:
    """Write the plots the records allow (`capacity`: a capacity suite's searches, for `plot_capacity`); return
    their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written = _plot_batch(plt, records, out_dir) + _plot_latency(plt, records, out_dir)
    written += _plot_pareto(plt, records, out_dir)
    written += _plot_ttft_per_turn(plt, records, out_dir)
    if capacity:
        path = plot_capacity(records, capacity, out_dir)
        if path is not None:
            written.append(path)
    return written
