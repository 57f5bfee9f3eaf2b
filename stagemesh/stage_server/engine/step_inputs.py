"""A step's input off the wire, decoded and checked before it reaches the batcher: every way a caller can get
it wrong is an INVALID_ARGUMENT that says what was expected, never a failed pass."""

from __future__ import annotations

import grpc
import torch

from stagemesh import tensor_codec
from stagemesh.errors import StatusError
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.v1 import stage_pb2


def step_tokens(request: stage_pb2.ForwardRequest) -> int:
    """The tokens of a step, from its tensor's shape (its bytes unread)."""
    tensor = request.hidden if request.HasField("hidden") else request.token_ids
    return tensor.shape[0] if tensor.shape else 0


def check_inputs(model: StageModel, request: stage_pb2.ForwardRequest) -> None:
    """What decode_inputs refuses that a step's shape and dtype tell, checked on arrival without reading its bytes
    (it is decoded when it reaches the head of its session: a queued step holds only its message)."""
    if model.is_first:
        if request.WhichOneof("input") != "token_ids":
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "the first stage takes token_ids, not hidden states")
        return
    if request.WhichOneof("input") != "hidden":
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"stage {model.layer_start}:{model.layer_end} takes hidden states, not token ids")
    shape = list(request.hidden.shape)
    if len(shape) != 2 or shape[1] != model.args.hidden_size:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"hidden states must have shape [tokens, {model.args.hidden_size}], got {shape}")
    if shape[0] <= 0:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "a step needs at least one token")


def decode_inputs(model: StageModel, request: stage_pb2.ForwardRequest) -> torch.Tensor:
    """A step's input, decoded and checked: token ids [T] (first stage) or hidden states [T, hidden]."""
    args = model.args
    which = request.WhichOneof("input")
    if model.is_first:
        if which != "token_ids":
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              "the first stage takes token_ids, not hidden states")
        inputs = tensor_codec.decode(request.token_ids)
        if inputs.dtype not in (torch.int64, torch.int32) or inputs.dim() != 1:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"token_ids must be a 1-D int64/int32 tensor, got {request.token_ids.dtype} "
                              f"{list(inputs.shape)}")
        ids = inputs.tolist()  # checked in Python: a decode step's one id costs a third of two torch reductions
        if ids and (min(ids) < 0 or max(ids) >= args.vocab_size):
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"token id outside the vocabulary 0..{args.vocab_size - 1}")
        if inputs.dtype != torch.int64:
            inputs = inputs.long()
    else:
        if which != "hidden":
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"stage {model.layer_start}:{model.layer_end} takes hidden states, not token ids")
        inputs = tensor_codec.decode(request.hidden)
        if not inputs.is_floating_point():
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"hidden states must be float32, bfloat16, float16 or int8 with row_scale, "
                              f"got {request.hidden.dtype}")
        if inputs.dim() != 2 or inputs.shape[1] != args.hidden_size:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"hidden states must have shape [tokens, {args.hidden_size}], "
                              f"got {list(inputs.shape)}")
    if inputs.shape[0] == 0:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "a step needs at least one token")
    return inputs
