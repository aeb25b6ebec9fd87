"""CPU sets of their own for the server and the clients (bench/affinity.py): the plan, its errors, and pinning
real processes (a child started on a set, a running tree pinned thread by thread)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.affinity import (
    AffinityPlan,
    format_cpu_list,
    parent_map,
    parse_cpu_list,
    pin_tree,
    plan_affinity,
    preexec,
    process_tree,
)


def test_auto_on_two_cpus_puts_the_server_on_cpu_1_and_the_clients_on_cpu_0():
    plan = plan_affinity("auto", {0, 1})
    assert plan == AffinityPlan(client=frozenset({0}), server=frozenset({1}))
    assert plan.describe() == "server on CPU 1, each client on CPU 0"


@pytest.mark.parametrize(
    "available, client, server",
    [
        ({0, 1, 2, 3}, {0}, {1, 2, 3}),
        (set(range(8)), {0, 1}, set(range(2, 8))),
        (set(range(16)), {0, 1, 2, 3}, set(range(4, 16))),
        ({3, 5}, {3}, {5}),  # what this process may use, not the machine's numbering
    ],
)
def test_auto_gives_the_clients_a_quarter_of_the_cpus_at_least_one(available, client, server):
    plan = plan_affinity("auto", available)
    assert (plan.client, plan.server) == (client, server)
    assert not plan.client & plan.server and plan.client | plan.server == available


@pytest.mark.parametrize("available", [{0}, {7}, set()])
def test_too_few_cpus_is_an_error_that_says_how_many_and_what_to_pass(available):
    with pytest.raises(ValueError, match=r"--affinity auto: .*at least 2; this process may use [01].*--affinity off"):
        plan_affinity("auto", available)


def test_explicit_sets_and_off():
    assert plan_affinity("0:1", {0, 1}) == AffinityPlan(frozenset({0}), frozenset({1}))
    assert plan_affinity("0-1:2-7", range(8)) == AffinityPlan(frozenset({0, 1}), frozenset(range(2, 8)))
    assert plan_affinity("1:0", {0, 1}) == AffinityPlan(frozenset({1}), frozenset({0}))
    assert plan_affinity("off", {0}) is None  # sharing needs no second CPU


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0-1:1-3", "overlap on 1"),
        ("0:4", "CPU 4 is not available to this process"),
        ("0", "expected auto, off or CLIENT:SERVER"),
        (":1", r"client CPUs\): expected CPU numbers"),
        ("0:a", r"server CPUs\): 'a' is not a CPU number"),
        ("0:3-1", "'3-1' is not a range"),
    ],
)
def test_bad_explicit_sets_name_the_flag_and_the_fault(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        plan_affinity(spec, range(4))
    assert str(e.value).startswith("--affinity")


def test_cpu_lists_in_the_kernels_format():
    assert parse_cpu_list("0,2-4") == {0, 2, 3, 4}
    assert parse_cpu_list(" 5 ") == {5}
    assert format_cpu_list({0, 2, 3, 4, 7}) == "0,2-4,7"
    assert format_cpu_list([1]) == "1" and format_cpu_list([]) == ""


def test_process_tree_is_the_root_and_every_descendant():
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 21: 20}
    assert process_tree(10, parents) == [10, 11, 12, 13]
    assert process_tree(20, parents) == [20, 21]
    assert process_tree(99, parents) == [99]


def _child_affinity(cpus: frozenset[int]) -> set[int]:
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        preexec_fn=preexec(cpus),
        capture_output=True,
        text=True,
        check=True,
    )
    return set(eval(out.stdout))  # a list of ints printed by the child


def test_a_child_started_on_a_set_runs_there():
    one = frozenset({min(os.sched_getaffinity(0))})
    assert _child_affinity(one) == one


def test_pin_tree_moves_every_thread_of_a_running_tree_and_reads_it_back():
    mine = os.sched_getaffinity(0)
    target = frozenset({max(mine)})
    # a process with a child of its own: the tree is 2 processes
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    tree = [proc.pid]
    try:
        for _ in range(100):  # wait until the shell has forked its child (no timing is asserted)
            tree = process_tree(proc.pid, parent_map())
            if len(tree) == 2:
                break
            time.sleep(0.05)
        pinned = pin_tree(proc.pid, target)
        assert pinned.processes == len(tree) == 2 and pinned.threads >= 2
        assert pinned.observed == target
        assert all(os.sched_getaffinity(pid) == target for pid in tree)
    finally:
        for pid in reversed(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    with pytest.raises(ProcessLookupError):
        pin_tree(proc.pid, target)
