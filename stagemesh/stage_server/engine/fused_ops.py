"""A layer's small ops in one kernel each where the device has them: on CUDA the Triton kernels of
stage_server/gpu/triton_fused.py (RMSNorm with its residual add, rotary embedding with the K/V writes,
SiLU-and-multiply), for every pass and inside the CUDA graphs. The CPU has its own answer, the whole decode pass in
one call (stage_server/cpu/decode_layers.py)."""

from __future__ import annotations

from stagemesh.stage_server.engine.model import FusedOps, StageModel
from stagemesh.stage_server.gpu import triton_loader


def attach(model: StageModel) -> str | None:
    """The model's layers run their small ops fused from now on, where they can; returns why not."""
    model.fused_ops = None
    if model.device.type != "cuda":
        return "not a CUDA stage"
    kernels = triton_loader.load("triton_fused", "a layer's small ops run one by one on CUDA")
    if kernels is None:
        return "Triton cannot be loaded (logged above)"
    model.fused_ops = FusedOps(kernels.add_rms_norm, kernels.rope_and_write, kernels.silu_and_mul)
    return None
