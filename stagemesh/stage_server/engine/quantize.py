"""int8 and FP8 weights for a stage's Linear layers: a quarter of float32's weight bytes, half of bfloat16's.

Two paths. On the CPU in float32, `--quantize int8` uses torch.ao's dynamic quantization: int8
weights with a per-output-channel scale, activations quantized per batch on the fly, int8 kernels;
it reads a quarter of the bytes per token and is ~3× faster on this kind of machine. Everywhere else
(CUDA, bfloat16/float16), and with `--quantize int8-weight-only` on any device, Int8WeightLinear keeps
the same int8 weights and per-channel scales, the activations in the model's dtype (more accurate: docs/performance.md,
"Speed levers"). On a CPU float32 stage with packed weights (the default) those go into int8 panels for
stagemesh's kernel, which widens them as it reads them (packed_weights.py: one stream 2.3x float32, faster than
torch.ao's int8 at a few rows, slower at prefill). On the CPU in bfloat16 it runs torch's int8 weight-only
kernel (faster than bfloat16); elsewhere it widens the weights to the activations' dtype at each
call, except on CUDA, where a Triton kernel widens each tile as it reads it (triton_int8.py). `--quantize fp8`:
float8_e4m3 weights with a float32 scale per output channel, activations quantized per token to FP8 on the fly,
and torch._scaled_mm's FP8 matrix product (Hopper's FP8 tensor cores; on a CPU torch's own kernel, for checking;
refused on CUDA devices older than compute capability 8.9, which have no FP8). Norms, embeddings and attention
stay in the model's dtype. The accuracy cost is measured, not assumed: scripts/bench_levers.py reports top-1
agreement with float32 next to the speed.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from stagemesh.checkpoint import QUANTIZE
from stagemesh.stage_server.engine.model import StageModel, replace_linears
from stagemesh.stage_server.gpu import triton_loader

LinearFormat = Literal["dense", "int8", "fp8"]
"""How a stage holds its Linear weights: as loaded, Int8WeightLinear's or Fp8Linear's."""
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def int8_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, scale per row in dtype), rounded against the scale as stored."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale


def fp8_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3 weight, float32 scale per row): each row scaled so that its largest value is FP8's largest."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).contiguous(), scale


def linear_format(how: str, device_type: str, dtype: torch.dtype) -> LinearFormat:
    """How --quantize `how` holds the Linear weights here; load_stage quantizes each weight as it reads it, so that
    the full-precision stage never sits in memory ("dense": as loaded, then torch.ao's path for --quantize int8 on
    a CPU in float32)."""
    if how not in QUANTIZE:
        raise ValueError(f"--quantize {how!r}: use one of {', '.join(QUANTIZE)}")
    if how == "fp8":
        return "fp8"
    if how == "int8-weight-only" or (how == "int8" and (device_type != "cpu" or dtype != torch.float32)):
        return "int8"
    return "dense"


def check_fp8(device: torch.device) -> None:
    """--quantize fp8 needs FP8 matrix products: a CPU (torch's kernel) or a CUDA device of compute capability 8.9
    or later (Ada, Hopper)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"--quantize fp8 needs FP8 matrix products (compute capability 8.9 or later); {name} has none:"
                         " use --quantize int8-weight-only")


class Int8WeightLinear(nn.Module):
    """A Linear whose weight is int8 with one scale per output channel (symmetric, ±127)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = int8_rows(linear.weight, linear.weight.dtype)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (kernels := triton_loader.load("triton_int8", "int8 weights widen whole on CUDA")):
            return kernels.int8_weight_matmul(x, self.weight, self.scale, self.bias)
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


class Fp8Linear(nn.Module):
    """A Linear whose weight is float8_e4m3 with a float32 scale per output channel; each call quantizes its
    activations per token to FP8 and multiplies in FP8 (torch._scaled_mm), into the activations' dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = fp8_rows(linear.weight, linear.weight.dtype)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        x_scale = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [M, 1]
        xq = (flat / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        # A scale per row and per column: CUDA's kernel writes bfloat16 only, widened or narrowed after.
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale[None, :],
                               out_dtype=out_dtype).to(x.dtype)
        out = out.reshape(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias


QUANTIZED_LINEARS: dict[str, type[nn.Module]] = {"int8": Int8WeightLinear, "fp8": Fp8Linear}
ROWS = {"int8": int8_rows, "fp8": fp8_rows}
"""Each format's weight quantizer: (weight, dtype) -> (quantized weight, scale per row)."""


def quantize_linears(model: StageModel, fmt: LinearFormat) -> StageModel:
    """Replaces every nn.Linear with fmt's (a no-op where load_stage already did)."""
    if fmt != "dense":
        replace_linears(model, QUANTIZED_LINEARS[fmt])
    return model


def quantize(model: StageModel, how: str) -> StageModel:
    if (fmt := linear_format(how, model.device.type, model.dtype)) != "dense":
        return quantize_linears(model, fmt)
    if how == "none":
        return model
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    return torch.ao.quantization.quantize_dynamic(model, {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)
