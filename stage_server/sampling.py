"""Picks the next token from the last stage's logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0  # 1 (or 0): no limit
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sample(logits: torch.Tensor, params: Sampling, generator: torch.Generator | None) -> int:
    # logits: [vocab], float32
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the top one always stays.
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
