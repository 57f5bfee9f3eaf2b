"""Linear weights packed in panels of 16 output columns, multiplied by stagemesh's own kernel on the CPU in
float32 (stagemesh::packed_linear, packed_linear.cpp, built by cpu_kernels.py).

torch's float32 matrix products on the CPU go to MKL. On an AMD EPYC with AVX2 (this project's machines) MKL's
small-batch sgemm reads the weight about once per row, so a busy stage's decode pass of 4 sessions' steps costs
3x a pass of one where the weight's bytes say it should cost about the same; and its GEMV, a lone decode step,
runs no faster on two threads than on one. The kernel reads each panel once per pass, for all the pass's rows,
and splits the panels across the threads: over one ~270M stage's Linears (8 layers), 1 row 19 ms against MKL's
23 on one thread and 14 against 22 on two; 4 rows 33 against 65; 16 rows 100 against 121; prefill chunks of 256
rows about even (docs/decisions.md, "Packed weights"). The panels replace the weight: the same memory, held once.

Each output is one chain of fused multiply-adds over the input features in order, so it rounds differently from
MKL (another order of the same float32 sums; ~1e-6 relative), and a row's result does not depend on the other
rows of its pass.

The RMSNorm before a packed Linear (each decoder layer's two, and the final norm before an untied LM head) runs
inside the Linear's call: eager PyTorch spends half a dozen small ops on a norm, which on the tiny model cost a
fifth of a decode pass and on the ~270M model 7% (docs/decisions.md, "The norm inside the Linear").

With --quantize int8-weight-only the panels hold the int8 weights (quantize.Int8WeightLinear's, one scale per
output column), each panel's 16 scales after its rows, and the kernel widens them to float32 as it reads them: a
quarter of the bytes a token reads, the activations float32 throughout, as Int8WeightLinear computes (which
widens the whole weight at every call instead).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stagemesh.stage_server.cpu import cpu_kernels, huge_pages
from stagemesh.stage_server.engine.model import RMSNorm, StageModel, replace_linears
from stagemesh.stage_server.engine.quantize import Int8WeightLinear

PANEL = 16
"""Output columns per panel (packed_linear.cpp's kPanel)."""
SCALE_ROWS = 4
"""An int8 panel's 16 float32 scales, after its rows of weights: 4 rows of 16 bytes (packed_linear.cpp's
kScaleRows)."""


def available(model: StageModel) -> str | None:
    """Why this model's weights cannot be packed here (None: they can)."""
    if model.device.type != "cpu":
        return f"weights on {model.device.type}, not the CPU"
    if model.dtype != torch.float32:
        return f"{model.dtype} weights (packed in float32 only)"
    if not cpu_kernels.load():
        return "the CPU kernels could not be built here (logged above)"
    return None


def panels_of(weight: torch.Tensor, huge: bool = True, scale: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] (any strides) as panels [ceil(N / 16), K, 16], the last padded with zero columns; with huge,
    on 2 MiB pages (huge_pages.py: the panels are streamed every step). With scale (an int8 weight's float32 scale
    per row): [ceil(N / 16), K + 4, 16] int8, each panel's rows followed by its 16 scales (0 for padding columns)."""
    n, k = weight.shape
    count = -(-n // PANEL)
    panels = huge_pages.zeros((count, k + (0 if scale is None else SCALE_ROWS), PANEL), weight.dtype, huge)
    rows = panels[:, :k]
    whole = n // PANEL
    rows[:whole].copy_(weight[:whole * PANEL].unflatten(0, (whole, PANEL)).transpose(1, 2))
    if n % PANEL:
        rows[whole, :, :n % PANEL].copy_(weight[whole * PANEL:].t())
    if scale is not None:  # a panel's 16 scales as its last 64 bytes: [count, 4, 16] int8 as [count, 4, 4] float32
        scales = F.pad(scale.float(), (0, count * PANEL - n)).view(count, SCALE_ROWS, -1)
        panels[:, k:].view(torch.float32).copy_(scales)
    return panels


class PackedLinear(nn.Module):
    """A float32 Linear whose weight is held as panels only (float32, or an Int8WeightLinear's int8 weights and
    scales), multiplied by stagemesh::packed_linear."""

    def __init__(self, linear: nn.Linear | Int8WeightLinear, huge: bool = True):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        scale = linear.scale if isinstance(linear, Int8WeightLinear) else None
        with torch.no_grad():
            self.panels = nn.Parameter(panels_of(linear.weight, huge, scale), requires_grad=False)
            padding = self.panels.shape[0] * PANEL - self.out_features  # the kernel reads whole panels of bias too
            self.bias = None if linear.bias is None else nn.Parameter(F.pad(linear.bias, (0, padding)),
                                                                      requires_grad=False)
        self.register_parameter("norm_weight", None)  # set by take_norm: the RMSNorm before it, applied first
        self.eps = 0.0

    def take_norm(self, norm: RMSNorm) -> NormInNextLinear:
        """Applies norm to this Linear's input from now on; returns what the model holds in the norm's place."""
        self.norm_weight, self.eps = norm.weight, norm.eps
        return NormInNextLinear(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.stagemesh.packed_linear(flat, self.panels, self.bias, self.out_features, self.norm_weight,
                                                self.eps)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        norm = f", RMSNorm first (eps={self.eps})" if self.norm_weight is not None else ""
        int8 = " int8" if self.panels.dtype == torch.int8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, panels of {PANEL}{int8}{norm}"


class NormInNextLinear(nn.Module):
    """An RMSNorm whose work the next PackedLinear does: it passes its input through, and keeps the norm's weight
    where the model has it (the model reads its dtype and device off a norm)."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight = norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def padding_bytes(model: nn.Module) -> int:
    """The zero columns that fill the packed Linears' last panels: memory held, not weights (nor scales)."""
    return sum((m.panels.shape[0] * PANEL - m.out_features) * m.panels.shape[1] * m.panels.element_size()
               + (0 if m.bias is None else m.bias.nbytes - m.out_features * m.bias.element_size())
               for m in model.modules() if isinstance(m, PackedLinear))


def pack(model: StageModel, huge: bool = True) -> int:
    """Puts a PackedLinear in place of every nn.Linear (and Int8WeightLinear: int8 panels) of the model whose weight
    it alone holds (a tied LM head, which shares the embeddings' weight, stays as it is: packing it would hold that
    weight twice), and moves each RMSNorm into the packed Linear after it. Returns the bytes of the weights packed
    (freed as loaded, held again as panels). huge: the panels on 2 MiB pages (huge_pages.py)."""
    embedding = model.embed_tokens.weight.data_ptr() if model.embed_tokens is not None else None

    def make(linear: nn.Linear | Int8WeightLinear) -> nn.Module:
        return linear if linear.weight.data_ptr() == embedding else PackedLinear(linear, huge)

    replace_linears(model, make, (nn.Linear, Int8WeightLinear))
    norms_before = [(layer, "input_layernorm", layer.self_attn.qkv_proj) for layer in model.layers]
    norms_before += [(layer, "post_attention_layernorm", layer.mlp.gate_up_proj) for layer in model.layers]
    if model.norm is not None:
        norms_before.append((model, "norm", model.lm_head))
    for holder, name, linear in norms_before:
        if isinstance(linear, PackedLinear):
            setattr(holder, name, linear.take_norm(getattr(holder, name)))
    return sum(m.panels.nbytes for m in model.modules() if isinstance(m, PackedLinear))
