"""The per-step overhead fitted to published vLLM sweeps (benchmarks/sim_published.py): it
lives in the hardware profile and enters the roofline's fixed time, once per step."""

from dataclasses import replace

from tierserve.model.metadata import resolve
from tierserve.sim.step_time import load_hardware, roofline


def test_profiles_carry_the_fitted_step_overhead():
    assert load_hardware("a100-80gb").step_overhead_s == 0.0028
    assert load_hardware("h100-sxm").step_overhead_s == 0.0021
    assert "published_vllm_sweeps" in load_hardware("a100-80gb").note


def test_step_overhead_adds_to_fixed_time_only():
    shape, hw = resolve("llama-3-8b"), load_hardware("a100-80gb")
    base = roofline(shape, replace(hw, step_overhead_s=0.0))
    more = roofline(shape, replace(hw, step_overhead_s=0.003))
    assert abs((more.fixed_s - base.fixed_s) - 0.003) < 1e-12
    assert (more.per_seq_s, more.per_token_s, more.per_kv_token_s) == \
        (base.per_seq_s, base.per_token_s, base.per_kv_token_s)
    # a decode step of 32 sequences at context 1000 pays it once, not per sequence
    step = [(1, 1000)] * 32
    assert abs(more.predict_s(step) - base.predict_s(step) - 0.003) < 1e-12
