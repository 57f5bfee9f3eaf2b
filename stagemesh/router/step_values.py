"""A step's sampling parameters and its answer as the generation loop sees them: plain values, turned into protobuf
and read off it here only."""

from __future__ import annotations

from dataclasses import dataclass

from stagemesh.v1 import stage_pb2, tensor_pb2


@dataclass(frozen=True)
class Sampling:
    """How the last stage picks each token (the defaults: greedy). The generation loop's own type:
    only this module turns it into protobuf."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0  # 0 or 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()
    suppress_ids: tuple[int, ...] = ()  # min_tokens: end tokens the stage suppresses ...
    suppress_until: int = 0  # ... for draws at positions below this
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def penalised(self) -> bool:
        """Whether the last stage needs the session's tokens (OpenSession's token_history)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty not in (0.0, 1.0))

    def to_pb(self) -> stage_pb2.SamplingParams:
        return stage_pb2.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias),
            suppress_ids=self.suppress_ids, suppress_until=self.suppress_until, logprobs=self.logprobs,
            top_logprobs=self.top_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability (log-softmax of the model's raw logits) and the most likely tokens' at its
    position (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepResult:
    """What the last stage answered for a step, read off its ForwardResponse."""

    token_id: int
    logits: tensor_pb2.Tensor | None = None
    """The last position's logits, [vocab_size] float32, when the step asked for them, as they came off the
    wire: tensor_codec.decode makes them a tensor (the router never does, and never imports torch)."""
    logprob: TokenLogprob | None = None
    """When the sampling asked for logprobs."""

    @classmethod
    def from_pb(cls, response: stage_pb2.ForwardResponse) -> StepResult:
        logprob = None
        if response.HasField("logprob"):
            logprob = TokenLogprob(response.token_id, response.logprob,
                                   tuple(zip(response.top_token_ids, response.top_logprobs, strict=True)))
        return cls(token_id=response.token_id, logits=response.logits if response.HasField("logits") else None,
                   logprob=logprob)
