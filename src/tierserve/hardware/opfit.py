"""A GEMM time curve per GPU, fitted to measured operator timings (the Vidur profiles).

NOTE: the curve
    A linear layer on T tokens, [T x K] @ [K x N] on one device, does F = 2 T K N FLOPs and
    moves B = 2 (K N + T K + T N) bytes (bf16). Its time is a smooth maximum of the compute
    and the memory time, plus a fixed cost per kernel:

        compute = F / (peak_flops x eff_flops)      memory = B / (peak_bw x eff_bw)
        t       = launch + (compute^knee + memory^knee)^(1 / knee)

    knee = 1 is the additive roofline (an upper bound); a large knee is the hard max. Four
    numbers per GPU (eff_flops, eff_bw, knee, launch), fitted by Levenberg-Marquardt on the
    log of predicted over measured time of each GEMM. The efficiency curve in token count
    follows: eff(T) = compute / t rises from memory-bound (~T / T_knee x eff_flops) to
    eff_flops past T_knee = peak_flops x eff_flops / (peak_bw x eff_bw) tokens, where the
    weights stop dominating the bytes. The residuals leave no trend in T, TP degree or
    shape for more parameters to take (on the A100 the median residual of every
    (log2 T, TP) bucket is within 9%).

    The profiles (data/profiling/<gpu>/<Model>.mlp.csv, microsoft/vidur, MIT) time
    each operator of a decoder layer for token counts 1..4096 and tensor-parallel degrees
    1..8; the four linear layers are the QKV projection, the output projection, the fused
    gate+up projection and the down projection. Pure Python: no torch, no numpy.
"""

import csv
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from tierserve.errors import ConfigError

OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
"""The profiled operators that are linear layers: QKV, O, gate+up, down."""
DTYPE_BYTES = 2
"""The profiles are bf16."""


@dataclass(frozen=True)
class Gemm:
    """[num_tokens x k] @ [k x n] on one device (k or n already divided by the TP degree)."""

    num_tokens: int
    k: int
    n: int

    @property
    def flops(self) -> float:
        return 2.0 * self.num_tokens * self.k * self.n

    def bytes(self, dtype_bytes: int = DTYPE_BYTES) -> float:
        """Weights, input and output, each moved once."""
        return float(self.k * self.n + self.num_tokens * (self.k + self.n)) * dtype_bytes


@dataclass(frozen=True)
class GemmCurve:
    """The time of a GEMM on one device (see the NOTE at the top)."""

    peak_flops: float
    """Datasheet dense bf16 FLOP/s."""
    peak_bw: float
    """Datasheet memory bandwidth, bytes/s."""
    eff_flops: float
    """Fraction of peak_flops a large GEMM reaches."""
    eff_bw: float
    """Fraction of peak_bw reached streaming the weights."""
    knee: float = 1.0
    """Exponent of the smooth maximum of compute and memory time; 1 adds them."""
    launch_s: float = 0.0
    """Fixed time per kernel."""

    def time_s(self, flops: float, nbytes: float) -> float:
        compute = flops / (self.peak_flops * self.eff_flops)
        memory = nbytes / (self.peak_bw * self.eff_bw)
        p = self.knee
        return self.launch_s + (compute ** p + memory ** p) ** (1.0 / p)

    def gemm_s(self, gemm: Gemm, dtype_bytes: int = DTYPE_BYTES) -> float:
        return self.time_s(gemm.flops, gemm.bytes(dtype_bytes))

    @property
    def knee_tokens(self) -> float:
        """Token count where compute time equals weight-streaming time."""
        return self.peak_flops * self.eff_flops / (self.peak_bw * self.eff_bw)

    def params(self) -> dict:
        """The fitted numbers, as stored in a hardware profile."""
        return {"eff_flops": round(self.eff_flops, 4), "eff_bw": round(self.eff_bw, 4),
                "knee": round(self.knee, 4), "kernel_launch_s": round(self.launch_s, 8)}


@dataclass(frozen=True)
class LayerTiming:
    """One profiled row: a model shape at a TP degree and token count, its four linear
    layers and their measured (median) seconds."""

    model: str
    num_tokens: int
    tp: int
    gemms: tuple[Gemm, ...]
    times_s: tuple[float, ...]

    @property
    def linear_s(self) -> float:
        """The per-layer linear time: the four GEMMs' sum."""
        return sum(self.times_s)


def layer_gemms(num_tokens: int, hidden: int, q_size: int, kv_size: int, intermediate: int,
                gated: bool, tp: int) -> tuple[Gemm, ...]:
    """The four linear layers of a decoder layer on one of `tp` devices: QKV and gate+up
    split their outputs (column parallel), O and down split their inputs (row parallel)."""
    up = intermediate * (2 if gated else 1)
    return (Gemm(num_tokens, hidden, (q_size + 2 * kv_size) // tp),
            Gemm(num_tokens, q_size // tp, hidden),
            Gemm(num_tokens, hidden, up // tp),
            Gemm(num_tokens, intermediate // tp, hidden))


def load_profile_csv(path: str | Path) -> list[LayerTiming]:
    """The rows of one Vidur `<Model>.mlp.csv` (times there are in milliseconds)."""
    path = Path(path)
    model = path.name.removesuffix(".mlp.csv")
    rows = []
    try:
        with path.open(newline="") as f:
            for r in csv.DictReader(f):
                t, tp = int(r["num_tokens"]), int(r["num_tensor_parallel_workers"])
                hidden, heads = int(r["n_embd"]), int(r["n_head"])
                head_dim = hidden // heads
                gemms = layer_gemms(t, hidden, heads * head_dim, int(r["n_kv_head"]) * head_dim,
                                    int(r["n_expanded_embd"]), r["use_gated_mlp"] == "True", tp)
                times = tuple(float(r[f"time_stats.{op}.median"]) * 1e-3 for op in OPS)
                rows.append(LayerTiming(model, t, tp, gemms, times))
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigError(f"cannot read the operator profile {path}: {exc}") from None
    return rows


def load_profiles(root: str | Path) -> dict[str, list[LayerTiming]]:
    """{gpu directory name: rows of every model profiled on it} under `root`."""
    root = Path(root)
    dirs = sorted(d for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
    out = {d.name: [row for p in sorted(d.glob("*.mlp.csv")) for row in load_profile_csv(p)]
           for d in dirs}
    out = {gpu: rows for gpu, rows in out.items() if rows}
    if not out:
        raise ConfigError(f"no operator profiles (<gpu>/<Model>.mlp.csv) under {root}")
    return out


# ------------------------------------------------------------------ the fit
BOUNDS = ((0.02, 2.0), (0.02, 2.0), (1.0, 8.0), (0.0, 1e-3))
"""Box for (eff_flops, eff_bw, knee, launch_s): a knee under 1 would put the time above the
sum of compute and memory time, which no kernel does on purpose."""
START = (0.7, 0.8, 1.5, 5e-6)


def fit_curve(rows: list[LayerTiming], peak_flops: float, peak_bw: float,
              max_iters: int = 50) -> GemmCurve:
    """Levenberg-Marquardt on r = log(predicted / measured) over every GEMM of `rows`,
    parameters kept inside BOUNDS. Parameters are scaled to order 1 for the step."""
    samples = [(g.flops, g.bytes(), math.log(t)) for row in rows
               for g, t in zip(row.gemms, row.times_s) if t > 0]
    if len(samples) < len(START):
        raise ConfigError(f"need at least {len(START)} timed GEMMs to fit a curve, "
                          f"got {len(samples)}")
    scale = (1.0, 1.0, 1.0, 1e-5)

    def residuals(theta):
        curve = GemmCurve(peak_flops, peak_bw, *theta)
        return [math.log(curve.time_s(f, b)) - y for f, b, y in samples]

    theta, lam = list(START), 1e-3
    r = residuals(theta)
    cost = sum(e * e for e in r)
    for _ in range(max_iters):
        jac = []
        for i in range(len(theta)):
            h = 1e-6 * scale[i] if theta[i] + 1e-6 * scale[i] <= BOUNDS[i][1] \
                else -1e-6 * scale[i]
            shifted = theta[:i] + [theta[i] + h] + theta[i + 1:]
            jac.append([(a - b) / h * scale[i] for a, b in zip(residuals(shifted), r)])
        jtj = [[sum(a * b for a, b in zip(ji, jk)) for jk in jac] for ji in jac]
        jtr = [sum(a * b for a, b in zip(ji, r)) for ji in jac]
        improved = False
        while lam < 1e8:
            damped = [[v * (1 + lam) if i == k else v for k, v in enumerate(row)]
                      for i, row in enumerate(jtj)]
            step = _solve(damped, [-v for v in jtr])
            trial = [min(max(t + s * sc, lo), hi)
                     for t, s, sc, (lo, hi) in zip(theta, step, scale, BOUNDS)]
            r_trial = residuals(trial)
            cost_trial = sum(e * e for e in r_trial)
            if cost_trial < cost:
                improved = cost - cost_trial > 1e-10 * cost
                theta, r, cost, lam = trial, r_trial, cost_trial, max(lam / 10, 1e-9)
                break
            lam *= 10
        if not improved:
            break
    return GemmCurve(peak_flops, peak_bw, *theta)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small dense system."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(m[i][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            m[col][col] = 1e-300
        for i in range(col + 1, n):
            f = m[i][col] / m[col][col]
            m[i] = [u - f * v for u, v in zip(m[i], m[col])]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


# ------------------------------------------------------------ the line
def linearize(time_s, max_tokens: int, points: int = 48) -> tuple[float, float]:
    """(a, b) of the line a + b x T closest to `time_s(T)` in relative error over T
    log-spaced in 1..max_tokens. The step-time model is linear in tokens and the curve bends
    at its knee; relative error on a log grid weighs a lone decode and a full prefill alike
    (llama-3-8b on the fitted A100 curve: the line is within 8%, the chord through the two
    ends up to 17% high at the knee)."""
    grid = sorted({round(max_tokens ** (i / (points - 1))) for i in range(points)})
    ys = [time_s(t) for t in grid]
    # minimise sum(((a + b t) / y - 1)^2): linear least squares in (a, b)
    rows = [(1 / y, t / y) for t, y in zip(grid, ys)]
    a, b = _solve([[sum(r[i] * r[j] for r in rows) for j in range(2)] for i in range(2)],
                  [sum(r[i] for r in rows) for i in range(2)])
    return a, max(b, 0.0)


# ------------------------------------------------------------ validation
def layer_errors(curve: GemmCurve, rows: list[LayerTiming]) -> list[float]:
    """Absolute relative error of the predicted per-layer linear time of each row."""
    return [abs(sum(curve.gemm_s(g) for g in row.gemms) / row.linear_s - 1) for row in rows]


def linearized_errors(curve: GemmCurve, rows: list[LayerTiming],
                      max_tokens: int = 4096) -> list[float]:
    """As `layer_errors`, through the line the simulator uses: one `linearize` per model
    shape and TP degree, over 1..max_tokens."""
    lines = {}
    errors = []
    for row in rows:
        key = (row.model, row.tp)
        if key not in lines:
            lines[key] = linearize(lambda t, gemms=row.gemms: sum(
                curve.gemm_s(replace(g, num_tokens=t)) for g in gemms), max_tokens)
        a, b = lines[key]
        errors.append(abs((a + b * row.num_tokens) / row.linear_s - 1))
    return errors


def leave_one_out(rows: list[LayerTiming], peak_flops: float,
                  peak_bw: float) -> dict[str, GemmCurve]:
    """{model: the curve fitted to every other model's rows}."""
    models = sorted({row.model for row in rows})
    if len(models) < 2:
        raise ConfigError("leave-one-out needs at least two model shapes")
    return {m: fit_curve([r for r in rows if r.model != m], peak_flops, peak_bw)
            for m in models}


def median_p90(errors: list[float]) -> tuple[float, float]:
    return statistics.median(errors), statistics.quantiles(errors, n=10, method="inclusive")[8]
