"""Step-time models for the simulator: a calibrated profile, or a roofline from datasheets.

NOTE: the additive roofline
    A step streams the weights once, reads each decode's KV cache, and does 2 x params
    FLOPs per token plus 4 x layers x hidden FLOPs per query-key pair. Written as a sum
    of those terms over measured-or-datasheet bandwidth and FLOP rate (each scaled by an
    efficiency), it is a StepTimeModel, the same linear form the scheduler's step-time cap
    and the cost meter already use:

        fixed      = weight bytes / (bw x eff_bw) + per-step overhead
        per_token  = 2 x params / (tp x flops x eff_flops)
        per_kv     = KV bytes per token / (tp x bw x eff_bw)
        per_pair   = 4 x layers x hidden / (tp x flops x eff_flops)

    The sum is an upper bound of the usual max(compute, memory) form; they differ most
    where a step is balanced between the two (about 20% for an 8B model at batch 64 on an
    H100) and little at either end. The efficiencies here are datasheet defaults, not yet
    fitted to the operator profiles in ../shared/data/profiling.
    No torch here.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tierserve.core.step_time import StepTimeModel
from tierserve.errors import ConfigError

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_tflops: float
    """Dense bf16 tensor FLOP rate, datasheet, TFLOP/s."""
    mem_bw_tbs: float
    """Memory bandwidth, datasheet, TB/s."""
    mem_gb: float
    eff_flops: float = 0.6
    eff_bw: float = 0.8
    step_overhead_s: float = 0.002
    """Scheduling, launch and sampling per step (CUDA graphs would lower it)."""
    seq_overhead_s: float = 0.00002


def load_hardware(name: str) -> Hardware:
    path = PROFILE_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
        raise ConfigError(f"unknown hardware {name!r}; profiles: {', '.join(known)} (add a "
                          f"JSON file to {PROFILE_DIR})")
    return Hardware(**json.loads(path.read_text()))


def roofline(shape, hw: Hardware, dtype_bytes: int = 2, tp: int = 1) -> StepTimeModel:
    """The additive roofline of `shape` (model.shapes.ModelShape) on `hw`, tensor parallel
    over `tp` devices (weights and KV split evenly; communication not modelled)."""
    flops = hw.bf16_tflops * 1e12 * hw.eff_flops * tp
    bw = hw.mem_bw_tbs * 1e12 * hw.eff_bw * tp
    return StepTimeModel(
        fixed_s=shape.num_params * dtype_bytes / bw + hw.step_overhead_s,
        per_seq_s=hw.seq_overhead_s,
        per_token_s=2 * shape.num_params / flops,
        per_kv_token_s=shape.kv_bytes_per_token(dtype_bytes) / bw,
        per_pair_s=4 * shape.num_layers * shape.hidden_size / flops)


def describe(model: StepTimeModel) -> dict:
    return asdict(model)
