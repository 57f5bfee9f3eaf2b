"""Attention read where K/V lie in the paged pool: on the CPU the op stagemesh::decode_attention of
paged_attention.cpp, next to this file (built by cpu_kernels.py), for decode steps; on CUDA the Triton kernel of
triton_attention.py, for every pass (decode steps, prefill chunks and mixed passes).

A pass of B sessions' decode steps attends over every key each of them holds. Gathered into one padded
contiguous buffer for SDPA (model.py's path for prefill chunks on the CPU, and wherever no kernel loads) the
pass's K/V are copied and read again; on a busy stage they outweigh the weights (32 sessions of ~360 positions on
the ~270M model: 95 MB per layer against 67 MB of the layer's weights). The kernels read them once, block by block
through each session's block table.
"""

from __future__ import annotations

import torch

from stagemesh.stage_server.cpu import cpu_kernels
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.stage_server.engine.pass_plan import DecodeAttention
from stagemesh.stage_server.gpu import triton_loader


def load() -> DecodeAttention | None:
    """The CPU kernel; None where the CPU kernels cannot be built (logged once, by cpu_kernels)."""
    return torch.ops.stagemesh.decode_attention if cpu_kernels.load() else None


def attach(model: StageModel) -> None:
    """model's passes attend through the device's kernel from now on (where it can be had)."""
    if model.device.type == "cpu":
        model.decode_attention = load()
    elif model.device.type == "cuda" and (kernels := triton_loader.load(
            "triton_attention", "attention on CUDA gathers K/V for SDPA")) is not None:
        model.ragged_attention = kernels.paged_attention
        model.decode_attention = kernels.decode_attention  # what a CUDA graph of decode steps captures
