"""``full``: the uncompressed reference cache. Keeps every token; never evicts."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass
class Full(Policy):
    """Keeps everything. The reference every budgeted policy is compared with."""

    name = "full"
    evicts = False
