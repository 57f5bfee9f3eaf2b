"""Picks the next token from the last stage's logits.

The randomness of a draw is a function of (seed, position) alone: a seeded stream gives the same
tokens on any chain, after any failover (the replacement chain replays the prefix and draws again at
the same positions), whatever other sessions share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagemesh.request_limits import check_sampling

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive positions over the seed space
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0  # 1 (or 0): no limit
    seed: int = 0

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def draw_generator(seed: int, position: int) -> torch.Generator:
    """The generator of the draw at `position`: the same (seed, position), the same draw."""
    return torch.Generator().manual_seed(((seed ^ (position * _MIX)) & _SEED_MASK) or 1)


def sample(logits: torch.Tensor, params: Sampling, position: int) -> int:
    """logits: [vocab], float32. position: the sequence position of the token being drawn."""
    if params.greedy:
        return int(torch.argmax(logits))
    # Shift first: the best logit becomes 0, so a tiny temperature gives -inf for the others, not inf - inf.
    logits = (logits - logits.max()) / params.temperature
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
    return int(torch.multinomial(probs, 1, generator=draw_generator(params.seed, position)))


def sample_rows(logits: torch.Tensor, params: list[Sampling | None],
                positions: list[int]) -> list[int | None | Exception]:
    """A pass's tokens: logits [S, vocab] on the device (float32), one Sampling (None: no sample) and the
    position of the token drawn per row. Greedy rows take one argmax on the device and one copy of the
    chosen ids to the CPU; other rows draw as sample() does. A row's error stays in its own slot."""
    tokens: list[int | None | Exception] = [None] * len(params)
    greedy = [i for i, p in enumerate(params) if p is not None and p.greedy]
    if greedy:
        rows = logits if len(greedy) == len(params) else logits[greedy]
        for i, token in zip(greedy, rows.argmax(dim=-1).tolist(), strict=True):
            tokens[i] = token
    for i, p in enumerate(params):
        if p is not None and not p.greedy:
            try:
                tokens[i] = sample(logits[i].cpu(), p, positions[i])
            except Exception as exc:  # this row's failure, not the pass's
                tokens[i] = exc
    return tokens
