"""Builds a stage's slice and reads only its own tensors from a safetensors checkpoint (which tensors,
and what they mean, comes from stagemesh.checkpoint)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from stagemesh.checkpoint import ModelArgs, is_linear_weight, stage_sources, weight_files
from stagemesh.stage_server.cpu import huge_pages
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.stage_server.engine.quantize import ROWS, LinearFormat, quantize_linears
from stagemesh.stage_server.engine.tensor_parallel import rank_args, shard_of

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype's

# Rope variants whose frequencies do not change with the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def load_hf_config(model_dir: str | Path):
    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale, computed by transformers itself so they match exactly."""
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


def _copy_rows(dest: torch.Tensor, path: Path, name: str, part: tuple[slice, slice] | None = None) -> int:
    """Copies checkpoint tensor `name` (or only its rows and columns `part`: a tensor-parallel rank's
    shard) into the first rows of dest (converting dtype, device and layout on the way) and returns how
    many rows it copied. It goes ~16 MiB at a time, each piece of the file mapped only while it is
    copied, so that the file's pages do not pile up in this process's memory next to the copy."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        shape = f.get_slice(name).get_shape()
    rows_of, cols = part or (slice(None), slice(None))
    if shape:  # the shape of what is copied
        shape = [len(range(*rows_of.indices(shape[0]))), *([len(range(*cols.indices(shape[1])))] if shape[1:] else []),
                 *shape[2:]]
    if not shape or shape[0] > dest.shape[0] or shape[1:] != list(dest.shape[1:]):
        raise ValueError(f"checkpoint tensor {name} has shape {shape}; expected rows of {list(dest.shape[1:])}")
    n, first = shape[0], rows_of.start or 0
    slab = max(1, (16 << 20) // (dest[0].numel() * dest.element_size()))
    for r in range(0, n, slab):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            rows_read = slice(first + r, first + min(n, r + slab))
            piece = f.get_slice(name)[(rows_read, cols) if len(shape) > 1 else rows_read]
            rows = dest[r : min(n, r + slab)]
            if rows.dim() == 2 and rows.stride(0) == 1:  # column-major: copy whole rows of memory
                rows.t().copy_(piece.t().contiguous())
            else:
                rows.copy_(piece)
    return n


def load_stage(
    model_dir: str | Path,
    layer_start: int,
    layer_end: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    linears: LinearFormat = "dense",
    tp: tuple[int, int] = (0, 1),
    huge: bool = True,
) -> StageModel:
    """Builds the slice and reads only its own tensors from the checkpoint. With linears "int8" or "fp8" every
    Linear becomes stage_server.quantize's Int8WeightLinear or Fp8Linear, each weight quantized on the CPU as it
    is read: the device never holds the full-precision slice. tp = (rank, size): the slice of one rank of
    a tensor-parallel stage, its heads and MLP columns only (stage_server/engine/tensor_parallel.py)."""
    model_dir = Path(model_dir)
    config = load_hf_config(model_dir)
    full_args = ModelArgs.from_config(config.to_dict())
    args = rank_args(full_args, tp[1])
    layer_end = args.num_layers if layer_end is None else layer_end
    inv_freq, rope_scale = rope_inv_freq(config)
    with torch.device("meta"):
        model = StageModel(args, layer_start, layer_end, inv_freq, rope_scale)
        quantize_linears(model, linears)  # shapes and dtypes only, on the meta device

    sources = stage_sources(args, layer_start, layer_end)  # our parameter -> the checkpoint tensors it is made of
    device_type = torch.device(device).type
    files = weight_files(model_dir)
    missing = [name for names in sources.values() for name in names if name not in files]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors {missing[:5]}")
    state: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        if linears != "dense" and is_linear_weight(name):
            q, scale = ROWS[linears](tensor.to(dtype), dtype)  # of the weight the stage would otherwise hold
            state[name], state[name.removesuffix("weight") + "scale"] = q.to(device), scale.to(device)
        else:
            state[name] = tensor.to(device=device, dtype=dtype)

    progress = tqdm(sources.items(), desc=f"loading layers {layer_start}:{layer_end}", unit="tensor",
                    disable=not sys.stderr.isatty(), leave=False)  # a progress bar on a terminal only
    for ours, names in progress:
        # float32 only: a bfloat16 GEMV is ~20% slower over the transposed layout (oneDNN prefers rows).
        transposed = device_type == "cpu" and dtype == torch.float32 and linears == "dense" and is_linear_weight(ours)
        parts = [shard_of(ours, i, full_args, *tp) for i in range(len(names))]  # None: the whole tensor
        if len(names) == 1 and not transposed and parts[0] is None:  # as stored: on CPU a view of the file, read on use
            with safe_open(str(files[names[0]]), framework="pt", device="cpu") as f:
                put(ours, f.get_tensor(names[0]))
            continue
        shape = model.get_parameter(ours).shape  # on the meta model: the fused shape
        if transposed:
            # Linear weights laid out as their transpose ([in, out] in memory): F.linear of one
            # token (a GEMV, every decode step) is ~20% faster over it on CPU in float32.
            t = huge_pages.zeros((shape[1], shape[0]), dtype, huge).t()  # streamed every step: on 2 MiB pages
        else:  # int8 or fp8: assembled on the CPU, then quantized and moved
            t = torch.empty(shape, dtype=dtype, device="cpu" if linears != "dense" else device)
        row = 0
        for name, part in zip(names, parts, strict=True):  # the parts, one after another along the rows
            row += _copy_rows(t[row:], files[name], name, part)
        if row != shape[0]:
            raise ValueError(f"checkpoint tensors {names} have {row} rows in all; expected {shape[0]}")
        put(ours, t)
    if model.is_first and model.is_last and args.tie_word_embeddings:
        if linears != "dense":
            put("lm_head.weight", state["embed_tokens.weight"].cpu())  # a quantized copy: not shared
        else:
            state["lm_head.weight"] = state["embed_tokens.weight"]
    model.to_empty(device=device)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = inv_freq.float().to(device)
    return model.eval()
