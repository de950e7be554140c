"""The sampler alone: top-k / top-p keep the right tokens; draws depend only on the seed."""

import torch

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
