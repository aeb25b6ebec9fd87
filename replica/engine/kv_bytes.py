"""The KV budget of the preallocated layout, in bytes (`replica.engine.kv_budget` describes the bound)."""

from __future__ import annotations

import math

from replica.engine.kv_base import KVBudget
from replica.engine.requests import EngineView, Sequence

__all__ = ["PreallocatedBudget"]


class PreallocatedBudget(KVBudget):
    """Bytes: rows preallocated to their final slots, padded to the widest (see the module docstring)."""

    def prefill_peak_bytes(
        self, rows: int, prompt_tokens: int, budget: int | None = None, final_slots: int | None = None
    ) -> int:
        """Peak bytes of a prefill cache of `rows` prompts of `prompt_tokens` (all layers): the layers
        before the current one hold their compressed slots (`prefill_slots`), the current one the whole prompt."""
        kept = self.prefill_slots(prompt_tokens, budget, final_slots)
        layer_slots = (self.num_layers - 1) * kept + max(prompt_tokens, kept)
        return math.ceil(rows * layer_slots * self.slot_bytes / self.num_layers)

    def batch_bytes_bound(self, slots: list[int]) -> int:
        """Bytes of a batch whose rows hold `slots` tokens each: rows * max(slots) * slot_bytes."""
        return len(slots) * max(slots, default=0) * self.slot_bytes

    def footprint(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Bytes one row holds at its end."""
        return self.batch_bytes_bound([self.final_slots(prompt_tokens, max_new_tokens)])

    def memory_refusal(self, prompt_tokens, max_new_tokens, budget, chunk):
        """Its final bytes, and its whole-prompt prefill's peak (the preallocated layout feeds prompts whole)."""
        final = self.footprint(prompt_tokens, max_new_tokens)
        peak = self.prefill_peak_bytes(1, prompt_tokens, budget, self.final_slots(prompt_tokens, max_new_tokens))
        if max(final, peak) <= self.limit_bytes:
            return None
        what = f"its prefill of {prompt_tokens} tokens at once" if peak >= final else "its final slots"
        return (
            f"it needs {max(final, peak)} bytes of KV cache alone ({what}), more than the limit of "
            f"{self.limit_bytes} bytes"
        )

    def max_batch_for(self, prompt_tokens: int, max_new_tokens: int, cap: int, chunk: int | None = None) -> int:
        """Largest batch of identical requests (at most `cap`) whose steady state and last prefill fit."""
        n = min(cap, self.limit_bytes // (self.final_slots(prompt_tokens, max_new_tokens) * self.slot_bytes))
        budget = self.budget_of(prompt_tokens, max_new_tokens)
        final = self.final_slots(prompt_tokens, max_new_tokens)
        kept = self.prefill_slots(prompt_tokens, budget, final)
        while (
            n > 0
            and self.batch_bytes_bound([kept] * (n - 1)) + self.prefill_peak_bytes(1, prompt_tokens, budget, final)
            > self.limit_bytes
        ):
            n -= 1  # the last one's prefill, next to the others' prompts, must fit too
        return int(n)

    def admission(self, view: EngineView) -> "_BytesAdmission":
        return _BytesAdmission(self, view)


class _BytesAdmission:
    """One step's byte account of the rows running and admitted so far (`PreallocatedBudget.admission`)."""

    def __init__(self, kv: PreallocatedBudget, view: EngineView):
        self.kv = kv
        self.finals = [s.final_slots for s in view.running]  # every row once admitted, at its end
        self.held = [s.held_slots for s in view.running]  # rows in the cache, tokens held now
        self.group_held: list[int] = []  # tokens each admitted row holds after prefill
        self.last_rows = 0  # rows of the last group admitted

    def admits(self, seq: Sequence, tokens: int, joinable: bool) -> str | None:
        """``"join"`` (prefilled with the last group), ``"new"`` (a group of its own) or None (it waits): the
        steady state with `seq` and its prefill's peak beside the rows held then fit."""
        kv, limit, same = self.kv, self.kv.limit_bytes, joinable
        if limit is not None:
            if kv.batch_bytes_bound(self.finals + [seq.final_slots]) > limit:
                return None  # steady state would not fit: wait for rows to finish
            # the rows in the cache while this request's group is prefilled: join the last group if its
            # prefill still fits, else prefill alone after it is merged
            if (
                same
                and kv.batch_bytes_bound(self.held + self.group_held[: -self.last_rows])
                + kv.prefill_peak_bytes(self.last_rows + 1, tokens, seq.budget_tokens, seq.final_slots)
                > limit
            ):
                same = False
            if (
                not same
                and kv.batch_bytes_bound(self.held + self.group_held)
                + kv.prefill_peak_bytes(1, tokens, seq.budget_tokens, seq.final_slots)
                > limit
            ):
                return None
        self.last_rows = self.last_rows + 1 if same else 1
        self.finals.append(seq.final_slots)
        self.group_held.append(kv.prefill_slots(tokens, seq.budget_tokens, seq.final_slots))
        return "join" if same else "new"
