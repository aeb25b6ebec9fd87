"""Process-wide settings every test module shares.

Ray reads `RAY_AUTH_MODE` into a per-process config the first time it starts or joins a
cluster, while the processes it spawns read the variable afresh. A local `ray.init()` turns
token auth on by itself when the variable is unset, so one module's cluster would be started
with token auth and a later module's with it off (or the reverse), and the driver's cached mode
then disagrees with its own GCS ("InvalidAuthToken ... RAY_AUTH_MODE is currently 'disabled'";
the actors of a cluster never start). Every Ray cluster of the tests is on loopback only, so one
mode for the whole session, fixed before Ray is imported: disabled.
"""

import os

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import pytest  # noqa: E402  (after the environment is set)


@pytest.fixture(scope="module")
def model():
    """The tiny random-weight Llama of most tests (seed 0, EOS off so greedy runs have exact lengths),
    on one torch thread. A module may define its own `model` fixture instead."""
    import torch

    from scissorhands.testing import tiny_llama

    torch.set_num_threads(1)
    m = tiny_llama(0)
    m.generation_config.eos_token_id = None
    return m
