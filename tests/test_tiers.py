"""Service tiers in the scheduler, with a fake runner (no torch): preemption for slots and
blocks, the step-time cap, reserves, aging, the flex wait limit, victims, wasted work."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import (FakeRunner, check_scheduler_invariants, make_requests, make_scheduler,
                      run_to_completion)
from tierserve.config import SchedulerConfig
from tierserve.core.block_manager import BlockManager
from tierserve.core.request import Request, RequestStatus
from tierserve.core.scheduler import SchedulerOutput
from tierserve.core.step_time import FEATURES, StepTimeModel
from tierserve.core.tier_rules import StepCaps, victim
from tierserve.tiers import Tier

P, D, F, B = Tier.PRIORITY, Tier.DEFAULT, Tier.FLEX, Tier.BATCH


def step(s, now=0.0):
    out = s.schedule(now)
    s.update(out, FakeRunner().execute(out))
    return out


def ids(out):
    return [x.request_id for x in out.seqs]


def test_priority_arrival_preempts_a_lower_tier_when_max_num_seqs_is_full():
    s = make_scheduler(policy="tiered", max_num_seqs=2, max_num_batched_tokens=100)
    for r in make_requests(2, max_tokens=50, tier=D):
        s.add_request(r)
    step(s)
    (p,) = make_requests(1, start=9, tier=P, arrival_time=5.0)
    s.add_request(p)
    out = step(s)
    assert "r9" in ids(out) and out.preempted_ids == ["r1"]  # the later default arrival
    assert s.requests["r1"].status == RequestStatus.PREEMPTED


def test_strict_priority_cannot_preempt_for_a_slot():
    """vLLM's gap: with every slot taken, a waiting priority request waits."""
    s = make_scheduler(policy="priority", max_num_seqs=2, max_num_batched_tokens=100)
    for r in make_requests(2, max_tokens=50, tier=D):
        s.add_request(r)
    step(s)
    s.add_request(make_requests(1, start=9, tier=P, arrival_time=5.0)[0])
    out = step(s)
    assert "r9" not in ids(out) and not out.preempted_ids


def test_priority_preempts_lower_tiers_for_kv_blocks():
    # 12 blocks of 4 tokens: two 20-token default requests hold 10 of them.
    s = make_scheduler(policy="tiered", num_blocks=12, max_num_batched_tokens=100)
    for r in make_requests(2, prompt_len=20, max_tokens=30, tier=D):
        s.add_request(r)
    step(s)
    s.add_request(make_requests(1, start=9, prompt_len=12, tier=P, arrival_time=5.0)[0])
    out = step(s)
    assert "r9" in ids(out) and out.preempted_ids
    assert all(s.requests[i].tier == D for i in out.preempted_ids)


def test_victim_is_lowest_tier_then_fewest_computed_tokens():
    s = make_scheduler(policy="tiered", max_num_seqs=4, max_num_batched_tokens=200)
    d_long, d_short = make_requests(2, prompt_len=40, max_tokens=50, tier=D)
    d_short.prompt_token_ids = d_short.prompt_token_ids[:8]
    (f,) = make_requests(1, start=2, prompt_len=40, max_tokens=50, tier=F)
    for r in (d_long, d_short, f):
        s.add_request(r)
    step(s)
    chosen = victim(s.policy, make_requests(1, start=5, tier=P)[0], s.running, waiting=True)
    assert chosen is f  # flex goes first, although it computed more than d_short
    s.finish_request(f.request_id, RequestStatus.FINISHED_ABORTED)
    chosen = victim(s.policy, make_requests(1, start=5, tier=P)[0], s.running, waiting=True)
    assert chosen is d_short  # same tier: least progress lost
    assert d_short.num_computed_tokens < d_long.num_computed_tokens


def test_step_time_cap_applies_while_priority_runs_and_lifts_after_the_guard():
    model = StepTimeModel(fixed_s=0.010, per_seq_s=0.001, per_token_s=0.001)
    s = make_scheduler(policy="tiered", max_num_batched_tokens=256, num_blocks=256,
                       step_time_model=model, step_time_limit_s=0.040, priority_guard_s=5.0)
    (p,) = make_requests(1, prompt_len=8, max_tokens=4, tier=P)
    (d,) = make_requests(1, start=1, prompt_len=400, max_tokens=2, tier=D)
    s.add_request(p)
    s.add_request(d)
    capped, t = [], 0.0
    while p.status != RequestStatus.FINISHED_LENGTH:
        out = step(s, now=t)
        chunk = {x.request_id: len(x.token_ids) for x in out.seqs}
        assert chunk["r0"] in (1, 8)  # priority is never cut
        predicted = model.predict_s([(len(x.token_ids), x.start_pos + len(x.token_ids))
                                     for x in out.seqs])
        assert predicted <= 0.040 + 1e-12
        capped.append(chunk.get("r1", 0))
        t += 1.0
    # fixed 10 ms + priority's 2 ms decode leaves 28 ms: chunks of 27 tokens
    assert capped[1:] and all(c == 27 for c in capped[1:])
    # priority left at t - 1: within the 5 s guard, steps keep to the decode cap (2.5 x
    # 40 ms), so a priority arrival waits for at most one such step and the prompt is not
    # cut into chunks that are mostly the step's fixed time
    out = step(s, now=t + 3.5)
    assert len(out.seqs[0].token_ids) == 89  # 10 + 1 + 89 = 100 ms
    out = step(s, now=t + 6.0)  # the guard has passed: the cap lifts
    assert len(out.seqs[0].token_ids) > 89


@pytest.mark.parametrize("streams, prompts", [(12, 0), (1, 6)])
def test_in_the_guard_no_lower_tier_decode_is_cut_and_no_burst_lifts_the_cap(streams, prompts):
    """After the last priority request left, within priority_guard_s, steps keep to the
    decode cap (2.5 x the 30 ms priority cap) by its rules: every stream decodes each step
    (12 streams predict 34 ms alone, over the priority cap, which would cut two of them),
    and a burst of long prompts beside one stream is cut to the cap instead of taking the
    whole budget as it would with no priority request about, so a priority arrival waits
    for one step of at most 75 ms."""
    model = StepTimeModel(fixed_s=0.010, per_seq_s=0.001, per_token_s=0.001)
    s = make_scheduler(policy="tiered", max_num_batched_tokens=256, num_blocks=1024,
                       max_num_seqs=32, step_time_model=model, step_time_limit_s=0.030,
                       priority_guard_s=5.0)
    (p,) = make_requests(1, prompt_len=4, max_tokens=1, tier=P)
    reqs = make_requests(streams, start=1, prompt_len=4, max_tokens=50, tier=D)
    for r in [p, *reqs]:
        s.add_request(r)
    while p.status != RequestStatus.FINISHED_LENGTH or any(
            r.num_output_tokens == 0 for r in reqs):
        step(s, now=10.0)
    for r in make_requests(prompts, start=40, prompt_len=400, max_tokens=2, tier=D):
        s.add_request(r)
    out = step(s, now=12.0)
    got = {x.request_id: len(x.token_ids) for x in out.seqs}
    assert [got.get(r.request_id) for r in reqs] == [1] * streams
    predicted = model.predict_s([(len(x.token_ids), x.start_pos + len(x.token_ids))
                                 for x in out.seqs])
    assert predicted <= 0.075 + 1e-12
    if prompts:   # 10 ms fixed, 2 ms the stream's decode: the prompt gets 1 + 62 ms
        assert out.num_prefill_tokens == 62


@pytest.mark.parametrize("decode_cap, guard_s, expect", [
    (None, 5.0, 0.100), (0.060, 5.0, 0.060), (0.0, 5.0, 0.100), (None, 0.0, None)])
def test_the_guard_s_cap_and_the_next_priority_request_s_own_first_step(decode_cap, guard_s,
                                                                         expect):
    """The guard's cap: the decode cap if one is set, else 2.5 priority caps (the vLLM
    plugin's default has none); `priority_guard_s` 0: no guard. Either way the next
    priority arrival's first-token step is its own again, even where the last one ended
    in its own first-token step (so the every-other-step rule had just used its turn)."""
    caps = StepCaps()
    config = SchedulerConfig(decode_step_time_s=decode_cap, priority_guard_s=guard_s)
    assert caps.limit_s(0.0, config, 0.040, True, False) == (0.040, False)
    assert caps.starting(True)        # a priority request's first-token step; it ends there
    limit, decode_kind = caps.limit_s(1.0, config, 0.040, False, False)   # no decodes
    assert (limit, decode_kind) == ((expect, True) if expect else (None, False))
    assert caps.guarding == bool(expect)
    caps.limit_s(1.5, config, 0.040, True, False)                        # the next arrives
    assert caps.starting(True)


def test_cap_cuts_lower_tier_prefill_before_decodes():
    model = StepTimeModel(fixed_s=0.010, per_seq_s=0.001, per_token_s=0.001)
    s = make_scheduler(policy="tiered", max_num_batched_tokens=256, num_blocks=256,
                       step_time_model=model, step_time_limit_s=0.030)
    reqs = make_requests(5, prompt_len=4, max_tokens=20, tier=D)
    reqs[0].tier = P
    for r in reqs:
        s.add_request(r)
    while any(r.num_output_tokens == 0 for r in reqs):
        step(s)  # prefill everyone; then all decode
    s.add_request(make_requests(1, start=7, prompt_len=100, max_tokens=2, tier=D)[0])
    out = step(s)
    got = {x.request_id: len(x.token_ids) for x in out.seqs}
    # 10 fixed + 5 decodes x 2 ms = 20 ms; the prefill gets what is left: (10 - 1) tokens
    assert [got[r.request_id] for r in reqs] == [1] * 5 and got["r7"] == 9


def _long_prompt_among_streams(model, streams: int, decode_cap):
    """`streams` default requests decoding, then a 400-token default prompt arrives (r9;
    no priority request about): (the streams, tokens per request in the next step, it)."""
    s = make_scheduler(policy="tiered", max_num_batched_tokens=256, num_blocks=512,
                       max_num_seqs=32, step_time_model=model, step_time_limit_s=0.030,
                       decode_step_time_s=decode_cap)
    reqs = make_requests(streams, start=10, prompt_len=4, max_tokens=50, tier=D)
    for r in reqs:
        s.add_request(r)
    while any(r.num_output_tokens == 0 for r in reqs):
        step(s)
    s.add_request(make_requests(1, start=9, prompt_len=400, max_tokens=2, tier=D)[0])
    out = step(s)
    return reqs, {x.request_id: len(x.token_ids) for x in out.seqs}, out, s


@pytest.mark.parametrize("decode_cap", [None, 0.050, 0.0])
def test_steps_with_decodes_keep_to_the_decode_cap_without_priority(decode_cap):
    """No priority request about: a long default prompt arriving while others stream is
    cut so the step stays within decode_step_time_s (default 2.5 times the priority cap);
    0 turns that off and the prompt takes the whole budget."""
    model = StepTimeModel(fixed_s=0.010, per_seq_s=0.001, per_token_s=0.001)
    reqs, got, out, _ = _long_prompt_among_streams(model, 4, decode_cap)
    assert [got[r.request_id] for r in reqs] == [1] * 4            # no decode is cut
    limit = {None: 0.075, 0.050: 0.050, 0.0: None}[decode_cap]
    if limit is None:
        assert got["r9"] == 256 - 4                                 # the whole budget
    else:   # 10 ms fixed + 4 decodes x 2 ms = 18 ms; the prompt: 1 ms, then 1 ms a token
        predicted = model.predict_s([(len(x.token_ids), x.start_pos + len(x.token_ids))
                                     for x in out.seqs])
        assert predicted <= limit + 1e-12 and got["r9"] == round((limit - 0.018) / 0.001) - 1


def test_many_streams_over_the_decode_cap_still_let_a_prompt_in():
    """When the decodes alone predict more than the decode cap (many streams), a waiting
    prompt still gets a chunk: the step may reach twice the decodes' own time."""
    model = StepTimeModel(fixed_s=0.010, per_seq_s=0.001, per_token_s=0.001)
    reqs, got, _, _ = _long_prompt_among_streams(model, 20, 0.040)
    assert [got[r.request_id] for r in reqs] == [1] * 20           # no decode is cut
    # decodes alone: 10 ms + 20 x 2 ms = 50 ms, over the 40 ms cap; the step may take
    # 100 ms, so the prompt gets 1 ms + 1 ms a token of the other 50: 49 tokens
    assert got["r9"] == 49


def _two_streams_decoding(max_num_seqs: int, max_tokens: int):
    """A tiered scheduler (256-token budget, a 40 ms decode cap) with two default
    streams past their first token: (its model, it, the streams)."""
    model = StepTimeModel(fixed_s=0.010, per_seq_s=0.001, per_token_s=0.001)
    s = make_scheduler(policy="tiered", max_num_batched_tokens=256, num_blocks=512,
                       max_num_seqs=max_num_seqs, step_time_model=model,
                       step_time_limit_s=0.030, decode_step_time_s=0.040)
    streams = make_requests(2, start=10, prompt_len=4, max_tokens=max_tokens, tier=D)
    for r in streams:
        s.add_request(r)
    while any(r.num_output_tokens == 0 for r in streams):
        step(s, now=12.0)
    return model, s, streams


@pytest.mark.parametrize("max_num_seqs", [32, 3])
def test_a_burst_of_prompts_gets_a_stream_s_share_each_beside_few_streams(max_num_seqs):
    """More default prompts that could start than streams decoding (a burst beside the
    first streams): each prompt may take as much of a step as a stream, so the step may
    exceed the decode cap. Prompts no free slot could start do not count: with one slot
    left the cap holds as before."""
    model, s, streams = _two_streams_decoding(max_num_seqs, 50)
    burst = make_requests(6, start=20, prompt_len=400, max_tokens=2, tier=D)
    for r in burst:
        s.add_request(r)
    out = step(s)
    got = {x.request_id: len(x.token_ids) for x in out.seqs}
    assert [got[r.request_id] for r in streams] == [1, 1]
    predicted = model.predict_s([(len(x.token_ids), x.start_pos + len(x.token_ids))
                                 for x in out.seqs])
    if max_num_seqs == 32:
        # decodes alone: 10 ms + 2 x 2 ms = 14 ms; 6 prompts for 2 streams: the step may
        # take (1 + 3) x 14 = 56 ms, over the 40 ms cap; the first prompt: 1 ms, 41 tokens
        assert got["r20"] == 41 and predicted == pytest.approx(0.056)
        # r20 prefilling and five waiting: still 6 prompts, 56 ms, all r20's
        out = step(s)
        assert {x.request_id for x in out.seqs} == {"r10", "r11", "r20"}
        assert model.predict_s([(len(x.token_ids), x.start_pos + len(x.token_ids))
                                for x in out.seqs]) == pytest.approx(0.056)
    else:   # one slot: one prompt counts; the 40 ms cap (above 2 x 14 ms): 25 tokens
        assert got["r20"] == 25 and predicted == pytest.approx(0.040)


@pytest.mark.parametrize("max_num_seqs", [32, 7])
def test_a_burst_of_prompts_is_prefilled_first_until_it_is_in(max_num_seqs):
    """Four times as many default prompts that could start as streams decoding (a burst
    beside the first streams): the decode cap is off and the prompts take the whole token
    budget, the streams' decodes first in each step, until none of the burst's prompts is
    left. A prompt arriving meanwhile is not the burst's: once the burst is in, it keeps to
    the cap. Prompts no free slot could start do not count: with five slots left, five
    prompts beside two streams get a stream's share each."""
    model, s, streams = _two_streams_decoding(max_num_seqs, 80)
    burst = make_requests(8, start=20, prompt_len=400, max_tokens=2, tier=D,
                          arrival_time=50.0)
    for r in burst:
        s.add_request(r)
    out = step(s, now=50.0)
    got = {x.request_id: len(x.token_ids) for x in out.seqs}
    assert [got[r.request_id] for r in streams] == [1, 1]
    predicted = model.predict_s([(len(x.token_ids), x.start_pos + len(x.token_ids))
                                 for x in out.seqs])
    if max_num_seqs == 7:   # five prompts count: (1 + 5 / 2) x 14 ms = 49 ms; r20: 34
        assert got["r20"] == 34 and predicted == pytest.approx(0.049)
        return
    # the whole budget, 256 tokens less the two decodes
    assert got["r20"] == 254 and not out.refused_ids
    late = make_requests(1, start=40, prompt_len=600, max_tokens=2, tier=D,
                         arrival_time=60.0)[0]
    s.add_request(late)   # arrives within the burst: not one of its prompts
    steps = 1
    while any(r.num_output_tokens == 0 for r in burst):
        out = step(s, now=60.0)
        steps += 1
        got = {x.request_id: len(x.token_ids) for x in out.seqs}
        assert all(got[r.request_id] == 1 for r in streams)
        assert sum(got.values()) == 256   # no cap: the whole budget every step
    assert steps == 13 and late.num_computed_tokens < 600
    out = step(s, now=61.0)   # the burst is in; the late prompt keeps to the cap
    got = {x.request_id: len(x.token_ids) for x in out.seqs}
    decodes = [(1, x.start_pos + 1) for x in out.seqs if len(x.token_ids) == 1]
    predicted = model.predict_s([(len(x.token_ids), x.start_pos + len(x.token_ids))
                                 for x in out.seqs])
    assert 0 < got["r40"] < 256 - len(decodes)
    assert predicted <= max(0.040, 2 * model.predict_s(decodes)) + 1e-12


def test_a_burst_s_steps_place_the_decodes_first():
    """With no cap through a burst, a prompt that ranks ahead of the streams (here by its
    request priority) still leaves a token each for their decodes: the decodes go first."""
    _, s, streams = _two_streams_decoding(32, 80)
    burst = make_requests(8, start=20, prompt_len=1000, max_tokens=2, tier=D,
                          arrival_time=50.0)
    for r in burst:
        r.priority = -1
        s.add_request(r)
    for _ in range(3):   # r20's 1000 tokens take steps of the whole budget, past 3
        got = {x.request_id: len(x.token_ids) for x in step(s, now=50.0).seqs}
        assert [got.get(r.request_id) for r in streams] == [1, 1] and got["r20"] == 254


def test_the_cap_corrects_its_model_from_the_steps_it_sizes():
    """Steps whose prefill the cap sized running 1.5x over their prediction shrink the
    next chunk so the step holds in measured time; decode-only steps, which the cap never
    cuts, leave the correction alone however far off they are."""
    model = StepTimeModel(fixed_s=0.010, per_seq_s=0.001, per_token_s=0.001)
    reqs, got, mixed, s = _long_prompt_among_streams(model, 4, 0.080)
    assert mixed.capped and got["r9"] == 61                        # 80 ms predicted
    decodes = SchedulerOutput(seqs=mixed.seqs[:4], predicted_s=0.018)
    for _ in range(20):
        s.observe_step_time(decodes, 0.009)
    assert not decodes.capped and s.step_time_ratio == 1.0
    for _ in range(40):
        s.observe_step_time(mixed, 1.5 * mixed.predicted_s)
    assert s.step_time_ratio == pytest.approx(1.5, abs=1e-3)
    got = {x.request_id: len(x.token_ids) for x in step(s).seqs}
    # 80 / 1.5 = 53.3 ms: 18 ms of decodes, 1 ms for the prompt, 34 tokens
    assert [got[r.request_id] for r in reqs] == [1] * 4 and got["r9"] == 34


def test_flex_is_refused_after_its_wait_limit_and_started_flex_is_not():
    s = make_scheduler(policy="tiered", max_num_seqs=1, flex_max_wait_s=10.0)
    (d,) = make_requests(1, max_tokens=1000, tier=D)
    f1, f2 = make_requests(2, start=1, tier=F, arrival_time=1.0)
    for r in (d, f1, f2):
        s.add_request(r)
    out = s.schedule(now=5.0)
    assert not out.refused_ids
    s.update(out, FakeRunner().execute(out))
    out = s.schedule(now=11.5)
    assert out.refused_ids == ["r1", "r2"]
    assert f1.status == RequestStatus.FINISHED_REFUSED and f1.status.finish_reason == "refused"
    assert s.num_waiting == 0 and "r1" not in s.requests


def test_default_never_starves_under_a_stream_of_priority_arrivals():
    def starved_steps(aging_s):
        s = make_scheduler(policy="tiered", max_num_seqs=2, max_num_batched_tokens=64,
                           default_aging_s=aging_s)
        (d,) = make_requests(1, max_tokens=3, tier=D, arrival_time=0.0)
        s.add_request(d)
        n = 0
        for t in range(60):  # two new priority requests every step keep both slots busy
            for r in make_requests(2, start=100 + 2 * t, max_tokens=3, tier=P,
                                   arrival_time=float(t)):
                s.add_request(r)
            step(s, now=float(t))
            if d.num_computed_tokens == 0:
                n += 1
        return n, d
    n, d = starved_steps(aging_s=5.0)
    assert n <= 7 and d.is_finished
    n, d = starved_steps(aging_s=1e9)  # without aging, it would wait forever
    assert n == 60


def test_preempted_requests_keep_their_order():
    s = make_scheduler(policy="tiered", max_num_seqs=3, max_num_batched_tokens=100)
    defaults = make_requests(3, max_tokens=40, tier=D)
    for r in defaults:
        s.add_request(r)
    step(s)
    for r in make_requests(3, start=10, max_tokens=2, tier=P, arrival_time=10.0):
        s.add_request(r)
    out = step(s, now=10.0)
    assert sorted(out.preempted_ids) == ["r0", "r1", "r2"]
    order = []
    for t in range(40):
        out = step(s, now=11.0 + t)
        order += [x.request_id for x in out.seqs if x.request_id not in order]
    assert [x for x in order if x in ("r0", "r1", "r2")] == ["r0", "r1", "r2"]


def test_reserved_slots_and_blocks_are_left_to_priority():
    s = make_scheduler(policy="tiered", max_num_seqs=4, num_blocks=20,
                       max_num_batched_tokens=200, reserved_priority_seqs=1,
                       reserved_priority_blocks=6)
    for r in make_requests(5, prompt_len=8, max_tokens=30, tier=B):
        s.add_request(r)
    step(s)
    assert len(s.running) == 3  # one slot held back
    for _ in range(20):
        step(s)
        assert s.block_manager.num_free_blocks >= 6 or any(r.tier == P for r in s.running)
    s.add_request(make_requests(1, start=9, prompt_len=20, tier=P, arrival_time=9.0)[0])
    out = step(s)
    assert "r9" in ids(out)
    assert all(s.requests[i].tier == B for i in out.preempted_ids)


def test_wasted_tokens_are_counted_per_tier():
    s = make_scheduler(policy="tiered", max_num_seqs=2, max_num_batched_tokens=100,
                       prefix_caching=False)  # with it, the prompt's blocks would be reused
    for r in make_requests(2, prompt_len=12, max_tokens=20, tier=F):
        s.add_request(r)
    step(s)
    step(s)
    s.add_request(make_requests(1, start=5, tier=P, arrival_time=3.0)[0])
    run_to_completion(s)
    assert s.preemptions_by_tier == {F: 1}
    assert s.recomputed_tokens_by_tier[F] == 13  # 12 prompt + 1 output token again
    assert s.recomputed_tokens_by_tier[P] == 0


def test_higher_tier_cached_blocks_are_evicted_last():
    bm = BlockManager(num_blocks=4, block_size=2, evict_by_tier=True)
    p = Request("p", [1, 2, 3, 4, 5], max_tokens=1, tier=P)
    f = Request("f", [9, 8, 7, 6, 5], max_tokens=1, tier=F)
    for r in (p, f):  # each computes its 2 full blocks, then leaves them cached
        assert bm.allocate_slots(r, 4)
        r.num_computed_tokens = 4
        bm.cache_full_blocks(r)
    bm.free(p)  # priority's blocks were freed first: plain LRU would evict them first
    bm.free(f)
    assert bm.allocate_slots(Request("x", [0] * 4, max_tokens=1, tier=D), 4)
    assert bm.get_computed_blocks(Request("p2", [1, 2, 3, 4, 0], 1))[1] == 4
    assert bm.get_computed_blocks(Request("f2", [9, 8, 7, 6, 0], 1))[1] == 0
    bm.check_invariants()


STEP_SHAPES = ([(1, 100)] * 4, [(1, 300)] * 16, [(64, 64)], [(256, 512)], [(1, 50)],
               [(1, 900)] * 64, [(30, 200), (1, 400)], [(128, 128)] * 2, [(1, 20)] * 32,
               [(16, 16)] * 3 + [(1, 64)] * 2)


def test_step_time_model_fit_recovers_its_coefficients():
    true = StepTimeModel(fixed_s=0.012, per_seq_s=0.0004, per_token_s=0.00011,
                         per_kv_token_s=3e-6, per_pair_s=2e-8, per_chunk_s=0.006)
    steps = [(seqs, true.predict_s(seqs)) for seqs in STEP_SHAPES]
    for relative in (False, True):
        fit = StepTimeModel.fit(steps, relative=relative)
        for name in FEATURES:
            a, b = getattr(fit, name), getattr(true, name)
            assert abs(a - b) <= 1e-6 * max(b, 1e-3), (name, relative)
    assert StepTimeModel.fit(steps, relative=True, chunk_term=False).per_chunk_s == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.8, 2.0), min_size=len(STEP_SHAPES), max_size=len(STEP_SHAPES)))
def test_a_centred_step_time_model_predicts_the_mean_step(noise):
    """A fit in relative error sits below the mean of noisy steps; centred, the measured
    steps take 1.0x its prediction on average (what a simulator replaying predicted steps
    needs), its coefficients in the same proportions; exact steps change nothing."""
    true = StepTimeModel(0.012, 0.0004, 0.00011, 3e-6, 2e-8, 0.006)
    steps = [(seqs, true.predict_s(seqs) * k) for seqs, k in zip(STEP_SHAPES, noise)]
    fit = StepTimeModel.fit(steps, relative=True)
    centred = fit.centred(steps)
    ratios = [d / centred.predict_s(seqs) for seqs, d in steps]
    assert sum(ratios) / len(ratios) == pytest.approx(1.0, rel=1e-9)
    factor = centred.fixed_s / fit.fixed_s
    for name in FEATURES:
        assert getattr(centred, name) == pytest.approx(getattr(fit, name) * factor, rel=1e-9)
    broken = steps + [(STEP_SHAPES[0], 0.0), (STEP_SHAPES[1], float("nan"))]
    assert fit.centred(broken) == centred   # steps that took no time are left out, as in fit
    assert fit.centred([]) == fit
    exact = [(seqs, true.predict_s(seqs)) for seqs in STEP_SHAPES]
    assert StepTimeModel.fit(exact, relative=True).centred(exact).fixed_s == \
        pytest.approx(true.fixed_s, rel=1e-6)


def test_a_step_time_profile_round_trips_and_a_bad_one_is_a_clear_error(tmp_path):
    import pytest
    from tierserve.errors import ConfigError
    model = StepTimeModel(0.03, 0.0003, 0.0003, 2e-6, 1e-7)
    model.save(tmp_path / "m.json", dtype="bfloat16")
    assert StepTimeModel.load(tmp_path / "m.json") == model
    # a profile written before chunks had their own cost loads as the model it was
    data = json.loads((tmp_path / "m.json").read_text())
    del data["step_time_model"]["per_chunk_s"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert StepTimeModel.load(tmp_path / "old.json") == model
    del data["step_time_model"]["per_seq_s"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="per_seq_s"):
        StepTimeModel.load(tmp_path / "old.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="cannot read a step-time profile"):
        StepTimeModel.load(tmp_path / "bad.json")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_no_block_leaks_and_invariants_under_any_tier_interleaving(data):
    model = StepTimeModel(fixed_s=0.01, per_seq_s=0.001, per_token_s=0.0005)
    s = make_scheduler(
        policy=data.draw(st.sampled_from(["tiered", "priority", "fcfs"])),
        num_blocks=data.draw(st.integers(12, 40)), block_size=4,
        max_num_seqs=data.draw(st.integers(2, 6)),
        max_num_batched_tokens=data.draw(st.integers(8, 64)),
        reserved_priority_seqs=data.draw(st.integers(0, 1)),
        reserved_priority_blocks=data.draw(st.integers(0, 4)),
        default_aging_s=data.draw(st.sampled_from([2.0, 1e9])),
        flex_max_wait_s=data.draw(st.sampled_from([3.0, 1e9])),
        step_time_model=model, step_time_limit_s=data.draw(st.sampled_from([None, 0.02])),
        priority_guard_s=data.draw(st.sampled_from([0.0, 3.0])),
        max_model_len=48)
    n = 0
    for t in range(data.draw(st.integers(5, 40))):
        for _ in range(data.draw(st.integers(0, 2))):
            length = data.draw(st.integers(1, 30))
            shared = data.draw(st.booleans())
            prompt = ([7] * 8 if shared else []) + [1000 + 13 * n + j for j in range(length)]
            s.add_request(Request(f"q{n}", prompt[:40], data.draw(st.integers(1, 8)),
                                  arrival_time=float(t), tier=data.draw(st.sampled_from(Tier))))
            n += 1
        if s.requests and data.draw(st.integers(0, 5)) == 0:
            s.finish_request(data.draw(st.sampled_from(sorted(s.requests))),
                             RequestStatus.FINISHED_ABORTED)
        out = s.schedule(now=float(t))
        s.update(out, FakeRunner().execute(out))
        check_scheduler_invariants(s, out)
    run_to_completion(s, max_steps=5000)
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks and s.num_waiting == 0 and not s.running


def test_a_step_starting_priority_carries_no_lower_tier_work_every_other_step_at_most():
    model = StepTimeModel(fixed_s=0.010, per_seq_s=0.001, per_token_s=0.001)
    s = make_scheduler(policy="tiered", max_num_batched_tokens=256, num_blocks=256,
                       step_time_model=model, step_time_limit_s=0.060)
    defaults = make_requests(3, prompt_len=4, max_tokens=50, tier=D)
    for r in defaults:
        s.add_request(r)
    step(s)
    tiers_per_step = []
    for t in range(4):  # a priority arrival before every step
        s.add_request(make_requests(1, start=10 + t, prompt_len=6, tier=P,
                                    arrival_time=float(t))[0])
        out = step(s, now=float(t))
        tiers_per_step.append({s.requests[x.request_id].tier for x in out.seqs
                               if x.request_id in s.requests} | {P})
    assert tiers_per_step[0] == {P} and D in tiers_per_step[1]
    assert tiers_per_step[2] == {P} and D in tiers_per_step[3]


def test_batch_prefill_is_spread_over_steps_and_other_tiers_are_not():
    s = make_scheduler(policy="tiered", max_num_batched_tokens=64, batch_prefill_tokens=8,
                       num_blocks=256)
    batch = make_requests(3, prompt_len=20, max_tokens=2, tier=Tier.BATCH)
    default = make_requests(1, prompt_len=40, max_tokens=2, start=3, tier=Tier.DEFAULT)
    for r in batch + default:
        s.add_request(r)
    steps = run_to_completion(s)
    batch_ids = {r.request_id for r in batch}
    per_step = [sum(max(0, min(x.start_pos + len(x.token_ids), 20) - x.start_pos)
                    for x in out.seqs if x.request_id in batch_ids)  # prompt positions
                for out in steps]
    assert max(per_step) == 8 and sum(per_step) == 60  # every prompt token, 8 at a time
    first = steps[0]
    assert any(x.request_id == default[0].request_id and len(x.token_ids) == 40
               for x in first.seqs)  # the default prompt in one step
    assert all(r.is_finished for r in batch + default)
    unlimited = make_scheduler(policy="tiered", max_num_batched_tokens=64,
                               batch_prefill_tokens=0, num_blocks=256)
    for r in make_requests(3, prompt_len=20, max_tokens=2, tier=Tier.BATCH):
        unlimited.add_request(r)
    assert unlimited.schedule().num_scheduled_tokens == 60
