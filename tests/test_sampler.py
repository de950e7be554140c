"""The sampler alone: top-k / top-p keep the right tokens; draws depend only on the seed."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from tierserve.errors import InvalidRequestError
from tierserve.sampling_params import SamplingParams
from tierserve.worker.sampler import SamplingState, sample


def state(seed=0, **kw):
    return SamplingState(SamplingParams(**kw), torch.Generator().manual_seed(seed))


def test_top_k_and_top_p_only_pick_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for seed in range(200):
        (k,) = sample(logits.clone(), [state(seed, temperature=1.0, top_k=2)], [0])
        assert k in (0, 1)
        (p,) = sample(logits.clone(), [state(seed, temperature=1.0, top_p=0.7)], [0])
        assert p in (0, 1)                                 # 0.5 + 0.3 reaches 0.7


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = [0, 0, 0]
    for seed in range(2000):
        counts[sample(logits.clone(), [state(seed, temperature=1.0)], [0])[0]] += 1
    assert 1250 < counts[0] < 1550 and 300 < counts[1] < 500 and 120 < counts[2] < 280


def test_min_tokens_bans_eos_and_greedy_ignores_seed():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    s = state(0, temperature=0.0, min_tokens=2)
    s.banned_before_min = [0]
    assert sample(logits.clone(), [s], [0]) == [1]
    assert sample(logits.clone(), [s], [2]) == [0]


def test_a_rows_draw_does_not_depend_on_its_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(5, 100)
    alone = sample(logits[2:3].clone(), [state(42, temperature=0.8, top_p=0.95)], [0])
    batch = sample(logits.clone(), [state(i, temperature=1.0) for i in range(2)]
                   + [state(42, temperature=0.8, top_p=0.95)]
                   + [state(9, temperature=0.0), state(5, temperature=2.0, top_k=3)],
                   [0] * 5)
    assert batch[2] == alone[0]


def made(seed=0, prompt=(), vocab=4, **kw):
    return SamplingState.create(SamplingParams(**kw), torch.Generator().manual_seed(seed), [],
                                vocab, list(prompt))


def test_logit_bias_bans_and_forces_tokens():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    assert sample(logits.clone(), [made(temperature=0.0, logit_bias={0: -100.0})], [0]) == [1]
    assert sample(logits.clone(), [made(temperature=0.0, logit_bias={3: 100.0})], [0]) == [3]
    for seed in range(50):  # a banned token is never drawn
        (t,) = sample(logits.clone(), [made(seed, temperature=1.0, logit_bias={0: -100.0})], [0])
        assert t != 0


def test_frequency_and_presence_penalties_as_specified():
    """frequency: minus count x penalty; presence: minus the penalty once (OpenAI's
    definition), applied to greedy decoding too; other rows are untouched."""
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0], [3.0, 2.5, 0.0, 0.0]])
    freq = made(temperature=0.0, frequency_penalty=0.3)
    plain = made(temperature=0.0)
    assert sample(logits.clone(), [freq, plain], [0, 0]) == [0, 0]
    assert sample(logits.clone(), [freq, plain], [1, 1]) == [0, 0]   # 3.0 - 0.3 > 2.5
    assert sample(logits.clone(), [freq, plain], [2, 2]) == [1, 0]   # 3.0 - 0.6 < 2.5
    pres = made(temperature=0.0, presence_penalty=0.6)
    x = logits[:1].clone()
    assert sample(x, [pres], [0]) == [0] and x[0, 0] == 3.0
    x = logits[:1].clone()
    assert sample(x, [pres], [1]) == [1] and x[0, 0] == pytest.approx(2.4)
    x = logits[:1].clone()                         # once, however often it came
    assert sample(x, [pres], [2]) == [0] and x[0, 0] == pytest.approx(2.4)
    assert x[0, 1] == pytest.approx(1.9)


def test_repetition_penalty_covers_the_prompt_and_both_signs():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2]])
    s = made(temperature=0.0, repetition_penalty=1.5, prompt=[0, 2])
    x = logits.clone()
    assert sample(x, [s], [0]) == [1]              # 2.0 / 1.5 < 1.5
    assert x[0, 2] == pytest.approx(-1.5) and x[0, 3] == pytest.approx(-1.2)


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.06, 0.04]]))
    for seed in range(300):
        (t,) = sample(logits.clone(), [made(seed, temperature=1.0, min_p=0.2)], [0])
        assert t in (0, 1)                         # 0.06 < 0.2 x 0.6


def test_penalised_rows_keep_their_draw_whatever_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(3, 50)
    kw = dict(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.2,
              repetition_penalty=1.2, min_p=0.05, logit_bias={7: 2.0})
    alone = made(11, prompt=[1, 2, 3], vocab=50, **kw)
    mixed = made(11, prompt=[1, 2, 3], vocab=50, **kw)
    a = [sample(logits[1:2].clone(), [alone], [i])[0] for i in range(5)]
    b = [sample(logits.clone(), [made(i, vocab=50, temperature=1.0), mixed,
                                 made(9, vocab=50, temperature=0.0)], [i] * 3)[1]
         for i in range(5)]
    assert a == b


def test_sampling_parameters_are_checked():
    for bad in [dict(min_p=1.5), dict(presence_penalty=3), dict(frequency_penalty=-2.5),
                dict(repetition_penalty=0), dict(logit_bias={1: 200.0})]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**bad)
        assert e.value.param == next(iter(bad))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.05, 1.0), min_size=1, max_size=6), st.floats(0.05, 8.0),
       st.integers(0, 2**31 - 1))
def test_top_p_keeps_the_nucleus_a_full_sort_keeps(top_ps, spread, seed):
    # the sampler looks among the top k first and grows k; a flat row (small spread)
    # needs the whole vocabulary, a peaked one a few tokens; a row at top_p 1 keeps all
    from tierserve.worker.sampler import _apply_top_p

    gen = torch.Generator().manual_seed(seed)
    probs = (torch.randn(len(top_ps), 5000, generator=gen) * spread).softmax(dim=-1)
    kept = _apply_top_p(probs, top_ps)
    p = torch.tensor(top_ps).unsqueeze(1)
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered
    want = torch.zeros_like(probs).scatter_(1, order, ordered.masked_fill(before >= p, 0.0))
    assert torch.equal(kept[kept > 0], probs[kept > 0])  # kept tokens keep their mass
    for i, tp in enumerate(top_ps):
        if tp >= 1.0:  # (the sort's float cumsum can reach 1 before the last token)
            assert torch.equal(kept[i], probs[i])
        else:
            assert int((kept[i] > 0).sum()) == int((want[i] > 0).sum())
            assert abs(float(kept[i].sum()) - float(want[i].sum())) <= 1e-5


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 9), st.integers(1, 300), st.integers(0, 2**31 - 1),
       st.sampled_from(["plain", "ties", "banned", "nan"]))
def test_greedy_takes_the_first_largest_logit_as_torch_does(rows, width, seed, kind):
    # the CPU kernel (where built) against torch.max: rows of any width (vector body and
    # tail), many ties (values rounded to a few levels), whole rows banned to -inf, NaN
    from tierserve.worker.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=gen)
    if kind == "ties":
        logits = logits.round()
    elif kind == "banned":
        logits[torch.rand(rows, width, generator=gen) < 0.7] = float("-inf")
        logits[0] = float("-inf")
    elif kind == "nan":
        logits[torch.rand(rows, width, generator=gen) < 0.05] = float("nan")
    assert torch.equal(greedy_tokens(logits), logits.max(dim=-1).indices)


def _draws_follow_the_nucleus(logits, temperature: float, top_p: float, n: int = 2000) -> None:
    """n evenly spaced uniforms through the sampling kernel over one row hit each token
    about n x its probability (softmax at the temperature, cut to the top_p nucleus a full
    sort keeps, renormalized), whatever order the kernel walks the kept tokens in; a
    token outside the nucleus, or banned to -inf, never. Against a float64 reference."""
    from tierserve.model import kernels

    kernel = kernels.load()
    if kernel is None:
        pytest.skip("the CPU kernels are not built here")
    width = logits.shape[0]
    picks = kernel.sample_rows(logits.expand(n, width).contiguous(),
                               torch.full((n,), temperature), torch.full((n,), top_p),
                               (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float())
    counts = torch.bincount(picks, minlength=width).double()
    probs = (logits.double() / temperature).softmax(dim=-1)
    order = sorted(range(width), key=lambda i: (-float(probs[i]), i))
    kept, before, unsure, last = torch.zeros(width, dtype=torch.float64), 0.0, False, None
    for i in order:
        if top_p < 1.0 and abs(before - top_p) < 1e-5:
            unsure = True  # at the nucleus' edge float rounding may decide either way
        if before < top_p or top_p >= 1.0:
            kept[i], last = probs[i], i
        elif float(probs[i]) >= float(probs[last]) * (1 - 1e-6):
            unsure = True  # tied with the last kept one: which of them is kept is a tie's
        before += float(probs[i])                # break (the kernel's exp may differ by an ulp)
    assert all(counts[i] == 0 for i in range(width) if logits[i] == float("-inf"))
    if unsure:  # (which renormalizes every other token's share): only what is drawn
        return
    want = kept / kept.sum() * n
    for i in range(width):
        if kept[i] == 0:
            assert counts[i] == 0, (i, float(probs[i]))
        else:
            assert abs(counts[i] - want[i]) <= 2 + 1e-3 * n, (i, counts[i], want[i])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.floats(0.05, 3.0), st.floats(0.05, 1.0),
       st.integers(0, 2**31 - 1), st.sampled_from(["plain", "ties", "banned"]))
def test_the_sampling_kernel_draws_each_token_as_often_as_its_probability(
        width, temperature, top_p, seed, kind):
    # model/cpu_sample.py: rows of any width, peaked or flat, with ties and banned tokens
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(width, generator=gen) * 3
    if kind == "ties":
        logits = logits.round()
    elif kind == "banned":
        logits[torch.rand(width, generator=gen) < 0.6] = float("-inf")
        logits[int(torch.randint(width, (1,), generator=gen))] = 0.5
    _draws_follow_the_nucleus(logits, temperature, top_p)


def test_the_sampling_kernel_keeps_every_token_of_wide_flat_nuclei():
    # flat rows of 100-300 tokens put hundreds of candidates through the kernel's
    # weighted selection, so every way it can end (the boundary found in a partition's
    # pivot, among the larger ones, or in the last sort) is taken, with each kept token
    # likely enough to be counted
    gen = torch.Generator().manual_seed(3)
    for _ in range(120):
        width = int(torch.randint(100, 300, (1,), generator=gen))
        top_p = float(torch.rand(1, generator=gen)) * 0.6 + 0.3
        _draws_follow_the_nucleus(torch.randn(width, generator=gen) * 0.5, 1.0, top_p)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_kernel_and_torch_draw_the_same_token_for_the_same_uniform(top_p):
    # both walk the kept tokens in vocabulary order to where the running sum reaches u
    # times their mass, so a seeded request draws what it drew before the kernel (all but
    # a draw that float rounding moves across a boundary)
    from tierserve.worker.sampler import _sample_torch

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 1000, generator=gen)
    u = torch.rand(64, generator=gen).clamp_min(1e-6)
    params = [SamplingParams(temperature=1.0, top_p=top_p) for _ in range(64)]
    ref = _sample_torch(logits.clone(), params, u)
    from tierserve.model import kernels

    kernel = kernels.load()
    if kernel is None:
        pytest.skip("the CPU kernels are not built here")
    got = kernel.sample_rows(logits.clone(), torch.ones(64), torch.full((64,), top_p), u)
    assert int((got == ref).sum()) >= 63
