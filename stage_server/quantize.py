"""int8 weights for a stage's Linear layers: a quarter of float32's weight bytes, half of bfloat16's.

Two paths. On the CPU in float32, `--quantize int8` uses torch.ao's dynamic quantization: int8
weights with a per-output-channel scale, activations quantized per batch on the fly, int8 kernels;
it reads a quarter of the bytes per token and is ~3× faster on this kind of machine. Everywhere else
(CUDA, bfloat16/float16), and with `--quantize int8-weight-only` on any device, Int8WeightLinear keeps
the same int8 weights and per-channel scales, the activations in the model's dtype (more accurate: README,
"Speed levers"). On a CPU float32 stage with packed weights (the default) those go into int8 panels for
stagemesh's kernel, which widens them as it reads them (packed_weights.py: one stream 2.3x float32, faster than
torch.ao's int8 at a few rows, slower at prefill). On the CPU in bfloat16 it runs torch's int8 weight-only
kernel (faster than bfloat16); elsewhere it widens the weights to the activations' dtype at each
call: portable, and the memory saving is the point (a model that needs two GPUs may fit on one), not
speed. Norms, embeddings and attention stay in the model's dtype. The accuracy cost is measured, not
assumed: scripts/bench_levers.py reports top-1 agreement with float32 next to the speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stage_server.model import StageModel, replace_linears
from stagemesh.checkpoint import QUANTIZE


def int8_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, scale per row in dtype), rounded against the scale as stored."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale


def loads_int8_weights(how: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether `how` means Int8WeightLinear here (then load_stage quantizes each weight as it reads it,
    so that the full-precision stage never sits in memory)."""
    if how not in QUANTIZE:
        raise ValueError(f"--quantize {how!r}: use one of {', '.join(QUANTIZE)}")
    return how == "int8-weight-only" or (how == "int8" and (device_type != "cpu" or dtype != torch.float32))


class Int8WeightLinear(nn.Module):
    """A Linear whose weight is int8 with one scale per output channel (symmetric, ±127)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = int8_rows(linear.weight, linear.weight.dtype)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:
            # torch's int8 weight-only kernel: ~3x faster than a bfloat16 GEMV here (slower than the
            # plain path for float32 and float16 inputs, which therefore widen the weight instead).
            flat = x.reshape(-1, x.shape[-1])
            out = torch._weight_int8pack_mm(flat, self.weight, self.scale).reshape(*x.shape[:-1], -1)
        else:
            weight = self.weight.to(x.dtype)
            if x.dtype == torch.float16:  # scaled first: raw int8 values x activations overflow float16
                out = F.linear(x, weight * self.scale[:, None])
            else:  # one multiply over the output instead of the weight
                out = F.linear(x, weight) * self.scale
        return out if self.bias is None else out + self.bias


def int8_weight_only(model: StageModel) -> StageModel:
    """Replaces every nn.Linear (a no-op where load_stage already did)."""
    replace_linears(model, Int8WeightLinear)
    return model


def quantize(model: StageModel, how: str) -> StageModel:
    if loads_int8_weights(how, model.device.type, model.dtype):
        return int8_weight_only(model)
    if how == "none":
        return model
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    return torch.ao.quantization.quantize_dynamic(model, {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)
