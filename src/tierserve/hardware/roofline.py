"""Step-time models for the simulator: a calibrated profile, or a roofline from datasheets.

NOTE: the roofline
    A step streams the weights once, reads each decode's KV cache, and does the linear
    layers' FLOPs per token plus 4 x layers x hidden FLOPs per query-key pair. Each linear
    layer's time follows the GPU's GEMM curve (hardware/opfit.py: a smooth maximum of compute
    and memory time plus a launch cost, fitted to measured operator timings), which bends
    at a knee of a few hundred tokens. The scheduler and cost meter need the linear form
    of a StepTimeModel, so the layers' curve is replaced by the line closest to it in
    relative error over 1..REF_TOKENS tokens (within 8% for llama-3-8b on an A100):

        fixed      = line's intercept (weights streamed once, launches) + LM-head weights
                     + per-step overhead
        per_seq    = LM head on the sequence's last token + per-sequence overhead
        per_token  = line's slope
        per_kv     = KV bytes per token / (tp x bw x eff_bw)
        per_pair   = 4 x layers x hidden / (tp x flops x eff_flops)

    Profiles fitted to operator timings (a100-80gb, h100-sxm) carry eff_flops, eff_bw,
    knee and kernel_launch_s from the fit; a profile with datasheet numbers only gets the
    default efficiencies, knee 1 (the additive roofline, compute + memory, an upper bound)
    and no launch cost. Attention's other kernels, norms and communication are not
    modelled beyond per_kv, per_pair and the overheads. No torch here.
"""

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tierserve.core.step_time import StepTimeModel
from tierserve.errors import ConfigError
from tierserve.hardware.opfit import Gemm, GemmCurve, layer_gemms, linearize

PROFILE_DIR = Path(__file__).parent / "profiles"
REF_TOKENS = 2048
"""The line replacing the GEMM curve is fitted over 1..REF_TOKENS tokens a step (the
simulator's default max_num_batched_tokens)."""


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_tflops: float
    """Dense bf16 tensor FLOP rate, datasheet, TFLOP/s."""
    mem_bw_tbs: float
    """Memory bandwidth, datasheet, TB/s."""
    mem_gb: float
    eff_flops: float = 0.6
    """Fraction of bf16_tflops a large GEMM reaches (fitted, or a datasheet default)."""
    eff_bw: float = 0.8
    """Fraction of mem_bw_tbs reached streaming weights and KV (fitted, or a default)."""
    knee: float = 1.0
    """GEMM time = (compute^knee + memory^knee)^(1/knee): 1 adds them (the default)."""
    kernel_launch_s: float = 0.0
    """Fixed time per GEMM kernel (fitted)."""
    step_overhead_s: float = 0.002
    """Scheduling, launch and sampling per step (CUDA graphs would lower it)."""
    seq_overhead_s: float = 0.00002
    fitted_from: str = ""
    """Where the efficiencies come from (operator profiles, another GPU's fit), if fitted."""
    note: str = ""
    price_per_hour: float | None = None
    """USD per hour of one device (a user's file; the shipped profiles are priced in
    metering/prices.py)."""

    def gemm_curve(self) -> GemmCurve:
        return GemmCurve(self.bf16_tflops * 1e12, self.mem_bw_tbs * 1e12, self.eff_flops,
                         self.eff_bw, self.knee, self.kernel_launch_s)


REQUIRED = ("name", "bf16_tflops", "mem_bw_tbs", "mem_gb")
FRACTIONS = ("eff_flops", "eff_bw")
"""In (0, 1]."""


def load_hardware(name: str) -> Hardware:
    """A shipped profile by name, or a profile file a user wrote (a path ending in .json,
    `--hardware-file`); its fields are the `Hardware` dataclass's, checked here."""
    if name.endswith(".json") or os.sep in name:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"hardware file {name}: no such file")
    else:
        path = PROFILE_DIR / f"{name}.json"
        if not path.exists():
            known = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
            raise ConfigError(f"unknown hardware {name!r}; profiles: {', '.join(known)} (or "
                              "--hardware-file FILE.json: docs/hardware.md)")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    return Hardware(**validate_profile(data, str(path)))


def validate_profile(data, where: str) -> dict:
    """The profile's fields, or a ConfigError naming the first bad one."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object of hardware fields")
    known = {f.name for f in fields(Hardware)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{where}: unknown field {sorted(unknown)[0]!r} (fields: "
                          f"{', '.join(sorted(known))})")
    for key in REQUIRED:
        if key not in data:
            raise ConfigError(f"{where}: missing field {key!r} (required: "
                              f"{', '.join(REQUIRED)})")
    if not isinstance(data["name"], str) or not data["name"]:
        raise ConfigError(f"{where}: field 'name' must be a non-empty string")
    for key, value in data.items():
        if key in ("name", "fitted_from", "note"):
            continue
        if value is None and key == "price_per_hour":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise ConfigError(f"{where}: field {key!r} must be a number, got {value!r}")
        positive = key in REQUIRED or key in FRACTIONS or key == "knee"
        if (positive and value <= 0) or value < 0:
            raise ConfigError(f"{where}: field {key!r} must be "
                              f"{'> 0' if positive else '>= 0'}, got {value!r}")
        if key in FRACTIONS and value > 1:
            raise ConfigError(f"{where}: field {key!r} is a fraction of the datasheet "
                              f"figure, in (0, 1], got {value!r}")
    return data


def roofline(shape, hw: Hardware, dtype_bytes: int = 2, tp: int = 1,
             kv_cache_dtype: str = "auto") -> StepTimeModel:
    """The roofline of `shape` (model.shapes.ModelShape) on `hw`, tensor parallel over `tp`
    devices (weights and KV split evenly; communication not modelled); `kv_cache_dtype`
    int8: a decode reads its KV cache at one byte a value (shapes.kv_bytes_per_token)."""
    curve = hw.gemm_curve()

    def layers_s(num_tokens: int) -> float:
        gemms = layer_gemms(num_tokens, shape.hidden_size, shape.q_size, shape.kv_size,
                            shape.intermediate_size, True, tp)
        return shape.num_layers * sum(curve.gemm_s(g, dtype_bytes) for g in gemms)

    intercept, slope = linearize(layers_s, REF_TOKENS)
    lm_head = Gemm(1, shape.hidden_size, shape.vocab_size // tp)  # the last token of each seq
    lm_head_flops_s = lm_head.flops / (curve.peak_flops * curve.eff_flops)
    flops = curve.peak_flops * curve.eff_flops * tp
    bw = curve.peak_bw * curve.eff_bw * tp
    return StepTimeModel(
        fixed_s=intercept + curve.gemm_s(lm_head, dtype_bytes) - lm_head_flops_s
        + hw.step_overhead_s,
        per_seq_s=lm_head_flops_s + hw.seq_overhead_s,
        per_token_s=slope,
        per_kv_token_s=shape.kv_bytes_per_token(dtype_bytes, kv_cache_dtype) / bw,
        per_pair_s=4 * shape.num_layers * shape.hidden_size / flops)


def describe(model: StepTimeModel) -> dict:
    return asdict(model)
