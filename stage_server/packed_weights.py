"""Linear weights held a second time in oneDNN's blocked layout, for the CPU passes of several tokens.

torch's float32 matrix products on the CPU go to MKL. For a single row (a lone decode step) MKL's GEMV streams
the weight at the memory's speed, in the stage's column-major layout (loader.py) best of all. For a few rows
(a busy stage's decode pass: 2 to 32 sessions' steps) MKL's sgemm, on a CPU it does not tune for (measured on
an AMD EPYC with AVX2), reads the weight about once per row: a pass of 4 decode steps takes 3x a pass of one,
where the weight bytes say it should take about the same. oneDNN's matmul over a weight reordered once into
its own layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing uses) does not: on the
~270M model's shapes 1.5-1.9x faster for 2 to 16 rows, 1.3x for 32, even for prefill chunks; but 1.5x slower
for one row. So each Linear keeps both layouts and picks by the pass's rows: twice the Linear weights' memory
(`--packed-weights`, off by default; the README gives the figures).

oneDNN rounds differently from MKL (float32 sums in another order; ~1e-6 relative), as MKL's own kernels do
between one row and several: logits stay within the 1e-4 of the exactness tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stage_server.model import StageModel, replace_linears


def available(model: StageModel) -> str | None:
    """Why this model's weights cannot be packed here (None: they can)."""
    if model.device.type != "cpu":
        return f"weights on {model.device.type}, not the CPU (oneDNN's CPU layout)"
    if model.dtype != torch.float32:
        return f"{model.dtype} weights (packed in float32 only)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


class PackedLinear(nn.Module):
    """A Linear that multiplies a single row by its plain weight and several rows by the oneDNN-packed copy."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # as loaded (the single-row path reads it)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] == 1:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def pack(model: StageModel) -> int:
    """Replaces every nn.Linear of the model with a PackedLinear; returns the bytes of the weights packed (their
    copies take about as much, oneDNN's padding aside)."""
    replace_linears(model, PackedLinear)
    return sum(m.weight.nbytes for m in model.modules() if isinstance(m, PackedLinear))
