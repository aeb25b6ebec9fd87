"""`cluster.loopback`: the Serve replica's gRPC listener rebind, without Ray running (fakes stand in for Ray's
private modules; the end-to-end check is tests/cluster/test_loopback_listeners.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster import loopback


def _fake_ray(monkeypatch, node_ip: str) -> tuple[list, SimpleNamespace]:
    bound: list = []
    monkeypatch.setattr(loopback, "_MISSING", None)
    monkeypatch.setattr(loopback, "ray_worker", SimpleNamespace(global_worker=SimpleNamespace(node_ip_address=node_ip)))
    monkeypatch.setattr(
        loopback, "tls_utils", SimpleNamespace(add_port_to_grpc_server=lambda s, a: bound.append(a) or 4321)
    )
    replica = SimpleNamespace(add_port_to_grpc_server=None)
    monkeypatch.setattr(loopback, "serve_replica", replica)
    return bound, replica


@pytest.mark.parametrize(
    ("node_ip", "expect"), [("127.0.0.1", "127.0.0.1:0"), ("::1", "[::1]:0"), ("fd00::7", "[fd00::7]:0")]
)
def test_the_all_interfaces_listener_binds_the_node_address_bracketed_when_ipv6(monkeypatch, node_ip, expect):
    bound, replica = _fake_ray(monkeypatch, node_ip)
    loopback.setup_worker()
    assert replica.add_port_to_grpc_server(object(), loopback.ALL_INTERFACES) == 4321
    replica.add_port_to_grpc_server(object(), "10.0.0.2:5000")  # another address passes through
    assert bound == [expect, "10.0.0.2:5000"]


def test_a_ray_without_the_private_names_fails_only_when_the_rebind_is_applied_naming_the_ray_version(monkeypatch):
    monkeypatch.setattr(loopback, "_MISSING", "No module named 'ray._common'")
    with pytest.raises(RuntimeError) as e:
        loopback.setup_worker()
    assert f"Ray {loopback.WRITTEN_FOR_RAY}" in str(e.value) and "ray._common" in str(e.value)
    assert loopback.WRITTEN_FOR_RAY == "2.60.0"


def test_the_pinned_ray_has_the_private_names():
    assert loopback._MISSING is None
