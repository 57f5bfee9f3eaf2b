"""Picks the next tokens from the last stage's logits: every row of a pass at once, on the logits' device.

A pass's rows are drawn together: logits processing (logit_bias, repetition/presence/frequency penalties, the
suppression of end tokens before min_tokens), then temperature, top-k, top-p and min-p, applied row by row as
batched tensor ops, and each row's token found by inverse-CDF sampling with one uniform number per row (a greedy
row takes the argmax of its processed logits). Only the chosen ids (and, when asked, their log-probabilities)
come back to the host (one copy per pass), never the logits.

The randomness of a draw is a function of (seed, position) alone: its uniform number is a hash of the two, so a
seeded stream gives the same tokens on any chain, after any failover (the replacement chain replays the prefix
and draws again at the same positions), whatever other sessions share its batch. Penalties read the session's
tokens by position (TokenHistory): those before the position drawn at, and nothing else, so they too are a
function of the position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagemesh.request_limits import check_processing, check_sampling

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive positions over the seed space
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0  # 1 (or 0): no limit
    seed: int = 0
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # OpenAI's, over the generated tokens (0: off)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # transformers', over prompt and generated tokens (0 or 1: off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    suppress_ids: tuple[int, ...] = ()  # -inf for draws at positions below suppress_until (min_tokens)
    suppress_until: int = 0
    logprobs: bool = False  # return the chosen token's log-probability ...
    top_logprobs: int = 0  # ... and those of the top_logprobs most likely tokens

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)
        check_processing(vocab_size=None, min_p=self.min_p, presence_penalty=self.presence_penalty,
                         frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                         logit_bias=dict(self.logit_bias), logprobs=self.logprobs, top_logprobs=self.top_logprobs)
        if self.repetition_penalty == 0.0:
            object.__setattr__(self, "repetition_penalty", 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether the draw reads the session's tokens (TokenHistory)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def plain(self) -> bool:
        """No processing besides temperature, top-k and top-p, and no log-probabilities: the fast path."""
        return not (self.penalised or self.logit_bias or self.suppress_ids or self.min_p or self.logprobs)


class TokenHistory:
    """A last-stage session's tokens by position, on the device (penalties): the prompt's at 0..prompt_length-1,
    then the generated ones, each written where it is drawn. A draw at position p reads positions 0..p-1 only, so
    a rewound, repaired or replayed session sees exactly the tokens before p."""

    def __init__(self, ids: list[int], prompt_length: int, capacity: int, device: torch.device | str = "cpu"):
        self.prompt_length = prompt_length
        self.capacity = max(capacity, len(ids))
        self.tokens = torch.zeros(self.capacity, dtype=torch.long, device=device)
        if ids:
            self.tokens[: len(ids)] = torch.tensor(ids, dtype=torch.long).to(device)
        self.known = len(ids)  # positions written so far (at open, or by a draw)

    def record(self, position: int, token: torch.Tensor) -> None:
        """The token drawn at position (a 0-d tensor on the device: no copy to the host)."""
        if position < self.capacity:
            self.tokens[position] = token
            self.known = max(self.known, position + 1)


@dataclass(frozen=True)
class Logprobs:
    """A drawn token's log-probability (log-softmax of the raw logits, float32) and the top ones at its
    position, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Drawn:
    token: int
    logprobs: Logprobs | None = None


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


def process(logits: torch.Tensor, params: list[Sampling], positions: list[int],
            histories: list[TokenHistory | None] | None = None) -> torch.Tensor:
    """The logits after logit_bias, the penalties and the suppression of end tokens, row by row (a copy;
    temperature and the filters come later). Rows whose params ask for none are returned as they are."""
    x = logits.float().clone()
    device = x.device
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for token, value in p.logit_bias:
            rows.append(i)
            ids.append(token)
            values.append(value)
    if rows:
        x.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                     torch.tensor(values, dtype=x.dtype, device=device), accumulate=True)
    penalised = [i for i, p in enumerate(params) if p.penalised]
    if penalised:
        if histories is None or any(histories[i] is None for i in penalised):
            raise ValueError("a penalty needs the session's token history (OpenSession's token_history)")
        _penalise(x, params, positions, histories)
    rows, ids = [], []
    for i, (p, pos) in enumerate(zip(params, positions, strict=True)):
        if p.suppress_ids and pos < p.suppress_until:
            rows.extend([i] * len(p.suppress_ids))
            ids.extend(p.suppress_ids)
    if rows:
        x.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                     torch.tensor(float("-inf"), device=device))
    return x


def _penalise(x: torch.Tensor, params: list[Sampling], positions: list[int],
              histories: list[TokenHistory | None]) -> None:
    """Repetition (transformers' RepetitionPenaltyLogitsProcessor, over prompt and generated tokens), then
    presence and frequency (OpenAI's, over the generated tokens) on every row of x in place (a row without a
    penalty is left as it is: penalty 1, nothing seen). The tokens seen and their counts are built on the device by
    one scatter over every penalised row's history: no gather or scatter of rows, no loop over tokens."""
    device, vocab, n = x.device, x.shape[-1], len(params)
    ends = [min(pos, h.capacity) if p.penalised else 0
            for p, pos, h in zip(params, positions, histories, strict=True)]
    starts = [min(h.prompt_length, end) if h is not None else 0 for h, end in zip(histories, ends, strict=True)]
    taken = [i for i in range(n) if ends[i]]
    # output_size: known here, so that the device is not asked (no sync on CUDA)
    seen_ids = torch.cat([histories[i].tokens[: ends[i]] for i in taken]) if taken else x.new_zeros(0, dtype=torch.long)
    seen_rows = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(ends, device=device),
                                        output_size=sum(ends))
    gen_lengths = [e - s for s, e in zip(starts, ends, strict=True)]
    gen_ids = (torch.cat([histories[i].tokens[starts[i]: ends[i]] for i in taken]) if taken
               else x.new_zeros(0, dtype=torch.long))
    gen_rows = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(gen_lengths, device=device),
                                       output_size=sum(gen_lengths))
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        seen[seen_rows, seen_ids] = True
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=device)[:, None]
        x.copy_(torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x))
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = torch.zeros(n, vocab, dtype=x.dtype, device=device)
        counts.index_put_((gen_rows, gen_ids), torch.ones((), dtype=x.dtype, device=device).expand(len(gen_ids)),
                          accumulate=True)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=device)[:, None]
        x.sub_(frequency * counts + presence * (counts > 0).to(x.dtype))


def draw_rows(logits: torch.Tensor, params: list[Sampling], positions: list[int],
              histories: list[TokenHistory | None] | None = None) -> list[Drawn | NotFinite]:
    """One token per row of logits [S, vocab] (float32, on any device), row i drawn by params[i] at
    positions[i] (reading histories[i] for penalties, and recording its token there); a sampled row whose
    probabilities are not finite gets NotFinite in its place."""
    if all(p.greedy and p.plain for p in params):
        chosen = logits.argmax(dim=-1)
        _record(chosen, positions, histories)
        return [Drawn(t) for t in chosen.tolist()]
    device = logits.device
    x = logits if all(p.plain for p in params) else process(logits, params, positions, histories)
    greedy = torch.tensor([p.greedy for p in params], device=device)
    best = x.argmax(dim=-1)
    if all(p.greedy for p in params):
        chosen = best
        finite = torch.ones_like(best, dtype=torch.bool)
    else:
        chosen, finite = _sample(x, params, positions)
        chosen = torch.where(greedy, best, chosen)
    _record(chosen, positions, histories)
    tokens = torch.where(finite | greedy, chosen, -1).tolist()
    logprobs = _logprobs(logits, params, chosen)
    return [NotFinite("the logits of this row are not finite numbers") if t < 0 else Drawn(t, lp)
            for t, lp in zip(tokens, logprobs, strict=True)]


def warp(x: torch.Tensor, params: list[Sampling]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, row by row: the logits the draw is made from (shifted so that each
    row's best is 0; those filtered out -inf). Greedy rows go through with temperature 1."""
    device, vocab = x.device, x.shape[-1]
    temperature = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, device=device)
    # Shift first: the best logit becomes 0, so a tiny temperature gives -inf for the others, not inf - inf.
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature[:, None]
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
    if any(p.min_p for p in params):  # transformers' MinPLogitsWarper: below min_p x the top probability goes
        probs = torch.softmax(x, dim=-1)
        floor = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)[:, None]
        x = x.masked_fill(probs < floor * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return x


def _sample(x: torch.Tensor, params: list[Sampling], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw from the warped logits: each row's token, and whether its probabilities were finite (a greedy
    row's token is the caller's argmax)."""
    device, vocab = x.device, x.shape[-1]
    cdf = torch.softmax(warp(x, params), dim=-1).cumsum(-1)  # [S, vocab]
    u = torch.tensor([uniform(p.seed, pos) for p, pos in zip(params, positions, strict=True)],
                     dtype=torch.float32, device=device)
    # The first token whose cumulative mass reaches u of the row's total: never one of mass 0.
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=vocab - 1)[:, 0]
    return chosen, torch.isfinite(cdf[:, -1])


def _record(chosen: torch.Tensor, positions: list[int], histories: list[TokenHistory | None] | None) -> None:
    if histories:
        for i, (pos, history) in enumerate(zip(positions, histories, strict=True)):
            if history is not None:
                history.record(pos, chosen[i])


def _logprobs(logits: torch.Tensor, params: list[Sampling], chosen: torch.Tensor) -> list[Logprobs | None]:
    """The chosen tokens' log-probabilities (and the top ones) of the rows that asked, from the raw logits."""
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if not rows:
        return [None] * len(params)
    index = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[index].float(), dim=-1)
    picked = lp.gather(1, chosen[index][:, None])[:, 0].tolist()
    n = max(params[i].top_logprobs for i in rows)
    top_values, top_ids = torch.topk(lp, n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out: list[Logprobs | None] = [None] * len(params)
    for j, i in enumerate(rows):
        k = params[i].top_logprobs
        out[i] = Logprobs(picked[j], tuple(zip(top_ids[j][:k], top_values[j][:k], strict=True)))
    return out


def draw(logits: torch.Tensor, params: list[Sampling], positions: list[int],
         histories: list[TokenHistory | None] | None = None) -> list[int | NotFinite]:
    """draw_rows' tokens only."""
    return [d if isinstance(d, NotFinite) else d.token for d in draw_rows(logits, params, positions, histories)]


def sample(logits: torch.Tensor, params: Sampling, position: int, history: TokenHistory | None = None) -> int:
    """logits: [vocab], float32. position: the sequence position of the token being drawn."""
    token = draw(logits[None], [params], [position], [history])[0]
    if isinstance(token, NotFinite):
        raise token
    return token


def sample_rows(logits: torch.Tensor, params: list[Sampling | None], positions: list[int],
                histories: list[TokenHistory | None] | None = None) -> list[Drawn | None | Exception]:
    """A pass's tokens: logits [S, vocab] on the device (float32), one Sampling (None: no sample), the position
    of the token drawn and the session's TokenHistory (None: no penalties) per row. The rows are drawn together;
    should that fail, one at a time, so that a row's error stays in its own slot."""
    tokens: list[Drawn | None | Exception] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p is not None]
    if not rows:
        return tokens
    histories = histories or [None] * len(params)
    picked = logits if len(rows) == len(params) else logits[rows]
    try:
        drawn: list[Drawn | Exception] = draw_rows(picked, [params[i] for i in rows], [positions[i] for i in rows],
                                                   [histories[i] for i in rows])
    except Exception:  # which row? each alone, so that only its own fails
        drawn = []
        for j, i in enumerate(rows):
            try:
                drawn.append(draw_rows(picked[j: j + 1], [params[i]], [positions[i]], [histories[i]])[0])
            except Exception as exc:  # this row's failure, not the pass's
                drawn.append(exc)
    for i, token in zip(rows, drawn, strict=True):
        tokens[i] = token
    return tokens
