"""Attention read in place from the paged KV pool, for every pass shape, in Triton (the GPU's attention).

One kernel serves decode steps, prefill chunks and passes that mix them: every query row of the pass knows its
session (a row of the block tables) and its position, and attends over that session's keys
[max(0, position + 1 - window), position + 1) where they lie in the pool, page by page through the block table.
Nothing is gathered, copied or padded to the longest session; scores and the softmax are float32 inside the
kernel (online softmax, as FlashAttention does), and the query heads that share a kv head are rows of one tile
(GQA: each K/V page is read once for all of them).

The launch is a grid of (query tile, kv head, key split): a tile is up to `block_q` consecutive query tokens of
one session; for long contexts and few tiles the keys are split across programs (flash decoding) and the
partial results merged by their log-sum-exp. The shape follows SGLang's Triton backend and vLLM's unified
Triton attention; the code is our own.

With TRITON_INTERPRET=1 in the environment before triton is imported, the same kernel runs on CPU tensors
through Triton's interpreter (slow; the tests check exactness that way, in a process of their own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stagemesh.stage_server.engine.pass_plan import PagedBatch, key_splits

BLOCK_N = 64
"""Keys a program scores at once (pass_plan.key_splits sizes splits in these)."""


@triton.jit
def _paged_attention(
    q, k_pool, v_pool, out, lse,  # q/out [T, H, D]; pools [slots, kvH, D]; lse [splits, T, H] (float32) or unused
    tables, tile_seq, tile_q0, seq_row0, seq_qlen, seq_start,
    scale, window, split_keys,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_os,
    stride_table, stride_lse_s, stride_lse_t,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq + tile)
    q0 = tl.load(tile_q0 + tile)
    row0 = tl.load(seq_row0 + seq)
    q_len = tl.load(seq_qlen + seq)
    start = tl.load(seq_start + seq)

    r = tl.arange(0, BLOCK_M)
    t = r // GROUP  # the row's token within the tile
    head = kv_head * GROUP + r % GROUP
    valid = (t < BLOCK_Q) & (q0 + t < q_len)
    row = row0 + q0 + t
    pos = start + q0 + t  # its position in the session
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    qv = tl.load(q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=valid[:, None] & d_ok[None, :], other=0.0)

    last = tl.minimum(q0 + BLOCK_Q, q_len) - 1  # the tile's last query token
    hi = start + last + 1  # keys [lo, hi) cover every row of the tile
    lo = start + q0
    if window > 0:
        lo = tl.maximum(lo - window + 1, 0)
    else:
        lo = 0
    if SPLITS > 1:
        lo = lo + split * split_keys
        hi = tl.minimum(hi, lo + split_keys)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    table_row = tables + seq * stride_table
    for k_start in range(lo, hi, BLOCK_N):
        k_pos = k_start + n
        k_ok = k_pos < hi
        page = tl.load(table_row + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)  # past 2**31 elements per layer
        slot = page * PAGE + k_pos % PAGE
        kv = tl.load(k_pool + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                     mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(qv, tl.trans(kv), input_precision="ieee")
        else:
            s = tl.dot(qv, tl.trans(kv))
        s = s * scale
        seen = k_ok[None, :] & (k_pos[None, :] <= pos[:, None])
        if window > 0:
            seen = seen & (pos[:, None] - k_pos[None, :] < window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(v_pool + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                     mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vv.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptr = out + split * stride_os + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, o.to(out.dtype.element_ty), mask=valid[:, None] & d_ok[None, :])
    if SPLITS > 1:
        lse_v = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse + split * stride_lse_s + row * stride_lse_t + head, lse_v, mask=valid)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch, page: int,
                    window: int = 0, scale: float | None = None, splits: int | None = None,
                    block_n: int = BLOCK_N) -> torch.Tensor:
    """q [T, H, D] (the pass's queries, their keys and values already written to the pools), k_pool/v_pool
    [slots, kvH, D] (one layer's) -> [T, H, D]: each row attends over its session's keys up to its position.
    splits > 1 divides each tile's keys over that many programs (long contexts, few tiles; default: the
    batch's)."""
    splits = batch.splits if splits is None else splits
    T, H, D = q.shape
    kv_heads = k_pool.shape[1]
    group = H // kv_heads
    scale = D**-0.5 if scale is None else scale
    block_m = max(16, triton.next_power_of_2(batch.block_q * group))
    block_d = max(16, triton.next_power_of_2(D))
    ieee = q.dtype == torch.float32
    split_keys = 0
    if splits > 1:
        split_keys = triton.cdiv(triton.cdiv(batch.max_keys, splits), block_n) * block_n
        out = torch.empty(splits, T, H, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, T, H, dtype=torch.float32, device=q.device)
    else:
        out = torch.empty(1, T, H, D, dtype=q.dtype, device=q.device)
        lse = out  # not read
    grid = (batch.tile_seq.shape[0], kv_heads, splits)
    _paged_attention[grid](
        q, k_pool, v_pool, out, lse,
        batch.tables, batch.tile_seq, batch.tile_q0, batch.seq_row0, batch.seq_qlen, batch.seq_start,
        scale, window, split_keys,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(1), out.stride(2), out.stride(0), batch.tables.stride(0),
        lse.stride(0) if splits > 1 else 0, lse.stride(1) if splits > 1 else 0,
        HEAD_DIM=D, GROUP=group, BLOCK_Q=batch.block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PAGE=page, SPLITS=splits, IEEE=ieee,
    )
    if splits == 1:
        return out[0]
    # Splits whose keys were all past the session's end hold lse -inf and weigh nothing.
    weights = torch.softmax(lse, dim=0).nan_to_num_(0.0)  # [splits, T, H]
    return (weights[..., None] * out).sum(0).to(q.dtype)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     ends: torch.Tensor, block_size: int, window: int, scale: float) -> torch.Tensor:
    """Decode steps only, in the CPU kernel's signature (pass_plan.DecodeAttention): q [B, H, D], table [B, nb],
    ends [B] one past each row's position. Everything is made on the device from the shapes, so a CUDA graph
    can hold it (cuda_graphs.py); the keys are split as the table's width allows."""
    B, nb = table.shape
    rows = torch.arange(B, dtype=torch.int32, device=q.device)
    batch = PagedBatch(table.to(torch.int32), rows, torch.ones_like(rows), (ends - 1).to(torch.int32), rows,
                       torch.zeros_like(rows), 1, nb * block_size, key_splits(B, k_pool.shape[1], nb * block_size,
                                                                             q.device))
    return paged_attention(q, k_pool, v_pool, batch, block_size, window, scale)

