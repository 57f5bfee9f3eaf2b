"""A pass's rows drawn together on the logits' device: each row as if drawn alone, the draw a function of (seed,
position) only, top-k and top-p keeping what transformers' logits processors keep, frequencies as the
probabilities say, and a row that cannot be drawn failing alone."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from stagemesh.stage_server.engine.sampling import NotFinite, Sampling, draw, sample, sample_rows, uniform

VOCAB = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_a_batch_of_mixed_rows_equals_each_row_drawn_alone():
    x = logits(6)
    params = [Sampling(), Sampling(0.7, seed=1), Sampling(1.0, top_k=5, seed=2), Sampling(1.3, top_p=0.8, seed=3),
              Sampling(0.9, top_k=10, top_p=0.5, seed=4), Sampling(1e-40, seed=5)]
    positions = [3, 10, 11, 12, 400, 7]
    together = draw(x, params, positions)
    assert together == [sample(x[i], p, pos) for i, (p, pos) in enumerate(zip(params, positions, strict=True))]
    assert together[0] == int(x[0].argmax()) and together[5] == int(x[5].argmax())  # greedy, and as good as it


def test_the_draw_is_a_function_of_seed_and_position_only():
    x = logits(1)[0]
    p = Sampling(1.0, seed=42)
    at_9 = sample(x, p, 9)
    assert all(sample(x, p, 9) == at_9 for _ in range(5))
    # The same row among other rows, at another place in the batch: the same token.
    others = logits(4, seed=1)
    batch = torch.cat([others[:2], x[None], others[2:]])
    assert draw(batch, [Sampling(1.0, seed=s) for s in (1, 2)] + [p] + [Sampling(0.5, seed=3), Sampling()],
                [1, 2, 9, 3, 4])[2] == at_9
    # Seeds and positions spread: 200 draws over a flat distribution do not repeat one token.
    flat = torch.zeros(VOCAB)
    assert len({sample(flat, Sampling(1.0, seed=s), 9) for s in range(200)}) > VOCAB // 2
    assert len({sample(flat, p, pos) for pos in range(200)}) > VOCAB // 2
    assert len({uniform(7, pos) for pos in range(1000)}) == 1000 and all(0 < uniform(7, p) < 1 for p in range(1000))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 5, 1.0), (0.7, 0, 0.6), (1.5, 12, 0.9), (1.0, 1, 1.0)])
def test_only_what_transformers_logits_processors_keep_is_ever_drawn(temperature, top_k, top_p):
    x = logits(1, seed=5)
    warped = TemperatureLogitsWarper(temperature)(None, x.clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    kept = set(torch.isfinite(warped[0]).nonzero().flatten().tolist())
    drawn = {sample(x[0], Sampling(temperature, top_k, top_p, seed=s), 0) for s in range(300)}
    assert drawn <= kept
    assert drawn == kept or len(kept) > 20  # with 300 draws every kept token of a short list shows


def test_frequencies_follow_the_probabilities():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 4000
    counts = torch.bincount(torch.tensor([sample(x, Sampling(1.0, seed=s), 0) for s in range(n)]), minlength=4)
    for got, want in zip((counts / n).tolist(), [0.5, 0.3, 0.15, 0.05], strict=True):
        assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / n), counts  # within 4 standard deviations


def test_a_row_that_cannot_be_drawn_fails_alone():
    x = logits(3)
    x[1, 4] = float("nan")
    tokens = sample_rows(x, [Sampling(1.0, seed=1), Sampling(1.0, seed=2), None], [0, 0, 0])
    assert tokens[0].token == sample(x[0], Sampling(1.0, seed=1), 0)
    assert isinstance(tokens[1], NotFinite) and tokens[2] is None
    with pytest.raises(NotFinite):
        sample(x[1], Sampling(1.0, seed=2), 0)
