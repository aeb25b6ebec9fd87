"""Every suite kind, and the one front door that reads a suite file of any of them.

    KINDS["batch"].suite_model        # the kind's pydantic model
    suite = load_suite("workloads/suites/smoke.yaml")

A kind is one folder `workloads/<kind>/` (`suite.py`: its model and points; `runner.py`: its `Kind`, the half of
the run template it supplies; `report.py`: its tables) plus one line here, as a policy is one file plus one line
in `scissorhands.POLICIES`.
"""

from __future__ import annotations

from typing import Any, Sequence

from workloads.batch.runner import KIND as BATCH
from workloads.core.suite import read_suite_file, validate_suite
from workloads.core.template import Kind
from workloads.frontier.runner import KIND as FRONTIER
from workloads.quality.runner import KIND as QUALITY
from workloads.serving.runner import KIND as SERVING

KINDS: dict[str, Kind] = {"batch": BATCH, "serving": SERVING, "quality": QUALITY, "frontier": FRONTIER}


def parse_suite(data: Any, source: str = "<suite>"):
    """Validate a parsed YAML mapping into the suite model of the kind it names (`KINDS`).

    Raises:
        workloads.core.suite.SuiteError: as `workloads.core.suite.validate_suite`.
    """
    return validate_suite({name: kind.suite_model for name, kind in KINDS.items()}, data, source)


def load_suite(path: str, overrides: Sequence[str] = ()):
    """Read and validate a suite file of any kind, `overrides` (``KEY=VALUE``, the command line's ``--set``)
    applied first (`workloads.core.suite.read_suite_file`).

    Raises:
        workloads.core.suite.SuiteError: the file does not exist / is not valid YAML / an override is malformed /
            validation fails.
    """
    return parse_suite(read_suite_file(path, overrides), source=path)
