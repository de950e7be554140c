"""The cost meter (no torch): hand-computed cases and invariants over random steps."""

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.core.step_time import StepTimeModel
from tierserve.metering.cost import CostMeter

MODEL = StepTimeModel(fixed_s=0.030, per_seq_s=0.0002, per_token_s=0.0003,
                      per_kv_token_s=2e-6, per_pair_s=1e-7)
PRICE = 3.6  # $/hour = $0.001 per second


@dataclass
class Seq:
    request_id: str
    num_tokens: int
    context_len: int
    is_decode: bool


@dataclass
class Step:
    start_time: float
    duration_s: float
    seqs: list = field(default_factory=list)


@dataclass
class Finished:
    request_id: str
    cost: object = None


def finish(meter, rid):
    f = Finished(rid)
    return meter.on_request_finished(f).cost


def test_one_request_alone_pays_the_whole_step():
    m = CostMeter(PRICE, MODEL)
    m.on_step(Step(0.0, 0.5, [Seq("a", 100, 100, False)]))
    m.on_step(Step(0.5, 0.1, [Seq("a", 1, 101, True)]))
    c = finish(m, "a")
    assert c.prefill_cost == pytest.approx(0.0005) and c.decode_cost == pytest.approx(0.0001)
    assert m.idle_cost == 0 and c.mean_batch_size == 1


def test_two_equal_requests_share_a_step_equally():
    m = CostMeter(PRICE, MODEL)
    m.on_step(Step(0.0, 0.2, [Seq("a", 1, 50, True), Seq("b", 1, 50, True)]))
    a, b = finish(m, "a"), finish(m, "b")
    assert a.decode_cost == pytest.approx(0.0001) == b.decode_cost
    assert a.mean_batch_size == 2


def test_idle_gap_is_split_between_reserved_fast_lane_and_idle():
    m = CostMeter(PRICE, MODEL, reserved_fraction=0.25, idle_interval_s=5.0)
    m.on_step(Step(0.0, 1.0, [Seq("a", 10, 10, False)]))
    m.on_step(Step(9.0, 1.0, [Seq("a", 1, 11, True)]))  # 8 s idle
    m.close_window(12.0)                                 # 2 s more
    assert m.reserved_idle_cost == pytest.approx(10 * 0.001 * 0.25)
    assert m.idle_cost == pytest.approx(10 * 0.001 * 0.75)
    intervals = m.take_idle(flush=True)
    assert [(i.start, i.end) for i in intervals] == [(1.0, 9.0), (10.0, 12.0)]
    assert sum(i.cost + i.reserved_cost for i in intervals) == pytest.approx(0.010)
    assert m.machine_cost == pytest.approx(0.012)


steps_strategy = st.lists(
    st.tuples(st.floats(0.0, 2.0), st.floats(0.001, 1.0),
              st.lists(st.tuples(st.integers(0, 5), st.integers(1, 300), st.integers(0, 2000)),
                       min_size=1, max_size=8, unique_by=lambda x: x[0])),
    min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(steps_strategy, st.floats(0.0, 1.0))
def test_shares_are_non_negative_and_everything_adds_up(steps, reserved):
    m = CostMeter(PRICE, MODEL, reserved_fraction=reserved, idle_interval_s=1.0)
    t, ids = 0.0, set()
    for gap, dur, seqs in steps:
        t += gap
        m.on_step(Step(t, dur, [Seq(f"r{i}", n, n + ctx, n == 1) for i, n, ctx in seqs]))
        t += dur
        ids |= {f"r{i}" for i, _, _ in seqs}
    m.close_window(t + 1.0)
    costs = [finish(m, rid) for rid in ids]
    assert all(c.prefill_cost >= 0 and c.decode_cost >= 0 for c in costs)
    total = sum(c.machine_cost for c in costs) + m.idle_cost + m.reserved_idle_cost
    assert total == pytest.approx(m.machine_cost, rel=1e-9)
    window = (t + 1.0) * PRICE / 3600  # the meter's window starts at the first step
    first = steps[0][0]
    assert m.machine_cost == pytest.approx(window - first * PRICE / 3600, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 2000)), min_size=1,
                max_size=8), st.integers(1, 300), st.integers(1, 200))
def test_more_tokens_never_cost_less_and_batching_is_cheaper_per_token(others, mine, extra):
    m = CostMeter(PRICE, MODEL)
    seqs = [("me", mine, mine + 10, False)] + [(f"o{i}", n, n + c, n == 1)
                                              for i, (n, c) in enumerate(others)]
    more = [("me", mine + extra, mine + extra + 10, False)] + seqs[1:]
    dur = 0.1
    assert m.shares(dur, more)[0] >= m.shares(dur, seqs)[0]
    # the same request alone or in the batch, each step lasting what the model predicts
    alone = MODEL.predict_s([(mine, mine + 10)])
    batch = MODEL.predict_s([(n, c) for _, n, c, _ in seqs])
    assert m.shares(batch, seqs)[0] <= m.shares(alone, seqs[:1])[0] + 1e-15
