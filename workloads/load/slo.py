"""Latency service-level objectives (SLOs) of a load point, and whether one request meets them.

A serving suite states them under ``slo:`` (seconds; `workloads.serving.suite.ServingSuite.slo`)::

    slo: {ttft_s: 2.0, tpot_s: 0.1}          # the defaults; add e2e_latency_s: 30 to bound the whole request too

The defaults are MLPerf Inference's server-scenario limits for Llama-3.1-8B: TTFT 2,000 ms and TPOT 100 ms.
MLPerf applies them to a run's p99; here they apply to every request, as vLLM's ``bench serve --goodput``
applies its SLOs: a request is *good* when it meets every SLO of the point. The rule for one request
(`SLO.met_by`):

* a request that failed, or was never sent (a dropped arrival), meets none;
* ``ttft_s <= slo.ttft_s``, ``tpot_s <= slo.tpot_s`` and, when set, ``e2e_latency_s <= slo.e2e_latency_s``
  (a value at the limit meets it);
* a one-token request has no TPOT (`workloads.load.metrics.RequestRecord.tpot_s` is None): it meets the
  TPOT SLO vacuously, as in vLLM's goodput, which counts its TPOT as 0; its TTFT and e2e are still checked.

Attainment and goodput over a point's requests are `workloads.load.metrics.summarize`'s (its definitions table).

A request that timed out (`timeout`) or that the server refused for load (`overloaded`: HTTP 429/503, a full queue,
Serve's back-pressure) is a measurement of the load that misses the SLO (`SLO_MISS_ERROR_KINDS`): a point where every
request ended so is a result of attainment 0 (`workloads.serving.point.run_point`), not an error. Only a dead replica,
a configuration that failed, or another error kind makes a point with no completed request an error.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import BeforeValidator

from replica.common.rules import Section
from workloads.load.numbers import significant

if TYPE_CHECKING:
    from workloads.load.metrics import RequestRecord

#: The error kinds that measure the load (it was too much for the server) rather than break the point: they miss the
#: SLO, and a point whose requests all ended in them is a result of attainment 0 (the module docstring).
SLO_MISS_ERROR_KINDS = ("timeout", "overloaded")

#: MLPerf Inference's server-scenario latency limits for Llama-3.1-8B, in seconds (p99 limits there).
MLPERF_LLAMA31_8B_TTFT_S = 2.0
MLPERF_LLAMA31_8B_TPOT_S = 0.1


def _positive_seconds(value: Any) -> float:
    """A positive, finite number of seconds (an int or a float; not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a positive number of seconds (for example 2.0 or 0.1), got {value!r}")
    return float(value)


Seconds = Annotated[float, BeforeValidator(_positive_seconds)]


class SLO(Section):
    """Per-request latency limits in seconds: `ttft_s` (send -> first token), `tpot_s` (time per output token after
    the first), and optionally `e2e_latency_s` (send -> last token; None: not checked).

    Raises (on construction) `pydantic.ValidationError` whose message names the field (``ttft_s: expected a
    positive number of seconds ...``): a limit that is not a positive finite number, an unknown key, or a value
    that is not a mapping.
    """

    form: ClassVar[str] = (
        "a mapping {ttft_s: S, tpot_s: S, e2e_latency_s: S} of positive seconds (e2e_latency_s optional)"
    )
    ttft_s: Seconds = MLPERF_LLAMA31_8B_TTFT_S
    tpot_s: Seconds = MLPERF_LLAMA31_8B_TPOT_S
    e2e_latency_s: Seconds | None = None

    def met_by(self, record: RequestRecord) -> bool:
        """Whether `record` meets every limit (the module docstring's rule: failed or unsent -> False; one token ->
        the TPOT limit is met vacuously)."""
        if not record.ok:
            return False
        tpot = record.tpot_s
        return (
            record.ttft_s <= self.ttft_s
            and (tpot is None or tpot <= self.tpot_s)
            and (self.e2e_latency_s is None or record.e2e_latency_s <= self.e2e_latency_s)
        )

    def record_fields(self) -> dict[str, float | None]:
        """The limits under their record keys: ``slo_ttft_s``, ``slo_tpot_s``, ``slo_e2e_latency_s`` (seconds)."""
        return {"slo_ttft_s": self.ttft_s, "slo_tpot_s": self.tpot_s, "slo_e2e_latency_s": self.e2e_latency_s}


#: The default SLO (MLPerf's Llama-3.1-8B server limits), what a point without one of its own is judged by.
DEFAULT_SLO = SLO()


def describe_slo(ttft_s: float | None, tpot_s: float | None, e2e_latency_s: float | None = None) -> str:
    """The limits in milliseconds for a printed table: ``TTFT <= 2000 ms, TPOT <= 100 ms`` (+ e2e when set)."""
    parts = [
        f"{name} <= {significant(value * 1000, 6)} ms"
        for name, value in (("TTFT", ttft_s), ("TPOT", tpot_s), ("e2e", e2e_latency_s))
        if value is not None
    ]
    return ", ".join(parts) or "none"
