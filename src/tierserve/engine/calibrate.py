"""Calibration: fit the step-time model to steps measured on this engine.

NOTE: the grid
    A few batches that together vary every feature of the model independently: lone
    prefills of rising length (per token, per chunk, with one sequence), decode batches
    of rising size at a short and at a long context (per sequence, per KV token read);
    the prefills of the batches add steps where chunks meet decodes. A warm-up batch
    (allocator and kernel warm-up) is not measured. 24-32 s on a 2-core Zen 4 for the
    135M model (bf16 or gguf; 20-28 s before more decode sizes were added). Nothing of it
    stays behind: the prefix cache is emptied and the counters and stat sinks the engine
    had are restored.

NOTE: what is timed
    By default the runner's time (forward pass and sampling), which the engine's step-time
    cap was tuned with (the cap learns the measured/predicted ratio of whole steps on top).
    `whole_step=True` times `engine.step()` whole (scheduling, forward, sampling, update,
    outputs): what the simulator needs, since its steps take exactly the predicted time.
    On this machine the runner's time alone leaves 2-5 ms of every step out. The engine's
    cap stays on the runner's model: with whole-step models its default cap (3x a lone
    decode step) grows by that overhead, and in a side-by-side run of the tiers benchmark
    (3 req/s) priority attainment fell from 1.00 to 0.75.

NOTE: the fit
    In relative error, so a 5 ms decode step counts as much as a 300 ms prefill. Fitted in
    absolute error, the large steps decided every coefficient and the fixed part took what
    was left: three calibrations of the same 4-bit engine in a row predicted a lone decode
    step at 5.4, 9.7 and 14.2 ms (measured: 5.5-6.2), and both caps are multiples of that
    prediction. In relative error the same samples gave 5.5, 6.0 and 5.8 ms, for a median
    error on the large steps of 5-7% instead of 4-6%.

    A fit in relative error puts a step's prediction below its expected time: it
    minimises the squares of (1 - predicted / measured), where a slow step's large
    measured time shrinks its residual, so the occasional slow step (this machine's steps
    are right-skewed) pulls the fit up less than it pulls the mean. On a 2-core Zen 3 the
    grid's own steps took 1.01-1.05x their prediction on average. A simulator replays
    each step at its predicted time, so the whole-step model (`whole_step=True`) is
    `centred`: scaled so that the grid's steps take 1.0x their prediction on average
    (docs/benchmarks.md). The runner's model, which the engine's step cap reads, is left
    as the cap was tuned with it (the cap learns the measured ratio on top).
"""

import dataclasses
import hashlib
import json
import os
import platform
import random
from pathlib import Path

from tierserve.core.stats import StatsCollector
from tierserve.core.step_time import StepTimeModel
from tierserve.model.generation import request_sampling
from tierserve.sampling_params import SamplingParams
from tierserve.tiers import Tier


def calibration_batches(max_num_seqs: int, max_len: int, wide: bool = False
                        ) -> list[tuple[int, int, int]]:
    """(num_requests, prompt_len, full_steps) per batch, clipped to the engine's limits:
    `full_steps` steps decode all `num_requests` together after the last prompt is in (the
    first ones decode beside the later prompts' chunks before that); 0: a lone prefill.
    `wide`: the lean step runs steps over DENSE_ROWS rows on other weights (its AMX
    copies), so the short context also decodes WIDE_DECODE_BATCH sequences at once."""
    short, long = min(32, max_len - 64), min(384, max_len - 64)
    batches = [(1, min(n, max_len - 2), 0) for n in (32, 128, 384)]  # lone prefills
    short_sizes = DECODE_BATCHES + ((WIDE_DECODE_BATCH,) if wide else ())
    for ctx, sizes in ((short, short_sizes), (long, LONG_DECODE_BATCHES)):
        for b in sorted({min(b, max_num_seqs) for b in sizes}):  # decodes: size x context
            batches.append((b, ctx, SMALL_DECODE_STEPS if b <= 4 else DECODE_STEPS))
    return batches


DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
WIDE_DECODE_BATCH = 64
"""Where the lean step's AMX copies take steps over 32 rows (model/cpu_step.py), decodes of
33 or more sequences cost less per sequence than the grid's 32 and below: measured, not
extrapolated (a 64-sequence decode step 53.6 ms on the kernels, 41.5 on the copies)."""
LONG_DECODE_BATCHES = (1, 4, 8, 32)
"""At the long context each batch's prompts cost seconds to prefill (16 x 384 tokens:
about 5 s on a 2-core Zen 4), so fewer sizes there; the KV term is set by its ends."""
DECODE_STEPS = 8
"""Full-size decode steps of each batch. Under load most of an engine's steps are decodes
of 1-16 sequences (70% of them at 0.5 req/s in benchmarks/sim_accuracy.py).

Counted, not implied: until the twenty-seventh session each batch asked for a number of
tokens (prompt tokens over the step budget, plus these steps), but the decode cap lets
prefill chunks in more slowly than the budget would, so the first requests finished
before the last prompt was in. On a 2-core Zen 4 the grid held no full decode step at the
long context above 6 sequences (3 at 32 sequences, short context, instead of 8): the
KV-token term rested on batches of 1-4, two calibrations in a row fitted it at 0.34 and
1.1 us, and decodes of 5-16 sequences at 300-600 tokens ran 1.15-1.22x their prediction
(docs/benchmarks.md)."""
SMALL_DECODE_STEPS = 24
"""For batches of 1-4: with 8 steps each the grid held 22 lone decode steps of 221
(2% of its time) and the relative fit put them 7% short on a 2-core Zen 5, while lone
decodes are 25-45% of the engine's time at 0.5-1 req/s (benchmarks/sim_accuracy.py).
16 more steps at each of 5 such cells cost about 1 s."""


def calibrate(engine, repeats: int = 1, seed: int = 0, whole_step: bool = False,
              steps: list | None = None) -> StepTimeModel:
    """Run the calibration grid on `engine`, which must be idle; return the fitted model
    (of the runner's time, or of whole steps, centred: see the notes). `steps`, if given, gets the
    measured steps the model is fitted to, each ([(num_tokens, context_len)...], seconds)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("calibrate needs an idle engine")
    rng = random.Random(seed)
    collector = StatsCollector()
    core = engine.core
    acc = core.accounting
    sinks, metering = acc.sinks, acc.metering  # calibration runs are nobody's cost
    acc.sinks, acc.metering = [collector], None
    counters = (engine.scheduler.num_preemptions, engine.scheduler.num_recomputed_tokens)
    vocab = engine.shape.vocab_size
    # sampled as a request that sets no sampling field is (the model's defaults): the
    # sampler is part of a step, 4-15% of a 16-row decode step at temperature 1 or
    # SmolLM2's 0.2 / 0.9 on a 2-core Zen 5 (benchmarks/sample_kernel.py)
    params = SamplingParams(ignore_eos=True, **request_sampling(engine.generation_defaults))
    samples = []
    try:
        _run_batch(engine, 2, 64, 2, rng, vocab, params, collector, [], False)  # warm-up
        for _ in range(repeats):
            for num, prompt_len, full_steps in calibration_batches(
                    engine.scheduler.max_seqs(Tier.DEFAULT), engine.max_model_len,
                    wide=_dense_copies(engine)):
                _run_batch(engine, num, prompt_len, full_steps, rng, vocab, params,
                           collector, samples, whole_step)
    finally:
        acc.sinks, acc.metering = sinks, metering
        engine.scheduler.num_preemptions, engine.scheduler.num_recomputed_tokens = counters
        engine.block_manager.reset_prefix_cache()
    if steps is not None:
        steps.extend(samples)
    model = StepTimeModel.fit(samples, relative=True)  # see the note on the fit
    return model.centred(samples) if whole_step else model


def _run_batch(engine, num: int, prompt_len: int, full_steps: int, rng, vocab: int,
               params: SamplingParams, collector: StatsCollector, samples: list,
               whole_step: bool) -> None:
    """Run one batch (see calibration_batches); append (step's sequences, seconds) per
    step. The requests may decode to the end of the context their tier allows; once
    `full_steps` steps have decoded all of them together, the rest are aborted. A batch
    that cannot come together (a KV pool too small for it, a context so short that its
    first requests end before its last prompt is in) stops at a bound on its steps with
    fewer full-size steps: the fit then has fewer of that size, and nothing fails."""
    ids = []
    for _ in range(num):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]  # no prefix hits
        ids.append(engine.add_request(None, prompt, dataclasses.replace(
            params, max_tokens=None if full_steps else 1)))
    full, bound = 0, full_steps + num * prompt_len // 16 + 64
    while engine.has_unfinished_requests() and bound > 0 and (not full_steps
                                                             or full < full_steps):
        count, bound = len(samples), bound - 1
        timed_step(engine, collector, samples, whole_step)
        if len(samples) > count and len(samples[-1][0]) == num and all(
                n == 1 and c > prompt_len for n, c in samples[-1][0]):
            full += 1  # a prompt's last chunk cut to one token (context == prompt_len)
            # by the decode cap is not a decode: counted, it left a batch one step short
    for request_id in ids:
        engine.abort_request(request_id)  # those still decoding


def timed_step(engine, collector: StatsCollector, samples: list, whole_step: bool) -> None:
    """One `engine.step()` (`collector` one of its sinks); a step it ran appends
    ([(num_tokens, context_len)...], seconds) to `samples`: the whole `engine.step()`,
    or the runner's time alone (see the note on what is timed)."""
    count, begin = len(collector.steps), engine.clock.now()
    engine.step()
    if len(collector.steps) > count:
        st = collector.steps[-1]
        samples.append(([(s.num_tokens, s.context_len) for s in st.seqs],
                        engine.clock.now() - begin if whole_step else st.duration_s))


# ------------------------------------------------------------------ the cache
def cache_path(engine) -> Path:
    """Where this engine's calibration is kept: one file per machine and configuration.

    NOTE: why a cache. Calibrating takes 10-20 s of every start; the fit depends only on
    the machine, the software and the engine's shape, so the key holds all three (CPU
    model, threads, torch, the kernels' source, the model file, dtype, quantization,
    device, the KV cache's dtype, block and batch limits, the policy's reserves).
    `tierserve calibrate` still measures afresh, and deleting the file (or
    TIERSERVE_CACHE_DIR pointing elsewhere) forces a new fit."""
    import torch

    from tierserve.model import kernels

    mc, cc, sc = engine.config.model, engine.config.cache, engine.config.scheduler
    source = engine.loaded.source
    try:
        size = os.path.getsize(source)
    except (OSError, TypeError):
        size = None
    key = json.dumps([
        cpu_model(), torch.get_num_threads(), torch.__version__, platform.machine(),
        hashlib.sha256(kernels.source().encode()).hexdigest()[:16],
        engine.runner.lean is not None, kernels.load() is not None,
        _dense_copies(engine),
        str(source), size, mc.dtype, mc.quantization, mc.device, mc.load_format,
        cc.block_size, cc.kv_cache_dtype, sc.max_num_seqs, sc.max_num_batched_tokens, engine.max_model_len,
        sc.policy, sc.reserved_priority_seqs, sc.reserved_priority_blocks,
        CACHE_VERSION])
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    root = Path(os.environ.get("TIERSERVE_CACHE_DIR") or Path.home() / ".cache" / "tierserve")
    return root / "calibration" / f"{name}.json"


CACHE_VERSION = 10
"""Bump when the grid, the fit or what the kernels are asked to do changes (3: prefill
chunks on the paged kernel; 4: back on torch's attention; 5: a prefill chunk's own cost
and more decode steps; 6: sampled as a default request, more small decode steps; 7: float32
weights packed by oneDNN on an AVX2-only CPU; 8: full decode steps counted; 9: prefill
chunks on the paged kernel again; 10: AMX copies for wide steps, and 64-sequence decodes
in the grid where they are on): older files are then not read."""


def _dense_copies(engine) -> bool:
    """Whether the engine's lean step holds AMX copies for wide steps (model/cpu_step.py)."""
    return bool(engine.runner.lean is not None and engine.runner.lean.dense_bytes)


def calibrate_cached(engine, say) -> StepTimeModel:
    """The cached fit for this machine and configuration, or a new one (then saved)."""
    path = cache_path(engine)
    if path.exists():
        try:
            model = StepTimeModel.load(path)
            say(f"step-time model from {path} (measured here earlier; delete it to re-measure)")
            return model
        except Exception:  # unreadable or from an older layout: measure again
            pass
    say("calibrating the step-time model (once per machine and configuration; cached)")
    model = calibrate(engine)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        model.save(tmp, source=str(engine.loaded.source), dtype=engine.config.model.dtype,
                   quantization=engine.config.model.quantization)
        os.replace(tmp, path)          # atomic: two servers starting at once both read whole
    except OSError as exc:             # a read-only home: calibrate each time, say why
        say(f"could not cache the step-time model ({exc})")
    return model


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
