"""A slice of a Llama-family decoder (Llama, Mistral, Qwen2) in plain PyTorch.

One forward pass runs a flat batch: the tokens of many sessions' steps side by side, [T, hidden].
Linear layers see all T tokens at once; attention runs per step against that session's own KV
cache, so sessions of different lengths, prefill chunks and decode steps share one pass.
The math follows transformers' modeling_llama/qwen2/mistral so that results match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stage_server.kv_pool import SessionCache
from stagemesh.checkpoint import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu":
            # One call instead of six; on CPU in float32 bit-identical to the steps below
            # (which are transformers').
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(inv_freq: torch.Tensor, scale: float, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and "signed sin" for positions 0..n-1, [n, head_dim] each.

    cos/sin are computed as transformers does (freqs, concatenated with themselves). The sin
    table has its first half negated, so that rotate_half(x) * sin == x.roll(half) * signed_sin
    bit for bit, with one roll instead of two slices, a negation and a cat.
    """
    positions = torch.arange(n, device=inv_freq.device)
    freqs = positions[:, None].float() * inv_freq[None, :]  # [n, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
    cos = (emb.cos() * scale).to(dtype)
    sin = (emb.sin() * scale).to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos, signed_sin: [T, 1, D]. Same as x * cos + rotate_half(x) * sin.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass
class StepSlice:
    """One session's part of a flat batch: tokens [offset, offset+length) at positions start...

    cache.length == start when the pass begins; the pass writes K/V for the new positions.
    """

    cache: SessionCache
    offset: int
    start: int
    length: int


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, slot: int):
        super().__init__()
        self.args = args
        self.slot = slot  # index of this layer inside the stage's KV cache
        self.window = args.sliding_windows[layer_index]
        bias = args.attention_bias
        # q, k and v projections as one Linear (the checkpoint's three, concatenated at load).
        self.qkv_proj = nn.Linear(args.hidden_size, (args.num_heads + 2 * args.num_kv_heads) * args.head_dim,
                                  bias=bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, steps: list[StepSlice]
    ) -> torch.Tensor:
        # x: [T, hidden]; cos, sin: [T, 1, head_dim] (sin signed, see rope_tables)
        a = self.args
        T, H, kvH, D = x.shape[0], a.num_heads, a.num_kv_heads, a.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 kvH) * D]
        qk = apply_rope(qkv[:, : (H + kvH) * D].view(T, H + kvH, D), cos, sin)  # [T, H + kvH, D]
        q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, kvH, D]
        v = qkv[:, (H + kvH) * D :].view(T, kvH, D)

        if len(steps) == 1 and T == 1:  # one decode step: no scratch buffer, no copy back
            return self.o_proj(self._decode(q[0], k[0], v[0], steps[0]).view(1, H * D))
        out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
        for st in steps:
            lo, hi = st.offset, st.offset + st.length
            if st.length == 1:
                out[lo] = self._decode(q[lo], k[lo], v[lo], st)
                continue
            end = st.start + st.length
            k_cache, v_cache = st.cache.k[self.slot], st.cache.v[self.slot]  # [kvH, capacity, D]
            k_cache[:, st.start : end] = k[lo:hi].transpose(0, 1)
            v_cache[:, st.start : end] = v[lo:hi].transpose(0, 1)
            mask, causal = self._mask(st, x.device)
            o = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1)[None],  # [1, H, L, D]
                k_cache[None, :, :end],
                v_cache[None, :, :end],
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=H != kvH,
            )
            out[lo:hi] = o[0].transpose(0, 1)
        return self.o_proj(out.view(T, H * D))

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, st: StepSlice) -> torch.Tensor:
        """One position's attention: q [H, D], k and v [kvH, D] -> [H, D]. Writes k, v to the cache."""
        a = self.args
        end = st.start + 1
        k_cache, v_cache = st.cache.k[self.slot], st.cache.v[self.slot]  # [kvH, capacity, D]
        k_cache[:, st.start] = k
        v_cache[:, st.start] = v
        # The keys it may see: all so far, or the last `window` of them. No mask needed.
        first = 0 if self.window is None else max(0, end - self.window)
        group = a.num_heads // a.num_kv_heads
        # The query heads that share a kv head are rows of one query block: [1, kvH, group, D].
        o = F.scaled_dot_product_attention(
            q.view(1, a.num_kv_heads, group, a.head_dim),
            k_cache[None, :, first:end],
            v_cache[None, :, first:end],
        )
        return o.view(a.num_heads, a.head_dim)

    def _mask(self, st: StepSlice, device: torch.device) -> tuple[torch.Tensor | None, bool]:
        end = st.start + st.length
        if (self.window is None or end <= self.window) and st.start == 0:
            return None, True
        q_pos = torch.arange(st.start, end, device=device)[:, None]
        k_pos = torch.arange(end, device=device)[None, :]
        mask = k_pos <= q_pos
        if self.window is not None:
            mask &= q_pos - k_pos < self.window
        return mask, False


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # gate and up projections as one Linear (the checkpoint's two, concatenated at load).
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, slot: int):
        super().__init__()
        self.self_attn = Attention(args, layer_index, slot)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, steps: list[StepSlice]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, steps)
        return x + self.mlp(self.post_attention_layernorm(x))


class StageModel(nn.Module):
    """Decoder layers [layer_start, layer_end), plus embeddings on the first stage and the
    final norm and LM head on the last."""

    def __init__(self, args: ModelArgs, layer_start: int, layer_end: int, inv_freq: torch.Tensor,
                 rope_scale: float):
        super().__init__()
        if not 0 <= layer_start < layer_end <= args.num_layers:
            raise ValueError(
                f"layer range {layer_start}:{layer_end} is not inside the model's 0:{args.num_layers}"
            )
        self.args = args
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == args.num_layers
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size) if self.is_first else None
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, slot) for slot, i in enumerate(range(layer_start, layer_end))
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if self.is_last else None
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False) if self.is_last else None
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scale = rope_scale
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # rope_tables(), made on first use
        self.load_s = 0.0  # how long loading took (cold start), set by the stage server

    # Read from a norm weight: Linear layers may be quantized (stage_server/quantize.py).
    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    def rotary(self, steps: list[StepSlice], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see rope_tables) of the batch's positions: [T, 1, head_dim] each."""
        end = max(st.start + st.length for st in steps)
        if self._rope is None or end > self._rope[0].shape[0] or self._rope[0].dtype != dtype:
            # Tables for the first 4096 positions, doubled when a longer session comes.
            n = max(end, 4096 if self._rope is None else 2 * self._rope[0].shape[0])
            self._rope = rope_tables(self.inv_freq, self.rope_scale, n, dtype)
        cos, sin = self._rope
        if len(steps) == 1:
            st = steps[0]
            return cos[st.start : st.start + st.length, None], sin[st.start : st.start + st.length, None]
        positions = torch.cat([torch.arange(st.start, st.start + st.length) for st in steps]).to(cos.device)
        return cos[positions, None], sin[positions, None]

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, steps: list[StepSlice]) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, hidden states [T, hidden] elsewhere.

        Returns hidden states [T, hidden], or on the last stage the logits of each step's
        last position [len(steps), vocab] in float32. Advances each step's cache length.
        """
        x = self.embed_tokens(inputs) if self.is_first else inputs.to(self.dtype)  # [T, hidden]
        cos, sin = self.rotary(steps, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, steps)
        for st in steps:
            st.cache.length = st.start + st.length
        if not self.is_last:
            return x
        if len(steps) == x.shape[0]:  # every step is one token: each row is a step's last
            last = x
        else:
            last = x[torch.tensor([st.offset + st.length - 1 for st in steps], device=x.device)]
        return self.lm_head(self.norm(last)).float()  # [len(steps), vocab]
