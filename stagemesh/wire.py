"""What crosses the wire without torch: the names of the dtypes hidden states may travel in, and token ids as a
Tensor message.

tensor_codec builds on this for torch tensors. The router and the control plane, which never hold a tensor,
import only this module: torch is ~2 s of a process's start."""

from __future__ import annotations

from array import array

from stagemesh.v1 import tensor_pb2

PROTOCOL_VERSION = 3
"""The stage protocol this build speaks, bumped when what routers and stages send each other changes meaning (2:
penalties, logprobs and end-token suppression in a step's sampling; a stage of version 1 would ignore them and answer
other tokens; 3: the stage's Forward call is gone, routers step sessions on Sessions only). It is part of every
stage's serving fingerprint (checkpoint.serving_fingerprint), so the scheduler never chains stages of two versions, and
a router uses no chain of another version than its own."""

FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16"})
WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8")
"""How hidden states may travel between stages (int8: per-row scaled)."""


def encode_ids(ids: list[int]) -> tensor_pb2.Tensor:
    """Token ids as a 1-D int64 tensor, the same message as tensor_codec.encode(torch.tensor(ids))."""
    return tensor_pb2.Tensor(dtype="int64", shape=[len(ids)], data=array("q", ids).tobytes())
