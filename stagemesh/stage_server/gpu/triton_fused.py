"""A decoder layer's small ops on CUDA, one Triton kernel each: RMSNorm with the residual add before it, the rotary
embedding with the K/V writes into the pool after it, and SiLU-and-multiply.

Written op by op (model.py), a layer of a bfloat16 model launches ~30 kernels, ~20 of them elementwise work on a
few kilobytes at batch 1 (an RMSNorm alone is eight: widen, square, mean, add, rsqrt, multiply, narrow, scale).
Inside a CUDA graph a launch costs no host time, but each kernel still costs the GPU a few microseconds to start
and drain, which over a 22-layer stage is of the order of the whole step's weight reads. Fused, a layer is nine
kernels: RMSNorm, the q/k/v product, rotary + K/V write, attention, the output product, residual add + RMSNorm,
gate/up product, SiLU-and-multiply, the down product.

Each kernel rounds where the ops it replaces round (to the model's dtype after every op, as transformers' layer
does in bfloat16). Inside an op the float32 arithmetic may differ from torch's kernels in the last bit (the order of
a row's sum of squares, Triton's exp and rsqrt), so a bfloat16 element can now and then land one step away: the
GPU check holds a stage with them to transformers' tokens by the near-tie rule, as every other kernel.

With TRITON_INTERPRET=1 in the environment before triton is imported they run on CPU tensors through Triton's
interpreter (tests/triton_interpreted.py checks them that way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(x, residual, weight, out, residual_out, N, stride_x, stride_r, stride_o, eps,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:  # the residual stream after this sublayer, rounded as x + residual is
        r = tl.load(residual + row * stride_r + cols, mask=ok, other=0.0)
        v = (v.to(tl.float32) + r.to(tl.float32)).to(residual_out.dtype.element_ty)
        tl.store(residual_out + row * N + cols, v, mask=ok)
    f = v.to(tl.float32)
    variance = tl.sum(f * f, axis=0) / N
    normed = (f * tl.rsqrt(variance + eps)).to(out.dtype.element_ty)
    w = tl.load(weight + cols, mask=ok, other=0.0)
    tl.store(out + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out.dtype.element_ty),
             mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for x [T, N]; residual None: the stage's first sublayer,
    whose residual stream is x itself."""
    T, N = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    stream = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(N)  # a row per program, spread over more warps as it widens (no spills at 8,192)
    if T:
        _add_rms_norm[(T,)](x, residual if residual is not None else x, weight, out, stream, N, x.stride(0),
                            residual.stride(0) if residual is not None else 0, out.stride(0), eps,
                            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=max(1, min(16, block // 512)))
    return out, stream


@triton.jit
def _silu_and_mul(gate_up, out, width, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    g = tl.load(gate_up + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * stride_g + width + cols, mask=ok, other=0.0).to(tl.float32)
    silu = tl.div_rn(g, 1.0 + tl.exp(-g)).to(out.dtype.element_ty).to(tl.float32)  # rounded as F.silu, then the product
    tl.store(out + row * stride_o + cols, (silu * u).to(out.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * I] (the fused gate/up product's output) -> [T, I]."""
    T, width = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty(T, width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if T:
        _silu_and_mul[(T, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), out.stride(0),
                                                        BLOCK=block)
    return out


@triton.jit
def _rope_and_write(qkv, cos, sin, slots, q_out, k_pool, v_pool, stride_t, stride_c, stride_slot, H, KVH, D, HALF,
                    BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    src = qkv + t * stride_t + h * D
    x = tl.load(src + d, mask=ok, other=0.0)
    slot = tl.load(slots + t).to(tl.int64)
    if h < H + KVH:  # q or k: x * cos + rotate_half(x) * sin, rounded after each op as model.apply_rope is
        rolled = tl.load(src + (d + HALF) % D, mask=ok, other=0.0)
        c = tl.load(cos + t * stride_c + d, mask=ok, other=0.0)
        s = tl.load(sin + t * stride_c + d, mask=ok, other=0.0)
        a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
        b = (rolled.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        y = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        if h < H:
            tl.store(q_out + (t * H + h) * D + d, y, mask=ok)
        else:
            tl.store(k_pool + slot * stride_slot + (h - H) * D + d, y, mask=ok)
    else:  # v, as it is
        tl.store(v_pool + slot * stride_slot + (h - H - KVH) * D + d, x, mask=ok)


def rope_and_write(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
                   k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """The q/k/v product's output qkv [T, (H + 2 kvH) * D]: q and k rotated (cos, signed_sin [T, 1, D] or [T, D],
    see model.rope_tables), k and v written to the pool's rows slots [T] (k_pool, v_pool [slots, kvH, D], one
    layer's); returns q [T, H, D]."""
    T = qkv.shape[0]
    D = k_pool.shape[-1]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(T, heads, D, dtype=qkv.dtype, device=qkv.device)
    if T:
        _rope_and_write[(T, heads + 2 * kv_heads)](qkv, cos, signed_sin, slots, q, k_pool, v_pool, qkv.stride(0),
                                                   cos.stride(0), k_pool.stride(0), heads, kv_heads, D, D // 2,
                                                   BLOCK_D=triton.next_power_of_2(D))
    return q
