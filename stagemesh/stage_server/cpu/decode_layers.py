"""A decode pass's decoder layers in one call, on the CPU in float32: the op stagemesh::decode_layers of
decode_layers.cpp, next to this file (built by cpu_kernels.py with the kernels it calls).

Eager PyTorch spends ~25 calls through Python and the dispatcher on one layer of a decode pass; on the tiny
model they cost more than the layer's arithmetic, and more again in a mesh, where gRPC, the event loop and the
other processes run between two steps and leave the caches cold (docs/decisions.md, "One call per layer"). The op does
the same math with the same kernels: the packed Linears with their norms inside (packed_weights.py), rotary
embedding, the K/V writes, attention in place in the pool (paged_attention.py), the residual adds and
silu(gate) * up, for all of the stage's layers at once: a call per layer cost ~80 µs between two layers of a
~270M stage (docs/decisions.md, "All layers in one call"). The first stage's embedding and the last stage's packed
LM head (its final norm inside) go in the same call. Prefill chunks and mixed passes keep the layers' own forward.
"""

from __future__ import annotations

import torch

from stagemesh.stage_server.cpu import cpu_kernels
from stagemesh.stage_server.cpu.packed_weights import PackedLinear
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.stage_server.engine.pass_plan import PassPlan


def available(model: StageModel) -> str | None:
    """Why this model's decode passes cannot run their layers in one call (None: they can)."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "not a CPU float32 stage"
    if model.tp_group is not None:
        return "a tensor-parallel stage (its layers all-reduce between their ops)"
    if model.decode_attention is None:
        return "decode steps attend by SDPA, not the paged attention kernel"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(m, PackedLinear) for m in linears):
            return "the Linear weights are not packed"
        if attn.qkv_proj.norm_weight is None or mlp.gate_up_proj.norm_weight is None:
            return "the layer norms are not inside the packed Linears"
    if not cpu_kernels.load():
        return "the CPU kernels could not be built here (logged above)"
    return None


def attach(model: StageModel) -> str | None:
    """The model's decode passes run their layers in one call from now on, where they can; returns why not."""
    why = available(model)
    model.decode_layers = OneCall(model) if why is None else None
    return why


class _PassArgs:
    """What every pass's call passes that does not change between passes: each layer's weights, norms' eps and
    window, and its K/V views of the pool; the first stage's embedding table, the last stage's packed head. ~25
    module attribute reads and two tensor views per layer cost ~25 µs, as much as a tiny layer's arithmetic with
    its weights in cache."""

    def __init__(self, model: StageModel, pool: KVPool):
        self.pool = pool
        self.weights: list[torch.Tensor | None] = []
        self.eps: list[float] = []
        self.windows: list[int] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.weights += [attn.qkv_proj.panels, attn.qkv_proj.bias, attn.qkv_proj.norm_weight,
                             attn.o_proj.panels, attn.o_proj.bias, mlp.gate_up_proj.panels, mlp.gate_up_proj.bias,
                             mlp.gate_up_proj.norm_weight, mlp.down_proj.panels, mlp.down_proj.bias]
            self.eps += [attn.qkv_proj.eps, mlp.gate_up_proj.eps]
            self.windows.append(attn.window or 0)
            self.k.append(pool.k[attn.slot])
            self.v.append(pool.v[attn.slot])
        a = model.args
        self.heads, self.scale = a.num_heads, a.head_dim**-0.5
        self.embed = model.embed_tokens.weight if model.is_first else None
        head = model.lm_head if model.is_last else None
        self.with_head = isinstance(head, PackedLinear) and head.norm_weight is not None  # the final norm inside
        self.head = (head.panels, head.bias, head.norm_weight, head.eps, head.out_features) if self.with_head else ()


class OneCall:
    """A model's decode passes (decode steps only, in the pass's order: plan.in_order, one paged group) through
    all its layers in one call: token ids (first stage) or hidden states in; hidden states out, or logits where the
    call runs the LM head too (returned with True)."""

    def __init__(self, model: StageModel):
        self.model = model
        self._args: _PassArgs | None = None

    def __call__(self, inputs: torch.Tensor, plan: PassPlan) -> tuple[torch.Tensor, bool]:
        group, pool = plan.groups[0], plan.pool
        args = self._args
        if args is None or args.pool is not pool:  # a new pool (the stage's slice was swapped) gets new views
            args = self._args = _PassArgs(self.model, pool)
        x = inputs if args.embed is not None else inputs.to(torch.float32)  # a 16-bit wire's hidden states
        out = torch.ops.stagemesh.decode_layers(x.contiguous(), args.weights, args.eps, plan.cos, plan.sin,
                                                plan.slots, args.k, args.v, group.table, group.ends, pool.block_size,
                                                args.windows, args.heads, args.scale, args.embed, *args.head)
        return out, args.with_head
