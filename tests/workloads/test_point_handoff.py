"""What the runners send through the Serve handle: dataclasses, never dicts rebuilt by hand. No Ray
(`workloads.core.dispatch`'s init_ray, start_replicas and dispatch_points are replaced by fakes that call the kind's `remote` with a
fake handle capturing the arguments)."""

import argparse
from pathlib import Path

import pytest

from replica.static_batch import BatchSpec, ModelReplica
from scissorhands.testing import tiny_llama
from tests.suite_helpers import tiny_suite
from workloads.core import dispatch as dispatch_mod
from workloads.core.template import Session
from workloads.frontier.point import run_frontier_point
from workloads.frontier.suite import FrontierPoint
from workloads.kinds import KINDS, parse_suite


class _Handle:
    """A stand-in for the Serve deployment handle: ``handle.<method>.remote(*args)`` records the call."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, method):
        return type("Method", (), {"remote": lambda _, *args: self.calls.append((method, args))})()


def _fake_cluster(monkeypatch, handle):
    class _RSet:
        handle = None

        def shutdown(self):
            pass

    def dispatch(ray, rset, infos, pending, remote):
        for point in pending:
            remote(handle, point)
        yield from ()

    monkeypatch.setattr(dispatch_mod, "init_ray", lambda address: (None, False))
    monkeypatch.setattr(dispatch_mod, "start_replicas", lambda *a, **k: (_RSet(), [{}]))
    monkeypatch.setattr(dispatch_mod, "dispatch_points", dispatch)
    monkeypatch.setattr(dispatch_mod, "cluster_inventory", lambda: {})


def _session(suite) -> Session:
    return Session(argparse.Namespace(address=None, local=False), suite, "r", Path("."), 1, pusher=None)


def test_sweep_sends_each_point_as_a_batch_spec(monkeypatch):
    suite = parse_suite(
        tiny_suite(
            "batch",
            name="t",
            compression_ratios=[2],
            budget_tokens=[30],
            batch_sizes=[3],
            prompt_tokens=[64],
            new_tokens=[16],
            seed=5,
        )
    )
    points = suite.points()
    handle = _Handle()
    _fake_cluster(monkeypatch, handle)
    assert list(KINDS["batch"].execute(_session(suite), points)) == []
    assert [m for m, _ in handle.calls] == ["run_batch"] * 3
    specs = [args[0] for _, args in handle.calls]
    assert all(type(s) is BatchSpec and len(args) == 1 for s, (_, args) in zip(specs, handle.calls))
    assert [(s.policy, s.compression_ratio, s.budget_tokens) for s in specs] == [
        ("full", None, None),
        ("scissorhands", 2.0, None),
        ("scissorhands", None, 30),
    ]
    assert {(s.batch_size, s.prompt_tokens, s.new_tokens, s.seed, s.random_ids, s.prompt_ids) for s in specs} == {
        (3, 64, 16, 5, False, None)
    }


def test_apply_points_are_sent_as_the_workloads_dataclass(monkeypatch):
    suite = parse_suite(
        {
            "kind": "frontier",
            "model": "tiny-llama",
            "policies": ["full", "scissorhands"],
            "compression_ratios": [4],
            "prompt_tokens": 24,
            "new_tokens": 8,
        }
    )
    points = suite.points()
    handle = _Handle()
    _fake_cluster(monkeypatch, handle)
    assert list(KINDS["frontier"].execute(_session(suite), points)) == []
    assert [(m, args) for m, args in handle.calls] == [("apply", (run_frontier_point, p)) for p in points]
    assert all(type(args[1]) is FrontierPoint for _, args in handle.calls)


def test_run_batch_refuses_a_mapping_naming_the_type():
    replica = ModelReplica(model=tiny_llama(seed=0), model_spec="tiny-llama", num_threads=1, warmup=False)
    with pytest.raises(TypeError, match="BatchSpec, got dict"):
        replica.run_batch(dict(policy="full", batch_size=1, prompt_tokens=4, new_tokens=2, seed=0))
