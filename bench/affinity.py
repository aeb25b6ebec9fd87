"""CPU cores of their own for a server and its load clients on one machine (Linux CPU affinity).

A load client on the server's machine takes CPU from a CPU-bound server, so the server's steps slow down
while that client runs, and two clients that use different amounts of CPU measure different servers
(results/2026-12-01-crosscheck-9ff24ee.md). Giving the server and the clients disjoint CPU sets removes
that coupling: each side gets its own CPUs, and every client gets the same set.

Plan (`plan_affinity`), from the CPUs this process may use (``os.sched_getaffinity(0)``):

* ``auto``: the clients get the lowest ``max(1, n // 4)`` CPUs, the server the rest (2 CPUs: client
  ``{0}``, server ``{1}``; 8 CPUs: client ``{0, 1}``, server ``{2..7}``);
* ``CLIENT:SERVER``: two CPU lists in the kernel's format (``0:1``, ``0-1:2-7``, ``0,2:1,3``);
* ``off``: no affinity (both share every CPU; a report says so).

CPUs are logical CPUs as the kernel numbers them. On a machine with SMT, sibling threads of one core
share its execution units: pass explicit sets that keep siblings on one side
(``/sys/devices/system/cpu/cpu*/topology/thread_siblings_list``).

Pinning: a Linux thread's affinity is its own and a new thread or process inherits its creator's, so a
process started with an affinity (`preexec`) keeps its whole future tree there; a running process tree
is pinned thread by thread (`pin_tree`: every thread of the root and of each descendant, as
``taskset -a -p`` does for one process).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

#: The clients' share of the CPUs in `auto`: ``max(1, n // CLIENT_FRACTION_DIVISOR)``.
CLIENT_FRACTION_DIVISOR = 4


def parse_cpu_list(text: str, what: str = "CPU list") -> frozenset[int]:
    """``"0,2-3"`` -> ``{0, 2, 3}`` (the kernel's list format). ValueError naming `what` for an empty
    list, an empty item, a non-integer, a negative CPU or a range whose end is below its start."""
    cpus: set[int] = set()
    items = text.split(",")
    if not text.strip() or any(not i.strip() for i in items):
        raise ValueError(f"{what}: expected CPU numbers or ranges such as '0' or '1-3,5', got {text!r}")
    for item in items:
        lo, sep, hi = item.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{what}: {item.strip()!r} is not a CPU number or range (e.g. '1-3')") from None
        if first < 0 or last < first:
            raise ValueError(f"{what}: {item.strip()!r} is not a range of CPUs (start >= 0, end >= start)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``{0, 2, 3, 4}`` -> ``"0,2-4"`` (the kernel's list format, ranges where consecutive)."""
    out: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True)
class AffinityPlan:
    """Disjoint CPU sets: `client` for every load client (the same for each), `server` for the server's
    whole process tree."""

    client: frozenset[int]
    server: frozenset[int]

    def describe(self) -> str:
        return f"server on CPU {format_cpu_list(self.server)}, each client on CPU {format_cpu_list(self.client)}"


def plan_affinity(spec: str, available: Iterable[int], *, flag: str = "--affinity") -> AffinityPlan | None:
    """The plan `spec` (``auto``, ``off`` or ``CLIENT:SERVER``) makes of the `available` CPUs; None for ``off``.

    Raises:
        ValueError: fewer than 2 CPUs available (the message says how many and what to pass instead); in
            ``CLIENT:SERVER``, a bad list, sets that overlap, or a CPU outside `available`. The message
            names `flag`.
    """
    avail = sorted(set(available))
    spec = spec.strip()
    if spec == "off":
        return None
    if spec == "auto":
        if len(avail) < 2:
            raise ValueError(
                f"{flag} auto: the server and the clients need CPUs of their own, at least 2; this process may "
                f"use {len(avail)} ({format_cpu_list(avail) or 'none'}, os.sched_getaffinity). Run on a machine "
                f"with more CPUs, or pass {flag} off to let them share (the report then says so)"
            )
        k = max(1, len(avail) // CLIENT_FRACTION_DIVISOR)
        return AffinityPlan(client=frozenset(avail[:k]), server=frozenset(avail[k:]))
    client_text, sep, server_text = spec.partition(":")
    if not sep:
        raise ValueError(f"{flag}: expected auto, off or CLIENT:SERVER CPU lists (e.g. 0:1 or 0-1:2-7), got {spec!r}")
    client = parse_cpu_list(client_text, f"{flag} (client CPUs)")
    server = parse_cpu_list(server_text, f"{flag} (server CPUs)")
    if client & server:
        raise ValueError(
            f"{flag}: the client and server CPU sets overlap on {format_cpu_list(client & server)}; give each "
            "side CPUs of its own"
        )
    outside = (client | server) - set(avail)
    if outside:
        raise ValueError(
            f"{flag}: CPU {format_cpu_list(outside)} is not available to this process (available: "
            f"{format_cpu_list(avail) or 'none'})"
        )
    return AffinityPlan(client=client, server=server)


def preexec(cpus: frozenset[int]) -> Callable[[], None]:
    """A `subprocess` ``preexec_fn`` that puts the child (and so its whole future tree) on `cpus`."""

    def _pin() -> None:
        os.sched_setaffinity(0, cpus)

    return _pin


def thread_ids(pid: int) -> list[int]:
    """The thread ids of process `pid` (``/proc/<pid>/task``); [] when it is gone."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (FileNotFoundError, ProcessLookupError):
        return []


def pin_threads(pid: int, cpus: frozenset[int]) -> int:
    """Put every thread of process `pid` on `cpus`; the number of threads pinned (threads that end
    meanwhile are skipped)."""
    n = 0
    for tid in thread_ids(pid):
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except ProcessLookupError:
            continue
    return n


def parent_map() -> dict[int, int]:
    """pid -> parent pid of every process now (``/proc/<pid>/stat``, the field after the command's ``)``)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        parents[int(entry)] = int(fields[1])
    return parents


def process_tree(root: int, parents: dict[int, int]) -> list[int]:
    """`root` and all its descendants under `parents` (pid -> parent pid), root first, then by depth."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, frontier = [root], [root]
    while frontier:
        frontier = sorted(c for p in frontier for c in children.get(p, []) if c != p)
        tree += frontier
    return tree


@dataclass(frozen=True)
class Pinned:
    """What `pin_tree` did: the processes and threads it put on `cpus`, and the union of their CPU sets
    read back afterwards (equal to `cpus` when every thread took it)."""

    cpus: frozenset[int]
    processes: int
    threads: int
    observed: frozenset[int]

    def describe(self) -> str:
        return (
            f"{self.processes} processes, {self.threads} threads on CPU {format_cpu_list(self.cpus)} "
            f"(read back: {format_cpu_list(self.observed) or '-'})"
        )


def pin_tree(root: int, cpus: frozenset[int]) -> Pinned:
    """Put every thread of `root` and of each of its descendants on `cpus`, then read the sets back.

    Raises:
        ProcessLookupError: `root` is not running.
    """
    if not thread_ids(root):
        raise ProcessLookupError(f"process {root} is not running")
    pids = process_tree(root, parent_map())
    threads = sum(pin_threads(pid, cpus) for pid in pids)
    observed: set[int] = set()
    for pid in pids:
        for tid in thread_ids(pid):
            try:
                observed |= os.sched_getaffinity(tid)
            except ProcessLookupError:
                continue
    return Pinned(cpus=cpus, processes=len(pids), threads=threads, observed=frozenset(observed))
