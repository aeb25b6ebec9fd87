"""Run a suite of any kind and record every point: the command line of `make sweep`.

    python -m workloads.sweep SUITE.yaml [--replicas N] [--results-dir results] [--run-id ID]
                              [--resume RUN_ID] [--address ADDR] [--local] [--pushgateway HOST:PORT|off]
                              [--set KEY=VALUE ...]

The suite's `kind:` picks its runner from `workloads.kinds.KINDS` (batch: `workloads.batch.runner`, serving:
`workloads.serving.runner`, quality: `workloads.quality.runner`, frontier: `workloads.frontier.runner`); every
kind runs through the one run template (`workloads.core.template.run_suite`): points appended to
`<results-dir>/<run_id>/points.jsonl` as they finish, `--resume RUN_ID` skips the finished ones, the kind's
table printed and written at the end, each point pushed to the Pushgateway.

Exit status: 0 all points ok; 1 a point failed or no replica could start (e.g. a missing model
path); 2 the suite or the arguments are invalid (nothing is recorded); 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

from workloads.core.run import SweepError, cli_main, runner_args
from workloads.core.suite import SuiteError
from workloads.core.template import run_suite
from workloads.kinds import KINDS, load_suite


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return runner_args(argv, "python -m workloads.sweep", __doc__, "suite YAML file, e.g. workloads/suites/smoke.yaml")


def run(args: argparse.Namespace) -> int:
    """Run ``args.suite`` as the kind it names; the exit status (see the module docstring)."""
    try:
        suite = load_suite(args.suite, args.set or ())
    except SuiteError as e:
        raise SweepError(str(e), 2) from None
    return run_suite(args, KINDS[suite.kind], suite, name="sweep")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return cli_main("sweep", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
