"""What a Hugging Face checkpoint directory means, read without torch: config -> model arguments, which
tensors a layer range needs, which of them are Linear weights, and how many bytes each piece weighs in a
dtype and quantization. The stage's loader and the scheduler's placement both read checkpoints through
this module, so they cannot disagree about a model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from stagemesh.wire import PROTOCOL_VERSION

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")
ITEMSIZE = {"float64": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1,
            "int8": 1, "uint8": 1, "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I8": 1, "U8": 1}
ServingDtype = Literal["float32", "bfloat16", "float16"]
"""The dtypes a stage serves in, and the scheduler sizes weights at."""
DtypeChoice = Literal["auto", "float32", "bfloat16", "float16"]
"""--dtype: a serving dtype, or auto (serving_dtype)."""
_CHECKPOINT_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
                      "half": "float16"}
Quantization = Literal["none", "int8", "int8-weight-only", "fp8"]
"""int8: Linear weights in int8 (int8 kernels on CPU float32, weight-only elsewhere); int8-weight-only:
int8 weights, activations in the model's dtype, on any device; fp8: float8_e4m3 weights and FP8 matrix products
(Hopper; stage_server/engine/quantize.py). Either way a Linear weight weighs one byte plus a scale per row."""
QUANTIZE = get_args(Quantization)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")

# Our fused Linears, and the checkpoint's Linears they concatenate (along the output dim, in order).
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def itemsize(dtype) -> int:
    """Bytes per element; accepts "bfloat16", torch.bfloat16 or a safetensors code like "BF16"."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(ITEMSIZE)}")
    return ITEMSIZE[name]


def serving_dtype(choice: str, config: Mapping, device_type: str) -> ServingDtype:
    """--dtype auto: the checkpoint's own (config.json's torch_dtype), except that a float32 checkpoint runs in
    bfloat16 on CUDA, as vLLM does (half the memory and bandwidth, tensor cores); a checkpoint that names none,
    or a dtype no stage serves in, runs in float32 on a CPU and bfloat16 on CUDA. Any other choice is kept."""
    if choice != "auto":
        return choice  # type: ignore[return-value]
    stored = _CHECKPOINT_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch."),
                                    "float32")
    return "bfloat16" if device_type == "cuda" and stored == "float32" else stored  # type: ignore[return-value]


def is_linear_weight(name: str) -> bool:
    """A Linear weight, by our parameter name or the checkpoint's: the layout and int8 choices apply to
    these only (projections and the LM head; not embeddings or norms)."""
    return name.endswith("_proj.weight") or name.endswith("lm_head.weight")


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
    """On q, k and v (Qwen2 always; Llama and Mistral when the config says so)."""
    o_bias: bool
    """Llama's attention_bias covers o_proj too; Qwen2's is on q/k/v only."""
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: attend to at most this many previous positions, or None for full attention."""

    @classmethod
    def from_config(cls, config: Mapping) -> ModelArgs:
        """From a config.json dict (or transformers' `config.to_dict()`, which fills the defaults)."""
        family = config.get("model_type", "llama")
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(f"model family {family!r} is not supported; use one of {SUPPORTED_FAMILIES}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        num_layers = config["num_hidden_layers"]
        windows: list[int | None] = [None] * num_layers
        layer_types, window = config.get("layer_types"), config.get("sliding_window")
        if window:
            if layer_types:
                windows = [window if t == "sliding_attention" else None for t in layer_types]
            elif family == "mistral":
                windows = [window] * num_layers
        heads = config["num_attention_heads"]
        attention_bias = family == "qwen2" or bool(config.get("attention_bias"))
        return cls(
            family=family,
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            max_position=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            attention_bias=attention_bias,
            o_bias=attention_bias and family == "llama",
            mlp_bias=family == "llama" and bool(config.get("mlp_bias")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings")),
            sliding_windows=tuple(windows),
        )

    def layer_parameters(self) -> dict[str, int]:
        """One decoder layer's parameters as the stage names them (fused q/k/v and gate/up), with
        their element counts."""
        h, inter, q = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim
        qkv = q + 2 * self.num_kv_heads * self.head_dim
        params = {"self_attn.qkv_proj.weight": qkv * h, "self_attn.o_proj.weight": h * q,
                  "mlp.gate_up_proj.weight": 2 * inter * h, "mlp.down_proj.weight": h * inter,
                  "input_layernorm.weight": h, "post_attention_layernorm.weight": h}
        if self.attention_bias:
            params["self_attn.qkv_proj.bias"] = qkv
        if self.o_bias:
            params["self_attn.o_proj.bias"] = h
        if self.mlp_bias:
            params |= {"mlp.gate_up_proj.bias": 2 * inter, "mlp.down_proj.bias": h}
        return params


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def checkpoint_names(name: str) -> list[str]:
    """A decoder layer's parameter name -> the checkpoint tensors it is made of:
    "self_attn.qkv_proj.bias" -> ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]."""
    module, _, param = name.rpartition(".")
    return [f"{part}.{param}" for part in FUSED.get(module, (module,))]


def stage_sources(args: ModelArgs, layer_start: int, layer_end: int) -> dict[str, list[str]]:
    """The stage's parameter names -> the checkpoint tensors each is made of, for layers [start, end)
    (plus the embeddings on the first stage, the final norm and LM head on the last)."""
    sources: dict[str, list[str]] = {}
    for slot, i in enumerate(range(layer_start, layer_end)):
        for name in args.layer_parameters():
            sources[f"layers.{slot}.{name}"] = [f"model.layers.{i}.{part}" for part in checkpoint_names(name)]
    first, last = layer_start == 0, layer_end == args.num_layers
    if first:
        sources["embed_tokens.weight"] = ["model.embed_tokens.weight"]
    if last:
        sources["norm.weight"] = ["model.norm.weight"]
        if not (first and args.tie_word_embeddings):  # tied and also first: one tensor, two uses
            sources["lm_head.weight"] = ["model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"]
    return sources


def _read_header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        header = json.loads(_header_bytes(f)[0])
    header.pop("__metadata__", None)
    return header


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Maps each tensor name to the safetensors file that holds it."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    return {name: single for name in _read_header(single)}


def _header_bytes(f) -> tuple[bytes, int]:
    """A safetensors file's raw header, and where its data begins."""
    size = int.from_bytes(f.read(8), "little")
    return f.read(size), 8 + size


def tensor_headers(model_dir: str | Path) -> dict[str, dict]:
    """Every tensor's safetensors header entry ({"dtype", "shape", ...}); no tensor is read."""
    headers: dict[str, dict] = {}
    for path in sorted(set(weight_files(model_dir).values())):
        headers |= _read_header(path)
    return headers


@dataclass(frozen=True)
class ModelFootprint:
    """What placement needs to know about a model: how many bytes each piece weighs in the serving dtype."""

    num_layers: int
    layer_bytes: int  # one decoder layer's weights
    embed_bytes: int  # held by the first stage
    head_bytes: int  # final norm + LM head, held by the last stage
    kv_bytes_per_token_per_layer: int
    tied_embeddings: bool = False  # then a single stage holds one tensor for both embed and head

    @property
    def total_bytes(self) -> int:
        return self.stage_bytes(0, self.num_layers)

    def stage_bytes(self, start: int, end: int) -> int:
        """Weight bytes of a stage serving layers [start, end)."""
        first, last = start == 0, end == self.num_layers
        shared = self.embed_bytes if first and last and self.tied_embeddings else 0
        return (end - start) * self.layer_bytes + first * self.embed_bytes + last * self.head_bytes - shared

    @classmethod
    def from_config(cls, config: Mapping, dtype=None) -> ModelFootprint:
        """Sizes from a Hugging Face config.json dict, as the stage builds the model."""
        args = ModelArgs.from_config(config)
        size = itemsize(dtype or config.get("dtype") or config.get("torch_dtype") or "float32")
        h, vocab = args.hidden_size, args.vocab_size
        return cls(num_layers=args.num_layers, layer_bytes=sum(args.layer_parameters().values()) * size,
                   embed_bytes=vocab * h * size, head_bytes=(h + vocab * h) * size,
                   kv_bytes_per_token_per_layer=2 * args.num_kv_heads * args.head_dim * size,
                   tied_embeddings=args.tie_word_embeddings)

    @classmethod
    def from_model_dir(cls, path: str | Path, dtype=None, quantize: str = "none") -> ModelFootprint:
        """Sizes from config.json and the safetensors headers (no tensor is read), scaled to `dtype`
        (default: as stored). With quantize "int8"/"int8-weight-only" every Linear weight (projections,
        LM head) weighs one byte per element plus a scale per output row."""
        config = read_config(path)
        quantized = quantize != "none"
        layers: dict[int, int] = {}
        embed = head = 0
        tensors = tensor_headers(path)
        for name, t in tensors.items():
            numel, rows, size = math.prod(t["shape"]), (t["shape"] or [1])[0], itemsize(dtype or t["dtype"])
            nbytes = numel + rows * size if quantized and is_linear_weight(name) else numel * size
            if m := _LAYER.match(name):
                layers[int(m[1])] = layers.get(int(m[1]), 0) + nbytes
            elif name == "model.embed_tokens.weight":
                embed = nbytes
            elif name in ("model.norm.weight", "lm_head.weight"):
                head += nbytes
        tied = bool(config.get("tie_word_embeddings")) and "lm_head.weight" not in tensors
        if sorted(layers) != list(range(config["num_hidden_layers"])):
            raise ValueError(f"{path}: checkpoint layers {sorted(layers)} do not match num_hidden_layers")
        embedding = tensors["model.embed_tokens.weight"]
        embed_size = itemsize(dtype or embedding["dtype"])
        kv = cls.from_config(config, dtype or embedding["dtype"]).kv_bytes_per_token_per_layer
        if tied and quantized:  # the quantized LM head is an int8 copy: the embedding is not shared
            vocab = embedding["shape"][0]
            return cls(num_layers=len(layers), layer_bytes=max(layers.values()), embed_bytes=embed,
                       head_bytes=head + math.prod(embedding["shape"]) + vocab * embed_size,
                       kv_bytes_per_token_per_layer=kv)
        return cls(num_layers=len(layers), layer_bytes=max(layers.values()), embed_bytes=embed,
                   head_bytes=head + embed * tied, kv_bytes_per_token_per_layer=kv, tied_embeddings=tied)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")
PROBE_BYTES = 64
"""Bytes read at the start, middle and end of each tensor for the model digest."""


def model_fingerprint(model_dir: str | Path) -> str:
    """A digest (hex) of what makes a model this model: config.json, the tokenizer files, each weight
    file's name, size and safetensors header, and a 64-byte probe at the start, middle and end of every
    tensor. Stages, routers and the scheduler compare it so that one chain never mixes two builds.

    The probes are the only tensor bytes read (a few KiB in all): headers and sizes alone cannot tell a
    fine-tune, or another seed, from its base model, since their shapes and offsets are the same."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        digest.update(f"{label}\0{len(data)}\0".encode())
        digest.update(data)

    add("config.json", (model_dir / "config.json").read_bytes())
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            add(name, (model_dir / name).read_bytes())
    for path in sorted(set(weight_files(model_dir).values())):
        with open(path, "rb") as f:
            header, data_start = _header_bytes(f)
            add(f"{path.name} {path.stat().st_size}", header)
            tensors = json.loads(header)
            for name in sorted(k for k in tensors if k != "__metadata__"):
                begin, end = tensors[name]["data_offsets"]
                for at in sorted({begin, max(begin, (begin + end) // 2 - PROBE_BYTES // 2),
                                  max(begin, end - PROBE_BYTES)}):
                    f.seek(data_start + at)
                    add(name, f.read(min(PROBE_BYTES, end - at)))
    return digest.hexdigest()


FINGERPRINT_DIGEST_CHARS = 16


def serving_fingerprint(model_digest: str, dtype: str, quantize: str) -> str:
    """What a stage serves, as it registers it and Stage/Info reports it:
    "<digest[:16]>/<dtype>/<quantize>/p<protocol version>". Stages of one chain must agree on all of it; a router
    also checks the digest and the protocol version against its own."""
    return f"{model_digest[:FINGERPRINT_DIGEST_CHARS]}/{dtype}/{quantize}/p{PROTOCOL_VERSION}"


def fingerprint_protocol(fingerprint: str) -> int:
    """The stage protocol version part of a serving fingerprint (0: none, a build from before versions)."""
    last = fingerprint.rsplit("/", 1)[-1]
    return int(last[1:]) if last[:1] == "p" and last[1:].isdigit() else 0


def fingerprint_digest(fingerprint: str) -> str:
    """The model digest part of a serving fingerprint ("" when there is none)."""
    return fingerprint.split("/", 1)[0]


def read_accepted_digests(path: str | Path) -> frozenset[str]:
    """The model digests a file lists (a router's --accept-fingerprints): one per line, each a serving fingerprint
    or its digest part (at least FINGERPRINT_DIGEST_CHARS hex digits); "#" starts a comment. ValueError naming the
    line when one is not."""
    digests = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        entry = line.partition("#")[0].strip()
        if not entry:
            continue
        digest = fingerprint_digest(entry).lower()
        if len(digest) < FINGERPRINT_DIGEST_CHARS or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{path}:{number}: {entry!r} is not a model fingerprint (Stage/Info's fingerprint, or "
                             f"its first part: {FINGERPRINT_DIGEST_CHARS} or more hex digits)")
        digests.add(digest[:FINGERPRINT_DIGEST_CHARS])
    return frozenset(digests)
