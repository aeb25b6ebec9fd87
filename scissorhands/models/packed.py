"""Linear layers whose CPU weights are packed once into oneDNN's blocked layout (:class:`PackedLinear`)."""

from __future__ import annotations

from functools import lru_cache

import torch

PACKED_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes whose CPU weights :class:`PackedLinear` packs (where :func:`onednn_packs` says oneDNN runs them)."""


@lru_cache(maxsize=4)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether :class:`PackedLinear` packs CPU weights of ``dtype`` in this torch: float32 where torch has
    oneDNN, bfloat16 where oneDNN also runs bfloat16 matmuls (the CPU's AVX512 or AMX units)."""
    try:
        if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is reordered once into oneDNN's blocked layout on a CPU (float32,
    bfloat16), and multiplied in that layout, so our engine's decode step runs faster on a CPU.

    Why: on a CPU a bfloat16 ``F.linear`` runs in oneDNN, which copies the ``(out, in)`` weight into its own
    layout on every call, so a decode step of a few rows reads each weight about twice; a float32 one runs
    MKL's sgemm, far below the machine's speed at a few rows and many weight rows. The packed copy
    (``torch.ops.mkldnn._reorder_linear_weight``, the one torch's own compiler uses for frozen CPU models)
    is made at the first such forward and kept while the weight is unchanged (same storage and version).
    The speedups (``make bench-decode ARGS="--packing-ab"``): docs/performance.md, "Measurements behind the library and cluster code".

    Numbers: in bfloat16 the same as ``F.linear`` bit for bit (both are oneDNN's kernel), except for calls of more
    than 32 rows on a CPU with AMX, where oneDNN runs one of the two in another kernel and the sums round
    differently; in float32 the same float32 products summed in another order (within float32 rounding of
    ``F.linear``; both measured on the embedded model in tests/scissorhands/test_models.py).
    Memory: one more copy of each packed weight (the Parameter stays, shared, for everything else that reads
    it, such as tied input embeddings).

    Runs where :func:`onednn_packs` says so, with input and weight of one dtype, and without autograd (the
    packed op has none: under ``torch.no_grad`` or ``torch.inference_mode``, as every engine here runs);
    elsewhere (GPUs, float16, a forward that records gradients) ``F.linear`` as the model would.

    Args:
        linear: an ``nn.Linear``; its ``weight`` and ``bias`` Parameters are shared, not copied (a weight
            tied to the input embeddings stays tied).
    Shapes: input ``(..., in_features)``; output ``(..., out_features)``, the input's dtype.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed, self._packed_key = None, None

    def _packed_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight for input ``x``, or None where ``F.linear`` runs."""
        w = self.weight
        if (
            x.device.type != "cpu"
            or x.dtype != w.dtype
            or not onednn_packs(w.dtype)
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        ):
            return None
        # an inference tensor (made under torch.inference_mode) has no version counter: it is keyed by its
        # storage, so an in-place change made to it inside inference mode is not seen (a new tensor is)
        key = (w.data_ptr(), None if w.is_inference() else w._version, tuple(w.shape), w.dtype)
        if self._packed_key != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
            self._packed_key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed_weight(x)
        if packed is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [None], "")

    def _apply(self, fn, recurse=True):
        self._packed, self._packed_key = None, None  # .to() / .bfloat16(): pack afresh
        return super()._apply(fn, recurse)

    def __getstate__(self):  # copy / pickle without the opaque tensor
        state = self.__dict__.copy()
        state["_packed"], state["_packed_key"] = None, None
        return state

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every plain ``nn.Linear`` inside ``model`` (the output projection included) with a
    :class:`PackedLinear` of the same Parameters, in place; other modules keep theirs. Returns ``model``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
    return model
