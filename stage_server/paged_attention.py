"""Decode attention read where K/V lie in the paged pool, on the CPU: the op stagemesh::decode_attention of
paged_attention.cpp, next to this file (built by cpu_kernels.py).

A pass of B sessions' decode steps attends over every key each of them holds. Gathered into one padded
contiguous buffer for SDPA (model.py's path for prefill chunks, and on other devices) the pass's K/V are
copied and read again; on a busy stage they outweigh the weights (32 sessions of ~360 positions on the ~270M
model: 95 MB per layer against 67 MB of the layer's weights). The kernel reads them once, block by block
through each session's block table.
"""

from __future__ import annotations

import torch

from stage_server import cpu_kernels
from stage_server.model import StageModel
from stage_server.pass_plan import DecodeAttention


def load() -> DecodeAttention | None:
    """The kernel; None where the CPU kernels cannot be built (logged once, by cpu_kernels)."""
    return torch.ops.stagemesh.decode_attention if cpu_kernels.load() else None


def attach(model: StageModel) -> None:
    """A CPU model's decode steps attend through the kernel from now on (where it can be had)."""
    if model.device.type == "cpu":
        model.decode_attention = load()
