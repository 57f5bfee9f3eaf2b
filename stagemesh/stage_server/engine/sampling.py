"""Picks the next tokens from the last stage's logits: every row of a pass at once, on the logits' device.

A pass's rows are drawn together: temperature, top-k and top-p applied row by row as batched tensor ops, and
each row's token found by inverse-CDF sampling with one uniform number per row. Only the chosen ids come back to
the host (one copy per pass), never the logits.

The randomness of a draw is a function of (seed, position) alone: its uniform number is a hash of the two, so a
seeded stream gives the same tokens on any chain, after any failover (the replacement chain replays the prefix
and draws again at the same positions), whatever other sessions share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagemesh.request_limits import check_sampling

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive positions over the seed space
_MASK64 = (1 << 64) - 1


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


def uniform(seed: int, position: int) -> float:
    """The draw's number in (0, 1) at `position` of a stream seeded `seed`: splitmix64 of the two, 53 bits."""
    z = (seed ^ (position * _MIX)) & _MASK64
    z = (z + _MIX) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return ((z >> 11) + 0.5) / (1 << 53)


class NotFinite(ValueError):
    """A sampled row's probabilities are not finite numbers (NaN or infinite logits): no token can be drawn."""


def draw(logits: torch.Tensor, params: list[Sampling], positions: list[int]) -> list[int | NotFinite]:
    """One token per row of logits [S, vocab] (float32, on any device), row i drawn by params[i] at
    positions[i]; a sampled row whose probabilities are not finite gets NotFinite in its place."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    device, vocab = logits.device, logits.shape[-1]
    greedy = torch.tensor([p.greedy for p in params], device=device)
    # Greedy rows go through the same ops with temperature 1 and take their argmax at the end.
    temperature = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, device=device)
    # Shift first: the best logit becomes 0, so a tiny temperature gives -inf for the others, not inf - inf.
    x = (logits - logits.max(dim=-1, keepdim=True).values) / temperature[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        values = torch.topk(x, max(top_k), dim=-1).values  # [S, largest k]
        k = torch.tensor([max(k, 1) for k in top_k], device=device)
        kth = values.gather(1, (k - 1)[:, None])
        kth = torch.where(torch.tensor(top_k, device=device)[:, None] > 0, kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    top_p = [p.top_p if 0.0 < p.top_p < 1.0 else 2.0 for p in params]  # 2: no limit
    if any(p < 1.0 for p in top_p):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the top one always stays.
        drop = (probs.cumsum(-1) - probs) >= torch.tensor(top_p, device=device)[:, None]
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    cdf = torch.softmax(x, dim=-1).cumsum(-1)  # [S, vocab]
    u = torch.tensor([uniform(p.seed, pos) for p, pos in zip(params, positions, strict=True)],
                     dtype=torch.float32, device=device)
    # The first token whose cumulative mass reaches u of the row's total: never one of mass 0.
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=vocab - 1)[:, 0]
    chosen = torch.where(torch.isfinite(cdf[:, -1]), chosen, -1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), chosen).tolist()
    return [NotFinite("the logits of this row are not finite numbers") if t < 0 else t for t in tokens]


def sample(logits: torch.Tensor, params: Sampling, position: int) -> int:
    """logits: [vocab], float32. position: the sequence position of the token being drawn."""
    token = draw(logits[None], [params], [position])[0]
    if isinstance(token, NotFinite):
        raise token
    return token


def sample_rows(logits: torch.Tensor, params: list[Sampling | None],
                positions: list[int]) -> list[int | None | Exception]:
    """A pass's tokens: logits [S, vocab] on the device (float32), one Sampling (None: no sample) and the
    position of the token drawn per row. The rows are drawn together; should that fail, one at a time, so that
    a row's error stays in its own slot."""
    tokens: list[int | None | Exception] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p is not None]
    if not rows:
        return tokens
    picked = logits if len(rows) == len(params) else logits[rows]
    try:
        drawn: list[int | Exception] = draw(picked, [params[i] for i in rows], [positions[i] for i in rows])
    except Exception:  # which row? each alone, so that only its own fails
        drawn = []
        for j, i in enumerate(rows):
            try:
                drawn.append(draw(picked[j: j + 1], [params[i]], [positions[i]])[0])
            except Exception as exc:  # this row's failure, not the pass's
                drawn.append(exc)
    for i, token in zip(rows, drawn, strict=True):
        tokens[i] = token
    return tokens
