"""Placement without a cluster: the suite's `placement:` mapping, bundles, fit checks, device maps."""

import pytest

from cluster.placement import (
    PLACEMENT_STRATEGIES,
    PlacementConfig,
    PlacementError,
    check_fits,
    gpu_max_memory,
    parse_placement,
    plan_device_map,
    replica_bundle,
)
from cluster.replica_set import point_replicas
from scissorhands.testing import tiny_llama
from workloads.core.suite import SuiteError
from workloads.kinds import parse_suite

SUITE = {
    "kind": "batch",
    "name": "t",
    "model": "tiny-llama",
    "policies": ["full"],
    "batch_sizes": [1],
    "prompt_tokens": [8],
    "new_tokens": [2],
}


def test_defaults_spread_with_restarts():
    cfg = parse_placement(None)
    assert cfg == PlacementConfig()
    assert cfg.strategy == "SPREAD" and cfg.max_restarts == 2 and cfg.max_task_retries == 1
    assert cfg.num_cpus is None and cfg.num_gpus is None and cfg.resources == {}


def test_parse_full_mapping():
    cfg = parse_placement(
        {
            "strategy": "strict_pack",
            "num_cpus": 4,
            "num_gpus": 2,
            "resources": {"a100": 1},
            "gpu_memory_fraction": 0.5,
            "max_memory_per_gpu_bytes": 2**30,
            "max_restarts": 0,
            "max_task_retries": 0,
            "ready_timeout_s": 30,
        }
    )
    assert cfg.strategy == "STRICT_PACK"
    assert (cfg.num_cpus, cfg.num_gpus, cfg.resources) == (4, 2, {"a100": 1.0})
    assert (cfg.gpu_memory_fraction, cfg.max_memory_per_gpu_bytes) == (0.5, 2**30)
    assert (cfg.max_restarts, cfg.max_task_retries, cfg.ready_timeout_s) == (0, 0, 30.0)
    assert parse_placement(cfg) is cfg and PlacementConfig(**cfg.model_dump()) == cfg


def test_placement_config_is_frozen_and_refuses_unknown_keys_built_directly():
    cfg = PlacementConfig(num_cpus=2)
    with pytest.raises(Exception, match="frozen"):
        cfg.num_cpus = 3
    with pytest.raises(PlacementError, match=r"^placement\.nodes: unknown key"):
        PlacementConfig(nodes=2)


@pytest.mark.parametrize(
    "data, needle",
    [
        (
            {"strategy": "ROUND_ROBIN"},
            "placement.strategy: unknown strategy 'ROUND_ROBIN' (accepted: " + ", ".join(PLACEMENT_STRATEGIES),
        ),
        ({"num_gpus": 1.5}, "placement.num_gpus: a replica on several GPUs needs a whole number, got 1.5"),
        ({"num_cpus": -1}, "placement.num_cpus: expected a number >= 0 or null, got -1"),
        ({"num_cpus": "four"}, "placement.num_cpus: expected a number >= 0 or null, got 'four'"),
        ({"resources": {"GPU": 1}}, "placement.resources: invalid resource name 'GPU'"),
        ({"resources": {"a100": -2}}, "placement.resources.a100: expected a number >= 0, got -2"),
        ({"gpu_memory_fraction": 1.5}, "placement.gpu_memory_fraction: expected a number in (0, 1], got 1.5"),
        ({"max_restarts": 1.5}, "placement.max_restarts: expected an integer >= 0, got 1.5"),
        ({"nodes": 2}, "placement.nodes: unknown key (accepted: strategy, num_cpus"),
        ([1, 2], "placement: expected a mapping, got [1, 2]"),
        (
            {"num_gpus": 1.5, "max_restarts": -1},
            "placement.num_gpus: a replica on several GPUs needs a whole number, got 1.5; "
            "placement.max_restarts: expected an integer >= 0, got -1",
        ),
    ],
)
def test_invalid_placement_names_the_field(data, needle):
    with pytest.raises(PlacementError) as e:
        parse_placement(data)
    assert needle in str(e.value)


def test_suite_carries_placement_and_reports_errors_as_suite_errors():
    suite = parse_suite({**SUITE, "placement": {"strategy": "STRICT_SPREAD", "num_gpus": 2}})
    assert suite.placement.strategy == "STRICT_SPREAD" and suite.placement.num_gpus == 2
    assert parse_suite(SUITE).placement == PlacementConfig()
    with pytest.raises(SuiteError, match=r"placement\.strategy: unknown strategy 'X'"):
        parse_suite({**SUITE, "placement": {"strategy": "X"}})


def test_bundle_holds_every_resource_of_one_replica():
    assert replica_bundle(4, 2, {"a100": 1}) == {"CPU": 4.0, "GPU": 2.0, "a100": 1.0}
    assert replica_bundle(1, 0, {}) == {"CPU": 1.0}
    assert replica_bundle(0.5, 0, {"fake_gpu": 0}) == {"CPU": 0.5}


def ReplicaSet(n, placement=None, num_cpus=1.0, num_gpus=0.0, num_threads=None):
    return point_replicas(
        n,
        placement,
        {"model_spec": "tiny-llama"},
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        num_threads=num_threads,
        app_name="t",
    )


def test_replica_set_resources_config_wins_over_sweep_defaults():
    rs = ReplicaSet(
        2, parse_placement({"num_cpus": 3, "resources": {"fake_gpu": 2}}), num_cpus=1, num_gpus=0, num_threads=1
    )
    assert rs.bundle == {"CPU": 3.0, "fake_gpu": 2.0}
    assert rs.num_threads == 3  # torch threads follow the replica's CPUs
    rs = ReplicaSet(2, None, num_cpus=1, num_gpus=1, num_threads=1)
    assert rs.bundle == {"CPU": 1.0, "GPU": 1.0} and rs.num_threads == 1
    with pytest.raises(PlacementError, match="replicas: must be >= 1, got 0"):
        ReplicaSet(0)


def test_serve_deployment_options_place_each_replica_in_one_bundle():
    """Serve's options carry the placement: one bundle per replica holding all its resources, the actor
    asking for the same (so Ray sets CUDA_VISIBLE_DEVICES to its GPUs), one point at a time, STRICT_SPREAD
    as one replica per node, the weight caps and torch threads for the replica's own loading."""
    rs = ReplicaSet(
        3,
        parse_placement(
            {
                "num_cpus": 2,
                "num_gpus": 2,
                "resources": {"a100": 1},
                "strategy": "STRICT_SPREAD",
                "gpu_memory_fraction": 0.5,
            }
        ),
    )
    opts = rs.options()
    assert opts["num_replicas"] == 3 and opts["max_ongoing_requests"] == 1
    assert opts["max_replicas_per_node"] == 1 and "placement_group_bundles" not in opts  # Serve allows one of them
    assert opts["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 2.0, "resources": {"a100": 1.0}}
    assert rs.init_kwargs["gpu_memory_fraction"] == 0.5 and rs.num_threads == 2
    spread = ReplicaSet(2, parse_placement({"num_cpus": 2, "resources": {"a100": 1}})).options()
    assert spread["placement_group_bundles"] == [{"CPU": 2.0, "a100": 1.0}]
    assert spread["placement_group_strategy"] == "STRICT_PACK" and "max_replicas_per_node" not in spread


NODES = [
    {"NodeID": "a", "Resources": {"CPU": 2.0, "fake_gpu": 1.0}},
    {"NodeID": "b", "Resources": {"CPU": 2.0, "fake_gpu": 2.0}},
]


def test_check_fits_refuses_a_replica_no_single_node_can_hold():
    check_fits({"CPU": 1.0, "fake_gpu": 2.0}, 1, "SPREAD", NODES)  # node b holds it
    with pytest.raises(PlacementError) as e:
        check_fits({"CPU": 1.0, "fake_gpu": 3.0}, 1, "SPREAD", NODES)  # 3 in the cluster, but on two nodes
    assert "fake_gpu: asks 3, the largest node has 2" in str(e.value)
    assert "a replica never spans nodes" in str(e.value)


def test_check_fits_strict_spread_needs_enough_nodes():
    check_fits({"CPU": 1.0}, 2, "STRICT_SPREAD", NODES)
    with pytest.raises(PlacementError, match="STRICT_SPREAD needs 3 nodes .* the cluster has 2"):
        check_fits({"CPU": 1.0}, 3, "STRICT_SPREAD", NODES)
    with pytest.raises(PlacementError, match="STRICT_SPREAD needs 2 nodes .* the cluster has 1"):
        check_fits({"CPU": 1.0, "fake_gpu": 2.0}, 2, "STRICT_SPREAD", NODES)


def test_gpu_max_memory_is_explicit_per_gpu():
    assert gpu_max_memory(2, fraction=0.5, totals_bytes=[1000, 2000]) == {0: 500, 1: 1000}
    assert gpu_max_memory(3, per_gpu_bytes=123) == {0: 123, 1: 123, 2: 123}


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_device_map_spreads_decoder_layers_over_the_replicas_gpus():
    model = tiny_llama(seed=0, num_hidden_layers=4)
    size = _weight_bytes(model)
    device_map = plan_device_map(model, {0: size, 1: size})  # room for everything on each GPU
    assert set(device_map.values()) == {0, 1}, device_map  # balanced: both GPUs hold layers
    layers = {name: d for name, d in device_map.items() if name.startswith("model.layers.")}
    assert layers, "decoder layers are placed one by one, never split"
    # every parameter is covered by exactly one entry of the map
    covered = [n for n, _ in model.named_parameters() if any(n == k or n.startswith(k + ".") for k in device_map)]
    assert len(covered) == len(list(model.named_parameters()))


def test_device_map_refuses_a_model_that_does_not_fit():
    model = tiny_llama(seed=0)
    size = _weight_bytes(model)
    with pytest.raises(PlacementError) as e:
        plan_device_map(model, {0: size // 8, 1: size // 8})
    msg = str(e.value)
    assert "do not fit in max_memory" in msg and "left over:" in msg and "placement.num_gpus" in msg


def test_default_cpu_share_is_capped_at_one_node():
    """12 CPUs over 2 replicas is 6 each, but no node has 6: each replica gets a node's 4."""
    nodes = [
        {"Resources": {"CPU": 4.0, "GPU": 1.0}},
        {"Resources": {"CPU": 4.0, "GPU": 1.0}},
        {"Resources": {"CPU": 4.0}},
    ]
    rs = ReplicaSet(2, None, num_cpus=6, num_gpus=1, num_threads=6)
    rs._cap_cpus_to_one_node(nodes)
    assert rs.bundle == {"CPU": 4.0, "GPU": 1.0} and rs.num_threads == 4
    check_fits(rs.bundle, 2, "SPREAD", nodes)
    fixed = ReplicaSet(2, parse_placement({"num_cpus": 2}), num_cpus=6)
    assert fixed.bundle == {"CPU": 2.0}  # a suite's own num_cpus is never changed
