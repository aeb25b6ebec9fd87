"""Frontier report: the Pareto frontier of throughput against perplexity, the quality gate, a PNG and its table.

``python -m workloads.frontier.report results/<run_id>`` (re)writes, next to the run's ``points.jsonl``:

* ``table.md``: first line, the highest throughput among the configurations that pass the quality gate
  (`headline`: policy, ratio, capacity or output tok/s against the full cache's, perplexity with its interval), or
  a line saying none did; then the conditions (model, dtype, CPU, threads, limit, lengths, windows, the SLO) and
  one row per point, sorted by throughput, with its perplexity's 95% interval, its ratio to the full cache's with the paired interval, the gate's
  decision and the frontier mark.
* ``frontier.png``: one point per policy and compression ratio, x = its throughput (`throughput_value`: capacity
  at the SLO in req/s, or output tok/s at the point's own max batch, under the run's one KV memory limit), y =
  perplexity of held-out text (log scale when it spans more than 3x) with its 95% interval as a vertical error bar;
  the quality gate as a horizontal line at the full cache's
  perplexity x (1 + bound), the failing region above it shaded; the points on the Pareto frontier ringed and
  joined; a second panel zooms on the points within `ZOOM_PERPLEXITY_FACTOR` of the lowest perplexity. Labels
  are placed so that no two overlap (`_place_labels`), with a leader line where one had to move off its point.

A point on an engine backend that gives no log-likelihoods (OpenVINO GenAI, ``engine: openvino``) has no perplexity
(its ``quality_note``, `workloads.frontier.suite.NO_PERPLEXITY`): it is listed in the table with its throughput and
"no gate" saying why, drawn as a vertical line at its throughput (its quality unknown, not placed on the frontier),
and named after the headline; it never judges nor passes the gate (the gate's full cache is ours', with a perplexity).

Points are compared only within one dtype and one KV limit in bytes: a run resolves ``dtype: auto`` once, but
records of runs that resolved differently (or of older runs) may be reported together; the report then says so
and draws one frontier, and judges one gate, per group.

A point is on the frontier when no other point is at least as fast (`throughput_value`) and at most as perplexed
with one of the two strictly better (`pareto_front`, on the point estimates). It passes the quality gate when its
perplexity is at most the full cache's of its group times ``1 + max_perplexity_increase``
(`workloads.frontier.gate`, where the intervals and the rule are defined); ``quality_gate_passed`` is None
without a full-cache point in its group.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from replica import cpu_share
from workloads.core import results as res
from workloads.frontier.gate import (
    DEFAULT_MAX_PERPLEXITY_INCREASE,
    gate_passed,
    gate_perplexity,
    gate_resolved,
    paired_ratio_interval,
)

MIB = 1024 * 1024

#: The throughput axis of each kind of frontier record (``throughput``, `workloads.frontier.suite`): its words on
#: the plot's x axis, and its unit in the table and the headline.
AXES = {
    "capacity": ("capacity at the SLO (req/s of Poisson arrivals; ≥: a lower bound)", "req/s at the SLO"),
    "max_batch": ("output tok/s at the policy's own max batch", "output tok/s"),
}
#: Capacity searches whose highest passing rate is a lower bound of the capacity (`workloads.serving.capacity`).
LOWER_BOUND_STATUSES = ("at_least_max_rate", "not_converged")


def throughput_axis(r: dict) -> str:
    """A record's throughput axis: ``capacity`` or ``max_batch`` (records from before the axis existed)."""
    return r.get("throughput") or "max_batch"


def throughput_value(r: dict) -> tuple[float | None, bool]:
    """A record's throughput and whether it is only a lower bound: ``(capacity_req_per_s, False)`` for a capacity
    search that ended ``ok``; ``(capacity_lo_req_per_s, True)`` for one that passed its highest rate or ran out of
    probes (the capacity is at least that); ``(None, False)`` for one below its lowest rate (no number: the point is
    listed, not placed); ``(output_throughput_tok_per_s, False)`` for a max-batch record."""
    if throughput_axis(r) != "capacity":
        return r.get("output_throughput_tok_per_s"), False
    if r.get("capacity_req_per_s") is not None:
        return r["capacity_req_per_s"], False
    if r.get("capacity_status") in LOWER_BOUND_STATUSES and r.get("capacity_lo_req_per_s") is not None:
        return r["capacity_lo_req_per_s"], True
    return None, False


def pareto_front(points: list[tuple[float, float]]) -> list[bool]:
    """Which of ``points`` = [(throughput, perplexity), ...] are not dominated (higher throughput and lower
    perplexity are better): ``out[i]`` is False exactly when some ``j`` has ``t_j >= t_i`` and ``p_j <= p_i``
    with one of them strict. Equal points are all on the frontier.

    Raises:
        ValueError: a value is not a finite number.
    """
    for i, (t, p) in enumerate(points):
        if not (isinstance(t, (int, float)) and isinstance(p, (int, float)) and math.isfinite(t) and math.isfinite(p)):
            raise ValueError(f"points[{i}]: throughput and perplexity must be finite numbers, got {(t, p)!r}")
    return [not any(tj >= ti and pj <= pi and (tj > ti or pj < pi) for tj, pj in points) for ti, pi in points]


def has_perplexity(r: dict) -> bool:
    """Whether a record has a perplexity (a point on a backend without log-likelihoods has None and a
    ``quality_note``)."""
    return r.get("perplexity") is not None


def _is_gate_full(r: dict) -> bool:
    """Whether a row is its group's full-cache reference of the gate: the full cache with a perplexity (ours;
    another backend's full cache has none)."""
    return r.get("policy") == "full" and has_perplexity(r)


def _label(r: dict) -> str:
    name = r.get("policy_label") or r.get("policy") or "?"
    return name if r.get("compression_ratio") is None else f"{name} x{r['compression_ratio']:g}"


def _group(r: dict) -> tuple:
    """Points are comparable only on one throughput axis, at one dtype and one KV limit in bytes (``dtype: auto``
    resolves per replica), on the same requests and held-out windows (seed, lengths, window count: a results folder
    may hold points of an edited suite), and for capacity under one search (`_search_of`)."""
    return (
        throughput_axis(r),
        r.get("dtype"),
        r.get("kv_memory_limit_bytes"),
        r.get("seed"),
        r.get("prompt_tokens"),
        r.get("new_tokens"),
        # a row without perplexity scored no window: the suite's count (its point's identity) groups it
        r.get("perplexity_windows") if has_perplexity(r) else (r.get("point_config") or {}).get("perplexity_windows"),
        _search_of(r),
    )


def _search_of(r: dict) -> tuple | None:
    """A capacity record's search settings that change its number (the SLO, the target, the requests a probe, the
    token budget a step); None for a max-batch record."""
    if throughput_axis(r) != "capacity":
        return None
    keys = (
        "slo_ttft_s",
        "slo_tpot_s",
        "slo_e2e_latency_s",
        "capacity_target_attainment",
        "num_requests",
        "max_num_batched_tokens",
    )
    return tuple(r.get(k) for k in keys)


def _bound_of(records, max_perplexity_increase: float | None) -> float:
    """The gate's bound: the one given (the suite's, from the runner), else the one the records carry (the suite's
    when they ran), else `DEFAULT_MAX_PERPLEXITY_INCREASE`."""
    if max_perplexity_increase is not None:
        return max_perplexity_increase
    carried = [r.get("quality_gate_max_perplexity_increase") for r in records]
    return next((b for b in reversed(carried) if b is not None), DEFAULT_MAX_PERPLEXITY_INCREASE)


def _gate_fields(r: dict, full: dict | None, bound: float) -> dict:
    """The gate's columns of one ok row against ``full`` (its group's full-cache row, or None); a row without a
    perplexity gets the reference's and None for its own decision (no gate)."""
    full_ppl = full["perplexity"] if full else None
    if not has_perplexity(r):
        return {
            "quality_gate_max_perplexity_increase": bound,
            "full_perplexity": full_ppl,
            "full_throughput": full["throughput_value"] if full else None,
            "quality_gate_perplexity": gate_perplexity(full_ppl, bound),
            "quality_gate_passed": None,
            "perplexity_vs_full": None,
            "perplexity_ratio_ci_low": None,
            "perplexity_ratio_ci_high": None,
            "quality_gate_resolved": None,
        }
    ratio_ci = paired_ratio_interval(r.get("window_nll_per_token"), (full or {}).get("window_nll_per_token"))
    return {
        "quality_gate_max_perplexity_increase": bound,
        "full_perplexity": full_ppl,
        "full_throughput": full["throughput_value"] if full else None,
        "quality_gate_perplexity": gate_perplexity(full_ppl, bound),
        "quality_gate_passed": gate_passed(r["perplexity"], full_ppl, bound),
        "perplexity_vs_full": r["perplexity"] / full_ppl if full_ppl else None,
        "perplexity_ratio_ci_low": ratio_ci[0],
        "perplexity_ratio_ci_high": ratio_ci[1],
        "quality_gate_resolved": gate_resolved(ratio_ci, bound),
    }


def _group_text(g: tuple) -> str:
    """A `_group` in words (the settings a record carries)."""
    axis, dtype, limit, seed, prompt, new, windows, search = g
    parts = [AXES[axis][1], f"{dtype}", f"{limit} B", f"seed {seed}" if seed is not None else None]
    parts += [f"{prompt} + {new} tokens", f"{windows} window(s)" if windows is not None else None]
    if search is not None:
        ttft, tpot, e2e, target, requests, step_tokens = search
        parts.append(
            f"SLO TTFT {ttft:g} s, TPOT {tpot:g} s"
            + (f", e2e {e2e:g} s" if e2e is not None else "")
            + f" for {target:g} of {requests} requests, {step_tokens} tokens a step"
        )
    return ", ".join(p for p in parts if p is not None)


def frontier_rows(records, max_perplexity_increase: float | None = None) -> list[dict]:
    """The latest record of every point, sorted by throughput (fastest first; then the measured points without a
    number, capacity searches below their lowest rate; failed points last), each with ``label``, ``on_frontier``
    (None on the points without a number, and on those without a perplexity: their ``quality_note`` says why),
    ``throughput_value`` and ``throughput_lower_bound``
    (`throughput_value`) and the quality gate's fields (every measured point has them; None on failed points):

    * ``quality_gate_passed`` (bool; None without an ok full-cache point in the group), ``quality_gate_perplexity``
      (the highest perplexity that passes), ``quality_gate_max_perplexity_increase`` (the bound used);
    * ``full_perplexity``, ``full_throughput``, ``perplexity_vs_full`` (this / the full cache's);
    * ``perplexity_ratio_ci_low``, ``perplexity_ratio_ci_high`` (95% paired interval of that ratio; None with one
      window or records without ``window_nll_per_token``) and ``quality_gate_resolved``.

    The frontier and the gate are taken within each group of one dtype and one limit in bytes (`_group`): a run
    whose replicas resolved ``dtype: auto`` differently has one frontier and one full-cache reference per dtype.
    ``max_perplexity_increase``: the gate's bound (None: the one the records carry, else the default 0.01).

    Raises:
        ValueError: ``max_perplexity_increase`` not a finite number > 0 (from `gate_perplexity`).
    """
    latest = []
    for r in res.latest_by_point(records).values():
        value, lower = throughput_value(r)
        latest.append(dict(r, throughput_value=value, throughput_lower_bound=lower))
    bound = _bound_of(latest, max_perplexity_increase)
    measured = [r for r in latest if r.get("status") == "ok"]
    on, gate = {}, {}
    for g in dict.fromkeys(_group(r) for r in measured):
        members = [r for r in measured if _group(r) == g]
        placed = [r for r in members if r["throughput_value"] is not None and has_perplexity(r)]
        on.update(
            zip(
                (r["point_id"] for r in placed),
                pareto_front([(r["throughput_value"], r["perplexity"]) for r in placed]),
            )
        )
        # the gate needs the full cache's perplexity, not its capacity: a full cache below the grid still judges
        full = next((r for r in members if _is_gate_full(r)), None)
        gate.update((r["point_id"], _gate_fields(r, full, bound)) for r in members)
    rows = [dict(r, on_frontier=on.get(r["point_id"]), label=_label(r), **gate[r["point_id"]]) for r in measured]
    rows.sort(key=lambda r: (r["throughput_value"] is None, -(r["throughput_value"] or 0.0)))
    failed = [
        dict(r, on_frontier=None, label=_label(r), quality_gate_passed=None, quality_gate_max_perplexity_increase=bound)
        for r in latest
        if r.get("status") != "ok"
    ]
    return rows + failed


def _percent(fraction: float) -> str:
    return f"{fraction * 100:+.2f}%"


def _ci(low, high, fmt: str = ".3f") -> str | None:
    return None if low is None or high is None else f"{low:{fmt}}-{high:{fmt}}"


def headline(rows: list[dict]) -> str:
    """The first line of ``table.md``: per group (`_group`), the highest throughput among the rows of
    `frontier_rows` that pass the quality gate, with its policy, ratio, throughput against the full cache's and
    perplexity with its intervals; or a line saying that no compressed configuration beat the full cache within
    the gate (a tie is no gain; the full cache always passes its own gate), that the grid could not tell them apart
    (both passed its highest rate), or that the gate could not be judged (no full-cache point). A full cache below
    its search's lowest rate still judges the gate, and any placed compressed row that passes beats it."""
    measured = [r for r in rows if r.get("status") == "ok"]
    if not measured:
        return "**Quality gate: no point finished.**"
    groups = list(dict.fromkeys(_group(r) for r in measured))
    parts = []
    for g in groups:
        members = [r for r in measured if _group(r) == g]  # fastest first, those without a number last
        where = f" ({_group_text(g)})" if len(groups) > 1 else ""
        unit = AXES[g[0]][1]
        best_words = "Highest capacity" if g[0] == "capacity" else "Fastest"
        bound = members[0]["quality_gate_max_perplexity_increase"]
        ungated = _ungated_text([r for r in members if not has_perplexity(r)], unit)
        full = next((r for r in members if _is_gate_full(r)), None)
        if full is None:
            parts.append(
                f"**No quality gate{where}: no full-cache point finished to compare with**, so no configuration is "
                f"judged (`quality_gate_passed` is null; the gate is perplexity within {bound * 100:g}% of the full "
                "cache's)." + ungated
            )
            continue
        rule = (
            f"perplexity at most {bound * 100:g}% above the full cache's {full['perplexity']:.3f}, i.e. "
            f"<= {full['quality_gate_perplexity']:.3f}"
        )
        best = next(
            (r for r in members if r["quality_gate_passed"] and not _is_gate_full(r) and r["on_frontier"] is not None),
            None,
        )
        full_value = full["throughput_value"]  # None: a capacity below the search's lowest rate
        if best is not None and full["throughput_lower_bound"] and best["throughput_value"] <= full_value:
            parts.append(
                f"**Undecided within the quality gate{where}**: the full cache passed the grid's highest rate "
                f"({_amount(full)} {unit}) and so did {best['label']} ({_amount(best)}); raise "
                "`capacity.max_rate_req_per_s` to tell them apart." + ungated
            )
            continue
        if best is None or (full_value is not None and best["throughput_value"] <= full_value):  # a tie gains nothing
            compressed = sum(1 for r in members if r.get("policy") != "full" and has_perplexity(r))
            passed = sum(1 for r in members if r.get("policy") != "full" and r["quality_gate_passed"])
            parts.append(
                f"**No compressed configuration beats the full cache within the quality gate{where}** ({rule}): "
                f"{passed} of {compressed} passed"
                + (", none faster than" if passed else "; fastest passing is")
                + f" the full cache at {_amount(full)} {unit}."
                + ungated
            )
            continue
        ratio = best.get("compression_ratio")
        if full_value is None:
            versus = f"the full cache's below {full.get('capacity_hi_req_per_s'):g} (the search's lowest rate)"
        else:
            at_least = "at least " if best["throughput_lower_bound"] else ""
            versus = f"{at_least}{best['throughput_value'] / full_value:.2f}x the full cache's {_amount(full)}"
        ci = _ci(best.get("perplexity_ci_low"), best.get("perplexity_ci_high"))
        paired = _ci(best.get("perplexity_ratio_ci_low"), best.get("perplexity_ratio_ci_high"), ".4f")
        resolved = best.get("quality_gate_resolved")
        parts.append(
            f"**{best_words} within the quality gate{where}: {best['label']}** (policy {best.get('policy')}"
            + (f", compression ratio {ratio:g}x" if ratio is not None else "")
            + f") at {_amount(best)} {unit}, {versus}"
            + (
                f" (max batch {best.get('batch_size')} vs {full.get('batch_size')})"
                if g[0] == "max_batch"
                else f" ({_slo_text(best)})"
            )
            + f"; perplexity {best['perplexity']:.3f}"
            + (f" (95% CI {ci})" if ci else "")
            + f", {_percent(best['perplexity_vs_full'] - 1)} vs full"
            + (f" (paired 95% CI of the ratio {paired}" if paired else "")
            + (
                ""
                if not paired
                else ")"
                if resolved
                else "; the bound lies inside it, so more windows could flip the decision)"
            )
            + f". Gate: {rule}."
            + ungated
        )
    return " ".join(parts)


def _ungated_text(rows: list[dict], unit: str) -> str:
    """The headline's words on the rows without a perplexity (another engine's): their throughput, without a gate,
    and why; "" without such rows."""
    if not rows:
        return ""
    notes = ", ".join(dict.fromkeys(r.get("quality_note") or "no perplexity" for r in rows))
    listed = "; ".join(f"{r['label']} {_amount(r)}" for r in rows)
    return f" Without a gate ({notes}): {listed} {unit}."


def _amount(r: dict) -> str:
    """A row's throughput as printed: ``1.19`` req/s (``≥ 8`` a lower bound, ``< 0.1`` below the search's lowest
    rate) or ``57.3`` tok/s."""
    if throughput_axis(r) != "capacity":
        return f"{r['throughput_value']:.1f}"
    if r["throughput_value"] is None:
        return f"< {r['capacity_hi_req_per_s']:.3g}" if r.get("capacity_hi_req_per_s") is not None else "-"
    return ("≥ " if r.get("throughput_lower_bound") else "") + f"{r['throughput_value']:.3g}"


def _slo_text(r: dict) -> str:
    """The SLO and target a capacity row was searched at, in words."""
    limits = [f"TTFT <= {r.get('slo_ttft_s'):g} s", f"TPOT <= {r.get('slo_tpot_s'):g} s"]
    if r.get("slo_e2e_latency_s") is not None:
        limits.append(f"e2e <= {r['slo_e2e_latency_s']:g} s")
    return f"SLO {', '.join(limits)} for >= {r.get('capacity_target_attainment'):g} of {r.get('num_requests')} requests"


def main_axis(rows: list[dict]) -> str | None:
    """The throughput axis the plot draws and the conditions describe: that of the last measured point to finish
    (a results folder resumed under another axis keeps its older points; the table lists every one)."""
    measured = [r for r in rows if r.get("status") == "ok"]
    last = max(measured, key=lambda r: r.get("finished_at_unix_s") or 0.0, default=None)
    return throughput_axis(last) if last else None


def _conditions(rows: list[dict]) -> str:
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return "No point finished."
    axis = main_axis(rows)
    on_axis = [r for r in ok if throughput_axis(r) == axis]
    first = next((r for r in on_axis if has_perplexity(r)), on_axis[0])

    def distinct(key):
        return ", ".join(str(v) for v in dict.fromkeys(r.get(key) for r in ok))

    groups = list(dict.fromkeys(_group(r) for r in ok))
    mixed = (
        ""
        if len(groups) == 1
        else (
            f"**Not one comparison: the points ran in {len(groups)} settings (throughput axis, dtype, KV limit in "
            "bytes, seed, prompt and new tokens, perplexity windows, capacity search): "
            + "; ".join(_group_text(g) for g in groups)
            + " (`dtype: auto` resolved differently on the replicas, or a run resumed under an edited suite); "
            f"each has its own frontier, and the plot draws the {AXES[axis][1]} ones. Force `dtype:` in "
            "the suite, and give an edited suite a new run.** "
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
        f"(the same prompts for every point) + {first['new_tokens']} new tokens; "
        + (
            f"perplexity over {first['perplexity_tokens_scored']} held-out tokens" + _windows(first)
            if has_perplexity(first)
            else "no perplexity"
        )
        + _engines(ok)
        + f"; budget B = ceil(({first['prompt_tokens']} + {first['new_tokens']}) / ratio) in both. "
        + (_capacity_conditions(first, ok) if throughput_axis(first) == "capacity" else _max_batch_conditions())
    )


def _engines(ok: list[dict]) -> str:
    """The engines of the rows when another than ours ran some (their versions, and why they have no perplexity)."""
    others = [r for r in ok if (r.get("engine") or "ours") != "ours"]
    if not others:
        return ""
    versions = ", ".join(
        dict.fromkeys(
            f"{r['engine']}"
            + (f" (OpenVINO GenAI {r['openvino_genai_version']})" if r.get("openvino_genai_version") else "")
            for r in others
        )
    )
    notes = ", ".join(dict.fromkeys(r.get("quality_note") for r in others if r.get("quality_note")))
    return f"; engines: ours and {versions} on the same requests, arrivals and KV bytes" + (
        f" ({notes}: those rows are listed without a gate)" if notes else ""
    )


def _max_batch_conditions() -> str:
    return (
        "Throughput: one batch of the policy's own max batch, all requests at once (preallocated rows, "
        "prefill-first). Points ran one after another on the replicas (not interleaved): on a shared machine their "
        "timings carry its load; output tokens per CPU-second is less sensitive to it."
    )


def _capacity_conditions(first: dict, ok: list[dict]) -> str:
    bounds = [r for r in ok if r.get("throughput_lower_bound") or r.get("throughput_value") is None]
    return (
        f"Throughput: capacity at the SLO, the highest Poisson rate of a grid that passes, a rate passing when it "
        f"meets the {_slo_text(first)} (a bisection, `workloads.serving.capacity`; the same requests and arrival "
        f"pattern for every point; the paged engine, mixed scheduler with {first.get('max_num_batched_tokens')} "
        "tokens a step). "
        + (
            "≥: the search passed its highest rate (or ran out of probes), so the capacity is at least that; <: it "
            "failed its lowest rate. "
            if bounds
            else ""
        )
        + "Points ran one after another on the replicas: on a shared machine their latencies carry its load."
    )


def _windows(first: dict) -> str:
    """How the perplexity was scored: the windows, and what the intervals are."""
    n = first.get("perplexity_windows")
    if not n:
        return ""  # a record from before windows were recorded
    if n == 1:
        return " in one window (no interval: one window says nothing about its spread)"
    return (
        f" in {n} windows of {first['perplexity_tokens_scored'] // n} (the same windows for every point; 95% "
        "t-intervals across windows: of a point's perplexity, and of its ratio to the full cache's, paired by window)"
    )


COLUMNS = [  # (header with unit, key, format)
    ("policy", "label", "s"),
    ("dtype", "dtype", "s"),
    ("B (tok)", "budget_tokens", "d"),
    ("max batch", "batch_size", "d"),
    ("capacity (req/s)", "capacity", "s"),
    ("goodput at capacity (tok/s)", "goodput_tok_per_s", ".1f"),
    ("output (tok/s)", "output_throughput_tok_per_s", ".1f"),
    ("output (tok/CPU-s)", "output_tok_per_cpu_s", ".2f"),
    ("decode (tok/s)", "decode_tokens_per_s", ".1f"),
    ("perplexity", "perplexity", ".3f"),
    ("perplexity 95% CI", "perplexity_ci", "s"),
    ("vs full (paired 95% CI)", "vs_full", "s"),
    ("gate", "gate_mark", "s"),
    ("peak KV (MiB)", "kv_cache_mib", ".2f"),
    ("verified", "max_batch_verified", "s"),
    ("frontier", "frontier_mark", "s"),
    ("CPU share", "cpu", "s"),  # replica.cpu_share: ran / runnable of the replica's threads, `!` contended
    ("status", "status", "s"),
]


#: The columns only one throughput axis fills.
AXIS_COLUMNS = {
    "capacity": ("capacity", "goodput_tok_per_s"),
    "max_batch": (
        "batch_size",
        "output_throughput_tok_per_s",
        "output_tok_per_cpu_s",
        "decode_tokens_per_s",
        "max_batch_verified",
    ),
}


def _vs_full(r: dict) -> str | None:
    if r.get("perplexity_vs_full") is None:
        return None
    paired = _ci(r.get("perplexity_ratio_ci_low"), r.get("perplexity_ratio_ci_high"), ".4f")
    return f"{r['perplexity_vs_full']:.4f}" + (f" ({paired})" if paired else "")


def _gate_mark(r: dict) -> str | None:
    if r.get("status") == "ok" and not has_perplexity(r):
        return "no gate (no perplexity)"
    passed = r.get("quality_gate_passed")
    if passed is None:
        return None
    return ("pass" if passed else "fail") + (" (bound inside CI)" if r.get("quality_gate_resolved") is False else "")


def markdown(rows: list[dict]) -> str:
    """`headline` (the first line), the conditions and the table: one row per point of `frontier_rows`;
    ``gate`` = pass / fail ("bound inside CI" when the paired interval holds the bound) / - (no full cache);
    ``frontier`` = "yes" for frontier points."""
    cells = []
    for r in rows:
        r = dict(
            r,
            kv_cache_mib=r["kv_cache_bytes"] / MIB if r.get("kv_cache_bytes") is not None else None,
            frontier_mark={True: "yes", False: "", None: "-"}[r.get("on_frontier")],
            perplexity_ci=_ci(r.get("perplexity_ci_low"), r.get("perplexity_ci_high")),
            vs_full=_vs_full(r),
            gate_mark=_gate_mark(r),
            capacity=_amount(r) if throughput_axis(r) == "capacity" and r.get("status") == "ok" else None,
            cpu=cpu_share.mark(r),
        )
        if r.get("evicts") is False:  # an eviction label on a row that ran the full cache
            r["label"] = f"{r['label']} ({r.get('evicts_reason')})"
        if r.get("status") != "ok":
            r["status"] = f"{r['status']}: {str(r.get('error'))[:80]}"
        elif not has_perplexity(r):
            no_capacity = f"no capacity: {r.get('capacity_status')}; " if r.get("throughput_value") is None else ""
            r["status"] = f"ok, {no_capacity}{r.get('quality_note') or 'no perplexity'}"
        elif r.get("on_frontier") is None:
            r["status"] = f"ok, no capacity: {r.get('capacity_status')}"
        cells.append(r)
    # the columns of an axis no row is on are left out (a capacity run has no max batch, and the reverse)
    axes = {throughput_axis(r) for r in rows}
    keep = [c for c in COLUMNS if not any(c[1] in AXIS_COLUMNS[a] for a in set(AXIS_COLUMNS) - axes)]
    body = ["| " + " | ".join(res.format_value(r.get(k), f) for _, k, f in keep) + " |" for r in cells]
    head = ["| " + " | ".join(h for h, _, _ in keep) + " |", "|" + "---|" * len(keep)]
    notes = "".join(f"\n{line}\n" for line in cpu_share.contended_lines(rows))
    return headline(rows) + "\n\n" + _conditions(rows) + "\n\n" + "\n".join(head + body) + "\n" + notes


#: The right panel of the PNG zooms on the points within this factor of the lowest perplexity.
ZOOM_PERPLEXITY_FACTOR = 1.15
#: The ``gid`` of every point label of the PNG (what `tests/workloads/test_frontier.py` finds and checks).
LABEL_GID = "frontier-label"
#: The ``gid`` of the quality gate's line.
GATE_GID = "quality-gate"
#: The ``gid`` of the vertical line of a point without a perplexity (at its throughput).
NO_PERPLEXITY_GID = "no-perplexity"
_UNPLACED_COLORS = ("tab:gray", "tab:brown", "tab:olive", "tab:cyan")
_LABEL_FONTSIZE = 7
_MARKER_RADIUS_PT = 7.0  # a label keeps off every marker (the frontier's rings included) by this radius (points)
_RING_STEP_PT = 9.0  # each further ring of candidate positions lies this much farther from the point (points)
_RINGS_INSIDE = 14  # rings tried inside the axes before a label may leave them
_RINGS = 40


def _candidates(ring: int):
    """Offsets (points) and alignments for a label at ``ring``: right, above-right, below-right, left, above-left,
    below-left, above, below its point, the text growing away from it."""
    r = _MARKER_RADIUS_PT + 2 + _RING_STEP_PT * ring
    d = r / math.sqrt(2)
    return [
        ((r, 0.0), "left", "center"),
        ((d, d), "left", "bottom"),
        ((d, -d), "left", "top"),
        ((-r, 0.0), "right", "center"),
        ((-d, d), "right", "bottom"),
        ((-d, -d), "right", "top"),
        ((0.0, r), "center", "bottom"),
        ((0.0, -r), "center", "top"),
    ]


def _overlaps(a, b, pad: float = 3.0) -> bool:
    """Whether two display boxes (pixels) intersect, ``pad`` pixels apart counting as touching."""
    return a.x0 < b.x1 + pad and b.x0 < a.x1 + pad and a.y0 < b.y1 + pad and b.y0 < a.y1 + pad


def _place_labels(fig, items: list[tuple]) -> list:
    """Annotate every ``(ax, x, y, text)`` of ``items`` (data coordinates) so that no two labels' boxes intersect
    and no label covers a marker or a legend: each label takes the first free candidate offset (`_candidates`),
    ring by ring outwards, inside its axes for the first `_RINGS_INSIDE` rings; a label off its first ring gets a
    thin leader line to its point. Positions are measured on the drawn figure (``get_window_extent``), so the
    figure's layout must be final before the call. Returns the label annotations (``gid`` `LABEL_GID`)."""
    from matplotlib.transforms import Bbox

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    radius = _MARKER_RADIUS_PT * fig.dpi / 72  # pixels
    taken = []
    for ax, x, y, _ in items:
        px, py = ax.transData.transform((x, y))
        taken.append(Bbox.from_extents(px - radius, py - radius, px + radius, py + radius))
    taken += [leg.get_window_extent(renderer) for leg in fig.legends]
    taken += [ax.get_legend().get_window_extent(renderer) for ax in fig.axes if ax.get_legend() is not None]
    placed = []
    for ax, x, y, text in items:
        frame = ax.get_window_extent(renderer)
        ann = ax.annotate(
            text,
            (x, y),
            xytext=(0.0, 0.0),
            textcoords="offset points",
            fontsize=_LABEL_FONTSIZE,
            gid=LABEL_GID,
            annotation_clip=False,
            bbox=dict(boxstyle="square,pad=0.1", facecolor="white", alpha=0.75, linewidth=0),  # readable over lines
        )
        best = None
        for ring in range(_RINGS):
            for offset, ha, va in _candidates(ring):
                ann.xyann = offset
                ann.set_horizontalalignment(ha)
                ann.set_verticalalignment(va)
                box = ann.get_window_extent(renderer)
                if any(_overlaps(box, t) for t in taken):
                    continue
                inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
                if inside or ring >= _RINGS_INSIDE:
                    best = (ring, offset, ha, va, box)
                    break
            if best:
                break
        if best is None:  # nowhere free within _RINGS rings (not met in practice): keep the last candidate
            best = (_RINGS, offset, ha, va, box)
        ring, offset, ha, va, box = best
        ann.xyann = offset
        ann.set_horizontalalignment(ha)
        ann.set_verticalalignment(va)
        taken.append(box)
        placed.append(ann)
        if ring > 0:  # moved off its point: a leader line (an annotation without text) shows whose it is
            ax.annotate(
                "",
                (x, y),
                xytext=offset,
                textcoords="offset points",
                arrowprops=dict(arrowstyle="-", color="0.45", lw=0.6, shrinkA=0, shrinkB=2),
                annotation_clip=False,
            )
    return placed


def _gates(ok: list[dict]) -> list[tuple[float, dict]]:
    """One quality gate per group that has a full-cache point: ``(highest passing perplexity, its full row)``."""
    out = []
    for g in dict.fromkeys(_group(r) for r in ok):
        full = next((r for r in ok if _group(r) == g and r.get("policy") == "full"), None)
        if full is not None and full.get("quality_gate_perplexity") is not None:
            out.append((full["quality_gate_perplexity"], full))
    return out


#: Legend names of the two kinds of error bar (`_error_bar`).
CI_ACROSS_WINDOWS = "95% interval across windows (left)"
CI_PAIRED = "paired 95% interval vs full, x full's perplexity (zoom)"


def _error_bar(r: dict, zoom: bool) -> tuple[str, tuple[float | None, float | None]]:
    """The interval a point's error bar shows: on the left panel its perplexity's (`perplexity_ci_low` and
    `_high`: the text's variation across windows included); on the zoom, where the gate is decided, the paired
    interval of its ratio to the full cache's times the full cache's perplexity (the text's variation cancels
    there; it crosses the gate's line exactly when `quality_gate_resolved` is False)."""
    if not zoom:
        return CI_ACROSS_WINDOWS, (r.get("perplexity_ci_low"), r.get("perplexity_ci_high"))
    full, lo, hi = r.get("full_perplexity"), r.get("perplexity_ratio_ci_low"), r.get("perplexity_ratio_ci_high")
    if full is None or lo is None or hi is None or r.get("policy") == "full":
        return CI_PAIRED, (None, None)
    return CI_PAIRED, (full * lo, full * hi)


def _draw_fronts(ax, shown: list[dict], groups: list[tuple], handles: dict) -> None:
    """Each group's Pareto frontier among the `shown` rows on `ax`: its points ringed and joined (dashed for the
    first group, dotted after), its legend handle kept in `handles`."""
    for k, g in enumerate(groups):
        front = sorted(
            (r for r in shown if r["on_frontier"] and _group(r) == g),
            key=lambda r: r["throughput_value"],
        )
        if not front:
            continue
        name = "Pareto frontier" + (f" ({k + 1}: {g[1]}, {g[2] / MIB:.3g} MiB)" if len(groups) > 1 else "")
        (handles[name],) = ax.plot(
            [r["throughput_value"] for r in front],
            [r["perplexity"] for r in front],
            "--" if k == 0 else ":",
            color="black",
            lw=1,
            zorder=2,
        )
        ax.scatter(
            [r["throughput_value"] for r in front],
            [r["perplexity"] for r in front],
            s=160,
            facecolors="none",
            edgecolors="black",
            zorder=4,
        )


def figure(rows: list[dict]):
    """The frontier figure (matplotlib `Figure` on an Agg canvas, drawn, labels placed) of the ok ``rows`` of
    `frontier_rows`: every point (left), and the points within `ZOOM_PERPLEXITY_FACTOR` of the lowest perplexity
    (right), where the policies worth choosing sit close together. Each point has a 95% interval as a vertical
    error bar where it has one (`_error_bar`: across windows on the left, paired with the full cache on the zoom),
    the quality gate is a horizontal line at the full cache's perplexity x
    (1 + bound) with the failing region above it shaded, the Pareto frontier is ringed and joined, and the labels
    do not overlap (`_place_labels`)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    axis = main_axis(rows)  # one x axis: another axis's points are in the table only
    ok = [r for r in rows if r.get("on_frontier") is not None and throughput_axis(r) == axis]
    # measured without a perplexity (another engine's): a vertical line at its throughput, its quality unknown
    unplaced = [
        r
        for r in rows
        if r.get("status") == "ok"
        and not has_perplexity(r)
        and r.get("throughput_value") is not None
        and throughput_axis(r) == axis
    ]
    fig = Figure(figsize=(13, 6.2), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    policies = list(dict.fromkeys(r.get("policy_label") or r["policy"] for r in ok))
    cmap = matplotlib.colormaps["tab10"]
    colors = {p: cmap(i % 10) for i, p in enumerate(policies)}
    ratios = sorted({r.get("compression_ratio") or 1.0 for r in ok})
    markers = {q: m for q, m in zip(ratios, "os^Dvp*hX<>")}
    groups = list(dict.fromkeys(_group(r) for r in ok))
    gates = _gates(ok)
    best = min((r["perplexity"] for r in ok), default=1.0)
    labels: list[tuple] = []
    handles: dict = {}
    for ax, zoom in zip(axes, (False, True)):
        shown = [r for r in ok if not zoom or r["perplexity"] <= best * ZOOM_PERPLEXITY_FACTOR]
        for r in shown:
            pol, q = r.get("policy_label") or r["policy"], r.get("compression_ratio") or 1.0
            x, y = r["throughput_value"], r["perplexity"]
            name, (lo, hi) = _error_bar(r, zoom)
            if lo is not None:
                handles[name] = ax.errorbar(
                    x,
                    y,
                    yerr=[[max(y - lo, 0.0)], [max(hi - y, 0.0)]],
                    fmt="none",
                    ecolor=colors[pol],
                    elinewidth=0.9,
                    capsize=2.5,
                    alpha=0.6,
                    zorder=2,
                )
            ax.scatter(x, y, color=colors[pol], marker=markers.get(q, "o"), s=55, zorder=3)
            labels.append((ax, x, y, ("≥ " if r["throughput_lower_bound"] else "") + r["label"]))
        _draw_fronts(ax, shown, groups, handles)
        if zoom and shown:  # the zoom keeps its points (and the gate) in view, not the intervals' far ends
            ys = [r["perplexity"] for r in shown] + [g for g, _ in gates]
            pad = max((max(ys) - min(ys)) * 0.08, max(ys) * 0.002)
            ax.set_ylim(min(ys) - pad, max(ys) + pad)
        elif ok and max(r["perplexity"] for r in ok) / best > 3:  # a far-off point would flatten the rest
            ax.set_yscale("log")
        low, high = ax.get_ylim()
        for k, (gate_y, full) in enumerate(gates):
            high = max(high, gate_y * 1.002)
            bound = full["quality_gate_max_perplexity_increase"]
            name = f"quality gate: perplexity <= full x {1 + bound:g}" + (
                f" ({full.get('dtype')}, {full['kv_memory_limit_bytes'] / MIB:.3g} MiB)" if len(gates) > 1 else ""
            )
            handles[name] = ax.axhline(
                gate_y, color="tab:red", lw=1.1, ls="-." if k == 0 else ":", zorder=1, gid=GATE_GID
            )
        for gate_y, _ in gates:
            handles["fails the gate"] = ax.axhspan(gate_y, high, color="tab:red", alpha=0.07, lw=0, zorder=0)
        for k, r in enumerate(unplaced):
            name = f"{r['label']}: {_amount(r)}, {r.get('quality_note') or 'no perplexity'} (no gate)"
            handles[name] = ax.axvline(
                r["throughput_value"],
                color=_UNPLACED_COLORS[k % len(_UNPLACED_COLORS)],
                lw=1.3,
                ls=(0, (4, 2)),
                zorder=1,
                gid=NO_PERPLEXITY_GID,
            )
        ax.set_ylim(low, high)
        ax.set_xlabel(AXES[axis][0] if axis else "throughput")
        ax.set_ylabel("perplexity on held-out text (lower is better)")
        ax.grid(True, which="both", alpha=0.3)
        if zoom:
            ax.set_title(
                f"zoom: perplexity within {ZOOM_PERPLEXITY_FACTOR:g}x of the lowest ({len(shown)} of {len(ok)} points)",
                fontsize=9,
            )
        elif ok:
            first = ok[0]
            ax.set_title(
                f"all points: one KV limit ({first['kv_memory_limit_bytes'] / MIB:.3g} MiB), "
                f"{first.get('model')} {first.get('dtype')}, {first['prompt_tokens']} + "
                f"{first['new_tokens']} tokens per request",
                fontsize=9,
            )
    for p in policies:
        handles[p] = axes[0].scatter([], [], color=colors[p])
    for q in ratios:
        handles[f"ratio {q:g}x"] = axes[0].scatter([], [], color="gray", marker=markers[q])
    fig.tight_layout(rect=(0, 0.11, 1, 1))  # once: the layout is final before the labels are placed
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=6, fontsize=7, frameon=False)
    _place_labels(fig, labels)
    return fig


def plot(rows: list[dict], path: Path) -> Path:
    """Write `figure` of ``rows`` as a PNG to ``path`` (the box widened to hold a label that left the axes)."""
    fig = figure(rows)
    fig.savefig(path, dpi=fig.dpi, bbox_inches="tight")
    return path


def write_report(run_dir, records, max_perplexity_increase: float | None = None) -> res.Report:
    """Write ``table.md`` and ``frontier.png`` into ``run_dir``.
    ``max_perplexity_increase``: the quality gate's bound (None: as `frontier_rows`)."""
    run_dir = Path(run_dir)
    rows = frontier_rows(records, max_perplexity_increase)
    table = markdown(rows)
    res.write_atomic(str(run_dir / "table.md"), table)
    return res.Report(table, (run_dir / "table.md", Path(plot(rows, run_dir / "frontier.png"))))


def main(argv: list[str] | None = None) -> int:
    return res.report_main("workloads.frontier.report", write_report, argv)


if __name__ == "__main__":
    sys.exit(main())
