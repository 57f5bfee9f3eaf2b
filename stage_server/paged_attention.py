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

import importlib
import logging
from types import ModuleType

import torch

from stage_server import cpu_kernels
from stage_server.model import StageModel
from stage_server.pass_plan import DecodeAttention

log = logging.getLogger("stagemesh.stage")
_triton: list[ModuleType | None] = []  # triton_attention once tried: [module] or [None]


def load() -> DecodeAttention | None:
    """The CPU kernel; None where the CPU kernels cannot be built (logged once, by cpu_kernels)."""
    return torch.ops.stagemesh.decode_attention if cpu_kernels.load() else None


def triton_kernels() -> ModuleType | None:
    """stage_server.triton_attention, or None where Triton cannot be imported (logged once)."""
    if not _triton:
        try:
            _triton.append(importlib.import_module("stage_server.triton_attention"))
        except ImportError as exc:  # an optional dependency: the stage serves with gathered attention
            log.warning(f"attention on CUDA gathers K/V for SDPA: Triton cannot be loaded ({exc})")
            _triton.append(None)
    return _triton[0]


def attach(model: StageModel) -> None:
    """model's passes attend through the device's kernel from now on (where it can be had)."""
    if model.device.type == "cpu":
        model.decode_attention = load()
    elif model.device.type == "cuda" and (kernels := triton_kernels()) is not None:
        model.ragged_attention = kernels.paged_attention
        model.decode_attention = kernels.decode_attention  # what a CUDA graph of decode steps captures
