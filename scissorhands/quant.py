"""4-bit KV quantization: group-wise asymmetric integers along ``head_dim``, two per byte.

Each vector of ``head_dim`` values is cut into groups of ``group_size`` consecutive values. A group
stores a float16 ``scale`` and a float16 ``zero`` (its minimum, rounded down), and every value as
``q = round((x - zero) / scale)`` in ``0..15``, packed two per uint8 (even index in the low nibble).
Dequantization is ``q * scale + zero`` in float32, cast to the model dtype. Scale and zero are
float16 whatever the model dtype (so the bytes do not depend on it); they are rounded outward
(zero down, scale up) so the group's whole range stays representable and the error of every value
is at most ``scale / 2`` (plus float32 rounding). Values must be within float16 range.

Keys and values may use different group sizes (``Int4KV(group_size, value_group_size)``): values
are mixed per token by the attention weights, so larger value groups cost little (KIVI, arXiv
2402.02750, quantizes values per token).

Bytes per vector of ``head_dim`` d: ``d / 2`` packed + ``4 * d / group_size`` for scale and zero;
with d = 64 and group 32 that is 40 bytes, against 128 in 16 bits (3.2x) and 256 in float32 (6.4x);
group 64: 36 bytes. Attention runs on dequantized keys and values (no fused 4-bit kernel): the
saving is memory. The whole slot's bytes (and why 4 bits at ratio 5 stay below 18x a 16-bit cache)
are stated in ``scissorhands.storage``.
"""
from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16
LEVELS = 15   # 4 bits: 0..15


def check_group_size(head_dim: int, group_size: int) -> None:
    """Raises ValueError unless ``group_size`` is an even integer dividing ``head_dim``."""
    if (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2
            or head_dim % group_size):
        raise ValueError(f"kv_group_size must be an even integer >= 2 dividing head_dim ({head_dim}), "
                         f"got {group_size!r}")


def quantize_int4(x: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``(..., d)`` to 4 bits per value in groups of ``group_size`` along the last dim.

    Returns:
        ``(packed, scale, zero)``: ``(..., d // 2)`` uint8, ``(..., d // group_size)`` float16 twice.
    Raises:
        ValueError: ``group_size`` is not an even divisor of ``d``.
    """
    d = x.shape[-1]
    check_group_size(d, group_size)
    xg = x.float().reshape(*x.shape[:-1], d // group_size, group_size)                 # (..., G, g)
    lo, hi = xg.amin(-1), xg.amax(-1)                                                 # (..., G)
    zero = lo.to(SCALE_DTYPE)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, zero.new_full((), float("-inf"))), zero)
    scale = ((hi - zero.float()) / LEVELS).to(SCALE_DTYPE)
    scale = torch.where(scale.float() * LEVELS + zero.float() < hi,
                        torch.nextafter(scale, scale.new_full((), float("inf"))), scale)
    s = scale.float()[..., None]
    q = ((xg - zero.float()[..., None]) / torch.where(s > 0, s, torch.ones_like(s))).round_().clamp_(0, LEVELS)
    q = q.to(torch.uint8).reshape(*x.shape[:-1], d)                                   # (..., d) in 0..15
    packed = q[..., 0::2] | (q[..., 1::2] << 4)                                       # (..., d // 2)
    return packed, scale, zero


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_int4`: ``(..., d // 2)`` uint8 + ``(..., G)`` scales/zeros -> ``(..., d)``."""
    q = torch.stack((packed & 15, packed >> 4), dim=-1)                               # (..., d // 2, 2)
    n_groups = scale.shape[-1]
    q = q.reshape(*packed.shape[:-1], n_groups, -1).float()                          # (..., G, g)
    x = torch.addcmul(zero.float()[..., None], q, scale.float()[..., None])          # q * scale + zero
    return x.reshape(*packed.shape[:-1], -1).to(dtype)


def int4_bytes_per_vector(dim: int, group_size: int) -> int:
    """Stored bytes of one quantized vector of ``dim`` values (packed values + scales + zeros)."""
    return dim // 2 + 2 * (dim // group_size) * torch.finfo(SCALE_DTYPE).bits // 8


class Int4KV:
    """Codec: keys and values stored 4-bit (see module docstring); ``decode`` dequantizes all used slots.

    Args:
        group_size: values per group of the keys (and of the values unless ``value_group_size``).
        value_group_size: values per group of the values (None: ``group_size``).
    """

    bits = 4

    def __init__(self, group_size: int = 32, value_group_size: int | None = None):
        self.group_size = group_size
        self.value_group_size = group_size if value_group_size is None else value_group_size

    def _groups(self):
        return (("keys", self.group_size), ("values", self.value_group_size))

    def specs(self, key_dim: int, value_dim: int, dtype: torch.dtype):
        out = {}
        for (name, group), dim in zip(self._groups(), (key_dim, value_dim)):
            check_group_size(dim, group)
            g = dim // group
            out.update({f"{name}_packed": ((dim // 2,), torch.uint8), f"{name}_scale": ((g,), SCALE_DTYPE),
                        f"{name}_zero": ((g,), SCALE_DTYPE)})
        return out

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for (name, group), x in zip(self._groups(), (keys, values)):
            p, s, z = quantize_int4(x, group)
            out.update({f"{name}_packed": p, f"{name}_scale": s, f"{name}_zero": z})
        return out

    def decode(self, store, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(dequantize_int4(store.view(f"{n}_packed"), store.view(f"{n}_scale"), store.view(f"{n}_zero"),
                                     dtype) for n in ("keys", "values"))
