"""The simulator's GEMM curve against measured GPU operator timings (issue 6).

    python benchmarks/sim_profiling.py [--data data/profiling] [--write]

Per GPU directory under --data (a100 -> a100-80gb, h100 -> h100-sxm; another directory is
taken as a profile name): fit the curve of hardware/opfit.py to every model shape but one,
predict the held-out shape's per-layer linear time (QKV + O + gate/up + down) at all its
token counts (1..4096) and TP degrees, and repeat for each shape. Prints one line: per GPU,
the median and p90 absolute percentage error over the held-out rows (LOO), the same for
rows of at most 128 tokens (decode-sized steps), the line the simulator uses in place of
the curve (LOO), and the in-sample error of one fit to all shapes. Deterministic: no
sampling. --write stores the all-shapes fit in the hardware profile JSONs.
"""

import argparse
import json
import sys
from pathlib import Path

from tierserve.hardware.opfit import (fit_curve, layer_errors, leave_one_out, linearized_errors,
                                 load_profiles, median_p90)
from tierserve.hardware.roofline import PROFILE_DIR, load_hardware

DATA = Path(__file__).resolve().parents[1] / "data" / "profiling"
PROFILE_OF = {"a100": "a100-80gb", "h100": "h100-sxm"}
"""Vidur's GPU directory names -> our hardware profiles."""
DECODE_TOKENS = 128


def figures(rows, peak_flops, peak_bw) -> tuple[dict, object]:
    fitted = fit_curve(rows, peak_flops, peak_bw)
    in_sample = {"in_sample": median_p90(layer_errors(fitted, rows))}
    if len({r.model for r in rows}) < 2:
        return in_sample, fitted  # nothing to hold out
    curves = leave_one_out(rows, peak_flops, peak_bw)
    held_out = [(curves[r.model], r) for r in rows]
    loo = [e for c, r in held_out for e in layer_errors(c, [r])]
    small = [e for (c, r), e in zip(held_out, loo) if r.num_tokens <= DECODE_TOKENS]
    line = [e for m, c in curves.items()
            for e in linearized_errors(c, [r for r in rows if r.model == m])]
    return {"loo": median_p90(loo), "loo_t<=128": median_p90(small),
            "loo_line": median_p90(line), **in_sample}, fitted


def write_profile(name: str, curve, data_dir: Path, models: list[str]) -> None:
    path = PROFILE_DIR / f"{name}.json"
    profile = json.loads(path.read_text())
    if "fitted_from" not in profile:
        profile.pop("note", None)  # a datasheet-only profile's note no longer applies
    profile.update(curve.params())
    profile["fitted_from"] = (f"operator profiles {data_dir.name}/ ({', '.join(models)}), "
                              "benchmarks/sim_profiling.py --write")
    path.write_text(json.dumps(profile, indent=1) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DATA, help=f"default {DATA}")
    p.add_argument("--write", action="store_true",
                   help="store each GPU's all-shapes fit in its hardware profile JSON")
    args = p.parse_args(argv)
    parts = []
    for gpu, rows in load_profiles(args.data).items():
        hw = load_hardware(PROFILE_OF.get(gpu, gpu))
        models = sorted({r.model for r in rows})
        figs, fitted = figures(rows, hw.bf16_tflops * 1e12, hw.mem_bw_tbs * 1e12)
        cells = " ".join(f"{k} {m:.1%}/{p90:.1%}" for k, (m, p90) in figs.items())
        params = " ".join(f"{k}={v:g}" for k, v in fitted.params().items())
        parts.append(f"{gpu} ({hw.name}, {len(models)} shapes, {len(rows)} rows): {cells} | "
                     f"fit {params} knee_tokens={fitted.knee_tokens:.0f}")
        if args.write:
            write_profile(hw.name, fitted, args.data / gpu, models)
    print(f"sim_profiling data={args.data} metric=per-layer linear time APE median/p90, "
          f"leave-one-shape-out per GPU, tokens 1..4096 | " + " | ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
