"""The GEMM curve fitted to GPU operator profiles, and the roofline built on it."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tierserve.errors import ConfigError
from tierserve.model.shapes import preset
import tierserve.hardware.roofline as hardware_roofline
from tierserve.hardware.opfit import (GemmCurve, LayerTiming, fit_curve, layer_errors, layer_gemms,
                                 leave_one_out, linearize, load_profiles, median_p90)
from tierserve.hardware.roofline import load_hardware, roofline

DATA = Path(__file__).resolve().parents[1] / "data" / "profiling"
A100 = (312e12, 2.039e12)


@pytest.fixture(scope="module")
def profiles():
    return load_profiles(DATA)


def synthetic_rows(curve: GemmCurve) -> list[LayerTiming]:
    """Rows timed by `curve` itself, over three shapes, two TP degrees, 1..4096 tokens."""
    rows = []
    for model, (hidden, inter) in {"s": (2048, 5632), "m": (4096, 11008),
                                   "l": (8192, 28672)}.items():
        for tp in (1, 4):
            for t in (1, 4, 16, 64, 128, 256, 512, 1024, 4096):
                gemms = layer_gemms(t, hidden, hidden, hidden // 8, inter, True, tp)
                rows.append(LayerTiming(model, t, tp, gemms,
                                        tuple(curve.gemm_s(g) for g in gemms)))
    return rows


def test_loader_reads_the_vidur_profiles(profiles):
    assert len({r.model for r in profiles["a100"]}) == 6
    assert len({r.model for r in profiles["h100"]}) == 2
    row = next(r for r in profiles["a100"]
               if r.model == "Llama-2-7b-hf" and r.tp == 1 and r.num_tokens == 1)
    qkv, o, up, down = row.gemms
    assert (qkv.k, qkv.n, o.k, up.n, down.k) == (4096, 3 * 4096, 4096, 2 * 11008, 11008)
    assert 20e-6 < row.times_s[0] < 200e-6  # 0.065 ms in the file: read as milliseconds


def test_the_fit_recovers_the_parameters_that_made_the_data():
    truth = GemmCurve(*A100, eff_flops=0.72, eff_bw=0.83, knee=1.8, launch_s=7e-6)
    fitted = fit_curve(synthetic_rows(truth), *A100)
    assert fitted.eff_flops == pytest.approx(truth.eff_flops, rel=0.01)
    assert fitted.eff_bw == pytest.approx(truth.eff_bw, rel=0.01)
    assert fitted.knee == pytest.approx(truth.knee, rel=0.02)
    assert fitted.launch_s == pytest.approx(truth.launch_s, rel=0.05)
    assert median_p90(layer_errors(fitted, synthetic_rows(truth)))[1] < 1e-3


def test_leave_one_shape_out_error_on_the_measured_profiles(profiles):
    """Measured (benchmarks/sim_profiling.py): median 3.4% on the A100, 4.2% on the H100;
    p90 10-12%."""
    for gpu, peaks in {"a100": A100, "h100": (989e12, 3.35e12)}.items():
        rows = profiles[gpu]
        curves = leave_one_out(rows, *peaks)
        errors = [e for m, c in curves.items()
                  for e in layer_errors(c, [r for r in rows if r.model == m])]
        median, p90 = median_p90(errors)
        assert median < 0.07 and p90 < 0.2, (gpu, median, p90)


def test_linearize_is_exact_on_a_line_and_close_on_the_curve():
    a, b = linearize(lambda t: 0.004 + 2e-5 * t, 2048)
    assert (a, b) == (pytest.approx(0.004), pytest.approx(2e-5))
    curve = load_hardware("a100-80gb").gemm_curve()
    gemms = layer_gemms(1, 4096, 4096, 1024, 14336, True, 1)

    def layer_s(t):
        return sum(curve.gemm_s(replace(g, num_tokens=t)) for g in gemms)
    a, b = linearize(layer_s, 2048)
    assert all(abs((a + b * t) / layer_s(t) - 1) < 0.1 for t in (1, 16, 128, 512, 2048))


def test_profiles_load_and_say_where_their_numbers_come_from():
    names = sorted(p.stem for p in hardware_roofline.PROFILE_DIR.glob("*.json"))
    assert {"a100-80gb", "h100-sxm", "h200", "l40s", "l4"} <= set(names)
    hws = {n: load_hardware(n) for n in names}
    assert all(hws[n].fitted_from for n in ("a100-80gb", "h100-sxm", "h200"))
    assert hws["l4"].knee == 1.0 and hws["l4"].note
    h100, h200 = hws["h100-sxm"], hws["h200"]
    assert (h200.eff_flops, h200.eff_bw, h200.knee) == (h100.eff_flops, h100.eff_bw, h100.knee)


def test_the_roofline_ranks_the_gpus():
    shape = preset("llama-3-8b")
    model = {n: roofline(shape, load_hardware(n)) for n in ("l4", "a100-80gb", "h100-sxm")}
    assert model["l4"].per_token_s > model["a100-80gb"].per_token_s > model["h100-sxm"].per_token_s
    assert model["l4"].fixed_s > model["a100-80gb"].fixed_s > model["h100-sxm"].fixed_s
    tp2 = roofline(shape, load_hardware("h100-sxm"), tp=2)
    assert tp2.per_token_s < model["h100-sxm"].per_token_s


def test_a_datasheet_only_profile_is_the_additive_roofline(tmp_path, monkeypatch):
    (tmp_path / "mygpu.json").write_text(json.dumps(
        {"name": "mygpu", "bf16_tflops": 100, "mem_bw_tbs": 1.0, "mem_gb": 40}))
    (tmp_path / "typo.json").write_text(json.dumps(
        {"name": "typo", "bf16_tflops": 100, "mem_bw_tbs": 1.0, "mem_gb": 40, "kne": 2}))
    monkeypatch.setattr(hardware_roofline, "PROFILE_DIR", tmp_path)
    hw = load_hardware("mygpu")
    assert (hw.eff_flops, hw.eff_bw, hw.knee, hw.kernel_launch_s) == (0.6, 0.8, 1.0, 0.0)
    shape = preset("llama-3-8b")
    model = roofline(shape, hw)
    gemms = layer_gemms(1, shape.hidden_size, shape.q_size, shape.kv_size,
                        shape.intermediate_size, True, 1)
    weights = shape.num_layers * sum(g.k * g.n for g in gemms)
    activations = shape.num_layers * sum(g.k + g.n for g in gemms)
    # additive, so exactly linear in tokens: bf16 bytes at 0.8 x 1 TB/s, FLOPs at 0.6 x 100 TF
    h, v = shape.hidden_size, shape.vocab_size  # the LM head: weights, one token in and out
    assert model.fixed_s == pytest.approx(2 * (weights + h * v + h + v) / 0.8e12 + 0.002,
                                          rel=1e-6)
    assert model.per_token_s == pytest.approx(2 * weights / 60e12 + 2 * activations / 0.8e12,
                                              rel=1e-6)
    with pytest.raises(ConfigError, match="unknown field.*kne"):
        load_hardware("typo")
