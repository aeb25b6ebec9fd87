"""A stand-in for OpenVINO GenAI's backend in the fast tier (`PeerStub`): the scripted backend of
tests/replica/test_engine_backends.py, sized and named as `replica.backends.openvino.OpenVINOEngine` is (the KV limit
resolved on the replica's model, ``openvino_eviction``'s ``max_cache_size`` from the ratio as its ``budget_tokens``),
which answers a request late (over a TTFT limit) when its probe's rate exceeds ``passes_up_to``, and keeps every
prompt it was given per (policy, rate) so a test can check the pairing; and `real_runtime_or_skip` for the slow
tier's real pipeline."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from replica.backends import BACKENDS
from replica.backends import openvino as ovb
from replica.openvino_settings import eviction_from_policy
from tests.replica.test_engine_backends import ScriptedBackend

#: A capacity probe's rate in its requests' ids (``<series>-L<rate>-s<seed>-<digest>-<i>``).
_RATE = re.compile(r"-L([0-9.e+-]+?)-s\d+-")


def rate_of(request_id: str) -> float | None:
    """The probe's rate (req/s) a request id names, or None."""
    m = _RATE.search(request_id)
    return float(m.group(1)) if m else None


class PeerStub(ScriptedBackend):
    """`ScriptedBackend` with the peer's sizes and a rate above which every request's first token comes `late_s` late."""

    passes_up_to: float = math.inf
    late_s: float = 2.0
    #: (policy, rate) -> the prompts (token id lists) of the measured and warm-up requests, in arrival order
    seen: dict = {}

    def __init__(self, model, config, **kwargs):
        super().__init__(model, config, **kwargs)
        self.kv_memory_limit_bytes = config.kv_memory_limit_bytes_on(model, torch.device("cpu"))
        self.eviction, self.rounding = None, None
        if config.policy == "openvino_eviction":
            self.eviction, self.rounding = eviction_from_policy(
                config.policy_params, config.compression_ratio, config.max_length_tokens
            )
        self.budget_tokens = self.eviction["max_cache_size"] if self.eviction else None
        self.parked: list[tuple] = []

    def submit(self, request, on_done, on_token=None) -> None:
        rate = rate_of(request.request_id)
        if rate is not None:
            PeerStub.seen.setdefault((self.config.policy, rate), []).append(list(request.prompt_ids))
        if rate is not None and rate > self.passes_up_to:
            with self.queue.lock:
                self.parked.append((self.clock() + self.late_s, request, on_done, on_token))
            return
        super().submit(request, on_done, on_token)

    def step(self) -> bool:
        now = self.clock()
        with self.queue.lock:
            due = [p for p in self.parked if p[0] <= now]
            self.parked = [p for p in self.parked if p[0] > now]
        for _, *args in due:
            super().submit(*args)
        return super().step()

    def stats(self) -> dict:
        return {
            **super().stats(),
            "engine": "openvino",
            "queued_requests": len(self.pending) + len(self.parked),  # a late request is still queued
            "budget_tokens": self.budget_tokens,
            "kv_memory_limit_bytes": self.kv_memory_limit_bytes,
            "slot_bytes": None,
            "openvino_genai_version": "stub",
            "openvino_eviction": self.eviction,
            "openvino_max_cache_size_rounding": self.rounding,
        }


def install(monkeypatch, passes_up_to: float = math.inf) -> type[PeerStub]:
    """``engine: openvino`` runs `PeerStub` (answering late above `passes_up_to` req/s), and the suite-load check of
    its runtime passes; its record of prompts starts empty."""
    monkeypatch.setitem(BACKENDS, "openvino", PeerStub)
    monkeypatch.setattr("workloads.core.run.check_openvino", lambda model: None)
    monkeypatch.setattr(PeerStub, "passes_up_to", passes_up_to)
    monkeypatch.setattr(PeerStub, "seen", {})
    return PeerStub


#: The peer venv's packages (``make openvino-peer``), which hold the same openvino-genai.
PEER_SITE = Path(__file__).resolve().parents[1] / ".cache" / "venv-openvino" / "lib" / "python3.11" / "site-packages"


def real_runtime_or_skip() -> None:
    """The runtime in this Python (``make openvino-runtime``), else the peer venv's (appended after ours so our
    packages win); skip when neither, or without the export (``make openvino-peer``)."""
    try:
        import openvino_genai  # noqa: F401
    except ImportError:
        if not (PEER_SITE / "openvino_genai").is_dir():
            pytest.skip("no openvino-genai runtime (make openvino-runtime or make openvino-peer)")
        sys.path.append(str(PEER_SITE))
    if not (ovb.EXPORT_DIR / "openvino_model.xml").is_file():
        pytest.skip(f"no export at {ovb.EXPORT_DIR} (make openvino-peer)")
