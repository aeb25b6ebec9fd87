"""Helpers the tests that start servers share: a free loopback port and waiting for a condition."""

from __future__ import annotations

import time

from cluster.connect import free_local_port


def free_port() -> int:
    """A port nothing listens on at 127.0.0.1 now (the OS picks it)."""
    return free_local_port(0)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.25):
    """``predicate()``'s first truthy value, polled every ``poll_s``.

    Raises:
        AssertionError: none within ``timeout_s`` seconds (the message names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
