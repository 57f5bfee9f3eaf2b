"""A stage's whole decode pass (every row one session's one new token) as one function of tensors, for
torch.compile to turn into one graph (stage_server/engine/compiled.py wires it into the stage behind --compile).

The same math as model.py's eager pass for decode steps: K/V of the new positions written into the paged
pool, each session's keys gathered from its block table, one masked attention per layer over them, the
layer's MLP; on the last stage the final norm and LM head. What the eager pass builds on the host once per
pass (pass_plan.py: rotary rows, slots, gather indices, masks) is made inside the graph from two small
tensors, the positions and the block tables, so a pass hands the graph nothing else.

Two choices the compiler forces: K/V are written with index_put_ on the whole pool tensor with full indices
(written into a view of one layer, inductor copies that layer's whole pool slice every pass); and attention,
where the paged attention kernel is not had (paged_attention.py: on the CPU it is, an opaque op in the graph
that reads each row's keys in place), is written out (scores, softmax, weighted sum), which inductor fuses,
rather than SDPA. Written out, keys past a session's position, and the NULL_BLOCK padding its block table to
the pass's width, are masked, and masked by selection, not by adding -inf: the graph reads whole blocks, so
the slots of a session's last block past its position were never written and hold whatever the memory held,
NaN included, and 0 * NaN (or NaN - inf) is NaN. Their scores are set to -inf and their values to 0 (both fuse
into the gather). The kernel never reads them. Written out, the scores, softmax and weighted sum are float32
whatever the model's dtype (a no-op in float32), as in SDPA's kernels and the paged attention kernel: in bfloat16
they cost a 1.1B Llama's greedy tokens their agreement with transformers within a few steps (scripts/gpu_check.sh).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stagemesh.stage_server.engine.model import StageModel, StepSlice, apply_rope


def key_blocks(steps: list[StepSlice]) -> int:
    """The width of a decode pass's block tables: the blocks up to its furthest new position, 2 at least (dynamo
    would specialise a width of 1)."""
    return max(2, steps[0].cache.pool.blocks_for(max(st.start for st in steps) + 1))


def decode_pass_fn(model: StageModel, block_size: int) -> Callable[..., torch.Tensor]:
    """The decode pass of model's slice over a pool of block_size-position blocks:
    (inputs, pos, table, cos, sin, k_pool, v_pool) -> hidden states [B, hidden], or logits [B, vocab] in float32
    on the last stage. inputs: token ids [B] (first stage) or hidden states [B, hidden]; pos: [B] each row's
    position; table: [B, nb] each row's block table, padded with NULL_BLOCK; cos, sin: model.rope()'s tables;
    k_pool, v_pool: KVPool.k and .v, [layers, slots, kvH, D], written in place."""
    a = model.args
    H, kvH, D, bs = a.num_heads, a.num_kv_heads, a.head_dim, block_size
    windows = {layer.self_attn.window for layer in model.layers}
    scale = D**-0.5
    paged = model.decode_attention  # the paged attention kernel (paged_attention.py), or None: gathered here

    def decode_pass(inputs, pos, table, cos, sin, k_pool, v_pool):
        x = model.embed_tokens(inputs) if model.is_first else inputs.to(model.dtype)  # [B, hidden]
        B, nb = table.shape
        c, s = cos[pos][:, None], sin[pos][:, None]  # [B, 1, D]
        slot = table.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs  # [B] where the new K/V go
        keys = (table[:, :, None] * bs + torch.arange(bs, device=pos.device)).view(B, nb * bs)  # [B, Lk] pool slots
        k_pos = torch.arange(nb * bs, device=pos.device)  # [Lk]
        masks = {}
        for w in windows if paged is None else ():
            visible = k_pos[None] <= pos[:, None]  # [B, Lk]
            if w is not None:
                visible = visible & (pos[:, None] - k_pos[None] < w)
            masks[w] = visible
        for i, layer in enumerate(model.layers):
            at = layer.self_attn
            qkv = at.qkv_proj(layer.input_layernorm(x))  # [B, (H + 2 kvH) * D]
            qk = apply_rope(qkv[:, : (H + kvH) * D].view(B, H + kvH, D), c, s)  # [B, H + kvH, D]
            li = torch.full((1,), i, dtype=torch.long, device=pos.device)
            k_pool.index_put_((li, slot), qk[:, H:])  # in place: no copy of the pool
            v_pool.index_put_((li, slot), qkv[:, (H + kvH) * D :].view(B, kvH, D))
            if paged is not None:  # the kernel reads each row's keys where they lie (an opaque op to inductor)
                o = paged(qk[:, :H].contiguous(), k_pool[i], v_pool[i], table, pos + 1, bs, at.window or 0, scale)
                x = x + at.o_proj(o.reshape(B, H * D))
            else:
                visible = masks[at.window]
                k = k_pool[i][keys].permute(2, 0, 1, 3).float()  # [kvH, B, Lk, D]
                v = torch.where(visible[None, :, :, None], v_pool[i][keys].permute(2, 0, 1, 3).float(), 0.0)
                q = qk[:, :H].reshape(B, kvH, H // kvH, D).transpose(0, 1).float()  # [kvH, B, group, D]
                scores = torch.where(visible[None, :, None, :], (q @ k.transpose(-1, -2)) * scale, float("-inf"))
                o = (torch.softmax(scores, dim=-1) @ v).to(x.dtype)  # [kvH, B, group, D]
                x = x + at.o_proj(o.transpose(0, 1).reshape(B, H * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(model.norm(x)).float() if model.is_last else x

    return decode_pass
