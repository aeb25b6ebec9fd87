"""Every port the processes we start open binds loopback: a local Ray on 127.0.0.1 with a serving replica deployed
(the sweeps' `workloads.serving.pools.ServeReplicaPool`, whose replicas run `cluster.loopback.setup_worker`)."""

from __future__ import annotations

import ipaddress
import os

import psutil
import pytest

from tests.ray_helpers import local_ray
from workloads.serving.pools import ServeReplicaPool

pytestmark = [pytest.mark.ray]

ALL_INTERFACES = {"0.0.0.0", "::", ""}


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback (``::ffff:127.0.0.1``, a dual-stack socket bound to it)."""
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def listeners_of_this_process_tree() -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of this process and its descendants (Ray's
    GCS, raylet and workers, which `ray.init` starts under it)."""
    me = psutil.Process(os.getpid())
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    out = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.NoSuchProcess:
                continue
            out.append((c.laddr.ip, c.laddr.port, name))
    return out


def test_a_sweeps_ray_and_its_serving_replica_listen_on_loopback_only():
    with local_ray():
        pool = ServeReplicaPool(
            1,
            model_spec="tiny-llama",
            dtype="float32",
            device="cpu",
            num_cpus=1,
            num_gpus=0,
            num_threads=1,
            run_id="loopback",
        )
        try:
            infos = pool.start()
            assert infos and infos[0]["replica_id"]
            listening = listeners_of_this_process_tree()
            # the replica answers its own CPU counters (what a point measures its CPU share from)
            (sample,) = pool.cpu_samples().values()
            assert sample["process_cpu_s"] > 0 and sample["threads"] == 1 and sample["run_s"] is not None
        finally:
            pool.close()
    assert len(listening) > 3, listening  # Ray's GCS, raylet and the replica's own servers were found
    assert [s for s in listening if s[0] in ALL_INTERFACES] == []
    assert [s for s in listening if not is_loopback(s[0])] == []
