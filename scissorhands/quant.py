"""4-bit KV quantization: group-wise integers along ``head_dim``, two per byte, in four scale formats.

Each vector of ``head_dim`` values is cut into groups of ``group_size`` consecutive values; every
value is stored as a 4-bit code ``q`` in ``0..15``, packed two per uint8 (even index in the low
nibble). What a group stores besides its codes is the *scale format*, chosen by ``scale_bits`` and
``zero_point``:

| ``scale_bits`` | ``zero_point`` | per group | dequantized value |
|---|---|---|---|
| 16 (default) | True (default) | float16 ``scale`` + float16 ``zero`` (4 bytes) | ``q * scale + zero`` |
| 16 | False | float16 ``scale`` (2 bytes) | ``(q - 7.5) * scale`` |
| 8 | True | uint8 log-scale code + int8 integer zero ``z`` (2 bytes) | ``(q + z) * scale`` |
| 8 | False | uint8 log-scale code (1 byte) | ``(q - 7.5) * scale`` |

* float16 (the default, asymmetric): ``zero`` is the group's minimum rounded down, ``scale`` =
  range / 15 rounded up, so the whole range stays representable.
* symmetric (``zero_point=False``): 16 levels at half-integer steps around 0 (``-7.5 .. 7.5``
  scales, mid-rise), ``scale >= max |x| / 7.5``; no zero is stored.
* 8-bit log scale: ``scale = 2 ** (code / 8 - 19)`` for ``code`` in 0..255, i.e. 8 codes per octave
  (successive scales 9% apart) from ``2**-19`` (1.9e-6) to ``2**12.875`` (7,509): the smallest code
  whose scale covers the group is stored. With a zero point the group's grid is ``z * scale ..
  (z + 15) * scale`` for an int8 ``z`` (``floor(min / scale)``), which needs ``scale >= (max -
  min) / 14`` (one step is lost to the integer zero) and ``-128 <= z <= 127``.

In every format the error of each value is at most ``scale / 2`` (plus float32 rounding), because
the grid covers the group's whole range by construction. Scales are float16 or 8-bit whatever the
model dtype (so the bytes do not depend on it); values must be within float16 range (8-bit scales:
``|x| <= 56,000``), else ``ValueError``. Dequantization runs in float32 and casts to the model dtype.

Keys and values may use different group sizes (``Int4KV(group_size, value_group_size)``): values
are mixed per token by the attention weights, so larger value groups cost little (KIVI, arXiv
2402.02750, quantizes values per token).

Bytes per vector of ``head_dim`` d: ``d / 2`` packed + ``(d / group_size) x`` the per-group bytes of
the table above (:func:`int4_bytes_per_vector`); d = 64: group 32 float16 40 bytes (3.2x smaller than
16 bits), group 64 float16 36, group 64 with an 8-bit scale and zero 34, group 64 symmetric 8-bit 33.
Attention runs on dequantized keys and values (no fused 4-bit kernel): the saving is memory. The
whole slot's bytes, and what the 18x goal at ratio 5 needs, are stated in ``scissorhands.storage``.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16
LEVELS = 15  # 4 bits: 0..15
SCALE_BITS = (16, 8)
LOG8_STEPS = 8  # 8-bit scale codes per octave
LOG8_OFFSET = 19  # code 0 is 2 ** -19
_LOG8_TABLE: dict[torch.device, torch.Tensor] = {}
_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def check_group_size(head_dim: int, group_size: int) -> None:
    """Raises ValueError unless ``group_size`` is an even integer dividing ``head_dim``."""
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size < 2
        or group_size % 2
        or head_dim % group_size
    ):
        raise ValueError(
            f"kv_group_size must be an even integer >= 2 dividing head_dim ({head_dim}), got {group_size!r}"
        )


def check_scale_format(scale_bits: int, zero_point: bool) -> None:
    """Raises ValueError unless ``scale_bits`` is in ``SCALE_BITS`` and ``zero_point`` a bool."""
    if isinstance(scale_bits, bool) or scale_bits not in SCALE_BITS:
        raise ValueError(f"kv_scale_bits must be one of {SCALE_BITS}, got {scale_bits!r}")
    if not isinstance(zero_point, bool):
        raise ValueError(f"kv_zero_point must be True (asymmetric) or False (symmetric), got {zero_point!r}")


def log8_scales(device=None) -> torch.Tensor:
    """``(256,)`` float32: the scale of every 8-bit code, ``2 ** (code / 8 - 19)``."""
    device = torch.device(device or "cpu")
    if device not in _LOG8_TABLE:
        codes = torch.arange(256, dtype=torch.float64)
        _LOG8_TABLE[device] = torch.exp2(codes / LOG8_STEPS - LOG8_OFFSET).float().to(device)
    return _LOG8_TABLE[device]


def _log8_code(needed: torch.Tensor) -> torch.Tensor:
    """Smallest uint8 code whose scale is >= ``needed`` (float32, >= 0). Raises ValueError past code 255."""
    table = log8_scales(needed.device)
    code = torch.ceil((torch.log2(needed.clamp(min=float(table[0]))) + LOG8_OFFSET) * LOG8_STEPS)
    code = code.nan_to_num(256.0).clamp_(0, 255).to(torch.int64)  # (...,) in 0..255
    code = torch.where(table[code] < needed, code + 1, code)  # float rounding of log2, or too large
    if bool((code > 255).any()):
        raise ValueError(
            f"values out of range for 8-bit scales (a group's range may be at most {float(table[-1]) * (LEVELS - 1):g})"
        )
    code = torch.where((code > 0) & (table[(code - 1).clamp(min=0)] >= needed), code - 1, code)
    return code


def _pack(q: torch.Tensor) -> torch.Tensor:
    """``(..., d)`` codes 0..15 (any integer or float dtype) -> ``(..., d // 2)`` uint8, even index low."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack(packed: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``(..., d // 2)`` uint8 -> ``(..., G, g)`` float32 codes."""
    q = torch.stack((packed & 15, packed >> 4), dim=-1)  # (..., d // 2, 2)
    return q.reshape(*packed.shape[:-1], n_groups, -1).float()


def quantize_int4(x: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``(..., d)`` to 4 bits per value in groups of ``group_size`` along the last dim
    (the default format: float16 scale and zero).

    Returns:
        ``(packed, scale, zero)``: ``(..., d // 2)`` uint8, ``(..., d // group_size)`` float16 twice.
    Raises:
        ValueError: ``group_size`` is not an even divisor of ``d``.
    """
    d = x.shape[-1]
    check_group_size(d, group_size)
    xg = x.float().reshape(*x.shape[:-1], d // group_size, group_size)  # (..., G, g)
    lo, hi = xg.amin(-1), xg.amax(-1)  # (..., G)
    zero = lo.to(SCALE_DTYPE)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, zero.new_full((), float("-inf"))), zero)
    scale = ((hi - zero.float()) / LEVELS).to(SCALE_DTYPE)
    scale = torch.where(
        scale.float() * LEVELS + zero.float() < hi, torch.nextafter(scale, scale.new_full((), float("inf"))), scale
    )
    s = scale.float()[..., None]
    q = ((xg - zero.float()[..., None]) / torch.where(s > 0, s, torch.ones_like(s))).round_().clamp_(0, LEVELS)
    return _pack(q.reshape(*x.shape[:-1], d)), scale, zero


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_int4`: ``(..., d // 2)`` uint8 + ``(..., G)`` scales/zeros -> ``(..., d)``."""
    q = _unpack(packed, scale.shape[-1])  # (..., G, g)
    x = torch.addcmul(zero.float()[..., None], q, scale.float()[..., None])  # q * scale + zero
    return x.reshape(*packed.shape[:-1], -1).to(dtype)


def quantize(
    x: torch.Tensor, group_size: int = 32, scale_bits: int = 16, zero_point: bool = True
) -> dict[str, torch.Tensor]:
    """Quantize ``x`` ``(..., d)`` in any format of the module table.

    Returns:
        ``{"packed": (..., d // 2) uint8, "scale": (..., G) float16 or uint8 code}`` plus ``"zero"``
        ``(..., G)`` (float16 for 16-bit scales, int8 for 8-bit) when ``zero_point``; ``G = d // group_size``.
    Raises:
        ValueError: a bad ``group_size`` / ``scale_bits`` / ``zero_point``, or values out of range.
    """
    check_scale_format(scale_bits, zero_point)
    if scale_bits == 16 and zero_point:
        packed, scale, zero = quantize_int4(x, group_size)
        return {"packed": packed, "scale": scale, "zero": zero}
    d = x.shape[-1]
    check_group_size(d, group_size)
    xg = x.float().reshape(*x.shape[:-1], d // group_size, group_size)  # (..., G, g)
    lo, hi = xg.amin(-1), xg.amax(-1)  # (..., G)
    if zero_point:  # 8-bit code + int8 zero: (q + z) * s
        needed = torch.maximum(torch.maximum((hi - lo) / (LEVELS - 1), -lo / 128), hi / (127 + LEVELS))
        code = _log8_code(needed)
        table = log8_scales(x.device)
        for _ in range(2):  # float rounding: widen until covered
            s = table[code.clamp(max=255)]
            z = torch.floor(lo / s).clamp_(-128, 127)
            covered = (z * s <= lo) & ((z + LEVELS) * s >= hi)
            if bool(covered.all()):
                break
            code = torch.where(covered, code, code + 1)
        if bool((code > 255).any()):
            raise ValueError("values out of range for 8-bit scales")
        s = table[code]
        z = torch.floor(lo / s).clamp_(-128, 127)
        q = (xg / s[..., None] - z[..., None]).round_().clamp_(0, LEVELS)
        return {"packed": _pack(q.reshape(*x.shape[:-1], d)), "scale": code.to(torch.uint8), "zero": z.to(torch.int8)}
    absmax = torch.maximum(hi, -lo)
    half = LEVELS / 2  # symmetric, mid-rise: (q - 7.5) * s
    if scale_bits == 16:
        scale = (absmax / half).to(SCALE_DTYPE)
        scale = torch.where(
            scale.float() * half < absmax, torch.nextafter(scale, scale.new_full((), float("inf"))), scale
        )
        if not bool(torch.isfinite(scale).all()):
            raise ValueError("values out of float16 range for 4-bit quantization")
        s = scale.float()
        stored = scale
    else:
        code = _log8_code(absmax / half)
        s = log8_scales(x.device)[code]
        stored = code.to(torch.uint8)
    s = s[..., None]
    q = (xg / torch.where(s > 0, s, torch.ones_like(s)) + half).round_().clamp_(0, LEVELS)
    return {"packed": _pack(q.reshape(*x.shape[:-1], d)), "scale": stored}


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize`; the format is read from the dtypes (float16 or uint8 scale, zero or None)."""
    if zero is not None and scale.dtype == SCALE_DTYPE:
        return dequantize_int4(packed, scale, zero, dtype)
    q = _unpack(packed, scale.shape[-1])  # (..., G, g)
    s = (log8_scales(packed.device)[scale.long()] if scale.dtype == torch.uint8 else scale.float())[..., None]
    q = q.add_(zero.float()[..., None]) if zero is not None else q.sub_(LEVELS / 2)
    return (q * s).reshape(*packed.shape[:-1], -1).to(dtype)


def group_bytes(scale_bits: int = 16, zero_point: bool = True) -> int:
    """Bytes a group stores besides its packed codes: scale (and zero)."""
    return (scale_bits // 8) * (2 if zero_point else 1)


def int4_bytes_per_vector(dim: int, group_size: int, scale_bits: int = 16, zero_point: bool = True) -> int:
    """Stored bytes of one quantized vector of ``dim`` values (packed values + scales + zeros)."""
    return dim // 2 + (dim // group_size) * group_bytes(scale_bits, zero_point)


def hadamard(dim: int, device=None) -> torch.Tensor:
    """``(dim, dim)`` float32 orthonormal Hadamard matrix (Sylvester's construction, symmetric: its own
    inverse). Raises ValueError unless ``dim`` is a power of two."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"kv_rotate needs a head_dim that is a power of two, got {dim}")
    key = (dim, torch.device(device or "cpu"))
    if key not in _HADAMARD:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[key] = (h / dim**0.5).float().to(key[1])
    return _HADAMARD[key]


class Int4KV:
    """Codec: keys and values stored 4-bit (see module docstring); ``decode`` dequantizes all used slots.

    Args:
        group_size: values per group of the keys (and of the values unless ``value_group_size``).
        value_group_size: values per group of the values (None: ``group_size``).
        scale_bits: 16 (float16 scales) or 8 (8-bit log-scale codes), keys and values alike.
        zero_point: True: asymmetric (a zero per group); False: symmetric, no zero stored.
        rotate: quantize ``x @ H`` for the orthonormal Hadamard matrix ``H`` of ``head_dim`` (a fixed constant,
            nothing stored) and decode ``x_hat @ H``: the rotation spreads a few large channels (outliers
            of keys) over all of them, so one scale per vector fits them all (QuaRot, arXiv 2404.00456).
            The error is then bounded in L2 norm: ``||x_hat - x|| <= sqrt(sum over groups of g * (scale/2)**2)``.
    """

    bits = 4

    def __init__(
        self,
        group_size: int = 32,
        value_group_size: int | None = None,
        scale_bits: int = 16,
        zero_point: bool = True,
        rotate: bool = False,
    ):
        check_scale_format(scale_bits, zero_point)
        if not isinstance(rotate, bool):
            raise ValueError(f"kv_rotate must be True or False, got {rotate!r}")
        self.rotate = rotate
        self.group_size = group_size
        self.value_group_size = group_size if value_group_size is None else value_group_size
        self.scale_bits, self.zero_point = scale_bits, zero_point

    def _groups(self):
        return (("keys", self.group_size), ("values", self.value_group_size))

    def specs(self, key_dim: int, value_dim: int, dtype: torch.dtype):
        scale_dtype = SCALE_DTYPE if self.scale_bits == 16 else torch.uint8
        zero_dtype = SCALE_DTYPE if self.scale_bits == 16 else torch.int8
        out = {}
        for (name, group), dim in zip(self._groups(), (key_dim, value_dim)):
            check_group_size(dim, group)
            if self.rotate:
                hadamard(dim)  # raises unless a power of two
            g = dim // group
            out.update({f"{name}_packed": ((dim // 2,), torch.uint8), f"{name}_scale": ((g,), scale_dtype)})
            if self.zero_point:
                out[f"{name}_zero"] = ((g,), zero_dtype)
        return out

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for (name, group), x in zip(self._groups(), (keys, values)):
            if self.rotate:  # (..., d) @ (d, d)
                x = x.float() @ hadamard(x.shape[-1], x.device)
            out.update({f"{name}_{k}": v for k, v in quantize(x, group, self.scale_bits, self.zero_point).items()})
        return out

    def decode(self, store, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for n in ("keys", "values"):
            x = dequantize(
                store.view(f"{n}_packed"),
                store.view(f"{n}_scale"),
                store.view(f"{n}_zero") if self.zero_point else None,
                torch.float32 if self.rotate else dtype,
            )  # (b, h, S, d)
            out.append((x @ hadamard(x.shape[-1], x.device)).to(dtype) if self.rotate else x)
        return tuple(out)
