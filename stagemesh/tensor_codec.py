"""Tensors on the wire: dtype name, shape and raw bytes. No pickle, so a peer can never run code."""

from __future__ import annotations

import warnings

import torch

from stagemesh.v1 import tensor_pb2
from stagemesh.wire import FLOAT_DTYPES, WIRE_DTYPES

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


# decode() views a message's bytes without copying them (torch.frombuffer). Those bytes are the tensor's own:
# protobuf's upb backend hands out a fresh bytes object at every read of a bytes field, and the tensor
# keeps it alive. torch warns (once) that bytes are not writable; nothing writes into a decoded tensor
# (the model makes new tensors from its inputs), and writing would touch only that private copy.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class CodecError(ValueError):
    """The message does not describe a valid tensor; the caller sent something malformed."""


def encode_into(msg: tensor_pb2.Tensor, t: torch.Tensor) -> tensor_pb2.Tensor:
    """Writes t into msg, an empty Tensor (a field of the message being answered: no second message and no
    CopyFrom). The bytes are copied once, out of the tensor; protobuf copies them once more into the message."""
    if t.dtype not in NAMES:
        raise CodecError(f"cannot send dtype {t.dtype}; supported: {', '.join(DTYPES)}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # numpy has no bfloat16: view the bits as int16 so the bytes go out untouched.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    msg.dtype = NAMES[t.dtype]
    msg.shape.extend(t.shape)
    msg.data = raw.numpy().tobytes()
    return msg


def encode(t: torch.Tensor) -> tensor_pb2.Tensor:
    return encode_into(tensor_pb2.Tensor(), t)


def encode_hidden_into(msg: tensor_pb2.Tensor, t: torch.Tensor, wire_dtype: str = "") -> tensor_pb2.Tensor:
    """Hidden states [tokens, hidden] into msg, in wire_dtype ("" keeps their own). int8 keeps one float
    scale per token (row), which bounds each value's error by half a step of that row's absmax / 127."""
    if not wire_dtype or NAMES.get(t.dtype) == wire_dtype:
        return encode_into(msg, t)
    if wire_dtype == "int8":
        t = t.float()
        scale = t.abs().amax(dim=-1).clamp(min=1e-12) / 127.0  # [tokens]
        q = torch.round(t / scale[:, None]).clamp(-127, 127).to(torch.int8)
        encode_into(msg, q)
        msg.row_scale.extend(scale.tolist())
        return msg
    if wire_dtype not in FLOAT_DTYPES:
        raise CodecError(f"wire dtype {wire_dtype!r}: use one of {', '.join(WIRE_DTYPES)}")
    return encode_into(msg, t.to(DTYPES[wire_dtype]))


def encode_hidden(t: torch.Tensor, wire_dtype: str = "") -> tensor_pb2.Tensor:
    return encode_hidden_into(tensor_pb2.Tensor(), t, wire_dtype)


def decode(msg: tensor_pb2.Tensor) -> torch.Tensor:
    """Returns a tensor that owns its memory (safe to keep after the message is gone): a view of the
    bytes object msg.data hands out, with no further copy."""
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"unknown tensor dtype {msg.dtype!r}; supported: {', '.join(DTYPES)}")
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise CodecError(f"negative dimension in shape {list(shape)}")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = dtype.itemsize
    data = msg.data  # read once: each read of a bytes field is a copy of its own (upb)
    if len(data) != numel * itemsize:
        raise CodecError(
            f"tensor of shape {list(shape)} and dtype {msg.dtype} needs {numel * itemsize} bytes, "
            f"got {len(data)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(data, dtype=dtype).reshape(shape)
    if msg.row_scale:
        if dtype != torch.int8 or len(shape) != 2 or len(msg.row_scale) != shape[0]:
            raise CodecError(f"row_scale ({len(msg.row_scale)} values) needs an int8 tensor of "
                             f"[rows, columns] with one scale per row; got {msg.dtype} {list(shape)}")
        t = t.float() * torch.tensor(list(msg.row_scale), dtype=torch.float32)[:, None]
    return t
