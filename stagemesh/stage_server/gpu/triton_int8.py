"""int8 weight-only matrix products on CUDA, in Triton: y = x @ (q * scale)^T + bias, the int8 weight widened tile
by tile as the kernel reads it, never whole (torch's own path on CUDA widens the whole weight at every call, which
reads and writes it twice over for one decode step). A decode step reads half the bytes of bfloat16 weights.

With TRITON_INTERPRET=1 in the environment before triton is imported it runs on CPU tensors through Triton's
interpreter (tests/triton_interpreted.py checks it that way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int8_weight_matmul(
    x, w, scale, bias, out, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(x + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + rn[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)
        if IEEE:
            acc += tl.dot(a, b.to(a.dtype), input_precision="ieee")
        else:
            acc += tl.dot(a, b.to(a.dtype))
    acc *= tl.load(scale + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rm[:, None] * stride_om + rn[None, :], acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def int8_weight_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32, bfloat16 or float16), weight [N, K] int8, scale [N] -> [..., N] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    M, K = flat.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _int8_weight_matmul[grid](
        flat, weight, scale, bias if bias is not None else scale, out, M, N, K,
        flat.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, IEEE=x.dtype == torch.float32,
    )
    return out.reshape(*x.shape[:-1], N)
