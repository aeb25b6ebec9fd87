"""Run a frontier suite: ``python -m workloads.frontier.runner SUITE [options]`` (``make frontier``).

Each point (one policy at one compression ratio) runs on one of N model replicas as
``ModelReplica.apply(run_frontier_point, point)`` through the run template every kind shares
(`workloads.core.template`, `workloads.core.dispatch`), and measures both numbers of the picture on that replica:
its capacity at the SLO (or, with ``throughput: max_batch``, output tok/s at its own max batch) under the run's one
KV memory limit, and perplexity of held-out text (`workloads.frontier.point`). Every finished point is one record
(``kind: frontier``) appended to ``<results-dir>/<run_id>/points.jsonl`` and pushed to the Pushgateway like a sweep
point; ``--resume RUN_ID``
skips the points already ``ok``. At the end ``frontier.png`` and ``table.md`` (the highest throughput within
the suite's ``quality_gate`` first, the Pareto frontier marked, `workloads.frontier.report`) are written next to
the points. ``--local`` runs the points in this process.

Exit status: 0 all points ok; 1 a point failed or no replica could start; 2 invalid suite or arguments
(nothing recorded); 130 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

from workloads.core.dispatch import replica_points
from workloads.core.template import Finished, Kind, Report, Session, kind_main
from workloads.frontier.point import run_frontier_point
from workloads.frontier.report import throughput_value, write_report
from workloads.frontier.suite import FrontierPoint, FrontierSuite
from workloads.quality.runner import apply_point, policy_label


class FrontierKind(Kind):
    """Capacity at the SLO (or throughput at each policy's own max batch) and held-out perplexity, on the same
    replicas."""

    name = "frontier"
    suite_model = FrontierSuite

    def execute(self, session: Session, pending: list[FrontierPoint]) -> Iterator[Finished]:
        return replica_points(session, pending, **apply_point(run_frontier_point, self.name))

    def record_fields(self, suite: FrontierSuite, point: FrontierPoint, finished: Finished) -> dict:
        label = policy_label(point.policy, point.policy_params)
        return dict(
            # another engine's rows are named after it: its full cache is not ours
            policy_label=label if point.engine == "ours" else f"{point.engine} {label}",
            engine=point.engine,
            prompt_tokens=point.prompt_tokens,
            new_tokens=point.new_tokens,
            quality_gate_max_perplexity_increase=suite.quality_gate.max_perplexity_increase,
            throughput=suite.throughput,  # the axis, on a failed point's record too (the report groups by it)
        )

    def ok_line(self, rec: dict) -> str:
        if rec.get("throughput") == "capacity":
            value, lower = throughput_value(rec)
            speed = (
                f"capacity {'>= ' if lower else ''}{value:.3g} req/s at the SLO"
                if value is not None
                else f"no capacity ({rec.get('capacity_status')})"
            ) + f" ({rec.get('capacity_probes')} probes)"
        else:
            speed = f"max batch {rec['batch_size']}, {rec['output_throughput_tok_per_s']:.1f} output tok/s"
        if rec.get("perplexity") is None:  # a backend without log-likelihoods: no perplexity, no gate
            return f"{speed}, {rec.get('quality_note') or 'no perplexity'}" + (
                f", B {rec['budget_tokens']} tok" if rec.get("budget_tokens") else ""
            )
        return (
            f"{speed}, perplexity {rec['perplexity']:.3f}"
            + (
                f" (95% CI {rec['perplexity_ci_low']:.3f}-{rec['perplexity_ci_high']:.3f})"
                if rec.get("perplexity_ci_low") is not None
                else ""
            )
            + (f", B {rec['budget_tokens']} tok" if rec.get("budget_tokens") else "")
        )

    def report(self, run_dir: Path, suite: FrontierSuite, records: list[dict]) -> Report:
        return write_report(run_dir, records, suite.quality_gate.max_perplexity_increase)


KIND = FrontierKind()


def main(argv: list[str] | None = None) -> int:
    return kind_main(KIND, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
