"""A local Ray cluster on loopback, and the Serve app started on one, for the tests that need them."""

import contextlib

from tests.waiting import free_port

#: `ray.init` arguments of a local 2-CPU cluster on loopback, without the dashboard.
LOOPBACK = dict(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")


@contextlib.contextmanager
def local_ray(**init_kw):
    """A local Ray cluster (`LOOPBACK`, with `init_kw` added or overriding), shut down on leaving."""
    import ray

    ray.init(**{**LOOPBACK, **init_kw})
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def local_serve_app(*build_args, **build_kw):
    """`cluster.serve_app.build_serve_app(*build_args, **build_kw)` started on a free loopback port of a
    `local_ray`; yields the port; Serve, then Ray, shut down on leaving."""
    from ray import serve

    from cluster.serve_app import build_serve_app, start

    with local_ray():
        port = free_port()
        try:
            start(build_serve_app(*build_args, **build_kw), port=port)
            yield port
        finally:
            serve.shutdown()
