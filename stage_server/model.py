"""A slice of a Llama-family decoder (Llama, Mistral, Qwen2) in plain PyTorch.

One forward pass runs a flat batch: the tokens of many sessions' steps side by side, [T, hidden].
Linear layers see all T tokens at once; attention runs per step against that session's own KV
cache, so sessions of different lengths, prefill chunks and decode steps share one pass.
The math follows transformers' modeling_llama/qwen2/mistral so that results match it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from stage_server.kv_pool import SessionCache

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")
# Rope variants whose frequencies do not change with the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelArgs:
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    # Per layer: attend to at most this many previous positions, or None for full attention.
    sliding_windows: tuple[int | None, ...]

    @classmethod
    def from_hf_config(cls, config) -> ModelArgs:
        family = config.model_type
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(f"model family {family!r} is not supported; use one of {SUPPORTED_FAMILIES}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        num_layers = config.num_hidden_layers
        windows: list[int | None] = [None] * num_layers
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if window:
            if layer_types:
                windows = [window if t == "sliding_attention" else None for t in layer_types]
            elif family == "mistral":
                windows = [window] * num_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            family=family,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            max_position=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            attention_bias=family == "qwen2" or bool(getattr(config, "attention_bias", False)),
            mlp_bias=family == "llama" and bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_windows=tuple(windows),
        )


def load_hf_config(model_dir: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale, computed by transformers itself so they match exactly."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {STATIC_ROPE_TYPES}")
    if rope_type == "default":
        base = params["rope_theta"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config)


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
        # Llama's attention_bias covers o_proj too; Qwen2's bias is on q/k/v only.
        o_bias = bias and args.family == "llama"
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=o_bias)

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


# Our fused Linears, and the checkpoint's Linears they concatenate (along the output dim, in order).
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def checkpoint_names(name: str) -> list[str]:
    """A decoder layer's parameter name -> the checkpoint tensors it is made of:
    "self_attn.qkv_proj.bias" -> ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]."""
    module, _, param = name.rpartition(".")
    return [f"{part}.{param}" for part in FUSED.get(module, (module,))]


def _is_linear_weight(name: str) -> bool:
    """Our parameter names of Linear weights: the layout and int8 choices apply to these only."""
    return name.endswith("proj.weight") or name == "lm_head.weight"


def _copy_rows(dest: torch.Tensor, path: Path, name: str) -> int:
    """Copies checkpoint tensor `name` into the first rows of dest (converting dtype, device and
    layout on the way) and returns how many rows it has. It goes ~16 MiB at a time, each piece
    of the file mapped only while it is copied, so that the file's pages do not pile up in this
    process's memory next to the copy."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        shape = f.get_slice(name).get_shape()
    if not shape or shape[0] > dest.shape[0] or shape[1:] != list(dest.shape[1:]):
        raise ValueError(f"checkpoint tensor {name} has shape {shape}; expected rows of {list(dest.shape[1:])}")
    n = shape[0]
    slab = max(1, (16 << 20) // (dest[0].numel() * dest.element_size()))
    for r in range(0, n, slab):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            piece, rows = f.get_slice(name)[r : r + slab], dest[r : min(n, r + slab)]
            if rows.dim() == 2 and rows.stride(0) == 1:  # column-major: copy whole rows of memory
                rows.t().copy_(piece.t().contiguous())
            else:
                rows.copy_(piece)
    return n


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Maps each tensor name to the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def load_stage(
    model_dir: str | Path,
    layer_start: int,
    layer_end: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    int8_linears: bool = False,
) -> StageModel:
    """Builds the slice and reads only its own tensors from the checkpoint. With int8_linears every
    Linear becomes stage_server.quantize.Int8WeightLinear, each weight quantized on the CPU as it is
    read: the device never holds the full-precision slice."""
    model_dir = Path(model_dir)
    config = load_hf_config(model_dir)
    args = ModelArgs.from_hf_config(config)
    layer_end = args.num_layers if layer_end is None else layer_end
    inv_freq, rope_scale = rope_inv_freq(config)
    with torch.device("meta"):
        model = StageModel(args, layer_start, layer_end, inv_freq, rope_scale)
        if int8_linears:
            from stage_server.quantize import int8_rows, int8_weight_only

            int8_weight_only(model)  # shapes and dtypes only, on the meta device

    sources: dict[str, list[str]] = {}  # our parameter name -> the checkpoint tensors it is made of
    for slot, i in enumerate(range(layer_start, layer_end)):
        for name, _ in model.layers[slot].named_parameters():
            if name.endswith(".scale"):  # int8 scales: made from their weight below
                continue
            sources[f"layers.{slot}.{name}"] = [f"model.layers.{i}.{part}" for part in checkpoint_names(name)]
    if model.is_first:
        sources["embed_tokens.weight"] = ["model.embed_tokens.weight"]
    if model.is_last:
        sources["norm.weight"] = ["model.norm.weight"]
        if not (model.is_first and args.tie_word_embeddings):  # tied and also first: one tensor, two uses
            head = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
            sources["lm_head.weight"] = [head]

    device_type = torch.device(device).type
    files = _weight_files(model_dir)
    missing = [name for names in sources.values() for name in names if name not in files]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors {missing[:5]}")
    state: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        if int8_linears and _is_linear_weight(name):
            q, scale = int8_rows(tensor.to(dtype), dtype)  # of the weight the stage would otherwise hold
            state[name], state[name.removesuffix("weight") + "scale"] = q.to(device), scale.to(device)
        else:
            state[name] = tensor.to(device=device, dtype=dtype)

    for ours, names in sources.items():
        # float32 only: a bfloat16 GEMV is ~20% slower over the transposed layout (oneDNN prefers rows).
        transposed = device_type == "cpu" and dtype == torch.float32 and not int8_linears and _is_linear_weight(ours)
        if len(names) == 1 and not transposed:  # as stored: on CPU a view of the file, read on use
            with safe_open(str(files[names[0]]), framework="pt", device="cpu") as f:
                put(ours, f.get_tensor(names[0]))
            continue
        shape = model.get_parameter(ours).shape  # on the meta model: the fused shape
        if transposed:
            # Linear weights laid out as their transpose ([in, out] in memory): F.linear of one
            # token (a GEMV, every decode step) is ~20% faster over it on CPU in float32.
            t = torch.empty(shape[1], shape[0], dtype=dtype, device=device).t()
        else:  # int8: assembled on the CPU, then quantized and moved
            t = torch.empty(shape, dtype=dtype, device="cpu" if int8_linears else device)
        row = 0
        for name in names:  # the parts, one after another along the rows
            row += _copy_rows(t[row:], files[name], name)
        if row != shape[0]:
            raise ValueError(f"checkpoint tensors {names} have {row} rows in all; expected {shape[0]}")
        put(ours, t)
    if model.is_first and model.is_last and args.tie_word_embeddings:
        if int8_linears:
            put("lm_head.weight", state["embed_tokens.weight"].cpu())  # an int8 copy: not shared
        else:
            state["lm_head.weight"] = state["embed_tokens.weight"]
    model.to_empty(device=device)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = inv_freq.float().to(device)
    return model.eval()
