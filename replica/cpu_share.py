"""How much CPU a measurement's processes got of what they asked for: the one contention check of every sweep
point and bench row.

A timing taken while another job holds the cores is not a result: on a 2-core machine one busy neighbour can make
our engine several times slower than idle. Every point therefore records, from two `sample` calls
taken in the process that did the work (in-process: this process; a point replica: around the point in its actor;
a Serve serving replica: its own ``cpu_sample`` call before and after the point's load):

* ``cpu_share`` (0..1): the time the process's threads ran on a CPU over the time they were runnable (ran +
  waited in the run queue), summed over its threads, from Linux's ``/proc/<pid>/task/*/schedstat``. Time a
  thread sleeps (an idle replica waiting for requests) counts in neither, so an idle-by-design point is not taken
  for a starved one. None where the OS does not give it.
* ``cpu_busy_share``: process CPU seconds / (wall seconds x torch threads) -- what the point got against what its
  threads could have used. Meaningful for points that keep their threads busy (a batch, a bench row); it is the
  fallback decision where ``cpu_share`` is None and the caller says the work was busy.
* ``cpu_steal_share``: the machine's steal ticks over all ticks (``/proc/stat``; a VM's host ran someone else);
  ``cpu_pressure_share``: the fraction of the time some task of the machine (or cgroup) waited for a CPU
  (``/proc/pressure/cpu``, "some"); ``loadavg_1m`` at the end (``/proc/loadavg``). Recorded, not decided on.
* ``contended``: ``cpu_share < CONTENDED_BELOW`` or ``cpu_steal_share > STEAL_ABOVE`` (``contended_rule`` names
  the rule in the record); None when nothing decides.

Source followed: the kernel's ``Documentation/scheduler/sched-stats.rst`` (schedstat: time on CPU, time waiting
on a run queue, in ns) and ``Documentation/accounting/psi.rst`` (pressure ``total`` in microseconds).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping

#: A point whose threads ran less than this share of the time they were runnable waited for cores: flagged.
CONTENDED_BELOW = 0.75
#: Steal above this share of the machine's ticks flags a point too (the VM's host gave the cores elsewhere).
STEAL_ABOVE = 0.10
CONTENDED_RULE = f"cpu_share < {CONTENDED_BELOW} or cpu_steal_share > {STEAL_ABOVE}"
#: Below this many seconds of runnable (or wall) time a share is scheduler noise, not a measurement: None.
MIN_MEASURED_S = 0.05
#: Record fields `measure` returns (tables and tests read them by these names).
FIELDS = (
    "cpu_share",
    "cpu_busy_share",
    "cpu_process_s",
    "cpu_wait_s",
    "cpu_steal_share",
    "cpu_pressure_share",
    "loadavg_1m",
    "contended",
    "contended_rule",
)


@dataclass(frozen=True)
class CpuSample:
    """Counters of one process (and the machine) at one moment; plain numbers, so a Ray actor can return it.

    `wall_s`: ``time.monotonic()`` of the sampled process; `process_cpu_s`: user + system seconds of its threads
    (and of children it waited for); `run_s` / `wait_s`: schedstat's time on a CPU / runnable but waiting, summed
    over its live threads (None without schedstat); `threads`: torch threads it asked for; `steal_ticks` /
    `total_ticks`: ``/proc/stat``'s cpu line; `pressure_some_us`: ``/proc/pressure/cpu`` some total.
    """

    wall_s: float
    process_cpu_s: float
    run_s: float | None
    wait_s: float | None
    threads: int
    steal_ticks: int | None = None
    total_ticks: int | None = None
    pressure_some_us: int | None = None
    loadavg_1m: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _schedstat(pid: int | str) -> tuple[float, float] | None:
    """(ran_s, waited_s) summed over the threads of `pid` now, or None without schedstat."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    run_ns = wait_ns = 0
    seen = False
    for tid in tids:
        text = _read(f"/proc/{pid}/task/{tid}/schedstat")
        if not text:
            continue  # the thread ended between the listing and the read
        parts = text.split()
        run_ns, wait_ns, seen = run_ns + int(parts[0]), wait_ns + int(parts[1]), True
    return (run_ns / 1e9, wait_ns / 1e9) if seen else None


def _machine() -> dict:
    out: dict = {}
    stat = _read("/proc/stat")
    if stat and stat.startswith("cpu "):
        ticks = [int(x) for x in stat.splitlines()[0].split()[1:]]
        out["total_ticks"] = sum(ticks[:8])  # user..steal; guest time is already inside user
        out["steal_ticks"] = ticks[7] if len(ticks) > 7 else 0
    pressure = _read("/proc/pressure/cpu")
    if pressure:
        some = next((line for line in pressure.splitlines() if line.startswith("some")), "")
        total = next((kv for kv in some.split() if kv.startswith("total=")), None)
        out["pressure_some_us"] = int(total.split("=")[1]) if total else None
    load = _read("/proc/loadavg")
    if load:
        out["loadavg_1m"] = float(load.split()[0])
    return out


def sample(threads: int | None = None) -> CpuSample:
    """This process's counters now. `threads`: what it asks for (default: torch's intra-op threads when torch is
    loaded, else 1). Cheap (a few /proc reads per thread): a Ray actor answers it inside its stats call."""
    if threads is None:
        torch = sys.modules.get("torch")  # never imports torch for a process that has none
        threads = torch.get_num_threads() if torch is not None else 1
    times = os.times()
    sched = _schedstat("self")
    return CpuSample(
        wall_s=time.monotonic(),
        process_cpu_s=times.user + times.system + times.children_user + times.children_system,
        run_s=sched[0] if sched else None,
        wait_s=sched[1] if sched else None,
        threads=max(1, int(threads)),
        **_machine(),
    )


def _as_sample(s: CpuSample | Mapping) -> CpuSample:
    return s if isinstance(s, CpuSample) else CpuSample(**s)


def _verdict(share: float | None, busy: float | None, steal: float | None, is_busy: bool) -> bool | None:
    decider = share if share is not None else (busy if is_busy else None)
    if decider is None and steal is None:
        return None
    return bool((decider is not None and decider < CONTENDED_BELOW) or (steal is not None and steal > STEAL_ABOVE))


def measure(start: CpuSample | Mapping, end: CpuSample | Mapping, *, busy: bool = False) -> dict:
    """The record fields (`FIELDS`) of the work between two samples of one process (module docstring).

    `busy`: the work kept its threads busy throughout (a batch, a bench row), so ``cpu_busy_share`` may decide
    where schedstat is missing. Raises ValueError when `end` is older than `start` (samples of two processes).
    """
    a, b = _as_sample(start), _as_sample(end)
    wall = b.wall_s - a.wall_s
    if wall < 0:
        raise ValueError(f"end: sampled before start ({wall:.3f} s); both samples must come from one process")
    cpu = max(0.0, b.process_cpu_s - a.process_cpu_s)
    share = wait = None
    if a.run_s is not None and b.run_s is not None:
        ran, wait = max(0.0, b.run_s - a.run_s), max(0.0, b.wait_s - a.wait_s)
        share = ran / (ran + wait) if ran + wait >= MIN_MEASURED_S else None
    busy_share = min(1.0, cpu / (wall * b.threads)) if wall >= MIN_MEASURED_S else None
    steal = pressure = None
    if a.total_ticks is not None and b.total_ticks is not None and b.total_ticks > a.total_ticks:
        steal = (b.steal_ticks - a.steal_ticks) / (b.total_ticks - a.total_ticks)
    if a.pressure_some_us is not None and b.pressure_some_us is not None and wall > 0:
        pressure = min(1.0, (b.pressure_some_us - a.pressure_some_us) / 1e6 / wall)
    return {
        "cpu_share": _round(share),
        "cpu_busy_share": _round(busy_share),
        "cpu_process_s": _round(cpu),
        "cpu_wait_s": _round(wait),
        "cpu_steal_share": _round(steal),
        "cpu_pressure_share": _round(pressure),
        "loadavg_1m": b.loadavg_1m,
        "contended": _verdict(share, busy_share, steal, busy),
        "contended_rule": CONTENDED_RULE,
    }


def combine(parts: Iterable[Mapping]) -> dict:
    """One point's fields from several processes' `measure` results (replicas): the lowest share (the most
    starved replica decides), CPU and wait seconds summed, contended when any is."""
    parts = [p for p in parts if p]
    if not parts:
        return empty()

    def low(key: str) -> float | None:
        return min((p[key] for p in parts if p.get(key) is not None), default=None)

    def high(key: str) -> float | None:
        return max((p[key] for p in parts if p.get(key) is not None), default=None)

    def total(key: str) -> float | None:
        values = [p[key] for p in parts if p.get(key) is not None]
        return _round(sum(values)) if values else None

    verdicts = [p.get("contended") for p in parts if p.get("contended") is not None]
    return {
        "cpu_share": low("cpu_share"),
        "cpu_busy_share": low("cpu_busy_share"),
        "cpu_process_s": total("cpu_process_s"),
        "cpu_wait_s": total("cpu_wait_s"),
        "cpu_steal_share": high("cpu_steal_share"),
        "cpu_pressure_share": high("cpu_pressure_share"),
        "loadavg_1m": high("loadavg_1m"),
        "contended": any(verdicts) if verdicts else None,
        "contended_rule": CONTENDED_RULE,
    }


def empty() -> dict:
    """The fields of a point nothing measured (an external server): every value None."""
    return {**dict.fromkeys(FIELDS), "contended_rule": CONTENDED_RULE}


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)


class CpuMeter:
    """``with CpuMeter() as m: work()`` then ``m.fields`` (`measure` of this process over the block; `busy` as
    there). For in-process points and bench rows."""

    def __init__(self, threads: int | None = None, *, busy: bool = True):
        self.threads, self.busy, self.fields = threads, busy, empty()

    def __enter__(self) -> CpuMeter:
        self.start = sample(self.threads)
        return self

    def __exit__(self, *exc) -> None:
        self.fields = measure(self.start, sample(self.threads), busy=self.busy)


def note(fields: Mapping) -> str:
    """`` [contended: CPU share 0.41 < 0.75]`` for a contended point's progress line or table row, else ''."""
    if not fields.get("contended"):
        return ""
    share, steal = fields.get("cpu_share"), fields.get("cpu_steal_share")
    if share is None:
        share = fields.get("cpu_busy_share")
    what = []
    if share is not None and share < CONTENDED_BELOW:
        what.append(f"CPU share {share:.2f} < {CONTENDED_BELOW}")
    if steal is not None and steal > STEAL_ABOVE:
        what.append(f"steal {steal:.2f} > {STEAL_ABOVE}")
    return f" [contended: {', '.join(what) or 'see cpu_* fields'}]"


def contended_lines(records: Iterable[Mapping], id_key: str = "point_id") -> list[str]:
    """The lines a table ends with when some of its rows were contended (their ids), else none."""
    hit = [str(r.get(id_key)) for r in records if r.get("contended")]
    if not hit:
        return []
    return [
        f"`!` contended ({CONTENDED_RULE}; the processes waited for cores while other work ran): {', '.join(hit)}. "
        "Their timings are pessimistic and not a result; run again on an idle machine."
    ]


def measured(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` run under a `CpuMeter` (busy work: a whole point); a dict result gets the `FIELDS` added
    (its own keys win), any other result comes back as it is. Exceptions pass through."""
    with CpuMeter() as meter:
        result = call(*args)
    return {**meter.fields, **result} if isinstance(result, dict) else result


def mark(fields: Mapping) -> str:
    """A table cell: the point's CPU share (``cpu_share``, else ``cpu_busy_share``), ``!`` after it when contended;
    ``-`` when not measured."""
    share = fields.get("cpu_share")
    share = fields.get("cpu_busy_share") if share is None else share
    if share is None:
        return "-"
    return f"{share:.2f}{' !' if fields.get('contended') else ''}"


def row_fields(run: Mapping, cpu_s: float | None, wall_s: float | None, threads: int) -> dict:
    """The `FIELDS` of one row of a run whose rows share its time (a bench tool interleaving its rows step by step):
    the run's own ``cpu_share`` (`measure` over the whole run, `run`) and steal, the row's ``cpu_busy_share`` from
    its own CPU and wall seconds; contended as `measure` decides (the run's share first, the row's busy share
    where schedstat is missing)."""
    busy = min(1.0, cpu_s / (wall_s * max(1, threads))) if cpu_s is not None and wall_s else None
    share, steal = run.get("cpu_share"), run.get("cpu_steal_share")
    return {
        **run,
        "cpu_busy_share": _round(busy),
        "cpu_process_s": _round(cpu_s),
        "contended": _verdict(share, busy, steal, True),
    }
