"""The labels and name prefixes every floor shares for the project's metrics: the replica's live series
(`replica.metrics`), the sweep's per-point summaries it pushes (`workloads.core.push`) and the dashboards' queries
all name their series with these, so they are declared once here, below the replica's code that records them."""

from __future__ import annotations

#: Prefix of every metric this project defines.
PREFIX = "scissorhands_"
#: Prefix Ray 2.60 puts in front of every `ray.util.metrics` name when it exports it.
RAY_EXPORT_PREFIX = "ray_"

#: Labels of every live replica metric (all low cardinality; no request ids). ``engine``: the backend that runs the
#: replica's requests (`replica.common.types.ENGINES`: ours or openvino), so ours' full cache and OpenVINO's are two series.
REPLICA_LABELS: tuple[str, ...] = ("policy", "compression_ratio", "replica", "model", "run_id", "engine")
#: `REPLICA_LABELS`' ``engine`` of our own engine (and of the static-batch replica, which only ours runs).
OURS_ENGINE = "ours"
#: Label of request-level replica metrics: whose requests they count (see `PHASES`).
PHASE_LABEL = "phase"
#: Values of `PHASE_LABEL`: requests measured by the load generator, and its warm-up requests.
PHASES: tuple[str, ...] = ("measured", "warmup")
#: Labels of every per-point sweep summary (``run_id`` comes from the Pushgateway grouping key). ``engine``: the
#: backend that served the point (a record without one ran on ours: batch and quality points).
#: Every sweep axis is a label, so no two points of a run share a series; `budget_tokens` is
#: the requested absolute budget ("" when the budget comes from `compression_ratio`).
POINT_LABELS: tuple[str, ...] = (
    "policy",
    "compression_ratio",
    "budget_tokens",
    "batch_size",
    "prompt_tokens",
    "new_tokens",
    "concurrency",
    "request_rate",
    "kv_bits",
    "task",
    "model",
    "engine",
)
