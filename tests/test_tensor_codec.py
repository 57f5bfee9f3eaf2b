"""Tensors on the wire: exact round trips, raw little-endian bytes, and malformed messages rejected."""

from __future__ import annotations

import struct
import warnings

import pytest
import torch

from stagemesh import tensor_codec
from stagemesh.tensor_codec import CodecError, decode, encode
from stagemesh.v1 import tensor_pb2

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8]
SHAPES = [[3, 5], [0, 4], [1], [], [2, 3, 4]]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def sample(shape: list[int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern, so that NaN and -0.0 compare exactly."""
    return t.view(BITS[t.dtype]) if t.dtype in BITS else t


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_exact(dtype, shape):
    """decode(encode(t)) has t's dtype, shape and values exactly."""
    t = sample(shape, dtype)
    msg = encode(t)
    assert msg.dtype == tensor_codec.NAMES[dtype]
    assert list(msg.shape) == shape
    out = decode(tensor_pb2.Tensor.FromString(msg.SerializeToString()))
    assert out.dtype == dtype
    assert list(out.shape) == shape
    assert torch.equal(out, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_special_floats_keep_their_bits(dtype):
    """inf, -inf, NaN, -0.0 and the dtype's extremes come back bit for bit."""
    fi = torch.finfo(dtype)
    t = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, fi.max, fi.min, fi.tiny, fi.eps],
                     dtype=dtype)
    assert torch.equal(bits(decode(encode(t))), bits(t))


def test_non_contiguous_tensor_round_trips_in_logical_order():
    """A transposed view goes out row-major in its own shape, not in its storage order."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert not t.is_contiguous()
    out = decode(encode(t))
    assert list(out.shape) == [4, 3]
    assert torch.equal(out, t)


def test_data_is_the_raw_bytes_not_a_pickle():
    """float32 data is exactly t.numpy().tobytes(): no pickle header, nothing a peer could execute."""
    t = sample([3, 5], torch.float32)
    data = encode(t).data
    assert data == t.numpy().tobytes()
    assert len(data) == 3 * 5 * 4
    assert not data.startswith(b"\x80")  # pickle protocol 2+ opcode


def test_data_is_little_endian_row_major():
    """Known values give known bytes, whatever the host."""
    assert encode(torch.tensor([1.0, -2.0])).data == struct.pack("<2f", 1.0, -2.0)
    assert encode(torch.tensor([[1, 2], [3, 4]], dtype=torch.int64)).data == struct.pack("<4q", 1, 2, 3, 4)
    assert encode(torch.tensor([1.0], dtype=torch.bfloat16)).data == struct.pack("<H", 0x3F80)
    assert encode(torch.tensor([-1], dtype=torch.int8)).data == b"\xff"


def test_a_message_built_by_hand_decodes():
    """A peer in another language needs only dtype, shape and bytes."""
    msg = tensor_pb2.Tensor(dtype="int32", shape=[2, 2], data=struct.pack("<4i", 1, -2, 3, 2**31 - 1))
    assert torch.equal(decode(msg), torch.tensor([[1, -2], [3, 2**31 - 1]], dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decoded_tensor_owns_writable_memory(dtype):
    """The result can be written in place, outlives its message, and shares nothing with it."""
    t = sample([3, 5], dtype)
    msg = encode(t)
    sent = bytes(msg.data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a read-only buffer
        first, second = decode(msg), decode(msg)
    del msg
    first.fill_(1)
    first[0, 0] = 0
    assert first[0, 0].item() == 0 and first[1, 1].item() == 1
    assert torch.equal(second, t)  # a second decode of the same message is untouched
    assert encode(second).data == sent


def test_empty_tensor_decodes_writable():
    """A shape with a zero dimension gives an empty tensor that can still be used."""
    out = decode(encode(torch.empty(0, 4, dtype=torch.float16)))
    assert out.shape == (0, 4) and out.dtype == torch.float16
    assert torch.cat([out, torch.ones(1, 4, dtype=torch.float16)]).shape == (1, 4)


@pytest.mark.parametrize(
    "shape, nbytes",
    [([3, 5], 3 * 5 * 4 - 1), ([3, 5], 3 * 5 * 4 + 4), ([3, 5], 0), ([0, 4], 4), ([], 0), ([2**40, 2**40], 16)],
    ids=["short", "long", "no-data", "empty-with-data", "scalar-no-data", "huge"],
)
def test_shape_and_byte_length_mismatch_raises(shape, nbytes):
    """The byte count must be prod(shape) * itemsize exactly."""
    with pytest.raises(CodecError, match="bytes"):
        decode(tensor_pb2.Tensor(dtype="float32", shape=shape, data=b"\0" * nbytes))


@pytest.mark.parametrize("name", ["", "float64", "complex64", "bool", "uint8", "Float32", "torch.float32"])
def test_unknown_dtype_raises(name):
    """Only the dtypes the codec names are accepted, spelled exactly."""
    with pytest.raises(CodecError, match="unknown tensor dtype"):
        decode(tensor_pb2.Tensor(dtype=name, shape=[1], data=b"\0" * 8))


@pytest.mark.parametrize("shape", [[-1], [2, -3], [-2, -2]], ids=str)
def test_negative_dimension_raises(shape):
    """Negative dims are rejected even when their product matches the data ([-2, -2]: 4 elements)."""
    with pytest.raises(CodecError, match="negative"):
        decode(tensor_pb2.Tensor(dtype="float32", shape=shape, data=b"\0" * 16))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.float64, torch.uint8], ids=str)
def test_encoding_an_unsupported_dtype_raises(dtype):
    """The sender learns at once, rather than the receiver failing on a name it does not know."""
    with pytest.raises(CodecError, match="cannot send dtype"):
        encode(torch.zeros(2, dtype=dtype))


def test_codec_error_is_a_value_error():
    """Callers that catch ValueError (bad input) also catch codec errors."""
    assert issubclass(CodecError, ValueError)
