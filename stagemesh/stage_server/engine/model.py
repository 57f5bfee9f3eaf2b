"""A slice of a Llama-family decoder (Llama, Mistral, Qwen2) in plain PyTorch.

One forward pass runs a flat batch: the tokens of many sessions' steps side by side, [T, hidden].
Linear layers see all T tokens at once; attention runs once per layer for all decode steps of the
pass (on the CPU by a kernel that reads K/V in the paged pool, kv_pool.py and paged_attention.py), and
once for all its prefill chunks over K/V gathered from the pool, with
rotary tables, slots and masks made once per pass (pass_plan.py), so sessions of different lengths,
prefill chunks and decode steps share one pass.
The math follows transformers' modeling_llama/qwen2/mistral so that results match it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stagemesh.checkpoint import ModelArgs
from stagemesh.stage_server.engine.pass_plan import (
    AttentionGroup,
    DecodeAttention,
    PassPlan,
    RaggedAttention,
    StepSlice,
    int_tensor,
    plan_pass,
)


@dataclasses.dataclass(frozen=True)
class FusedOps:
    """A layer's small ops in one kernel each (on CUDA stage_server/gpu/triton_fused.py's), rounding where the ops
    they replace round; a model without them runs those ops one by one."""

    # (x, residual or None, weight, eps) -> (RMSNorm(x + residual) * weight, x + residual)
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    # (qkv, cos, signed sin, slots, k_pool, v_pool, heads, kv_heads) -> q, k and v written to the pool
    rope_and_write: Callable[..., torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]  # gate_up [T, 2 I] -> silu(gate) * up


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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, slot: int):
        super().__init__()
        self.args = args
        self.slot = slot  # index of this layer inside the stage's KV pool
        self.window = args.sliding_windows[layer_index]
        bias = args.attention_bias
        # q, k and v projections as one Linear (the checkpoint's three, concatenated at load).
        self.qkv_proj = nn.Linear(args.hidden_size, (args.num_heads + 2 * args.num_kv_heads) * args.head_dim,
                                  bias=bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)

    def forward(self, x: torch.Tensor, plan: PassPlan, ops: FusedOps | None = None) -> torch.Tensor:
        # x: [T, hidden]; plan.cos, plan.sin: [T, 1, head_dim] (sin signed, see rope_tables)
        a = self.args
        T, H, kvH, D = x.shape[0], a.num_heads, a.num_kv_heads, a.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 kvH) * D]
        k_pool, v_pool = plan.pool.k[self.slot], plan.pool.v[self.slot]  # [slots, kvH, D]
        if ops is not None:
            q = ops.rope_and_write(qkv, plan.cos, plan.sin, plan.slots, k_pool, v_pool, H, kvH)  # [T, H, D]
        else:
            qk = apply_rope(qkv[:, : (H + kvH) * D].view(T, H + kvH, D), plan.cos, plan.sin)  # [T, H + kvH, D]
            q = qk[:, :H]  # [T, H, D]
            k_pool.index_copy_(0, plan.slots, qk[:, H:])
            v_pool.index_copy_(0, plan.slots, qkv[:, (H + kvH) * D :].view(T, kvH, D))
        if plan.ragged is not None:  # every row over its session's keys where they lie (triton_attention.py)
            o = plan.ragged_attention(q, k_pool, v_pool, plan.ragged, plan.pool.block_size, self.window or 0, D**-0.5)
            return self.o_proj(o.reshape(T, H * D))
        if plan.in_order:
            return self.o_proj(self._attend(q, plan.groups[0], k_pool, v_pool, plan).reshape(T, H * D))
        out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
        for g in plan.groups:
            o = self._attend(q, g, k_pool, v_pool, plan)  # [B * Lq, H, D]
            if g.valid is None:
                out.index_copy_(0, g.rows, o)
            else:
                out.index_copy_(0, g.rows[g.valid], o[g.valid])
        return self.o_proj(out.view(T, H * D))

    def _attend(self, q: torch.Tensor, g: AttentionGroup, k_pool: torch.Tensor, v_pool: torch.Tensor,
                plan: PassPlan) -> torch.Tensor:
        """One attention call for the group's sessions: q [T, H, D] (the pass's) -> [B * Lq, H, D]."""
        a = self.args
        H, kvH, D, B, Lq, Lk = a.num_heads, a.num_kv_heads, a.head_dim, g.size, g.q_len, g.k_len
        if g.table is not None:  # decode steps, the kernel reading K/V in the pool (paged_attention.py)
            qd = (q if plan.in_order else q[g.rows]).contiguous()  # [B, H, D]
            return plan.decode_attention(qd, k_pool, v_pool, g.table, g.ends, plan.pool.block_size, self.window or 0,
                                         D**-0.5)
        # Gathered contiguous into the reused scratch buffers (SDPA on CPU is many times slower on strided K/V), a
        # kv head at a time: index_select over the pool's transposed view would first copy the whole layer.
        k_buf, v_buf = plan.pool.scratch(B * Lk)  # [kvH, B * Lk, D], grown for the pass already
        for h in range(kvH):
            torch.index_select(k_pool[:, h], 0, g.gather, out=k_buf[h])
            torch.index_select(v_pool[:, h], 0, g.gather, out=v_buf[h])
        k, v = k_buf.view(kvH, B, Lk, D), v_buf.view(kvH, B, Lk, D)
        mask = g.mask(self.window)  # [B, Lq, Lk] or None
        if Lq == 1:
            # Decode steps: the query heads that share a kv head are rows of one query block, [kvH, B, group, D].
            qg = (q if plan.in_order else q[g.rows]).view(B, kvH, H // kvH, D).transpose(0, 1).contiguous()
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=None if mask is None else mask.view(1, B, 1, Lk))
            return o.transpose(0, 1).reshape(B, H, D)
        qg = q[g.rows].view(B, Lq, H, D).transpose(1, 2)  # [B, H, Lq, D]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [B, kvH, Lk, D]
        if B > 1:
            k, v = k.contiguous(), v.contiguous()
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=None if mask is None else mask[:, None],
                                           is_causal=mask is None, enable_gqa=H != kvH)  # [B, H, Lq, D]
        return o.transpose(1, 2).reshape(B * Lq, H, D)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # gate and up projections as one Linear (the checkpoint's two, concatenated at load).
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor, ops: FusedOps | None = None) -> torch.Tensor:
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, slot: int):
        super().__init__()
        self.self_attn = Attention(args, layer_index, slot)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, plan: PassPlan) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), plan)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_forward(self, x: torch.Tensor, residual: torch.Tensor | None, plan: PassPlan,
                      ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with its small ops fused: x is the previous sublayer's output, not yet added to the residual
        stream (None: x is the stream, this stage's first layer); returns this layer's MLP output and the
        stream before it (their sum is forward()'s)."""
        h, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        h, residual = ops.add_rms_norm(self.self_attn(h, plan, ops), residual, self.post_attention_layernorm.weight,
                                       self.post_attention_layernorm.eps)
        return self.mlp(h, ops), residual


def replace_linears(model: nn.Module, make: Callable[[nn.Module], nn.Module],
                    kinds: tuple[type[nn.Module], ...] = (nn.Linear,)) -> None:
    """Puts make(linear) in place of every Linear of the model (of kinds: int8 weights, packed weights)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, kinds):
                setattr(parent, name, make(child))


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
        self.fingerprint = ""  # what it serves (checkpoint.serving_fingerprint of the files read), set by the server
        # Decode passes' graph: --compile's (stage_server/engine/compiled.py).
        self.decode_graph = None
        # On CUDA, every pass's CUDA graph by bucket (stage_server/gpu/cuda_graphs.py); None: eager.
        self.pass_graphs = None
        # On the CPU, the kernel that attends decode steps over K/V in place (stage_server/engine/paged_attention.py);
        # None: gathered for SDPA.
        self.decode_attention: DecodeAttention | None = None
        # On the CPU in float32, a decode pass's layers in one call (stage_server/cpu/decode_layers.py), the embedding
        # and head with them where it can (the output, and whether it is the logits); None: op by op.
        # On CUDA, the kernel that attends every row of any pass in place (stage_server/gpu/triton_attention.py); None:
        # the paths above.
        self.ragged_attention: RaggedAttention | None = None
        self.decode_layers: Callable[[torch.Tensor, PassPlan], tuple[torch.Tensor, bool]] | None = None
        # On CUDA, each layer's small ops in one kernel each (stage_server/gpu/triton_fused.py); None: op by op.
        self.fused_ops: FusedOps | None = None
        self.tp_group = None  # rank 0 of a tensor-parallel stage: its TPGroup (stage_server/engine/tensor_parallel.py)

    # Read from a norm weight: Linear layers may be quantized (stage_server/engine/quantize.py).
    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    def rope(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see rope_tables) of positions 0.. at least end-1: [n, head_dim] each."""
        if self._rope is None or end > self._rope[0].shape[0] or self._rope[0].dtype != dtype:
            # Tables for the first 4096 positions, doubled when a longer session comes.
            n = max(end, 4096 if self._rope is None else 2 * self._rope[0].shape[0])
            self._rope = rope_tables(self.inv_freq, self.rope_scale, n, dtype)
        return self._rope

    def scratch_inputs(self, n: int) -> torch.Tensor:
        """Inputs of n tokens for a warm-up pass: token ids [n] on the first stage, hidden states [n, hidden]."""
        if self.is_first:
            return torch.zeros(n, dtype=torch.long, device=self.device)
        return torch.zeros(n, self.args.hidden_size, dtype=self.dtype, device=self.device)

    def run_layers(self, x: torch.Tensor, plan: PassPlan) -> torch.Tensor:
        """The decoder layers over x [T, hidden] (embedded tokens or the previous stage's hidden states)."""
        if self.fused_ops is None:
            for layer in self.layers:
                x = layer(x, plan)
            return x
        residual = None
        for layer in self.layers:
            x, residual = layer.fused_forward(x, residual, plan, self.fused_ops)
        return x + residual

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, steps: list[StepSlice]) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, hidden states [T, hidden] elsewhere; every step's
        cache holds the pool's blocks for its new positions (KVPool.grow).

        Returns hidden states [T, hidden], or on the last stage the logits of each step's
        last position [len(steps), vocab] in float32. Advances each step's cache length.
        """
        if self.pass_graphs is not None:
            out = self.pass_graphs(inputs, steps)  # None: no graph for this pass: eager
            if out is not None:
                for st in steps:
                    st.cache.length = st.start + st.length
                return out
        if self.decode_graph is not None and len(steps) == inputs.shape[0]:  # decode steps only: compiled
            out = self.decode_graph(inputs, steps)  # None: no graph for this pass (or compilation failed): eager
            if out is not None:
                for st in steps:
                    st.cache.length = st.start + 1
                return out
        rope = self.rope(max(st.start + st.length for st in steps), self.dtype)
        # Rotary rows, slots, gather indices and masks: made once per pass, used by every layer.
        plan = plan_pass(steps, steps[0].cache.pool, rope, self.device, self.decode_attention, self.ragged_attention)
        decode_only = (plan.in_order and len(steps) == inputs.shape[0] and plan.ragged is None
                       and plan.groups[0].table is not None)  # the CPU kernel's
        if decode_only and self.decode_layers is not None:  # embedding and head too, where it can
            x, is_logits = self.decode_layers(inputs, plan)
        else:
            x = self.run_layers(self.embed_tokens(inputs) if self.is_first else inputs.to(self.dtype), plan)
            is_logits = False
        for st in steps:
            st.cache.length = st.start + st.length
        if not self.is_last or is_logits:
            return x
        if len(steps) == x.shape[0]:  # every step is one token: each row is a step's last
            last = x
        else:
            last = x[int_tensor([st.offset + st.length - 1 for st in steps], x.device)]
        return self.lm_head(self.norm(last)).float()  # [len(steps), vocab]
