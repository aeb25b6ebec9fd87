"""Capacity at an SLO (a serving suite's `mode: capacity`): per series (policy and ratio), the highest Poisson
request rate whose SLO attainment stays at or above a target, found by bisection on a fixed grid of rates::

    mode: capacity
    capacity:
      min_rate_req_per_s: 0.1      # the bracket searched (req/s)
      max_rate_req_per_s: 1.6
      target_attainment: 0.99      # a probe passes when its slo_attainment >= this; in (0, 1]
      resolution: 0.25             # relative: adjacent rates of the grid are at most 25% apart
      max_probes: null             # default: what the grid needs (ceil(log2(rates + 1)))

* **The grid** (`CapacitySearch.grid`): ``steps + 1`` rates from `min_rate_req_per_s` to `max_rate_req_per_s`,
  ``min x q^i`` with ``q = (max / min)^(1 / steps)`` and the fewest steps that keep every ratio of adjacent rates
  at or below ``1 + resolution``; rates rounded to 6 significant digits. Every series probes rates of this one grid,
  and every probe, of every series at every rate, is seeded by the suite's `seed` alone (`probe_seed`): the same
  requests, and the same arrival pattern scaled to the rate (gamma gaps are a standard draw times 1 / rate). So
  every series at one rate gets the same requests at the same times (a paired comparison), and from one rate to
  the next only the rate changes, not the draw (common random numbers): with a draw per rate, the realized
  rate of 64 Poisson arrivals strays about 12% from its target, and attainment was seen to fall from one rate
  to the next and rise again at the one after (docs/results/2026-12-04-mixed-scheduler.md).
* **The search** (`bisect`): binary search over the grid's indexes between two sentinels, a pass below the lowest
  rate and a fail above the highest; each probe is the middle of the rates still open, a pass raises the lower
  end, a fail lowers the upper one, until they are adjacent (``hi / lo - 1 <= resolution``). A probe *passes*
  (`passed`) when its record is ``ok`` and its ``slo_attainment >= target_attainment``; an ``oom`` probe fails (the
  memory limit is part of the capacity); a probe whose requests all timed out or were refused for load is ``ok`` with
  attainment 0 (`workloads.serving.point.run_point`), so it fails and the search moves down. An ``error`` probe (a
  replica died, a point could not start) is no result:
  its series stops for this run (status ``searching``, exit 1) and a resumed run probes that rate again, as the
  other modes run a failed point again (`bisect` is a function of the results, so the path re-derives). The search
  assumes attainment does not rise with the rate; where noise breaks that, it still ends on a passing rate next
  to a failing one.
* **Statuses** (`STATUSES`): ``ok`` (capacity = the highest passing rate, the lowest failing one next to it);
  ``below_min_rate`` (the lowest rate already fails: no capacity in the bracket); ``at_least_max_rate`` (the
  highest rate passes: the capacity is at least that); ``not_converged`` (`max_probes` ran out before the
  resolution; the bracket so far is reported, no capacity); ``searching`` (the run stopped mid-search: resume it).
  Only ``ok`` reports `capacity_req_per_s`.
* **Resume**: the search is a function of the records already written (`search_series`), so a resumed run
  re-derives each series' next probe from ``points.jsonl`` and never runs a recorded probe again. The search
  settings are not part of a probe's id (its numbers depend on the rate, not on the target or the bracket): a run
  resumed with a larger `max_probes` goes on where a ``not_converged`` search stopped, and one resumed with another
  target or bracket reuses every probe it recorded at a rate of the new grid.

**Over sessions** (a suite with a ``sessions:`` block, `workloads.load.sessions`): the bracket is
``min_rate_sessions_per_s`` / ``max_rate_sessions_per_s``, the rates are session start rates, a probe passes on its
``session_slo_attainment`` (a session meets the SLO when every one of its turns does), and the record keys say
``sessions_per_s`` instead of ``req_per_s`` (`summary_keys`, `rate_of`); everything else is the same.

Every probe is a full serving point (its record, table row and Prometheus series), with the search's state after
it: ``capacity_probe`` (its place in its series' search), ``capacity_passed``, and `summary_fields`
(``capacity_status``, ``capacity_req_per_s``, the bracket ``capacity_lo_req_per_s`` / ``capacity_hi_req_per_s``,
``capacity_probes``, ``capacity_target_attainment``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterable, Iterator, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from workloads.core.results import latest_by_point

#: What a series' search ended in (or `searching`: not ended yet), see the module docstring.
STATUSES = ("ok", "below_min_rate", "at_least_max_rate", "not_converged", "searching")
#: The finest resolution accepted (1%: finer than the attainment of a probe of a few dozen requests can tell).
MIN_RESOLUTION = 0.01
#: The most rates one grid holds (a wider bracket or a finer resolution is refused, naming `capacity.resolution`).
MAX_GRID_RATES = 1000

Rate = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _significant(x: float) -> float:
    """`x` to 6 significant digits (the point tag's `:g`; a rate reproduces on every machine)."""
    return float(f"{x:.6g}")


#: What a search's rates count, by unit: the suffix of its bracket fields and record keys, and the attainment a probe
#: is judged by (a request meets the SLO; a session meets it when every one of its turns does).
RATE_UNITS = {
    "req/s": ("req_per_s", "slo_attainment"),
    "sessions/s": ("sessions_per_s", "session_slo_attainment"),
}


class CapacitySearch(BaseModel):
    """A serving suite's ``capacity:`` (see the module docstring); each invalid field raises ValueError naming it.

    The bracket is in requests per second (``min_rate_req_per_s``, ``max_rate_req_per_s``: Poisson request rates) or,
    for a suite with a ``sessions:`` block, in sessions per second (``min_rate_sessions_per_s``,
    ``max_rate_sessions_per_s``: session start rates, judged by the session SLO attainment); one pair exactly."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    min_rate_req_per_s: Rate | None = None
    max_rate_req_per_s: Rate | None = None
    min_rate_sessions_per_s: Rate | None = None
    max_rate_sessions_per_s: Rate | None = None
    target_attainment: float = 0.99
    resolution: float = 0.1
    max_probes: Annotated[int, Field(strict=True)] | None = None

    @field_validator("target_attainment")
    @classmethod
    def _a_fraction(cls, value: float) -> float:
        if not (math.isfinite(value) and 0 < value <= 1):
            raise ValueError(f"a fraction of requests in (0, 1] (0.99: 99% meet the SLO), got {value!r}")
        return value

    @field_validator("resolution")
    @classmethod
    def _a_relative_step(cls, value: float) -> float:
        if not (math.isfinite(value) and value >= MIN_RESOLUTION):
            raise ValueError(
                f"the relative step between adjacent rates (0.1: 10% apart), at least {MIN_RESOLUTION}, got {value!r}"
            )
        return value

    @field_validator("max_probes")
    @classmethod
    def _two_or_more(cls, value: int | None) -> int | None:
        if value is not None and value < 2:
            raise ValueError(f"a bracket takes at least 2 probes (one that passes, one that fails), got {value}")
        return value

    @model_validator(mode="after")
    def _a_bracket(self) -> "CapacitySearch":
        pairs = {
            unit: (getattr(self, f"min_rate_{suffix}"), getattr(self, f"max_rate_{suffix}"))
            for unit, (suffix, _) in RATE_UNITS.items()
        }
        given = [unit for unit, pair in pairs.items() if any(v is not None for v in pair)]
        if len(given) != 1 or None in pairs[given[0]]:
            raise ValueError(
                "capacity: give one rate bracket: min_rate_req_per_s and max_rate_req_per_s (Poisson request rates), "
                "or min_rate_sessions_per_s and max_rate_sessions_per_s (session start rates, with a sessions: block)"
                + (f"; got {', '.join(given)} fields" if len(given) > 1 else "")
            )
        lo, hi = self.min_rate, self.max_rate
        sfx = self.rate_suffix
        if lo >= hi:
            raise ValueError(
                f"capacity.min_rate_{sfx}, capacity.max_rate_{sfx}: the rate bracket [{lo:g}, {hi:g}] {self.unit} "
                f"is empty or inverted; give a min_rate_{sfx} below max_rate_{sfx}"
            )
        n = len(self.grid())
        if n > MAX_GRID_RATES:
            raise ValueError(
                f"capacity.resolution: {self.resolution:g} over [{lo:g}, {hi:g}] req/s makes a grid of {n} rates "
                f"(at most {MAX_GRID_RATES}); raise the resolution or narrow the bracket"
            )
        return self

    @property
    def unit(self) -> str:
        """What the rates count: ``req/s`` (requests per second) or ``sessions/s`` (session starts per second)."""
        return "req/s" if self.min_rate_req_per_s is not None else "sessions/s"

    @property
    def over_sessions(self) -> bool:
        """Whether the search is over session start rates (a suite with a ``sessions:`` block)."""
        return self.unit == "sessions/s"

    @property
    def rate_suffix(self) -> str:
        """The unit's suffix of the bracket fields and the record keys (``req_per_s``, ``sessions_per_s``)."""
        return RATE_UNITS[self.unit][0]

    @property
    def attainment_key(self) -> str:
        """The record key a probe is judged by: ``slo_attainment``, or ``session_slo_attainment`` over sessions."""
        return RATE_UNITS[self.unit][1]

    @property
    def min_rate(self) -> float:
        return self.min_rate_req_per_s if self.unit == "req/s" else self.min_rate_sessions_per_s

    @property
    def max_rate(self) -> float:
        return self.max_rate_req_per_s if self.unit == "req/s" else self.max_rate_sessions_per_s

    def grid(self) -> tuple[float, ...]:
        """The rates every series may probe, increasing (`unit`): the module docstring's grid."""
        lo, hi, res = self.min_rate, self.max_rate, self.resolution
        steps = max(1, math.ceil(math.log(hi / lo) / math.log1p(res) - 1e-9))
        while True:  # one more step when rounding pushed a ratio past the resolution (a 1e-6 effect)
            q = (hi / lo) ** (1 / steps)
            rates = (lo, *(_significant(lo * q**i) for i in range(1, steps)), hi)
            if all(b / a - 1 <= res for a, b in zip(rates, rates[1:])) or steps > MAX_GRID_RATES:
                return rates
            steps += 1

    @property
    def probes(self) -> int:
        """The most probes a series' search takes: `max_probes`, else what the grid needs to converge."""
        return self.max_probes if self.max_probes is not None else needed_probes(len(self.grid()))

    def describe(self) -> str:
        """One line: the grid, the target and the probes (for the run's header and the table)."""
        rates = self.grid()
        step = (rates[-1] / rates[0]) ** (1 / (len(rates) - 1))
        what = "session start rates" if self.over_sessions else "Poisson rates"
        judged = (
            "session SLO attainment (every turn of a session meets the SLO)" if self.over_sessions else "SLO attainment"
        )
        return (
            f"the highest of {len(rates)} {what} from {rates[0]:g} to {rates[-1]:g} {self.unit} (x{step:.3g} a step, "
            f"resolution {self.resolution:g}) with {judged} >= {self.target_attainment:g}, at most "
            f"{self.probes} probes a series"
        )


def needed_probes(candidates: int) -> int:
    """The most probes a binary search over `candidates` open rates takes: ceil(log2(candidates + 1))."""
    return max(0, candidates).bit_length()


def probe_seed(seed: int) -> int:
    """The seed of every capacity probe's requests and arrival times: the suite's `seed` alone, never the rate or
    the probe's place in a search (the module docstring's common random numbers)."""
    return seed * 1_009  # the seed a rate sweep's first load takes (`ServingSuite.workload_seed`)


def passed(record: Mapping[str, Any], target_attainment: float, attainment_key: str = "slo_attainment") -> bool:
    """Whether a probe's record (or point body) meets the target: ``ok`` and its `attainment_key` (``slo_attainment``,
    or ``session_slo_attainment`` for a search over sessions) ``>= target``; an ``oom`` probe, or one without arrivals
    (attainment null), fails (an ``error`` one is no result: `results`)."""
    attainment = record.get(attainment_key)
    return record.get("status") == "ok" and attainment is not None and attainment >= target_attainment


@dataclass(frozen=True)
class Search:
    """Where one series' search stands. Indexes are the grid's; `lo` the highest passing index on the path, `hi`
    the lowest failing one (None: none yet); `next` the index to probe next (status ``searching``), `remaining`
    the most probes still to run."""

    status: str
    path: tuple[int, ...]  # the indexes probed, in order
    lo: int | None
    hi: int | None
    next: int | None
    remaining: int


def bisect(n: int, results: Mapping[int, bool], max_probes: int) -> Search:
    """The search over a grid of `n` rates given the `results` known (index -> passed), with at most `max_probes`
    probes (the module docstring's rule). Pure: the same results give the same path, whatever order they came in."""
    lo, hi, path = -1, n, []  # sentinels: a pass below the grid, a fail above it
    status = None
    while hi - lo > 1:
        if len(path) >= max_probes:
            status = "not_converged"
            break
        mid = (lo + hi) // 2
        if mid not in results:
            remaining = min(max_probes - len(path), needed_probes(hi - lo - 1))
            return Search("searching", tuple(path), _index(lo, n), _index(hi, n), mid, remaining)
        path.append(mid)
        lo, hi = (mid, hi) if results[mid] else (lo, mid)
    if status is None:
        status = "below_min_rate" if lo < 0 else "at_least_max_rate" if hi >= n else "ok"
    return Search(status, tuple(path), _index(lo, n), _index(hi, n), None, 0)


def _index(i: int, n: int) -> int | None:
    return i if 0 <= i < n else None


#: The record keys of `summary_fields`.
SUMMARY_KEYS = (
    "capacity_status",
    "capacity_req_per_s",
    "capacity_lo_req_per_s",
    "capacity_hi_req_per_s",
    "capacity_probes",
    "capacity_target_attainment",
)


def summary_keys(unit: str = "req/s") -> tuple[str, ...]:
    """`SUMMARY_KEYS` for a search in `unit`: ``capacity_sessions_per_s``, ... over sessions."""
    suffix = RATE_UNITS[unit][0]
    return tuple(k.replace("req_per_s", suffix) for k in SUMMARY_KEYS)


def rate_unit(record: Mapping[str, Any]) -> str:
    """The unit of a probe's record or a `summaries` row: ``sessions/s`` when it has the sessions keys."""
    return (
        "sessions/s" if "capacity_sessions_per_s" in record or record.get("capacity_unit") == "sessions/s" else "req/s"
    )


def rate_of(record: Mapping[str, Any], which: str = "") -> float | None:
    """A record's capacity (`which` ``""``), or its bracket's ``lo`` / ``hi``, in its own unit (`rate_unit`)."""
    suffix = RATE_UNITS[rate_unit(record)][0]
    return record.get(f"capacity_{which + '_' if which else ''}{suffix}")


def summary_fields(
    search: Search, rates: tuple[float, ...] | list[float], target_attainment: float, unit: str = "req/s"
) -> dict:
    """The search's state under its record keys: ``capacity_status``, ``capacity_req_per_s`` (the highest passing
    rate; only when ``ok``), the bracket ``capacity_lo_req_per_s`` (highest passing rate probed, null: none passed)
    and ``capacity_hi_req_per_s`` (lowest failing rate probed, null: none failed), ``capacity_probes`` (probes
    used) and ``capacity_target_attainment``; over sessions (`unit` ``sessions/s``) the rates under
    ``capacity_sessions_per_s``, ``capacity_lo_sessions_per_s`` and ``capacity_hi_sessions_per_s``."""
    lo = rates[search.lo] if search.lo is not None else None
    hi = rates[search.hi] if search.hi is not None else None
    values = (search.status, lo if search.status == "ok" else None, lo, hi, len(search.path), target_attainment)
    return dict(zip(summary_keys(unit), values, strict=True))


def by_series(points: Iterable) -> dict[str, list]:
    """A capacity suite's points (`workloads.serving.suite.ServingPoint`) per series, each in grid order."""
    out: dict[str, list] = {}
    for p in points:
        out.setdefault(p.series, []).append(p)
    return out


#: The probe statuses that are results of a search (an ``error`` probe is run again).
RESULT_STATUSES = ("ok", "oom")


def search_series(spec: CapacitySearch, series_points: list, latest: Mapping[str, dict]) -> Search:
    """One series' search given `latest` (point id -> its latest record): every probe recorded ``ok`` or ``oom``
    is a result."""
    target = spec.target_attainment
    results = {
        i: passed(latest[p.point_id], target, spec.attainment_key)
        for i, p in enumerate(series_points)
        if latest.get(p.point_id, {}).get("status") in RESULT_STATUSES
    }
    return bisect(len(series_points), results, spec.probes)


def errored_next(search: Search, series_points: list, latest: Mapping[str, dict]) -> bool:
    """Whether the probe a search waits for has an ``error`` record (its series stops until a resumed run)."""
    return search.next is not None and latest.get(series_points[search.next].point_id, {}).get("status") == "error"


def summaries(spec: CapacitySearch, points: Iterable, records: Iterable[dict]) -> list[dict]:
    """Per series, in suite order: ``series``, `summary_fields` of its search over `records` (the latest record
    of each point wins), and ``capacity_errored_probes`` (1 when the probe it waits for errored, else 0)."""
    latest = latest_by_point(records)
    out = []
    for series, pts in by_series(points).items():
        search = search_series(spec, pts, latest)
        rates = [p.load for p in pts]
        errored = int(errored_next(search, pts, latest))
        out.append(
            {
                "series": series,
                **summary_fields(search, rates, spec.target_attainment, spec.unit),
                "capacity_errored_probes": errored,
                "capacity_unit": spec.unit,
            }
        )
    return out


def searches(suite, records: list[dict], run: Callable[[Any], dict]) -> Iterator[tuple[Any, dict, float]]:
    """Each series' search of a capacity suite (`workloads.serving.suite.ServingSuite`, ``mode: capacity``) in suite
    order, one probe at a time (the next depends on the last), resumed from `records`: every recorded probe is a
    result (`search_series`). Yields (point, body, start time in Unix s); each body (``run(point)``, a serving
    point's metrics with its ``status``) carries the search's state after it (``capacity_probe``,
    ``capacity_passed``, `summary_fields`). The serving runner's search, and each capacity point of a frontier
    (`workloads.frontier.point`)."""
    spec = suite.capacity
    latest = latest_by_point(records)
    errored: set[str] = set()  # probes that errored in this run (a resumed run probes them again)
    for pts in by_series(suite.points()).values():
        rates = [p.load for p in pts]
        while (search := search_series(spec, pts, latest)).next is not None:
            if errored_next(search, pts, latest) and pts[search.next].point_id in errored:
                break  # it errored in this run: the series waits for a resumed run
            point, t0 = pts[search.next], time.time()
            body = run(point)
            latest[point.point_id] = dict(body)  # the probe's result (its status included), for the next step
            if body["status"] == "error":
                errored.add(point.point_id)
            after = search_series(spec, pts, latest)
            body.update(
                capacity_probe=len(after.path),
                capacity_passed=passed(body, spec.target_attainment, spec.attainment_key),
                **summary_fields(after, rates, spec.target_attainment, spec.unit),
            )
            yield point, body, t0
