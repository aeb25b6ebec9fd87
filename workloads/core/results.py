"""Results of a run: the one record builder, `results/<run_id>/points.jsonl`, and what every table shares.

The run template (`workloads.core.template`) builds every record with `build_record`: a typed header
(`RecordHeader`: schema version, `kind`, run id, point id and the settings it covers, git commit,
suite, model, dtype, policy with every resolved parameter, replica and node, start and end times)
followed by the point's metrics under the keys the metrics catalogue (`replica.metrics.METRICS`,
`MetricSpec.record_key`) names. Output length is `new_tokens` everywhere (requested tokens per
sequence); `output_tokens` is the count of tokens actually generated. Each kind's report writes its tables
with `markdown_table`, each starting with its `conditions_line`.

`points.jsonl` holds one JSON object per line, one line per finished point (ok or error).
Each line is appended with a single `os.write` of the complete line on an `O_APPEND` file
descriptor, then fsync'ed, so a killed sweep leaves complete lines only (a torn tail, possible
only if the machine dies mid-write, is cut off before the file is appended to again).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from scissorhands import POLICIES
from scissorhands.models import model_id_of
from workloads.core.suite import tag_of

SCHEMA_VERSION = 2
MIB = 1024 * 1024
#: Keys of a replica's `info()` copied into every record (where the point ran).
REPLICA_KEYS = (
    "replica_id",
    "node_id",
    "node_ip",
    "accelerator_ids",
    "devices",
    "hostname",
    "cpu_model",
    "torch_threads",
)


def resolved_policy_params(policy: str | None, policy_params: dict, budget_tokens: int | None) -> dict | None:
    """The policy's full parameter set (defaults filled in), plus the effective recent window and drop
    count (`Policy.resolve`) for ``budget_tokens`` when one was used; None for a point without a
    policy (a quality persistence point)."""
    if policy is None:
        return None
    if policy not in POLICIES:  # a backend's own policy (openvino_eviction): its parameters as given
        return dict(policy_params)
    pol = POLICIES[policy](**policy_params)
    params = pol.params()
    if budget_tokens is not None:
        params["effective_recent_window"], params["effective_drop_tokens"] = pol.resolve(int(budget_tokens))
    return params


@dataclass(frozen=True)
class RecordHeader:
    """What every record starts with, whatever its kind (`batch`, `serving`)."""

    schema_version: int
    kind: str
    run_id: str
    point_index: int
    point_id: str
    point_config: dict  # every setting the point id covers (workloads.core.suite.point_id)
    status: str  # ok | error | oom | skipped
    error: str | None
    git_commit: str
    suite: str
    model: str
    model_id: str
    dtype: str  # the dtype the replica ran in (the suite may ask for "auto")
    dtype_requested: str
    dtype_reason: str | None  # why `auto` resolved as it did (scissorhands.models.resolve_dtype)
    device: str
    policy: str
    policy_params: dict  # every parameter resolved, see resolved_policy_params
    compression_ratio: float | None
    budget_tokens_requested: int | None
    seed: int
    replica_id: str | None
    node_id: str | None
    node_ip: str | None
    accelerator_ids: Any
    devices: Any
    hostname: str | None
    cpu_model: str | None  # the replica's CPU (scissorhands.models.cpu_model_name)
    torch_threads: int | None
    ray_nodes: Any
    started_at_unix_s: float | None
    finished_at_unix_s: float | None


def build_record(
    *,
    kind: str,
    run_id: str,
    commit: str,
    suite,
    point,
    status: str,
    error: str | None = None,
    replica: Mapping[str, Any] | None = None,
    inventory: Any = None,
    started_at_unix_s: float | None = None,
    finished_at_unix_s: float | None = None,
    metrics: Mapping[str, Any] | None = None,
    fields: Mapping[str, Any] | None = None,
) -> dict:
    """The record of one finished point, built once: the `RecordHeader` fields, then `metrics` (which may add
    `budget_tokens`, the B used; the resolved policy parameters follow it), then the kind's own `fields`
    (`workloads.core.template.Kind.record_fields`: its columns, e.g. a batch point's shape).

    `suite` and `point` are a suite model of `workloads.core.suite` and one of its points (`index`,
    `point_id`, `identity`, `policy`, `policy_params`, `compression_ratio`, `budget_tokens`, `seed`);
    `replica` is the replica's `info()` (None when the point never reached one).
    """
    metrics = dict(metrics or {})
    replica = replica or {}
    header = RecordHeader(
        schema_version=SCHEMA_VERSION,
        kind=kind,
        run_id=run_id,
        point_index=point.index,
        point_id=point.point_id,
        point_config=point.identity,
        status=status,
        error=error,
        git_commit=commit,
        suite=suite.name,
        model=suite.model,
        model_id=metrics.pop("model_id", None) or replica.get("model_id") or model_id_of(suite.model),
        dtype=replica.get("dtype") or suite.dtype,
        dtype_requested=suite.dtype,
        dtype_reason=replica.get("dtype_reason"),
        device=suite.device,
        policy=point.policy,
        policy_params=resolved_policy_params(point.policy, point.policy_params, metrics.get("budget_tokens")),
        compression_ratio=point.compression_ratio,
        budget_tokens_requested=point.budget_tokens,
        seed=point.seed,
        **{k: replica.get(k) for k in REPLICA_KEYS},
        ray_nodes=inventory,
        started_at_unix_s=started_at_unix_s,
        finished_at_unix_s=finished_at_unix_s,
    )
    return {**asdict(header), **metrics, **(fields or {})}


def append_record(path: str, record: dict) -> None:
    """Append one record as one JSON line: a single write of the whole line, flush, fsync.

    Raises OSError when the line could not be written whole.
    """
    line = (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"{path}: short write ({written} of {len(line)} bytes)")
        os.fsync(fd)
    finally:
        os.close(fd)


def repair_tail(path: str) -> int:
    """Cut an incomplete last line (no trailing newline) off `path`; return bytes removed."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return len(data) - keep


def read_records(path: str) -> list[dict]:
    """All complete, valid records of a points file (invalid lines are skipped with a warning)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith("\n"):
                warnings.warn(f"{path}:{n}: incomplete last line ignored")
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{n}: invalid JSON line ignored")
                continue
            if isinstance(rec, dict) and "point_id" in rec and "status" in rec:
                out.append(rec)
    return out


def latest_by_point(records: Iterable[dict]) -> dict[str, dict]:
    """The last record of every point id (a resumed run may hold an error, then an ok)."""
    latest: dict[str, dict] = {}
    for rec in records:
        latest[rec["point_id"]] = rec
    return latest


def repair_points_file(path: str, who: str) -> None:
    """Cut an incomplete last line off the points file `path` (a killed run's half-written point),
    saying so on stderr as `who`; a missing file is left missing."""
    cut = repair_tail(path)
    if cut:
        print(f"{who}: cut an incomplete last line ({cut} bytes) off {path}", file=sys.stderr)


def changed_settings(records: Iterable[dict], points: Iterable) -> dict[str, dict[str, tuple]]:
    """Points of a resumed run whose settings changed since they were recorded.

    A record and a point match when their readable tags match (`workloads.core.suite.tag_of`: policy,
    budget, shape) but their ids differ, i.e. some setting the id covers changed (model, dtype,
    device, lengths, load, limits, policy parameters). Returns point id -> {field: (recorded, now)}.
    """
    by_tag = {tag_of(r["point_id"]): r for r in records if r.get("point_config")}
    out = {}
    for p in points:
        old = by_tag.get(tag_of(p.point_id))
        if old is not None and old["point_id"] != p.point_id:
            was = old["point_config"]
            now = json.loads(json.dumps(p.identity, default=str))
            out[p.point_id] = {
                k: (was.get(k), now.get(k)) for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)
            }
    return out


def changed_policy_params(records: Iterable[dict], points: Iterable, statuses: tuple[str, ...] = ("ok",)) -> dict:
    """Kept points of a resumed run whose recorded resolved policy parameters differ from what this code resolves.

    A point's id covers only the parameters the suite names; a default the code changed since (e.g. a new
    ``min_budget_tokens`` floor) leaves the id as it was. Each record in ``statuses`` carries its resolved
    parameters (`resolved_policy_params` at its ``budget_tokens``); they are resolved again for its point here.
    Returns point id -> {parameter: (recorded, now)} (a parameter the record lacks is recorded as None).
    """
    by_id = {p.point_id: p for p in points}
    out = {}
    for r in records:
        point = by_id.get(r.get("point_id"))
        was = r.get("policy_params")
        if point is None or r.get("status") not in statuses or was is None:
            continue
        try:
            now = resolved_policy_params(point.policy, point.policy_params, r.get("budget_tokens"))
        except ValueError as e:  # this code no longer accepts the recorded budget for the policy
            out[point.point_id] = {"budget_tokens": (r.get("budget_tokens"), str(e))}
            continue
        if now is None:
            continue
        now = json.loads(json.dumps(now, default=str))
        diff = {k: (was.get(k), now.get(k)) for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)}
        if diff:
            out[point.point_id] = diff
    return out


def format_value(value, fmt: str) -> str:
    """`value` in `fmt`, '-' for None, `str(value)` when the format does not apply."""
    if value is None:
        return "-"
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def markdown_table(columns: list[tuple[str, str, str]], rows: list[dict], *, footer: str = "") -> str:
    """`rows` as aligned Markdown under `columns` (header with its unit, record key, format); numbers right-aligned,
    the first column left-aligned; ``footer`` (a note) after a blank line."""
    header = [h for h, _, _ in columns]
    body = [[format_value(r.get(k), f) for _, k, f in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for b in body:
        lines.append(
            "| " + " | ".join(c.rjust(w) if i > 0 else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths))) + " |"
        )
    return "\n".join(lines) + "\n" + (f"\n{footer}\n" if footer else "")


def conditions_line(records: Iterable[dict]) -> str:
    """The line every results table starts with: what its numbers ran on (model, dtype and why, device, CPU,
    torch threads, commit), each distinct value of the run's records, comma-joined."""
    recs = list(records)

    def distinct(key: str) -> str:
        return ", ".join(sorted({str(r[key]) for r in recs if r.get(key) is not None})) or "-"

    reasons = distinct("dtype_reason")
    return (
        f"Conditions: model {distinct('model_id')}; dtype {distinct('dtype')}"
        + (f" ({reasons})" if reasons != "-" else "")
        + f"; device {distinct('device')}; CPU {distinct('cpu_model')}; {distinct('torch_threads')} torch "
        f"thread(s) per replica; commit {distinct('git_commit')}\n\n"
    )


@dataclass(frozen=True)
class Report:
    """What a kind's report wrote: the table printed at the end, and every file written (table.md first)."""

    table: str
    files: tuple[Path, ...]


def mixed_dtypes(records: Iterable[dict]) -> str | None:
    """A warning when `records` (points read together: a run's, or files concatenated from several runs) ran in
    more than one resolved dtype for one requested dtype (``dtype: auto`` resolved differently), naming each with
    its points; None when they agree. A resumed run refuses such a mix (`workloads.core.run.check_resolved_dtype`);
    records put together by hand are not resumed, so their report says it."""
    by_request: dict[str, dict[str, list[str]]] = {}
    for r in records:
        if r.get("dtype_reason") is not None:
            by_request.setdefault(str(r.get("dtype_requested")), {}).setdefault(str(r.get("dtype")), []).append(
                str(r.get("point_id"))
            )
    mixed = {req: seen for req, seen in by_request.items() if len(seen) > 1}
    if not mixed:
        return None
    parts = [
        f"dtype {req!r} resolved to "
        + " and ".join(f"{d} ({len(ids)} points, e.g. {ids[0]})" for d, ids in seen.items())
        for req, seen in mixed.items()
    ]
    return "; ".join(parts) + ": their timings are not comparable (set dtype explicitly to compare runs)"


def report_main(prog: str, write_report, argv: list[str] | None = None) -> int:
    """The command line of a run's report (``python -m <prog> results/<run_id>``): reads the run's
    ``points.jsonl``, calls ``write_report(run_dir, records)`` (-> `Report`), prints its table on stdout and
    every file it wrote on stderr. Exit status 2 for a wrong command line or a run
    without records (the message names the file), else 0."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {prog} results/<run_id>", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    records = read_records(str(run_dir / "points.jsonl"))
    if not records:
        print(f"{prog}: no records in {run_dir / 'points.jsonl'}", file=sys.stderr)
        return 2
    mixed = mixed_dtypes(records)
    if mixed:
        print(f"{prog}: warning: {mixed}", file=sys.stderr)
    report = write_report(run_dir, records)
    print(report.table, end="")
    print(f"{prog}: wrote " + ", ".join(str(p) for p in report.files), file=sys.stderr)
    return 0


def save_figure(fig, path: str | Path, dpi: int = 120, tight_layout: bool = True) -> Path:
    """Write a matplotlib figure as PNG to `path` via a temporary file and rename (as `write_atomic`),
    laid out tight unless told not to, then close it; return the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.png")
    if tight_layout:
        fig.tight_layout()
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def write_atomic(path: str, text: str) -> None:
    """Write a whole file via a temporary file and rename (readers never see half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
