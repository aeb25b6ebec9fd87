"""Frontier report: the Pareto frontier of throughput against perplexity, a PNG and its Markdown table.

``python -m workloads.frontier.report results/<run_id>`` (re)writes, next to the run's ``points.jsonl``:

* ``frontier.png``: one point per policy and compression ratio, x = output tok/s at the point's own max batch
  under the run's one KV memory limit, y = perplexity of held-out text (log scale when it spans more than 3x); the
  points on the Pareto frontier are ringed and joined; a second panel zooms on the points within
  `ZOOM_PERPLEXITY_FACTOR` of the lowest perplexity.
* ``table.md``: the conditions (model, dtype, CPU, threads, limit, lengths) and one row per point, frontier
  points marked, sorted by output tok/s.

Points are compared only within one dtype and one KV limit in bytes: a run resolves ``dtype: auto`` once, but
records of runs that resolved differently (or of older runs) may be reported together; the report then says so
first and draws one frontier per group.

A point is on the frontier when no other point is at least as fast (output tok/s) and at most as perplexed
with one of the two strictly better (`pareto_front`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from workloads.core import results as res

MIB = 1024 * 1024


def pareto_front(points: list[tuple[float, float]]) -> list[bool]:
    """Which of ``points`` = [(throughput, perplexity), ...] are not dominated (higher throughput and lower
    perplexity are better): ``out[i]`` is False exactly when some ``j`` has ``t_j >= t_i`` and ``p_j <= p_i``
    with one of them strict. Equal points are all on the frontier.

    Raises:
        ValueError: a value is not a finite number.
    """
    import math

    for i, (t, p) in enumerate(points):
        if not (isinstance(t, (int, float)) and isinstance(p, (int, float)) and math.isfinite(t) and math.isfinite(p)):
            raise ValueError(f"points[{i}]: throughput and perplexity must be finite numbers, got {(t, p)!r}")
    return [not any(tj >= ti and pj <= pi and (tj > ti or pj < pi) for tj, pj in points) for ti, pi in points]


def _label(r: dict) -> str:
    name = r.get("policy_label") or r.get("policy") or "?"
    return name if r.get("compression_ratio") is None else f"{name} x{r['compression_ratio']:g}"


def _group(r: dict) -> tuple:
    """Points are comparable only at one dtype and one KV limit in bytes (``dtype: auto`` resolves per replica)."""
    return (r.get("dtype"), r.get("kv_memory_limit_bytes"))


def frontier_rows(records) -> list[dict]:
    """The latest record of every point, ok ones with ``on_frontier`` set, sorted by output tok/s (fastest
    first; failed points last). The frontier is taken within each group of one dtype and one limit in bytes
    (`_group`): a run whose replicas resolved ``dtype: auto`` differently has one frontier per dtype."""
    latest = list(res.latest_by_point(records).values())
    ok = [r for r in latest if r.get("status") == "ok"]
    on = {}
    for g in dict.fromkeys(_group(r) for r in ok):
        members = [r for r in ok if _group(r) == g]
        on.update(
            zip(
                (r["point_id"] for r in members),
                pareto_front([(r["output_throughput_tok_per_s"], r["perplexity"]) for r in members]),
            )
        )
    rows = [dict(r, on_frontier=on[r["point_id"]], label=_label(r)) for r in ok]
    rows.sort(key=lambda r: -r["output_throughput_tok_per_s"])
    return rows + [dict(r, on_frontier=None, label=_label(r)) for r in latest if r.get("status") != "ok"]


def _conditions(rows: list[dict]) -> str:
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return "No point finished."
    first = ok[0]

    def distinct(key):
        return ", ".join(str(v) for v in dict.fromkeys(r.get(key) for r in ok))

    groups = list(dict.fromkeys(_group(r) for r in ok))
    mixed = (
        ""
        if len(groups) == 1
        else (
            f"**Not one comparison: the points ran in {len(groups)} settings (dtype, KV limit in bytes): "
            + "; ".join(f"{d}, {b} B" for d, b in groups)
            + " (`dtype: auto` resolved differently on the replicas); "
            "each has its own frontier. Force `dtype:` in the suite.** "
        )
    )
    limit = first["kv_memory_limit_bytes"]
    full_seq = (first.get("point_config") or {}).get("kv_limit_full_sequences")
    return mixed + (
        f"Conditions: model {first.get('model')} ({first.get('model_id')}), dtype {distinct('dtype')} "
        f"({distinct('dtype_reason')}), CPU {distinct('cpu')}, {distinct('torch_threads')} torch thread(s) per "
        f"replica, replicas {distinct('replica_id')}, git commit {first.get('git_commit')}. KV memory limit "
        f"{limit} B ({limit / MIB:.3g} MiB"
        + (f" = {full_seq} full-cache sequences" if full_seq else "")
        + f"); every request {first['prompt_tokens']} prompt tokens of {first.get('text_source', 'load-test text')} "
        f"(the same prompts for every point) + {first['new_tokens']} new tokens; perplexity over "
        f"{first['perplexity_tokens_scored']} held-out tokens; budget B = ceil(({first['prompt_tokens']} + {first['new_tokens']}) / ratio) in both. Points ran "
        "one after another on the replicas (not interleaved): on a shared machine their timings carry its load; "
        "output tokens per CPU-second is less sensitive to it."
    )


COLUMNS = [  # (header with unit, key, format)
    ("policy", "label", "s"),
    ("dtype", "dtype", "s"),
    ("B (tok)", "budget_tokens", "d"),
    ("max batch", "batch_size", "d"),
    ("output (tok/s)", "output_throughput_tok_per_s", ".1f"),
    ("output (tok/CPU-s)", "output_tok_per_cpu_s", ".2f"),
    ("decode (tok/s)", "decode_tokens_per_s", ".1f"),
    ("perplexity", "perplexity", ".3f"),
    ("peak KV (MiB)", "kv_cache_mib", ".2f"),
    ("verified", "max_batch_verified", "s"),
    ("frontier", "frontier_mark", "s"),
    ("status", "status", "s"),
]


def markdown(rows: list[dict]) -> str:
    """The conditions line and the table (one row per point; ``frontier`` = "yes" for frontier points)."""
    body = []
    for r in rows:
        r = dict(
            r,
            kv_cache_mib=r["kv_cache_bytes"] / MIB if r.get("kv_cache_bytes") is not None else None,
            frontier_mark={True: "yes", False: "", None: "-"}[r.get("on_frontier")],
        )
        if r.get("status") != "ok":
            r["status"] = f"{r['status']}: {str(r.get('error'))[:80]}"
        body.append("| " + " | ".join(res.format_value(r.get(k), f) for _, k, f in COLUMNS) + " |")
    head = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return _conditions(rows) + "\n\n" + "\n".join(head + body) + "\n"


#: The right panel of the PNG zooms on the points within this factor of the lowest perplexity.
ZOOM_PERPLEXITY_FACTOR = 1.15


def plot(rows: list[dict], path: Path) -> Path:
    """Write the frontier PNG (matplotlib, Agg) of the ok ``rows`` of `frontier_rows` to ``path``: every point
    (left), and the points within `ZOOM_PERPLEXITY_FACTOR` of the lowest perplexity (right), where the policies
    worth choosing sit close together."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    policies = list(dict.fromkeys(r.get("policy_label") or r["policy"] for r in ok))
    colors = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(policies)}
    ratios = sorted({r.get("compression_ratio") or 1.0 for r in ok})
    markers = {q: m for q, m in zip(ratios, "os^Dvp*hX<>")}
    groups = list(dict.fromkeys(_group(r) for r in ok))
    best = min((r["perplexity"] for r in ok), default=1.0)
    for ax, zoom in zip(axes, (False, True)):
        shown = [r for r in ok if not zoom or r["perplexity"] <= best * ZOOM_PERPLEXITY_FACTOR]
        for r in shown:
            pol, q = r.get("policy_label") or r["policy"], r.get("compression_ratio") or 1.0
            ax.scatter(
                r["output_throughput_tok_per_s"],
                r["perplexity"],
                color=colors[pol],
                marker=markers.get(q, "o"),
                s=55,
                zorder=3,
            )
            ax.annotate(
                r["label"],
                (r["output_throughput_tok_per_s"], r["perplexity"]),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=7,
            )
        for k, g in enumerate(groups):
            front = sorted(
                (r for r in shown if r["on_frontier"] and _group(r) == g),
                key=lambda r: r["output_throughput_tok_per_s"],
            )
            if front:
                ax.plot(
                    [r["output_throughput_tok_per_s"] for r in front],
                    [r["perplexity"] for r in front],
                    "--" if k == 0 else ":",
                    color="black",
                    lw=1,
                    zorder=2,
                    label="Pareto frontier" + (f" ({g[0]}, {g[1] / MIB:.3g} MiB)" if len(groups) > 1 else ""),
                )
                ax.scatter(
                    [r["output_throughput_tok_per_s"] for r in front],
                    [r["perplexity"] for r in front],
                    s=160,
                    facecolors="none",
                    edgecolors="black",
                    zorder=4,
                )
        ax.set_xlabel("output tok/s at the policy's own max batch")
        ax.set_ylabel("perplexity on held-out text (lower is better)")
        ax.grid(True, which="both", alpha=0.3)
        if zoom:
            ax.set_title(
                f"zoom: perplexity within {ZOOM_PERPLEXITY_FACTOR:g}x of the lowest ({len(shown)} of {len(ok)} points)",
                fontsize=9,
            )
        elif ok:
            if max(r["perplexity"] for r in ok) / best > 3:  # a far-off point would flatten the rest
                ax.set_yscale("log")
            first = ok[0]
            ax.set_title(
                f"all points: one KV limit ({first['kv_memory_limit_bytes'] / MIB:.3g} MiB), "
                f"{first.get('model')} {first.get('dtype')}, {first['prompt_tokens']} + "
                f"{first['new_tokens']} tokens per request",
                fontsize=9,
            )
            for p in policies:
                ax.scatter([], [], color=colors[p], label=p)
            for q in ratios:
                ax.scatter([], [], color="gray", marker=markers[q], label=f"ratio {q:g}x")
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(run_dir, records) -> dict[str, str]:
    """Write ``table.md`` and ``frontier.png`` into ``run_dir``; return their paths by name."""
    run_dir = Path(run_dir)
    rows = frontier_rows(records)
    table = run_dir / "table.md"
    res.write_atomic(str(table), markdown(rows))
    return {"table": str(table), "plot": str(plot(rows, run_dir / "frontier.png"))}


def main(argv: list[str] | None = None) -> int:
    return res.report_main("workloads.frontier.report", write_report, argv)


if __name__ == "__main__":
    sys.exit(main())
