"""A pass's rows drawn together on the logits' device: each row as if drawn alone, the draw a function of (seed,
position) only, top-k, top-p, min-p and the repetition penalty doing what transformers' logits processors do,
presence and frequency penalties OpenAI's formula, penalties reading the session's tokens by position only,
frequencies as the probabilities say, and a row that cannot be drawn failing alone."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stagemesh.stage_server.engine.sampling import (
    NotFinite,
    Sampling,
    TokenHistory,
    draw,
    draw_rows,
    process,
    sample,
    sample_rows,
    uniform,
    warp,
)

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


def history(ids: list[int], prompt_length: int) -> TokenHistory:
    return TokenHistory(ids, prompt_length, 64)


@pytest.mark.parametrize("penalty", [1.3, 0.6, 2.0])
def test_repetition_penalty_equals_transformers_processor(penalty):
    x = logits(3, seed=4)
    seqs = [[3, 7, 7, 12, 40], [0, 1, 2], [9, 9, 9, 9, 30, 31]]
    got = process(x, [Sampling(repetition_penalty=penalty)] * 3, [len(s) for s in seqs],
                  [history(s, 2) for s in seqs])
    for i, seq in enumerate(seqs):  # prompt and generated tokens alike
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seq]), x[i: i + 1].clone())[0]
        torch.testing.assert_close(got[i], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.9])
def test_min_p_keeps_what_transformers_min_p_warper_keeps(min_p):
    x = logits(4, seed=5)
    for temperature in (1.0, 0.7):
        ours = warp(x, [Sampling(temperature, min_p=min_p, seed=1)] * 4)
        theirs = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, x.clone()))
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
        torch.testing.assert_close(torch.softmax(ours, -1), torch.softmax(theirs, -1), rtol=0, atol=1e-6)


def test_presence_and_frequency_penalties_follow_openai_over_generated_tokens_only():
    x = logits(2, seed=6)
    prompt, generated = [4, 4, 5], [5, 6, 6, 6, 8]
    params = [Sampling(presence_penalty=0.5, frequency_penalty=0.25), Sampling(presence_penalty=-1.0)]
    got = process(x, params, [8, 8], [history(prompt + generated, 3)] * 2)
    counts = torch.bincount(torch.tensor(generated), minlength=VOCAB).float()
    for i, p in enumerate(params):
        expected = x[i] - counts * p.frequency_penalty - (counts > 0).float() * p.presence_penalty
        torch.testing.assert_close(got[i], expected, rtol=0, atol=1e-6)
    assert got[0, 4] == x[0, 4]  # a prompt token is no generated token


def test_penalties_read_the_tokens_before_the_position_only():
    """A draw at position p reads positions 0..p-1 of the history, whatever was written past them (a rewound
    session, a replayed step): the same as a history that never had them."""
    x = logits(1, seed=7)
    p = Sampling(presence_penalty=1.0, frequency_penalty=1.0, repetition_penalty=1.5)
    longer = history([1, 2, 3, 10, 11, 12, 13], 3)
    shorter = history([1, 2, 3, 10, 11], 3)
    assert torch.equal(process(x, [p], [5], [longer]), process(x, [p], [5], [shorter]))
    # and a drawn token is recorded at its position, overwriting what a rewound session had there
    drawn = draw_rows(x, [Sampling(logit_bias=((33, 100.0),))], [5], [longer])[0]
    assert drawn.token == 33 and longer.tokens[5].item() == 33


def test_processing_applies_bias_then_penalties_then_suppression():
    x = torch.zeros(1, VOCAB)
    p = Sampling(repetition_penalty=2.0, logit_bias=((3, 4.0), (4, -4.0)), suppress_ids=(5,), suppress_until=10)
    got = process(x, [p], [3], [history([3, 4, 7], 3)])[0]
    assert got[3] == 2.0 and got[4] == -8.0 and got[7] == 0.0 and got[5] == float("-inf")
    later = process(x, [p], [10], [history([3, 4, 7], 3)])[0]
    assert later[5] == 0.0  # at and past suppress_until, the id is free


def test_greedy_takes_the_argmax_of_the_processed_logits_and_logprobs_of_the_raw_ones():
    x = logits(2, seed=8)
    biased = Sampling(logit_bias=((int(x[0].argmin()), 100.0),), logprobs=True, top_logprobs=3)
    got = draw_rows(x, [biased, Sampling(logprobs=True)], [0, 0])
    assert got[0].token == int(x[0].argmin()) and got[1].token == int(x[1].argmax())
    raw = torch.log_softmax(x, -1)
    assert abs(got[0].logprobs.logprob - raw[0, got[0].token].item()) < 1e-6
    values, ids = torch.topk(raw[0], 3)
    assert [t for t, _ in got[0].logprobs.top] == ids.tolist()
    assert got[1].logprobs.top == ()


def test_a_batch_with_processing_equals_each_row_drawn_alone():
    x = logits(6, seed=9)
    hist = [history([1, 2, 3, 4, 4, 9], 3) for _ in range(6)]
    params = [Sampling(), Sampling(0.8, seed=1, min_p=0.1), Sampling(1.0, top_k=5, seed=2, repetition_penalty=1.4),
              Sampling(1.2, top_p=0.8, seed=3, presence_penalty=1.0, logprobs=True, top_logprobs=2),
              Sampling(0.9, seed=4, logit_bias=((7, 5.0),), suppress_ids=(0, 1), suppress_until=9),
              Sampling(frequency_penalty=-0.5, logprobs=True)]
    positions = [6] * 6
    together = draw_rows(x, params, positions, hist)
    alone = [draw_rows(x[i: i + 1], [params[i]], [6], [hist[i]])[0] for i in range(6)]
    assert [d.token for d in together] == [d.token for d in alone]
    for a, b in zip(together, alone, strict=True):
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert abs(a.logprobs.logprob - b.logprobs.logprob) < 1e-6


def test_a_penalty_without_a_history_fails_its_row_only():
    x = logits(2)
    tokens = sample_rows(x, [Sampling(presence_penalty=1.0), Sampling()], [3, 3])
    assert isinstance(tokens[0], ValueError) and tokens[1].token == int(x[1].argmax())


@pytest.mark.parametrize("bad", [dict(min_p=-0.1), dict(presence_penalty=2.5), dict(repetition_penalty=-1.0),
                                 dict(logit_bias=((1, 200.0),)), dict(top_logprobs=3), dict(top_logprobs=21,
                                                                                            logprobs=True)])
def test_out_of_range_processing_is_refused(bad):
    from stagemesh.request_limits import InvalidSampling

    with pytest.raises(InvalidSampling):
        Sampling(**bad)
