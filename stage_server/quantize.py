"""int8 weights for a stage's Linear layers (CPU): a quarter of float32's bytes per token read.

torch.ao's dynamic quantization stores each Linear weight as int8 with a per-output-channel scale
and quantizes activations per batch on the fly. Norms, embeddings and attention stay in float32.
The accuracy cost is measured, not assumed: scripts/bench_levers.py reports top-1 agreement with
float32 next to the speed.
"""

from __future__ import annotations

import torch
from torch import nn

from stage_server.model import StageModel

QUANTIZATIONS = ("none", "int8")


def quantize(model: StageModel, how: str) -> StageModel:
    if how == "none":
        return model
    if how != "int8":
        raise ValueError(f"--quantize {how!r}: use one of {', '.join(QUANTIZATIONS)}")
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise ValueError("--quantize int8 needs --device cpu and --dtype float32 (on a GPU use bfloat16)")
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    return torch.ao.quantization.quantize_dynamic(model, {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)
