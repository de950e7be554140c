"""A step-time model: how long one engine step takes, predicted from its shape.

NOTE: the model
    t(step) = fixed + per_seq * seqs + per_token * tokens
              + per_kv_token * (context tokens read by decodes)
              + per_pair * (query-key pairs of prefill chunks)
              + per_chunk * (prefill chunks)

    - fixed: what every step pays whatever it holds (weights streamed once, launch and
      Python overhead);
    - per_seq: sampling, block tables, one attention call per sequence;
    - per_token: the linear layers' work per token computed;
    - per_kv_token: a decode reads its whole context from the KV cache once, one token of
      work per cached token, bound by memory;
    - per_pair: a prefill chunk of n tokens at offset s attends n x (s + n) pairs, by the
      paged kernel query after query over a context already in cache (or, over an int8
      KV cache, in torch's dense matrix products): far cheaper per pair than a decode's
      reads. One feature for both would let the prefills' many cheap pairs hide the
      decodes' cost (measured: a 32-sequence decode step at context 420 predicted 55 ms,
      took 92).
    - per_chunk: what a prefill chunk costs beyond a decode's per_seq: its own tables in
      every layer (and over an int8 KV cache torch's attention, its masks and copies; the
      figures below were measured when every chunk took that path). With one per_seq for
      both, the fit spread a chunk's cost over per_token (0.77 ms against 0.62 fitted
      apart): on a 2-core Zen 4 the whole-step model then predicted steps where a chunk
      meets decodes 13-24% short (docs/benchmarks.md); fitted apart, a chunk costs 5-10
      ms more than a decode's 0-0.4 ms. Zero in a model that does not measure it
      (profiles written before it, roofline models), which is the old model.

    The coefficients are fitted by least squares to measured steps (`fit`), which is what a
    calibration run does on the engine at hand (`tierserve calibrate`). In absolute error
    the few long prefills decide the fit; in relative error (`relative=True`, what a
    calibration fits, engine/calibrate.py) each residual is divided by its step's time,
    so a 25 ms decode step weighs as much as a 300 ms prefill: on a 2-core EPYC the
    absolute fit put small decode steps, which make up TPOT, at half their time. The
    simulator's whole-step model is then `centred` on its steps. No torch here: the
    scheduler uses the model to cap a step's budget, and the simulator predicts with it.
"""

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tierserve.errors import ConfigError

FEATURES = ("fixed_s", "per_seq_s", "per_token_s", "per_kv_token_s", "per_pair_s",
            "per_chunk_s")
OPTIONAL = {"per_chunk_s"}
"""Coefficients a profile file may lack (written before they were measured): zero."""
EPS_S = 1e-12
"""Slack when comparing predicted sums of seconds (float rounding)."""


@dataclass(frozen=True)
class StepTimeModel:
    fixed_s: float
    per_seq_s: float
    per_token_s: float
    per_kv_token_s: float = 0.0
    per_pair_s: float = 0.0
    per_chunk_s: float = 0.0

    def seq_cost_s(self, num_tokens: int, context_len: int) -> float:
        """Time a sequence adds to a step: `num_tokens` new, `context_len` after them."""
        if num_tokens <= 0:
            return 0.0
        cost = self.per_seq_s + self.per_token_s * num_tokens
        if num_tokens == 1:
            return cost + self.per_kv_token_s * context_len
        return cost + self.per_chunk_s + self.per_pair_s * num_tokens * context_len

    @staticmethod
    def features(seqs: list[tuple[int, int]]) -> tuple[int, int, int, int, int]:
        """(seqs, tokens, decode context tokens, prefill pairs, prefill chunks) of a step's
        sequences: the multipliers of FEATURES after `fixed_s`."""
        kv = sum(c for n, c in seqs if n == 1)
        pairs = sum(n * c for n, c in seqs if n > 1)
        chunks = sum(1 for n, _ in seqs if n > 1)
        return len(seqs), sum(n for n, _ in seqs), kv, pairs, chunks

    def predict_s(self, seqs: list[tuple[int, int]]) -> float:
        """Predicted time of a step of (num_tokens, context_len) sequences."""
        return self.fixed_s + sum(self.seq_cost_s(n, c) for n, c in seqs)

    def scaled(self, factor: float) -> "StepTimeModel":
        """Every step `factor` times as long (each coefficient scaled: the model is linear)."""
        return StepTimeModel(*(getattr(self, f) * factor for f in FEATURES))

    def mean_ratio(self, steps: list[tuple[list[tuple[int, int]], float]]) -> float:
        """The mean of each measured step's ([(num_tokens, context_len)...], seconds) time
        over this model's prediction; as `fit`, only steps that took a positive, finite
        time, and only where the prediction is positive (NaN where none is left). What
        `centred` scales by, and how far a run moved from the model (bench/tiers.py)."""
        ratios = [d / q for seqs, d in steps
                  if 0 < d < math.inf and (q := self.predict_s(seqs)) > 0]
        return sum(ratios) / len(ratios) if ratios else math.nan

    def centred(self, steps: list[tuple[list[tuple[int, int]], float]]) -> "StepTimeModel":
        """This model scaled so that measured `steps` ([(num_tokens, context_len)...],
        seconds) take on average 1.0x their prediction: the expected time of a step of
        that shape, which is what a simulator replaying steps at their predicted time
        needs (see the note on the fit in engine/calibrate.py). Unchanged where no step
        has a positive, finite time and a positive prediction."""
        factor = self.mean_ratio(steps)
        return self if math.isnan(factor) else self.scaled(factor)

    def summary(self) -> str:
        """The coefficients in the units a person reads, and a lone decode step."""
        return (f"fixed {self.fixed_s * 1e3:.2f} ms/step, {self.per_seq_s * 1e3:.3f} ms/seq, "
                f"{self.per_chunk_s * 1e3:.3f} ms/prefill chunk, {self.per_token_s * 1e3:.4f} "
                f"ms/token, {self.per_kv_token_s * 1e6:.3f} us/KV token, "
                f"{self.per_pair_s * 1e9:.3f} ns/pair; a lone decode step "
                f"{self.predict_s([(1, 256)]) * 1e3:.1f} ms")

    def max_tokens_within(self, room_s: float, start_pos: int, limit: int) -> int:
        """Most tokens (<= limit) of one sequence at `start_pos` whose cost fits `room_s`."""
        lo, hi = 0, limit
        while lo < hi:  # cost grows with n: binary search
            mid = (lo + hi + 1) // 2
            if self.seq_cost_s(mid, start_pos + mid) <= room_s + EPS_S:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ------------------------------------------------------------ fit, files
    @classmethod
    def fit(cls, steps: list[tuple[list[tuple[int, int]], float]],
            relative: bool = False, chunk_term: bool = True) -> "StepTimeModel":
        """Least squares (in relative error if `relative`) over measured steps, each
        ([(num_tokens, context_len)...], seconds), every coefficient kept >= 0 (a negative
        one is dropped and the rest refitted). `chunk_term=False` leaves per_chunk at 0:
        for a few records of lone prefills, where it and per_token trade off freely."""
        if len(steps) < len(FEATURES):
            raise ConfigError(f"need at least {len(FEATURES)} measured steps to fit a "
                              f"step-time model, got {len(steps)}")
        steps = [(seqs, d) for seqs, d in steps if d > 0]
        weight = [1.0 / d if relative else 1.0 for _, d in steps]
        rows = [tuple(x * w for x in (1.0, *map(float, cls.features(seqs))))
                for (seqs, _), w in zip(steps, weight)]
        ys = [d * w for (_, d), w in zip(steps, weight)]
        active = [j for j, name in enumerate(FEATURES)
                  if chunk_term or name != "per_chunk_s"]
        while True:
            coef = _least_squares([[r[j] for j in active] for r in rows], ys)
            negative = [j for j, c in zip(active, coef) if c < 0]
            if not negative or len(active) == 1:
                break
            active.remove(negative[0])
        values = [0.0] * len(FEATURES)
        for j, c in zip(active, coef):
            values[j] = max(c, 0.0)
        return cls(*values)

    def save(self, path: str | Path, **meta) -> None:
        Path(path).write_text(json.dumps({"step_time_model": asdict(self), **meta}, indent=2)
                              + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> "StepTimeModel":
        """From its coefficients by name (as saved; the optional ones may be missing)."""
        return cls(**{k: float(data[k]) for k in FEATURES if k in data or k not in OPTIONAL})

    @classmethod
    def load(cls, path: str | Path) -> "StepTimeModel":
        try:
            return cls.from_dict(json.loads(Path(path).read_text())["step_time_model"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot read a step-time profile from {path}: {exc}") from None


def load_way_in_s(path: str | Path) -> float:
    """A profile's `way_in_s` (what a request spends outside the steps, measured by
    `tierserve calibrate --backend URL --from-steps`), 0 where it has none; a ConfigError
    naming the field where it is not a number >= 0."""
    try:
        value = json.loads(Path(path).read_text()).get("way_in_s", 0.0)
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"cannot read a step-time profile from {path}: {exc}") from None
    return check_way_in(value, f"{path}: way_in_s")


def check_way_in(value, name: str) -> float:
    """`value` as seconds of the way in, or a ConfigError naming `name` where it is not a
    finite number >= 0 (a profile's field, `sim --way-in-s`, a simulated replica's)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 <= value < math.inf:
        raise ConfigError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Solve the normal equations (X'X) b = X'y by Gaussian elimination with pivoting.
    Columns are scaled first so per-token seconds and per-step seconds are comparable."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    xs = [[r[j] / scale[j] for j in range(k)] for r in rows]
    a = [[sum(x[i] * x[j] for x in xs) for j in range(k)] + [sum(x[i] * y for x, y in zip(xs, ys))]
         for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-12:
            a[col][col] = 1e-12  # a feature that never varies: its coefficient goes to ~0
        for i in range(k):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [u - f * v for u, v in zip(a[i], a[col])]
    return [a[i][k] / a[i][i] / scale[i] for i in range(k)]
