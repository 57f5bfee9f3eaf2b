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

    def to_pb(self) -> stage_pb2.SamplingParams:
        return stage_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                        seed=self.seed)


@dataclass
class StepResult:
    """What the last stage answered for a step, read off its ForwardResponse."""

    token_id: int
    logits: tensor_pb2.Tensor | None = None
    """The last position's logits, [vocab_size] float32, when the step asked for them, as they came off the
    wire: tensor_codec.decode makes them a tensor (the router never does, and never imports torch)."""

    @classmethod
    def from_pb(cls, response: stage_pb2.ForwardResponse) -> StepResult:
        return cls(token_id=response.token_id, logits=response.logits if response.HasField("logits") else None)
