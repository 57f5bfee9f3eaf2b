"""The last stage's sampling as the engine takes it, read off an open's or a step's protobuf (bounds and token ids
checked: InvalidSampling, answered INVALID_ARGUMENT), a penalised session's token history, and the logprobs a
sampled token goes back with."""

from __future__ import annotations

import grpc

from stagemesh.errors import StatusError
from stagemesh.request_limits import MAX_STOP_TOKEN_IDS, InvalidSampling, check_processing
from stagemesh.stage_server.engine.model import StageModel
from stagemesh.stage_server.engine.sampling import Logprobs, Sampling, TokenHistory
from stagemesh.v1 import stage_pb2

MAX_SUPPRESS_IDS = MAX_STOP_TOKEN_IDS + 64
"""min_tokens' end tokens: a request's stop_token_ids and the model's end-of-sequence ids."""


def sampling_of(p: stage_pb2.SamplingParams, vocab: int) -> Sampling:
    """A SamplingParams as the engine takes it; its bounds and token ids checked (InvalidSampling)."""
    check_processing(vocab_size=vocab, logit_bias=dict(p.logit_bias), logprobs=p.logprobs,
                     top_logprobs=p.top_logprobs)
    if len(p.suppress_ids) > MAX_SUPPRESS_IDS or any(not 0 <= t < vocab for t in p.suppress_ids):
        raise InvalidSampling(f"suppress_ids: at most {MAX_SUPPRESS_IDS} ids in the vocabulary 0..{vocab - 1}")
    return Sampling(p.temperature, p.top_k, p.top_p or 1.0, p.seed, min_p=p.min_p,
                    presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                    repetition_penalty=p.repetition_penalty or 1.0, logit_bias=tuple(sorted(p.logit_bias.items())),
                    suppress_ids=tuple(p.suppress_ids), suppress_until=p.suppress_until, logprobs=p.logprobs,
                    top_logprobs=p.top_logprobs)


def history_of(request: stage_pb2.OpenSessionRequest, sampling: Sampling | None,
               model: StageModel) -> TokenHistory | None:
    """A last-stage session's tokens by position, from its open: when it was sent them, or its sampling has a
    penalty (None otherwise: the common path keeps nothing)."""
    if not model.is_last or not (request.token_history or (sampling is not None and sampling.penalised)):
        return None
    ids, vocab = list(request.token_history), model.args.vocab_size
    if len(ids) > request.max_length or not 0 <= request.prompt_length <= len(ids):
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"token_history has {len(ids)} ids and prompt_length is {request.prompt_length}: "
                          f"send at most max_length ({request.max_length}) ids, the prompt's first")
    if outside := [t for t in ids if not 0 <= t < vocab]:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"token_history: token id {outside[0]} is outside the vocabulary 0..{vocab - 1}")
    return TokenHistory(ids, request.prompt_length, request.max_length + 1, model.device)


def step_sampling(request: stage_pb2.ForwardRequest, told: Sampling | None, history: TokenHistory | None,
                  vocab: int) -> Sampling:
    """How a last-stage step samples: its own sampling, else the session's as told at open (told), else greedy; a
    penalty needs the session's history."""
    sampling = sampling_of(request.sampling, vocab) if request.HasField("sampling") else told or Sampling()
    if sampling.penalised and history is None:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                          "a penalty needs the session's tokens: open it with token_history and prompt_length (and "
                          "a penalty in its sampling)")
    return sampling


def add_logprobs(response: stage_pb2.ForwardResponse, logprobs: Logprobs | None) -> None:
    if logprobs is not None:
        response.logprob = logprobs.logprob
        for token, logprob in logprobs.top:
            response.top_token_ids.append(token)
            response.top_logprobs.append(logprob)
