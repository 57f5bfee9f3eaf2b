"""A prototype of issue 15's whole-step compile: one torch.compile'd graph for a stage's whole decode pass
(every layer, K/V writes into the paged pool and attention over it), timed against the eager pass in process.

    python scripts/bench_step_compile.py [--model DIR] [--end 4] [--sizes 1] [--variants eager,c,c_keept,c_cpp]

Variants (run alternately, medians): eager (StageModel.forward), c (torch.compile, default guards), c_skipmod
(guard_filter_fn=skip_guard_on_all_nn_modules_unsafe), c_keept (keep_tensor_guards_unsafe), a "cpp" in the name
adds cpp_wrapper. Not wired into the stage yet (README, the per-token floor). K/V writes are index_put_ on the
whole pool tensor with full indices: written into a view of one layer (pool.k[i]), inductor copies the layer's
whole pool slice every pass (found with TORCH_LOGS=output_code).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.compiler as tc  # noqa: E402

from stage_server.kv_pool import NULL_BLOCK, KVPool  # noqa: E402
from stage_server.loader import load_stage  # noqa: E402
from stage_server.model import StageModel, StepSlice, apply_rope  # noqa: E402


def decode_pass_fn(model: StageModel, block_size: int):
    """The whole decode pass as one function of tensors: (inputs [B], pos [B], table [B, nb], cos, sin, k_pool,
    v_pool) -> hidden [B, hidden] or logits [B, vocab]. Masks, slots and gathers are made inside the graph."""
    a = model.args
    H, kvH, D, bs = a.num_heads, a.num_kv_heads, a.head_dim, block_size
    windows = {layer.self_attn.window for layer in model.layers}

    def step_pass(inputs, pos, table, cos, sin, k_pool, v_pool):
        x = model.embed_tokens(inputs) if model.is_first else inputs.to(model.dtype)
        B, nb = table.shape
        c, s = cos[pos][:, None], sin[pos][:, None]  # [B, 1, D]
        slot = table.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs  # [B]
        keys = (table[:, :, None] * bs + torch.arange(bs)).view(B, nb * bs)  # [B, Lk] pool slots
        kpos = torch.arange(nb * bs)
        masks = {}
        for w in windows:
            visible = kpos[None] <= pos[:, None]
            if w is not None:
                visible = visible & (pos[:, None] - kpos[None] < w)
            masks[w] = torch.where(visible, 0.0, float("-inf")).to(x.dtype)[None, :, None, :]  # [1, B, 1, Lk]
        heads = torch.arange(kvH)[None, :]
        for i, layer in enumerate(model.layers):
            at = layer.self_attn
            qkv = at.qkv_proj(layer.input_layernorm(x))
            qk = apply_rope(qkv[:, : (H + kvH) * D].view(B, H + kvH, D), c, s)
            li = torch.full((1, 1), i, dtype=torch.long)
            k_pool.index_put_((li, heads, slot[:, None]), qk[:, H:])  # in place, no copy of the pool
            v_pool.index_put_((li, heads, slot[:, None]), qkv[:, (H + kvH) * D :].view(B, kvH, D))
            K, V = k_pool[i][:, keys], v_pool[i][:, keys]  # [kvH, B, Lk, D]
            qg = qk[:, :H].reshape(B, kvH, H // kvH, D).transpose(0, 1)  # [kvH, B, G, D]
            scores = (qg @ K.transpose(-1, -2)) * D**-0.5 + masks[at.window]
            o = torch.softmax(scores, dim=-1) @ V
            x = x + at.o_proj(o.transpose(0, 1).reshape(B, H * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(model.norm(x)).float() if model.is_last else x

    return step_pass


def compiled_variant(fn, name: str):
    opts: dict = {}
    if "skipmod" in name:
        opts["guard_filter_fn"] = tc.skip_guard_on_all_nn_modules_unsafe
    if "keept" in name:
        opts["guard_filter_fn"] = tc.keep_tensor_guards_unsafe
    if "cpp" in name:
        opts["cpp_wrapper"] = True
    fresh = types.FunctionType(fn.__code__.replace(co_name=f"step_{name}"), fn.__globals__, closure=fn.__closure__)
    return torch.compile(fresh, dynamic=True, fullgraph=True, options=opts)  # its own code object: its own cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    p.add_argument("--end", type=int, default=4, help="the stage's layers: 0:end")
    p.add_argument("--sizes", default="1")
    p.add_argument("--passes", type=int, default=200)
    p.add_argument("--variants", default="eager,c,c_keept,c_cpp_keept")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = load_stage(args.model, 0, args.end)
    for B in (int(s) for s in args.sizes.split(",")):
        run_size(model, B, args)


def run_size(model: StageModel, B: int, args: argparse.Namespace) -> None:
    a = model.args
    pool = KVPool(1 << 30, len(model.layers), a.num_kv_heads, a.head_dim, model.dtype)
    fn = decode_pass_fn(model, pool.block_size)
    variants = {v: None if v == "eager" else compiled_variant(fn, v) for v in args.variants.split(",")}
    caches = [pool.allocate(args.passes * len(variants) + 400) for _ in range(B)]
    with torch.inference_mode():
        for i, c in enumerate(caches):
            n = 100 + 7 * i
            pool.grow(c, n)
            x = torch.randint(4, a.vocab_size, (n,)) if model.is_first else torch.randn(n, a.hidden_size)
            model(x, [StepSlice(c, 0, 0, n)])
        cos, sin = model.rope(4096, model.dtype)

        def one(f):
            steps = []
            for i, c in enumerate(caches):
                pool.grow(c, c.length + 1)
                steps.append(StepSlice(c, i, c.length, 1))
            x = torch.randint(4, a.vocab_size, (B,)) if model.is_first else torch.randn(B, a.hidden_size)
            if f is None:
                return model(x, steps)
            pos = torch.tensor([st.start for st in steps])
            nb = max(2, pool.blocks_for(max(st.start for st in steps) + 1))  # nb >= 2: no 0/1 specialisation
            table = torch.tensor([c.blocks[:nb] + [NULL_BLOCK] * (nb - len(c.blocks[:nb])) for c in caches])
            out = f(x, pos, table, cos, sin, pool.k, pool.v)
            for st in steps:
                st.cache.length = st.start + 1
            return out

        times: dict[str, list[float]] = {k: [] for k in variants}
        for k, f in variants.items():
            t = time.perf_counter()
            one(f)
            print(f"{k}: first call {time.perf_counter() - t:.2f}s", flush=True)
        for _ in range(args.passes):
            for k, f in variants.items():
                t = time.perf_counter()
                one(f)
                times[k].append(time.perf_counter() - t)
    for k in variants:
        print(f"layers 0:{args.end} B={B} {k}: {statistics.median(times[k]) * 1000:.3f} ms per decode pass",
              flush=True)


if __name__ == "__main__":
    main()
