"""Whether Triton can launch a kernel on this machine's GPU at all. Importing a kernel module compiles nothing:
Triton builds a kernel and its launcher (with the host's C compiler and Python's headers) at its first launch, so a
machine that lacks them would fail a stage's profiling pass, and the stage would not start, where it should serve
on torch's ops instead (triton_loader.py launches this first)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one(x, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = i < n
    tl.store(x + i, tl.load(x + i, mask=ok) + 1, mask=ok)


def launch(device: str = "cuda") -> None:
    """Runs one tiny kernel on device and checks its answer; raises whatever stops it."""
    x = torch.arange(5, dtype=torch.int32, device=device)
    _add_one[(1,)](x, 5, BLOCK=8)
    if x.tolist() != [1, 2, 3, 4, 5]:
        raise RuntimeError(f"a Triton kernel answered {x.tolist()} for [1, 2, 3, 4, 5]")
